"""A study as data: its rows (config x optimizer), its seeds and the runs they make.

A *row* is one line of the study's table: a config (a file, a built-in name or a sweep point)
trained by one optimizer with its arguments and learning rate. A *run* is a row and a seed; its
key (:mod:`qconf.study.keys`) is a hash of everything that determines its numbers, so two rows
whose configs resolve to the same codecs share their runs. :class:`StudyPlan` lists the distinct
runs in the order they execute (seed by seed); it is what ``study.json`` holds, what ``--plan``
writes and ``--run-one`` reads, and it rebuilds in another process from its plain data.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from ..config import QConfig, load_config
from .keys import digest, model_parameters, plain, row_identity, run_key, shared_identity
from .task import StudyError, Task

PLAN_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class ConfigEntry:
    """One config of a study: its label, where it came from, and its resolved form.

    ``optimizer``: the optimizer a ``CONFIG@OPTIMIZER`` argument names (None: the study's);
    ``changes``: a sweep point's varied fields as ``(field, value text)`` pairs."""

    label: str
    source: str
    config: QConfig
    optimizer: str | None = None
    changes: tuple[tuple[str, str], ...] = ()

    @property
    def quantized(self) -> bool:
        """Whether any state is quantized (False for an fp32 baseline such as configs/fp32.yml)."""
        return any(s.enable for s in self.config.states.values()) or any(
            o.enable or o.states for o in self.config.overrides)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the study: ``entry``'s config trained by ``optimizer`` with ``kwargs`` at ``lr``.
    ``digest`` hashes what the row resolves to on the task's model (:func:`keys.row_identity`)."""

    label: str
    entry: ConfigEntry
    optimizer: str
    lr: float
    kwargs: Mapping[str, Any]
    digest: str

    @property
    def config(self) -> QConfig:
        return self.entry.config

    @property
    def source(self) -> str:
        return self.entry.source

    @property
    def quantized(self) -> bool:
        return self.entry.quantized

    @property
    def changes(self) -> tuple[tuple[str, str], ...]:
        return self.entry.changes

    def to_dict(self) -> dict[str, Any]:
        e = self.entry
        return {"label": self.label, "config_label": e.label, "source": e.source, "optimizer": self.optimizer,
                "lr": self.lr, "kwargs": plain(self.kwargs), "changes": [list(c) for c in e.changes],
                "quantized": e.quantized, "digest": self.digest, "config": e.config.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Row":
        entry = ConfigEntry(d["config_label"], d["source"], load_config(d["config"]), None,
                            tuple((str(f), str(v)) for f, v in d["changes"]))
        kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d["kwargs"].items()}
        return cls(d["label"], entry, d["optimizer"], float(d["lr"]), kwargs, d["digest"])


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """One distinct run: its position in the plan (``--run-one INDEX``), key, seed, and the rows
    that share it (the first one's config and optimizer train it)."""

    index: int
    key: str
    seed: int
    rows: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What every run of a study shares besides the task."""

    steps: int
    eval_every: int
    fused: bool | None
    threads: int
    measure_error: bool


@dataclasses.dataclass
class StudyPlan:
    """Rows x seeds of one task and the distinct runs they make (see the module docstring).

    ``task_spec`` is how the task was named (``charlm``, ``mymod:make_task``); None for a Task
    object, which cannot be rebuilt in another process. ``settings`` is the record that
    results.json and report.md show; ``varied`` the sweep's fields and values."""

    task: Task
    task_spec: str | None
    rows: list[Row]
    seeds: list[int]
    run_settings: RunSettings
    reference: str | None
    settings: dict[str, Any]
    varied: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shared = self.shared or self.shared_here()
        self._rows = {r.label: r for r in self.rows}
        self._shared_digest = digest(self.shared)
        self._runs: list[PlannedRun] | None = None

    def shared_here(self) -> dict[str, Any]:
        """The shared part of the run keys as this process computes it (qconf, torch, the task's data
        here); a plan read from study.json keeps the one it was made with in ``shared``."""
        s = self.run_settings
        return shared_identity(self.task, self.task_spec, steps=s.steps, eval_every=s.eval_every, fused=s.fused,
                               threads=s.threads, measure_error=s.measure_error)

    def row(self, label: str) -> Row:
        return self._rows[label]

    def key(self, row: Row, seed: int) -> str:
        """The key of ``row``'s run with ``seed``."""
        return run_key(self._shared_digest, row.digest, seed)

    def runs(self) -> list[PlannedRun]:
        """The distinct runs, seed by seed (every row of seed 0 first), each once (computed once:
        rows and seeds do not change)."""
        if self._runs is None:
            order: dict[str, tuple[int, list[str]]] = {}
            for seed in self.seeds:
                for row in self.rows:
                    order.setdefault(self.key(row, seed), (seed, []))[1].append(row.label)
            self._runs = [PlannedRun(i, key, seed, tuple(rows)) for i, (key, (seed, rows)) in enumerate(order.items())]
        return self._runs

    def identity(self) -> dict[str, Any]:
        """What makes another invocation *the same study* (it may add rows and seeds): the task and
        the settings every run shares -- the shared key without the versions and the kernel, with
        the ``fused`` choice instead."""
        same = {k: v for k, v in self.shared.items() if k not in ("format", "kernel", "qconf", "torch")}
        return {**same, "fused": self.run_settings.fused}

    def to_dict(self) -> dict[str, Any]:
        """study.json: everything ``--run-one`` and ``--collect`` need, as plain data."""
        s = self.run_settings
        return {"format": PLAN_FORMAT, "identity": plain(self.identity()), "task_spec": self.task_spec,
                "run_settings": dataclasses.asdict(s), "seeds": list(self.seeds), "reference": self.reference,
                "settings": plain(self.settings), "varied": [[f, list(v)] for f, v in self.varied],
                "shared": plain(self.shared), "rows": [r.to_dict() for r in self.rows],
                "runs": [dataclasses.asdict(r) for r in self.runs()]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], task: Task) -> "StudyPlan":
        """Rebuild a plan written by :meth:`to_dict` (``task``: the resolved ``task_spec``)."""
        if d.get("format") != PLAN_FORMAT:
            raise StudyError(f"study.json has format {d.get('format')!r}; this qconf reads format {PLAN_FORMAT}")
        return cls(task, d["task_spec"], [Row.from_dict(r) for r in d["rows"]], [int(s) for s in d["seeds"]],
                   RunSettings(**d["run_settings"]), d["reference"], dict(d["settings"]),
                   [(f, list(v)) for f, v in d["varied"]], dict(d["shared"]))


def make_rows(task: Task, seed: int, entries: Sequence[ConfigEntry], optimizers: Sequence[str],
              lrs: Mapping[str, float], kwargs: Mapping[str, Mapping[str, Any]], fused: bool | None) -> list[Row]:
    """The rows of a study: each entry with its own optimizer (``CONFIG@OPTIMIZER``) or with each of
    ``optimizers``. Labels get ``@optimizer`` when the rows use more than one optimizer."""
    pairs = [(e, o) for e in entries for o in ([e.optimizer] if e.optimizer else optimizers)]
    several = len({o for _, o in pairs}) > 1
    labels = _unique([f"{e.label}@{o}" if several else e.label for e, o in pairs])
    shared_params: list | None = None
    rows = []
    for label, (entry, opt) in zip(labels, pairs):
        if entry.config.bitnet.enable:  # BitNet may change the parameters' dtype: build its own model
            named = model_parameters(task, seed, entry.config)
        else:
            shared_params = shared_params or model_parameters(task, seed, entry.config)
            named = shared_params
        identity = row_identity(named, entry.config, opt, lrs[opt], kwargs[opt], fused)
        rows.append(Row(label, entry, opt, lrs[opt], dict(kwargs[opt]), digest(identity)))
    return rows


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out
