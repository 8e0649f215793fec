"""Writing a study's outputs: results.json, results.csv, report.md and PNG plots.

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
import sys
from pathlib import Path
from typing import Any, Sequence

from .results import StudyResult

PLOTS = ("curves.png", "summary.png", "qerror.png")


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
    path.write_text(json.dumps(_clean(result.to_dict()), indent=1, allow_nan=False) + "\n")
    return path


def load_results(path: str | Path) -> StudyResult:
    """A :class:`StudyResult` back from a results.json (or its directory), e.g. to re-plot with
    :func:`write_outputs`. The task is a stand-in (name, description, info, baselines only);
    losses written as null (non-finite) come back as NaN."""
    import dataclasses

    from ..config import load_config
    from .results import ConfigEntry
    from .runner import RunResult
    from .task import Task

    path = Path(path)
    data = json.loads((path / "results.json" if path.is_dir() else path).read_text())
    t = data["task"]

    def unavailable(*_):
        raise RuntimeError("a task loaded from results.json cannot train")

    task = Task(t["name"], unavailable, unavailable, unavailable, unavailable, description=t["description"],
                info=t["info"], baselines=t["baselines"])
    configs = [ConfigEntry(c["label"], c["source"], load_config(c["config"])) for c in data["configs"]]
    nan = float("nan")
    fields = {f.name for f in dataclasses.fields(RunResult)}
    runs = []
    for r in data["runs"]:
        r = {k: v for k, v in r.items() if k in fields}
        r["train_loss"] = [nan if v is None else v for v in r["train_loss"]]
        r["eval"] = [{k: (nan if v is None else v) for k, v in e.items()} for e in r["eval"]]
        r["qerr"] = {k: [[x, nan if v is None else v] for x, v in curve] for k, curve in r["qerr"].items()}
        runs.append(RunResult(**r))
    return StudyResult(task, configs, data["settings"], runs, interrupted=data["interrupted"],
                       started=data["started"], finished=data["finished"])


def _write_csv(result: StudyResult, path: Path) -> Path:
    rows = result.summary()
    fields = list(rows[0]) if rows else ["config"]
    with path.open("w", newline="") as f:
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
              "per parameter (`qconf.memory_report`). *vs BASELINE (paired)*: final eval loss minus the quantization-free "
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
    path.write_text("\n".join(parts))
    return path


# -- plots ---------------------------------------------------------------------------------------
def write_plots(result: StudyResult, out: Path) -> list[Path]:
    """curves.png, summary.png and (when errors were measured) qerror.png; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the [study] extra
        print("qconf compare: matplotlib is not installed, no plots (pip install 'qconf[study]')", file=sys.stderr)
        return []
    if not result.runs:
        return []
    colors = {c.label: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(result.configs)}
    paths = [_plot_curves(result, out / "curves.png", colors, plt), _plot_summary(result, out / "summary.png", colors, plt)]
    if result.state_names():
        paths.append(_plot_qerror(result, out / "qerror.png", colors, plt))
    return paths


