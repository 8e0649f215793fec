"""A study's results: :class:`StudyResult` -- every run, the per-row summary (mean ± std over seeds,
the paired comparison with the reference row and its verdict, divergence share, timings, state
errors), the summary table's rows and the JSON-ready form.

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
from .plan import Row
from .runner import RunResult
from .stats import paired
from .task import Task


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


@dataclasses.dataclass
class StudyResult:
    """The outcome of :func:`~qconf.study.compare`: settings, every run, and per-row summaries.

    ``rows`` are the table's rows (config x optimizer); ``runs`` holds one result per row and seed
    that has one (``status`` ok / diverged / crashed / interrupted; rows that share their runs
    show the same numbers); ``reference`` is the label of the row every other is compared with.
    ``summary()`` aggregates per row, ``table()`` renders it, ``to_dict()`` is results.json.
    """

    task: Task
    rows: list[Row]
    settings: dict[str, Any]
    runs: list[RunResult] = dataclasses.field(default_factory=list)
    reference: str | None = None
    varied: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)
    interrupted: bool = False
    out: Path | None = None
    started: str = ""
    finished: str = ""

    # -- aggregation -------------------------------------------------------------------------
    def runs_of(self, label: str) -> list[RunResult]:
        """Every run of the row labelled ``label``, seed by seed."""
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

    def reference_row(self) -> Row | None:
        """The row every other row is compared with (None in an empty study)."""
        return next((r for r in self.rows if r.label == self.reference), None)

    def shared_runs(self) -> dict[str, str]:
        """``{label: earlier label}`` for rows that resolve to the same runs as an earlier row."""
        first: dict[str, str] = {}
        out = {}
        for row in self.rows:
            if row.digest in first:
                out[row.label] = first[row.digest]
            else:
                first[row.digest] = row.label
        return out

    def summary(self) -> list[dict[str, Any]]:
        """One dict per row (the columns of results.csv)."""
        planned = len(self.settings["seeds"])
        ref = self.reference_row()
        ref_final = ({r.seed: r.final_eval["loss"] for r in self.runs_of(ref.label) if r.status == "ok"}
                     if ref is not None else {})
        shared = self.shared_runs()
        out = []
        for entry in self.rows:
            runs = self.runs_of(entry.label)
            finished = [r for r in runs if r.status in ("ok", "diverged")]
            ok = [r for r in runs if r.status == "ok"]
            diverged = [r for r in runs if r.diverged]
            row: dict[str, Any] = {
                "config": entry.label, "source": entry.source, "optimizer": entry.optimizer, "lr": entry.lr,
                **{f"vary {f}": v for f, v in entry.changes},
                "same_runs_as": shared.get(entry.label), "seeds_planned": planned,
                "seeds_finished": len(finished), "seeds_ok": len(ok), "seeds_diverged": len(diverged),
                "seeds_crashed": sum(r.status == "crashed" for r in runs),
                "seeds_interrupted": sum(r.status == "interrupted" for r in runs),
                "unstable": len(diverged) / len(finished) if finished else None,
            }
            row["final_loss_mean"], row["final_loss_std"] = _mean_std([r.final_eval["loss"] for r in ok])
            row["best_loss_mean"], row["best_loss_std"] = _mean_std([r.best_eval_loss for r in ok])
            row.update(self._paired(entry, ok, diverged, ref, ref_final))
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
            row["crashed_reasons"] = "; ".join(f"seed {r.seed}: {r.reason}" for r in runs if r.status == "crashed")
            out.append(row)
        return out

    @staticmethod
    def _paired(entry: Row, ok: list[RunResult], diverged: list[RunResult], ref: Row | None,
                ref_final: dict[int, float]) -> dict[str, Any]:
        """The row's final eval loss minus the reference's, seed by seed (qconf.study.stats)."""
        diffs = [r.final_eval["loss"] - ref_final[r.seed] for r in ok if r.seed in ref_final]
        p = paired(diffs)
        if ref is None or entry.label == ref.label:
            verdict = "reference" if ref is not None else None
        elif diverged:
            verdict = "unstable"
        else:
            verdict = p.verdict
        ref_mean = statistics.fmean(ref_final.values()) if ref_final else None
        return {"vs_ref_seeds": p.n, "vs_ref_mean": p.mean, "vs_ref_sd": p.sd, "vs_ref_low": p.low,
                "vs_ref_high": p.high, "vs_ref_half_width": p.half_width, "vs_ref_p": p.p,
                "vs_ref_relative": (p.mean / ref_mean if p.mean is not None and ref_mean else None),
                "verdict": verdict}

    def best(self) -> str | None:
        """Label of the row with the lowest mean final eval loss among those that never diverged
        (among all with a result if every row diverged somewhere)."""
        rows = [r for r in self.summary() if r["final_loss_mean"] is not None]
        stable = [r for r in rows if not r["seeds_diverged"]] or rows
        return min(stable, key=lambda r: r["final_loss_mean"])["config"] if stable else None

    # -- rendering ----------------------------------------------------------------------------
    def table_rows(self) -> tuple[list[str], list[list[Any]], str]:
        """``(headers, rows, align)`` of the summary table (shared by the terminal and report.md)."""
        metrics = self.metric_names()
        states = self.state_names()
        ref = self.reference_row()
        headers = ["config", "state B/param", "train B/param", "final eval loss", "best eval loss"]
        if ref is not None:
            headers += [f"vs {ref.label} (paired, 95% CI)", "p", "verdict"]
        headers += [f"final {m}" for m in metrics]
        headers += ["unstable", "ms/step", "opt ms/step"]
        headers += [("err " if s not in ("v_zero",) else "") + s for s in states]
        rows = []
        for r in self.summary():
            line: list[Any] = [r["config"], _fmt(r["state_bytes_per_param"], ".3f"),
                               _fmt(r["train_bytes_per_param"], ".2f"),
                               _pm(r["final_loss_mean"], r["final_loss_std"]),
                               _pm(r["best_loss_mean"], r["best_loss_std"])]
            if ref is not None:
                line += _paired_cells(r)
            line += [_pm(r[f"final_{m}_mean"], r[f"final_{m}_std"]) for m in metrics]
            line += [_unstable_cell(r), _fmt(r["step_ms"], ".1f"), _fmt(r["opt_ms"], ".2f")]
            line += [_fmt(r[f"qerr_{s}_mean"], ".3%" if s == "v_zero" else ".2e") for s in states]
            rows.append(line)
        align = "lrrll" + ("lrl" if ref is not None else "") + "l" * len(metrics) + "lrr" + "r" * len(states)
        return headers, rows, align

    def sweep_table_rows(self) -> tuple[list[str], list[list[Any]], str]:
        """A sweep's table: one column per varied field (the row's config label before them), then
        the outcome columns; rows that are not points have empty field cells."""
        fields = [f for f, _ in self.varied]
        several = len({r.optimizer for r in self.rows}) > 1
        ref = self.reference_row()
        states = [s for s in ("update", "v_zero") if s in self.state_names()]
        headers = ["config", *fields] + (["optimizer"] if several else []) + ["state B/param", "final eval loss"]
        headers += [f"vs {ref.label} (paired, 95% CI)", "p", "verdict"] if ref is not None else []
        headers += ["unstable"] + [("err " if s == "update" else "") + s for s in states]
        rows = []
        for entry, r in zip(self.rows, self.summary()):
            line: list[Any] = [entry.label.split(":", 1)[0] if entry.changes else entry.label]
            line += [dict(entry.changes).get(f, "") for f in fields] + ([entry.optimizer] if several else [])
            line += [_fmt(r["state_bytes_per_param"], ".3f"), _pm(r["final_loss_mean"], r["final_loss_std"])]
            line += _paired_cells(r) if ref is not None else []
            line += [_unstable_cell(r)] + [_fmt(r[f"qerr_{s}_mean"], ".3%" if s == "v_zero" else ".2e") for s in states]
            rows.append(line)
        align = "l" * (1 + len(fields) + several) + "rl" + ("lrl" if ref is not None else "") + "l" + "r" * len(states)
        return headers, rows, align

    def table(self) -> str:
        """The summary as a plain-text table (what ``qconf compare`` prints)."""
        headers, rows, align = self.table_rows()
        return format_table(headers, rows, align=align)

    def to_dict(self) -> dict[str, Any]:
        """The study as plain data: what results.json holds (before non-finite numbers become null)."""
        return {
            "format_version": 2,
            "task": {"name": self.task.name, "description": self.task.description, "info": dict(self.task.info),
                     "baselines": dict(self.task.baselines)},
            "settings": self.settings,
            "vary": {f: v for f, v in self.varied},
            "rows": [r.to_dict() for r in self.rows],
            "started": self.started, "finished": self.finished, "interrupted": self.interrupted,
            "best": self.best(), "reference": self.reference,
            "summary": self.summary(),
            "runs": [r.to_dict() for r in self.runs],
        }


def _paired_cells(r: dict[str, Any]) -> list[str]:
    """The paired columns of one row: ``+mean ± half-width``, p, verdict."""
    if r["verdict"] == "reference":
        return ["-", "-", "reference"]
    if r["vs_ref_mean"] is None:
        return ["-", "-", r["verdict"] or "-"]
    diff = f"{r['vs_ref_mean']:+.4f}"
    if r["vs_ref_half_width"] is not None:
        diff += f" ± {r['vs_ref_half_width']:.4f}"
    p = "-" if r["vs_ref_p"] is None else (f"{r['vs_ref_p']:.3f}" if r["vs_ref_p"] >= 0.001 else "<0.001")
    return [f"{diff} (n={r['vs_ref_seeds']})", p, r["verdict"]]


def _unstable_cell(r: dict[str, Any]) -> str:
    text = f"{100 * r['unstable']:.0f}% ({r['seeds_diverged']}/{r['seeds_finished']})" if r["seeds_finished"] else "-"
    if r["seeds_crashed"]:
        text += f" [{r['seeds_crashed']} crashed]"
    if r["seeds_interrupted"] or r["seeds_finished"] < r["seeds_planned"]:
        text += f" [{r['seeds_finished']}/{r['seeds_planned']} run]"
    return text


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pm(mean: float | None, std: float | None, spec: str = ".4f") -> str:
    if mean is None:
        return "-"
    return f"{mean:{spec}} ± {std:.4f}"
