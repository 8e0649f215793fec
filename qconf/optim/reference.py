"""The reference step: the readable, per-parameter specification of every update, a mixin of
:class:`~qconf.optim.base.QOptimizer` (it uses the optimizer's ``state``, ``plan``, ``_rule_specs``,
``_update``, ``_seed`` and ``_param_index``).

Each quantized state is decoded to fp32, the rule runs in the parameter's compute dtype, and the
new values are encoded again. A parameter sharded by FSDP2 steps on its local shard through a
:class:`~qconf.optim.sharded.ShardView`; its states are not encoded here but returned as
:class:`~qconf.optim.sharded.PendingEncode` items, because their scales may need maxima from other
ranks first (:mod:`qconf.optim.sharded`).
"""
from __future__ import annotations

from typing import Any

import torch

from ..codec import Codec, QTensor
from ..codec import rng
from ..config import StatePlan
from . import weights as wts
from .params import compute_dtype, real_view
from .sharded import PendingEncode, ShardView

__all__ = ["ReferenceSteps", "STATE_STREAMS"]

#: rng stream per quantized state (stochastic rounding of states); params use rng.STREAM_PARAM
STATE_STREAMS = {"exp_avg": rng.STREAM_EXP_AVG, "exp_avg_sq": rng.STREAM_EXP_AVG_SQ,
                 "compensation": rng.STREAM_COMPENSATION}


class ReferenceSteps:
    """The reference path of :class:`~qconf.optim.base.QOptimizer` (see the module docstring)."""

    state: Any
    _seed: int

    @torch.compiler.disable  # host-driven per parameter: see "torch.compile" in docs/optimizers.md
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
        bits = wts.param_bits(self._seed, step, index, t.numel(), t.device, offset) if stochastic else None
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

