"""Octave-linear code estimates: nearest rounding onto a 256-entry map without a binary search.

The nearest code of a normalized value ``n`` is ``t(n) = #{k : mid[k] < n}`` over the sorted
float32 midpoints. Inside one binary octave of ``|n|`` most maps are linear in ``n``, or linear on
each side of one point where they get sparser: the dynamic-exponent map is linear inside each
decade (5x sparser above a decade boundary), the linear, float-point and power-1 maps inside each
octave. So per octave ``o`` of ``a = |n|`` (32 octaves: ``[2**-31, 1)``, everything below in
octave 0, ``[1, 2)``) the smaller of two lines gives an estimate

    j = min(fma(a, S1[o], A1[o]), fma(a, S2[o], A2[o]))   (fp32 fused multiply-adds)
    j = K - j  if n < 0          (signed maps: the negative midpoints mirror the positive ones)
    r = rint(j)                  (NaN -> 0)
    t = r + (mid[r] < n)         (one exact probe)

which is exact whenever ``t(n)`` is ``r`` or ``r + 1``: the lines put midpoint ``k`` at ``j ~ k``,
within 0.3 codes, and the minimum of a steep and a flat line switches from one to the other where
the map gets sparser (one line: S2 = S1, A2 = A1). Whether this holds is not assumed:
``lines_exact`` checks the estimate, in exactly the kernels' float32 arithmetic, at every point
where ``t``, the octave or the sign can change and at both ends of every interval between them.
Between two such points ``t`` is constant and the estimate is monotone (``S >= 0``; fp32 rounding,
``min`` and ``rint`` are monotone), so the check covers every float32 input: -0, subnormals,
values above 1, infinities and NaN (code 0). Maps it fails for (e.g. unsigned power-2 at 8 bits)
keep the binary search.

Unsigned maps (all midpoints positive) take ``a = max(n, 2**-31)`` (NaN and negatives -> 2**-31,
code 0) and no mirror; signed maps ``a = |n|`` with octave ``max(exponent, 96)``. ``a`` is capped
below 2 so the octave index stays in range. The octave is the biased exponent of ``a`` mod 32.

Row layout (row 7 of :func:`qconf.codec.native.codec_table`, float32[256]): ``[0:32]`` S1, ``[32:64]`` A1,
``[64:96]`` S2, ``[96:128]`` A2, ``[160]`` K, ``[161]`` the form: 0 none (binary search),
1 unsigned, 2 signed.
"""
from __future__ import annotations

import torch

OCTAVES = 32
TABLE = 256  # entries of the kernels' midpoint table (+inf after the last midpoint)
FIRST_EXPONENT = 96  # biased exponent of octave 0 (2**-31); 96 % 32 == 0, so `& 31` indexes
A_FLOOR = 2.0**-31  # unsigned maps: a = max(n, A_FLOOR) keeps the exponent >= 96
A_CAP = 1.9999998807907104  # largest float32 below 2: keeps the exponent <= 127
FORM_NONE, FORM_UNSIGNED, FORM_SIGNED = 0, 1, 2
_TOLERANCE = 0.3  # the largest line error (in codes) accepted at a midpoint before splitting


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _line(xs: torch.Tensor, ks: list[int]) -> tuple[float, float]:
    """The line through the first and last (midpoint, index) pair (constant for one point)."""
    if len(ks) == 1:
        return 0.0, float(ks[0])
    x0, x1 = float(xs[ks[0]]), float(xs[ks[-1]])
    s = (ks[-1] - ks[0]) / (x1 - x0)
    return s, ks[0] - s * x0


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors rounded once to float32 (to nearest, ties to even), as the
    kernels' fused multiply-add: the product is exact in float64, TwoSum gives the float64 sum's
    exact error, and a float64 sum that lands exactly halfway between two float32s (the only
    case where rounding it again could go the wrong way) is resolved by the error's sign."""
    p = a.to(torch.float32).double() * b.to(torch.float32).double()
    cd = c.to(torch.float32).double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    r = s.float()
    rd = r.double()
    up, down = torch.nextafter(r, _f32(float("inf"))), torch.nextafter(r, _f32(float("-inf")))
    r = torch.where((s > rd) & ((s - rd) == (up.double() - s)) & (err > 0), up, r)
    return torch.where((s < rd) & ((rd - s) == (s - down.double())) & (err < 0), down, r)


