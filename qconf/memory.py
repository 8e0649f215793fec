"""``memory_report(opt)``: optimizer-state bytes per state per parameter, totals, fp32 equivalent,
and the training bytes per parameter (parameters + gradients + states); ``saved_bytes(module, x)``:
the bytes autograd keeps for backward (activations vs parameters).

Training bytes: the parameters' own bytes, their gradients' (one per parameter, in its dtype; with
gradient release only the largest one, since each is freed as soon as its parameter stepped:
docs/memory.md) and the states. Activations and workspace are not in it (``qconf bench --memory``
measures a whole training step).

Bytes come from the state tensors where they exist (a ``QTensor``'s packed codes + scales, or an
fp32 tensor's storage) and from the plan before the first step; both agree. ``step`` counters are
not counted. The fp32 equivalent is what torch.optim keeps: one fp32 tensor of the parameter's
shape per optimizer state (two for Adam/AdamW, even when the second moment is factored).

With sharded (FSDP2 / DTensor) parameters the rows are this rank's: local shapes, the bytes this
rank holds (its codes, the scales its elements use) and its fp32 equivalent; ``whole_model`` sums
numel, bytes and fp32 bytes over the ranks (one all-reduce, so every rank must call it).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ._table import format_table
from .codec import QTensor
from .config.plan import describe_codec
from .optim.sharded import shard_geometry


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """One parameter: ``states`` maps state key -> bytes, ``formats`` state key -> description."""

    name: str
    shape: tuple[int, ...]
    states: dict[str, int]
    formats: dict[str, str]
    fp32_bytes: int
    param_bytes: int = 0  #: the parameter itself (this rank's shard when sharded)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def total_bytes(self) -> int:
        return sum(self.states.values())


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-parameter rows plus totals; ``str()`` renders a table."""

    rows: tuple[MemoryRow, ...]
    #: (numel, total_bytes, fp32_bytes) summed over the ranks when parameters are sharded, else None
    whole_model: tuple[int, int, int] | None = None
    #: the optimizer frees each gradient in backward (gradient_release=True): one gradient at a time
    gradient_release: bool = False

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.rows)

    @property
    def fp32_bytes(self) -> int:
        return sum(r.fp32_bytes for r in self.rows)

    @property
    def bytes_per_param(self) -> float:
        return self.total_bytes / max(self.numel, 1)

    @property
    def param_bytes(self) -> int:
        return sum(r.param_bytes for r in self.rows)

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes held at the step: every parameter's, or with gradient release the largest one."""
        sizes = [r.param_bytes for r in self.rows]  # a gradient has its parameter's shape and dtype
        return (max(sizes, default=0) if self.gradient_release else sum(sizes))

    @property
    def train_bytes(self) -> int:
        """Parameters + gradients + optimizer states (no activations)."""
        return self.param_bytes + self.grad_bytes + self.total_bytes

    @property
    def train_bytes_per_param(self) -> float:
        return self.train_bytes / max(self.numel, 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": [{"name": r.name, "shape": list(r.shape), "numel": r.numel, "states": dict(r.states),
                        "formats": dict(r.formats), "total_bytes": r.total_bytes, "fp32_bytes": r.fp32_bytes}
                       for r in self.rows],
            "numel": self.numel,
            "total_bytes": self.total_bytes,
            "fp32_bytes": self.fp32_bytes,
            "bytes_per_param": self.bytes_per_param,
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "train_bytes": self.train_bytes,
            "train_bytes_per_param": self.train_bytes_per_param,
            "gradient_release": self.gradient_release,
            "whole_model": None if self.whole_model is None else dict(
                zip(("numel", "total_bytes", "fp32_bytes"), self.whole_model)),
        }

    def __str__(self) -> str:
        keys = list(dict.fromkeys(k for r in self.rows for k in r.states))
        header = ["param", "shape"] + [f"{k} (B)" for k in keys] + ["total (B)", "fp32 (B)", "B/param"]
        body = []
        for r in self.rows:
            cells = [f"{r.states[k]} [{r.formats[k]}]" if k in r.states else "-" for k in keys]
            body.append([r.name, "x".join(map(str, r.shape)) or "()", *cells, r.total_bytes, r.fp32_bytes,
                         f"{r.total_bytes / max(r.numel, 1):.3f}"])
        body.append(["total", str(self.numel), *[""] * len(keys), self.total_bytes, self.fp32_bytes,
                     f"{self.bytes_per_param:.3f}"])
        saved = 1 - self.total_bytes / self.fp32_bytes if self.fp32_bytes else 0.0
        text = format_table(header, body) + f"\nstate memory {self.total_bytes / 2**20:.2f} MiB vs fp32 " \
            f"{self.fp32_bytes / 2**20:.2f} MiB ({saved:.1%} saved)"
        if self.whole_model is not None:
            numel, total, fp32 = self.whole_model
            text += (f" on this rank; whole model {total / 2**20:.2f} MiB vs fp32 {fp32 / 2**20:.2f} MiB "
                     f"({numel} params)")
        grads = "the largest gradient: gradient release" if self.gradient_release else "one per parameter"
        text += (f"\ntraining memory (params + grads + states): {self.param_bytes / 2**20:.2f} + "
                 f"{self.grad_bytes / 2**20:.2f} ({grads}) + {self.total_bytes / 2**20:.2f} = "
                 f"{self.train_bytes / 2**20:.2f} MiB, {self.train_bytes_per_param:.2f} B/param")
        return text


