"""The native-extension probe: the lowest layer of qconf.

Imports the compiled extension ``qconf._C`` if it was built (its import registers the
``torch.ops.qconf.*`` operators with torch.library) and says what it offers. Everything else
reaches the extension through here; the package works without it on the reference path.

``layout()`` is the one description of the kernels' argument layout (columns of the ``meta``
table, positions of the ``hyper`` values and state tensors, codec fields, enum values). It is
defined in C++ (``csrc/include/qconf/layout.h``) and read from the extension, so Python never
spells a column number of its own.
"""
from __future__ import annotations

import functools
import types
from typing import Mapping

import torch

try:  # the extension is optional: absent on a pure-Python install
    from . import _C  # type: ignore[attr-defined]  # noqa: F401
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the build
    _C = None
    _IMPORT_ERROR = str(e)

__all__ = ["native_available", "native_error", "fused_available", "has_cuda_kernels", "cuda_kernels", "layout",
           "row_kernels"]


def native_available() -> bool:
    """True when the compiled extension ``qconf._C`` is importable."""
    return _C is not None


def fused_available() -> bool:
    """True when the fused optimizer-step kernels can run (extension built with them)."""
    return _C is not None and hasattr(torch.ops.qconf, "fused_step")


def native_error() -> str:
    """Why the extension (or its fused kernels) is unavailable; ``''`` when it is available."""
    if _C is None:
        return _IMPORT_ERROR or "qconf._C not found"
    if not fused_available():
        return "this build of qconf._C has no fused optimizer kernels"
    return ""


def has_cuda_kernels() -> bool:
    """True when this build registered CUDA implementations of the fused step."""
    return _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key("qconf::fused_step", "CUDA")


def cuda_kernels() -> str:
    """Which kernels the CUDA step runs: ``"generic"`` (the default, the kernel a GPU has verified)
    or ``"specialized"`` (one kernel per spec, compiled ahead of time or at first use; opt-in with
    ``QCONF_CUDA_KERNELS=specialized``: docs/kernels.md). Read from the environment at every call,
    as the step reads it. RuntimeError for another value of the variable, or without the extension."""
    if _C is None:
        raise RuntimeError(f"the CUDA kernel choice needs the extension qconf._C ({native_error()})")
    return torch.ops.qconf.cuda_kernels()


@functools.cache
def layout() -> Mapping[str, int]:
    """The kernels' argument layout, e.g. ``layout()["meta.index"]`` (read-only; see
    ``csrc/include/qconf/layout.h`` for every key). Raises RuntimeError without the extension."""
    if _C is None:
        raise RuntimeError(f"the native layout needs the extension qconf._C ({native_error()})")
    return types.MappingProxyType(dict(torch.ops.qconf.layout()))


def row_kernels(*tensors: torch.Tensor) -> bool:
    """True when the integer codec's row passes (``torch.ops.qconf.absmax_rows``, ``round_levels``,
    ``divide_levels``; csrc/cpu/integer_codec.cpp) should run on ``tensors``: the extension has
    them, every tensor is a 2-D CPU tensor (a Parameter too) that autograd does not track here
    (grad mode off, or no grad required), and torch.compile is not tracing (it fuses the reference
    ops itself)."""
    grad = torch.is_grad_enabled()
    return (_C is not None and hasattr(torch.ops.qconf, "round_levels") and not torch.compiler.is_compiling()
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dim() == 2 and t.device.type == "cpu"
                    and not (grad and t.requires_grad) for t in tensors))
