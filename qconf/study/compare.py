"""``qconf.study.compare`` and its cluster form: plan a study, run its runs (here, in ``jobs``
worker processes, or one at a time with :func:`run_one`), and make the report from what is stored
(:func:`collect`).

Every run of one seed starts from ``task.make_model(seed)`` and reads ``task.batches(seed)``, so
the rows of a seed see the same initial weights and the same data order; only the optimizer and
its state format differ, and rows are compared with the reference seed by seed. Runs go seed by
seed (every row of seed 0 first), so a study stopped early still compares every row on the seeds
it finished. With an output directory, every run is stored under its key as it finishes
(:mod:`qconf.study.store`): running the study again with the same ``out`` runs only what is missing.
"""
from __future__ import annotations

import datetime
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from .arguments import StudyArguments, build_plan, check_arguments, positive_int
from .execute import load_plan, relabel, run_planned, run_sequential, still_to_run, stored_results, torch_threads
from .keys import digest
from .parallel import run_parallel
from .plan import StudyPlan, make_rows
from .progress import RunProgress
from .report import write_outputs
from .results import StudyResult
from .runner import RunInterrupted, RunResult
from .store import FINAL, RunStore
from .sweep import Vary
from .task import StudyError, Task
from .tasks import DEFAULT_TASK

DEFAULT_SEEDS = 2


def default_out_dir() -> Path:
    """``qconf-results/<local date-time>``: where a study writes when no ``out`` is given."""
    return Path("qconf-results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def plan_study(configs: Sequence[Any] | Mapping[str, Any], task: str | Task = DEFAULT_TASK, *,
               optimizer: str | Sequence[str] = "adamw", steps: int | None = None,
               seeds: int | Sequence[int] = DEFAULT_SEEDS, lr: float | Mapping[str, float] | None = None,
               fused: str | bool | None = "auto", eval_every: int | None = None, threads: int | None = 1,
               optimizer_kwargs: Mapping[str, Any] | None = None, measure_error: bool = True,
               vary: Sequence[str | Vary] = (), reference: str | None = None, allow_many: bool = False,
               out: str | os.PathLike[str] | None = None, command: str | None = None,
               store: str | os.PathLike[str] | None = None) -> StudyPlan:
    """Check the arguments and make the study's plan (rows, seeds, distinct runs and their keys);
    with ``out``, also check that ``out`` holds no other study and write ``study.json`` there.
    Arguments as :func:`compare`; ``store``: where the runs are kept when it is not ``out`` (the
    temporary store of ``compare(out=False, jobs>1)``). Raises StudyError / QConfigError before
    anything is written."""
    a = check_arguments(configs, task, optimizer=optimizer, steps=steps, seeds=seeds, lr=lr, fused=fused,
                        eval_every=eval_every, threads=threads, optimizer_kwargs=optimizer_kwargs,
                        measure_error=measure_error, vary=vary, reference=reference, allow_many=allow_many)
    plan = build_plan(a)
    plan.settings["command"] = command or equivalent_command(a, plan, out)
    where = out if out is not None else store
    if where is not None:
        run_store = RunStore(where)
        run_store.check_same_study(plan)
        run_store.write_plan(plan)
    return plan


