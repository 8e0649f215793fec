"""A codec as the native kernels see it: its lookup tables and its integer descriptor.

This module is the one place that translates a :class:`~qconf.codec.Codec` for the kernels; both
the fused optimizer step (:mod:`qconf.optim.fused`) and the native encode/decode below use it.
Positions of the descriptor's fields come from the extension (:func:`qconf._native.layout`).

* :func:`codec_table` -- the float32 ``[12, 256]`` lookup tables of a codec (cached per codec:
  codecs are immutable and the 8-bit octave-line fit is not free).
* :func:`scale_layout` -- how stored scales map to elements after the rank fallbacks.
* :func:`codec_descriptor` -- the codec's integer fields (bits, levels, scale kind, block, d1,
  inner, stochastic) in the kernels' order.
* :func:`encode` / :func:`decode` -- ``torch.ops.qconf.encode/decode`` on one tensor.
* :func:`check_native` -- the codecs the kernels cannot run (absmean scales, a ``min_scale``
  floor, ``nearest-even`` rounding) are refused with a ``ValueError`` by all of the above.
"""
from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch

from .._native import layout, native_available, native_error
from .octave_lines import octave_lines
from .segment_lines import segment_lines
from .value_lines import value_lines

__all__ = ["TABLE_ROWS", "TABLE_SIZE", "midpoint_grid", "codec_table", "scale_layout", "codec_descriptor",
           "encode", "decode", "check_native"]

TABLE_ROWS, TABLE_SIZE = 12, 256  # the table format below (the kernels check them: layout "table.*")


def midpoint_grid(mids: torch.Tensor) -> tuple[float, float]:
    """(L, c) when the float32 midpoints are exactly ``(k + c) / L`` for k = 0, 1, ...: L a power
    of two (at most 2**16) and c - 1/2 a non-negative integer, e.g. power-1 maps ((k + 1.5) / 16
    at 4 bits). Then the nearest code is ``clamp(ceil(n * L - c), 0, levels - 1)``, exact in
    float32 (the kernel's proof is at FastQuantizer in csrc/include/qconf/quantizer.h). (0, 0)
    otherwise."""
    m = mids.double()
    if m.numel() < 2:
        return 0.0, 0.0
    step = float(m[1] - m[0])
    if step <= 0:
        return 0.0, 0.0
    L = 1.0 / step
    mant, _ = math.frexp(L)
    c = float(m[0]) * L
    o = c - 0.5
    if mant != 0.5 or not 1.0 <= L <= 2.0 ** 16 or o < 0 or o != math.floor(o):
        return 0.0, 0.0
    grid = (torch.arange(m.numel(), dtype=torch.float64) + c) / L
    return (L, c) if torch.equal(grid, m) else (0.0, 0.0)


def _shifted(table: torch.Tensor, steps: tuple[int, ...]) -> torch.Tensor:
    """Copies of ``table`` shifted by each binary-search step (``t[min(j + s, n - 1)]``), so a
    probe ``table[c + s - 1]`` becomes a plain permute at ``c``."""
    n = table.numel()
    return torch.cat([table[(torch.arange(n) + s).clamp(max=n - 1)] for s in steps])


def _planes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """256 float32 values as 16-bit planes (low halves, then high halves) and as byte planes
    (byte 0 of all, then byte 1, 2, 3), raw bits in float32 storage (little-endian)."""
    b = values.contiguous().view(torch.uint8).reshape(TABLE_SIZE, 4)
    words = torch.cat([b[:, 0:2].reshape(-1), b[:, 2:4].reshape(-1)]).view(torch.float32)
    return words, b.t().contiguous().reshape(-1).view(torch.float32)


def check_native(codec: Any) -> None:
    """Raise ``ValueError`` unless the kernels can run ``codec``: they compute absmax scales with
    only the FLT_MIN floor and round ``nearest`` or ``stochastic`` through the codec's tables."""
    why = []
    if codec.statistic != "absmax":
        why.append(f"statistic {codec.statistic!r} (they compute absmax scales)")
    if codec.min_scale > 0:
        why.append(f"min_scale={codec.min_scale!r} (they have no scale floor)")
    if codec.rounding not in ("nearest", "stochastic"):
        why.append(f"rounding {codec.rounding!r} (they round nearest or stochastic)")
    if why:
        raise ValueError(f"the native kernels cannot run {codec!r}: {'; '.join(why)}. Use backend='reference' "
                         "(or Codec.encode_integers / decode_integers for integer-grid codecs)")


