"""Native (fused) kernels: the ``qconf._C`` extension and its torch.library ops.

``native_available()`` says whether the extension imported; the package works without it on the
reference path.
"""
from __future__ import annotations

try:  # the extension is optional: absent on a pure-Python install
    from .. import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the build
    _C = None
    _IMPORT_ERROR = str(e)


if _C is not None:
    from .step import FusedStepper, unfusable_reason  # noqa: F401  (registers the fake impls)


def native_available() -> bool:
    """True when the compiled extension ``qconf._C`` is importable."""
    return _C is not None


def native_error() -> str:
    """Why the extension is unavailable ('' when it is available)."""
    if _C is None:
        return _IMPORT_ERROR or "qconf._C not found"
    if not fused_available():
        return "this build of qconf._C has no fused optimizer kernels"
    return ""


def fused_available() -> bool:
    """True when the fused optimizer-step kernels can run (extension built with them)."""
    import torch

    return _C is not None and hasattr(torch.ops.qconf, "fused_step")
