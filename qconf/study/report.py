"""Writing a study's outputs: results.json, results.csv, report.md (with its automatic reading) and,
through :mod:`qconf.study.plots`, the PNG plots.

    out/results.json   everything: settings, resolved configs, summary, every run with its curves
    out/results.csv    one row per row of the table: the summary columns
    out/report.md      the table, the settings, the exact command, an automatic reading, the plots
    out/curves.png     eval loss (mean ± std band over seeds) and smoothed train loss per config
    out/summary.png    state bytes/param and final eval loss per config (bars)
    out/qerror.png     quantization error of each state against the fp32 shadow, over the steps
    out/sweep.png      a sweep's final eval loss against its field's values (one field), or a heatmap
                       over two fields (one panel per value of any further field and per optimizer)

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
from .stats import FEW_SEEDS, t_quantile
from .store import TEXT

#: longer lists of rows in the reading become counts (the table has every row)
MAX_LISTED = 6


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
    fields = list(dict.fromkeys(k for row in rows for k in row)) or ["config"]  # sweep columns vary by row
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
    """A short automatic reading of the results: best row, paired verdicts against the reference,
    divergences, crashes, memory. One markdown bullet per line."""
    rows = {r["config"]: r for r in result.summary()}
    lines: list[str] = []
    done = [r for r in rows.values() if r["final_loss_mean"] is not None]
    if not done:
        lines.append("No row finished a run without diverging: there is nothing to rank.")
    best = result.best()
    if best is not None:
        b = rows[best]
        among = "rows that never diverged" if not b["seeds_diverged"] else "all rows (every one diverged somewhere)"
        lines.append(f"Lowest mean final eval loss among {among}: **{best}** "
                     f"({b['final_loss_mean']:.4f} ± {b['final_loss_std']:.4f} over {b['seeds_ok']} seed(s)).")
    lines += _verdict_lines(result, rows)
    shared = result.shared_runs()
    if len(shared) > MAX_LISTED:
        lines.append(f"{len(shared)} rows resolve to the same codecs as an earlier row and share its runs (identical "
                     "numbers; `same_runs_as` in results.csv names it).")
    elif shared:
        lines.append("Same codecs, run once (identical numbers): " + ", ".join(
            f"{label} = {first}" for label, first in shared.items()) + ".")
    unstable = [r for r in rows.values() if r["seeds_diverged"]]
    for r in unstable:
        reasons = r["diverged_reasons"] if len(unstable) <= MAX_LISTED else "at steps " + ", ".join(
            str(x.diverged_at) for x in result.runs_of(r["config"]) if x.diverged)
        lines.append(f"**{r['config']} diverged in {r['seeds_diverged']} of {r['seeds_finished']} seeds** "
                     f"({reasons}).")
    if not unstable and any(r["seeds_finished"] for r in rows.values()):
        lines.append("No run diverged.")
    for r in rows.values():
        if r["seeds_crashed"]:
            lines.append(f"**{r['config']} crashed in {r['seeds_crashed']} seed(s)** ({r['crashed_reasons']}); "
                         "running the study again with the same --out retries crashed runs.")
    sized = [r for r in rows.values() if r["state_bytes_per_param"] is not None]
    if sized:
        small = min(sized, key=lambda r: r["state_bytes_per_param"])
        lines.append(f"Smallest optimizer state: {small['config']} ({small['state_bytes_per_param']:.3f} B/param; "
                     "all parameters, including the small ones kept in fp32).")
    if "qerr_v_zero_mean" in next(iter(rows.values()), {}):
        hit = [r for r in rows.values() if (r.get("qerr_v_zero_mean") or 0) > 0]
        if hit:
            listed = (", ".join(f"{r['config']} {r['qerr_v_zero_mean']:.2%}" for r in hit) if len(hit) <= MAX_LISTED
                      else f"{len(hit)} rows, from {min(r['qerr_v_zero_mean'] for r in hit):.2%} to "
                           f"{max(r['qerr_v_zero_mean'] for r in hit):.2%} (the v_zero column)")
            lines.append("Second-moment entries that are positive in fp32 but stored as exactly 0 (the zero-point "
                         f"problem, update m/eps): {listed}.")
    if result.interrupted:
        lines.append("**The study was interrupted (Ctrl-C)**: only the finished runs are summarized; running it "
                     "again with the same --out continues it.")
    return lines


def _verdict_lines(result: StudyResult, rows: dict[str, dict[str, Any]]) -> list[str]:
    """The verdicts against the reference, grouped, and what the number of seeds can resolve."""
    ref = result.reference_row()
    if ref is None or rows[ref.label]["final_loss_mean"] is None:
        return []
    groups: dict[str, list[str]] = {}
    for r in rows.values():
        if r["verdict"] not in (None, "reference"):
            text = r["config"]
            if r["vs_ref_mean"] is not None:
                text += f" ({r['vs_ref_mean']:+.4f}" + (f", p {r['vs_ref_p']:.2g}" if r["vs_ref_p"] is not None else "") + ")"
            groups.setdefault(r["verdict"], []).append(text)
    why = "" if result.settings.get("reference_given") else (" (the first row that quantizes nothing)" if not ref.quantized
                                                             else " (no row quantizes nothing: the first row)")
    lines = [f"Reference: **{ref.label}**{why}; final eval loss {rows[ref.label]['final_loss_mean']:.4f}."]
    for verdict in ("better", "worse", "within noise", "identical", "unstable", "too few seeds"):
        if verdict in groups:
            listed = groups[verdict] if len(groups[verdict]) <= MAX_LISTED or verdict in ("better", "worse") else []
            lines.append(f"*{verdict}* vs {ref.label}: " + ("; ".join(listed) if listed else
                                                             f"{len(groups[verdict])} rows (see the table)") + ".")
    tested = {row.digest for row in result.rows if rows[row.label]["vs_ref_p"] is not None
              and row.label != ref.label and row.digest != ref.digest}
    if len(tested) >= 5:
        lines.append(f"**{len(tested)} distinct comparisons** at the 5% level: about {len(tested) / 20:.1f} 'better' or "
                     "'worse' verdicts are expected by chance alone even if no row differed; p < "
                     f"{0.05 / len(tested):.2g} (Bonferroni) would survive a correction for all of them.")
    n = max((r["vs_ref_seeds"] for r in rows.values() if r["verdict"] not in (None, "reference")), default=0)
    if n < 2:
        lines.append(f"**Too few seeds to tell**: {n} paired seed(s) give no spread, so no interval and no verdict; "
                     f"use --seeds {FEW_SEEDS} or more.")
    elif n < FEW_SEEDS:
        half = [r["vs_ref_half_width"] for r in rows.values() if r["vs_ref_half_width"]]
        lines.append(f"**Few seeds**: with {n} paired seeds the 95% interval is the mean ± {t_quantile(0.975, n - 1):.2f}"
                     " standard errors" + (f" (here ± {min(half):.4f} to ± {max(half):.4f} nats)" if half else "")
                     + "; 'within noise' only says that differences below that are not resolved. "
                     f"{FEW_SEEDS} or more seeds are the usual minimum.")
    return lines


def _write_report(result: StudyResult, path: Path, plots: list[str]) -> Path:
    s = result.settings
    task = result.task
    headers, rows, align = result.table_rows()
    command = s.get("command") or "# library call (qconf.study.compare) with in-memory configs, task or seeds"
    parts = [
        f"# qconf compare: {task.name}" + (" (interrupted)" if result.interrupted else ""),
        "",
        "```bash",
        command,
        "```",
        "",
        (f"Started {result.started}, finished" if result.started else "Collected") + f" {result.finished}; "
        f"torch {s['torch']}.",
        "",
        "## Settings",
        "",
        f"- **task** `{task.name}`: {task.description}",
    ]
    for name in s["optimizers"]:
        hyper = ", ".join(f"{k}={v}" for k, v in s["optimizer_defaults"][name].items())
        parts.append(f"- **optimizer** {name}: lr {s['lr'][name]:g} (schedule {s['lr_schedule']}); {hyper}")
    parts += [
        f"- fused kernel: {s['fused']}; {s['threads']} thread(s) per run",
        f"- **steps** {s['steps']}, **seeds** {', '.join(map(str, s['seeds']))} (every row of a seed starts from "
        f"the same initial weights and reads the same batches); eval every {s['eval_every']} steps",
        f"- **divergence**: {s['divergence']}",
    ]
    if s.get("vary"):
        parts.append("- **sweep**: " + " x ".join(f"`{f}` = {', '.join(v)}" for f, v in s["vary"].items())
                     + f" ({math.prod(len(v) for v in s['vary'].values())} points)")
    if task.baselines:
        parts.append("- **reference losses**: " + ", ".join(f"{k} {v:.4f}" for k, v in task.baselines.items()))
    parts.append("- **rows**: " + ", ".join(f"`{c.label}` ({c.source})" for c in result.rows)
                 + "; each row's resolved config is in `configs/`")
    parts += ["", "## Results", "", _md_table(headers, rows, align), "", RESULTS_LEGEND]
    if result.varied:
        parts += ["", "## Sweep", "", "The rows above by the values of the swept fields (a point's config label is "
                  "its base's; rows that are not points have empty field cells):", "",
                  _md_table(*result.sweep_table_rows())]
    parts += ["", "## Reading", ""]
    parts += [f"- {line}" for line in reading(result)]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    parts += ["", "## Runs", "", _runs_table(result), ""]
    path.write_text("\n".join(parts), **TEXT)
    return path


RESULTS_LEGEND = (
    "Mean ± std over the seeds that finished without diverging. *state B/param*: optimizer state bytes per parameter "
    "(`qconf.memory_report`). *train B/param*: parameters + gradients + states per parameter (with gradient release "
    "one gradient at a time: docs/memory.md). *vs REF (paired, 95% CI)*: final eval loss minus the reference row's "
    "on the same seed (same initial weights and batches), mean over the n seeds both finished ± the half-width of "
    "its 95% t interval; *p*: the paired t-test's p-value; *verdict*: *better* / *worse* when the interval lies "
    "below / above 0, *within noise* when it holds 0, *identical* when every seed gave the same loss (the same runs), "
    "*unstable* when the row diverged on a seed, *too few seeds* below 2 pairs. *unstable*: share of seeds that "
    "diverged. *ms/step*: median train step (batch, forward, backward, optimizer step) after the first steps; "
    "*opt ms/step*: the optimizer step alone. *err STATE*: normalized squared error `sum((decode(q)-s)^2)/sum(s^2)` "
    "of the state against an fp32 shadow optimizer fed the same gradients, at the last evaluation (error columns "
    "include diverged seeds, at their last finite measurement); *err update*: the same for the Adam update "
    "direction m/(sqrt(v)+eps); *v_zero*: share of positive fp32 second-moment entries stored as 0.")


def _runs_table(result: StudyResult) -> str:
    """Every row x seed: status, steps, losses, timing; the ones without a result as not run."""
    run_rows = []
    for r in result.runs:
        final = r.final_eval
        run_rows.append([r.config, r.seed, r.status, r.steps_done,
                         "-" if final is None else f"{final['loss']:.4f}",
                         "-" if r.best_eval_loss is None else f"{r.best_eval_loss:.4f}",
                         "-" if r.step_ms is None else f"{r.step_ms:.1f}", f"{r.wall_s:.1f}", r.reason])
    have = {(r.config, r.seed) for r in result.runs}
    for seed in result.settings["seeds"]:
        for row in result.rows:
            if (row.label, seed) not in have:
                run_rows.append([row.label, seed, "not run", 0, "-", "-", "-", "-", "no stored result (the study "
                                 "was interrupted, or its runs are still running elsewhere)"])
    return _md_table(["config", "seed", "status", "steps", "final eval loss", "best eval loss", "ms/step", "wall s",
                      "note"], run_rows, "lrlrrrrrl")
