"""The sanitizer job in the test suite: tests/sanitize.py builds the extension with AddressSanitizer
and UndefinedBehaviorSanitizer and runs the focused native-kernel subset under them (about a
minute of build and 55 s of tests on 2 idle cores). It runs as a background job (conftest.py),
started when collection ends at the lowest CPU priority, so it builds while the rest of the suite
runs. Any sanitizer report, or any failure of those tests, fails this test with the job's output.
``python tests/sanitize.py --full`` runs the whole native suite that way (docs/kernels.md, "Memory
safety").
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the sanitized build and its tests start when collection ends (conftest.py)
BACKGROUND_JOBS = {"test_native_tests_pass_under_address_and_undefined_behavior_sanitizers":
                   lambda workdir: [sys.executable, str(ROOT / "tests" / "sanitize.py")]}
BACKGROUND_CPU_S = 190  # 118 s on 2 idle cores: the build, then the focused tests


def test_native_tests_pass_under_address_and_undefined_behavior_sanitizers(background_job):
    returncode, out, err = background_job.result()
    assert returncode == 0, f"the sanitizer job failed ({returncode}):\n{out[-10000:]}\n{err[-10000:]}"
    last = out.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "error" not in last, out[-3000:]
