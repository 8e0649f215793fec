"""Running a plan's runs: one run as ``--run-one`` does it, the runs still to do, and a whole
plan in this process (``--jobs 1``); :mod:`qconf.study.parallel` runs them in worker processes.

Every path trains a run with :func:`run_planned`, which stores the result under the run's key, so
a study run here, by ``--jobs N`` workers or by an array job's ``--run-one`` gives the same files.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import torch

from .plan import PlannedRun, StudyPlan
from .progress import RunProgress
from .runner import RunInterrupted, RunResult, train_run
from .store import FINAL, RunStore
from .task import StudyError
from .tasks import resolve_task


def run_planned(plan: StudyPlan, run: PlannedRun, store: RunStore | None,
                on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """Train ``run`` (its first row's config and optimizer) and store the result unless it was
    interrupted (:class:`RunInterrupted` propagates with the partial result)."""
    row = plan.row(run.rows[0])
    s = plan.run_settings
    result = train_run(plan.task, row.config, row.label, run.seed, optimizer=row.optimizer, steps=s.steps, lr=row.lr,
                       fused=s.fused, eval_every=s.eval_every, optimizer_kwargs=dict(row.kwargs),
                       measure_error=s.measure_error, on_step=on_step)
    if store is not None:
        store.save(run, plan, result)
    return result


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def stored_results(plan: StudyPlan, store: RunStore | None) -> dict[str, RunResult]:
    """The runs of ``plan`` already in ``store`` (any status), by key."""
    if store is None:
        return {}
    found = {}
    for run in plan.runs():
        result = store.load(run.key)
        if result is not None:
            found[run.key] = result
    return found


def still_to_run(plan: StudyPlan, stored: dict[str, RunResult]) -> list[PlannedRun]:
    """The runs without a final (ok / diverged) stored result, in plan order."""
    return [r for r in plan.runs() if r.key not in stored or stored[r.key].status not in FINAL]


def run_sequential(plan: StudyPlan, todo: list[PlannedRun], store: RunStore | None, progress: RunProgress,
                   results: dict[str, RunResult]) -> bool:
    """Run ``todo`` here, one after another, into ``results``; True when Ctrl-C stopped it (the
    interrupted run is in ``results`` with ``status="interrupted"``, not stored)."""
    with torch_threads(plan.run_settings.threads):
        for run in todo:
            progress.start(run)
            try:
                result = run_planned(plan, run, store, progress.on_step)
            except RunInterrupted as stop:
                results[run.key] = stop.result
                progress.interrupted(stop.result)
                return True
            except KeyboardInterrupt:  # between two steps' bookkeeping
                return True
            results[run.key] = result
            progress.done(result)
    return False


def load_plan(out: str | Path) -> StudyPlan:
    """The plan in ``out``/study.json with its task resolved (StudyError when the task was an
    in-memory object, or cannot be resolved here)."""
    data = RunStore(out).read_plan_data()
    spec = data.get("task_spec")
    if not isinstance(spec, str):
        raise StudyError(f"the study in {str(out)!r} was planned with a Task object, which another process cannot "
                         "rebuild: plan it with the task's name or module:function")
    return StudyPlan.from_dict(data, resolve_task(spec))


def relabel(plan: StudyPlan, results: dict[str, RunResult]) -> list[RunResult]:
    """One result per (row, seed) that has one, seed by seed, labelled with its row (rows that share
    a run show the same numbers)."""
    out = []
    for seed in plan.seeds:
        for row in plan.rows:
            result = results.get(plan.key(row, seed))
            if result is not None:
                out.append(dataclasses.replace(result, config=row.label, seed=seed))
    return out
