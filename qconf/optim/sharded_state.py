"""State dicts of sharded (FSDP2 / DTensor) parameters: the form ``torch.distributed.checkpoint``
reshards, and the way back to a rank's local states.

In ``state_dict()`` a sharded parameter's states are *global* objects, independent of the world
size that wrote them:

* a dense state is a DTensor with the parameter's placement (as torch.optim's own states);
* a quantized state is the record of :mod:`qconf.optim.records` (the layout an unsharded run
  writes too): ``codes`` packed row by row, ``[rows, bytes per row]`` uint8, as a DTensor with
  the parameter's placement, and ``scales`` the global tensor's scales (fp32, every rank holds
  all of them; the shards' scales are combined with one all-reduce per ``state_dict()``).

Rows are packed on their own so that codes reshard row by row like the parameter (a 4-bit shard
may start in the middle of a flat byte stream, never inside a row's bytes); scales are small
(1/group_size of the elements, or the sum of the dims for rank1). Loading re-slices both for the
loading rank's shard (no re-encoding); only a state saved under a different codec than the loading
optimizer's plan is decoded and re-encoded, collectively.
Every rank must call ``state_dict()`` / ``load_state_dict()`` together.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..codec import Codec, QTensor
from ..codec import packing
from .records import PACKING, ROWS, row_geometry
from .sharded import PendingEncode, ShardGeometry, ShardView, is_sharded, shard_geometry

__all__ = ["export_states", "import_qtensor", "import_dense", "convert_local", "agree"]


def _global_dtensor(local: torch.Tensor, p: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``local`` (this rank's rows of a tensor of global ``shape``, by default the parameter
    ``p``'s, sharded on dim 0 as ``p`` is) as a DTensor placed like ``p`` (a DTensor: its class
    builds it, so qconf need not import torch.distributed.tensor)."""
    shape = tuple(p.shape) if shape is None else shape
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return type(p).from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


def export_states(state: Mapping[Any, Mapping[str, Any]]) -> dict[Any, dict[str, Any]]:
    """``optimizer.state`` with every sharded parameter's states in their global form (module
    docstring); other entries unchanged. A collective when any parameter is sharded across ranks."""
    out: dict[Any, dict[str, Any]] = {}
    full_scales: list[tuple[ShardGeometry, torch.Tensor]] = []
    for p, entry in state.items():
        geo = shard_geometry(p) if isinstance(p, torch.Tensor) else None
        if geo is None:
            out[p] = dict(entry)
            continue
        new = {}
        for key, value in entry.items():
            if isinstance(value, QTensor):
                new[key] = _export_qtensor(value, p, geo, full_scales)
            elif isinstance(value, torch.Tensor) and key != "step":
                new[key] = _global_dtensor(value, p)
            else:
                new[key] = value
        out[p] = new
    groups: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for geo, scales in full_scales:
        if geo.group is not None:
            groups.setdefault(id(geo.group), (geo.group, []))[1].append(scales)
    for pg, parts in groups.values():  # shards hold disjoint or equal scales, all >= 0: max assembles them
        buf = torch.cat(parts)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=pg)
        start = 0
        for part in parts:
            part.copy_(buf[start:start + part.numel()])
            start += part.numel()
    return out


def _export_qtensor(q: QTensor, p: torch.Tensor, geo: ShardGeometry,
                    full_scales: list[tuple[ShardGeometry, torch.Tensor]]) -> dict[str, Any]:
    codec = q.codec
    lead = geo.lead(codec)
    rows, inner = row_geometry(geo.global_shape)
    local = packing.unpack(q.codes, codec.bits, q.numel())[lead:].reshape(geo.local_shape[0], inner)
    scales = torch.zeros(codec.num_scales(geo.global_shape), dtype=torch.float32)
    scales[geo.scale_positions(codec)] = q.scales.cpu()
    full_scales.append((geo, scales))
    codes = _global_dtensor(packing.pack_rows(local, codec.bits), p, (rows, packing.packed_nbytes(inner, codec.bits)))
    return {"codes": codes, "scales": scales.to(q.scales.device), "shape": list(geo.global_shape),
            "codec": codec.to_dict(), PACKING: ROWS}


