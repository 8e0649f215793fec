"""benchmarks/avx2_stages.py: the AVX2 stage floors (cycles per vector of 8 elements) that
docs/benchmarks.md quotes. Timings are not checked (benchmarks are never timed tests): the
script must build its program, run it and print one row per stage with a positive figure."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "avx2_stages.py"


def _has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


@pytest.mark.skipif(shutil.which("g++") is None or not _has_avx2(), reason="needs g++ and an AVX2/FMA CPU")
def test_stage_table_has_a_positive_row_per_stage():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--reps", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("clock: ") and " GHz " in lines[0]
    assert lines[1].split() == ["stage", "cycles/8", "elem", "ns/elem"]
    rows = lines[3:]
    assert [r.split("  ")[0] for r in rows] == [
        "vsqrtps + vdivps alone (the AdamW denominator and quotient)",
        "AdamW update, fp32 states (torch fused AdamW's arithmetic)",
        "AdamW update, both moments decoded from 4-bit codes (group-128 main loop)",
        "signed 4-bit nearest search (Probe16 split count) + pack",
        "4-bit midpoint grid + pack",
        "the three group-128 stages above in one loop (quantizing another block)",
        "signed 8-bit segment-lines nearest code + pack (8bit.yml exp_avg)",
    ]
    for r in rows:
        cycles, ns = (float(x) for x in r.split()[-2:])
        assert cycles > 0 and ns > 0, r


def test_help_names_the_measurement():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Cycles per vector of 8 fp32 elements" in proc.stdout
