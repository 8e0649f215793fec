"""A study's results: the compared configs (:class:`ConfigEntry`) and :class:`StudyResult` -- every
run, the per-config summary (mean ± std over seeds, paired gaps to the fp32 baseline, divergence
share, timings, state errors), the summary table's rows and the JSON-ready form.

Written by :func:`qconf.study.compare`, read by :mod:`qconf.study.report` and
:mod:`qconf.study.plots`.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from .._table import format_table
from ..config import QConfig
from .runner import RunResult
from .task import Task


@dataclasses.dataclass(frozen=True)
class ConfigEntry:
    """One compared config: its label (column in every output), source path and resolved form."""

    label: str
    source: str
    config: QConfig

    @property
    def quantized(self) -> bool:
        """Whether any state is quantized (False for an fp32 baseline such as configs/fp32.yml)."""
        return any(s.enable for s in self.config.states.values()) or any(
            o.enable or o.states for o in self.config.overrides)


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


@dataclasses.dataclass
class StudyResult:
    """The outcome of :func:`compare`: settings, every run, and per-config summaries.

    ``runs`` holds every run that started (``status`` ok / diverged / interrupted); ``summary()``
    aggregates them per config (mean ± std over the seeds that finished without diverging),
    ``table()`` renders the summary, ``to_dict()`` is what results.json contains.
    """

    task: Task
    configs: list[ConfigEntry]
    settings: dict[str, Any]
    runs: list[RunResult] = dataclasses.field(default_factory=list)
    interrupted: bool = False
    out: Path | None = None
    started: str = ""
    finished: str = ""

    # -- aggregation -------------------------------------------------------------------------
    def runs_of(self, label: str) -> list[RunResult]:
        """Every run of the config labelled ``label``, in run order."""
        return [r for r in self.runs if r.config == label]

    def metric_names(self) -> list[str]:
        """Eval metrics besides the loss (e.g. ``accuracy``), in the task's order."""
        names: dict[str, None] = {}
        for r in self.runs:
            for e in r.eval:
                names.update((k, None) for k in e if k not in ("step", "loss"))
        return list(names)

    def state_names(self) -> list[str]:
        """Names with a quantization-error curve: optimizer states first, then diagnostics."""
        names: dict[str, None] = {}
        for r in self.runs:
            names.update((k, None) for k in r.qerr)
        extra = [k for k in ("update", "v_zero") if k in names]
        return [k for k in names if k not in extra] + extra

    def summary(self) -> list[dict[str, Any]]:
        """One dict per config (the columns of results.csv)."""
        rows = []
        planned = len(self.settings["seeds"])
        base = self.baseline()
        base_final = ({r.seed: r.final_eval["loss"] for r in self.runs_of(base.label) if r.status == "ok"}
                      if base is not None else {})
        for entry in self.configs:
            runs = self.runs_of(entry.label)
            finished = [r for r in runs if r.status in ("ok", "diverged")]
            ok = [r for r in runs if r.status == "ok"]
            diverged = [r for r in runs if r.diverged]
            row: dict[str, Any] = {
                "config": entry.label, "source": entry.source, "seeds_planned": planned,
                "seeds_finished": len(finished), "seeds_ok": len(ok), "seeds_diverged": len(diverged),
                "seeds_interrupted": sum(r.status == "interrupted" for r in runs),
                "unstable": len(diverged) / len(finished) if finished else None,
            }
            row["final_loss_mean"], row["final_loss_std"] = _mean_std([r.final_eval["loss"] for r in ok])
            row["best_loss_mean"], row["best_loss_std"] = _mean_std([r.best_eval_loss for r in ok])
            # paired over seeds (same initial weights and batches): final loss minus the baseline's
            paired = [r.final_eval["loss"] - base_final[r.seed] for r in ok if r.seed in base_final]
            row["vs_baseline_mean"], row["vs_baseline_std"] = _mean_std(paired)
            row["vs_baseline_seeds"] = len(paired)
            for m in self.metric_names():
                row[f"final_{m}_mean"], row[f"final_{m}_std"] = _mean_std(
                    [r.final_eval.get(m) for r in ok if r.final_eval])
            timed = [r for r in runs if r.step_ms is not None]
            row["step_ms"] = statistics.median(r.step_ms for r in timed) if timed else None
            row["opt_ms"] = statistics.median(r.opt_ms for r in timed) if timed else None
            sized = [r for r in runs if r.state_bytes_per_param is not None]
            row["state_bytes_per_param"] = sized[0].state_bytes_per_param if sized else None
            row["train_bytes_per_param"] = sized[0].train_bytes_per_param if sized else None
            # state errors describe storage, not the outcome: diverged seeds count too (their last
            # finite measurement, taken at or before the evaluation where they stopped)
            for s in self.state_names():
                row[f"qerr_{s}_mean"], row[f"qerr_{s}_std"] = _mean_std([r.final_qerr(s) for r in finished])
            row["diverged_reasons"] = "; ".join(f"seed {r.seed}: {r.reason}" for r in diverged)
            rows.append(row)
        return rows

    def baseline(self) -> ConfigEntry | None:
        """The first config that quantizes nothing (the fp32 reference), if any."""
        return next((c for c in self.configs if not c.quantized), None)

    def best(self) -> str | None:
        """Label of the config with the lowest mean final eval loss among those that never diverged
        (among all with a result if every config diverged somewhere)."""
        rows = [r for r in self.summary() if r["final_loss_mean"] is not None]
        stable = [r for r in rows if not r["seeds_diverged"]] or rows
        return min(stable, key=lambda r: r["final_loss_mean"])["config"] if stable else None

    # -- rendering ----------------------------------------------------------------------------
    def table_rows(self) -> tuple[list[str], list[list[Any]], str]:
        """``(headers, rows, align)`` of the summary table (shared by the terminal and report.md)."""
        metrics = self.metric_names()
        states = self.state_names()
        base = self.baseline()
        headers = ["config", "state B/param", "train B/param", "final eval loss", "best eval loss"]
        if base is not None:
            headers.append(f"vs {base.label} (paired)")
        headers += [f"final {m}" for m in metrics]
        headers += ["unstable", "ms/step", "opt ms/step"]
        headers += [("err " if s not in ("v_zero",) else "") + s for s in states]
        rows = []
        for r in self.summary():
            line: list[Any] = [r["config"], _fmt(r["state_bytes_per_param"], ".3f"), _fmt(r["train_bytes_per_param"], ".2f"),
                               _pm(r["final_loss_mean"], r["final_loss_std"]),
                               _pm(r["best_loss_mean"], r["best_loss_std"])]
            if base is not None:
                line.append("-" if r["config"] == base.label else _pm(r["vs_baseline_mean"], r["vs_baseline_std"], "+.4f"))
            line += [_pm(r[f"final_{m}_mean"], r[f"final_{m}_std"]) for m in metrics]
            if r["seeds_finished"]:
                unstable = f"{100 * r['unstable']:.0f}% ({r['seeds_diverged']}/{r['seeds_finished']})"
            else:
                unstable = "-"
            if r["seeds_interrupted"] or r["seeds_finished"] < r["seeds_planned"]:
                unstable += f" [{r['seeds_finished']}/{r['seeds_planned']} run]"
            line += [unstable, _fmt(r["step_ms"], ".1f"), _fmt(r["opt_ms"], ".2f")]
            line += [_fmt(r[f"qerr_{s}_mean"], ".3%" if s == "v_zero" else ".2e") for s in states]
            rows.append(line)
        align = "lrrll" + ("l" if base is not None else "") + "l" * len(metrics) + "lrr" + "r" * len(states)
        return headers, rows, align

    def table(self) -> str:
        """The summary as a plain-text table (what ``qconf compare`` prints)."""
        headers, rows, align = self.table_rows()
        return format_table(headers, rows, align=align)

    def to_dict(self) -> dict[str, Any]:
        """The study as plain data: what results.json holds (before non-finite numbers become null)."""
        return {
            "format_version": 1,
            "task": {"name": self.task.name, "description": self.task.description, "info": dict(self.task.info),
                     "baselines": dict(self.task.baselines)},
            "settings": self.settings,
            "configs": [{"label": c.label, "source": c.source, "quantized": c.quantized,
                         "config": c.config.to_dict()} for c in self.configs],
            "started": self.started, "finished": self.finished, "interrupted": self.interrupted,
            "best": self.best(),
            "baseline": (b.label if (b := self.baseline()) else None),
            "summary": self.summary(),
            "runs": [r.to_dict() for r in self.runs],
        }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pm(mean: float | None, std: float | None, spec: str = ".4f") -> str:
    if mean is None:
        return "-"
    return f"{mean:{spec}} ± {std:.4f}"
