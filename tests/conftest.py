"""Background jobs: the suite's long compile-bound subprocesses, started when collection ends.

A test module declares ``BACKGROUND_JOBS = {key: job}``, where ``job(workdir)`` returns the command
(argv) of a subprocess run in ``workdir`` (a fresh directory) and ``key`` names what needs it: a
test (its name with parameters) or a fixture of the module, and ``BACKGROUND_CPU_S``, the CPU
seconds its jobs took. The jobs that selected tests need run at the lowest CPU priority (nice 19)
from the end of collection, two at a time, so they compile on the CPU time the rest of the suite
leaves idle (most tests are one Python thread on two cores) instead of after it. Modules with jobs
run last, the costliest first, and their jobs start in that order. A test takes its job from the
``background_job`` fixture, a fixture from ``background_jobs(request, key)``; either waits for it
(starting it at once if it is still queued). Jobs still running when the session ends (a test
failed or was interrupted) are killed with everything they started.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import psutil
import pytest

_QUEUE = pytest.StashKey["JobQueue"]()
SLOTS = 2  # jobs at a time: the compilers of more would only share the same idle time, in more memory
TIMEOUT_S = 1500  # per job, from its start: a hung build fails its test instead of hanging the suite
#: Runs a job's command (after it) at nice 19, and its session's scheduling group too: with
#: autogroups (Linux's default on desktops and many CI runners) a new session is a group that
#: shares the CPU equally with pytest's whatever its nice, so the compilers took half of it and the
#: native codec tests ran 15x slower beside them (275 s against 18 s). A shell, not preexec_fn,
#: which is unsafe in a process with threads (the queue starts jobs from its own).
LOWEST_PRIORITY = ["/bin/sh", "-c", '(echo 19 > /proc/self/autogroup) 2>/dev/null; exec nice -n 19 "$@"', "job"]


class Job:
    """A background job: its command and directory (its output goes to stdout.log and stderr.log there)."""

    def __init__(self, argv: list[str], workdir: Path, queue: JobQueue):
        self.argv, self.workdir, self._queue = argv, workdir, queue
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.workdir / "stdout.log", "wb") as out, open(self.workdir / "stderr.log", "wb") as err:
            # (C locale: compiler messages in the words the tests look for; two compile jobs each)
            env = {**os.environ, "LC_ALL": "C", "MAX_JOBS": os.environ.get("MAX_JOBS", "2")}
            self.proc = subprocess.Popen([*LOWEST_PRIORITY, *self.argv], cwd=self.workdir, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def result(self) -> tuple[int, str, str]:
        """``(exit status, stdout, stderr)``, waiting for the job."""
        self._queue.start_now(self)
        try:
            self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill(self.proc)
            raise
        return (self.proc.returncode, *((self.workdir / f"{name}.log").read_text(errors="replace")
                                        for name in ("stdout", "stderr")))


class JobQueue:
    """Runs its jobs ``SLOTS`` at a time in submission order, from a thread of the pytest process."""

    def __init__(self):
        self.jobs: dict[tuple[str, str], Job] = {}
        self._pending: list[Job] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qconf-background-jobs", daemon=True)

    def submit(self, key: tuple[str, str], argv_of) -> None:
        workdir = Path(tempfile.mkdtemp(prefix="qconf-background-"))
        self.jobs[key] = job = Job(argv_of(workdir), workdir, self)
        self._pending.append(job)

    def start_now(self, job: Job) -> None:
        with self._lock:
            if job in self._pending:
                self._pending.remove(job)
                job.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                running = sum(j.proc is not None and j.proc.poll() is None for j in self.jobs.values())
                while self._pending and running < SLOTS:
                    self._pending.pop(0).start()
                    running += 1
                if not self._pending:
                    return
            self._stop.wait(0.5)

    def start(self) -> None:
        if self._pending:
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for job in self.jobs.values():
            if job.proc is not None:
                _kill(job.proc)
            shutil.rmtree(job.workdir, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    """Kill the job and every process it started: they share its session (ninja puts each compiler
    in a process group of its own, so the job's group is not enough)."""
    for _ in range(5):  # a process may fork while the others are killed
        left = [pid for pid in psutil.pids() if pid != os.getpid() and _session(pid) == proc.pid]
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    proc.wait()


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _key(module, key: str) -> tuple[str, str]:
    return (module.__file__, key)


def _background_cpu_s(item: pytest.Item) -> float | None:
    """The CPU seconds of the background jobs of ``item``'s module (its ``BACKGROUND_CPU_S``, as
    measured), None for a module without jobs."""
    module = getattr(item, "module", None)
    return getattr(module, "BACKGROUND_CPU_S", 0.0) if getattr(module, "BACKGROUND_JOBS", None) else None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with background jobs run last, the costliest jobs first (whole modules, in their own
    order: module fixtures are set up once). The other tests then run while the jobs take the idle
    core, the waits come at the end, when the jobs get both cores, and the longest job (the
    sanitizers') is not the last one started."""
    cost = {id(item): _background_cpu_s(item) for item in items}
    tail = sorted((item for item in items if cost[id(item)] is not None), key=lambda item: -cost[id(item)])
    items[:] = [item for item in items if cost[id(item)] is None] + tail


def pytest_collection_finish(session: pytest.Session) -> None:
    queue = session.config.stash[_QUEUE] = JobQueue()
    if session.config.option.collectonly:
        return
    for item in session.items:  # in run order: the first test's job first
        module = getattr(item, "module", None)
        for key, argv_of in getattr(module, "BACKGROUND_JOBS", {}).items():
            if (key == item.name or key in item.fixturenames) and _key(module, key) not in queue.jobs:
                queue.submit(_key(module, key), argv_of)
    queue.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _QUEUE in session.config.stash:
        session.config.stash[_QUEUE].close()


@pytest.fixture(scope="session")
def background_jobs(pytestconfig: pytest.Config):
    """``find(request, key)``: the job ``key`` of the requesting module's ``BACKGROUND_JOBS``."""
    jobs = pytestconfig.stash[_QUEUE].jobs

    def find(request: pytest.FixtureRequest, key: str) -> Job:
        if _key(request.module, key) not in jobs:
            raise RuntimeError(f"{request.module.__name__}: no background job {key!r} was started (BACKGROUND_JOBS)")
        return jobs[_key(request.module, key)]
    return find


@pytest.fixture
def background_job(request: pytest.FixtureRequest, background_jobs) -> Job:
    """This test's background job (its module's ``BACKGROUND_JOBS`` under the test's name)."""
    return background_jobs(request, request.node.name)
