"""The training-memory benchmark (``qconf bench --memory``, qconf.bench.memory) on the ~1M-parameter
``tiny`` model with 1 warm-up + 2 measured steps.

One run of ``benchmarks/bench_memory.py`` (six rows, each in its own two child processes: memory,
timing) is shared by
the tests below. Timings are never checked; what is checked holds on any machine: every row has
the JSON fields, the attribution adds up, a gradient-release row keeps far fewer gradient bytes
than its normal counterpart and reaches the very same loss, bit for bit. A second run, ``--muon``
with 1 warm-up + 1 measured step, checks the same of qconf Muon's 4-bit bf16 SR rows and their
split of the states into the Muon and the AdamW part; the Muon roster and the torch pairing are
checked in-process on a smaller model.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from qconf.bench import memory, memory_tables
from qconf.bench.model import GPT, MODEL_PRESETS
from qconf.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
ROWS = "torch-fused,qconf-default-*"  # the normal and gradient-release qconf rows, torch's fp32 baseline
STATUSES = ("ok", "not installed", "no CUDA", "error")
HAS_CUDA = torch.cuda.is_available()


def _tiny_run_command(workdir: Path) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "bench_memory.py"), "--memory-model", "tiny", "--memory-warmup",
            "1", "--memory-steps", "2", "--contenders", ROWS, "--json", str(workdir / "memory.json"), "--quiet"]


MUON_ROWS = "muon-default-*"  # qconf Muon 4-bit bf16 SR, normal and with gradient release


def _muon_run_command(workdir: Path) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "bench_memory.py"), "--muon", "--device", "cpu",
            "--memory-model", "tiny", "--memory-warmup", "1", "--memory-steps", "1", "--contenders", MUON_ROWS,
            "--json", str(workdir / "muon.json"), "--quiet"]


# the runs start in the background when collection ends (conftest.py): 12 + 4 child processes
BACKGROUND_JOBS = {"tiny_run": _tiny_run_command, "muon_run": _muon_run_command}
BACKGROUND_CPU_S = 51 + 40  # 48 s on 2 idle cores; the Muon run (bf16 Newton-Schulz) 38 CPU s


@pytest.fixture(scope="module")
def tiny_run(request, background_jobs) -> tuple[dict, str]:
    """``(JSON result, printed output)`` of the tiny run through the script twin."""
    job = background_jobs(request, "tiny_run")
    returncode, stdout, stderr = job.result()
    assert returncode == 0, stderr
    return json.loads((job.workdir / "memory.json").read_text()), stdout


def _rows(result: dict, device: str = "cpu") -> dict[str, dict]:
    return {r["key"]: r for r in result["rows"] if r["device"] == device}


def _tiny_param_bytes() -> list[int]:
    """numel of each parameter of the tiny model (built on the meta device: no memory)."""
    with torch.device("meta"):
        return [p.numel() for p in GPT(MODEL_PRESETS["tiny"]).parameters()]


def test_every_row_has_the_json_fields(tiny_run):
    result, _ = tiny_run
    assert result["benchmark"] == "memory" and result["settings"]["numel"] == MODEL_PRESETS["tiny"].numel
    assert set(result["settings"]["attribution"]) == set(memory.FIELDS)
    keys = [r.key for r in memory.select_rows(memory.memory_rows("cpu"), ROWS.split(","))]
    assert list(_rows(result)) == keys and len(keys) == 6
    for r in result["rows"]:
        assert {"name", "status", "device", "b_per_param", "step_ms", "final_loss"} <= set(r)
        assert r["status"] in STATUSES and r["device"] in ("cpu", "cuda")
        assert list(r["b_per_param"]) == list(memory.FIELDS)
        assert ("gradient release" in r["name"]) == r["gradient_release"]
    for r in _rows(result).values():
        assert r["status"] == "ok", r
        assert r["step_ms"] > 0 and math.isfinite(r["final_loss"]) and len(r["losses"]) == 3
        assert len(r["step_ms_each"]) == 2 and r["step_ms"] == statistics.median(r["step_ms_each"])
        assert r["timing_losses_match"] is True  # the timing child (default allocator) trained the same steps
    if not HAS_CUDA:
        assert {r["status"] for r in _rows(result, "cuda").values()} == {"no CUDA"}


def test_the_attribution_adds_up(tiny_run):
    result, _ = tiny_run
    numel = result["settings"]["numel"]
    for r in _rows(result).values():
        b, per = r["bytes"], r["b_per_param"]
        assert b["params_grads_states"] == b["params"] + b["grads"] + b["states"]
        assert b["other"] == b["peak"] - b["params_grads_states"]
        assert per["params_grads_states"] == per["params"] + per["grads"] + per["states"]
        assert all(per[k] == pytest.approx(b[k] / numel, rel=1e-12) for k in memory.FIELDS)
        assert b["peak"] >= b["params"] + b["states"]  # both are resident through the measured steps
        assert b["params"] == numel * (2 if r["dtype"] == "bfloat16" else 4)


def test_gradient_release_keeps_one_gradient_and_the_same_loss(tiny_run):
    result, _ = tiny_run
    rows = _rows(result)
    largest = max(_tiny_param_bytes())
    released = [r for r in rows.values() if r["gradient_release"]]
    assert len(released) == 3
    for r in released:
        normal = rows[r["counterpart"]]
        size = 2 if r["dtype"] == "bfloat16" else 4
        assert normal["bytes"]["grads"] == normal["bytes"]["params"]  # every gradient at the step
        assert r["bytes"]["grads"] == largest * size  # one parameter's at a time
        assert r["b_per_param"]["grads"] < 0.5 * normal["b_per_param"]["grads"]
        assert r["bytes"]["states"] == normal["bytes"]["states"]
        assert r["losses"] == normal["losses"] and r["final_loss"] == normal["final_loss"]  # bit for bit
        assert r["loss_matches_counterpart"] is True and r["counterpart_final_loss"] == normal["final_loss"]
        assert r["step_time_ratio"] == r["step_ms"] / normal["step_ms"]


def test_qconf_states_are_below_torch_fp32(tiny_run):
    rows = _rows(tiny_run[0])
    assert rows["qconf-default-fp32"]["bytes"]["states"] < 0.25 * rows["torch-fused"]["bytes"]["states"]
    assert rows["torch-fused"]["bytes"]["states"] == 2 * rows["torch-fused"]["bytes"]["params"]  # exp_avg, exp_avg_sq


def test_the_printed_report(tiny_run):
    result, out = tiny_run
    assert out.startswith("qconf training-memory benchmark, ")
    assert "\ncommand: python benchmarks/bench_memory.py --memory --memory-model tiny " in out
    lines = out.splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("== cpu: ")))
    header = lines[head + 1]
    assert header.split() == ["row", "params", "grads", "states", "other", "p+g+s", "peak", "peak", "MiB", "ms/step",
                              "final", "loss", "note"]
    body = lines[head + 3: head + 3 + 6]
    assert [ln.split("  ")[0] for ln in body] == [r["name"] for r in _rows(result).values()]
    assert sum("bit for bit" in ln for ln in body) == 3
    assert "other = peak - (params + grads + states)" in out
    if not HAS_CUDA:
        assert "== cuda: " in out and out.count("no CUDA") >= 5


def test_rows_that_cannot_run_keep_the_fields(monkeypatch):
    row = memory.MemoryRow("x", "an optimizer from a missing package fp32", torch.float32, lambda m: None,
                           requires="qconf_no_such_package")
    assert memory.unavailable(row, "cpu") == "not installed"
    r = memory.row_result(row, "cpu", None, "not installed")
    assert r["status"] == "not installed" and r["error"] == "qconf_no_such_package is not installed"
    assert r["b_per_param"] == dict.fromkeys(memory.FIELDS) and r["final_loss"] is None and r["step_ms"] is None
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: False)
    assert memory.unavailable(memory.memory_rows("cuda")[0], "cuda") == "no CUDA"
    failed = memory.row_result(row, "cpu", {"error": "RuntimeError: boom"}, None)
    assert failed["status"] == "error" and failed["error"] == "RuntimeError: boom"


def test_a_timing_run_that_trained_other_steps_is_flagged(tiny_run):
    result, _ = tiny_run
    r = dict(_rows(result)["torch-fused"], timing_losses_match=False)
    assert memory_tables._note(r, {}) == "the timing run's losses differ from the memory run's"


def test_the_model_presets():
    base, big = MODEL_PRESETS["base"], MODEL_PRESETS["base-32k"]
    assert base.numel == 104_825_088 >= 100_000_000 and big.numel == 134_306_304
    assert sum(_tiny_param_bytes()) == MODEL_PRESETS["tiny"].numel < 1_100_000
    for cfg in (base, big):
        with torch.device("meta"):
            numels = [p.numel() for p in GPT(cfg).parameters()]
        assert sum(numels) == cfg.numel
        assert max(numels) == cfg.vocab * cfg.d_model  # the embedding (and the LM head) is the largest tensor
    assert 0.05 < base.vocab * base.d_model / base.numel < 0.07  # what gradient release's grads column shows


def test_rosters():
    cpu, cuda = memory.memory_rows("cpu"), memory.memory_rows("cuda")
    assert [r.key for r in cpu] == [r.key for r in cuda if not r.cuda_only]
    assert [r.key for r in cuda if r.cuda_only] == ["flashoptim-adamw"]
    assert {"torchao-adamw4bit", "torchao-adamw8bit", "bnb-adamw8bit"} <= {r.key for r in cpu}
    for r in cpu:
        if r.release:
            twin = next(c for c in cpu if c.key == r.counterpart)
            norms = " keeping grad norms" if r.grad_norms else ""
            assert r.name == f"{twin.name}, gradient release{norms}" and r.dtype == twin.dtype


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "5"], "--rounds: not an option of --memory"),
    (["--size", "big", "--no-rss"], "--size, --no-rss: not an option of --memory"),
    (["--memory-steps", "0"], "--memory-steps must be >= 1"),
    (["--memory-warmup", "0"], "--memory-warmup must be >= 1"),
    (["--contenders", "nope-*"], "--contenders: 'nope-*' match no --memory row"),
    (["--json", "/no/such/dir/out.json"], "--json '/no/such/dir/out.json': not a file in an existing directory"),
])
def test_usage_errors_are_one_line(capsys, argv, message):
    assert cli_main(["bench", "--memory", "--memory-model", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qconf bench: error: {message}") and "\n" not in err


def test_memory_options_need_memory(capsys):
    assert cli_main(["bench", "--memory-steps", "2"]) == 2
    assert capsys.readouterr().err.strip() == "qconf bench: error: --memory-steps needs --memory"
    assert cli_main(["bench", "--memory", "--memory-model", "huge"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("qconf bench: error: argument --memory-model: invalid "
                                                        "choice: 'huge' (choose from base, base-32k, small)")


def test_help_and_list(capsys):
    assert cli_main(["bench", "--memory", "--help"]) == 0
    out = capsys.readouterr().out
    assert "training memory (--memory):" in out and "--memory-model {base,base-32k,small}" in out and "tiny" not in out
    assert cli_main(["bench", "--memory", "--list", "--device", "cpu"]) == 0
    listed = [ln.split()[1] for ln in capsys.readouterr().out.splitlines()]
    assert listed == [r.key for r in memory.memory_rows("cpu")]


# -- --muon: Muon's training rows ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def muon_run(request, background_jobs) -> tuple[dict, str]:
    """``(JSON result, printed output)`` of the tiny Muon run (qconf Muon 4-bit bf16 SR, with and without
    gradient release)."""
    job = background_jobs(request, "muon_run")
    returncode, stdout, stderr = job.result()
    assert returncode == 0, stderr
    return json.loads((job.workdir / "muon.json").read_text()), stdout


def _micro() -> GPT:
    """A GPT small enough for an in-process Muon step (Newton-Schulz in bf16 is slow on a CPU)."""
    from qconf.bench.model import GPTConfig, build_model
    return build_model(GPTConfig(vocab=64, d_model=64, layers=1, heads=2, seq=8, batch=2), torch.float32, "cpu", 0)


def test_muon_rosters():
    rows = memory.muon_rows("cpu")
    keys = [r.key for r in rows]
    assert keys == ["muon-torch", "muon-8bit-fp32", "muon-default-bf16-sr", "muon-default-bf16-sr-release",
                    "torch-fused", "qconf-default-bf16-sr-release"]
    assert [r.key for r in memory.roster("cpu", True)] == keys
    assert [r.key for r in memory.roster("cpu", False)] == [r.key for r in memory.memory_rows("cpu")]
    by_key = {r.key: r for r in rows}
    release = by_key["muon-default-bf16-sr-release"]
    assert release.release and release.counterpart == "muon-default-bf16-sr" and release.dtype == torch.bfloat16
    assert release.name == by_key["muon-default-bf16-sr"].name + ", gradient release"
    assert by_key["muon-torch"].dtype == by_key["muon-8bit-fp32"].dtype == torch.float32
    assert [r.key for r in memory.muon_rows("cuda")] == keys  # (no CUDA-only Muon row)


def test_muon_rows_build_route_and_split_their_states():
    """The torch pairing routes as qconf.optim.Muon does (matrices to Muon; embeddings, head, norms and biases to
    AdamW); after one training step each, the per-part states add up to the row's states: torch 4 B per Muon
    parameter and 8 B per AdamW one, qconf's 8-bit linear momentum 1 + 4/256 B per element of a matrix above
    min_numel (4096), 4 B (fp32) below it."""
    from qconf.bench.model import random_batches
    from qconf.optim import Muon

    by_key = {r.key: r for r in memory.muon_rows("cpu")}
    model = _micro()
    torch_opt, qconf_opt = by_key["muon-torch"].build(model), by_key["muon-8bit-fp32"].build(model)
    assert isinstance(qconf_opt, Muon) and isinstance(torch_opt.parts["muon"], torch.optim.Muon)
    names = {p: n for n, p in model.named_parameters()}
    routed = {names[p]: part for part, o in torch_opt.parts.items() for g in o.param_groups for p in g["params"]}
    assert routed == qconf_opt.routing() and len(routed) == len(names)
    assert {n for n, r in routed.items() if r == "adamw" and n.endswith(".weight") and ".ln_" not in n} == {
        "tok_emb.weight", "pos_emb.weight", "head.weight", "ln_f.weight"}
    assert torch_opt.parts["adamw"].defaults["fused"] is True
    batch = random_batches(model.cfg, 1, 1)[0]
    for key in ("muon-torch", "muon-8bit-fp32"):
        m = _micro()
        opt = by_key[key].build(m)
        memory.train_step(m, opt, batch, memory.make_backend("cpu"))
        parts = memory.state_parts(opt)
        assert sum(p["numel"] for p in parts.values()) == m.cfg.numel
        assert sum(p["state_bytes"] for p in parts.values()) == memory.optimizer_state_bytes(opt)
        matrices = [p.numel() for n, p in m.named_parameters() if routed[n] == "muon"]
        assert parts["muon"]["numel"] == sum(matrices)
        if key == "muon-torch":
            assert parts["muon"]["state_bytes"] == 4 * parts["muon"]["numel"]
            assert parts["adamw"]["state_bytes"] == 8 * parts["adamw"]["numel"]
        else:
            assert parts["muon"]["state_bytes"] == sum(n * (1 + 4 / 256) if n > 4096 else 4 * n for n in matrices)
    assert memory.state_parts(torch.optim.AdamW(_micro().parameters())) is None


def test_muon_run_rows_release_and_parts(muon_run):
    result, out = muon_run
    assert result["settings"]["optimizer"] == "muon" and result["settings"]["model"] == "tiny"
    rows = _rows(result)
    assert list(rows) == ["muon-default-bf16-sr", "muon-default-bf16-sr-release"]
    normal, release = rows["muon-default-bf16-sr"], rows["muon-default-bf16-sr-release"]
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["timing_losses_match"] is True and math.isfinite(r["final_loss"])
        parts = r["state_parts"]
        assert sum(p["state_bytes"] for p in parts.values()) == r["bytes"]["states"]
        assert sum(p["numel"] for p in parts.values()) == result["settings"]["numel"]
        assert parts["muon"]["state_bytes"] == parts["muon"]["numel"] * (0.5 + 4 / 128)  # 4-bit, group 128
    assert release["bytes"]["grads"] == 2 * max(_tiny_param_bytes())  # bf16: the largest gradient at a time
    assert normal["bytes"]["grads"] == normal["bytes"]["params"]
    assert release["bytes"]["states"] == normal["bytes"]["states"]
    assert release["losses"] == normal["losses"] and release["loss_matches_counterpart"] is True  # bit for bit
    assert "\ncommand: python benchmarks/bench_memory.py --memory --muon --device cpu --memory-model tiny " in out
    assert "\ntraining: Muon rows: Muon (torch.optim.Muon's defaults" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("states by part: ")]
    assert [ln.split(": ")[1] for ln in lines] == [normal["name"], release["name"]]
    assert "Muon 0." in lines[0] and "(0.531 B over " in lines[0]


def test_muon_memory_options(capsys):
    assert cli_main(["bench", "--memory", "--muon", "--list", "--device", "cpu"]) == 0
    listed = [ln.split()[1] for ln in capsys.readouterr().out.splitlines()]
    assert listed == [r.key for r in memory.muon_rows("cpu")]
    from qconf.bench import memory_cli
    parser = __import__("argparse").ArgumentParser()
    memory_cli.add_memory_arguments(parser)
    parser.add_argument("--muon", action="store_true")
    for argv, expect in ((["--memory", "--muon"], "--muon --memory-model small --memory-warmup 2 --memory-steps 3 "),
                         (["--memory"], "--memory --memory-model base --memory-warmup 2 --memory-steps 8 "),
                         (["--memory", "--muon", "--memory-model", "base", "--memory-steps", "1"],
                          "--muon --memory-model base --memory-warmup 2 --memory-steps 1 ")):
        opts = parser.parse_args(argv)
        opts.__dict__.update(device=None, threads=2, seed=0, contenders=None, json=None)
        assert expect in memory_cli.memory_command("qconf bench", opts)
    assert MODEL_PRESETS["small"].numel == 932_608
    assert 0.06 < MODEL_PRESETS["small"].vocab * MODEL_PRESETS["small"].d_model / MODEL_PRESETS["small"].numel < 0.075
