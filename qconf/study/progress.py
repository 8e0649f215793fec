"""The progress bar of a study (tqdm on stderr) and its one line per finished run; silent when
progress is off."""
from __future__ import annotations

from typing import Any

from .plan import PlannedRun
from .runner import RunResult


def run_line(run: RunResult) -> str:
    """``label seed S: eval loss X, accuracy Y [status: reason] W s``."""
    final = run.final_eval
    text = f"{run.config} seed {run.seed}: "
    if final is not None:
        text += f"eval loss {final['loss']:.4f}"
        text += "".join(f", {k} {v:.4f}" for k, v in final.items() if k not in ("step", "loss"))
    text += f" [{run.status}{': ' + run.reason if run.reason else ''}] {run.wall_s:.1f} s"
    return text


class RunProgress:
    """Progress over ``runs`` runs of ``steps`` steps each; ``enabled=False`` prints nothing."""

    def __init__(self, runs: int, steps: int, enabled: bool) -> None:
        self.steps = steps
        self.enabled = enabled
        self.bar: Any = None
        self._label = ""
        if enabled and runs:
            from tqdm import tqdm

            self.bar = tqdm(total=runs * steps, unit="step", desc="qconf compare", dynamic_ncols=True,
                            smoothing=0.1, mininterval=0.5)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)

    def start(self, run: PlannedRun) -> None:
        self._label = f"{run.rows[0]} seed {run.seed}"

    def advance(self, steps: int, label: str, loss: float | None) -> None:
        """``steps`` more steps done (by this process or a worker)."""
        if self.bar is not None:
            self.bar.update(steps)
            if loss is not None:
                self.bar.set_postfix_str(f"{label} loss {loss:.3f}", refresh=False)

    def on_step(self, step: int, loss: float) -> None:
        """A run of this process finished ``step``."""
        self.advance(1, self._label, loss if step % 10 == 0 or step == 1 else None)

    def done(self, result: RunResult, steps_reported: int | None = None) -> None:
        """A run ended: count the steps it skipped (diverged early) and print its line."""
        reported = result.steps_done if steps_reported is None else steps_reported
        self.advance(max(0, self.steps - reported), self._label, None)
        self.write(run_line(result))

    def interrupted(self, result: RunResult) -> None:
        self.write(f"interrupted: {result.config} seed {result.seed} ({result.steps_done}/{self.steps} steps); "
                   "writing what is done")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