def compare(configs: Sequence[Any] | Mapping[str, Any], task: str | Task = DEFAULT_TASK, *,
            optimizer: str | Sequence[str] = "adamw", steps: int | None = None,
            seeds: int | Sequence[int] = DEFAULT_SEEDS, lr: float | Mapping[str, float] | None = None,
            fused: str | bool | None = "auto", out: str | os.PathLike[str] | None | bool = None,
            eval_every: int | None = None, threads: int | None = 1,
            optimizer_kwargs: Mapping[str, Any] | None = None, measure_error: bool = True, progress: bool = True,
            announce: bool = False, vary: Sequence[str | Vary] = (), reference: str | None = None, jobs: int = 1,
            allow_many: bool = False, command: str | None = None) -> StudyResult:
    """Train ``task`` under every row (config x optimizer) and seed, and compare the rows.

    Args:
        configs: config files or built-in names such as ``"default"``, each optionally
            ``"NAME@OPTIMIZER"`` to train it with that optimizer only (or QConfig / dict objects, or a
            ``{label: config}`` mapping). With ``vary`` the first config is the sweep's base.
        task: built-in task name (``"charlm"``, ``"digits"``), ``"module:function"`` returning a
            :class:`Task`, or a Task (a Task object cannot run in worker processes: ``jobs=1``).
        optimizer: ``adamw`` | ``adam`` | ``sgd`` (momentum 0.9) | ``lion``, or several
            (``"adamw,lion"`` or a list): every config without ``@`` is trained by each.
        steps: training steps; default: the task's.
        lr: (peak) learning rate for every optimizer, or ``{optimizer: lr}``; default: the task's.
        seeds: a count K (seeds 0..K-1) or explicit seeds.
        fused: ``"auto"``/None (native kernel when built), ``"on"``/True, ``"off"``/False.
        out: output directory and run store (default ``qconf-results/<timestamp>``; reusing one runs
            only what it lacks); False writes nothing (and stores nothing).
        eval_every: evaluate (and measure state errors) every N steps; default steps // 20.
        threads: ``torch.set_num_threads`` for each run (restored afterwards); default 1 (small models:
            on a 2-core machine one thread was 2-20x faster than two when anything else was running);
            None keeps torch's setting.
        optimizer_kwargs: extra optimizer arguments (e.g. ``{"eps": 1e-6}``) for every optimizer, and
            ``{optimizer: {...}}`` entries for one (``{"lion": {"weight_decay": 0.1}}``).
        measure_error: run the fp32 shadow optimizer and measure state quantization errors.
        progress: show a progress bar (tqdm, on stderr) and one line per finished run.
        announce: print the task and settings before training (the CLI does).
        vary: ``"FIELD=V1,V2,..."`` sweeps over qconfig fields of the first config
            (:mod:`qconf.study.sweep`): its points replace it.
        reference: the row every other row is compared with (default: the first fp32 row, else the
            first row).
        jobs: runs in parallel worker processes (each with ``threads`` threads); the numbers equal
            ``jobs=1`` bit for bit.
        allow_many: allow a sweep of more than :data:`~qconf.study.sweep.MAX_POINTS` points.
        command: the command line to record in the report (default: an equivalent one).

    Returns a :class:`StudyResult`; on Ctrl-C the finished runs are kept, the interrupted ones are
    marked, outputs are written and ``result.interrupted`` is True (no exception). A run that
    crashes is recorded as ``crashed`` and the study goes on.
    Raises :class:`StudyError` / :class:`~qconf.QConfigError` before training on bad arguments.
    """
    positive_int("jobs", jobs)
    out_dir = None if out is False else Path(default_out_dir() if out in (None, True) else out)
    if jobs > 1 and not isinstance(task, str):
        raise StudyError("jobs > 1 needs the task by name or 'module:function' (worker processes rebuild it)")
    with tempfile.TemporaryDirectory(prefix="qconf-study-") as scratch:
        store_dir = out_dir if out_dir is not None else (Path(scratch) if jobs > 1 else None)
        plan = plan_study(configs, task, optimizer=optimizer, steps=steps, seeds=seeds, lr=lr, fused=fused,
                          eval_every=eval_every, threads=threads, optimizer_kwargs=optimizer_kwargs,
                          measure_error=measure_error, vary=vary, reference=reference, allow_many=allow_many,
                          out=out_dir, command=command, store=store_dir)
        store = RunStore(store_dir) if store_dir is not None else None
        started = _now()
        results = stored_results(plan, store)
        todo = still_to_run(plan, results)
        if announce:
            _announce(plan, len(plan.runs()) - len(todo), len(todo), jobs, out_dir)
        bar = RunProgress(len(todo), plan.run_settings.steps, progress)
        try:
            if jobs > 1 and len(todo) > 1:
                interrupted = run_parallel(plan, store_dir, todo, jobs, bar, results)
            else:
                interrupted = run_sequential(plan, todo, store, bar, results)
        finally:
            bar.close()
    result = _result(plan, results, started, interrupted)
    if out_dir is not None:
        write_outputs(result, out_dir)
        result.out = out_dir
    return result


def run_one(out: str | os.PathLike[str], index: int, *, progress: bool = True) -> RunResult:
    """Run the plan's run ``index`` (``qconf compare --run-one INDEX --out DIR``) and store it;
    a run already stored with a final status is not run again (its stored result is returned).
    StudyError for an index outside the plan or a run whose key differs here (another qconf, torch
    or task data than the plan's)."""
    plan = load_plan(out)
    runs = plan.runs()
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(runs):
        raise StudyError(f"run index {index!r} is not in the plan (0..{len(runs) - 1}; qconf compare --plan lists them)")
    run = runs[index]
    _check_key_here(plan, run)
    store = RunStore(out)
    stored = store.load(run.key)
    if stored is not None and stored.status in FINAL:
        return stored
    bar = RunProgress(1, plan.run_settings.steps, progress)
    bar.start(run)
    try:
        with torch_threads(plan.run_settings.threads):
            result = run_planned(plan, run, store, bar.on_step)
    except RunInterrupted as stop:
        return stop.result
    finally:
        bar.close()
    return result


def collect(out: str | os.PathLike[str], *, write: bool = True) -> StudyResult:
    """The table and report of the study in ``out`` from the runs stored there (``--collect``); runs
    not stored yet are listed as not run."""
    plan = load_plan(out)
    store = RunStore(out)
    result = _result(plan, stored_results(plan, store), "", False)
    if write:
        write_outputs(result, Path(out))
        result.out = Path(out)
    return result


