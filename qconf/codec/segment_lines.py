"""Segment lines: 8-bit nearest rounding with no table probe for almost every value (AVX2 kernels).

The octave lines (:mod:`qconf.codec.octave_lines`) estimate the code ``t(n) = #{k : mid[k] < n}``
within one and finish with one probe of the 256-entry midpoint table: a gather on AVX2, the
largest cost of an 8-bit step there, and 32-entry line tables that take seven operations per
lookup. Maps whose positive midpoints fall into at most 8 runs of equally spaced points (the
dynamic-exponent map: one run per decade) get a second form with 8-entry tables (one ``vpermps``
per lookup):

    d = #{s : B[s] <= a}                  (a = |n| or max(n, 2**-31), capped below 2, as the octave
                                           lines; a 3-level binary search over the 7 bounds B)
    j = min(T[d], fma(a, S[d], A[d]))     (the run's line, capped at T[d]; NaN stays NaN)
    j = K - j  if n < 0                   (signed maps: the mirror K of the octave lines)
    r = rint(j), u = j - r                (u exact)
    code = ceil(j)                        when |u| > eps, clamped to [0, 255] (a saturating pack)
    code = r + (mid[r] < n)               when |u| <= eps (r clamped to [0, levels - 1]; rare)

A segment is a run of midpoints on its line (``j(mid[k]) = k`` within ``eps``) and the cap zone
above its last point, up to the next segment's bound: there the code is one more than the run's
last index, which ``T = last + 1/2`` gives. An irregular midpoint between two runs (where the map
changes its spacing, and neither line is right) is such a zone's top: the next bound is the float
after it. Only values within ``eps`` of an integer estimate (about ``2 eps`` of them) read the
table.

Whether this is exact is checked, not assumed (:func:`segments_exact`), in exactly the kernels'
float32 arithmetic: at every float where ``t``, the segment or the sign can change and its
neighbours, every code must be right; and between two such points, where ``t = T`` is constant and
``j`` is monotone, ``j`` must stay in ``[T - 1 - eps, T + eps]``. There a value is either within
``eps`` of ``T - 1`` or ``T`` (the probe, with ``r`` in ``{T - 1, T}``, gives ``T``) or has
``ceil(j) = T``. So the check covers every float32 input.

Row layout (row 7 of :func:`qconf.codec.native.codec_table`, after the octave lines, which must
be present: the segments share their mirror K and form): see the ``SEG_*`` offsets.
"""
from __future__ import annotations

import numpy as np
import torch

from .octave_lines import (FORM_SIGNED, FORM_UNSIGNED, TABLE, _f32, _interval_ends, fma32, int32_of, line_arg,
                           padded_mids)

SEGMENTS = 8
SEG_BOUNDS = 162  # B[1..7] (bounds[s] = B[s + 1]), then +inf twice: 9 entries
SEG_SLOPE = 171  # S[0..7]
SEG_OFFSET = 179  # A[0..7]
SEG_CAP = 187  # T[0..7]
SEG_TOP = 195  # J[0..7]: the junction point at the top of segment d's cap zone (signed maps), or -1
SEG_EPS = 203  # eps
SEG_PRESENT = 204  # 1.0 when the segments are set and exact
_MIRROR, _FORM = 160, 161
_RUN_TOLERANCE = 1e-3  # the largest distance (in codes) of a run's point from its line
EPS_MAX = 1.0 / 64  # reject segment lines that would send more values to the table


def _run_end(x: np.ndarray, k: np.ndarray, i: int) -> int:
    """The last e >= i such that x[i..e] lie within the run tolerance of the line through their
    first and last point (float64 arrays)."""
    xs, ks = x[i:] - x[i], k[i:] - k[i]
    with np.errstate(divide="ignore", invalid="ignore"):
        slopes = ks[1:] / xs[1:]  # the line to each candidate last point e = i + 1 ..
        dev = np.abs(slopes[:, None] * xs[None, 1:] - ks[None, 1:])  # [e, point]
    dev = np.where(np.arange(1, xs.size)[None, :] <= np.arange(1, xs.size)[:, None], dev, 0.0)  # points <= e
    ok = dev.max(axis=1, initial=0.0) <= _RUN_TOLERANCE
    bad = np.flatnonzero(~ok)
    return i + (int(bad[0]) if bad.size else xs.size - 1)


