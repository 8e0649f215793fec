"""Model surgery for the BitNet b1.58 recipe, each an explicit step apart from the conversion
(:func:`qconf.nn.quantize_` never changes the architecture):

* :func:`insert_rmsnorm_` puts an ``nn.RMSNorm`` before each selected linear layer (BitNet's
  extra normalization of every quantized Linear's input);
* :func:`remove_norms_` replaces selected normalization modules by ``nn.Identity`` (the block's
  pre-norms, which the inserted norms take over).

Both change the module tree and the state-dict keys (see each function), so run them before the
optimizer is built and before loading a checkpoint written after them. Modules are selected like
``bitnet.modules`` (:mod:`qconf.nn.select`); on any error the model is left unchanged.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .bitlinear import BitLinear
from .select import as_patterns, replace_module, select_modules

__all__ = ["insert_rmsnorm_", "remove_norms_", "is_norm", "RMSNORM_EPS"]

#: The default eps of the inserted RMSNorms: BitNet b1.58 2B4T's ``rms_norm_eps``.
RMSNORM_EPS = 1e-5

_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._BatchNorm,
                nn.modules.instancenorm._InstanceNorm)


def is_norm(module: nn.Module) -> bool:
    """Whether :func:`remove_norms_` treats ``module`` as a normalization layer: one of torch's
    (LayerNorm, RMSNorm, GroupNorm, BatchNorm*, InstanceNorm*, LocalResponseNorm) or a class
    whose name ends in ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``, ...)."""
    return isinstance(module, _TORCH_NORMS) or type(module).__name__.endswith("Norm")


def _linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear or isinstance(module, BitLinear)


def _has_inserted_norm(model: nn.Module, name: str, module: nn.Module) -> bool:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    return (isinstance(parent, nn.Sequential) and child == "1" and len(parent) == 2
            and isinstance(parent[0], nn.RMSNorm) and parent[1] is module)


def insert_rmsnorm_(model: nn.Module, modules: str | Sequence[str] = "*", exclude: str | Sequence[str] = (), *,
                    eps: float | None = RMSNORM_EPS) -> list[str]:
    """Insert ``nn.RMSNorm(in_features, eps=eps, elementwise_affine=True)`` before each selected
    linear layer (``nn.Linear`` or :class:`BitLinear`): the module ``m`` registered as ``name``
    becomes ``nn.Sequential(RMSNorm, m)``, so ``name.weight`` is now ``name.1.weight`` and the
    norm's weight (ones, in ``m.weight``'s dtype and device) is ``name.0.weight``.

    Args:
        model: the model, changed in place.
        modules: glob(s) or ``re:`` regex(es) on qualified module names (default every linear).
        exclude: patterns of modules to leave alone (e.g. ``"lm_head"``).
        eps: the norms' eps (default :data:`RMSNORM_EPS` = 1e-5; ``None``: torch's default,
            ``finfo(input dtype).eps``).

    Returns:
        The qualified names (before the change) of the linear layers that got a norm.

    Raises:
        ValueError: (every problem listed) a pattern selects no linear layer, names a module that
            is missing or not linear, or selects a layer that already has an inserted RMSNorm.
    """
    mods, excl = as_patterns(modules, "modules"), as_patterns(exclude, "exclude")
    selected = select_modules(model, mods, excl, wanted=_linear, kind="nn.Linear or BitLinear")
    twice = [n for e in selected for n in e.names if _has_inserted_norm(model, n, e.module)]
    if twice:
        raise ValueError("already preceded by an inserted RMSNorm (insert_rmsnorm_ inserts one per layer): "
                         + ", ".join(twice))
    for e in selected:
        w = e.module.weight
        norm = nn.RMSNorm(e.module.in_features, eps=eps, elementwise_affine=True, device=w.device, dtype=w.dtype)
        replace_module(model, e.names, nn.Sequential(norm, e.module))
    return [e.name for e in selected]


def remove_norms_(model: nn.Module, modules: str | Sequence[str], exclude: str | Sequence[str] = ()) -> list[str]:
    """Replace each selected normalization module (:func:`is_norm`) by ``nn.Identity()``; their
    parameters and buffers leave the model and its state dict.

    Args:
        model: the model, changed in place.
        modules: glob(s) or ``re:`` regex(es) on qualified module names, e.g. ``"*.input_layernorm"``.
        exclude: patterns of modules to keep.

    Returns:
        The qualified names of the removed norms.

    Raises:
        ValueError: (every problem listed) a pattern selects no norm, or names a module that is
            missing or not a norm.
    """
    mods, excl = as_patterns(modules, "modules"), as_patterns(exclude, "exclude")
    selected = select_modules(model, mods, excl, wanted=is_norm, kind="normalization")
    for e in selected:
        replace_module(model, e.names, nn.Identity())
    return [e.name for e in selected]