def _check_key_here(plan: StudyPlan, run: Any) -> None:
    """The run's key recomputed in this process must equal the plan's (same qconf, torch, task data)."""
    row = plan.row(run.rows[0])
    shared = plan.shared_here()
    (here,) = make_rows(plan.task, run.seed, [row.entry], [row.optimizer], {row.optimizer: row.lr},
                        {row.optimizer: row.kwargs}, plan.run_settings.fused)
    if digest(shared) != digest(plan.shared) or here.digest != row.digest:
        differ = ", ".join(k for k in shared if shared[k] != plan.shared.get(k)) or "the model or optimizer"
        raise StudyError(f"run {run.index} would not reproduce the plan here ({differ} differ from the plan's): "
                         "run it with the qconf, torch and task data the study was planned with")


def _result(plan: StudyPlan, results: dict[str, RunResult], started: str, interrupted: bool) -> StudyResult:
    return StudyResult(plan.task, plan.rows, plan.settings, relabel(plan, results), plan.reference, plan.varied,
                       interrupted=interrupted, started=started, finished=_now())


def equivalent_command(a: StudyArguments, plan: StudyPlan, out: Any) -> str | None:
    """The explicit ``qconf compare`` command that repeats this study (None for in-memory configs or
    tasks, or explicit seed lists)."""
    if plan.task_spec is None or not a.sources or any(e.source.startswith("<") for e in a.entries):
        return None
    if a.seeds != list(range(len(a.seeds))):
        return None  # explicit seed lists have no CLI spelling
    s = plan.run_settings
    argv = ["qconf", "compare", *a.sources]
    for v in a.varies:
        argv += ["--vary", f"{v.field}={','.join(v.texts)}"]
    argv += ["--task", plan.task_spec, "--optimizer", ",".join(a.optimizers), "--steps", str(s.steps),
             "--seeds", str(len(a.seeds))]
    lrs = {repr(x) for x in a.lrs.values()}
    argv += ["--lr", lrs.pop() if len(lrs) == 1 else ",".join(f"{o}={x!r}" for o, x in a.lrs.items())]
    argv += ["--fused", plan.settings["fused"], "--eval-every", str(s.eval_every), "--threads", str(s.threads)]
    common = {k: v for k, v in a.kwargs[a.used[0]].items() if all(a.kwargs[o].get(k, _MISSING) == v for o in a.used)}
    for k, v in common.items():
        argv += [x for key, text in _opt_args(k, v) for x in ("--opt-arg", f"{key}={text}")]
    for o in a.used:
        for k, v in a.kwargs[o].items():
            if k not in common:
                argv += [x for key, text in _opt_args(k, v) for x in ("--opt-arg", f"{o}:{key}={text}")]
    if a.reference is not None:
        argv += ["--reference", a.reference]
    if not s.measure_error:
        argv.append("--no-qerr")
    if a.allow_many:
        argv.append("--yes")
    if out is not None:
        argv += ["--out", str(out)]
    return " ".join(shlex.quote(x) for x in argv)


_MISSING = object()


def _opt_args(key: str, v: Any) -> list[tuple[str, str]]:
    """``(KEY, VALUE)`` texts of one optimizer argument as --opt-arg spells it: a mapping's keys
    dotted (``adamw.lr``), a tuple comma-separated."""
    if isinstance(v, Mapping):
        return [pair for k, x in v.items() for pair in _opt_args(f"{key}.{k}", x)]
    return [(key, ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v))]


def _announce(plan: StudyPlan, cached: int, todo: int, jobs: int, out: Path | None) -> None:
    """What the CLI prints before training: the task, and what will run."""
    s = plan.settings
    runs = len(plan.runs())
    shared = len(plan.rows) * len(plan.seeds) - runs
    print(f"task {plan.task.name}: {plan.task.description}")
    lrs = ", ".join(f"{o} lr {x:g}" for o, x in s["lr"].items())
    print(f"{len(plan.rows)} row(s) x {len(plan.seeds)} seed(s) x {plan.run_settings.steps} steps; {lrs} "
          f"({s['lr_schedule']}), fused {s['fused']}, {s['threads']} thread(s) per run"
          + (f"; writing to {out}" if out is not None else ""))
    points = [r for r in plan.rows if r.changes]
    if points:
        base = points[0].entry.source.removesuffix(" --vary")
        print(f"sweep of {base}: {len(points)} row(s) over " + " x ".join(f"{f} ({len(v)})" for f, v in plan.varied))
        if len({r.digest for r in points}) < len(points):
            print(f"note: only {len({r.digest for r in points})} of them differ in what they train: the others resolve "
                  "to the same codecs and share their runs (e.g. group_size under a rank-1 or tensor scale, or a "
                  "field of a state that is disabled or that the optimizer does not keep)")
    print(f"{runs} distinct run(s)" + (f" ({shared} shared by rows that resolve to the same codecs)" if shared else "")
          + (f"; {cached} already in {out}" if cached else "") + f"; running {todo}"
          + (f" in {min(jobs, todo)} processes" if jobs > 1 and todo > 1 else ""), flush=True)


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


__all__ = ["compare", "plan_study", "run_one", "collect", "default_out_dir", "DEFAULT_SEEDS"]