def _rows(value: torch.Tensor, p: torch.Tensor, geo: ShardGeometry, fail: Callable[[str], None], what: str,
          shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """This rank's rows of a tensor of global ``shape`` (by default the parameter's) with the
    parameter's rows: the local part of a DTensor placed like ``p``, or a slice of a full tensor."""
    shape = geo.global_shape if shape is None else shape
    if is_sharded(value):
        if tuple(value.shape) != shape or value.placements != p.placements:
            fail(f"{what} is a DTensor {tuple(value.shape)} {value.placements}, expected {shape} {p.placements}")
        return value.to_local()
    if tuple(value.shape) != shape:
        fail(f"{what} has shape {tuple(value.shape)}, expected {shape}")
    return value[geo.row_start:geo.row_start + geo.local_shape[0]] if geo.global_shape else value


def import_dense(value: Any, p: torch.Tensor, fail: Callable[[str], None], what: str) -> torch.Tensor:
    """A dense state of sharded ``p`` from a checkpoint: this rank's rows (a new tensor)."""
    geo = shard_geometry(p)
    if not isinstance(value, torch.Tensor):
        fail(f"{what} must be a tensor or a quantized-state dict, got {type(value).__name__}")
    return _rows(value, p, geo, fail, what).detach().clone()


def import_qtensor(record: Mapping[str, Any], codec: Codec, p: torch.Tensor, fail: Callable[[str], None],
                   what: str) -> QTensor:
    """The local QTensor of sharded ``p`` from a global quantized record (any codes layout of
    :mod:`qconf.optim.records`), under the record's own ``codec``; scales and codes are
    re-sliced, never re-encoded."""
    geo = shard_geometry(p)
    codes, scales = record["codes"], record["scales"]
    if is_sharded(scales):
        scales = scales.full_tensor()
    if scales.dtype != torch.float32 or tuple(scales.shape) != (codec.num_scales(geo.global_shape),):
        fail(f"{what}: 'scales' must be float32 of shape ({codec.num_scales(geo.global_shape)},), got "
             f"{scales.dtype} {tuple(scales.shape)}")
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):  # all of them: one check on every rank
        fail(f"{what}: has NaN, infinite or negative scales")
    layout = record.get(PACKING, True)
    if layout == ROWS:
        rows, inner = row_geometry(geo.global_shape)
        nbytes = packing.packed_nbytes(inner, codec.bits)
        if codes.dtype != torch.uint8:
            fail(f"{what}: row-packed 'codes' must be uint8, got {codes.dtype}")
        local = _rows(codes, p, geo, fail, f"{what}: 'codes'", (rows, nbytes))
        local = packing.unpack_rows(local, codec.bits, inner).reshape(-1)
    elif layout is False:
        if codes.dtype != torch.uint8:
            fail(f"{what}: unpacked 'codes' must be uint8, got {codes.dtype}")
        local = _rows(codes, p, geo, fail, f"{what}: 'codes'").reshape(-1).to(torch.int64)
    elif layout is True:
        numel = math.prod(geo.global_shape)
        if codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() != packing.packed_nbytes(numel, codec.bits):
            fail(f"{what}: 'codes' must be 1-D uint8 with {packing.packed_nbytes(numel, codec.bits)} bytes")
        local = packing.unpack(codes, codec.bits, numel)[geo.offset:geo.offset + geo.local_numel]
    else:
        fail(f"{what}: '{PACKING}' must be {ROWS!r}, True or False, got {layout!r}")
    lead = geo.lead(codec)
    if lead:
        local = torch.cat([local.new_zeros(lead), local])
    shape = geo.state_shape(codec)
    return QTensor(packing.pack(local.to(p.device), codec.bits),
                   scales.to(p.device)[geo.scale_positions(codec).to(p.device)].clone(), torch.Size(shape), codec)


def convert_local(value: QTensor | torch.Tensor, codec: Codec | None, dtype: torch.dtype, p: torch.Tensor,
                  state: dict[str, Any], key: str, pending: list[PendingEncode]) -> QTensor | torch.Tensor:
    """A loaded local state of sharded ``p`` re-expressed under ``codec`` (None: a ``dtype``
    tensor). Encoding needs the other ranks' maxima, so a state to encode is queued in
    ``pending`` (for ``finish_encodes``, which replaces ``state[key]``) and returned as is."""
    if isinstance(value, QTensor) and value.codec == codec:
        return value
    view = ShardView(p.to_local(), p.to_local(), shard_geometry(p))
    x = view.decode(value) if isinstance(value, QTensor) else value
    if codec is None:
        return x.to(dtype)
    pending.append(PendingEncode.of(state, key, codec, view.pad(x, codec), None, view.geometry))
    return value


def agree(ok: bool, params: list[torch.Tensor]) -> bool:
    """Whether every rank of every process group the sharded ``params`` use reports ``ok`` (one
    all-reduce(min) per group), so that a checkpoint refused on one rank is refused on all and no
    rank waits in a later collective."""
    result = ok
    seen: set[int] = set()
    for p in params:
        geo = shard_geometry(p)
        if geo is None or geo.group is None or id(geo.group) in seen:
            continue
        seen.add(id(geo.group))
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=geo.group)
        result = result and bool(flag.item())
    return result
