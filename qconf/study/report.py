"""Writing a study's outputs: results.json, results.csv, report.md (with its automatic reading) and,
through :mod:`qconf.study.plots`, the PNG plots.

    out/results.json   everything: settings, resolved configs, summary, every run with its curves
    out/results.csv    one row per config: the summary columns
    out/report.md      the table, the settings, the exact command, an automatic reading, the plots
    out/curves.png     eval loss (mean ± std band over seeds) and smoothed train loss per config
    out/summary.png    state bytes/param and final eval loss per config (bars)
    out/qerror.png     quantization error of each state against the fp32 shadow, over the steps

Non-finite numbers (a diverged loss) are written as null in JSON and empty cells in CSV; the
run's ``reason`` says what happened.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Sequence

from .plots import write_plots
from .results import StudyResult

#: text outputs are UTF-8 whatever the locale; a file name's undecodable bytes (surrogate escapes in
#: ``sys.argv`` under an ASCII or mismatched locale) are written as ``\udcXX`` instead of failing
TEXT = {"encoding": "utf-8", "errors": "backslashreplace"}


def write_outputs(result: StudyResult, out: Path) -> list[Path]:
    """Write every output file into ``out`` (created); returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [_write_json(result, out / "results.json"), _write_csv(result, out / "results.csv")]
    plots = write_plots(result, out)
    written += plots
    written.append(_write_report(result, out / "report.md", [p.name for p in plots]))
    return written


