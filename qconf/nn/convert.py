"""``quantize_``: turn the ``nn.Linear`` modules a qconfig's ``bitnet`` section selects into
:class:`~qconf.nn.BitLinear`, in place. The architecture is otherwise unchanged (no norm is
added or removed: that is :mod:`qconf.nn.surgery`, an explicit step of its own).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..config import BitNetConfig, QConfig, load_config
from ..errors import Problem, QConfigError
from .bitlinear import BitLinear
from .select import module_names, replace_module, select_modules

__all__ = ["quantize_", "bitnet_config"]


def bitnet_config(config: Any) -> tuple[BitNetConfig, str]:
    """The :class:`BitNetConfig` of ``config`` and where it came from (a file, or ``<config>``):
    ``config`` is a BitNetConfig, or anything :func:`~qconf.config.load_config` takes (QConfig,
    dict, path, built-in name)."""
    if isinstance(config, BitNetConfig):
        return config, "<BitNetConfig>"
    cfg = config if isinstance(config, QConfig) else load_config(config)
    return cfg.bitnet, cfg.source or "<config>"


def _refuse(module: nn.Module) -> str | None:
    if isinstance(module, BitLinear):
        return "is already a BitLinear (quantize_ converts a module once)"
    return None


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def quantize_(model: nn.Module, config: Any) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` that ``config``'s ``bitnet`` section selects by a
    :class:`BitLinear` holding the same ``weight``/``bias`` Parameter objects (so state-dict keys
    stay, and an optimizer built before keeps working), buffers, hooks and training flag.

    Args:
        model: any ``nn.Module``; its submodules are matched by qualified name
            (``model.named_modules()``, all names of a module registered twice).
        config: a :class:`~qconf.config.QConfig`, dict, path or built-in name (its ``bitnet``
            section), or a :class:`~qconf.config.BitNetConfig`.

    Returns:
        The qualified names of the converted modules, in ``named_modules`` order.

    Only modules whose type is exactly ``nn.Linear`` are converted: a subclass (e.g.
    ``MultiheadAttention.out_proj``, whose weight the attention reads directly) matched by a
    wildcard is left alone with a warning, and named explicitly is an error.

    Raises:
        QConfigError: ``bitnet.enable`` is false, or the config is invalid.
        ValueError: listing every problem -- a selected module is already a BitLinear, a pattern
            without wildcards names a module that is missing, excluded or not an ``nn.Linear``, a
            pattern selects no ``nn.Linear``. On any error the model is left unchanged.
    """
    bitnet, source = bitnet_config(config)
    if not bitnet.enable:
        raise QConfigError(Problem(source, "bitnet.enable", False, "true", "BitNet is not enabled: quantize_ "
                                   "converts modules only with bitnet: {enable: true}"))
    selected = select_modules(model, bitnet.modules, bitnet.exclude, wanted=_plain_linear, kind="nn.Linear",
                              refuse=_refuse, where="bitnet.modules", where_exclude="bitnet.exclude")
    skipped = [f"{e.name} ({type(e.module).__name__})" for e in module_names(model).values()
               if isinstance(e.module, nn.Linear) and not _plain_linear(e.module) and bitnet.selects(e.name)]
    if skipped:
        warnings.warn("qconf.nn.quantize_ leaves subclasses of nn.Linear as they are (their forward may not be "
                      "nn.Linear's): " + ", ".join(skipped), stacklevel=2)
    dtype = None if bitnet.latent_dtype == "keep" else getattr(torch, bitnet.latent_dtype)
    for entry in selected:
        layer = BitLinear.from_linear(entry.module, bitnet)
        if dtype is not None:  # in place: the Parameter objects (and an optimizer's references) stay
            for p in (layer.weight, layer.bias):
                if p is not None and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        replace_module(model, entry.names, layer)
    return [e.name for e in selected]
