"""The reference step: the readable, per-parameter specification of every update, a mixin of
:class:`~qconf.optim.base.QOptimizer` (it uses the optimizer's ``state``, ``plan``, ``_rule_specs``,
``_update``, ``_seed`` and ``_param_index``).

Each quantized state is decoded to fp32, the rule runs in the parameter's compute dtype, and the
new values are encoded again. A parameter sharded by FSDP2 steps on its local shard through a
:class:`~qconf.optim.sharded.ShardView`; its states are not encoded here but returned as
:class:`~qconf.optim.sharded.PendingEncode` items, because their scales may need maxima from other
ranks first (:mod:`qconf.optim.sharded`).

Bounded memory: a parameter whose rule is elementwise (:attr:`ReferenceSteps.elementwise_rule`;
not a factored second moment) and whose quantized states have absmax scales and table rounding
(every optimizer-state codec) steps in chunks of its flattened elements (:mod:`qconf.optim.chunked`),
sized so that the scratch of one chunk stays within ``max(parameter bytes, CHUNK_FLOOR_BYTES)``;
quantized states are rewritten in place, chunk by chunk. Group scales are a property of the
chunk's own blocks; tensor, dim0, dim1 and rank1 scales need the maxima of the whole new state
first, so such a parameter (when it takes more than one chunk) runs the rule twice: a first pass
that only collects the maxima, a second that writes. Either way the results are the whole-tensor
step's bit for bit (docs/optimizers.md, "Non-contiguous parameters and the memory of a step").
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..codec import Codec, QTensor
from ..codec import rng
from ..config import StatePlan
from . import weights as wts
from .chunked import RangeCodec, chunk_bounds, chunk_unit, chunkable_codec, read, write
from .params import compute_dtype, real_view
from .sharded import PendingEncode, ShardView
from .spec import Slot, StateSpec

__all__ = ["ReferenceSteps", "STATE_STREAMS", "CHUNK_FLOOR_BYTES", "SCRATCH_BYTES_PER_ELEMENT"]

#: rng stream per quantized state (stochastic rounding of states); params use rng.STREAM_PARAM
STATE_STREAMS = {"exp_avg": rng.STREAM_EXP_AVG, "exp_avg_sq": rng.STREAM_EXP_AVG_SQ,
                 "compensation": rng.STREAM_COMPENSATION}

#: An upper bound of the scratch bytes the chunked reference step allocates at once per element of
#: a chunk (rule temporaries, decode/encode temporaries, random bits, scale indexes; measured at
#: most 128, with fp16 stochastic rounding and a Kahan buffer); a chunk holds
#: ``max(parameter bytes, CHUNK_FLOOR_BYTES) // SCRATCH_BYTES_PER_ELEMENT`` elements (rounded down
#: to whole blocks and bytes of codes, and to whole rows where they fit; at least one block).
SCRATCH_BYTES_PER_ELEMENT = 160
#: The smallest chunk budget: a parameter below it steps in one chunk (at most a few MiB of scratch).
CHUNK_FLOOR_BYTES = 4 << 20


class ReferenceSteps:
    """The reference path of :class:`~qconf.optim.base.QOptimizer` (see the module docstring)."""

    state: Any
    _seed: int
    #: whether the rule's ``_update`` is elementwise -- each element's new parameter and state
    #: values depend on that element's inputs only (a factored second moment, whose statistics
    #: are means over rows and columns, is recognized by its slots) -- so that a parameter can
    #: step in chunks (module docstring). Adam, AdamW, SGD and Lion set it; a rule that leaves it
    #: False steps each parameter whole.
    elementwise_rule: bool = False

    # host-driven per parameter: see "torch.compile" in docs/optimizers.md (torch.compiler.disable,
    # which imports dynamo when qconf is imported: 0.7 s of every start; this one at the first call)
    @torch._disable_dynamo
    def _reference_group(self, group: dict[str, Any]) -> None:
        """The reference step of every parameter of ``group`` that has a gradient."""
        index = self._param_index()
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            i = index[id(p)]
            new = self._ensure_state(p, i, group)
            self._reference_step(p, i, group, new)

    def _reference_step(self, p: torch.Tensor, index: int, group: dict[str, Any], new: frozenset[str],
                        view: ShardView | None = None) -> list[PendingEncode]:
        """One step of ``p`` in its compute dtype: fp32, or float64 for float64 parameters (never
        rounded through a narrower type); complex parameters step on their ``view_as_real``.
        With ``view`` (a sharded ``p``) the step runs on the local shard and the new values of its
        quantized states are returned for :func:`~qconf.optim.sharded.finish_encodes`; otherwise
        they are encoded here and the list is empty."""
        state = self.state[p]
        state["step"] += 1
        step = int(state["step"].item())
        t, g = (p, p.grad) if view is None else (view.param, view.grad)
        if t.numel() == 0 and view is None:  # nothing to update (and no mean over an empty dim)
            return []
        plan = self.plan(index)
        specs = self._rule_specs(group, p)
        if view is None and self._chunkable(t, specs, state):
            self._chunked_step(t, p.grad, index, group, new, step, plan, specs, state)
            return []
        real = real_view(t)
        dtype = compute_dtype(real)
        values = {}
        for spec in specs:
            v = state[spec.key]  # fp32/fp64 states update in place; quantized ones are decoded
            if isinstance(v, QTensor):
                v = (v.decode() if view is None else view.decode(v)).to(dtype)
            values[spec.key] = v
        p_c = real if real.dtype == dtype else real.to(dtype)
        p_old = t.float() if "kahan_comp" in state else None
        grad = real_view(g)
        self._update(p_c, grad if grad.dtype == dtype else grad.to(dtype), values, step, group, new)
        pending: list[PendingEncode] = []
        for spec in specs:
            if isinstance(state[spec.key], QTensor):
                self._store(state, spec.key, spec.section, values[spec.key], step, index, view, pending)
        if p_c is not real:  # bf16/fp16: round the fp32 result into the parameter
            t.copy_(self._write_param(t, p_c, p_old, state, index, step, plan, view, pending))
        return pending

    def _store(self, state: dict[str, Any], key: str, section: str, value: torch.Tensor, step: int, index: int,
               view: ShardView | None, pending: list[PendingEncode]) -> None:
        """Encode the new fp32 ``value`` of quantized state ``key`` with its codec (stochastic
        rounding draws by element index), or queue it in ``pending`` for a sharded parameter."""
        codec = state[key].codec
        if view is None:
            noise = self._noise(codec, step, index, section, value.numel(), value.device, 0)
            state[key] = codec.encode(value, noise=noise)
            return
        padded = view.pad(value, codec)
        noise = self._noise(codec, step, index, section, padded.numel(), value.device, view.noise_offset(codec))
        pending.append(PendingEncode.of(state, key, codec, padded, noise, view.geometry))

    def _write_param(self, t: torch.Tensor, p32: torch.Tensor, p_old: torch.Tensor | None, state: dict[str, Any],
                     index: int, step: int, plan: StatePlan, view: ShardView | None,
                     pending: list[PendingEncode]) -> torch.Tensor:
        """The new low-precision values of parameter (or shard) ``t``: nearest, stochastic or
        Kahan-compensated (the buffer is stored like any state, see :meth:`_store`)."""
        stochastic = plan.weights.rounding == "stochastic"
        offset = 0 if view is None else view.geometry.offset
        bits = wts.param_bits(self._seed, step, index, t.dtype, t.numel(), t.device, offset) if stochastic else None
        if p_old is None:
            return wts.round_param(p32, t.dtype, stochastic, bits)
        comp = state["kahan_comp"]
        if isinstance(comp, QTensor):
            comp32 = comp.decode() if view is None else view.decode(comp)
        else:
            comp32 = comp.float()
        new_p, new_comp = wts.kahan_update(p_old, p32, comp32, t.dtype, stochastic, bits)
        if isinstance(comp, QTensor):
            self._store(state, "kahan_comp", "compensation", new_comp, step, index, view, pending)
        else:
            comp.copy_(wts.round_param(new_comp, comp.dtype, False, None))
        return new_p

    def _noise(self, codec: Codec, step: int, index: int, section: str, numel: int, device: torch.device,
               offset: int) -> torch.Tensor | None:
        """Counter-based uniforms for stochastic rounding of one state of qconfig ``section``
        (``numel`` values for element indexes ``offset ..``; None for nearest rounding)."""
        if codec.rounding != "stochastic":
            return None
        key = rng.stream_key(self._seed, step, index, STATE_STREAMS[section])
        return rng.uniform(key, numel, device=device, offset=offset)

    # -- the chunked step (bounded scratch; see the module docstring) ----------------------------
    def _chunkable(self, t: torch.Tensor, specs: list[StateSpec], state: dict[str, Any]) -> bool:
        """Whether parameter (not shard) ``t`` can take :meth:`_chunked_step`: an elementwise rule,
        no factored statistics, every state shaped like ``t``'s real view and every quantized one
        under a codec that encodes chunk by chunk exactly (``chunkable_codec``)."""
        if not self.elementwise_rule:
            return False
        shape = tuple(real_view(t).shape)
        entries = [(state.get(spec.key), shape) for spec in specs if spec.slot not in (Slot.ROW, Slot.COL)]
        if len(entries) != len(specs):
            return False
        if t.dtype in wts.LOW_PRECISION and "kahan_comp" in state:
            entries.append((state["kahan_comp"], tuple(t.shape)))
        for value, want in entries:
            if isinstance(value, QTensor):
                if (not chunkable_codec(value.codec) or tuple(value.shape) != want or not value.codes.is_contiguous()
                        or not value.scales.is_contiguous() or value.device != t.device):
                    return False
            elif not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
                return False
        return True

    def _chunked_step(self, t: torch.Tensor, g: torch.Tensor, index: int, group: dict[str, Any],
                      new: frozenset[str], step: int, plan: StatePlan, specs: list[StateSpec],
                      state: dict[str, Any]) -> None:
        """The reference step of parameter ``t`` (gradient ``g``) chunk by chunk, with the results
        of the whole-tensor step (``state["step"]`` is already advanced to ``step``)."""
        _ChunkedStep(self, t, g, index, group, new, step, plan, specs, state).run()


class _ChunkedStep:
    """One parameter's chunked reference step (:meth:`ReferenceSteps._chunked_step`): the chunks,
    the quantized states (``quant``: key -> (qconfig section, :class:`RangeCodec`)) and the rule."""

    def __init__(self, opt: Any, t: torch.Tensor, g: torch.Tensor, index: int, group: dict[str, Any],
                 new: frozenset[str], step: int, plan: StatePlan, specs: list[StateSpec], state: dict[str, Any]):
        self.opt, self.t, self.index, self.group, self.new, self.step = opt, t, index, group, new, step
        self.specs, self.state = specs, state
        self.real, self.grad = real_view(t), real_view(g)
        self.dtype = compute_dtype(self.real)
        self.low = self.real.dtype != self.dtype  # bf16/fp16: the fp32 result is rounded into the parameter
        self.kahan = self.low and "kahan_comp" in state
        self.comp = state["kahan_comp"] if self.kahan else None
        self.stochastic = plan.weights.rounding == "stochastic"
        self.quant: dict[str, tuple[str, RangeCodec]] = {
            spec.key: (spec.section, RangeCodec(state[spec.key].codec, tuple(self.real.shape)))
            for spec in specs if isinstance(state[spec.key], QTensor)}
        if isinstance(self.comp, QTensor):
            self.quant["kahan_comp"] = ("compensation", RangeCodec(self.comp.codec, tuple(t.shape)))
        target = max(t.numel() * t.element_size(), CHUNK_FLOOR_BYTES) // SCRATCH_BYTES_PER_ELEMENT
        unit = chunk_unit([(rc.codec, rc.shape) for _, rc in self.quant.values()])
        rows = math.lcm(unit, *(rc.row for _, rc in self.quant.values()))
        # chunks of whole rows where they fit in the budget (their scales broadcast rather than gather)
        self.bounds = chunk_bounds(self.real.numel(), rows if rows <= target else unit, target)
        self.two_pass = [key for key, (_, rc) in self.quant.items() if rc.two_pass]

    def run(self) -> None:
        """Both passes: the maxima of two-pass states (when there is more than one chunk), then
        the writes, chunk by chunk; the two-pass states' new scales last."""
        device, scales = self.t.device, {}
        if self.two_pass and len(self.bounds) > 1:  # first pass: the maxima of the whole new states
            maxima = {key: torch.zeros(self.quant[key][1].num_scales, dtype=torch.float32, device=device)
                      for key in self.two_pass}
            for a, b in self.bounds:
                idx = self.indexes(a, b)
                out = self.chunk(a, b, idx, False, set(self.two_pass))
                for key in self.two_pass:
                    self.quant[key][1].accumulate(maxima[key], out[key], idx[key])
                del out, idx
            scales = {key: self.quant[key][1].finish(m) for key, m in maxima.items()}
        for a, b in self.bounds:
            idx = self.indexes(a, b)
            out = self.chunk(a, b, idx, True, set(self.quant))
            for key, (section, rc) in self.quant.items():
                q, x = self.state[key], out.pop(key)
                if rc.two_pass:
                    if key not in scales:  # one chunk: it is the whole tensor
                        m = torch.zeros(rc.num_scales, dtype=torch.float32, device=device)
                        rc.accumulate(m, x, idx[key])
                        scales[key] = rc.finish(m)
                    s = scales[key]
                else:
                    s = rc.group_scales(x)
                    q.scales[rc.group_slice(a, b)] = s
                noise = self.opt._noise(rc.codec, self.step, self.index, section, b - a, device, a)
                rc.encode(q, x, a, b, s, idx[key], noise)
                del x, noise
            del out, idx
        for key in self.two_pass:  # read by every chunk above: replaced only now
            self.state[key].scales.copy_(scales[key])

    def indexes(self, a: int, b: int) -> dict[str, Any]:
        """How each quantized state's elements ``a .. b-1`` find their scales
        (:meth:`RangeCodec.where`; shared by equal layouts)."""
        made: dict[tuple, Any] = {}
        out = {}
        for key, (_, rc) in self.quant.items():
            layout = (rc.eff, rc.shape)
            if layout not in made:
                made[layout] = rc.where(a, b, self.t.device)
            out[key] = made[layout]
        return out

    def chunk(self, a: int, b: int, idx: dict[str, Any], commit: bool, want: set[str]) -> dict[str, torch.Tensor]:
        """The rule on elements ``a .. b-1``; returns the new values of the quantized states in
        ``want``. ``commit``: write the parameter and the dense states (else nothing is written:
        the first pass of two-pass states)."""
        real, dtype, state = self.real, self.dtype, self.state
        p_chunk, p_is_view = read(real, a, b)
        if self.low:
            p_c = p_chunk.to(dtype)
        else:
            p_c = p_chunk.clone() if p_is_view and not commit else p_chunk
        rounded = self.low and (commit or "kahan_comp" in want)  # the parameter's new low-precision values
        p_old = p_chunk.float() if self.kahan and rounded else None
        g_c = read(self.grad, a, b)[0]
        if g_c.dtype != dtype:
            g_c = g_c.to(dtype)
        values, copies = {}, []
        for spec in self.specs:
            v = state[spec.key]
            if isinstance(v, QTensor):
                values[spec.key] = self.quant[spec.key][1].decode(v, a, b, idx[spec.key]).to(dtype)
                continue
            d, is_view = read(v, a, b)
            if is_view and not commit:
                d = d.clone()
            elif not is_view:
                copies.append((v, d))
            values[spec.key] = d
        self.opt._update(p_c, g_c, values, self.step, self.group, self.new)
        out = {key: values[key] for key in want if key in values}
        if commit:
            for v, d in copies:
                write(v, a, b, d)
            if not self.low and not p_is_view:
                write(real, a, b, p_c)
        if rounded:
            new_p = self.round(a, b, idx, p_c, p_old, commit, out)
            if commit:
                write(real, a, b, new_p)
        return out

    def round(self, a: int, b: int, idx: dict[str, Any], p32: torch.Tensor, p_old: torch.Tensor | None,
              commit: bool, out: dict[str, torch.Tensor]) -> torch.Tensor:
        """The new low-precision values of elements ``a .. b-1`` of the parameter (as
        :meth:`ReferenceSteps._write_param`): a dense Kahan buffer is written (``commit``), a
        quantized one's new values go to ``out``."""
        t, comp = self.t, self.comp
        bits = (wts.param_bits(self.opt._seed, self.step, self.index, t.dtype, b - a, t.device, a) if self.stochastic
                else None)
        if p_old is None:
            return wts.round_param(p32, t.dtype, self.stochastic, bits)
        if isinstance(comp, QTensor):
            comp32 = self.quant["kahan_comp"][1].decode(comp, a, b, idx["kahan_comp"])
        else:
            comp32 = read(comp, a, b)[0].float()
        new_p, new_comp = wts.kahan_update(p_old, p32, comp32, t.dtype, self.stochastic, bits)
        if isinstance(comp, QTensor):
            out["kahan_comp"] = new_comp
        elif commit:
            write(comp, a, b, wts.round_param(new_comp, comp.dtype, False, None))
        return new_p