# -- JSON / CSV ------------------------------------------------------------------------------------
def _clean(x: Any) -> Any:
    """JSON-safe copy: non-finite floats become None, tuples lists, paths strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def _write_json(result: StudyResult, path: Path) -> Path:
    path.write_text(json.dumps(_clean(result.to_dict()), indent=1, allow_nan=False) + "\n", **TEXT)
    return path


def _write_csv(result: StudyResult, path: Path) -> Path:
    rows = result.summary()
    fields = list(rows[0]) if rows else ["config"]
    with path.open("w", newline="", **TEXT) as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v)
                        for k, v in row.items()})
    return path


# -- report.md -----------------------------------------------------------------------------------
def _md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str) -> str:
    def cell(x: Any) -> str:
        return ("" if x is None else str(x)).replace("|", "\\|")

    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def reading(result: StudyResult) -> list[str]:
    """A short automatic reading of the results: best config, gaps to the fp32 baseline,
    divergences, memory. One markdown bullet per line."""
    rows = {r["config"]: r for r in result.summary()}
    lines: list[str] = []
    done = [r for r in rows.values() if r["final_loss_mean"] is not None]
    if not done:
        lines.append("No config finished a run without diverging: there is nothing to rank.")
    best = result.best()
    if best is not None:
        b = rows[best]
        among = "configs that never diverged" if not b["seeds_diverged"] else "all configs (every one diverged somewhere)"
        lines.append(f"Lowest mean final eval loss among {among}: **{best}** "
                     f"({b['final_loss_mean']:.4f} ± {b['final_loss_std']:.4f} over {b['seeds_ok']} seed(s)).")
    base = result.baseline()
    if base is not None and rows[base.label]["final_loss_mean"] is not None:
        ref = rows[base.label]
        for r in done:
            if r["config"] == base.label:
                continue
            if r["vs_baseline_mean"] is None:
                continue
            diff, std, n = r["vs_baseline_mean"], r["vs_baseline_std"], r["vs_baseline_seeds"]
            if n < 2:
                verdict = "one seed, no noise estimate"
            elif abs(diff) <= std:
                verdict = "within seed noise"
            else:
                verdict = "worse" if diff > 0 else "better"
            lines.append(f"{r['config']} vs {base.label}: final eval loss {diff:+.4f} ± {std:.4f} "
                         f"({diff / ref['final_loss_mean']:+.2%}; paired over {n} seed(s): {verdict}); states "
                         f"{r['state_bytes_per_param']:.2f} vs {ref['state_bytes_per_param']:.2f} B/param.")
    unstable = [r for r in rows.values() if r["seeds_diverged"]]
    if unstable:
        for r in unstable:
            lines.append(f"**{r['config']} diverged in {r['seeds_diverged']} of {r['seeds_finished']} seeds** "
                         f"({r['diverged_reasons']}).")
    elif any(r["seeds_finished"] for r in rows.values()):
        lines.append("No run diverged.")
    sized = [r for r in rows.values() if r["state_bytes_per_param"] is not None]
    if sized:
        small = min(sized, key=lambda r: r["state_bytes_per_param"])
        lines.append(f"Smallest optimizer state: {small['config']} ({small['state_bytes_per_param']:.3f} B/param; "
                     "all parameters, including the small ones kept in fp32).")
    if "qerr_v_zero_mean" in next(iter(rows.values()), {}):
        hit = [r for r in rows.values() if (r.get("qerr_v_zero_mean") or 0) > 0]
        if hit:
            lines.append("Second-moment entries that are positive in fp32 but stored as exactly 0 (the zero-point "
                         "problem, update m/eps): " + ", ".join(f"{r['config']} {r['qerr_v_zero_mean']:.2%}"
                                                                for r in hit) + ".")
    if result.interrupted:
        lines.append("**The study was interrupted (Ctrl-C)**: only the finished runs are summarized; see the "
                     "runs table for the interrupted one.")
    return lines


def _write_report(result: StudyResult, path: Path, plots: list[str]) -> Path:
    s = result.settings
    task = result.task
    headers, rows, align = result.table_rows()
    command = s.get("command") or "# library call (qconf.study.compare) with in-memory configs, task or seeds"
    hyper = ", ".join(f"{k}={v}" for k, v in s["optimizer_defaults"].items())
    parts = [
        f"# qconf compare: {task.name}" + (" (interrupted)" if result.interrupted else ""),
        "",
        f"Started {result.started}, finished {result.finished}; torch {s['torch']}.",
        "",
        "```bash",
        command,
        "```",
        "",
        "## Settings",
        "",
        f"- **task** `{task.name}`: {task.description}",
        f"- **optimizer** {s['optimizer']} (lr {s['lr']:g}, schedule {s['lr_schedule']}; {hyper}); "
        f"fused kernel: {s['fused']}; {s['threads']} thread(s)",
        f"- **steps** {s['steps']}, **seeds** {', '.join(map(str, s['seeds']))} (each config x seed starts from "
        "the same initial weights and reads the same batches); eval every "
        f"{s['eval_every']} steps",
        f"- **divergence**: {s['divergence']}",
    ]
    if task.baselines:
        parts.append("- **reference losses**: " + ", ".join(f"{k} {v:.4f}" for k, v in task.baselines.items()))
    parts.append("- **configs**: " + ", ".join(f"`{c.label}` ({c.source})" for c in result.configs))
    parts += ["", "## Results", "", _md_table(headers, rows, align), "",
              "Mean ± std over the seeds that finished without diverging. *state B/param*: optimizer state bytes "
              "per parameter (`qconf.memory_report`). *train B/param*: parameters + gradients + states per parameter "
              "(with gradient release one gradient at a time: docs/memory.md). *vs BASELINE (paired)*: final eval loss minus the quantization-free "
              "config's on the same seed (same initial weights and batches), mean ± std over seeds -- less noisy than "
              "comparing the means. *unstable*: share of seeds that diverged. *ms/step*: median "
              "train step (batch, forward, backward, optimizer step) after the first steps; *opt ms/step*: the "
              "optimizer step alone. *err STATE*: normalized squared error `sum((decode(q)-s)^2)/sum(s^2)` of the "
              "state against an fp32 shadow optimizer fed the same gradients, at the last evaluation (error columns "
              "include diverged seeds, at their last finite measurement); *err update*: "
              "the same for the Adam update direction m/(sqrt(v)+eps); *v_zero*: share of positive fp32 second-moment "
              "entries stored as 0.", "", "## Reading", ""]
    parts += [f"- {line}" for line in reading(result)]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    parts += ["", "## Runs", ""]
    run_rows = []
    for r in result.runs:
        final = r.final_eval
        run_rows.append([r.config, r.seed, r.status, r.steps_done,
                         "-" if final is None else f"{final['loss']:.4f}",
                         "-" if r.best_eval_loss is None else f"{r.best_eval_loss:.4f}",
                         "-" if r.step_ms is None else f"{r.step_ms:.1f}", f"{r.wall_s:.1f}", r.reason])
    planned = {(c.label, seed) for c in result.configs for seed in s["seeds"]}
    for label, seed in sorted(planned - {(r.config, r.seed) for r in result.runs}):
        run_rows.append([label, seed, "not run", 0, "-", "-", "-", "-", "study interrupted before this run"])
    parts.append(_md_table(["config", "seed", "status", "steps", "final eval loss", "best eval loss", "ms/step",
                            "wall s", "note"], run_rows, "lrlrrrrrl"))
    parts.append("")
    path.write_text("\n".join(parts), **TEXT)
    return path
