"""sweep.png: a sweep's final eval loss against its varied fields.

* one field: the mean final eval loss (± std over seeds) against the field's values, one line per
  optimizer, the reference row's loss dashed; markers coloured by the paired verdict;
* two fields: a heatmap over them (cell: mean ± std and the verdict, or how many seeds diverged);
* more: one heatmap of the first two fields per combination of the others (and per optimizer),
  at most :data:`MAX_PANELS` panels on one shared colour scale.
"""
from __future__ import annotations

import itertools
import math
import textwrap
from pathlib import Path
from typing import Any

from .results import StudyResult

MAX_PANELS = 16
_VERDICT_COLORS = {"better": "tab:green", "worse": "tab:red", "within noise": "0.45", "identical": "0.45",
                   "unstable": "red", "too few seeds": "0.7", "reference": "black"}
_VERDICT_MARKS = {"better": "+", "worse": "-", "within noise": "~", "identical": "=", "unstable": "!",
                  "too few seeds": "?", "reference": "ref"}


def _cells(result: StudyResult, summary: list[dict[str, Any]]) -> dict[tuple[str, tuple[str, ...]], dict[str, Any]]:
    """``{(optimizer, values of every varied field): summary row}`` of the sweep's points."""
    fields = [f for f, _ in result.varied]
    out = {}
    for r in summary:
        if all(f"vary {f}" in r for f in fields):
            out[(r["optimizer"], tuple(r[f"vary {f}"] for f in fields))] = r
    return out


def plot_sweep(result: StudyResult, path: Path, plt: Any) -> Path | None:
    """Write sweep.png for a study with a sweep; None without one (or with too many panels)."""
    if not result.varied:
        return None
    summary = result.summary()
    cells = _cells(result, summary)
    if not cells:
        return None
    optimizers = list(dict.fromkeys(opt for opt, _ in cells))
    ref = next((r for r in summary if r["config"] == result.reference), None)
    ref_loss = ref["final_loss_mean"] if ref is not None else None
    if len(result.varied) == 1:
        fig = _line(result, cells, optimizers, ref_loss, plt)
    else:
        facets = list(itertools.product(optimizers, *[v for _, v in result.varied[2:]]))
        if len(facets) > MAX_PANELS:
            return None
        fig = _heatmaps(result, cells, facets, plt)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _line(result: StudyResult, cells: dict, optimizers: list[str], ref_loss: float | None, plt: Any) -> Any:
    field, values = result.varied[0]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(values) + 3), 4.6))
    xs = list(range(len(values)))
    for k, opt in enumerate(optimizers):
        rows = [cells.get((opt, (v,))) for v in values]
        means = [r["final_loss_mean"] if r and r["final_loss_mean"] is not None else math.nan for r in rows]
        stds = [r["final_loss_std"] or 0.0 if r and r["final_loss_mean"] is not None else 0.0 for r in rows]
        label = field if len(optimizers) == 1 else opt
        ax.errorbar(xs, means, yerr=stds, color=f"C{k}", lw=1.6, capsize=4, label=f"{label} (mean ± std over seeds)")
        for x, r, m in zip(xs, rows, means):
            if r is None:
                continue
            if r["seeds_diverged"]:
                ax.annotate(f"diverged {r['seeds_diverged']}/{r['seeds_finished']}", (x, 0.97),
                            xycoords=("data", "axes fraction"), ha="center", va="top", fontsize=8, color="red")
            if not math.isnan(m):
                ax.plot(x, m, "o", ms=8, color=_VERDICT_COLORS.get(r["verdict"], "0.45"), zorder=3)
    if ref_loss is not None:
        ax.axhline(ref_loss, color="black", ls="--", lw=1, label=f"reference {result.reference}")
    ax.set_xticks(xs)
    ax.set_xticklabels(values)
    ax.set_xlabel(field)
    ax.set_ylabel("final eval loss")
    ax.set_title(textwrap.fill("final eval loss against the swept value; dot colour: the paired verdict vs the "
                               f"reference {result.reference} (green better, red worse, grey within noise)", 90),
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _heatmaps(result: StudyResult, cells: dict, facets: list[tuple[str, ...]], plt: Any) -> Any:
    (f1, v1), (f2, v2) = result.varied[0], result.varied[1]
    finite = sorted(r["final_loss_mean"] for r in cells.values() if r["final_loss_mean"] is not None)
    # colours span the best cell to the 90th percentile: one far-off cell does not flatten the rest (its
    # number is printed in it)
    vmin, vmax = (finite[0], finite[min(len(finite) - 1, math.ceil(0.9 * (len(finite) - 1)))]) if finite else (0, 1)
    vmax = vmax if vmax > vmin else vmin + 1e-6
    ncols = min(4, len(facets))
    nrows = math.ceil(len(facets) / ncols)
    width = max(8.0, ncols * (1.35 * len(v2) + 2.2))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, nrows * (0.62 * len(v1) + 1.9) + 0.5), squeeze=False,
                             layout="constrained")
    image = None
    for ax, facet in zip(axes.flat, facets):
        opt, rest = facet[0], facet[1:]
        grid = [[cells.get((opt, (a, b, *rest))) for b in v2] for a in v1]
        data = [[r["final_loss_mean"] if r and r["final_loss_mean"] is not None else math.nan for r in line]
                for line in grid]
        image = ax.imshow(data, cmap="viridis_r", vmin=vmin, vmax=vmax, aspect="auto")
        for i, line in enumerate(grid):
            for j, r in enumerate(line):
                bright = not math.isnan(data[i][j]) and (data[i][j] - vmin) < 0.5 * (vmax - vmin)  # yellow end
                diverged = bool(r and r["seeds_diverged"])
                ax.text(j, i, _cell_text(r), ha="center", va="center", fontsize=7,
                        color=("darkred" if bright or math.isnan(data[i][j]) else "#ff9a9a") if diverged
                        else ("black" if bright else "white"))
        ax.set_xticks(range(len(v2)))
        ax.set_xticklabels(v2, fontsize=8)
        ax.set_yticks(range(len(v1)))
        ax.set_yticklabels(v1, fontsize=8)
        ax.set_xlabel(f2, fontsize=8)
        ax.set_ylabel(f1, fontsize=8)
        title = ", ".join(f"{f}={v}" for (f, _), v in zip(result.varied[2:], rest))
        ax.set_title(" ".join(x for x in ((opt if len({f[0] for f in facets}) > 1 else ""), title) if x) or
                     "final eval loss", fontsize=7)
    for ax in list(axes.flat)[len(facets):]:
        ax.set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, extend="max",
                     label="mean final eval loss (darkest: the 90th percentile and above)")
    fig.suptitle(textwrap.fill(f"final eval loss: mean ± std over seeds; paired verdict vs {result.reference}: "
                               "+ better, - worse, ~ within noise, = identical, ! unstable, ? too few seeds",
                               int(width * 13)), fontsize=9)
    return fig


def _cell_text(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if r["final_loss_mean"] is None:
        return f"diverged\n{r['seeds_diverged']}/{r['seeds_finished']}" if r["seeds_diverged"] else "no result"
    text = f"{r['final_loss_mean']:.4f}\n±{r['final_loss_std']:.4f}"
    mark = _VERDICT_MARKS.get(r["verdict"] or "")
    if mark:
        text += f" {mark}"
    if r["seeds_diverged"]:
        text += f"\ndiv {r['seeds_diverged']}/{r['seeds_finished']}"
    return text
