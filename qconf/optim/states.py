"""State values: creating, re-expressing and expanding the tensors an optimizer keeps.

A state value is a plain tensor (fp32, or the parameter's dtype for the Kahan buffer) or a
:class:`~qconf.codec.QTensor`. These functions are shared by the optimizer base (state creation,
``override_quantize_enable``) and the checkpoint code (conversion on load, export).
"""
from __future__ import annotations

from typing import Any

import torch

from ..codec import Codec, QTensor
from .spec import StateSpec

__all__ = ["zero_state", "convert_state", "factored_dense"]


def zero_state(spec: StateSpec, codec: Codec | None, device: torch.device) -> torch.Tensor | QTensor:
    """An all-zero state of ``spec``'s shape: encoded under ``codec`` (without an fp32 temporary),
    or a ``spec.dtype`` tensor when ``codec`` is None."""
    if codec is None:
        return torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    return QTensor.zeros(spec.shape, codec, device)


def convert_state(value: Any, codec: Codec | None, dtype: torch.dtype = torch.float32) -> Any:
    """Re-express one state value (tensor or QTensor) under ``codec`` (None = a ``dtype`` tensor);
    a QTensor already under ``codec`` is returned as is."""
    if isinstance(value, QTensor):
        if value.codec == codec:
            return value
        value = value.decode()
    if codec is None:
        return value.to(dtype)
    return codec.encode(value)


def factored_dense(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """The dense second moment ``(r / mean(r))[..., None] * c[..., None, :]`` of a factored state
    (row statistics ``shape[:-1]``, column statistics ``shape[:-2] + shape[-1:]``); an all-zero
    row block gives 0 rather than 0/0."""
    mean = row.mean(dim=-1, keepdim=True)
    r = torch.where(mean > 0, row / mean, torch.zeros_like(row))
    return r.unsqueeze(-1) * col.unsqueeze(-2)
