"""Smoke test of the optimizer-step benchmark (qconf.bench) on a tiny size with 2 rounds.

Timings are not checked (benchmarks are never timed tests); the test checks that the tables have the
expected rows and columns, the JSON parses, and the CLI/script entry points work. Contenders from
packages that are not installed (torchao, bitsandbytes) are expected as "not installed" rows.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qconf import bench
from qconf.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["contender", "params", "ns/param", "x fused med", "x fused min", "rounds", "state B/param",
           "peak extra RSS", "note"]
FOOTNOTES = ("cost: ", "noise: ", "* slow contender", "peak extra RSS:", "median step: ")
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def _table_lines(out: str, size: str) -> list[str]:
    """The header row and body rows of ``size``'s table in the printed output."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"== {size}:"))
    body = []
    for ln in lines[start + 1:]:
        if not ln.strip() or ln.startswith(FOOTNOTES):
            break
        body.append(ln)
    assert set(body[1].replace(" ", "")) == {"-"}, body[1]
    return [body[0]] + body[2:]


def test_tiny_run_table_and_json(tmp_path, capsys):
    out_json = tmp_path / "out.json"
    # torchao compiles with Inductor (seconds per contender): covered by the separate test below
    code = bench.main(["--size", "tiny", "--rounds", "2", "--slow-rounds", "1", "--warmup", "2", "--quiet",
                       "--contenders", "torch-*,qconf-*,bnb-*",
                       "--rss-contenders", "qconf-fused-default-fp32", "--json", str(out_json)],
                      prog="bench_step.py")
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("qconf optimizer-step benchmark, ")
    assert "\nmachine: " in out and "qconf ISA " in out and "threads 2" in out
    assert "\ncommand: bench_step.py --size tiny --rounds 2 " in out

    header, *rows = _table_lines(out, "tiny")
    assert header.split("  ")[0] == "contender"
    positions = [header.index(c) for c in COLUMNS]
    assert positions == sorted(positions)

    result = json.loads(out_json.read_text())
    assert set(result) >= {"date", "command", "machine", "settings", "sizes"}
    assert list(result["sizes"]) == ["tiny"]
    res = result["sizes"]["tiny"]
    assert res["numel"] == 2 * 64 * 128 + 100 and res["rounds"] == 2
    keys = [r["key"] for r in res["rows"]]
    expected = ["torch-forloop", "torch-foreach", "torch-fused", "torch-fused-bf16",
                *(f"qconf-fused-{c}-{t}" for t in ("fp32", "bf16") for c in ("default", "group128", "8bit")),
                *(f"qconf-fused-{c}-bf16-sr" for c in ("default", "group128", "8bit")), "qconf-fused-default-bf16-kahan",
                "qconf-reference-default-fp32", "bnb-adamw8bit"]
    assert keys == expected
    assert len(rows) == len(expected)
    by_key = {r["key"]: r for r in res["rows"]}
    for key, line in zip(keys, rows):
        r = by_key[key]
        assert line.startswith(r["label"])
        if key == "bnb-adamw8bit" and not HAS_BNB:
            assert r["status"] == "not installed" and "not installed" in line
            continue
        assert r["status"] == "ok", (key, r["error"])
        assert r["ns_per_param"] > 0 and r["ratio_median"] > 0 and r["ratio_min"] <= r["ratio_median"]
        assert 1 <= r["rounds_timed"] <= 2 and len(r["times_ns"]) == 2
    assert by_key["torch-fused"]["ratios"] == [1.0, 1.0]
    assert "(baseline)" in rows[keys.index("torch-fused")]

    # state bytes: fp32 torch holds 2 fp32 moments (8 B/param), bf16 torch 2 bf16 ones; qconf's 4-bit is far less
    assert by_key["torch-fused"]["state_bytes_per_param"] == pytest.approx(8.0)
    assert by_key["torch-fused-bf16"]["state_bytes_per_param"] == pytest.approx(4.0)
    assert by_key["qconf-fused-group128-fp32"]["state_bytes_per_param"] < 1.5
    # the low-precision weight policies: a Kahan buffer in bf16 costs 2 B/param more; both report
    # their cost over plain bf16 from the same rounds
    plain = by_key["qconf-fused-default-bf16"]
    assert by_key["qconf-fused-default-bf16-sr"]["state_bytes_per_param"] == plain["state_bytes_per_param"]
    assert by_key["qconf-fused-default-bf16-kahan"]["state_bytes_per_param"] == pytest.approx(
        plain["state_bytes_per_param"] + 2.0)
    for plain_key, policy in [(f"qconf-fused-{c}-bf16", "sr") for c in ("default", "group128", "8bit")] + [
            ("qconf-fused-default-bf16", "kahan")]:
        r = by_key[f"{plain_key}-{policy}"]
        assert r["relative_to"] == plain_key and r["ratio_vs_relative"] > 0
        assert r["state_bytes_per_param"] >= by_key[plain_key]["state_bytes_per_param"]
        assert f"cost: {r['label']} (bfloat16): {r['ratio_vs_relative']:.2f}x the step time of " in out

    # peak RSS only where asked, from a subprocess
    for key in keys:
        rss = by_key[key].get("rss")
        if key == "qconf-fused-default-fp32":
            assert rss is not None and "error" not in rss, rss
            assert rss["param_bytes"] == 4 * res["numel"] and rss["pct_of_param_bytes"] >= 0
            assert rss["method"] in ("clear_refs", "sampling")
        else:
            assert rss is None
    assert "%" in rows[keys.index("qconf-fused-default-fp32")] and "%" not in rows[keys.index("torch-fused")]


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_tiny_torchao(capsys):
    code = bench.main(["--size", "tiny", "--rounds", "2", "--warmup", "2", "--quiet", "--no-rss",
                       "--contenders", "torchao-adamw4bit"])
    assert code == 0
    out = capsys.readouterr().out
    header, *rows = _table_lines(out, "tiny")
    assert [r.split("  ")[0] for r in rows] == ["torch AdamW fused", "torchao AdamW4bit"]
    assert "error" not in rows[1]


