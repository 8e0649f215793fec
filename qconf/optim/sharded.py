"""Parameters sharded by FSDP2 (``fully_shard``): DTensors sharded on dim 0 of a 1-D device mesh.

The quantization of a state is a property of the *global* parameter (DESIGN.md "Distributed"): the
plan comes from the global name and shape, and the scales are those the unsharded run stores. Each
rank keeps the codes of its own elements and the scales they use (:class:`ShardGeometry`):

* ``group``: the blocks of the global flattened tensor that its elements touch. A shard that starts
  inside a block keeps ``lead`` padding codes in front of its own (``lead`` = its first element's
  position in that block, < group_size), so that its blocks line up with its codes; its state is
  then a 1-D QTensor of ``lead + n`` elements.
* ``rank1``: its rows' maxima ``R_0`` and the global ``R_1, R_2, ...``; ``dim1``: the global column
  maxima; ``tensor``: the global maximum; ``dim0``: its rows' maxima.

A scale that elements on several ranks share -- a block that a shard boundary splits, every
``R_d`` with d >= 1, dim1 and tensor scales -- is the max of the ranks' partial maxima; each step
the shared values of every state go through one all-reduce (max) per process group
(:func:`combine_scales`). A max is exact and independent of order, so the stored scales, codes and
parameters equal the single-process run's bit for bit. Random numbers for stochastic rounding are
drawn by *global* element index (``offset``), so they match too. docs/distributed.md has the
semantics and the cases where invariance does not hold.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..codec import Codec, QTensor
from ..codec.scales import compute_scales, floor_scales

__all__ = ["ShardGeometry", "ShardView", "PendingEncode", "shard_geometry", "combine_scales", "finish_encodes",
           "store_encodes", "is_sharded"]


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor (a parameter of an FSDP2 / tensor-parallel module). A DTensor
    exists only once its module is imported, so qconf does not import it (0.7 s of every start)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(p, dtensor.DTensor)


@dataclasses.dataclass(frozen=True)
class ShardGeometry:
    """Where a rank's shard lies in its global parameter.

    Attributes:
        global_shape / local_shape: the parameter's and the shard's shape.
        row_start: the global dim-0 index of the shard's first row.
        offset: the global flat (row-major) index of the shard's first element.
        boundaries: global flat indexes where one rank's shard ends and the next one's begins
            (strictly inside the tensor).
        group: the process group whose ranks share scales; None when nothing is split (a
            replicated parameter, or a mesh of one rank).
    """

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    row_start: int
    offset: int
    boundaries: tuple[int, ...]
    group: Any

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def lead(self, codec: Codec) -> int:
        """Padding codes in front of the shard's own for ``codec`` (non-zero only for group
        scales when the shard starts inside a block)."""
        if self.local_numel == 0 or codec.effective_scale(self.global_shape) != "group":
            return 0
        return self.offset % codec.group_size

    def state_shape(self, codec: Codec | None) -> tuple[int, ...]:
        """Shape of the shard's state under ``codec`` (None: a dense state)."""
        lead = 0 if codec is None else self.lead(codec)
        return (lead + self.local_numel,) if lead else self.local_shape

    def scale_positions(self, codec: Codec) -> torch.Tensor:
        """int64 [num local scales]: the global index (in the unsharded QTensor's scales) of each
        scale the shard stores."""
        return _scale_positions(self, codec)

    def shared_positions(self, codec: Codec) -> torch.Tensor:
        """int64, sorted: the global scale indexes whose value needs the max over ranks."""
        return _shared_positions(self, codec)


@functools.lru_cache(maxsize=4096)
def _scale_positions(geo: ShardGeometry, codec: Codec) -> torch.Tensor:
    eff = codec.effective_scale(geo.global_shape)
    d0, rows = geo.global_shape[0] if geo.global_shape else 1, geo.local_shape[0] if geo.local_shape else 1
    own_rows = torch.arange(geo.row_start, geo.row_start + rows)
    if eff == "tensor":
        return torch.zeros(1, dtype=torch.int64)
    if eff == "dim0":
        return own_rows
    if eff == "dim1":
        return torch.arange(geo.global_shape[1])
    if eff == "group":
        first = (geo.offset - geo.lead(codec)) // codec.group_size
        return torch.arange(first, first + codec.num_scales(geo.state_shape(codec)))
    return torch.cat([own_rows, d0 + torch.arange(sum(geo.global_shape[1:]))])