def _runs(x: np.ndarray, k: np.ndarray) -> list[tuple[int, int, bool]]:
    """The fewest segments (first, last, junction after last?) covering the positive midpoints
    x (float64, indices k): a run of points on a line, optionally followed by one junction point
    in its cap zone."""
    n = x.size
    ends = [_run_end(x, k, i) for i in range(n)]
    best: list[tuple[int, int, bool]] = [(0, 0, False)] * n
    cost = [0] * (n + 2)  # cost[i]: segments to cover x[i:]
    for i in range(n - 1, -1, -1):
        cost[i] = n + 1
        for e in range(ends[i], i - 1, -1):  # (ties: the longest run, no junction)
            for junction in (False, True):
                nxt = e + 1 + int(junction)
                if nxt > n:
                    continue
                c = 1 + cost[nxt]
                if c < cost[i]:
                    cost[i], best[i] = c, (i, e, junction)
    out, i = [], 0
    while i < n:
        seg = best[i]
        out.append(seg)
        i = seg[1] + 1 + int(seg[2])
    return out


def _line(x: np.ndarray, k: np.ndarray, first: int, last: int, below: float) -> tuple[float, float]:
    """(S, A) of a run: through its first and last point; a single point gets the slope that puts
    the float `below` it (the segment's start) half a code lower."""
    if last > first:
        s = float((k[last] - k[first]) / (x[last] - x[first]))
    else:
        s = 0.5 / max(float(x[first]) - below, 1e-30)
    return s, float(k[first]) - s * float(x[first])


def _fit(mids: torch.Tensor) -> torch.Tensor | None:
    """The segment fields of row 7 (float32[256], zeros elsewhere) for the midpoints, eps unset;
    None if they need more than SEGMENTS segments."""
    pos = mids > 0
    x = mids[pos].double().numpy()
    k = torch.nonzero(pos).flatten().double().numpy()
    if x.size == 0:
        return None
    runs = _runs(x, k)
    top_zone = runs[-1][2]  # a junction above the last run: one more segment, its code constant
    if len(runs) + int(top_zone) > SEGMENTS:
        return None
    inf = _f32(float("inf"))
    row = torch.zeros(TABLE, dtype=torch.float32)
    bounds, below = [], 0.0  # below: where the segment starts
    for s, (first, last, junction) in enumerate(runs):
        slope, offset = _line(x, k, first, last, below)
        row[SEG_SLOPE + s], row[SEG_OFFSET + s], row[SEG_CAP + s] = slope, offset, float(k[last]) + 0.5
        row[SEG_TOP + s] = float(x[last + 1]) if junction else -1.0
        # the next segment starts at the float after the junction, or at the next run's first point
        if junction:
            below = float(x[last + 1])
            bounds.append(float(torch.nextafter(_f32(below), inf)))
        elif s + 1 < len(runs):
            below = float(x[last])
            bounds.append(float(x[last + 1]))
    if top_zone:
        top = float(k[runs[-1][1] + 1]) + 0.5
        row[SEG_SLOPE + len(runs)], row[SEG_OFFSET + len(runs)], row[SEG_CAP + len(runs)] = 0.0, top, top
        row[SEG_TOP + len(runs)] = -1.0
    bounds += [float("inf")] * (SEGMENTS + 1 - len(bounds))
    row[SEG_BOUNDS:SEG_BOUNDS + SEGMENTS + 1] = torch.tensor(bounds, dtype=torch.float32)
    return row