def test_contender_errors_become_rows(capsys, monkeypatch):
    real = bench.contenders

    def broken(*args, **kwargs):
        rows = real(*args, **kwargs)

        def fail(ps):
            raise RuntimeError("no kernel for this CPU")
        return [bench.Contender("broken", "a broken optimizer", rows[0].dtype, fail)] + rows

    monkeypatch.setattr(bench.cli, "contenders", broken)  # where run() looks it up
    code = bench.main(["--size", "tiny", "--rounds", "1", "--warmup", "1", "--quiet", "--no-rss",
                       "--contenders", "broken"])
    assert code == 0
    header, *rows = _table_lines(capsys.readouterr().out, "tiny")
    assert len(rows) == 2
    assert rows[0].startswith("a broken optimizer") and rows[0].endswith("RuntimeError: no kernel for this CPU")


def test_cli_bench_help_and_errors(capsys):
    assert cli_main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--size", "--rounds", "--threads", "--json"):
        assert option in out
    assert "tiny" not in out  # the smoke-test size is not advertised
    assert cli_main(["bench", "--size", "huge"]) == 2
    assert cli_main(["bench", "--contenders", "nope-*", "--quiet"]) == 2
    assert "match no contender" in capsys.readouterr().err
    assert cli_main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert "torch-fused" in listed and "qconf-fused-default-fp32" in listed


def test_script_runs():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--size", "tiny",
                           "--rounds", "1", "--warmup", "1", "--no-rss", "--quiet", "--contenders",
                           "qconf-fused-default-fp32"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "\ncommand: python benchmarks/bench_step.py --size tiny --rounds 1 " in proc.stdout
    assert "qconf fused default.yml" in proc.stdout


def test_many_vs_one_overhead_line():
    """`--size all` compares ns/param on 1000 small tensors with the same params as one tensor."""
    def size(ns):
        return {"rows": [{"key": "qconf-fused-default-fp32", "label": "qconf fused default.yml", "dtype": "float32",
                          "ns_per_param": ns}]}
    text = bench.format_many_vs_one(size(1.5), size(1.0))
    assert text.splitlines()[1] == "qconf fused default.yml (float32): 1.50x"
    assert bench.SIZE_GROUPS["all"] == ["big", "many", "one"]
    assert math.prod(bench.SIZES["one"][0]) == sum(math.prod(s) for s in bench.SIZES["many"])


