"""``qconf.study.compare``: the study itself -- load the configs and check every argument, train a
task under each qconfig and seed, and hand the :class:`~qconf.study.results.StudyResult` to the
report writers (:mod:`qconf.study.report`).

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
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..config import load_config
from ..config.builtin import is_builtin_name
from .report import write_outputs
from .results import ConfigEntry, StudyResult
from .runner import OPTIMIZERS, RunInterrupted, RunResult, WARMUP_FRACTION, make_optimizer, train_run
from .task import StudyError, Task
from .tasks import DEFAULT_TASK, resolve_task

DEFAULT_SEEDS = 2
FUSED_CHOICES = {"auto": None, "on": True, "off": False}


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
    # a label is display text (plots, tables): a file name's undecodable bytes, which reach sys.argv
    # as surrogate escapes, show as \xNN
    return [lab.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for lab in out]


def load_configs(configs: Sequence[Any] | Mapping[str, Any]) -> list[ConfigEntry]:
    """Config paths or built-in names (or QConfig/dict objects, or a ``{label: config}`` mapping) -> entries.
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
            if not Path(cfg).is_file() and not is_builtin_name(cfg):  # a name: load_config resolves it
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
    """``qconf-results/<local date-time>``: where a study writes when no ``out`` is given."""
    return Path("qconf-results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def compare(configs: Sequence[Any] | Mapping[str, Any], task: str | Task = DEFAULT_TASK, *, optimizer: str = "adamw",
            steps: int | None = None, seeds: int | Sequence[int] = DEFAULT_SEEDS, lr: float | None = None,
            fused: str | bool | None = "auto", out: str | os.PathLike | None | bool = None,
            eval_every: int | None = None, threads: int | None = 1,
            optimizer_kwargs: Mapping[str, Any] | None = None, measure_error: bool = True, progress: bool = True,
            announce: bool = False) -> StudyResult:
    """Train ``task`` with each config for each seed and compare them.

    Args:
        configs: config files or built-in names such as ``"default"`` (or QConfig / dict objects, or a
            ``{label: config}`` mapping).
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
    a = _check_arguments(configs, task, optimizer=optimizer, steps=steps, seeds=seeds, lr=lr, fused=fused, out=out,
                         eval_every=eval_every, threads=threads, optimizer_kwargs=optimizer_kwargs)
    settings = _settings(a)
    settings["command"] = _equivalent_command(a.entries, task, settings, a.out_dir, measure_error)
    result = StudyResult(a.task, a.entries, settings, started=_now())
    if announce:
        _announce(a, settings)
    _run_all(result, a, measure_error, progress)
    result.finished = _now()
    if a.out_dir is not None:
        write_outputs(result, a.out_dir)
        result.out = a.out_dir
    return result


@dataclasses.dataclass(frozen=True)
class _Arguments:
    """:func:`compare`'s arguments after validation, defaults filled in (what every run uses)."""

    entries: list[ConfigEntry]
    task: Task
    optimizer: str
    steps: int
    seeds: list[int]
    lr: float
    fused: bool | None
    eval_every: int
    threads: int | None
    kwargs: dict[str, Any]
    out_dir: Path | None


def _fused_flag(fused: str | bool | None) -> bool | None:
    """``"auto"``/``"on"``/``"off"`` or None/True/False -> None/True/False; StudyError otherwise."""
    if isinstance(fused, str):
        if fused not in FUSED_CHOICES:
            raise StudyError(f"fused must be one of {', '.join(FUSED_CHOICES)}, got {fused!r}")
        fused = FUSED_CHOICES[fused]
    if fused not in (None, True, False):
        raise StudyError(f"fused must be 'auto', 'on', 'off', None, True or False, got {fused!r}")
    return fused