def _band(runs: list, key) -> tuple[list[float], list[float], list[float]]:
    """Steps, mean and std over runs of ``key(run) -> {step: value}`` (finite values only)."""
    by_step: dict[float, list[float]] = {}
    for r in runs:
        for step, v in key(r).items():
            if v is not None and math.isfinite(v):
                by_step.setdefault(step, []).append(v)
    steps = sorted(by_step)
    mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
    std = [math.sqrt(sum((v - m) ** 2 for v in by_step[s]) / (len(by_step[s]) - 1)) if len(by_step[s]) > 1 else 0.0
           for s, m in zip(steps, mean)]
    return steps, mean, std


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (non-finite values end the series)."""
    out, acc, buf = [], 0.0, []
    for v in values:
        if not math.isfinite(v):
            break
        buf.append(v)
        acc += v
        if len(buf) > window:
            acc -= buf.pop(0)
        out.append(acc / len(buf))
    return out


def _plot_curves(result: StudyResult, path: Path, colors: dict, plt) -> Path:
    """Three panels: eval loss over the whole run (log y), eval loss over the second half (linear,
    zoomed: where configs differ), smoothed train loss (log y). The y range is capped a little above
    the initial loss; diverged runs are dashed and end in an x (drawn at the cap if beyond it)."""
    markers = _markers(result)
    fig, (ax_e, ax_z, ax_t) = plt.subplots(1, 3, figsize=(18, 5.2))
    steps_total = result.settings["steps"]
    window = max(1, steps_total // 25)
    initial = [r.eval[0]["loss"] for r in result.runs if r.eval and math.isfinite(r.eval[0]["loss"])]
    cap = 1.5 * max(initial) if initial else None
    floor: list[float] = []
    zoom: list[float] = []
    half = steps_total / 2
    for c in result.configs:
        runs = result.runs_of(c.label)
        stable = [r for r in runs if not r.diverged]
        color = colors[c.label]
        if stable:
            xs, mean, std = _band(stable, lambda r: {e["step"]: e["loss"] for e in r.eval})
            lo = [m - s for m, s in zip(mean, std)]
            hi = [m + s for m, s in zip(mean, std)]
            label = f"{c.label} (n={len(stable)} seeds)"
            for ax in (ax_e, ax_z):
                ax.plot(xs, mean, color=color, lw=1.8, marker=markers[c.label], ms=3.5, label=label)
                ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
            zoom += [v for x, a, b in zip(xs, lo, hi) if x >= half for v in (a, b)]
            floor += lo
            xs, mean, std = _band(stable, lambda r: dict(enumerate(_smooth(r.train_loss, window), 1)))
            ax_t.plot(xs, mean, color=color, lw=1.4, label=c.label)
            ax_t.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                              color=color, alpha=0.2, lw=0)
        for i, r in enumerate(r for r in runs if r.diverged):
            label = f"{c.label}: diverged" if i == 0 else None
            pts = [(e["step"], e["loss"]) for e in r.eval if math.isfinite(e["loss"])]
            tl = _smooth(r.train_loss, window)
            for ax, xy in ((ax_e, pts), (ax_t, list(enumerate(tl, 1)))):
                if not xy:
                    continue
                xy = [(x, min(y, cap) if cap else y) for x, y in xy]
                ax.plot(*zip(*xy), color=color, lw=1, ls="--", label=label)
                ax.plot(*xy[-1], marker="x", color=color, ms=10, mew=2.2, clip_on=False)
            floor += [y for _, y in pts]
    for name, value in result.task.baselines.items():
        for ax in (ax_e, ax_t):
            ax.axhline(value, color="0.4", ls=":", lw=1.2)
        ax_e.annotate(f"{name} {value:.3f}", (0.99, value), xycoords=("axes fraction", "data"), ha="right",
                      va="bottom", fontsize=8, color="0.3")
    ax_e.set_title(f"held-out eval loss, mean ± std over seeds ({result.task.name})", fontsize=10)
    ax_z.set_title("held-out eval loss, second half of the run (zoom)", fontsize=10)
    ax_t.set_title(f"train loss (moving average over {window} steps)", fontsize=10)
    for ax in (ax_e, ax_z, ax_t):
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
    ax_e.set_ylabel("cross-entropy (nats), log scale")
    ax_z.set_ylabel("cross-entropy (nats)")
    ax_t.set_ylabel("train loss, log scale")
    for ax in (ax_e, ax_t):
        ax.set_yscale("log")
        if cap is not None:
            ax.set_ylim(top=cap)
        _plain_log_ticks(ax)
    if zoom:
        lo, hi = min(zoom), max(zoom)
        pad = 0.08 * max(hi - lo, 1e-3 * abs(hi))
        ax_z.set_xlim(half, steps_total * 1.02)
        ax_z.set_ylim(lo - pad, hi + pad)
    if cap is not None and any(r.diverged for r in result.runs):
        ax_e.annotate("x = diverged (drawn at the top edge if above it)", (0.01, 0.01), xycoords="axes fraction",
                      ha="left", va="bottom", fontsize=8, color="0.3")
    for ax in (ax_e, ax_z, ax_t):
        ax.legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _markers(result: StudyResult) -> dict[str, str]:
    """One marker shape per config, so overlapping curves stay distinguishable."""
    shapes = "osD^vPX<>*"
    return {c.label: shapes[i % len(shapes)] for i, c in enumerate(result.configs)}


def _plain_log_ticks(ax) -> None:
    """Plain numbers on a log axis; minor ticks labelled only when it spans less than a decade."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    lo, hi = ax.get_ylim()
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    if lo > 0 and hi / lo < 10:
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _plot_summary(result: StudyResult, path: Path, colors: dict, plt) -> Path:
    rows = result.summary()
    labels = [r["config"] for r in rows]
    fig, (ax_b, ax_l) = plt.subplots(1, 2, figsize=(max(9, 1.6 * len(rows) + 4), 4.8))
    x = list(range(len(rows)))
    bpp = [r["state_bytes_per_param"] or 0.0 for r in rows]
    bars = ax_b.bar(x, bpp, color=[colors[lab] for lab in labels])
    ax_b.bar_label(bars, fmt="%.2f", fontsize=8)
    ax_b.set_ylabel("optimizer state bytes / parameter")
    ax_b.set_title("state memory (fp32 Adam = 8 B/param)")
    means = [r["final_loss_mean"] for r in rows]
    stds = [r["final_loss_std"] or 0.0 for r in rows]
    shown = [(i, m, s) for i, (m, s) in enumerate(zip(means, stds)) if m is not None]
    if shown:
        bars = ax_l.bar([i for i, _, _ in shown], [m for _, m, _ in shown], yerr=[s for _, _, s in shown],
                        capsize=4, color=[colors[labels[i]] for i, _, _ in shown])
        ax_l.bar_label(bars, fmt="%.4f", fontsize=8, padding=3)
        lo = min(m - s for _, m, s in shown)
        hi = max(m + s for _, m, s in shown)
        span = max(hi - lo, 0.02 * hi)
        ax_l.set_ylim(max(0.0, lo - 1.5 * span), hi + 0.6 * span)
    ax_l.set_ylabel("final eval loss (axis zoomed, not from 0)")
    ax_l.set_title("final eval loss, mean ± std over seeds")
    for i, r in enumerate(rows):
        if r["seeds_diverged"]:
            ax_l.annotate(f"{r['unstable']:.0%} unstable", (i, 0.02), xycoords=("data", "axes fraction"),
                          ha="center", fontsize=8, color="red")
    for ax in (ax_b, ax_l):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=20 if len(rows) > 3 else 0, ha="right" if len(rows) > 3 else "center",
                           fontsize=9)
        ax.set_xlabel("config")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_QERR_TITLES = {"exp_avg": "first moment exp_avg", "exp_avg_sq": "second moment exp_avg_sq",
                "momentum_buffer": "SGD momentum_buffer", "update": "Adam update m/(sqrt(v)+eps)",
                "v_zero": "share of v > 0 stored as 0"}