@functools.lru_cache(maxsize=4096)
def _shared_positions(geo: ShardGeometry, codec: Codec) -> torch.Tensor:
    eff = codec.effective_scale(geo.global_shape)
    if geo.group is None or eff == "dim0":
        return torch.zeros(0, dtype=torch.int64)
    if eff == "tensor":
        return torch.zeros(1, dtype=torch.int64)
    if eff == "dim1":
        return torch.arange(geo.global_shape[1])
    if eff == "group":
        g = codec.group_size
        return torch.tensor(sorted({b // g for b in geo.boundaries if b % g}), dtype=torch.int64)
    return geo.global_shape[0] + torch.arange(sum(geo.global_shape[1:]))


def shard_geometry(p: torch.Tensor) -> ShardGeometry | None:
    """The geometry of a sharded parameter ``p`` (None for a plain tensor). qconf takes DTensors
    on a 1-D mesh, sharded on dim 0 (FSDP2, with torch.chunk's split) or replicated; anything else
    is a ``ValueError`` naming what is allowed."""
    if not is_sharded(p):
        return None
    mesh, placements = p.device_mesh, p.placements
    if p.is_complex():
        raise ValueError("complex DTensor parameters are not supported; shard the real view instead")
    if mesh.ndim != 1 or len(placements) != 1:
        raise ValueError(f"DTensor parameters on a {mesh.ndim}-D mesh ({placements}) are not supported; qconf "
                         "takes a 1-D mesh with Shard(0) (FSDP2's fully_shard) or Replicate()")
    global_shape, local_shape = tuple(p.shape), tuple(p.to_local().shape)
    placement = placements[0]
    if placement.is_replicate() or mesh.size() == 1:
        return ShardGeometry(global_shape, local_shape, 0, 0, (), None)
    if not (placement.is_shard() and placement.dim == 0 and global_shape):
        raise ValueError(f"DTensor placement {placement} is not supported; qconf takes Shard(0) (FSDP2's "
                         "fully_shard) or Replicate() on a 1-D mesh")
    world, rank = mesh.size(), mesh.get_local_rank()
    d0, row = global_shape[0], math.prod(global_shape[1:])
    chunk = -(-d0 // world)
    starts = [min(r * chunk, d0) for r in range(world)]
    rows = min(chunk, d0 - starts[rank])
    if local_shape != (rows,) + global_shape[1:]:
        raise ValueError(f"the local shard {local_shape} of a {global_shape} DTensor on rank {rank} of {world} "
                         f"is not torch.chunk's split on dim 0 ({(rows,) + global_shape[1:]}); not supported")
    boundaries = tuple(sorted({s * row for s in starts[1:] if 0 < s * row < d0 * row}))
    return ShardGeometry(global_shape, local_shape, starts[rank], starts[rank] * row, boundaries, mesh.get_group())


@dataclasses.dataclass(frozen=True)
class ShardView:
    """A sharded parameter as the reference step sees it: the local ``param`` and ``grad``."""

    param: torch.Tensor
    grad: torch.Tensor
    geometry: ShardGeometry

    def decode(self, q: QTensor) -> torch.Tensor:
        """fp32 values of the shard's own elements (the padding codes dropped), local shape."""
        x = q.decode()
        lead = self.geometry.lead(q.codec)
        return x[lead:].reshape(self.geometry.local_shape) if lead else x

    def pad(self, x: torch.Tensor, codec: Codec) -> torch.Tensor:
        """fp32 ``x`` (local shape) in the state's shape: ``lead`` zeros in front when padded."""
        lead = self.geometry.lead(codec)
        x = x.float()
        return torch.cat([x.new_zeros(lead), x.reshape(-1)]) if lead else x

    def noise_offset(self, codec: Codec) -> int:
        """Global element index of the state's first (possibly padding) element."""
        return self.geometry.offset - self.geometry.lead(codec)


@dataclasses.dataclass
class PendingEncode:
    """A sharded state's new fp32 ``values`` (state shape) waiting for its shared scales;
    ``scales`` starts as the shard's own maxima (:func:`combine_scales` completes them)."""

    state: dict[str, Any]
    key: str
    codec: Codec
    values: torch.Tensor
    noise: torch.Tensor | None
    geometry: ShardGeometry
    scales: torch.Tensor

    @classmethod
    def of(cls, state: dict[str, Any], key: str, codec: Codec, values: torch.Tensor, noise: torch.Tensor | None,
           geometry: ShardGeometry) -> "PendingEncode":
        return cls(state, key, codec, values, noise, geometry, compute_scales(values, codec.scale, codec.group_size))


def combine_scales(items: list[tuple[ShardGeometry, Codec, torch.Tensor]]) -> None:
    """Replace, in place, every shared scale of each ``(geometry, codec, scales)`` by its max over
    the ranks: one ``all_reduce(MAX)`` per process group for all items. Every rank must call it
    with the same states in the same order (the buffer layout depends on global shapes only)."""
    groups: dict[int, tuple[Any, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
    for geo, codec, scales in items:
        if geo.group is None:
            continue
        count, mask, where = _share_index(geo, codec)
        if count == 0:
            continue
        segment = torch.zeros(count, dtype=torch.float32)
        segment[where] = scales[mask].cpu()
        groups.setdefault(id(geo.group), (geo.group, []))[1].append((segment, scales, mask, where))
    for pg, parts in groups.values():
        buf = torch.cat([segment for segment, *_ in parts])
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=pg)
        start = 0
        for segment, scales, mask, where in parts:
            scales[mask] = buf[start:start + segment.numel()][where].to(scales.device)
            start += segment.numel()


@functools.lru_cache(maxsize=4096)
def _share_index(geo: ShardGeometry, codec: Codec) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(number of shared scales, which of the shard's scales are shared (bool mask), and the
    position of each of those among the shared ones)."""
    shared, pos = geo.shared_positions(codec), geo.scale_positions(codec)
    mask = torch.isin(pos, shared)
    return shared.numel(), mask, torch.searchsorted(shared, pos[mask])


def finish_encodes(pending: list[PendingEncode]) -> None:
    """Combine the pending states' shared scales across ranks and store their new QTensors."""
    combine_scales([(e.geometry, e.codec, e.scales) for e in pending])
    store_encodes(pending)


def store_encodes(pending: list[PendingEncode]) -> None:
    """Store the pending states' new QTensors once their shared scales are combined. The floor
    is applied again: a rank's partial maxima may come unfloored from the fused kernel."""
    for e in pending:
        e.state[e.key] = e.codec.encode(e.values, noise=e.noise, scales=floor_scales(e.scales))