def _nbytes(value: Any) -> int:
    if isinstance(value, QTensor):
        return value.nbytes
    return value.numel() * value.element_size()


def memory_report(opt: Any) -> MemoryReport:
    """Report the state memory of a qconf optimizer (see module docstring)."""
    rows = []
    index = 0
    sharded = None
    for group in opt.param_groups:
        for p in group["params"]:
            rows.append(_row(opt, index, p, group))
            geo = shard_geometry(p)
            sharded = sharded or (geo.group if geo is not None else None)
            index += 1
    report = MemoryReport(tuple(rows), gradient_release=bool(getattr(opt, "gradient_release", False)))
    if sharded is None:
        return report
    sums = torch.tensor([report.numel, report.total_bytes, report.fp32_bytes], dtype=torch.float64)
    torch.distributed.all_reduce(sums, group=sharded)
    return dataclasses.replace(report, whole_model=tuple(int(v) for v in sums.tolist()))


def _row(opt: Any, index: int, p: torch.Tensor, group: dict[str, Any]) -> MemoryRow:
    """Parameter ``index``'s states: their bytes (held, or planned) and formats."""
    state = opt.state.get(p, {})
    states, formats = {}, {}
    geo = shard_geometry(p)
    shape = tuple(p.shape) if geo is None else geo.local_shape
    for spec, codec in opt.planned_states(index):
        value = state.get(spec.key)
        if value is not None:
            states[spec.key] = _nbytes(value)
            codec = value.codec if isinstance(value, QTensor) else None
        else:
            held = spec.shape if geo is None else geo.state_shape(codec)
            states[spec.key] = (codec.nbytes(held) if codec is not None
                                else torch.empty((), dtype=spec.dtype).element_size() * math.prod(held))
        formats[spec.key] = (str(spec.dtype).removeprefix("torch.") if codec is None
                             else describe_codec(codec, spec.shape))
    fp32 = 4 * math.prod(shape) * opt.fp32_state_count(group)
    return MemoryRow(opt.param_name(index) or f"param{index}", shape, states, formats, fp32,
                     param_bytes=math.prod(shape) * p.element_size())


def saved_bytes(module: torch.nn.Module, *inputs: Any) -> tuple[int, int]:
    """Bytes autograd keeps for backward during one ``module(*inputs)`` (counted with
    ``torch.autograd.graph.saved_tensors_hooks``): ``(total, activations)``, where ``activations``
    leaves out tensors that share storage with the module's parameters (a saved Parameter costs
    no extra memory). Runs the forward once; returns ints."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    total = act = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total, act
        size = t.numel() * t.element_size()
        total += size
        act += 0 if t.untyped_storage().data_ptr() in params else size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return total, act