def _segment_j(row: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' capped line value j (float32) and segment d (int64) of float32 values n."""
    a = line_arg(int(row[_FORM]), n)
    bounds = row[SEG_BOUNDS:SEG_BOUNDS + SEGMENTS + 1]
    d = torch.where(bounds[3] <= a, 4, 0)  # B[4], then B[d + 2], then B[d + 1] (bounds[s] = B[s + 1])
    d = d + torch.where(bounds[d + 1] <= a, 2, 0)
    d = d + torch.where(bounds[d] <= a, 1, 0)
    line = fma32(a, row[SEG_SLOPE + d], row[SEG_OFFSET + d])
    cap = row[SEG_CAP + d]
    if int(row[_FORM]) == FORM_SIGNED:  # the junction point itself: cap at its index (a probe)
        cap = cap + torch.where(a == row[SEG_TOP + d], _f32(0.5), _f32(0.0))
    j = torch.where(cap < line, cap, line)  # min(cap, line); NaN stays
    if int(row[_FORM]) == FORM_SIGNED:
        j = torch.where(n < 0, row[_MIRROR] - j, j)
    return j, d


def segment_codes(row: torch.Tensor, mids: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The kernels' codes from the segment lines for float32 values ``n`` (any shape): ceil(j),
    or the probe where the estimate is within eps of an integer; int64, shape of ``n``."""
    n = n.to(torch.float32)
    j, _ = _segment_j(row, n)
    jr = torch.round(j)  # half to even, like the kernels' rounding
    u = j - jr  # exact
    r = int32_of(jr)
    fast = (r + (u > 0).long()).clamp(0, TABLE - 1)  # (the kernels' stores saturate to a byte)
    padded = padded_mids(mids)
    rp = r.clamp(0, mids.numel())
    probe = rp + (padded[rp] < n).long()
    return torch.where(u.abs() <= row[SEG_EPS], probe, fast)


def _ends(row: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """The octave lines' interval ends plus every segment bound, its neighbours, and their negatives."""
    inf = _f32(float("inf"))
    b = row[SEG_BOUNDS:SEG_BOUNDS + SEGMENTS + 1]
    b = b[torch.isfinite(b)]
    b = torch.cat([b, torch.nextafter(b, inf), torch.nextafter(b, -inf)])
    return torch.cat([_interval_ends(row, mids), b, -b])


def _required_eps(row: torch.Tensor, mids: torch.Tensor) -> float:
    """The smallest eps for which every check of :func:`segments_exact` can hold (float64), or
    0.5 when none can (a code wrong outside any probe)."""
    n = torch.unique(_ends(row, mids))  # sorted; NaN last
    truth = torch.where(torch.isnan(n), 0, torch.searchsorted(mids, n, right=False))
    j, d = _segment_j(row, n)
    jd = j.double()
    u = (j - torch.round(j)).double().abs()
    probe_row = row.clone()
    probe_row[SEG_EPS] = float("inf")  # every value probes: the estimate must be within one
    need = [0.0]
    wrong_probe = segment_codes(probe_row, mids, n) != truth
    fast_row = row.clone()
    fast_row[SEG_EPS] = -1.0
    wrong_fast = segment_codes(fast_row, mids, n) != truth
    if bool((wrong_probe & ~torch.isnan(n)).any()):
        return 0.5
    if bool(wrong_fast.any()):
        need.append(float(u[wrong_fast].max()))
    fin = ~torch.isnan(n)
    nf, tf, jf, df = n[fin], truth[fin], jd[fin], d[fin]
    same = (tf[1:] == tf[:-1]) & (df[1:] == df[:-1]) & ((nf[1:] < 0) == (nf[:-1] < 0))
    T = tf[1:][same].double()
    # (the codes are clamped to [0, 255]: below code 0 and above code 255 any j will do)
    zero = torch.zeros(1, dtype=torch.float64)
    need += [float(torch.cat([(T - 1 - jf[:-1][same])[T > 0], zero]).max()),
             float(torch.cat([(jf[1:][same] - T)[T < TABLE - 1], zero]).max())]
    return max(need)


def segments_exact(row: torch.Tensor, mids: torch.Tensor) -> bool:
    """Whether the segment lines of ``row`` (with its eps) give ``#{k : mids[k] < n}`` (0 for NaN)
    for every float32 ``n`` (see the module docstring for why these points cover all floats)."""
    eps = float(row[SEG_EPS])
    if row[SEG_PRESENT] != 1.0 or not 0.0 <= eps < 0.5 or int(row[_FORM]) not in (FORM_UNSIGNED, FORM_SIGNED):
        return False
    if bool((row[SEG_SLOPE:SEG_SLOPE + SEGMENTS] < 0).any()):
        return False
    return _required_eps(row, mids) <= eps


def segment_lines(mids: torch.Tensor, lines: torch.Tensor) -> torch.Tensor | None:
    """Row 7 ``lines`` (the octave lines of ``mids``, with their form and mirror) with the segment
    lines added, or None when the map needs more than 8 segments or a wide probe window."""
    if int(lines[_FORM]) not in (FORM_UNSIGNED, FORM_SIGNED) or not 2 <= mids.numel() < TABLE:
        return None
    seg = _fit(mids.to(torch.float32))
    if seg is None:
        return None
    row = lines.clone()
    row[SEG_BOUNDS:SEG_PRESENT + 1] = seg[SEG_BOUNDS:SEG_PRESENT + 1]
    eps = _required_eps(row, mids)
    if eps > EPS_MAX:
        return None
    row[SEG_EPS] = float(torch.nextafter(_f32(eps), _f32(1.0))) if eps > 0 else 0.0
    row[SEG_PRESENT] = 1.0
    return row if segments_exact(row, mids) else None
