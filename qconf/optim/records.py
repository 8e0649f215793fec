"""The record of a quantized state in a state dict, one layout whether or not the run was sharded.

``state_dict()`` writes a quantized state as::

    {"codes": uint8 [rows, packed_nbytes(inner, bits)], "scales": float32 [num_scales],
     "shape": [...], "codec": {...}, "packed": "rows"}

where ``rows`` is the state's dim 0 (1 for a 0-d state), ``inner`` the number of elements per
row, and each row of codes is packed on its own (:func:`qconf.codec.packing.pack_rows`). Sharded
runs (FSDP2 shards dim 0) save the same tensor as a DTensor placed like the parameter, so
``torch.distributed.checkpoint`` moves a checkpoint between any number of ranks and an unsharded
run: the saved and the loading shapes agree. Where a row's codes fill whole bytes (``inner * bits``
a multiple of 8: any 2-D state with an even row length at 4 bits) the record holds exactly the
bytes of the flat packing, and an unsharded state dict shares them with the optimizer; otherwise
each row's last byte is padded -- at worst a 1-D state takes a byte per element.

Older checkpoints still load: ``"packed"`` absent (or True) marks the flat packed codes that
unsharded runs wrote before (1-D, ``packed_nbytes(numel, bits)`` bytes), ``False`` the unpacked
codes (uint8 shaped like the state) that sharded runs wrote.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..codec import Codec, QTensor
from ..codec import packing
from .sharded import is_sharded

__all__ = ["PACKING", "ROWS", "row_geometry", "to_record", "from_record", "flat_codes"]

#: the record key that says how its codes are laid out
PACKING = "packed"
#: its value for codes packed row by row (what state_dict() writes)
ROWS = "rows"


def row_geometry(shape: tuple[int, ...] | list[int] | torch.Size) -> tuple[int, int]:
    """(rows, elements per row) of a state of ``shape``: dim 0 and the product of the others."""
    shape = tuple(shape)
    rows = shape[0] if shape else 1
    return rows, (math.prod(shape[1:]) if shape else 1)


def to_record(q: QTensor) -> dict[str, Any]:
    """The state-dict record of an unsharded quantized state (module docstring)."""
    bits = q.codec.bits
    rows, inner = row_geometry(q.shape)
    if (inner * bits) % 8 == 0:  # rows start on bytes: the flat packing, viewed as rows
        codes = q.codes.view(rows, inner * bits // 8)
    else:
        codes = packing.pack_rows(packing.unpack(q.codes, bits, rows * inner).view(rows, inner), bits)
    return {"codes": codes, "scales": q.scales, "shape": list(q.shape), "codec": q.codec.to_dict(), PACKING: ROWS}


def from_record(record: Mapping[str, Any], codec: Codec) -> QTensor:
    """The unsharded QTensor of a record in any layout, under ``codec`` (the record's own, parsed);
    ValueError names a wrong codes shape or dtype."""
    shape = list(record["shape"])
    return QTensor(flat_codes(record, codec, shape), record["scales"], torch.Size(shape), codec)


def flat_codes(record: Mapping[str, Any], codec: Codec, shape: list[int]) -> torch.Tensor:
    """The flat packed codes (``packed_nbytes(numel, bits)`` bytes, 1-D uint8) of a record in any of
    the layouts (module docstring) of a state of ``shape``; ValueError names a wrong shape or dtype."""
    codes, layout = record["codes"], record.get(PACKING, True)
    if layout is True:
        return codes
    if is_sharded(codes):  # a sharded run's record, loaded whole
        codes = codes.full_tensor()
    if layout is False:
        if codes.dtype != torch.uint8 or tuple(codes.shape) != tuple(shape):
            raise ValueError(f"unpacked codes must be uint8 of shape {tuple(shape)}, got {codes.dtype} "
                             f"{tuple(codes.shape)}")
        return packing.pack(codes.reshape(-1).to(torch.int64), codec.bits)
    if layout != ROWS:
        raise ValueError(f"'{PACKING}' must be {ROWS!r}, True or False, got {layout!r}")
    rows, inner = row_geometry(shape)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (rows, packing.packed_nbytes(inner, codec.bits)):
        raise ValueError(f"row-packed codes must be uint8 of shape {(rows, packing.packed_nbytes(inner, codec.bits))}"
                         f", got {codes.dtype} {tuple(codes.shape)}")
    if (inner * codec.bits) % 8 == 0:
        return codes.reshape(-1)
    return packing.pack(packing.unpack_rows(codes, codec.bits, inner), codec.bits)