# -- --muon: qconf Muon beside torch.optim.Muon ----------------------------------------------------------
MUON_COLUMNS = ["contender", "params", "ns/param", "x Muon med", "x Muon min", "rounds", "state B/param",
                "peak extra RSS", "note"]
MUON_KEYS = ["torch-muon", "qconf-muon-8bit", "qconf-muon-default"]


def test_muon_roster_builds_its_contenders():
    """torch.optim.Muon (the baseline) and qconf.optim.Muon with 8-bit linear / 4-bit nonlinear momentum, all
    on fp32 matrices with the same hyperparameters; built here on two small matrices (no step)."""
    import torch

    from qconf.bench import roster
    from qconf.optim import Muon

    rows = bench.contenders(muon=True)
    assert [c.key for c in rows] == MUON_KEYS and roster.baseline_key(True) == "torch-muon"
    assert roster.BASELINE_TEXT["torch-muon"] == ("Muon", "torch.optim.Muon fp32")
    assert all(c.dtype == torch.float32 and c.requires is None for c in rows)
    assert not {c.key for c in rows} & {c.key for c in bench.contenders()}  # its own roster
    opts = [c.build([torch.zeros(s, requires_grad=True) for s in bench.SIZES["muon"]]) for c in rows]
    assert type(opts[0]) is torch.optim.Muon
    assert all(isinstance(o, Muon) and o.routing() == {"0": "muon", "1": "muon"} for o in opts[1:])
    for o in opts:
        group = o.param_groups[0]
        assert (group["lr"], group["weight_decay"]) == (roster.LR, roster.WEIGHT_DECAY)
        assert (group["momentum"], group["nesterov"], group["ns_steps"]) == (0.95, True, 5)  # torch's defaults
    exp_avg = [o.qconfig.states["exp_avg"] for o in opts[1:]]
    assert [(s.bits, s.map, s.group_size) for s in exp_avg] == [(8, "linear", 256), (4, "nonlinear", 128)]
    # the CUDA roster pins the qconf rows' kernels, as for AdamW
    cuda = bench.contenders(muon=True, device="cuda")
    assert [c.key for c in cuda] == ["torch-muon", "qconf-muon-8bit", "qconf-muon-8bit-specialized",
                                     "qconf-muon-default", "qconf-muon-default-specialized"]


def test_muon_smoke_run_table_and_json(tmp_path, capsys):
    """`--muon` times the three rows in the same rounds on the same matrices; the ratios are to torch.optim.Muon,
    the state bytes are the momentum's (torch fp32: 4 B; 8-bit linear group-256: 1 + 4/256; 4-bit group-128:
    0.5 + 4/128), and the RSS child finds a Muon contender."""
    out_json = tmp_path / "muon.json"
    code = bench.main(["--muon", "--size", "muon-smoke", "--rounds", "2", "--warmup", "1", "--quiet",
                       "--rss-contenders", "qconf-muon-8bit", "--json", str(out_json)], prog="qconf bench")
    assert code == 0
    out = capsys.readouterr().out
    assert "\ncommand: qconf bench --muon --size muon-smoke --rounds 2 " in out
    assert "ratios = median (min) over rounds of step time / torch.optim.Muon fp32 step time in the same round" in out
    header, *rows = _table_lines(out, "muon-smoke")
    positions = [header.index(c) for c in MUON_COLUMNS]
    assert positions == sorted(positions)
    result = json.loads(out_json.read_text())
    assert result["settings"]["muon"] is True and result["settings"]["baseline"] == "torch-muon"
    res = result["sizes"]["muon-smoke"]
    assert res["baseline"] == "torch-muon" and res["numel"] == 2 * 64 * 128
    by_key = {r["key"]: r for r in res["rows"]}
    assert [r["key"] for r in res["rows"]] == MUON_KEYS and len(rows) == 3
    for key, line in zip(MUON_KEYS, rows):
        r = by_key[key]
        assert r["status"] == "ok", (key, r["error"])
        assert line.startswith(r["label"]) and r["ns_per_param"] > 0 and r["ratio_median"] > 0
        assert r["rounds_timed"] == 2
    assert rows[0].startswith("torch Muon  (baseline)") and by_key["torch-muon"]["ratios"] == [1.0, 1.0]
    assert by_key["torch-muon"]["state_bytes_per_param"] == pytest.approx(4.0)
    assert by_key["qconf-muon-8bit"]["state_bytes_per_param"] == pytest.approx(1 + 4 / 256)
    assert by_key["qconf-muon-default"]["state_bytes_per_param"] == pytest.approx(0.5 + 4 / 128)
    step = next(ln for ln in out.splitlines() if ln.startswith("median step: "))
    assert all(by_key[k]["label"] in step for k in MUON_KEYS) and step.endswith(" ms.")
    rss = by_key["qconf-muon-8bit"]["rss"]
    assert "error" not in rss and rss["param_bytes"] == 4 * res["numel"]
    assert all("rss" not in by_key[k] for k in ("torch-muon", "qconf-muon-default"))


