"""``--jobs N``: a study's runs in N worker processes.

Each worker is a fresh interpreter (multiprocessing's ``spawn``: no state inherited from this
process, no fork of a process with threads) that reads the plan from ``study.json``, sets torch's
thread count to the study's, and trains the runs this process hands it one at a time with
:func:`qconf.study.execute.run_planned`, the function ``--run-one`` and ``--jobs 1`` use: the
stored results are the same, bit for bit. A worker that dies mid-run (a crash in native code, the
OOM killer) has its run recorded as ``crashed`` and is replaced; Ctrl-C stops the workers (they
ignore SIGINT themselves) and marks their runs interrupted.
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import signal
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from .execute import load_plan, run_planned, torch_threads
from .plan import PlannedRun, StudyPlan
from .progress import RunProgress
from .runner import RunResult
from .store import RunStore
from .task import StudyError

STEP_MESSAGES_EVERY = 10  # a worker reports progress every this many steps


def _worker(out: str, conn: Connection) -> None:
    """A worker's life: load the plan, then run the indices it receives until it receives None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        plan = load_plan(out)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which stops the study
        conn.send(("error", None, f"{type(e).__name__}: {e}"))
        return
    store = RunStore(out)
    runs = {r.index: r for r in plan.runs()}
    with torch_threads(plan.run_settings.threads):
        while (index := conn.recv()) is not None:
            sent = 0

            def on_step(step: int, loss: float, _index: int = index) -> None:
                nonlocal sent
                if step - sent >= STEP_MESSAGES_EVERY:
                    conn.send(("step", _index, (step - sent, loss)))
                    sent = step

            result = run_planned(plan, runs[index], store, on_step)
            conn.send(("done", index, result.to_dict()))


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Connection
    run: PlannedRun | None = None
    steps_reported: int = 0


def run_parallel(plan: StudyPlan, out: Path, todo: list[PlannedRun], jobs: int, progress: RunProgress,
                 results: dict[str, RunResult]) -> bool:
    """Run ``todo`` in ``jobs`` worker processes into ``results`` (the plan must be in
    ``out``/study.json). Returns True when Ctrl-C stopped it."""
    ctx = multiprocessing.get_context("spawn")
    store = RunStore(out)
    queue = collections.deque(todo)
    workers: list[_Worker] = []

    def start() -> _Worker:
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_worker, args=(str(out), child), daemon=True, name="qconf-compare-worker")
        process.start()
        child.close()
        return _Worker(process, parent)

    def hand_out(w: _Worker) -> None:
        w.run, w.steps_reported = (queue.popleft() if queue else None), 0
        w.conn.send(None if w.run is None else w.run.index)

    try:
        for _ in range(min(jobs, len(todo))):
            workers.append(start())
            hand_out(workers[-1])
        while any(w.run is not None for w in workers):
            busy = [w for w in workers if w.run is not None]
            ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=1.0)
            for w in busy:
                if w.conn not in ready and w.process.sentinel not in ready:
                    continue
                if _receive(w, plan, store, results, progress):
                    if w.run is None:
                        hand_out(w)
                elif queue:  # it died (its run is recorded as crashed): a new worker takes the next run
                    workers[workers.index(w)] = replacement = start()
                    hand_out(replacement)
        return False
    except KeyboardInterrupt:
        for w in workers:
            if w.run is not None:
                stopped = RunResult(w.run.rows[0], w.run.seed, status="interrupted",
                                    reason="interrupted (Ctrl-C) in a worker process")
                results[w.run.key] = stopped
                progress.interrupted(stopped)
        return True
    finally:
        for w in workers:
            if w.run is not None:  # Ctrl-C or an error: stop what is still running
                w.process.terminate()
        for w in workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()


def _receive(w: _Worker, plan: StudyPlan, store: RunStore, results: dict[str, RunResult],
             progress: RunProgress) -> bool:
    """Handle what worker ``w`` sent, or its death. Returns whether it lives; ``w.run`` becomes None
    when its run ended (done, or recorded and stored as crashed because the worker died)."""
    run = w.run
    assert run is not None
    try:
        while w.conn.poll():
            kind, _, payload = w.conn.recv()
            if kind == "error":
                raise StudyError(f"a worker process could not load the study: {payload}")
            if kind == "step":
                steps, loss = payload
                w.steps_reported += steps
                progress.advance(steps, f"{run.rows[0]} seed {run.seed}", loss)
            else:
                result = RunResult.from_dict(payload)
                results[run.key] = result
                progress.done(result, w.steps_reported)
                w.run = None
                return True
    except (EOFError, OSError):  # the pipe closed: the worker is gone or going
        w.process.join(timeout=5)
    if w.process.is_alive():
        return True
    result = RunResult(run.rows[0], run.seed, status="crashed",
                       reason=f"the worker process died (exit code {w.process.exitcode}) during this run")
    store.save(run, plan, result)
    results[run.key] = result
    progress.done(result, w.steps_reported)
    w.run = None
    return False
