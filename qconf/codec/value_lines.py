"""Value lines: an 8-bit map's values from its code by arithmetic, with no table lookup (AVX2 kernels).

Decoding ``qmap[code]`` for 8 codes at once needs a 256-entry lookup. AVX-512 holds the table in
registers; AVX2 has only a gather, which costs more than twenty vector operations on the CPUs
that lack AVX-512 (and more again under the Gather Data Sampling mitigation). Maps whose values lie
on at most 8 lines over power-of-two runs of codes (the dynamic-exponent map: one run per decade)
get this form instead, in 32-bit integer and float32 lane arithmetic:

    t = (code << s) - C                      (s = 0, C = 0 for unsigned maps; s = 1 and the
                                              centre C = 2 * code of zero for mirrored signed ones)
    x = float(|t| + 1),  d = exponent(x) & 7 (the run: codes with |t| + 1 in [2**e, 2**(e+1)))
    y = fma(x, S[d], A[d])                   (the run's line, float32)
    i = |t| >> s                             (the correction index: the code, or its mirror's)
    f = (Wd[i >> 4] >> 2 (i & 15)) & 3       (2 bits per index, 16 per 32-bit word)
    value = bits(y) + B[d] + f, with the sign bit of t   (an integer add on the float's bits)

So the line gets each value to within 3 units in the last place and the 2-bit correction, offset
by the run's bias ``B``, gives its exact bits. Whether this reproduces the map is checked, not
assumed: :func:`values_exact` runs the same arithmetic for all 256 codes and compares bits.

Row layout: entries ``[205, 248)`` of row 7 of :func:`qconf.codec.native.codec_table` (after the
octave and segment lines), the ``VAL_*`` offsets; s, C and B are small integers as floats, the
words ``Wd`` raw uint32 bits in the float32 storage. ``csrc/include/qconf/layout.h`` has the same
offsets.
"""
from __future__ import annotations

import functools

import torch

from .octave_lines import fma32

RUNS = 8
WORDS = 16  # correction words: 16 indices each, 256 in all
VAL_SHIFT = 205  # s: 0 or 1
VAL_CENTER = 206  # C
VAL_SLOPE = 207  # S[0..7]
VAL_OFFSET = 215  # A[0..7]
VAL_BIAS = 223  # B[0..7]
VAL_WORDS = 231  # Wd[0..15] (uint32 bits)
VAL_PRESENT = 247  # 1.0 when the value lines are set and exact
VAL_END = 248
_SEARCH = 16  # float32 steps tried around each least-squares slope and offset


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).view(torch.int32).long()


def _u32_as_f32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as those uint32 bits in float32 storage."""
    return (v - ((v >= 1 << 31).long() << 32)).to(torch.int32).view(torch.float32)


def _index(codes: torch.Tensor, shift: int, center: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t, x, d) of int64 codes: t = (code << s) - C, x = float(|t| + 1), d = exponent(x) & 7."""
    t = (codes << shift) - center
    x = (t.abs() + 1).to(torch.float32)
    return t, x, (x.view(torch.int32).long() >> 23) & (RUNS - 1)


