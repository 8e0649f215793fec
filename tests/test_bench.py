"""Smoke test of the optimizer-step benchmark (qconf.bench) on a tiny size with 2 rounds.

Timings are not checked (benchmarks are never timed tests); the test checks that the tables have the
expected rows and columns, the JSON parses, and the CLI/script entry points work. Contenders from
packages that are not installed (torchao, bitsandbytes) are expected as "not installed" rows.
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from qconf import bench
from qconf.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["contender", "params", "ns/param", "x fused med", "x fused min", "rounds", "state B/param",
           "peak extra RSS", "note"]
FOOTNOTES = ("cost: ", "noise: ", "* slow contender", "peak extra RSS:")
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
                "qconf-fused-default-bf16-sr", "qconf-fused-default-bf16-kahan",
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
    for policy in ("sr", "kahan"):
        r = by_key[f"qconf-fused-default-bf16-{policy}"]
        assert r["relative_to"] == "qconf-fused-default-bf16" and r["ratio_vs_relative"] > 0
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