@functools.lru_cache(maxsize=1024)
def codec_table(codec: Any) -> torch.Tensor:
    """The kernel's lookup tables of a codec, float32 [12, 256] (shared: do not modify):

    0. qmap (padded with its last value); 1. midpoints then +inf; 2. qmap then +inf;
    3. coarse16: midpoints[16k+15] (16), qmap+inf[16k+15] (16)   -- first 4 search levels;
       then at [32], [33] the grid (L, c) of the midpoints, or (0, 0): see ``midpoint_grid``;
       then from [64] the 16-entry search tables shifted by 3 and by 1 (``t[min(j + s, 15)]``),
       16 each: midpoints[:16], qmap+inf[:16], coarse16 midpoints, coarse16 qmap+inf
    4. coarse32: midpoints[8k+7] (32), qmap+inf[8k+7] (32)        -- 8-bit permute search;
       then from [64] both shifted by 7, 3 and 1 (``t[min(j + s, 31)]``), 32 each
    5. columns of the midpoints: [j*32 + k] = midpoints[8k+j], j < 7
    6. columns of qmap+inf:      [j*32 + k] = qsearch[8k+j], j < 7
    7. 5- to 8-bit maps: the octave lines of the midpoints (:mod:`qconf.codec.octave_lines`), or
       zeros (search; 4-bit maps keep their 16-entry search, which is as cheap); 8-bit maps with
       octave lines also the segment lines from [162] (:mod:`qconf.codec.segment_lines`) where
       they are exact; 8-bit maps of 256 values the value lines from [205]
       (:mod:`qconf.codec.value_lines`) where they are exact
    8, 9. rows 0 and 1 as 16-bit planes: the low halves of the 256 entries, then the high halves
    10, 11. rows 0 and 1 as byte planes: byte 0 of the 256 entries, then byte 1, 2, 3
       (raw bits in float32 storage, for the kernels' byte/word permutes: ``Isa::lookup256n``)

    ``csrc/include/qconf/step_types.h:point_tables`` reads this format. Raises ``ValueError`` for
    a codec the kernels cannot run (:func:`check_native`).
    """
    check_native(codec)
    qmap = codec.qmap
    levels = qmap.numel()
    inf = torch.full((TABLE_SIZE,), math.inf)
    t = torch.zeros(TABLE_ROWS, TABLE_SIZE)
    t[0, :levels] = qmap
    t[0, levels:] = qmap[-1]
    mids = inf.clone()
    mids[: levels - 1] = codec.midpoints
    qsearch = inf.clone()
    qsearch[:levels] = qmap
    t[1], t[2] = mids, qsearch
    coarse = torch.arange(15, TABLE_SIZE, 16)
    t[3, :16] = mids[coarse]
    t[3, 16:32] = qsearch[coarse]
    t[3, 32], t[3, 33] = midpoint_grid(codec.midpoints)
    coarse32 = torch.arange(7, TABLE_SIZE, 8)
    t[4, :32] = mids[coarse32]
    t[4, 32:64] = qsearch[coarse32]
    t[3, 64:192] = torch.cat([_shifted(x, (3, 1)) for x in (mids[:16], qsearch[:16], t[3, :16], t[3, 16:32])])
    t[4, 64:256] = torch.cat([_shifted(x, (7, 3, 1)) for x in (t[4, :32], t[4, 32:64])])
    cols = torch.arange(32) * 8
    for j in range(7):
        t[5, j * 32:(j + 1) * 32] = mids[cols + j]
        t[6, j * 32:(j + 1) * 32] = qsearch[cols + j]
    lines = octave_lines(codec.midpoints) if codec.bits >= 5 else None
    if lines is not None:
        t[7] = lines
        segments = segment_lines(codec.midpoints, lines) if codec.bits == 8 else None
        if segments is not None:
            t[7] = segments
    if codec.bits == 8:
        t[7] = value_lines(qmap.to(torch.float32), t[7])
    t[8], t[10] = _planes(t[0])
    t[9], t[11] = _planes(t[1])
    return t