def decode(row: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The kernels' value-lines decode of int64 ``codes`` (0..255) by ``row`` (row 7), float32."""
    shift = int(row[VAL_SHIFT])
    center = int(row[VAL_CENTER])
    t, x, d = _index(codes, shift, center)
    y = fma32(x, row[VAL_SLOPE:VAL_SLOPE + RUNS][d], row[VAL_OFFSET:VAL_OFFSET + RUNS][d])
    i = t.abs() >> shift
    words = row[VAL_WORDS:VAL_WORDS + WORDS].view(torch.int32).long() & 0xFFFFFFFF
    f = (words[(i >> 4) & (WORDS - 1)] >> (2 * (i & 15))) & 3
    bias = row[VAL_BIAS:VAL_BIAS + RUNS].long()[d]
    v = (_bits(y) + bias + f) & 0xFFFFFFFF
    return _u32_as_f32(v ^ (t < 0).long() << 31)


def values_exact(row: torch.Tensor, qmap: torch.Tensor) -> bool:
    """Whether the value lines of ``row`` give exactly the bits of ``qmap`` (256 entries) for every code."""
    form = (float(row[VAL_SHIFT]), float(row[VAL_CENTER]))
    if row[VAL_PRESENT] != 1.0 or qmap.numel() != 256 or not (form == (0.0, 0.0) or form[0] == 1.0):
        return False  # (the kernels read s = 0 as C = 0)
    got = decode(row, torch.arange(256))
    return torch.equal(got.view(torch.int32), qmap.to(torch.float32).contiguous().view(torch.int32))


def _fit_run(x: torch.Tensor, target: torch.Tensor) -> tuple[float, float, int, torch.Tensor] | None:
    """(S, A, B, f) for one run: the line through (x, |value|) nearest the least-squares one whose
    bit errors span at most 3 (B their minimum, f = error - B), or None."""
    xd, yd = x.double(), target.double()
    if bool((x == x[0]).all()):
        slope, offset = torch.tensor(0.0), target[0].clone()
    else:
        a = torch.stack([xd, torch.ones_like(xd)], 1)
        sol = torch.linalg.lstsq(a, yd.unsqueeze(1)).solution.squeeze(1)
        slope, offset = sol[0].to(torch.float32), sol[1].to(torch.float32)
    steps = torch.tensor(sorted(range(-_SEARCH, _SEARCH + 1), key=abs), dtype=torch.int32)
    offsets = (offset.to(torch.float32).view(torch.int32) + steps).view(torch.float32)
    for ds in steps.tolist():
        s = (slope.to(torch.float32).view(torch.int32) + ds).view(torch.float32)
        y = fma32(x.expand(len(offsets), -1), s.expand(len(offsets), len(x)), offsets.unsqueeze(1).expand(-1, len(x)))
        err = _bits(target).unsqueeze(0) - _bits(y)
        ok = ((err.max(1).values - err.min(1).values) <= 3) & ((y >= 0) | (target == 0)).all(1)
        if bool(ok.any()):
            j = int(ok.nonzero()[0])
            lo = int(err[j].min())
            return float(s), float(offsets[j]), lo, err[j] - lo
    return None


@functools.lru_cache(maxsize=64)
def _fit(qmap_bits: bytes) -> torch.Tensor | None:
    qmap = torch.frombuffer(bytearray(qmap_bits), dtype=torch.float32)
    codes = torch.arange(256)
    signed = bool(qmap[0] < 0)
    for shift, center in ((1, 254), (1, 255)) if signed else ((0, 0),):
        t, x, d = _index(codes, shift, center)
        target = qmap.abs() if signed else qmap
        row = torch.zeros(256)
        bias, field = [0] * RUNS, torch.zeros(256, dtype=torch.long)
        for r in range(RUNS):
            m = d == r
            if not bool(m.any()):
                continue
            fit = _fit_run(x[m], target[m])
            if fit is None:
                break
            row[VAL_SLOPE + r], row[VAL_OFFSET + r], bias[r], field[(t.abs() >> shift)[m]] = fit
        else:
            words = [int(sum(int(field[w * 16 + j]) << (2 * j) for j in range(16))) for w in range(WORDS)]
            row[VAL_SHIFT] = float(shift)
            row[VAL_CENTER] = float(center)
            row[VAL_BIAS:VAL_BIAS + RUNS] = torch.tensor(bias, dtype=torch.float32)
            row[VAL_WORDS:VAL_WORDS + WORDS] = _u32_as_f32(torch.tensor(words))
            row[VAL_PRESENT] = 1.0
            if values_exact(row, qmap):
                return row
    return None


def value_lines(qmap: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Row 7 ``row`` with the value lines of ``qmap`` (float32, 256 sorted values) added where some
    exist and are exact, else ``row`` unchanged."""
    if qmap.numel() != 256:
        return row
    fit = _fit(qmap.to(torch.float32).contiguous().numpy().tobytes())
    if fit is None:
        return row
    out = row.clone()
    out[VAL_SHIFT:VAL_END] = fit[VAL_SHIFT:VAL_END]
    return out
