"""The PNG plots of a study: curves.png (eval and train loss per row), summary.png (state
bytes/param and final eval loss, bars), qerror.png (each state's quantization error against the
fp32 shadow over the steps) and, for a sweep, sweep.png (:mod:`qconf.study.sweep_plot`). Needs
matplotlib (the ``[study]`` extra); without it there are no plots.
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from .plan import Row
from .results import StudyResult
from .runner import RunResult
from .sweep_plot import plot_sweep


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
    colors = {c.label: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(result.rows)}
    paths = [_plot_curves(result, out / "curves.png", colors, plt), _plot_summary(result, out / "summary.png", colors, plt)]
    if result.state_names():
        paths.append(_plot_qerror(result, out / "qerror.png", colors, plt))
    sweep = plot_sweep(result, out / "sweep.png", plt)
    if sweep is not None:
        paths.append(sweep)
    return paths


def _save(fig: Any, path: Path, dpi: int, plt: Any) -> Path:
    """Lay out ``fig``, write it to ``path`` as PNG and close it."""
    with warnings.catch_warnings():  # many rows: the legends may not fit; the figure is still drawn
        warnings.filterwarnings("ignore", "Tight layout not applied", UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


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


def _curves_stable(axes: Sequence[Any], c: Row, stable: list[RunResult], color: Any, marker: str,
                   window: int, half: float) -> list[float]:
    """Mean ± std bands of the runs that did not diverge: eval loss on the full and the zoomed
    panel, smoothed train loss on the third. Returns the band edges from the second half (zoom range)."""
    ax_e, ax_z, ax_t = axes
    xs, mean, std = _band(stable, lambda r: {e["step"]: e["loss"] for e in r.eval})
    lo = [m - s for m, s in zip(mean, std)]
    hi = [m + s for m, s in zip(mean, std)]
    label = f"{c.label} (n={len(stable)} seeds)"
    for ax in (ax_e, ax_z):
        ax.plot(xs, mean, color=color, lw=1.8, marker=marker, ms=3.5, label=label)
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
    zoom = [v for x, a, b in zip(xs, lo, hi) if x >= half for v in (a, b)]
    xs, mean, std = _band(stable, lambda r: dict(enumerate(_smooth(r.train_loss, window), 1)))
    ax_t.plot(xs, mean, color=color, lw=1.4, label=c.label)
    ax_t.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                      color=color, alpha=0.2, lw=0)
    return zoom


def _curves_diverged(ax_e: Any, ax_t: Any, c: Row, diverged: list[RunResult], color: Any, window: int,
                     cap: float | None) -> None:
    """Each diverged run dashed, ending in an x (values above ``cap`` drawn at the cap)."""
    for i, r in enumerate(diverged):
        label = f"{c.label}: diverged" if i == 0 else None
        pts = [(e["step"], e["loss"]) for e in r.eval if math.isfinite(e["loss"])]
        tl = _smooth(r.train_loss, window)
        for ax, xy in ((ax_e, pts), (ax_t, list(enumerate(tl, 1)))):
            if not xy:
                continue
            xy = [(x, min(y, cap) if cap else y) for x, y in xy]
            ax.plot(*zip(*xy), color=color, lw=1, ls="--", label=label)
            ax.plot(*xy[-1], marker="x", color=color, ms=10, mew=2.2, clip_on=False)


def _curves_axes(result: StudyResult, axes: Sequence[Any], window: int, cap: float | None,
                 zoom: list[float]) -> None:
    """The task's reference losses, titles, labels, log scales capped at ``cap``, the zoom range, legends."""
    ax_e, ax_z, ax_t = axes
    steps_total = result.settings["steps"]
    for name, value in result.task.baselines.items():
        for ax in (ax_e, ax_t):
            ax.axhline(value, color="0.4", ls=":", lw=1.2)
        ax_e.annotate(f"{name} {value:.3f}", (0.99, value), xycoords=("axes fraction", "data"), ha="right",
                      va="bottom", fontsize=8, color="0.3")
    ax_e.set_title(f"held-out eval loss, mean ± std over seeds ({result.task.name})", fontsize=10)
    ax_z.set_title("held-out eval loss, second half of the run (zoom)", fontsize=10)
    ax_t.set_title(f"train loss (moving average over {window} steps)", fontsize=10)
    for ax in axes:
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
        ax_z.set_xlim(steps_total / 2, steps_total * 1.02)
        ax_z.set_ylim(lo - pad, hi + pad)
    if cap is not None and any(r.diverged for r in result.runs):
        ax_e.annotate("x = diverged (drawn at the top edge if above it)", (0.01, 0.01), xycoords="axes fraction",
                      ha="left", va="bottom", fontsize=8, color="0.3")
    for ax in axes:
        ax.legend(fontsize=7.5, loc="upper right")


def _plot_curves(result: StudyResult, path: Path, colors: dict, plt) -> Path:
    """Three panels: eval loss over the whole run (log y), eval loss over the second half (linear,
    zoomed: where configs differ), smoothed train loss (log y). The y range is capped a little above
    the initial loss; diverged runs are dashed and end in an x (drawn at the cap if beyond it)."""
    markers = _markers(result)
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    ax_e, _, ax_t = axes
    steps_total = result.settings["steps"]
    window = max(1, steps_total // 25)
    initial = [r.eval[0]["loss"] for r in result.runs if r.eval and math.isfinite(r.eval[0]["loss"])]
    cap = 1.5 * max(initial) if initial else None
    zoom: list[float] = []
    for c in result.rows:
        runs = result.runs_of(c.label)
        stable = [r for r in runs if not r.diverged]
        if stable:
            zoom += _curves_stable(axes, c, stable, colors[c.label], markers[c.label], window, steps_total / 2)
        _curves_diverged(ax_e, ax_t, c, [r for r in runs if r.diverged], colors[c.label], window, cap)
    _curves_axes(result, axes, window, cap, zoom)
    return _save(fig, path, 100, plt)


def _markers(result: StudyResult) -> dict[str, str]:
    """One marker shape per config, so overlapping curves stay distinguishable."""
    shapes = "osD^vPX<>*"
    return {c.label: shapes[i % len(shapes)] for i, c in enumerate(result.rows)}


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
    return _save(fig, path, 110, plt)


_QERR_TITLES = {"exp_avg": "first moment exp_avg", "exp_avg_sq": "second moment exp_avg_sq",
                "momentum_buffer": "momentum_buffer (SGD, Muon)", "update": "Adam update m/(sqrt(v)+eps)",
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
        for c in result.rows:
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
    return _save(fig, path, 110, plt)
