"""A study's arguments, checked before anything runs, and the plan they make.

Everything a user can get wrong -- a missing or invalid config, a ``--vary`` field or value, an
unknown optimizer or an argument it rejects, a learning rate for an optimizer the study does not
use, a reference that is not a row, a count that is not positive -- raises
:class:`~qconf.study.task.StudyError` (or :class:`~qconf.QConfigError`) here, before the first step.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..config import load_config
from ..config.builtin import builtin_names, is_builtin_name
from .keys import plain
from .plan import ConfigEntry, RunSettings, StudyPlan, make_rows
from .runner import OPTIMIZERS, OPTIMIZER_DEFAULTS, WARMUP_FRACTION, make_optimizer
from .sweep import Vary, check_size, expand, parse_vary
from .task import StudyError, Task
from .tasks import resolve_task

FUSED_CHOICES = {"auto": None, "on": True, "off": False}


# -- configs ---------------------------------------------------------------------------------------
def labels_for(sources: list[str], optimizers: Sequence[str | None] | None = None) -> list[str]:
    """File stems, made unique by prefixing parent directories where two stems collide (the same
    file twice is numbered, unless ``CONFIG@OPTIMIZER`` names a different optimizer for each)."""
    labels = [Path(s).stem if s.endswith((".yml", ".yaml")) else s for s in sources]
    depth = 1
    while len(set(labels)) < len(labels) and depth < 8:
        depth += 1
        labels = [("/".join(Path(s).with_suffix("").parts[-depth:]) if labels.count(lab) > 1 else lab)
                  for s, lab in zip(sources, labels)]
    seen: dict[tuple[str, str | None], int] = {}
    out = []
    for lab, opt in zip(labels, optimizers or [None] * len(labels)):  # the same file twice: number the repeats
        seen[lab, opt] = seen.get((lab, opt), 0) + 1
        out.append(lab if seen[lab, opt] == 1 else f"{lab}#{seen[lab, opt]}")
    # a label is display text (plots, tables): a file name's undecodable bytes, which reach sys.argv
    # as surrogate escapes, show as \\xNN
    return [lab.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for lab in out]


def split_optimizer(item: str) -> tuple[str, str | None]:
    """``"default.yml@sgd"`` -> ``("default.yml", "sgd")``; a name that is a file or a built-in
    config as a whole is not split. StudyError for an unknown optimizer after the ``@``."""
    if "@" not in item or Path(item).is_file() or item in builtin_names():
        return item, None
    source, _, optimizer = item.rpartition("@")
    if optimizer not in OPTIMIZERS:
        raise StudyError(f"{item!r}: unknown optimizer {optimizer!r} after '@' (choose from {', '.join(OPTIMIZERS)})"
                         + _did_you_mean(optimizer, OPTIMIZERS))
    return source, optimizer


def load_configs(configs: Sequence[Any] | Mapping[str, Any]) -> list[ConfigEntry]:
    """Config paths or built-in names, each optionally ``@OPTIMIZER`` (or QConfig/dict objects, or
    a ``{label: config}`` mapping) -> entries. A missing file is a :class:`StudyError`; an invalid
    one raises :class:`~qconf.QConfigError`."""
    if isinstance(configs, (str, os.PathLike)):
        configs = [configs]
    if isinstance(configs, Mapping):
        items = [(str(label), *_split_any(cfg)) for label, cfg in configs.items()]
    else:
        split = [_split_any(c) for c in configs]
        sources = [str(c) if isinstance(c, (str, os.PathLike)) else f"config{i}" for i, (c, _) in enumerate(split)]
        items = [(label, c, o) for label, (c, o) in zip(labels_for(sources, [o for _, o in split]), split)]
    if not items:
        raise StudyError("no configs to compare (give at least one config file)")
    entries = []
    for label, cfg, optimizer in items:
        if isinstance(cfg, (str, os.PathLike)):
            if not Path(cfg).is_file() and not is_builtin_name(cfg):  # a name: load_config resolves it
                raise StudyError(f"config file {str(cfg)!r} not found")
            source = str(cfg)
        else:
            source = f"<{type(cfg).__name__}>"
        entries.append(ConfigEntry(label, source, load_config(cfg), optimizer))
    return entries


def _split_any(cfg: Any) -> tuple[Any, str | None]:
    """:func:`split_optimizer` for a path or name; a QConfig or dict has no ``@OPTIMIZER``."""
    return split_optimizer(str(cfg)) if isinstance(cfg, (str, os.PathLike)) else (cfg, None)


def sweep_entries(entries: list[ConfigEntry], vary: Sequence[str | Vary], seeds: int,
                  allow_many: bool) -> tuple[list[ConfigEntry], list[Vary]]:
    """With ``vary``, the first entry is the sweep's base: it is replaced by the sweep's points
    (each with the base's optimizer); the other entries stay as they are."""
    if not vary:
        return entries, []
    base = entries[0]
    varies = [v if isinstance(v, Vary) else parse_vary(str(v), base.config) for v in vary]
    check_size(varies, seeds, allow_many)
    points = [ConfigEntry(p.label, f"{base.source} --vary", p.config, base.optimizer, p.changes)
              for p in expand(base.label, base.config, varies)]
    return points + entries[1:], varies


# -- numbers -----------------------------------------------------------------------------------------
def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StudyError(f"{name} must be a positive integer, got {value!r}")
    return value


def seed_list(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        return list(range(positive_int("seeds", seeds)))
    try:
        out = [int(s) for s in seeds]
    except (TypeError, ValueError):
        raise StudyError(f"seeds must be a count or a list of integers, got {seeds!r}") from None
    if not out or len(set(out)) != len(out):
        raise StudyError(f"seeds must be a non-empty list of distinct integers, got {seeds!r}")
    return out


def fused_flag(fused: str | bool | None) -> bool | None:
    """``"auto"``/``"on"``/``"off"`` or None/True/False -> None/True/False; StudyError otherwise."""
    if isinstance(fused, str):
        if fused not in FUSED_CHOICES:
            raise StudyError(f"fused must be one of {', '.join(FUSED_CHOICES)}, got {fused!r}")
        fused = FUSED_CHOICES[fused]
    if fused not in (None, True, False):
        raise StudyError(f"fused must be 'auto', 'on', 'off', None, True or False, got {fused!r}")
    return fused


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


# -- optimizers --------------------------------------------------------------------------------------
def optimizer_list(optimizer: str | Sequence[str]) -> list[str]:
    """``"adamw"`` / ``"adamw,lion"`` / ``["adamw", "lion"]`` -> names; StudyError for an unknown one."""
    names = [o.strip() for o in optimizer.split(",")] if isinstance(optimizer, str) else [str(o) for o in optimizer]
    if not names or any(not n for n in names):
        raise StudyError(f"optimizer must name at least one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    for name in names:
        if name not in OPTIMIZERS:
            raise StudyError(f"unknown optimizer {name!r} (choose from {', '.join(OPTIMIZERS)})"
                             + _did_you_mean(name, OPTIMIZERS))
    if len(set(names)) != len(names):
        raise StudyError(f"optimizer {optimizer!r} names an optimizer twice")
    return names


def learning_rates(lr: float | Mapping[str, float] | None, used: list[str], default: float) -> dict[str, float]:
    """One learning rate per optimizer the study uses: ``lr`` for all, or ``{optimizer: lr}``
    (optimizers it leaves out take the task's default)."""
    given = dict(lr) if isinstance(lr, Mapping) else {name: lr for name in used}
    for name in given:
        if name not in used:
            raise StudyError(f"lr is given for {name!r}, which this study does not use (it uses {', '.join(used)})")
    out = {}
    for name in used:
        value = default if given.get(name) is None else given[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise StudyError(f"lr{' of ' + name if isinstance(lr, Mapping) else ''} must be a positive number, "
                             f"got {value!r}")
        out[name] = float(value)
    return out


def optimizer_arguments(kwargs: Mapping[str, Any] | None, used: list[str]) -> dict[str, dict[str, Any]]:
    """``{key: value}`` for every optimizer plus ``{optimizer: {key: value}}`` for one -> the
    arguments of each optimizer the study uses. StudyError for an argument an optimizer does not
    take (an unscoped one must suit every optimizer of the study)."""
    common = {k: v for k, v in (kwargs or {}).items() if k not in OPTIMIZERS}
    scoped = {k: dict(v) for k, v in (kwargs or {}).items() if k in OPTIMIZERS}
    for name, value in (kwargs or {}).items():
        if name in OPTIMIZERS and not isinstance(value, Mapping):
            raise StudyError(f"optimizer arguments for {name!r} must be a mapping, got {value!r}")
        if name in OPTIMIZERS and name not in used:
            raise StudyError(f"optimizer arguments are given for {name!r}, which this study does not use "
                             f"(it uses {', '.join(used)})")
    out = {}
    for name in used:
        accepted = [n for n, a in inspect.signature(OPTIMIZERS[name]).parameters.items()
                    if n not in ("self", "params", "lr", "qconfig", "fused") and a.kind is not a.VAR_KEYWORD]
        for key in [*common, *scoped.get(name, {})]:
            if key not in accepted:
                scope = (f" (scope it to the optimizers that take it: {', '.join(o + ':' + key for o in used if o != name)}=...)"
                         if key in common and len(used) > 1 else "")
                raise StudyError(f"{name} has no argument {key!r} (accepted: {', '.join(accepted)}){scope}")
        out[name] = {**common, **scoped.get(name, {})}
    return out


def check_optimizer(name: str, kwargs: dict[str, Any], lr: float, fused: bool | None, entry: ConfigEntry) -> None:
    """StudyError when ``name`` rejects its arguments (built once on a probe parameter, so that
    fused=True without the extension also fails here, not mid-study)."""
    try:
        make_optimizer(name, [("probe", torch.nn.Parameter(torch.zeros(2)))], lr=lr, qconfig=entry.config,
                       fused=fused, kwargs=kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise StudyError(f"{name} optimizer: {' '.join(str(e).split())}") from None


def optimizer_defaults(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters the runs actually used (the optimizer's defaults + study defaults + kwargs)."""
    # a matrix: Muon's own group (its AdamW part's settings are its `adamw` argument)
    opt = make_optimizer(name, [torch.nn.Parameter(torch.zeros(2, 2))], lr=1.0, qconfig={}, fused=False,
                         kwargs=dict(kwargs))
    group = {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "lr", "param_names")}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}


# -- the plan ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StudyArguments:
    """The checked arguments of a study (what :func:`build_plan` turns into rows and runs)."""

    sources: list[str]
    entries: list[ConfigEntry]
    varies: list[Vary]
    task: Task
    task_spec: str | None
    optimizers: list[str]
    used: list[str]
    lrs: dict[str, float]
    kwargs: dict[str, dict[str, Any]]
    seeds: list[int]
    run_settings: RunSettings
    reference: str | None
    allow_many: bool


def check_arguments(configs: Sequence[Any] | Mapping[str, Any], task: str | Task, *, optimizer: str | Sequence[str],
                    steps: int | None, seeds: int | Sequence[int], lr: Any, fused: str | bool | None,
                    eval_every: int | None, threads: int | None, optimizer_kwargs: Mapping[str, Any] | None,
                    measure_error: bool, vary: Sequence[str | Vary], reference: str | None,
                    allow_many: bool) -> StudyArguments:
    """Check every argument (the first problem raises StudyError or QConfigError) and fill in the
    task's defaults."""
    sources = [str(c) for c in configs] if not isinstance(configs, (Mapping, str, os.PathLike)) else []
    entries = load_configs(configs)
    optimizers = optimizer_list(optimizer)
    fused = fused_flag(fused)
    seed_values = seed_list(seeds)
    if threads is not None:
        positive_int("threads", threads)
    task_obj = resolve_task(task)
    steps = positive_int("steps", task_obj.default_steps if steps is None else steps)
    eval_every = positive_int("eval_every", max(1, steps // 20) if eval_every is None else eval_every)
    entries, varies = sweep_entries(entries, vary, len(seed_values), allow_many)
    used = list(dict.fromkeys(o for e in entries for o in ([e.optimizer] if e.optimizer else optimizers)))
    lrs = learning_rates(lr, used, task_obj.default_lr)
    kwargs = optimizer_arguments(optimizer_kwargs, used)
    for name in used:
        check_optimizer(name, {**OPTIMIZER_DEFAULTS.get(name, {}), **kwargs[name]}, lrs[name], fused, entries[0])
    run_settings = RunSettings(steps, eval_every, fused, threads or torch.get_num_threads(), measure_error)
    return StudyArguments(sources, entries, varies, task_obj, task if isinstance(task, str) else None, optimizers,
                          used, lrs, kwargs, seed_values, run_settings, reference, allow_many)


def build_plan(a: StudyArguments) -> StudyPlan:
    """Rows (each resolved on the task's model for its key), the reference row and the settings."""
    rows = make_rows(a.task, a.seeds[0], a.entries, a.optimizers, a.lrs, a.kwargs, a.run_settings.fused)
    labels = [r.label for r in rows]
    if a.reference is not None and a.reference not in labels:
        raise StudyError(f"reference {a.reference!r} is not a row of this study (rows: {', '.join(labels[:12])}"
                         + (", ..." if len(labels) > 12 else "") + ")" + _did_you_mean(a.reference, labels))
    reference = a.reference or next((r.label for r in rows if not r.quantized), labels[0])
    return StudyPlan(a.task, a.task_spec, rows, a.seeds, a.run_settings, reference, settings(a, reference),
                     [(v.short, list(v.texts)) for v in a.varies])


def settings(a: StudyArguments, reference: str) -> dict[str, Any]:
    """The study's settings as recorded in results.json and report.md (``command`` is added later)."""
    s = a.run_settings
    return {"task": a.task.name, "optimizers": a.used, "steps": s.steps, "seeds": a.seeds, "lr": a.lrs,
            "lr_schedule": getattr(a.task.lr_schedule, "__name__", None) if a.task.lr_schedule else "constant",
            "fused": {None: "auto", True: "on", False: "off"}[s.fused], "eval_every": s.eval_every,
            "threads": s.threads, "optimizer_kwargs": plain(a.kwargs),
            "optimizer_defaults": {o: optimizer_defaults(o, a.kwargs[o]) for o in a.used},
            "reference": reference, "reference_given": a.reference is not None,
            "vary": {v.field: list(v.texts) for v in a.varies},
            "divergence": f"non-finite train/eval loss, or eval loss above the initial eval loss after "
                          f"{WARMUP_FRACTION:.0%} of the steps",
            "torch": torch.__version__}
