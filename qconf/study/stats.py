"""Paired statistics over seeds: how a row of a study differs from the reference row.

Every run of a study with seed ``s`` starts from the same weights and reads the same batches, so
the per-seed differences ``d_s = loss(row, s) - loss(reference, s)`` remove the seed's own variance.
Over ``n`` seeds (Student's paired t)::

    mean = sum(d) / n          sd = sqrt(sum((d - mean)^2) / (n - 1))          se = sd / sqrt(n)
    95% interval: mean -+ t_{0.975, n-1} * se          t = mean / se, p = P(|T_{n-1}| >= |t|)

Verdict (lower loss is better): ``better`` when the whole interval is below 0, ``worse`` when it is
above, ``within noise`` when it holds 0 (p >= 0.05, the same test); ``identical`` when every
difference is exactly 0 (the same runs); ``too few seeds`` below 2 pairs (no spread to measure).
With few seeds the interval is wide (t = 12.7 at n = 2, 4.3 at n = 3, 2.78 at n = 5), so
"within noise" then says only that differences below the half-width are not resolved.

The t distribution is computed here (regularized incomplete beta function, a continued fraction)
so that a study needs no SciPy; tests check it against SciPy and a hand computation.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

LEVEL = 0.95
#: Below this many paired seeds the report warns that a "within noise" verdict says little.
FEW_SEEDS = 5
VERDICTS = ("better", "worse", "within noise", "identical", "too few seeds")


@dataclasses.dataclass(frozen=True)
class Paired:
    """The paired comparison of one row with the reference (differences = row - reference).

    ``low``/``high``: the 95% interval of the mean difference; ``half_width`` = (high - low) / 2;
    ``p``: two-sided p-value of the paired t-test; all None when ``n < 2``.
    """

    n: int
    mean: float | None
    sd: float | None
    half_width: float | None
    low: float | None
    high: float | None
    p: float | None
    t_crit: float | None
    verdict: str


def paired(diffs: Sequence[float]) -> Paired:
    """Paired t statistics of the differences ``diffs`` (row minus reference, one per seed)."""
    n = len(diffs)
    if n == 0:
        return Paired(0, None, None, None, None, None, None, None, "too few seeds")
    mean = statistics.fmean(diffs)
    if n == 1:
        return Paired(1, mean, None, None, None, None, None, None, "too few seeds")
    sd = statistics.stdev(diffs)
    t_crit = t_quantile(1 - (1 - LEVEL) / 2, n - 1)
    if sd == 0.0:  # every seed moved by the same amount: no spread, the interval is the point
        p = 1.0 if mean == 0 else 0.0
        verdict = "identical" if all(d == 0 for d in diffs) else ("better" if mean < 0 else "worse")
        return Paired(n, mean, 0.0, 0.0, mean, mean, p, t_crit, verdict)
    se = sd / math.sqrt(n)
    half = t_crit * se
    low, high = mean - half, mean + half
    p = t_two_sided_p(mean / se, n - 1)
    verdict = "better" if high < 0 else ("worse" if low > 0 else "within noise")
    return Paired(n, mean, sd, half, low, high, p, t_crit, verdict)


def t_two_sided_p(t: float, df: int) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``df`` degrees of freedom: ``I_x(df/2, 1/2)`` with
    ``x = df / (df + t^2)``."""
    if not math.isfinite(t):
        return 0.0
    return _betainc(df / 2, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's t with ``df`` degrees of freedom, by bisection
    on :func:`t_two_sided_p` (to ~1e-12 relative)."""
    target = 2 * (1 - q)
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_two_sided_p(mid, df) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return (lo + hi) / 2


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (Numerical Recipes' continued
    fraction, evaluated by modified Lentz; the symmetry ``I_x(a,b) = 1 - I_{1-x}(b,a)`` keeps it
    in its fast-converging region)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h
