"""The step of param groups that hold sharded (DTensor) parameters: a mixin of
:class:`~qconf.optim.base.QOptimizer`.

Every rank steps its own shards. A state's scales belong to the *global* parameter
(:mod:`qconf.optim.sharded`), so the step runs in two halves around one all-reduce:

1. Each group's fusable shards go through the first half of the fused kernel
   (:meth:`~qconf.optim.fused.GroupPlan.reduce`, one multi-tensor call on the ``to_local()``
   tensors): it computes the new states and their partial maxima and writes nothing. The other
   shards take the reference step, which queues their new values (:class:`PendingEncode`).
2. The shared scales of both kinds go through :func:`combine_scales` -- one ``all_reduce(MAX)``
   per process group for the whole step -- listed in (parameter index, state key) order, the same
   on every rank whichever path a rank's shard took.
3. :meth:`~qconf.optim.fused.GroupPlan.apply` quantizes with the combined maxima and writes the
   shards; the queued states are encoded.

A shard is fusable when every scale its states share with other shards is a rank1 or dim1 scale of
the rule's states (group blocks must not straddle a shard boundary: FSDP2's dim-0 split must fall
on block boundaries; a tensor scale must not be shared), it lives on the CPU, or on a GPU with the
specialized CUDA kernels (``QCONF_CUDA_KERNELS=specialized``: the generic CUDA kernel has no split;
a CUDA shard that no specialized kernel takes -- e.g. a parameter not 16-byte aligned -- is then
refused with a clear error before anything is written), and it is not empty; otherwise it takes
the reference path, which handles every layout. Both give the same bits
(tests/test_distributed_fsdp.py).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import _native
from ..codec import Codec
from .fused import GroupPlan, unfusable_reason
from .sharded import ShardGeometry, ShardView, combine_scales, is_sharded, shard_geometry, store_encodes
from .spec import Slot

__all__ = ["ShardedSteps"]

#: the columns of GroupPlan.reduce's ``offsets`` for the rule's states (the Kahan buffer's is always -1)
_COLUMN = {Slot.FIRST: 0, Slot.SECOND: 1}

#: one shared-scale item of a step: (parameter index, state key) -- the order on every rank -- and
#: the geometry, codec and scales (partial maxima, completed in place) of that state
Share = tuple[tuple[int, str], ShardGeometry, Codec, torch.Tensor]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if is_sharded(p) else p


class ShardedSteps:
    """The sharded step (module docstring). Uses the optimizer's ``_kernel``, ``_fused``,
    ``_ensure_state``, ``_reference_step``, ``_fused_params``, ``planned_states`` and index."""

    def _sharded_step(self, groups: list[dict[str, Any]]) -> None:
        """One step of every parameter with a gradient in ``groups`` (plain ones included)."""
        index = self._param_index()
        shares: list[Share] = []
        plans: list[tuple[GroupPlan, torch.Tensor]] = []
        pending = []
        for group in groups:
            fused, rest = self._split_shards(group, index)
            if fused:
                plans.append(self._reduce_shards(group, fused, index, shares))
            for p in rest:
                i = index[id(p)]
                new = self._ensure_state(p, i, group)
                geo = shard_geometry(p)
                view = None if geo is None else ShardView(p.to_local(), p.grad.to_local(), geo)
                queued = self._reference_step(p, i, group, new, view)
                shares += [((i, e.key), e.geometry, e.codec, e.scales) for e in queued]
                pending += queued
        shares.sort(key=lambda s: s[0])
        combine_scales([s[1:] for s in shares])
        for plan, maxima in plans:
            plan.apply(maxima)
        store_encodes(pending)

    def _split_shards(self, group: dict[str, Any], index: dict[int, int]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``group``'s parameters with gradients: (those the fused kernel steps, the others)."""
        params = [p for p in group["params"] if p.grad is not None]
        if self._kernel is None:
            return [], params
        fusable = self._shard_fusable(group, index)
        fused = [p for p in params if fusable[id(p)] and _local(p).numel() > 0]
        taken = {id(p) for p in fused}
        return fused, [p for p in params if id(p) not in taken]

    def _shard_fusable(self, group: dict[str, Any], index: dict[int, int]) -> dict[int, bool]:
        """id(p) -> whether parameter p of ``group`` can take the split fused step (cached until
        the layout changes). The conditions depend on global shapes and the plan only, so every
        rank decides alike and ``fused=True`` fails on all of them together."""
        key = (self._layout_version, len(group["params"]))
        cached = self._fusable_cache.get(("sharded", id(group)))
        if cached is not None and cached[0] == key:
            return cached[1]
        problems, fusable = [], {}
        for p in group["params"]:
            reason = self._shard_unfusable(p, index[id(p)])
            fusable[id(p)] = reason is None
            if reason is not None:
                problems.append(f"{self._describe(index[id(p)])} has {reason}")
        if problems and self._fused:
            raise RuntimeError(f"{type(self).__name__}(fused=True) cannot fuse: " + "; ".join(problems))
        if problems:
            warnings.warn(f"{type(self).__name__}: using the reference path for sharded parameters because "
                          + "; ".join(problems), stacklevel=4)
        self._fusable_cache[("sharded", id(group))] = (key, fusable)
        return fusable

    def _shard_unfusable(self, p: torch.Tensor, i: int) -> str | None:
        """Why parameter ``i`` (``p``, sharded or not) cannot take the split fused step."""
        t = _local(p)
        reason = unfusable_reason(t) or self._cuda_unfused(p, i)
        if reason is not None:
            return reason
        if t.device.type == "cuda" and _native.cuda_kernels() != "specialized":
            return (f"device {t.device} (the split fused step of sharded parameters runs on CUDA with the specialized "
                    "kernels only: QCONF_CUDA_KERNELS=specialized)")
        if t.device.type not in ("cpu", "cuda"):
            return f"device {t.device} (the split fused step runs on CPU and CUDA)"
        if not t.is_contiguous():  # (a plain parameter's eager step copies it: fused.GroupPlan.run)
            return "a non-contiguous parameter (the split fused step takes contiguous tensors)"
        geo = shard_geometry(p)
        for spec, codec in self.planned_states(i):
            if spec.slot in (Slot.ROW, Slot.COL):
                return "a factored second moment (the split fused step does not take it)"
            if geo is None or codec is None or not geo.shared_positions(codec).numel():
                continue
            eff = codec.effective_scale(geo.global_shape)
            if eff == "group":
                return (f"a shard boundary inside a {codec.group_size}-element block of {spec.key} (shape "
                        f"{geo.global_shape} split on dim 0; the fused kernel needs boundaries on block boundaries)")
            if eff == "tensor":  # the kernel keeps a small tensor's one block single-pass: no maxima
                return f"a tensor scale of {spec.key} shared by the shards (the fused kernel combines rank1/dim1 ones)"
            if spec.slot not in _COLUMN:
                return f"a quantized {spec.key} whose {codec.scale} scales span shards"
        return None

    def _reduce_shards(self, group: dict[str, Any], fused: list[torch.Tensor], index: dict[int, int],
                       shares: list[Share]) -> tuple[GroupPlan, torch.Tensor]:
        """The first half of the fused step of ``fused`` (one kernel call); appends the shared
        parts of its maxima to ``shares`` (views: combining them updates the maxima)."""
        locals_ = [_local(p) for p in fused]
        signature = self._spec_signature(group)

        def key() -> tuple:
            return (self._layout_version, tuple(index[id(p)] for p in fused), signature,
                    tuple(id(self.state.get(p)) for p in fused), tuple(t.data_ptr() for t in locals_))

        plan, maxima, offsets = self._kernel.reduce(("sharded", id(group)), key, lambda: self._fused_params(group, fused),
                                                    self._hyper(group), self._seed, [_local(p.grad) for p in fused])
        cached = self._fusable_cache.get(("shares", id(group)))
        if cached is None or cached[0] is not plan:  # the layout of a plan's maxima is fixed
            cached = (plan, self._share_layout(fused, index, offsets))
            self._fusable_cache[("shares", id(group))] = cached
        shares += [(key, geo, codec, maxima[start:end]) for key, geo, codec, start, end in cached[1]]
        return plan, maxima

    def _share_layout(self, fused: list[torch.Tensor], index: dict[int, int], offsets: torch.Tensor
                      ) -> list[tuple[tuple[int, str], ShardGeometry, Codec, int, int]]:
        """Where in the maxima of the plan of ``fused`` each state with shared scales lies:
        ((index, key), geometry, codec, start, end)."""
        layout = []
        for t, p in enumerate(fused):
            geo = shard_geometry(p)
            if geo is None:
                continue
            i = index[id(p)]
            for spec, codec in self.planned_states(i):
                if codec is None or not (shared := geo.shared_positions(codec)).numel():
                    continue
                start = int(offsets[t, _COLUMN[spec.slot]])
                if start < 0:  # _shard_unfusable let through a state the kernel does not reduce
                    raise RuntimeError(f"qconf: the fused kernel gave no maxima for {spec.key} of "
                                       f"{self._describe(i)}, whose scales span shards ({len(shared)} shared)")
                layout.append(((i, spec.key), geo, codec, start, start + codec.num_scales(geo.local_shape)))
        return layout
