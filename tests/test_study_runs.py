"""Where a study's runs run and how they are kept: the run store (resume, cache, a killed study),
--jobs N in worker processes (bit-identical to --jobs 1), --plan / --run-one / --collect (equal to
one local study), crashed runs, and an --out that holds another study."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qconf.cli import main
from qconf.study import StudyError, collect, compare, plan_study, run_one

import test_study_tasks

REPO = Path(__file__).resolve().parents[1]
TINY = "test_study_tasks:tiny_task"
STUDY = dict(task=TINY, steps=10, seeds=2, eval_every=5, progress=False)
CONFIGS = ["fp32", "default", "8bit"]
NUMBERS = ("status", "steps_done", "train_loss", "eval", "qerr", "state_bytes_per_param", "train_bytes_per_param")


def numbers(result):
    """Every number of every run that does not depend on the clock, by (row, seed)."""
    return {(r.config, r.seed): tuple(json.dumps(getattr(r, k)) for k in NUMBERS) for r in result.runs}


def summary_without_clock(result):
    return [{k: v for k, v in row.items() if k not in ("step_ms", "opt_ms")} for row in result.summary()]


def run_files(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (out / "runs").glob("*.json")}


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The reference: one study run here, one run after another."""
    out = tmp_path_factory.mktemp("local")
    return out, compare(CONFIGS, out=out, **STUDY)


def test_jobs_2_equals_jobs_1_bit_for_bit(local, tmp_path):
    _, one = local
    two = compare(CONFIGS, out=tmp_path, jobs=2, **STUDY)
    assert numbers(two) == numbers(one) and len(two.runs) == 6
    assert summary_without_clock(two) == summary_without_clock(one)
    assert two.table().splitlines()[2].split()[:5] == one.table().splitlines()[2].split()[:5]


def test_jobs_need_a_task_that_a_worker_can_rebuild():
    with pytest.raises(StudyError, match="jobs > 1 needs the task by name"):
        compare(["default"], task=test_study_tasks.tiny_task(), steps=4, seeds=2, out=False, jobs=2, progress=False)