def scale_layout(codec: Any, shape: tuple[int, ...]) -> tuple[str, int, int, int]:
    """``(kind, block, d1, inner)`` of ``codec`` on ``shape`` after the rank fallbacks: kind
    ``"block"`` (contiguous blocks of ``block`` elements: group, dim0 rows, the whole tensor),
    ``"dim1"`` (element i uses scale ``(i // inner) % d1``) or ``"rank1"``."""
    numel = math.prod(shape)
    eff = codec.effective_scale(shape)
    if eff == "tensor":
        return "block", max(numel, 1), 0, 0
    if eff == "dim0":
        return "block", max(numel // shape[0], 1), 0, 0
    if eff == "group":
        return "block", codec.group_size, 0, 0
    if eff == "dim1":
        return "dim1", 0, shape[1], max(math.prod(shape[2:]), 1)
    return "rank1", 0, 0, 0


def codec_descriptor(codec: Any, shape: tuple[int, ...]) -> list[int]:
    """The codec's integer fields for a tensor of ``shape``, in the kernels' order
    (``layout()["codec.len"]`` ints: bits, levels, scale kind, block, d1, inner, stochastic).
    Raises ``ValueError`` for a codec the kernels cannot run (:func:`check_native`)."""
    check_native(codec)
    lay = layout()
    kind, block, d1, inner = scale_layout(codec, shape)
    desc = [0] * lay["codec.len"]
    fields = {"bits": codec.bits, "levels": codec.qmap.numel(), "scale_kind": lay[f"scale.{kind}"], "block": block,
              "d1": d1, "inner": inner, "stochastic": int(codec.rounding == "stochastic")}
    for name, value in fields.items():
        desc[lay[f"codec.{name}"]] = value
    return desc


def _missing_extension() -> str:
    """Why ``backend="native"`` cannot run, and what to do instead."""
    if importlib.util.find_spec("qconf._C") is None:
        why = "which this installation of qconf does not have (it was built with QCONF_NO_EXT=1 or without a compiler)"
    else:
        why = f"which failed to load ({native_error() or 'it has no encode/decode kernels'})"
    return (f"backend='native' needs the compiled extension qconf._C, {why}; use backend='reference' (the same "
            "codes and scales), or reinstall qconf with `pip install --no-build-isolation .` to build it")


def _encode_args(codec: Any, shape: tuple[int, ...]) -> tuple[torch.Tensor, list[int]]:
    """The table and the ``codec`` int list of ``qconf::encode`` / ``qconf::decode``."""
    if not native_available() or not hasattr(torch.ops.qconf, "encode"):
        raise RuntimeError(_missing_extension())
    lay = layout()
    if len(shape) > lay["max_dims"]:
        raise ValueError(f"backend='native' handles at most {lay['max_dims']} dimensions, got {len(shape)}")
    desc = codec_descriptor(codec, shape) + [0] * (lay["encode.len"] - lay["codec.len"])
    desc[lay["encode.num_scales"]] = codec.num_scales(shape)
    return codec_table(codec), desc


def encode(codec: Any, x32: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes (uint8) and scales (fp32) of a non-empty fp32 CPU tensor ``x32`` (any shape,
    at most 8 dims) by the compiled kernel; ``noise`` (fp32, one uniform per element) is required
    for stochastic rounding."""
    table, desc = _encode_args(codec, tuple(x32.shape))
    if noise is not None:
        noise = noise.to(torch.float32).reshape(x32.shape).contiguous()
    return torch.ops.qconf.encode(x32.contiguous(), table, desc, noise)


def decode(codec: Any, codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 values of ``shape`` from packed ``codes`` and ``scales`` by the compiled kernel."""
    table, desc = _encode_args(codec, shape)
    return torch.ops.qconf.decode(codes, scales, table, desc, list(shape))
