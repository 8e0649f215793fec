"""qconf compare / qconf.study: determinism, user tasks, divergence, state errors, outputs, bad
arguments, Ctrl-C. Tiny tasks (tests/test_study_tasks.py), a few dozen steps each."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from qconf.cli import main
from qconf.study import StudyError, compare, resolve_task
from qconf.study.charlm import MODULES, charlm_task, unigram_loss
from qconf.study.cli import parse_opt_args
from qconf.study.arguments import labels_for as _labels
from qconf.study.runner import train_run
from qconf.config import load_config

import test_study_tasks

REPO = Path(__file__).resolve().parents[1]
CFG = REPO / "configs"
FP32, EIGHT, FOUR = str(CFG / "fp32.yml"), str(CFG / "8bit.yml"), str(CFG / "default.yml")


def run_cli(capsys, *argv):
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- tasks -------------------------------------------------------------------------------------------
def test_run_is_deterministic_per_seed():
    task = test_study_tasks.tiny_task()
    cfg = load_config(FOUR)

    def losses(seed):
        r = train_run(task, cfg, "default", seed, steps=12, lr=3e-3, eval_every=6, measure_error=False)
        return r.train_loss, [e["loss"] for e in r.eval]

    a, b, c = losses(0), losses(0), losses(1)
    assert a == b                      # bit-identical: same initial weights, same batches, same steps
    assert a[0] != c[0] and a[1] != c[1]


def test_charlm_task_is_deterministic_and_real():
    task = charlm_task(n_layers=1, d_model=32, n_heads=2, context=16, batch_size=4, eval_windows=8)
    assert task.name == "charlm" and len(task.info["files"]) >= 40 and "argparse.py" in task.info["files"]
    assert task.info["eval_chars"] > 0.05 * task.info["train_chars"]
    b0, b0_again, b1 = (test_study_tasks.first(3, task.batches(s)) for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(b0, b0_again))
    assert not torch.equal(b0[0], b1[0])
    assert b0[0].shape == (4, 17) and b0[0].max() < 256
    m0, m0_again, m1 = task.make_model(0), task.make_model(0), task.make_model(1)
    assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m0_again.parameters()))
    assert not torch.equal(m0.wte.weight, m1.wte.weight)
    with torch.no_grad():
        first = task.evaluate(m0.eval())
    assert abs(first["loss"] - math.log(256)) < 0.1           # untrained: about uniform over bytes
    assert 2.5 < unigram_loss() < 4.0                         # Python source: ~3.1 nats/char
    assert list(MODULES) == sorted(MODULES)


def test_default_charlm_weights_are_quantized():
    task = charlm_task(eval_windows=8)
    model = task.make_model(0)
    big = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert big and all(p.numel() > 4096 for n, p in model.named_parameters() if p.dim() == 2)


# -- user tasks ------------------------------------------------------------------------------------------
def test_user_task_hook_module_and_file():
    task = resolve_task("test_study_tasks:tiny_task")
    assert task.name == "tiny"
    path = str(Path(test_study_tasks.__file__))
    assert resolve_task(f"{path}:tiny_task").name == "tiny"
    result = compare([FOUR], task="test_study_tasks:tiny_task", steps=6, seeds=1, out=False, progress=False)
    assert result.task.name == "tiny" and [r.status for r in result.runs] == ["ok"]


@pytest.mark.parametrize("spec, words", [
    ("no_such_module_xyz:make", ["cannot import", "no_such_module_xyz"]),
    ("test_study_tasks:tiny_tsk", ["no function", "tiny_tsk", "did you mean 'tiny_task'"]),
    ("test_study_tasks:not_a_task", ["int", "not a qconf.study.Task"]),
    ("test_study_tasks:broken_task", ["RuntimeError", "dataset missing"]),
    ("charml", ["unknown task", "charml", "did you mean 'charlm'"]),
])
def test_bad_task_specs(spec, words):
    with pytest.raises(StudyError) as e:
        resolve_task(spec)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)


# -- divergence -------------------------------------------------------------------------------------------
def test_divergence_non_finite_loss_share():
    result = compare([FOUR], task="test_study_tasks:poisoned_task", steps=20, seeds=2, eval_every=5, out=False,
                     progress=False)
    ok, bad = result.runs
    assert ok.status == "ok" and ok.steps_done == 20
    assert bad.status == "diverged" and bad.diverged_at == 6 and bad.steps_done == 5 and "non-finite" in bad.reason
    row = result.summary()[0]
    assert row["unstable"] == 0.5 and row["seeds_diverged"] == 1 and row["seeds_ok"] == 1
    assert row["final_loss_mean"] == pytest.approx(ok.final_eval["loss"])  # mean over the stable seed only
    assert "50% (1/2)" in result.table()


def test_divergence_rising_eval_loss_stops_early():
    result = compare([FOUR, FP32], task="test_study_tasks:tiny_task", steps=20, seeds=1, lr=20.0, eval_every=2,
                     out=False, progress=False)
    for run in result.runs:
        assert run.status == "diverged" and run.steps_done < 20
        assert "above the initial" in run.reason or "non-finite" in run.reason
    assert all(r["unstable"] == 1.0 for r in result.summary())
    assert result.best() is None


# -- quantization error against the fp32 shadow ---------------------------------------------------------
def test_state_error_fp32_zero_4bit_positive_8bit_smaller():
    result = compare({"fp32": FP32, "8bit": EIGHT, "4bit": FOUR}, task="test_study_tasks:tiny_task", steps=16,
                     seeds=1, eval_every=8, out=False, progress=False)
    err = {r.config: {k: r.final_qerr(k) for k in r.qerr} for r in result.runs}
    for state in ("exp_avg", "exp_avg_sq"):
        assert err["fp32"][state] == 0.0
        assert 0.0 < err["4bit"][state] < 1.0 and math.isfinite(err["4bit"][state])
        assert 0.0 < err["8bit"][state] < err["4bit"][state]
    assert len(result.runs[0].qerr["exp_avg"]) == 2  # one checkpoint per evaluation


@pytest.mark.parametrize("optimizer, state", [("sgd", "momentum_buffer"), ("lion", "exp_avg")])
def test_state_error_other_optimizers(optimizer, state):
    result = compare({"fp32": FP32, "4bit": FOUR}, task="test_study_tasks:tiny_task", optimizer=optimizer,
                     steps=8, seeds=1, lr=1e-3, eval_every=8, out=False, progress=False)
    err = {r.config: r.final_qerr(state) for r in result.runs}
    assert err["fp32"] == 0.0 and 0.0 < err["4bit"] < 1.0


# -- outputs ------------------------------------------------------------------------------------------------
def test_outputs_written_and_parse(tmp_path):
    out = tmp_path / "study"
    result = compare([FP32, FOUR], task="test_study_tasks:tiny_task", steps=10, seeds=2, eval_every=5, out=out,
                     progress=False)
    assert result.out == out
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["seeds"] == [0, 1] and data["task"]["name"] == "tiny"
    assert [c["label"] for c in data["rows"]] == ["fp32", "default"]
    assert len(data["runs"]) == 4 and len(data["runs"][0]["train_loss"]) == 10
    assert [e["step"] for e in data["runs"][0]["eval"]] == [0, 5, 10]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["config"] for r in rows] == ["fp32", "default"]
    assert float(rows[1]["state_bytes_per_param"]) < float(rows[0]["state_bytes_per_param"])
    report = (out / "report.md").read_text()
    assert "| config |" in report and "qconf compare" in report and "## Reading" in report
    for name in ("curves.png", "summary.png", "qerror.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_runs_and_prints_table(capsys, tmp_path):
    code, out, err = run_cli(capsys, FP32, FOUR, "--task", "test_study_tasks:tiny_task", "--steps", "6", "--seeds",
                             "1", "--out", str(tmp_path), "--no-progress", "--opt-arg", "eps=1e-6")
    assert code == 0, err
    assert "final eval loss" in out and "fp32" in out and "default" in out
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["optimizer_defaults"]["adamw"]["eps"] == 1e-6
    assert "--opt-arg eps=1e-06" in data["settings"]["command"]


def test_help_documents_every_option(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for option in ("--task", "--optimizer", "--steps", "--seeds", "--lr", "--fused", "--out", "--eval-every",
                   "--threads", "--opt-arg", "charlm", "digits", "module:function", "diverged"):
        assert option in out


# -- bad arguments: exit 2, one line on stderr naming the problem, nothing trained -------------------------
@pytest.mark.parametrize("argv, words", [
    ([FOUR, "--task", "nosuchtask"], ["unknown task", "nosuchtask"]),
    (["configs/missing.yml"], ["missing.yml", "not found"]),
    ([FOUR, "--task", "nosuchmod_abc:make"], ["cannot import", "nosuchmod_abc"]),
    ([FOUR, "--steps", "0"], ["steps", "0"]),
    ([FOUR, "--seeds", "-1"], ["seeds"]),
    ([FOUR, "--steps", "ten"], ["--steps", "ten"]),
    ([FOUR, "--optimizer", "adagrad"], ["optimizer", "adagrad"]),
    ([FOUR, "--fused", "maybe"], ["fused", "maybe"]),
    ([FOUR, "--jobs", "0"], ["jobs must be a positive integer"]),
    ([FOUR, "--lr", "-1"], ["lr", "-1"]),
    ([FOUR, "--opt-arg", "eps"], ["--opt-arg", "eps"]),
    ([FOUR, "--opt-arg", "eps=-1"], ["eps"]),
    ([FOUR, "--opt-arg", "bogus=1"], ["bogus"]),
    ([], ["CONFIG"]),
])
def test_bad_arguments_exit_2_one_line(capsys, argv, words):
    extra = ["--no-progress"] + ([] if "--task" in argv else ["--task", "test_study_tasks:tiny_task"])
    code, out, err = run_cli(capsys, *argv, *extra)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconf compare: error:"), err
    assert all(w in lines[0] for w in words), lines[0]


def test_invalid_config_exit_2(capsys, tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("states:\n  exp_avg:\n    bits: 9\n    grop_size: 4\n")
    code, out, err = run_cli(capsys, FOUR, str(bad), "--task", "test_study_tasks:tiny_task")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "invalid config" in lines[0] and "bad.yml" in lines[0]
    assert "states.exp_avg.bits" in lines[0] and "grop_size" in lines[0]


# -- Ctrl-C --------------------------------------------------------------------------------------------------
def test_keyboard_interrupt_keeps_finished_runs(tmp_path):
    result = compare([FP32, FOUR], task="test_study_tasks:interrupted_task", steps=8, seeds=2, eval_every=4,
                     out=tmp_path, progress=False)
    assert result.interrupted
    assert [(r.config, r.seed, r.status) for r in result.runs] == [
        ("fp32", 0, "ok"), ("default", 0, "ok"), ("fp32", 1, "interrupted")]
    assert result.runs[-1].steps_done == 3
    rows = {r["config"]: r for r in result.summary()}
    assert rows["fp32"]["seeds_ok"] == 1 and rows["fp32"]["seeds_interrupted"] == 1
    assert rows["default"]["final_loss_mean"] is not None
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["interrupted"] and data["runs"][-1]["status"] == "interrupted"
    report = (tmp_path / "report.md").read_text()
    assert "interrupted" in report and "not run" in report
    assert (tmp_path / "curves.png").exists() and len(list(csv.DictReader((tmp_path / "results.csv").open()))) == 2


def test_keyboard_interrupt_cli_exit_130(capsys, tmp_path):
    code, out, err = run_cli(capsys, FOUR, "--task", "test_study_tasks:interrupted_task", "--steps", "5",
                             "--out", str(tmp_path), "--no-progress")
    assert code == 130 and "interrupted" in err
    assert (tmp_path / "report.md").exists()


# -- small helpers ------------------------------------------------------------------------------------------
def test_labels_and_opt_args():
    assert _labels(["configs/default.yml", "configs/8bit.yml"]) == ["default", "8bit"]
    assert _labels(["a/x/default.yml", "b/x/default.yml", "c.yml"]) == ["a/x/default", "b/x/default", "c"]
    assert _labels(["a.yml", "a.yml"]) == ["a", "a#2"]
    assert parse_opt_args(["eps=1e-6", "betas=0.9,0.95", "weight-decay=0"]) == {
        "eps": 1e-6, "betas": (0.9, 0.95), "weight_decay": 0}


def test_a_bitnet_config_trains_bitnet_layers_in_a_study_run(monkeypatch):
    """The runner converts the task's model as the config's bitnet section says (configs/bitnet.yml:
    every block Linear; the head stays full precision), and the run trains."""
    import qconf.study.runner as runner

    task = charlm_task(n_layers=1, d_model=32, n_heads=2, context=16, batch_size=4, eval_windows=8)
    converted = []
    real = runner.quantize_
    monkeypatch.setattr(runner, "quantize_", lambda model, config: converted.append(real(model, config)))
    blocks = ["blocks.0.attn_in", "blocks.0.attn_out", "blocks.0.mlp_in", "blocks.0.mlp_out"]
    for name in ("bitnet.yml", "bitnet_4bit_bf16.yml"):
        r = train_run(task, load_config(CFG / name), name, 0, steps=6, lr=3e-3, eval_every=3)
        assert r.steps_done == 6 and r.diverged_at is None and all(map(math.isfinite, r.train_loss)), name
    assert converted == [blocks, blocks]
    train_run(task, load_config(FP32), "fp32", 0, steps=2, lr=3e-3, eval_every=2)
    assert len(converted) == 2  # no bitnet section: the model is left as it is


# -- gradient release ---------------------------------------------------------------------------------
def test_a_study_with_gradient_release_equals_the_normal_one_with_fewer_training_bytes(capsys, tmp_path):
    """The same runs bit for bit (losses and the shadow's state errors, fed inside backward); the
    training B/param column drops by the gradients (one gradient at a time)."""
    runs = {}
    for release in (False, True):
        kwargs = {"gradient_release": True} if release else None
        runs[release] = compare({"4bit": FOUR}, task="test_study_tasks:tiny_task", steps=8, seeds=1, eval_every=4,
                                out=False, progress=False, optimizer_kwargs=kwargs).runs[0]
    normal, release = runs[False], runs[True]
    assert release.status == "ok" and release.train_loss == normal.train_loss and release.eval == normal.eval
    assert release.qerr == normal.qerr and release.final_qerr("exp_avg") > 0
    assert release.state_bytes_per_param == normal.state_bytes_per_param
    assert release.train_bytes_per_param < normal.train_bytes_per_param  # (all gradients vs the largest)
    code, out, _ = run_cli(capsys, FOUR, "--task", "test_study_tasks:tiny_task", "--steps", "4", "--seeds", "1",
                           "--gradient-release", "--no-progress", "--out", str(tmp_path / "study"))
    assert code == 0 and "train B/param" in out
