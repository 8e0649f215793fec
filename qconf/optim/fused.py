"""The fused optimizer step: one native kernel call per param group.

The optimizer base describes each parameter of a group as a :class:`FusedParam` -- its index (the
random stream of stochastic rounding), its tensors, and each state's value in its kernel
:class:`~qconf.optim.spec.Slot` -- and the group's hyperparameters as a
:class:`~qconf.optim.spec.Hyper`. This module lays them out as the kernels read them
(:func:`qconf._native.layout`: the int64 ``meta`` table, the flat ``states`` list, the ``hyper``
values) with the codecs' tables and descriptors from :mod:`qconf.codec.native`.

Per param group the arguments are collected once into a C++ ``StepPlan`` (:class:`GroupPlan`);
an eager step then passes only the hyperparameters (the plan reads each parameter's ``.grad``), so
the cost per parameter stays small even with thousands of small tensors. Under ``torch.compile``
the functional op ``qconf::fused_step`` (fake implementation in :mod:`qconf.ops`) is called
instead, with every tensor as an argument. The optimizer says when a cached plan is stale by the
key it passes to :meth:`FusedStepper.step`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Hashable, Mapping, Sequence

import torch

from .. import ops  # noqa: F401  (registers the fake impls that torch.compile needs)
from .._native import has_cuda_kernels, layout
from ..codec import Codec, QTensor
from ..codec.native import TABLE_ROWS, TABLE_SIZE, codec_descriptor, codec_table
from .spec import Hyper, Slot

__all__ = ["FUSED_DTYPES", "FusedParam", "GroupPlan", "FusedStepper", "unfusable_reason", "hyper_values"]

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EMPTY = torch.empty(0)


def unfusable_reason(p: torch.Tensor) -> str | None:
    """Why parameter ``p`` cannot take the fused step (None if it can)."""
    if p.dtype not in FUSED_DTYPES:
        return f"dtype {p.dtype} (fused kernels take float32, bfloat16, float16)"
    if p.device.type == "cuda" and not has_cuda_kernels():
        return f"device {p.device} (this build of qconf has no CUDA kernels; rebuild with nvcc and a CUDA torch)"
    if p.device.type not in ("cpu", "cuda"):
        return f"device {p.device} (fused kernels run on CPU and CUDA)"
    if p.dim() > layout()["max_dims"]:
        return f"{p.dim()} dimensions (at most {layout()['max_dims']})"
    if not p.is_contiguous():
        return "a non-contiguous parameter"
    return None


@dataclasses.dataclass(frozen=True)
class FusedParam:
    """One parameter of a fused step, as the optimizer hands it over.

    Attributes:
        index: the parameter's index in the optimizer (``state_dict`` order): its random streams.
        param: the parameter (fp32/bf16/fp16, contiguous); its ``.grad`` is read at each step.
        step: its step counter (a one-element fp32 CPU tensor; the kernel increments it).
        states: each state's value (tensor or QTensor) by kernel slot; ``ROW``/``COL`` present
            means a factored second moment, ``COMPENSATION`` a Kahan buffer.
        stochastic_weights: a bf16/fp16 parameter receives its update by stochastic rounding.
        first: a lazily created state (SGD's momentum buffer) starts at this step.
    """

    index: int
    param: torch.Tensor
    step: torch.Tensor
    states: Mapping[Slot, torch.Tensor | QTensor]
    stochastic_weights: bool = False
    first: bool = False


@functools.cache
def _hyper_order() -> tuple[str, ...]:
    """The :class:`Hyper` fields in the kernel's order (each kernel position has exactly one)."""
    lay = layout()
    names = [f.name for f in dataclasses.fields(Hyper)]
    if sorted(lay[f"hyper.{n}"] for n in names) != list(range(lay["hyper.len"])):
        raise RuntimeError("qconf._C's hyper layout does not match qconf.optim.spec.Hyper; rebuild the extension")
    return tuple(sorted(names, key=lambda n: lay[f"hyper.{n}"]))


def hyper_values(hyper: Hyper) -> list[float]:
    """``hyper`` as the kernel's positional ``float[] hyper`` argument."""
    return [float(getattr(hyper, name)) for name in _hyper_order()]


class GroupPlan:
    """The kernel's arguments for one param group (``rule``: the layout's rule id), and the C++
    ``StepPlan`` holding them. ``one_shot``: valid for this step only (a state starts now)."""

    def __init__(self, rule: int, fparams: Sequence[FusedParam]):
        lay = layout()
        tables: dict[Codec, int] = {}
        meta: list[list[int]] = []
        self.states: list[torch.Tensor] = []
        for fp in fparams:
            row, slots = _describe_param(lay, fp, tables)
            meta.append(row)
            self.states.extend(slots)
        self.rule = rule
        self.params = [fp.param for fp in fparams]
        self.steps = [fp.step for fp in fparams]
        self.meta = torch.tensor(meta, dtype=torch.int64).reshape(len(meta), lay["meta.cols"])
        self.tables = (torch.stack([codec_table(c) for c in tables]) if tables
                       else torch.zeros(1, TABLE_ROWS, TABLE_SIZE))
        self.one_shot = any(fp.first for fp in fparams)
        self.cpp = torch.classes.qconf.StepPlan(rule, self.params, self.steps, self.states, self.meta, self.tables)

    def run(self, grads: list[torch.Tensor], hyper: list[float], seed: int) -> None:
        """One step; ``grads`` are the parameters' gradients (read from ``.grad`` when eager)."""
        if torch.compiler.is_compiling():
            torch.ops.qconf.fused_step(self.rule, self.params, grads, self.steps, self.states, self.meta,
                                       self.tables, hyper, seed)
        else:
            self.cpp.run(hyper, seed)


def _describe_param(lay: Mapping[str, int], fp: FusedParam, tables: dict[Codec, int]
                    ) -> tuple[list[int], list[torch.Tensor]]:
    """One parameter's ``meta`` row and state tensors (``tables``: codec -> table index, grown)."""
    p = fp.param
    row = [0] * lay["meta.cols"]
    slots = [_EMPTY] * lay["slot.len"]
    row[lay["meta.index"]] = fp.index
    row[lay["meta.ndim"]] = p.dim()
    row[lay["meta.shape"]:lay["meta.shape"] + p.dim()] = list(p.shape)
    row[lay["meta.first"]] = int(fp.first)
    for slot, value in fp.states.items():
        if slot in (Slot.ROW, Slot.COL):  # fp32 statistics, no meta columns of their own
            row[lay["meta.factored"]] = 1
            slots[lay[f"slot.{slot.value}"]] = value
        else:
            _describe_state(lay, row, slots, slot, value, tuple(p.shape), tables,
                            "param_dtype" if slot is Slot.COMPENSATION else "fp32")
    if p.dtype != torch.float32:  # fp32 parameters take the fp32 result as is
        row[lay["meta.weights"]] = ((lay["weights.stochastic"] if fp.stochastic_weights else 0)
                                    | (lay["weights.kahan"] if Slot.COMPENSATION in fp.states else 0))
    return row, slots


def _describe_state(lay: Mapping[str, int], row: list[int], slots: list[torch.Tensor], slot: Slot,
                    value: torch.Tensor | QTensor, shape: tuple[int, ...], tables: dict[Codec, int],
                    dense_kind: str) -> None:
    """The meta columns and tensors of one state: a QTensor (kind, table, codec descriptor; codes
    and scales) or a dense tensor (fp32, or the parameter's dtype for the Kahan buffer)."""
    base = lay[f"meta.{slot.value}"]
    if isinstance(value, QTensor):
        row[base + lay["state.kind"]] = lay["kind.quant"]
        row[base + lay["state.table"]] = tables.setdefault(value.codec, len(tables))
        desc = codec_descriptor(value.codec, shape)
        row[base + lay["state.codec"]:base + lay["state.codec"] + len(desc)] = desc
        slots[lay[f"slot.{slot.value}"]] = value.codes
        slots[lay[f"slot.{slot.value}_scales"]] = value.scales
    else:
        row[base + lay["state.kind"]] = lay[f"kind.{dense_kind}"]
        slots[lay[f"slot.{slot.value}"]] = value


def _signed64(x: int) -> int:
    """The kernel's int64 seed argument from an unsigned 64-bit seed."""
    return x - (1 << 64) if x >= 1 << 63 else x


class FusedStepper:
    """Runs an optimizer's steps on the native kernel, one call per param group, caching each
    group's :class:`GroupPlan` until the key the optimizer passes changes."""

    def __init__(self, rule: str):
        self._rule = layout()[f"rule.{rule}"]
        self._plans: dict[int, tuple[Hashable, GroupPlan]] = {}

    def step(self, group_id: int, key: Callable[[], Hashable], describe: Callable[[], Sequence[FusedParam]],
             grads: list[torch.Tensor], hyper: Hyper, seed: int) -> None:
        """One step of the group ``group_id`` whose parameters (those with gradients ``grads``)
        ``describe()`` lists. ``key()`` identifies the group's layout: while it is unchanged the
        cached plan is reused, otherwise ``describe()`` (which may create states) is called and
        ``key()`` read again afterwards."""
        cached = self._plans.get(group_id)
        if cached is not None and cached[0] == key():
            plan = cached[1]
        else:
            plan = GroupPlan(self._rule, describe())
            if plan.one_shot:
                self._plans.pop(group_id, None)
            else:
                self._plans[group_id] = (key(), plan)
        plan.run(grads, hyper_values(hyper), _signed64(seed))
