"""The README's runnable example (gradient release with 4-bit states) runs from a fresh interpreter
as printed there: the loss falls and the memory report shows the training bytes per parameter."""
from __future__ import annotations

import re
import sys

from helpers import ROOT

HEADING = "## Train with 4-bit states and gradient release"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(HEADING):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


# the example runs in the background from when collection ends (conftest.py)
BACKGROUND_JOBS = {"test_the_gradient_release_example_runs_and_learns": lambda workdir: [
    sys.executable, "-c", readme_example()]}
BACKGROUND_CPU_S = 34  # 31 s on 2 idle cores


def test_the_gradient_release_example_runs_and_learns(background_job):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 22 and "gradient_release=True" in code
    returncode, stdout, stderr = background_job.result()
    assert returncode == 0, stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", stdout)]
    assert len(losses) == 4 and losses[-1] < 0.1 * losses[0]
    assert "(the largest gradient: gradient release)" in stdout and "B/param" in stdout
