"""The sanitizer job in the test suite: tests/sanitize.py builds the extension with AddressSanitizer
and UndefinedBehaviorSanitizer and runs the focused native-kernel subset under them (about 2
minutes of build and 80 s of tests on 2 cores). Any sanitizer report, or any failure of those
tests, fails this test with the job's output. ``python tests/sanitize.py --full`` runs the whole
native suite that way (docs/kernels.md, "Memory safety").
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_native_tests_pass_under_address_and_undefined_behavior_sanitizers():
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "sanitize.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=1500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"the sanitizer job failed ({done.returncode}):\n{out[-20000:]}"
    assert " passed" in done.stdout and "failed" not in done.stdout.splitlines()[-1], done.stdout[-3000:]
