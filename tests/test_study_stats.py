"""qconf.study.stats: the paired t statistics of a study against hand computations (closed forms of
Student's t for 1 and 2 degrees of freedom, a t-table value) and SciPy, and a study's paired columns
against its own runs."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from qconf.study import compare
from qconf.study.stats import paired, t_quantile, t_two_sided_p

CFG = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.0, 12.7, 400.0])
def test_t_distribution_closed_forms(t):
    # df = 1 is the Cauchy distribution: P(|T| >= t) = 1 - 2 atan(t) / pi
    assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-12, abs=1e-15)
    # df = 2: P(|T| >= t) = 1 - t / sqrt(t^2 + 2)
    assert t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("q", [0.9, 0.95, 0.975, 0.995])
def test_t_quantile_closed_forms(q):
    assert t_quantile(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-10)
    a = 4 * q * (1 - q)
    assert t_quantile(q, 2) == pytest.approx((2 * q - 1) * math.sqrt(2 / a), rel=1e-10)


def test_t_table_values_and_scipy():
    assert t_quantile(0.975, 4) == pytest.approx(2.776445, abs=1e-6)   # the t table: n = 5 seeds
    assert t_quantile(0.975, 1) == pytest.approx(12.706205, abs=1e-6)  # n = 2 seeds
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 3, 4, 9, 29):
        assert t_quantile(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-9)
        for t in (0.5, 2.1, 7.0):
            assert t_two_sided_p(t, df) == pytest.approx(2 * scipy_stats.t.sf(t, df), rel=1e-10)


def test_paired_by_hand():
    d = [0.010, 0.030, -0.005, 0.020, 0.015]
    mean = sum(d) / 5                                                     # 0.014
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    half = 2.7764451051977987 * sd / math.sqrt(5)
    p = paired(d)
    assert (p.n, p.verdict) == (5, "within noise")
    assert p.mean == pytest.approx(0.014, abs=1e-15) and p.sd == pytest.approx(sd, rel=1e-12)
    assert p.half_width == pytest.approx(half, rel=1e-9)
    assert (p.low, p.high) == (pytest.approx(mean - half, rel=1e-9), pytest.approx(mean + half, rel=1e-9))
    assert p.low < 0 < p.high and 0.05 < p.p < 0.1                      # p = 0.0729 (SciPy: ttest_1samp)
    assert p.p == pytest.approx(0.07285505961025568, rel=1e-9)


def test_paired_verdicts():
    assert paired([-0.02, -0.03, -0.025]).verdict == "better"           # interval below 0
    assert paired([0.02, 0.03, 0.025]).verdict == "worse"
    assert paired([0.0, 0.0, 0.0]).verdict == "identical" and paired([0.0, 0.0]).p == 1.0
    constant = paired([0.01, 0.01])                                      # no spread, every seed worse
    assert constant.verdict == "worse" and constant.half_width == 0.0 and constant.p == 0.0
    one = paired([0.5])
    assert one.verdict == "too few seeds" and one.p is None and one.low is None
    assert paired([]).verdict == "too few seeds"
    # two seeds: t = 12.7, so a consistent-looking gap is still "within noise"
    assert paired([0.01, 0.03]).verdict == "within noise"


def test_a_study_pairs_its_rows_seed_by_seed():
    """The paired columns of a study equal the statistics of its own runs' final losses."""
    result = compare({"fp32": str(CFG / "fp32.yml"), "4bit": str(CFG / "default.yml")},
                     task="test_study_tasks:tiny_task", steps=10, seeds=3, eval_every=5, out=False, progress=False,
                     measure_error=False)
    final = {(r.config, r.seed): r.final_eval["loss"] for r in result.runs}
    diffs = [final[("4bit", s)] - final[("fp32", s)] for s in range(3)]
    row = {r["config"]: r for r in result.summary()}
    assert result.reference == "fp32" and row["fp32"]["verdict"] == "reference"
    assert row["4bit"]["vs_ref_seeds"] == 3
    assert row["4bit"]["vs_ref_mean"] == pytest.approx(statistics.fmean(diffs), rel=1e-12)
    half = t_quantile(0.975, 2) * statistics.stdev(diffs) / math.sqrt(3)
    assert row["4bit"]["vs_ref_half_width"] == pytest.approx(half, rel=1e-9)
    assert row["4bit"]["verdict"] == paired(diffs).verdict
    text = result.table()
    assert "vs fp32 (paired, 95% CI)" in text and row["4bit"]["verdict"] in text and "(n=3)" in text
