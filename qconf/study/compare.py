"""``qconf.study.compare``: train a task under several qconfigs and seeds, summarize, write reports.

Every (config, seed) run starts from ``task.make_model(seed)`` and reads ``task.batches(seed)``, so
the configs of one seed see the same initial weights and the same data order; only the optimizer
state format differs. Runs go seed by seed (all configs for seed 0, then seed 1, ...), so a study
stopped with Ctrl-C still compares every config on the seeds it finished.
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
import math
import os
import shlex
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..config import QConfig, load_config
from .runner import OPTIMIZERS, RunInterrupted, RunResult, WARMUP_FRACTION, make_optimizer, train_run
from .task import StudyError, Task
from .tasks import DEFAULT_TASK, resolve_task

DEFAULT_SEEDS = 2
FUSED_CHOICES = {"auto": None, "on": True, "off": False}


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
            sized = [r.state_bytes_per_param for r in runs if r.state_bytes_per_param is not None]
            row["state_bytes_per_param"] = sized[0] if sized else None
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
        headers = ["config", "state B/param", "final eval loss", "best eval loss"]
        if base is not None:
            headers.append(f"vs {base.label} (paired)")
        headers += [f"final {m}" for m in metrics]
        headers += ["unstable", "ms/step", "opt ms/step"]
        headers += [("err " if s not in ("v_zero",) else "") + s for s in states]
        rows = []
        for r in self.summary():
            line: list[Any] = [r["config"], _fmt(r["state_bytes_per_param"], ".3f"),
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
        align = "lrll" + ("l" if base is not None else "") + "l" * len(metrics) + "lrr" + "r" * len(states)
        return headers, rows, align

    def table(self) -> str:
        from .._table import format_table

        headers, rows, align = self.table_rows()
        return format_table(headers, rows, align=align)

    def to_dict(self) -> dict[str, Any]:
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


# -- argument handling ---------------------------------------------------------------------------
def _labels(sources: list[str]) -> list[str]:
    """File stems, made unique by prefixing parent directories where two stems collide."""
    labels = [Path(s).stem if s.endswith((".yml", ".yaml")) else s for s in sources]
    depth = 1
    while len(set(labels)) < len(labels) and depth < 8:
        depth += 1
        labels = [("/".join(Path(s).with_suffix("").parts[-depth:]) if labels.count(lab) > 1 else lab)
                  for s, lab in zip(sources, labels)]
    seen: dict[str, int] = {}
    out = []
    for lab in labels:  # the same file twice: number the repeats
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab}#{seen[lab]}")
    return out


def load_configs(configs: Sequence[Any] | Mapping[str, Any]) -> list[ConfigEntry]:
    """Config paths (or QConfig/dict objects, or a ``{label: config}`` mapping) -> entries.
    A missing file is a :class:`StudyError`; an invalid one raises :class:`~qconf.QConfigError`."""
    if isinstance(configs, (str, os.PathLike)):
        configs = [configs]
    if isinstance(configs, Mapping):
        items = list(configs.items())
    else:
        items = []
        sources = [str(c) if isinstance(c, (str, os.PathLike)) else f"config{i}" for i, c in enumerate(configs)]
        items = list(zip(_labels(sources), configs))
    if not items:
        raise StudyError("no configs to compare (give at least one config file)")
    entries = []
    for label, cfg in items:
        if isinstance(cfg, (str, os.PathLike)):
            if not Path(cfg).is_file():
                raise StudyError(f"config file {str(cfg)!r} not found")
            source = str(cfg)
        else:
            source = f"<{type(cfg).__name__}>"
        entries.append(ConfigEntry(str(label), source, load_config(cfg)))
    return entries


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StudyError(f"{name} must be a positive integer, got {value!r}")
    return value


def _seeds(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        return list(range(_positive_int("seeds", seeds)))
    try:
        out = [int(s) for s in seeds]
    except (TypeError, ValueError):
        raise StudyError(f"seeds must be a count or a list of integers, got {seeds!r}") from None
    if not out or len(set(out)) != len(out):
        raise StudyError(f"seeds must be a non-empty list of distinct integers, got {seeds!r}")
    return out


def default_out_dir() -> Path:
    return Path("qconf-results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def compare(configs: Sequence[Any] | Mapping[str, Any], task: str | Task = DEFAULT_TASK, *, optimizer: str = "adamw",
            steps: int | None = None, seeds: int | Sequence[int] = DEFAULT_SEEDS, lr: float | None = None,
            fused: str | bool | None = "auto", out: str | os.PathLike | None | bool = None,
            eval_every: int | None = None, threads: int | None = 1,
            optimizer_kwargs: Mapping[str, Any] | None = None, measure_error: bool = True, progress: bool = True,
            announce: bool = False) -> StudyResult:
    """Train ``task`` with each config for each seed and compare them.

    Args:
        configs: config files (or QConfig / dict objects, or a ``{label: config}`` mapping).
        task: built-in task name (``"charlm"``, ``"digits"``), ``"module:function"`` returning a
            :class:`Task`, or a Task.
        optimizer: ``adamw`` | ``adam`` | ``sgd`` (momentum 0.9) | ``lion``.
        steps, lr: training steps and (peak) learning rate; default: the task's.
        seeds: a count K (seeds 0..K-1) or explicit seeds.
        fused: ``"auto"``/None (native kernel when built), ``"on"``/True, ``"off"``/False.
        out: output directory (default ``qconf-results/<timestamp>``); False writes nothing.
        eval_every: evaluate (and measure state errors) every N steps; default steps // 20.
        threads: ``torch.set_num_threads`` for the study (restored afterwards); default 1 (small models:
            on a 2-core machine one thread was 2-20x faster than two when anything else was running);
            None keeps torch's setting.
        optimizer_kwargs: extra optimizer arguments (e.g. ``{"eps": 1e-6}``), same for every config.
        measure_error: run the fp32 shadow optimizer and measure state quantization errors.
        progress: show a progress bar (tqdm, on stderr) and one line per finished run.
        announce: print the task and settings before training (the CLI does).

    Returns a :class:`StudyResult`; on Ctrl-C the finished runs are kept, the interrupted one is
    marked, outputs are written and ``result.interrupted`` is True (no exception).
    Raises :class:`StudyError` / :class:`~qconf.QConfigError` before training on bad arguments.
    """
    # -- validate everything before the first step -----------------------------------------------
    entries = load_configs(configs)
    if optimizer not in OPTIMIZERS:
        raise StudyError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    if isinstance(fused, str):
        if fused not in FUSED_CHOICES:
            raise StudyError(f"fused must be one of {', '.join(FUSED_CHOICES)}, got {fused!r}")
        fused = FUSED_CHOICES[fused]
    if fused not in (None, True, False):
        raise StudyError(f"fused must be 'auto', 'on', 'off', None, True or False, got {fused!r}")
    seed_list = _seeds(seeds)
    if threads is not None:
        _positive_int("threads", threads)
    task_obj = resolve_task(task)
    steps = _positive_int("steps", task_obj.default_steps if steps is None else steps)
    lr = task_obj.default_lr if lr is None else lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise StudyError(f"lr must be a positive number, got {lr!r}")
    eval_every = _positive_int("eval_every", max(1, steps // 20) if eval_every is None else eval_every)
    kwargs = dict(optimizer_kwargs or {})
    accepted = [n for n, a in inspect.signature(OPTIMIZERS[optimizer]).parameters.items()
                if n not in ("self", "params", "lr", "qconfig", "fused") and a.kind is not a.VAR_KEYWORD]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise StudyError(f"{optimizer} has no argument {unknown[0]!r} (accepted: {', '.join(accepted)})")
    try:  # the optimizer arguments (and fused=True without the extension) fail here, not mid-study
        make_optimizer(optimizer, [("probe", torch.nn.Parameter(torch.zeros(2)))], lr=lr,
                       qconfig=entries[0].config, fused=fused, kwargs=kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise StudyError(f"{optimizer} optimizer: {' '.join(str(e).split())}") from None
    out_dir = None if out is False else Path(default_out_dir() if out in (None, True) else out)

    settings = {"task": task_obj.name, "optimizer": optimizer, "steps": steps, "seeds": seed_list, "lr": lr,
                "lr_schedule": getattr(task_obj.lr_schedule, "__name__", None) if task_obj.lr_schedule else "constant",
                "fused": {None: "auto", True: "on", False: "off"}[fused], "eval_every": eval_every,
                "threads": threads or torch.get_num_threads(), "optimizer_kwargs": kwargs,
                "optimizer_defaults": _optimizer_defaults(optimizer, kwargs),
                "divergence": f"non-finite train/eval loss, or eval loss above the initial eval loss after "
                              f"{WARMUP_FRACTION:.0%} of the steps",
                "torch": torch.__version__}
    settings["command"] = _equivalent_command(entries, task, settings, out_dir, measure_error)
    result = StudyResult(task_obj, entries, settings, started=_now())
    if announce:
        print(f"task {task_obj.name}: {task_obj.description}")
        print(f"{len(entries)} config(s) x {len(seed_list)} seed(s) x {steps} steps; {optimizer}, lr {lr:g} "
              f"({settings['lr_schedule']}), fused {settings['fused']}, {settings['threads']} thread(s)"
              + (f"; writing to {out_dir}" if out_dir is not None else ""), flush=True)

    # -- run ---------------------------------------------------------------------------------
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    bar = _progress_bar(len(entries) * len(seed_list) * steps, progress)
    try:
        for seed in seed_list:
            for entry in entries:
                def on_step(step: int, loss: float, _label: str = entry.label, _seed: int = seed) -> None:
                    bar.update(1)
                    if step % 10 == 0 or step == 1:
                        bar.set_postfix_str(f"{_label} seed {_seed} loss {loss:.3f}", refresh=False)

                run = train_run(task_obj, entry.config, entry.label, seed, optimizer=optimizer, steps=steps, lr=lr,
                                fused=fused, eval_every=eval_every, optimizer_kwargs=kwargs,
                                measure_error=measure_error, on_step=on_step)
                result.runs.append(run)
                bar.update(steps - run.steps_done)
                if progress:
                    bar.write(_run_line(run))
    except RunInterrupted as stop:
        result.runs.append(stop.result)
        result.interrupted = True
        if progress:
            bar.write(f"interrupted: {stop.result.config} seed {stop.result.seed} "
                      f"({stop.result.steps_done}/{steps} steps); writing what is done")
    except KeyboardInterrupt:  # between runs
        result.interrupted = True
    finally:
        bar.close()
        torch.set_num_threads(previous_threads)
    result.finished = _now()

    if out_dir is not None:
        from .report import write_outputs

        write_outputs(result, out_dir)
        result.out = out_dir
    return result


def _equivalent_command(entries: list[ConfigEntry], task: Any, settings: dict[str, Any], out: Path | None,
                        measure_error: bool) -> str | None:
    """The explicit ``qconf compare`` command that repeats this study (None for in-memory configs/tasks)."""
    if not isinstance(task, str) or any(e.source.startswith("<") for e in entries):
        return None
    argv = ["qconf", "compare", *(e.source for e in entries), "--task", task, "--optimizer", settings["optimizer"],
            "--steps", str(settings["steps"]), "--seeds", str(len(settings["seeds"])), "--lr", repr(settings["lr"]),
            "--fused", settings["fused"], "--eval-every", str(settings["eval_every"])]
    if settings["seeds"] != list(range(len(settings["seeds"]))):
        return None  # explicit seed lists have no CLI spelling
    if settings["threads"] is not None:
        argv += ["--threads", str(settings["threads"])]
    for k, v in settings["optimizer_kwargs"].items():
        argv += ["--opt-arg", f"{k}={','.join(map(str, v)) if isinstance(v, (tuple, list)) else v}"]
    if not measure_error:
        argv.append("--no-qerr")
    if out is not None:
        argv += ["--out", str(out)]
    return " ".join(shlex.quote(a) for a in argv)


def _optimizer_defaults(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters the runs actually used (the optimizer's defaults + study defaults + kwargs)."""
    opt = make_optimizer(name, [torch.nn.Parameter(torch.zeros(2))], lr=1.0, qconfig={}, fused=False,
                         kwargs=dict(kwargs))
    group = {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "lr", "param_names")}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}


def _run_line(run: RunResult) -> str:
    final = run.final_eval
    text = f"{run.config} seed {run.seed}: "
    if final is not None:
        text += f"eval loss {final['loss']:.4f}"
        text += "".join(f", {k} {v:.4f}" for k, v in final.items() if k not in ("step", "loss"))
    text += f" [{run.status}{': ' + run.reason if run.reason else ''}] {run.wall_s:.1f} s"
    return text


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...
    def write(self, s: str) -> None: ...
    def close(self) -> None: ...


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="step", desc="qconf compare", dynamic_ncols=True, smoothing=0.1, mininterval=0.5)