def _check_optimizer(optimizer: str, kwargs: dict[str, Any], lr: float, fused: bool | None,
                     entries: list[ConfigEntry]) -> None:
    """StudyError for an argument ``optimizer`` does not take, or one it rejects (built once on a probe
    parameter, so that fused=True without the extension also fails here, not mid-study)."""
    accepted = [n for n, a in inspect.signature(OPTIMIZERS[optimizer]).parameters.items()
                if n not in ("self", "params", "lr", "qconfig", "fused") and a.kind is not a.VAR_KEYWORD]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise StudyError(f"{optimizer} has no argument {unknown[0]!r} (accepted: {', '.join(accepted)})")
    try:
        make_optimizer(optimizer, [("probe", torch.nn.Parameter(torch.zeros(2)))], lr=lr,
                       qconfig=entries[0].config, fused=fused, kwargs=kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise StudyError(f"{optimizer} optimizer: {' '.join(str(e).split())}") from None


def _check_arguments(configs: Sequence[Any] | Mapping[str, Any], task: str | Task, *, optimizer: str,
                     steps: int | None, seeds: int | Sequence[int], lr: float | None, fused: str | bool | None,
                     out: str | os.PathLike | None | bool, eval_every: int | None, threads: int | None,
                     optimizer_kwargs: Mapping[str, Any] | None) -> _Arguments:
    """Validate everything before the first step (the first problem raises StudyError or
    QConfigError) and fill in the task's defaults."""
    entries = load_configs(configs)
    if optimizer not in OPTIMIZERS:
        raise StudyError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    fused = _fused_flag(fused)
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
    _check_optimizer(optimizer, kwargs, lr, fused, entries)
    out_dir = None if out is False else Path(default_out_dir() if out in (None, True) else out)
    return _Arguments(entries, task_obj, optimizer, steps, seed_list, lr, fused, eval_every, threads, kwargs, out_dir)


def _settings(a: _Arguments) -> dict[str, Any]:
    """The study's settings as recorded in results.json and report.md (without ``command``)."""
    return {"task": a.task.name, "optimizer": a.optimizer, "steps": a.steps, "seeds": a.seeds, "lr": a.lr,
            "lr_schedule": getattr(a.task.lr_schedule, "__name__", None) if a.task.lr_schedule else "constant",
            "fused": {None: "auto", True: "on", False: "off"}[a.fused], "eval_every": a.eval_every,
            "threads": a.threads or torch.get_num_threads(), "optimizer_kwargs": a.kwargs,
            "optimizer_defaults": _optimizer_defaults(a.optimizer, a.kwargs),
            "divergence": f"non-finite train/eval loss, or eval loss above the initial eval loss after "
                          f"{WARMUP_FRACTION:.0%} of the steps",
            "torch": torch.__version__}


def _announce(a: _Arguments, settings: dict[str, Any]) -> None:
    """The two lines the CLI prints before training: the task, and what will run."""
    print(f"task {a.task.name}: {a.task.description}")
    print(f"{len(a.entries)} config(s) x {len(a.seeds)} seed(s) x {a.steps} steps; {a.optimizer}, lr {a.lr:g} "
          f"({settings['lr_schedule']}), fused {settings['fused']}, {settings['threads']} thread(s)"
          + (f"; writing to {a.out_dir}" if a.out_dir is not None else ""), flush=True)


def _run_all(result: StudyResult, a: _Arguments, measure_error: bool, progress: bool) -> None:
    """Every (seed, config) run, seed by seed, appended to ``result.runs``. Ctrl-C keeps what is
    done and sets ``result.interrupted``; torch's thread count is restored afterwards."""
    previous_threads = torch.get_num_threads()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    bar = _progress_bar(len(a.entries) * len(a.seeds) * a.steps, progress)
    try:
        for seed in a.seeds:
            for entry in a.entries:
                def on_step(step: int, loss: float, _label: str = entry.label, _seed: int = seed) -> None:
                    bar.update(1)
                    if step % 10 == 0 or step == 1:
                        bar.set_postfix_str(f"{_label} seed {_seed} loss {loss:.3f}", refresh=False)

                run = train_run(a.task, entry.config, entry.label, seed, optimizer=a.optimizer, steps=a.steps,
                                lr=a.lr, fused=a.fused, eval_every=a.eval_every, optimizer_kwargs=a.kwargs,
                                measure_error=measure_error, on_step=on_step)
                result.runs.append(run)
                bar.update(a.steps - run.steps_done)
                if progress:
                    bar.write(_run_line(run))
    except RunInterrupted as stop:
        result.runs.append(stop.result)
        result.interrupted = True
        if progress:
            bar.write(f"interrupted: {stop.result.config} seed {stop.result.seed} "
                      f"({stop.result.steps_done}/{a.steps} steps); writing what is done")
    except KeyboardInterrupt:  # between runs
        result.interrupted = True
    finally:
        bar.close()
        torch.set_num_threads(previous_threads)


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
