"""The fused optimizer step: one native kernel call per param group.

The optimizer base describes each parameter of a group as a :class:`FusedParam` -- its index (the
random stream of stochastic rounding), its tensors, and each state's value in its kernel
:class:`~qconf.optim.spec.Slot` -- and the group's hyperparameters as a
:class:`~qconf.optim.spec.Hyper`. This module lays them out as the kernels read them
(:func:`qconf._native.layout`: the int64 ``meta`` table, the flat ``states`` list, the ``hyper``
values) with the codecs' tables and descriptors from :mod:`qconf.codec.native`.

Per param group the arguments are collected once into a C++ ``StepPlan`` (:class:`GroupPlan`);
an eager step then passes only the hyperparameters (the plan reads each parameter's ``.grad``), so
the cost per parameter stays small even with thousands of small tensors. The optimizer says when a
cached plan is stale by the key it passes to :meth:`FusedStepper.plan`.

Under ``torch.compile`` the plan is built outside the graph (the optimizer's ``_init_group``, which
Dynamo runs eagerly while tracing, lists :meth:`GroupPlan.op_tensors`), and the traced step is
:meth:`FusedStepper.traced_step`: the functional op ``qconf::fused_step`` (fake implementation in
:mod:`qconf.ops`) with every tensor as an argument. Nothing the traced step calls reads the native
layout or builds a plan, so it has no graph break.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from .. import ops
from .._native import has_cuda_kernels, layout
from ..codec import Codec, QTensor
from ..codec.native import TABLE_ROWS, TABLE_SIZE, codec_descriptor, codec_table
from .spec import Hyper, Slot

__all__ = ["FUSED_DTYPES", "FusedParam", "GroupPlan", "FusedStepper", "CompiledFusedSteps", "unfusable_reason",
           "hyper_values", "run_one"]

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
    return None  # any strides: a non-contiguous parameter steps through a contiguous copy (GroupPlan)


@dataclasses.dataclass(frozen=True)
class FusedParam:
    """One parameter of a fused step, as the optimizer hands it over.

    Attributes:
        index: the parameter's index in the optimizer (``state_dict`` order): its random streams.
        param: the parameter (fp32/bf16/fp16, any strides); its ``.grad`` is read at each step.
            A non-contiguous parameter steps through a contiguous copy that is written back in
            place (:class:`GroupPlan`); a non-contiguous gradient is copied by the kernel.
        step: its step counter (a one-element fp32 CPU tensor; the kernel increments it).
        states: each state's value (tensor or QTensor) by kernel slot; ``ROW``/``COL`` present
            means a factored second moment, ``COMPENSATION`` a Kahan buffer.
        stochastic_weights: a bf16/fp16 parameter receives its update by stochastic rounding.
        first: a lazily created state (SGD's momentum buffer) starts at this step.
        rng_offset: the index of ``param``'s element 0 in its random streams (>= 0): a shard
            starting at flat element ``a`` of its global parameter passes ``a`` and draws the same
            stochastic-rounding bits as elements ``a..`` of the whole parameter.
    """

    index: int
    param: torch.Tensor
    step: torch.Tensor
    states: Mapping[Slot, torch.Tensor | QTensor]
    stochastic_weights: bool = False
    first: bool = False
    rng_offset: int = 0


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
    ``StepPlan`` holding them. ``one_shot``: valid for this step only (a state starts now).

    The kernels take contiguous parameters. A non-contiguous one (``strided``: its positions in
    :attr:`params`) is left out of the C++ plan; :meth:`run` steps it alone through a contiguous
    copy -- the kernel sees the same logical (row-major) elements, so the results are those of a
    contiguous parameter bit for bit -- and copies the result back into it in place (its storage,
    strides and identity unchanged). The copy exists for that parameter's call only: one
    parameter-sized temporary, plus the kernel's contiguous copy of a non-contiguous gradient."""

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
        self.strided = tuple(k for k, p in enumerate(self.params) if not p.is_contiguous())
        if not self.strided:
            self.cpp = torch.classes.qconf.StepPlan(rule, self.params, self.steps, self.states, self.meta, self.tables)
            self._strided_args: list[tuple[int, list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = []
            return
        n = lay["slot.len"]
        dense = [k for k in range(len(self.params)) if k not in self.strided]
        self.cpp = (torch.classes.qconf.StepPlan(rule, [self.params[k] for k in dense], [self.steps[k] for k in dense],
                                                 [s for k in dense for s in self.states[k * n:(k + 1) * n]],
                                                 self.meta[dense].contiguous(), self.tables) if dense else None)
        self._strided_args = [(k, [self.steps[k]], self.states[k * n:(k + 1) * n], self.meta[k:k + 1].clone())
                              for k in self.strided]

    def run(self, hyper: list[float], seed: int) -> None:
        """One eager step (the C++ plan reads each parameter's ``.grad``); each non-contiguous
        parameter then steps alone through a contiguous copy (see the class docstring)."""
        if self.cpp is not None:
            self.cpp.run(hyper, seed)
        for k, steps, states, meta in self._strided_args:
            p = self.params[k]
            if p.grad is None:
                raise RuntimeError(f"qconf fused_step: parameter {k} of the plan has no gradient")
            work = p.contiguous()  # the parameter-sized copy, freed after this parameter
            ops.fused_step(self.rule, [work], [p.grad], steps, states, meta, self.tables, hyper, seed)
            p.copy_(work)
            del work

    def reduce(self, hyper_values: list[float], seed: int, grads: Sequence[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """First half of :meth:`run`, for a caller that combines the new scales across ranks before
        they are used (FSDP: a state's scales belong to the global parameter). CPU plans; CUDA
        plans with the specialized kernels (``QCONF_CUDA_KERNELS=specialized``), every tensor of
        which must have one (else RuntimeError, nothing written), the maxima then on the GPU.

        Computes the new value of every two-pass quantized state (tensor, dim0/dim1, rank-1
        scales and blocks too large for one tile) from ``grads`` -- one per parameter, shaped
        like it (the parameters' ``.grad`` is not read: a local shard has none) -- and reduces
        their absmax; nothing is written (parameters, states, scales, steps) until :meth:`apply`.
        ``hyper_values`` are :meth:`FusedStepper.hyper_values`, ``seed`` the optimizer's
        unsigned 64-bit seed. Factored second moments are refused.

        Returns ``(maxima, offsets)``:

        * ``maxima``: float32 ``[M]``. For each tensor in plan order and within it state 0, state
          1, Kahan buffer: that state's ``num_scales`` values ``max |x|`` over the finite new
          values of each scale's elements, *before* the ``FLT_MIN`` floor of stored scales (an
          all-reduce with ``MAX`` combines them across ranks).
        * ``offsets``: int64 ``[T, 3]``: where tensor i's state 0 / state 1 / Kahan buffer start
          in ``maxima``; -1 where that state is not a two-pass quantized state (fp32, absent,
          single-pass blocks, the Kahan buffer always, or an empty tensor's states).
        """
        if self.strided:
            raise RuntimeError(f"qconf GroupPlan.reduce: parameters {list(self.strided)} of the plan are not "
                               "contiguous; the split step takes contiguous tensors")
        return self.cpp.reduce(hyper_values, _signed64(seed), list(grads))

    def apply(self, maxima: torch.Tensor) -> None:
        """Second half of :meth:`run`: completes the step the last :meth:`reduce` started, with
        ``maxima`` in its layout (float32, finite, >= 0; e.g. all-reduced with ``MAX``). Each new
        scale is ``max(m, FLT_MIN)`` for ``m > 0`` (0 stays 0), the states are quantized with
        those scales, the parameters written and the steps incremented; unchanged ``maxima`` give
        exactly :meth:`run`'s results. The plan's tensors must not change in between."""
        self.cpp.apply(maxima)

    def op_tensors(self) -> list[torch.Tensor]:
        """Every tensor of ``qconf::fused_step`` in one list, as :meth:`FusedStepper.traced_step`
        reads it: params, their current gradients, steps, states, then meta and tables."""
        return [*self.params, *(p.grad for p in self.params), *self.steps, *self.states, self.meta, self.tables]


def run_one(rule: str, fp: FusedParam, grad: torch.Tensor, hyper: Hyper, seed: int) -> None:
    """One kernel call of rule ``rule`` (the layout's ``rule.<name>``) for one parameter, with an
    explicit gradient (any strides, shaped like ``fp.param``, fp32/bf16/fp16 whatever the
    parameter's dtype) instead of ``fp.param.grad``: Muon's two calls around Newton–Schulz
    (:mod:`qconf.optim.muon`). A non-contiguous parameter steps through a contiguous copy that is
    written back, as in :class:`GroupPlan`."""
    lay = layout()
    tables: dict[Codec, int] = {}
    row, slots = _describe_param(lay, fp, tables)
    meta = torch.tensor([row], dtype=torch.int64)
    table = torch.stack([codec_table(c) for c in tables]) if tables else torch.zeros(1, TABLE_ROWS, TABLE_SIZE)
    work = fp.param if fp.param.is_contiguous() else fp.param.contiguous()
    ops.fused_step(lay[f"rule.{rule}"], [work], [grad], [fp.step], slots, meta, table, hyper_values(hyper),
                   _signed64(seed))
    if work is not fp.param:
        fp.param.copy_(work)


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
    row[lay["meta.rng_offset"]] = fp.rng_offset
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
        self._order = _hyper_order()  # read here, eagerly: a traced step must not call into layout()
        self._plans: dict[Hashable, tuple[Hashable, GroupPlan]] = {}
        #: part of every plan's key; a compiled step that started a lazy state bumps it (a graph
        #: cannot drop its one-shot plan the way an eager step does)
        self.generation = 0

    def plan(self, group_id: Hashable, key: Callable[[], Hashable], describe: Callable[[], Sequence[FusedParam]]
             ) -> GroupPlan:
        """The plan of group ``group_id``. ``key()`` identifies the group's layout: while it is
        unchanged the cached plan is returned, otherwise ``describe()`` (which may create states)
        lists the parameters and ``key()`` is read again afterwards. A one-shot plan (a state
        starts at this step) is cached too, so that a compiled graph's tensors stay alive; an
        eager step drops it, a compiled one bumps :attr:`generation`."""
        cached = self._plans.get(group_id)
        if cached is not None and cached[0] == (self.generation, key()):
            return cached[1]
        plan = GroupPlan(self._rule, describe())
        self._plans[group_id] = ((self.generation, key()), plan)
        return plan

    def step(self, group_id: int, key: Callable[[], Hashable], describe: Callable[[], Sequence[FusedParam]],
             hyper: Hyper, seed: int) -> None:
        """One eager step of the group ``group_id`` (see :meth:`plan`)."""
        self._eager_plan(group_id, key, describe).run(self.hyper_values(hyper), _signed64(seed))

    def _eager_plan(self, group_id: Hashable, key: Callable[[], Hashable],
                    describe: Callable[[], Sequence[FusedParam]]) -> GroupPlan:
        """:meth:`plan` for an eager step: a one-shot plan is used once and dropped."""
        plan = self.plan(group_id, key, describe)
        if plan.one_shot:
            self._plans.pop(group_id, None)
        return plan

    def reduce(self, group_id: Hashable, key: Callable[[], Hashable], describe: Callable[[], Sequence[FusedParam]],
               hyper: Hyper, seed: int, grads: Sequence[torch.Tensor]) -> tuple[GroupPlan, torch.Tensor, torch.Tensor]:
        """The first half of a split step (:meth:`GroupPlan.reduce`) of the plan ``group_id`` (see
        :meth:`plan`); returns the plan, whose :meth:`GroupPlan.apply` completes the step, and the
        ``(maxima, offsets)`` of its two-pass states."""
        plan = self._eager_plan(group_id, key, describe)
        maxima, offsets = plan.reduce(self.hyper_values(hyper), seed, grads)
        return plan, maxima, offsets

    def hyper_values(self, hyper: Hyper) -> list[float]:
        """``hyper`` as the kernel's positional ``float[] hyper`` argument."""
        return [float(getattr(hyper, name)) for name in self._order]

    def traced_step(self, tensors: list[torch.Tensor], count: int, num_states: int, hyper: Hyper, seed: int) -> None:
        """The step as ``torch.compile`` traces it: ``tensors`` is :meth:`GroupPlan.op_tensors` of
        a plan of ``count`` parameters and ``num_states`` state tensors."""
        params, grads, steps = tensors[:count], tensors[count:2 * count], tensors[2 * count:3 * count]
        states = tensors[3 * count:3 * count + num_states]
        strided = [k for k, p in enumerate(params) if not p.is_contiguous()]
        work = [p.contiguous() if k in strided else p for k, p in enumerate(params)] if strided else params
        ops.fused_step(self._rule, work, grads, steps, states, tensors[-2], tensors[-1], self.hyper_values(hyper),
                       _signed64(seed))
        for k in strided:  # a non-contiguous parameter stepped through a contiguous copy (see GroupPlan)
            params[k].copy_(work[k])


class CompiledFusedSteps:
    """The fused step under ``torch.compile``, a mixin of :class:`~qconf.optim.base.QOptimizer`
    (it uses the optimizer's ``_kernel``, ``_fusable``, ``_plan_source``, ``_hyper``, ``_seed``,
    ``_layout_version`` and ``state``).

    Dynamo runs a method named ``_init_group`` eagerly while it traces an optimizer's ``step``
    (torch.optim's own optimizers build their state lists there) and then guards on the state and
    param groups that it leaves. Here it does the host work a graph cannot hold -- the fusability
    check, state creation and the group's plan -- and the traced part is only the functional op.
    """

    def _init_group(self, group: dict[str, Any], tensors: list[torch.Tensor]
                    ) -> tuple[bool, bool, int, int, tuple[int, int]]:
        """Prepare ``group``'s fused step: append its plan's op tensors to ``tensors``. Returns
        (fusable, one-shot plan, parameter count, state tensor count, layout) where layout is
        (the optimizer's layout version, the kernel's plan generation)."""
        if not self._fusable(group):
            return False, False, 0, 0, (self._layout_version, self._kernel.generation)
        for p in group["params"]:  # Dynamo moves each "step" to its parameter's device; the kernels read it on the CPU
            state = self.state.get(p)
            if state and "step" in state and state["step"].device.type != "cpu":
                state["step"] = state["step"].cpu()
                self._layout_version += 1
        source = self._plan_source(group)
        if source is None:  # no parameter of the group has a gradient
            return True, False, 0, 0, (self._layout_version, self._kernel.generation)
        plan = self._kernel.plan(id(group), *source)
        tensors.extend(plan.op_tensors())
        return True, plan.one_shot, len(plan.params), len(plan.states), (self._layout_version, self._kernel.generation)

    def _compiled_fused_steps(self) -> list[dict[str, Any]]:
        """The fused steps as torch.compile traces them (no graph break); returns the groups left
        for the reference path."""
        prepared = []
        for group in self.param_groups:
            tensors: list[torch.Tensor] = []
            prepared.append((group, tensors, self._init_group(group, tensors)))
        if not prepared:
            return []
        # Read once every _init_group has run (Dynamo does not see their writes). The graph is
        # guarded on this comparison: a state created, converted or replaced later (a new layout
        # version), or a spent one-shot plan (a new generation), retraces and replans.
        layout = (self._layout_version, self._kernel.generation)
        if layout != prepared[-1][2][4]:
            raise RuntimeError(f"{type(self).__name__}: the optimizer's states changed while a step was traced")
        rest, one_shot = [], False
        for group, tensors, (fusable, first, count, num_states, _) in prepared:
            if not fusable:
                rest.append(group)
            elif count:
                self._kernel.traced_step(tensors, count, num_states, self._hyper(group), self._seed)
                one_shot = one_shot or first
        if one_shot:  # a plan started a lazy state at this step only: the next step needs new plans
            # (kept on the kernel: Dynamo drops attribute writes to a torch.optim.Optimizer)
            self._kernel.generation = layout[1] + 1
        return rest