def _line_error(mids: torch.Tensor, ks: list[int], line: tuple[float, float]) -> float:
    j = fma32(mids[ks], _f32(line[0]), _f32(line[1]))
    return float((j - torch.tensor(ks, dtype=torch.float32)).abs().max())


def _fit(mids: torch.Tensor, reach: bool = False) -> torch.Tensor:
    """Lines per octave of the positive midpoints (float32[256] row, form not yet set).

    ``reach``: fit each octave's lines through its neighbouring midpoints too (the last one below
    and the first one above it). Where the map gets sparser between an octave's last midpoint
    and the next one (a 7-bit map's decade boundary just below a power of two), a line through the
    octave's own points alone overshoots the code at the octave's end; one that reaches the next
    midpoint does not."""
    row = torch.zeros(256, dtype=torch.float32)
    m = mids.tolist()
    for o in range(OCTAVES):
        lo = 0.0 if o == 0 else 2.0 ** (o - 31)
        hi = float("inf") if o == OCTAVES - 1 else 2.0 ** (o - 30)
        ks = [k for k, v in enumerate(m) if lo <= v < hi]  # octave 0 holds a zero midpoint too
        if ks and reach:
            ks = [k for k in (ks[0] - 1,) if k >= 0 and m[k] > 0] + ks + [k for k in (ks[-1] + 1,) if k < len(m)]
        if not ks:
            # no midpoint: t is the number below; rint(below - 0.5) is below - 1 or below
            below = sum(1 for v in m if v < lo)
            row[32 + o] = row[96 + o] = below - 0.5
            continue
        best = None
        one = _line(mids, ks)
        if len(ks) == 1 or _line_error(mids, ks, one) < _TOLERANCE:
            best = (0.0, one, one)
        else:
            for cut in range(1, len(ks)):  # line 2 from midpoint ks[cut] up
                l1, l2 = _line(mids, ks[:cut]), _line(mids, ks[cut:])
                if l1[0] <= l2[0]:
                    continue  # min() switches lines only where the map gets sparser
                err = max(_line_error(mids, ks[:cut], l1), _line_error(mids, ks[cut:], l2))
                if best is None or err < best[0]:
                    best = (err, l1, l2)
            if best is None:
                best = (0.0, one, one)  # (lines_exact will reject it)
        _, (s1, a1), (s2, a2) = best
        row[o], row[32 + o], row[64 + o], row[96 + o] = s1, a1, s2, a2
    return row


def line_arg(form: int, n: torch.Tensor) -> torch.Tensor:
    """The lines' argument ``a`` of float32 values ``n``, as the kernels compute it (also for the
    segment lines): ``max(n, 2**-31)`` (NaN, negatives -> 2**-31) for the unsigned form, ``|n|``
    (NaN stays) for the signed one, capped below 2."""
    if form == FORM_UNSIGNED:
        a = torch.where(n > A_FLOOR, n, _f32(A_FLOOR))  # max(n, floor): NaN, negatives -> floor
    else:
        a = n.abs()
    return torch.where(a > A_CAP, _f32(A_CAP), a)  # min(cap, a); NaN stays NaN


def int32_of(x: torch.Tensor) -> torch.Tensor:
    """An integral float32 tensor as int64 values of the kernels' int32 conversion: NaN and
    out-of-range lanes give INT32_MIN (the x86 "integer indefinite")."""
    bad = torch.isnan(x) | (x >= 2.0**31) | (x < -(2.0**31))
    return torch.where(bad, -(2.0**31), torch.where(bad, 0.0, x.double())).long()


def padded_mids(mids: torch.Tensor) -> torch.Tensor:
    """The midpoints padded to the kernels' 256 entries with +inf."""
    padded = torch.full((TABLE,), float("inf"))
    padded[: mids.numel()] = mids
    return padded


