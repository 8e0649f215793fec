"""The README's runnable example (gradient release with 4-bit states) runs from a fresh interpreter
as printed there: the loss falls and the memory report shows the training bytes per parameter."""
from __future__ import annotations

import re
import subprocess
import sys

from helpers import ROOT

HEADING = "## Train with 4-bit states and gradient release"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(HEADING):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_gradient_release_example_runs_and_learns(tmp_path):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 22 and "gradient_release=True" in code
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.1 * losses[0]
    assert "(the largest gradient: gradient release)" in done.stdout and "B/param" in done.stdout