def test_muon_options(capsys):
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    for argv, expect in ((["--muon"], "--muon --size muon --rounds 10 "), ([], "--size both --rounds 50 "),
                         (["--muon", "--rounds", "3"], "--muon --size muon --rounds 3 ")):
        assert expect in bench.cli.canonical_command("qconf bench", parser.parse_args(argv))
    assert cli_main(["bench", "--muon", "--size", "big", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == ("qconf bench: error: --muon times Muon on matrices: --size muon "
                                               "(2 matrices, 256x512 and 512x256), not big")
    assert cli_main(["bench", "--muon", "--contenders", "qconf-fused-*", "--quiet"]) == 2
    assert "match no contender (known: torch-muon, qconf-muon-8bit, qconf-muon-default)" in capsys.readouterr().err
    assert cli_main(["bench", "--muon", "--list"]) == 0
    assert [ln.split()[0] for ln in capsys.readouterr().out.splitlines()] == MUON_KEYS
    assert cli_main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--muon" in text and "muon = 2 matrices, 256x512 and 512x256" in text and "smoke" not in text


# -- --device cuda: everything that runs without a GPU ---------------------------------------------------
from qconf.bench import device as bench_device  # noqa: E402
from qconf.bench import measure as bench_measure  # noqa: E402
from qconf.bench.roster import BASELINE, KERNELS_ENV  # noqa: E402
from qconf.bench.tables import DEVICE_FORMULA  # noqa: E402

DEVICE_COLUMNS = ["contender", "params", "ms/step", "x fused med", "x fused min", "GB/s", "% copy BW", "rounds",
                  "state B/param", "peak MiB", "step extra MiB", "note"]


def test_device_cuda_without_cuda_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setattr(bench_device.torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "--device", "cuda", "--quiet", "--rounds", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("qconf bench: error: --device cuda: ")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--device", "cuda"],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("python benchmarks/bench_step.py: error: --device cuda: ")


def test_gpu_size_preset_and_size_defaults(capsys):
    assert bench.SIZES["gpu"] == [(4096, 2048)] * 64
    assert sum(math.prod(s) for s in bench.SIZES["gpu"]) == 536_870_912
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    for argv, size in ((["--device", "cuda"], "gpu"), ([], "both"), (["--device", "cuda", "--size", "big"], "big"),
                       (["--device", "cuda", "--size", "many"], "many")):
        opts = parser.parse_args(argv)
        command = bench.cli.canonical_command("qconf bench", opts)
        assert f"--size {size} " in command
        assert command.startswith("qconf bench --device cuda ") == ("cuda" in argv)
        assert ("--rss-steps" in command) == ("cuda" not in argv)  # no RSS subprocesses on a GPU
    assert cli_main(["bench", "--size", "gpu", "--quiet"]) == 2  # 537M params on the CPU: refused
    assert capsys.readouterr().err.strip() == "qconf bench: error: --size gpu (537M params) is for --device cuda"
    assert cli_main(["bench", "--help"]) == 0
    assert "--device {cpu,cuda}" in capsys.readouterr().out


def test_cuda_roster():
    cpu = {c.key: c for c in bench.contenders()}
    rows = bench.contenders(device="cuda")
    keys = [c.key for c in rows]
    assert "torch-forloop" not in keys and "qconf-reference-default-fp32" not in keys
    assert {"torch-foreach", BASELINE, "torch-fused-bf16", "torchao-adamw4bit", "torchao-adamw8bit",
            "bnb-adamw8bit"} <= set(keys)
    for c in rows:
        if c.family != "qconf":
            assert (c.label, c.dtype, c.requires, c.env) == (cpu[c.key].label, cpu[c.key].dtype, cpu[c.key].requires, ())
            continue
        special = c.key.endswith("-specialized")
        assert c.env == ((KERNELS_ENV, "specialized" if special else "generic"),), c.key
        assert c.label.endswith("(specialized)") == special
        if special:
            assert keys[keys.index(c.key) - 1] == c.key.removesuffix("-specialized")  # right after its twin
        plain = c.key.removesuffix("-specialized")
        if plain.endswith(("-sr", "-kahan")):
            # their cost over the same config's plain bf16 row on the same kernels, as on the CPU
            assert c.relative_to == plain.rsplit("-", 1)[0] + ("-specialized" if special else "")
            assert c.relative_to in keys[:keys.index(c.key)]
        elif c.dtype == bench_device.torch.bfloat16:
            assert c.relative_to == "torch-fused-bf16"
        else:
            assert c.relative_to is None
    special = [k for k in keys if k.endswith("-specialized")]
    assert len(special) == 10  # 3 configs x fp32 / bf16 / bf16 SR, and default.yml's Kahan variant


def test_with_env_switches_the_kernel_choice_per_step(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    seen = []
    step = bench_device.with_env(lambda: seen.append(__import__("os").environ.get(KERNELS_ENV)),
                                 ((KERNELS_ENV, "specialized"),))
    step()
    assert seen == ["specialized"] and KERNELS_ENV not in __import__("os").environ
    monkeypatch.setenv(KERNELS_ENV, "generic")
    step()
    assert seen[-1] == "specialized" and __import__("os").environ[KERNELS_ENV] == "generic"
    plain = lambda: None  # noqa: E731
    assert bench_device.with_env(plain, ()) is plain  # no wrapper where nothing is set
    from qconf import _native
    if _native.native_available():  # the step reads the variable at every call, as this does
        choice = bench_device.with_env(_native.cuda_kernels, ((KERNELS_ENV, "specialized"),))
        assert choice() == "specialized" and _native.cuda_kernels() == "generic"


def test_bytes_per_param_moved():
    f32, bf16 = bench_device.torch.float32, bench_device.torch.bfloat16
    assert bench_device.bytes_per_param_moved(f32, 8.0) == bench_device.COPY_BYTES_PER_PARAM == 28
    assert bench_device.bytes_per_param_moved(bf16, 4.0) == 14
    assert bench_device.bytes_per_param_moved(f32, 0.5) == 13


class _FakeDevice:
    """A clock that only moves when told: ``sync`` (waiting for the device) costs ``sync_ns``, a
    fake optimizer's step its own ns, the copy nothing beyond its syncs."""

    def __init__(self, sync_ns: int) -> None:
        self.now, self.sync_ns, self.syncs = 0, sync_ns, 0
        self.allocated, self.peak = 1000, 1000

    def sync(self) -> None:
        self.syncs += 1
        self.now += self.sync_ns

    def backend(self) -> bench_device.Backend:
        return bench_device.Backend(bench_device.torch.device("cpu"), sync=self.sync, clock=lambda: self.now,
                                    allocated=lambda: self.allocated, max_allocated=lambda: self.peak,
                                    reset_peak=lambda: setattr(self, "peak", self.allocated), share_grads=True,
                                    copy_bytes_per_param=bench_device.COPY_BYTES_PER_PARAM,
                                    info=lambda: {"name": "Fake GPU", "capability": "sm_90", "memory_gib": 80.0,
                                                  "cuda": "13.0", "qconf_cuda_kernels": True})


def _fake_rows(dev: _FakeDevice, grads_seen: list, write_grads: bool = False) -> list:
    torch = bench_device.torch

    class FakeOpt:
        def __init__(self, ps, ns, state_bytes_per_param, extra):
            self.ps, self.ns, self.extra = ps, ns, extra
            self.state = {p: {"m": torch.zeros(int(p.numel() * state_bytes_per_param), dtype=torch.uint8)}
                          for p in ps}
            grads_seen.append([p.grad for p in ps])
            dev.peak += 4000  # the build's allocations

        def step(self):
            dev.now += self.ns
            dev.peak = max(dev.peak, dev.allocated + self.extra)
            if write_grads:
                self.ps[0].grad.add_(1.0)

    def fake(ns, sbpp, extra):
        return lambda ps: FakeOpt(ps, ns, sbpp, extra)
    return [bench.Contender(BASELINE, "torch AdamW fused", torch.float32, fake(1000, 8, 300)),
            bench.Contender("fast", "a fast optimizer", torch.float32, fake(500, 1, 100), family="fake"),
            bench.Contender("other", "same grads", torch.float32, fake(500, 1, 100), family="fake")]


def _fake_opts(rounds: int = 3) -> __import__("argparse").Namespace:
    return __import__("argparse").Namespace(rounds=rounds, slow_rounds=1, warmup=2, seed=0, quiet=True, rss=True,
                                            rss_contenders=None)


def test_device_timing_with_a_fake_clock():
    """The CUDA path's timing, copy baseline, bandwidth fractions and memory probes, driven on CPU
    tensors by a fake clock whose `sync` is the only thing (besides the fake steps) that takes time."""
    dev, grads_seen = _FakeDevice(sync_ns=100), []
    res = bench_measure.bench_size("tiny", _fake_rows(dev, grads_seen), _fake_opts(), dev.backend())
    numel = res["numel"]
    by_key = {r["key"]: r for r in res["rows"]}
    assert [r["key"] for r in res["rows"]] == [BASELINE, "fast", "other"]  # the copy is not a row
    # every timed step: sync, clock, step, sync, clock -> the step's ns + one sync
    assert by_key[BASELINE]["times_ns"] == [1100] * 3 and by_key["fast"]["times_ns"] == [600] * 3
    assert by_key["fast"]["ratio_median"] == pytest.approx(600 / 1100)
    copy = res["copy"]
    assert copy["bytes"] == 28 * numel and copy["times_ns"] == [100] * 3 and copy["median_ns"] == 100
    assert copy["gb_per_s"] == pytest.approx(28 * numel / 100)
    # bytes/step = 2P + G + 2S; fraction = (bytes / time) / (copy bytes / copy time), same round
    assert by_key[BASELINE]["bytes_per_param_moved"] == 28 and by_key["fast"]["bytes_per_param_moved"] == 14
    assert by_key[BASELINE]["copy_fraction"] == pytest.approx(100 / 1100)
    assert by_key["fast"]["copy_fraction"] == pytest.approx((14 / 600) / (28 / 100))
    assert by_key["fast"]["gb_per_s"] == pytest.approx(14 * numel / 600)
    # 2 syncs per timed step: 3 contenders x (2 warm-up + 3 rounds) + the copy x (2 + 3)
    assert dev.syncs == 2 * (3 * 5 + 5)
    # memory probes: the build's 4000 bytes, and the last warm-up step's own peak
    assert by_key[BASELINE]["peak_mem_bytes"] == 4000 and by_key[BASELINE]["step_extra_bytes"] == 300
    assert by_key["fast"]["step_extra_bytes"] == 100 and "rss" not in by_key["fast"]
    # one set of gradients per dtype, shared by every contender, and not written
    assert all(g1 is g2 for g1, g2 in zip(grads_seen[0], grads_seen[1]))
    assert res["grads_modified"] is False

    text = bench.tables.format_size(res)
    lines = text.splitlines()
    header = lines[1]
    positions = [header.index(c) for c in DEVICE_COLUMNS]
    assert positions == sorted(positions)
    base_line = next(ln for ln in lines if ln.startswith("torch AdamW fused  (baseline)"))
    assert " 9% " in base_line and " 1.00 " in base_line
    fast_line = next(ln for ln in lines if ln.startswith("a fast optimizer"))
    assert " 8% " in fast_line and " 0.55 " in fast_line and " 0.001 " in fast_line  # 600 ns = 0.0006 ms
    assert any(ln.startswith("device copy: ") and "28 B/param" in ln for ln in lines)
    for formula in DEVICE_FORMULA:
        assert formula in text
    assert "cost: " not in text


def test_device_timing_flags_written_gradients():
    dev, grads_seen = _FakeDevice(sync_ns=10), []
    res = bench_measure.bench_size("tiny", _fake_rows(dev, grads_seen, write_grads=True), _fake_opts(1),
                                   dev.backend())
    assert res["grads_modified"] is True
    assert "warning: a contender wrote to the shared gradients" in bench.tables.format_size(res)


def test_device_cuda_end_to_end_on_a_fake_device(tmp_path, capsys, monkeypatch):
    """`--device cuda` through the CLI, its roster (specialized rows included), tables and JSON, with
    the CUDA backend replaced by CPU tensors and the real clock."""
    dev = _FakeDevice(sync_ns=0)
    fake = dataclasses_replace(dev.backend(), clock=__import__("time").perf_counter_ns, sync=lambda: None)
    monkeypatch.setattr(bench.cli, "make_backend", lambda device: fake if device == "cuda" else None)
    out_json = tmp_path / "gpu.json"
    code = bench.main(["--device", "cuda", "--size", "tiny", "--rounds", "2", "--warmup", "2", "--quiet",
                       "--contenders", "qconf-fused-group128-fp32*,torch-fused-bf16", "--json", str(out_json)],
                      prog="qconf bench")
    assert code == 0
    out = capsys.readouterr().out
    assert "\ndevice: Fake GPU (sm_90, 80.0 GiB); torch " in out and "CUDA 13.0" in out
    assert "\ncommand: qconf bench --device cuda --size tiny --rounds 2 " in out
    result = json.loads(out_json.read_text())
    assert result["device"] == "cuda" and result["machine"]["gpu"]["name"] == "Fake GPU"
    assert result["settings"]["rss"] is False
    res = result["sizes"]["tiny"]
    keys = [r["key"] for r in res["rows"]]
    assert keys == ["torch-fused", "torch-fused-bf16", "qconf-fused-group128-fp32",
                    "qconf-fused-group128-fp32-specialized"]
    for r in res["rows"]:
        assert r["status"] == "ok", r
        assert r["copy_fraction"] > 0 and r["gb_per_s"] > 0 and "peak_mem_bytes" in r
    assert res["copy"]["bytes"] == 28 * res["numel"]
    header, *rows = _table_lines(out, "tiny")
    assert [header.index(c) for c in DEVICE_COLUMNS] == sorted(header.index(c) for c in DEVICE_COLUMNS)
    assert rows[3].startswith("qconf fused 2nd_moment_group_128.yml (specialized)")
    assert "ms/step = median over rounds" in out


def dataclasses_replace(obj, **kw):
    return __import__("dataclasses").replace(obj, **kw)


def test_the_gpu_check_script_logs_each_stage_and_refuses_unknown_ones(tmp_path):
    """benchmarks/gpu_check.sh (issues 24 and 50's prepared GPU checks): each stage's log and exit
    status land under $OUT; without CUDA the bench, memory and bitlinear stages fail with their
    one-line errors; a misspelt stage stops the script with status 2."""
    script = REPO / "benchmarks" / "gpu_check.sh"
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(script), "bench", "memory", "bitlinear"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0  # (stages fail into their status line, not the script's)
    status = (tmp_path / "status").read_text().splitlines()
    assert [line.split(" ")[:2] for line in status] == [
        ["bench", "rc=2"], ["memory", "rc=2"], ["bitlinear_fp32", "rc=2"], ["bitlinear_bf16", "rc=2"]]
    assert "qconf bench: error: --device cuda: " in (tmp_path / "bench.log").read_text()
    assert "qconf bench: error: --device cuda: " in (tmp_path / "memory.log").read_text()
    assert "bench_bitlinear.py: error: --device cuda: " in (tmp_path / "bitlinear_bf16.log").read_text()
    bad = subprocess.run(["bash", str(script), "bild"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown stage 'bild'" in bad.stderr