def line_index(row: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The kernels' probe index ``r`` for float32 values ``n`` (any shape), computed with the same
    float32 operations in the same order: int64, shape of ``n``. The kernels clamp it only below
    (signed form: NaN), so ``octave_lines`` accepts lines only if ``0 <= r < 256`` everywhere."""
    n = n.to(torch.float32)
    form = int(row[161])
    a = line_arg(form, n)
    o = (((a.view(torch.int32) >> 23) & 0xFF).clamp(min=FIRST_EXPONENT) & (OCTAVES - 1)).long()
    j = torch.minimum(fma32(a, row[:32][o], row[32:64][o]), fma32(a, row[64:96][o], row[96:128][o]))
    if form == FORM_SIGNED:
        j = torch.where(n < 0, row[160] - j, j)
    r = int32_of(torch.round(j))  # rint: half to even
    return r.clamp(min=0) if form == FORM_SIGNED else r


def estimate_codes(row: torch.Tensor, mids: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The kernels' codes ``r + (mid[r] < n)`` for float32 values ``n``: int64, shape of ``n``.
    Like the kernels' table, the midpoints are padded to 256 entries with +inf."""
    n = n.to(torch.float32)
    padded = padded_mids(mids)
    r = line_index(row, n).clamp(0, TABLE - 1)  # (the clamp only guards this indexing)
    return r + (padded[r] < n).long()


def _interval_ends(row: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """Every float32 at which t, the octave or the sign may change, its neighbours, and the last
    float below each: both ends of every interval on which the estimate is monotone."""
    inf = _f32(float("inf"))
    powers = torch.tensor([2.0 ** e for e in range(-32, 2)], dtype=torch.float32)
    extra = torch.tensor([0.0, 1e-45, A_CAP, 3.4028234663852886e38], dtype=torch.float32)
    pts = torch.cat([mids, powers, extra])
    pts = torch.cat([pts, -pts])
    pts = torch.cat([pts, torch.nextafter(pts, inf), torch.nextafter(pts, -inf)])
    pts = torch.unique(pts[torch.isfinite(pts)])
    ends = torch.cat([pts, torch.nextafter(pts, -inf), torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])])
    return ends


def octave_lines(mids: torch.Tensor) -> torch.Tensor | None:
    """float32[256] kernel row of octave lines for the sorted float32 midpoints ``mids`` (at most
    256), or None when the estimate is not exact for every input (then the kernels search)."""
    mids = mids.to(torch.float32).contiguous()
    if mids.numel() < 2 or mids.numel() >= TABLE or not bool(torch.all(mids[1:] > mids[:-1])):
        return None
    for reach in (False, True):  # the octave's own midpoints first; then through its neighbours
        row = _finish(_fit(mids, reach), mids)
        if row is not None:
            return row
    return None


def _finish(row: torch.Tensor, mids: torch.Tensor) -> torch.Tensor | None:
    """``row`` with its form (and a signed map's mirror K) set, if it is exact; else None."""
    if float(mids[0]) > 0:
        row[161] = FORM_UNSIGNED
    else:
        # mirror: negative midpoint -p has index K - (index of p); take the common K
        pos = {v: k for k, v in enumerate(mids.tolist()) if v > 0}
        ks = [pos[-v] + k for k, v in enumerate(mids.tolist()) if v < 0 and -v in pos]
        if not ks:
            return None
        row[160] = max(set(ks), key=ks.count)
        row[161] = FORM_SIGNED
    if not bool(torch.all(torch.isfinite(row[:128]))):
        return None
    return row if lines_exact(row, mids) else None


def lines_exact(row: torch.Tensor, mids: torch.Tensor) -> bool:
    """Whether the kernels' estimate from ``row`` gives ``#{k : mids[k] < n}`` (0 for NaN) for
    every float32 ``n``, with probe indices inside the 256-entry table."""
    if int(row[161]) not in (FORM_UNSIGNED, FORM_SIGNED) or torch.any(row[:32] < 0) or torch.any(row[64:96] < 0):
        return False
    n = _interval_ends(row, mids)
    r = line_index(row, n)
    if int(r.min()) < 0 or int(r.max()) >= TABLE:
        return False
    truth = torch.where(torch.isnan(n), 0, torch.searchsorted(mids, n, right=False))
    return torch.equal(estimate_codes(row, mids, n), truth)