def _plot_qerror(result: StudyResult, path: Path, colors: dict, plt) -> Path:
    markers = _markers(result)
    states = result.state_names()
    ncols = 2 if len(states) == 4 else min(3, len(states))
    nrows = math.ceil(len(states) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.3 * nrows), squeeze=False)
    for ax in axes.flat[len(states):]:
        ax.set_visible(False)
    for ax, state in zip(axes.flat, states):
        drawn = False
        for c in result.configs:
            color = colors[c.label]
            runs = [r for r in result.runs_of(c.label) if not r.diverged and state in r.qerr]
            if runs:
                xs, mean, std = _band(runs, lambda r: {s: v for s, v in r.qerr[state]})
                pts = [(x, m, s) for x, m, s in zip(xs, mean, std) if m > 0]
                if pts:
                    xs, mean, std = zip(*pts)
                    ax.plot(xs, mean, color=color, marker=markers[c.label], ms=3, lw=1.5, label=c.label)
                    ax.fill_between(xs, [max(m - s, m * 0.1) for m, s in zip(mean, std)],
                                    [m + s for m, s in zip(mean, std)], color=color, alpha=0.2, lw=0)
                    drawn = True
                else:
                    ax.plot([], [], color=color, label=f"{c.label} (exactly 0)")
            for i, r in enumerate(r for r in result.runs_of(c.label) if r.diverged and state in r.qerr):
                pts = [(x, v) for x, v in r.qerr[state] if v is not None and math.isfinite(v) and v > 0]
                if pts:
                    ax.plot(*zip(*pts), color=color, ls="--", lw=1, marker=markers[c.label], ms=3,
                            label=f"{c.label}: diverged seeds" if i == 0 else None)
                    ax.plot(*pts[-1], marker="x", color=color, ms=9, mew=2)
                    drawn = True
        if drawn:
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "0 for every config", transform=ax.transAxes, ha="center", va="center", color="0.4")
        ax.set_title(_QERR_TITLES.get(state, state), fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("share of entries" if state == "v_zero" else "normalized MSE vs fp32 shadow")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("quantization error of the optimizer states against the fp32 shadow (mean ± std over stable "
                 "seeds; diverged seeds dashed, x = last evaluation before stopping)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