def test_plan_run_one_collect_equals_the_local_study(local, tmp_path, capsys):
    _, one = local
    plan = plan_study(CONFIGS, out=tmp_path, **{k: v for k, v in STUDY.items() if k != "progress"})
    runs = plan.runs()
    assert [(r.index, r.seed, r.rows) for r in runs] == [
        (0, 0, ("fp32",)), (1, 0, ("default",)), (2, 0, ("8bit",)), (3, 1, ("fp32",)), (4, 1, ("default",)),
        (5, 1, ("8bit",))]
    partial = collect(tmp_path, write=False)           # nothing run yet: every run listed as not run
    assert partial.runs == [] and all(r["seeds_finished"] == 0 for r in partial.summary())
    for run in reversed(runs):                          # array tasks finish in any order
        assert run_one(tmp_path, run.index, progress=False).status == "ok"
    again = run_one(tmp_path, 0, progress=False)        # a finished run is not run again
    assert again.status == "ok"
    gathered = collect(tmp_path)
    assert numbers(gathered) == numbers(one)
    assert summary_without_clock(gathered) == summary_without_clock(one)
    assert (tmp_path / "report.md").is_file() and (tmp_path / "results.csv").is_file()
    # the same through the command line
    assert main(["compare", "--run-one", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    assert main(["compare", "--collect", "--out", str(tmp_path)]) == 0
    out, _ = capsys.readouterr()
    assert "default seed 0: eval loss" in out and "vs fp32 (paired, 95% CI)" in out
    with pytest.raises(StudyError, match=r"run index 6 is not in the plan \(0..5"):
        run_one(tmp_path, 6)


def test_cli_plan_lists_the_runs(capsys, tmp_path):
    assert main(["compare", "fp32", "default", "--task", TINY, "--steps", "4", "--seeds", "2", "--plan", "--out",
                 str(tmp_path)]) == 0
    out, _ = capsys.readouterr()
    assert "wrote" in out and "4 run(s)" in out and f"qconf compare --run-one INDEX --out {tmp_path}" in out
    assert (tmp_path / "study.json").is_file() and not (tmp_path / "runs").exists()
    assert main(["compare", "default", "--run-one", "0", "--out", str(tmp_path)]) == 2  # the plan names the configs
    assert "give no CONFIG" in capsys.readouterr()[1]


def test_rerun_with_an_added_point_runs_only_the_new_runs(local, tmp_path):
    out, _ = local
    before = run_files(out)
    more = compare(CONFIGS + ["default_5b"], out=out, **STUDY)
    after = run_files(out)
    assert set(after) - set(before) and len(after) == len(before) + 2            # two new runs (seeds 0, 1)
    assert all(after[name] == before[name] for name in before)                   # the others were not touched
    assert [r.label for r in more.rows] == CONFIGS + ["default_5b"] and len(more.runs) == 8


def test_a_killed_study_continues_where_it_stopped(tmp_path):
    """SIGKILL while seed 1 waits (every seed-0 run stored): the same command runs only seed 1, and
    the study equals one that was never stopped."""
    gate = tmp_path / "gate"
    out = tmp_path / "study"
    argv = [sys.executable, "-m", "qconf.cli", "compare", "fp32", "default", "--task", "test_study_tasks:gated_task",
            "--steps", "6", "--seeds", "2", "--eval-every", "3", "--out", str(out), "--no-progress"]
    env = {**os.environ, test_study_tasks.GATE: str(gate),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(list((out / "runs").glob("*.json"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(list((out / "runs").glob("*.json"))) == 2, "the seed-0 runs did not finish"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    seed0 = run_files(out)
    gate.write_text("open")
    os.environ[test_study_tasks.GATE] = str(gate)
    try:
        resumed = compare(["fp32", "default"], task="test_study_tasks:gated_task", steps=6, seeds=2, eval_every=3,
                          out=out, progress=False)
        fresh = compare(["fp32", "default"], task="test_study_tasks:gated_task", steps=6, seeds=2, eval_every=3,
                        out=tmp_path / "fresh", progress=False)
    finally:
        del os.environ[test_study_tasks.GATE]
    files = run_files(out)
    assert len(files) == 4 and all(files[name] == seed0[name] for name in seed0)  # seed 0 was not run again
    assert numbers(resumed) == numbers(fresh) and not resumed.interrupted


def test_another_studys_out_is_refused_and_left_alone(local, capsys):
    out, _ = local
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for extra in (["--steps", "12"], ["--task", "test_study_tasks:poisoned_task", "--steps", "10"], ["--no-qerr", "--steps", "10"]):
        code = main(["compare", "fp32", "--seeds", "2", "--eval-every", "5", "--out", str(out), "--no-progress",
                     *(["--task", TINY] if "--task" not in extra else []), *extra])
        _, err = capsys.readouterr()
        assert code == 2 and "holds another study" in err and len(err.strip().splitlines()) == 1, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_outputs_without_a_plan_are_refused(tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    code = main(["compare", "fp32", "--task", TINY, "--steps", "2", "--seeds", "1", "--out", str(tmp_path),
                 "--no-progress"])
    assert code == 2 and "without a study.json" in capsys.readouterr()[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_crashed_run_is_recorded_and_the_study_goes_on(tmp_path):
    result = compare(["fp32", "default"], task="test_study_tasks:crashing_task", steps=6, seeds=2, eval_every=3,
                     out=tmp_path, progress=False)
    status = {(r.config, r.seed): r.status for r in result.runs}
    assert status == {("fp32", 0): "ok", ("default", 0): "ok", ("fp32", 1): "crashed", ("default", 1): "crashed"}
    crashed = result.runs_of("fp32")[1]
    assert crashed.steps_done == 2 and "RuntimeError: loss exploded in user code" in crashed.reason
    rows = {r["config"]: r for r in result.summary()}
    assert rows["default"]["seeds_crashed"] == 1 and rows["default"]["seeds_ok"] == 1
    report = (tmp_path / "report.md").read_text()
    assert "crashed in 1 seed(s)" in report and "retries crashed runs" in report
    before = run_files(tmp_path)
    compare(["fp32", "default"], task="test_study_tasks:crashing_task", steps=6, seeds=2, eval_every=3, out=tmp_path,
            progress=False)
    after = run_files(tmp_path)
    rerun = {name for name in before if after[name] != before[name]}
    keys = {json.loads(before[n][1])["row"] + "/" + str(json.loads(before[n][1])["seed"]) for n in rerun}
    assert keys == {"fp32/1", "default/1"}                      # only the crashed runs ran again


def test_a_worker_that_dies_is_recorded_as_crashed():
    """(Without an output directory: the workers share a temporary run store.) Seed 1's worker
    dies; a new worker takes seed 2."""
    result = compare(["default"], task="test_study_tasks:dying_task", steps=4, seeds=3, eval_every=2, out=False,
                     progress=False, jobs=2)
    status = {r.seed: (r.status, r.reason) for r in result.runs}
    assert status[0][0] == "ok" and status[2][0] == "ok"
    assert status[1] == ("crashed", "the worker process died (exit code 3) during this run")
    assert result.out is None and "--out" not in result.settings["command"]  # the temporary store is gone


def test_ctrl_c_with_jobs_stops_the_workers_and_writes_what_is_done(tmp_path):
    """SIGINT to a --jobs 2 study whose seed-1 runs wait: exit 130, the report covers seed 0, the
    seed-1 runs are interrupted (not stored, so the same command runs them), no worker is left."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "study"
    argv = [sys.executable, "-m", "qconf.cli", "compare", "fp32", "default", "--task", "test_study_tasks:gated_task",
            "--steps", "6", "--seeds", "2", "--eval-every", "3", "--out", str(out), "--no-progress", "--jobs", "2"]
    env = {**os.environ, test_study_tasks.GATE: str(tmp_path / "never"),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list((out / "runs").glob("*.json"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2 and len(list((out / "runs").glob("*.json"))) == 2
        time.sleep(0.3)  # the workers have taken the seed-1 runs and wait at the gate
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []
    report = (out / "report.md").read_text()
    assert "| fp32 | 1 | interrupted |" in report and "| default | 0 | ok |" in report
    assert len(list((out / "runs").glob("*.json"))) == 2


def test_stored_files_are_readable_like_any_new_file(local):
    out, _ = local
    mask = os.umask(0)
    os.umask(mask)
    for path in [out / "study.json", *(out / "runs").glob("*.json"), *(out / "configs").glob("*.yml")]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path

