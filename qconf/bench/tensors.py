"""The benchmark's tensors and state bytes: the fixed parameters and gradients of a run, each
contender's own copy of them, and the bytes an optimizer holds in its state.

State bytes/param count the tensors the optimizer actually holds after warm-up (``step`` counters
excluded; qconf: :func:`qconf.memory_report`).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from ..codec import QTensor
from ..memory import memory_report
from .roster import Contender


def make_base(shapes: Sequence[tuple[int, ...]], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 parameters (N(0, 0.02^2)) and gradients (N(0, 1)), fixed for the run by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    return params, grads


def copy_for(base: tuple[list[torch.Tensor], list[torch.Tensor]], dtype: torch.dtype,
             device: torch.device | None = None, grads: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """A contender's own parameters (leaf tensors in ``dtype`` on ``device``, default the CPU) with
    their own gradient copies, or with ``grads`` (shared between contenders: :func:`shared_grads`)."""
    out = []
    for i, (p0, g0) in enumerate(zip(*base)):
        p = p0.to(device=device, dtype=dtype, copy=True).requires_grad_(True)
        p.grad = grads[i] if grads is not None else g0.to(device=device, dtype=dtype, copy=True)
        out.append(p)
    return out


def shared_grads(base: tuple[list[torch.Tensor], list[torch.Tensor]], dtypes: Iterable[torch.dtype],
                 device: torch.device) -> dict[torch.dtype, list[torch.Tensor]]:
    """One set of gradients per dtype on ``device``, shared by every contender of that dtype (on a
    GPU, one copy per contender would not fit beside the states at 537M parameters)."""
    return {dtype: [g0.to(device=device, dtype=dtype, copy=True) for g0 in base[1]] for dtype in dict.fromkeys(dtypes)}


def _tensor_storages(t: Any) -> list[torch.Tensor]:
    """Plain tensors behind ``t``: a wrapper subclass (torchao's OptimState*) is flattened."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in _tensor_storages(getattr(t, n))]
    return [t]


def state_bytes(opt: Any) -> int:
    """Bytes of the tensors held in ``opt.state`` (step counters excluded, shared storages once)."""
    seen: set[int] = set()
    total = 0
    for state in opt.state.values():
        for key, value in state.items():
            if key == "step":
                continue
            if isinstance(value, QTensor):
                total += value.nbytes
                continue
            if not isinstance(value, torch.Tensor):
                continue
            for t in _tensor_storages(value):
                storage = t.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def state_bytes_per_param(c: Contender, opt: Any, numel: int) -> float:
    """State bytes per parameter of ``c``'s optimizer ``opt`` over ``numel`` parameters."""
    if c.family == "qconf":
        return memory_report(opt).bytes_per_param
    return state_bytes(opt) / numel
