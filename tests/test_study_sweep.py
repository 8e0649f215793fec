"""Sweeps (--vary), several optimizers in one study and run keys: expansion and validation before
anything runs, points named by what they change, points that resolve to the same codecs run once,
and a key that changes with everything that determines a run and with nothing else."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from qconf.cli import main
from qconf.config import load_config
from qconf.study import StudyError, compare, plan_study
from qconf.study import keys as study_keys
from qconf.study.cli import parse_lr, parse_opt_args
from qconf.study.compare import _opt_args
from qconf.study.sweep import HARD_LIMIT, MAX_POINTS, check_size, expand, parse_vary

CFG = Path(__file__).resolve().parents[1] / "configs"
TINY = "test_study_tasks:tiny_task"


def run_cli(capsys, *argv):
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- expansion ----------------------------------------------------------------------------------------
def test_expand_is_the_cartesian_product_named_by_its_changes():
    base = load_config("default")
    varies = [parse_vary("states.exp_avg.bits=3,4,5", base), parse_vary("states.exp_avg_sq.map=power-1,linear", base)]
    points = expand("default", base, varies)
    assert [p.label for p in points] == [f"default:exp_avg.bits={b},exp_avg_sq.map={m}"
                                         for b in (3, 4, 5) for m in ("power-1", "linear")]
    for p in points:
        bits, qmap = (v for _, v in p.changes)
        assert p.config.states["exp_avg"].bits == int(bits) and p.config.states["exp_avg_sq"].map == qmap
        # everything else is the base's
        assert p.config.states["exp_avg_sq"].scale == "rank1" and p.config.min_numel == base.min_numel


def test_vary_field_forms_and_value_types():
    cfg = load_config({"base": "default", "overrides": [{"match": "*.bias", "enable": False}]})
    assert parse_vary("overrides[0].enable=true,false", cfg).path == ("overrides", 0, "enable")
    v = parse_vary("overrides.0.states.exp_avg.bits=4,8", cfg)
    assert v.field == "overrides[0].states.exp_avg.bits" and v.values == (4, 8)
    assert parse_vary("min_numel=0,4096", cfg).values == (0, 4096)
    assert parse_vary("weights.rounding=nearest,stochastic", cfg).values == ("nearest", "stochastic")
    assert parse_vary("states.exp_avg.min_numel=null,100", cfg).values == (None, 100)
    points = expand("c", cfg, [parse_vary("overrides[0].enable=true", cfg)])
    assert points[0].config.overrides[0].enable is True and points[0].label == "c:overrides[0].enable=true"


@pytest.mark.parametrize("item, words", [
    ("states.exp_avg.bitz=3,4", ["unknown field 'bitz'", "did you mean 'bits'"]),
    ("states.exp_avgg.bits=3", ["unknown state 'exp_avgg'", "did you mean 'exp_avg'"]),
    ("stats.exp_avg.bits=3", ["not a qconfig field", "stats.exp_avg.bits"]),
    ("min_numell=3", ["not a qconfig field", "did you mean 'min_numel'"]),
    ("overrides[0].enable=true", ["has no overrides"]),
    ("states.exp_avg.bits", ["not FIELD=V1,V2"]),
    ("states.exp_avg.bits=3,,4", ["empty value"]),
    ("states.exp_avg.bits=4,4", ["listed twice"]),
])
def test_bad_vary_fields(item, words):
    with pytest.raises(StudyError) as e:
        parse_vary(item, load_config("default"))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_a_bad_value_names_its_point():
    base = load_config("default")
    varies = [parse_vary("states.exp_avg.bits=4,9", base), parse_vary("states.exp_avg.map=nonlinear", base)]
    with pytest.raises(StudyError) as e:
        expand("default", base, varies)
    text = str(e.value)
    assert "--vary point default:exp_avg.bits=9,exp_avg.map=nonlinear" in text and "states.exp_avg.bits" in text
    assert "allowed: integer 1..8" in text


def test_sweep_size_limits_are_checked_before_any_point_exists():
    base = load_config("default")
    over = [parse_vary(f"states.exp_avg.bits={','.join(str(b) for b in range(1, 9))}", base),
            parse_vary("states.exp_avg.group_size=32,64,128,256,512", base)]
    assert 8 * 5 > MAX_POINTS
    with pytest.raises(StudyError, match="40 points .*80 training runs.*--yes"):
        check_size(over, 2, allow_many=False)
    check_size(over, 2, allow_many=True)
    huge = [parse_vary(f"states.exp_avg.group_size={','.join(str(g) for g in range(1, 101))}", base),
            parse_vary(f"states.exp_avg_sq.group_size={','.join(str(g) for g in range(1, 101))}", base),
            parse_vary(f"min_numel={','.join(str(g) for g in range(100))}", base)]
    start = time.perf_counter()
    with pytest.raises(StudyError, match=f"more than the limit of {HARD_LIMIT}"):
        check_size(huge, 1, allow_many=True)  # 10^6 points: refused from the counts, nothing expanded
    assert time.perf_counter() - start < 1.0
    with pytest.raises(StudyError, match="given twice"):
        check_size([over[0], over[0]], 1, allow_many=True)


# -- dedup and keys ---------------------------------------------------------------------------------------
def _keys(configs, **kw):
    plan = plan_study(configs, kw.pop("task", TINY), steps=kw.pop("steps", 4), seeds=1, **kw)
    return {r.label: plan.key(r, 0) for r in plan.rows}, plan


def test_points_that_resolve_to_the_same_codecs_share_one_run():
    # tiny_task: one quantized 2-D weight (80x64); the 1-D bias and the 10x80 head stay fp32
    keys, plan = _keys(["default"], vary=["states.exp_avg_sq.scale=group,rank1", "states.exp_avg_sq.group_size=128,2048"])
    by = {tuple(v for _, v in r.changes): keys[r.label] for r in plan.rows}
    assert by[("rank1", "128")] == by[("rank1", "2048")]      # rank-1 on a matrix: no blocks
    assert by[("group", "128")] != by[("group", "2048")] != by[("rank1", "128")]
    assert len(plan.runs()) == 3 and plan.runs()[2].rows == ("default:exp_avg_sq.scale=rank1,exp_avg_sq.group_size=128",
                                                             "default:exp_avg_sq.scale=rank1,exp_avg_sq.group_size=2048")
    # min_numel between the parameter sizes (800 < 4096, 5000 < 5120): same runs; above the matrix: fp32
    keys, _ = _keys(["default"], vary=["min_numel=4096,5000,6000"])
    assert len(set(keys.values())) == 2 and keys["default:min_numel=4096"] == keys["default:min_numel=5000"]
    # fp32 parameters: the weights' rounding does nothing; SGD keeps no second moment
    keys, _ = _keys(["default"], vary=["weights.rounding=nearest,stochastic"])
    assert len(set(keys.values())) == 1
    keys, _ = _keys(["default"], optimizer="sgd", vary=["states.exp_avg_sq.bits=2,4,8"])
    assert len(set(keys.values())) == 1
    keys, _ = _keys(["default"], optimizer="adamw", vary=["states.exp_avg_sq.bits=2,4,8"])
    assert len(set(keys.values())) == 3


def test_the_key_changes_with_everything_that_determines_a_run(monkeypatch):
    base, _ = _keys(["default"])
    key = base["default"]
    assert _keys(["default"])[0]["default"] == key                             # deterministic
    changed = {
        "steps": _keys(["default"], steps=5), "lr": _keys(["default"], lr=1e-3),
        "optimizer": _keys(["default"], optimizer="lion"), "kwargs": _keys(["default"], optimizer_kwargs={"eps": 1e-6}),
        "config": _keys(["8bit"]), "task": _keys(["default"], task="test_study_tasks:poisoned_task"),
        "eval_every": _keys(["default"], eval_every=2), "threads": _keys(["default"], threads=2),
        "qerr": _keys(["default"], measure_error=False), "kernel": _keys(["default"], fused="off"),
    }
    for what, (keys, _) in changed.items():
        assert next(iter(keys.values())) != key, what
    _, plan = _keys(["default"])
    assert plan.key(plan.rows[0], 1) != key                                     # the seed
    monkeypatch.setattr(study_keys, "__version__", "999.0")                     # another qconf
    assert _keys(["default"])[0]["default"] != key
    monkeypatch.undo()
    monkeypatch.setattr(study_keys.torch, "__version__", "0.0.1")               # another torch
    assert _keys(["default"])[0]["default"] != key


def test_rows_share_runs_and_show_the_same_numbers():
    result = compare(["fp32", "default"], task=TINY, steps=6, seeds=2, eval_every=3, out=False, progress=False,
                     vary=["states.exp_avg.bits=3,4"])  # the sweep's base is fp32: both points are fp32
    rows = {r["config"]: r for r in result.summary()}
    a, b = "fp32:exp_avg.bits=3", "fp32:exp_avg.bits=4"
    assert rows[b]["same_runs_as"] == a and rows[b]["verdict"] == "identical"
    assert [r.train_loss for r in result.runs_of(a)] == [r.train_loss for r in result.runs_of(b)]
    assert result.reference == a and rows["default"]["verdict"] in ("better", "worse", "within noise")


# -- several optimizers -------------------------------------------------------------------------------------
def test_several_optimizers_in_one_study(tmp_path):
    result = compare(["fp32", "default", "default@sgd"], task=TINY, optimizer="adamw,lion", steps=6, seeds=1,
                     eval_every=3, lr={"adamw": 3e-3, "lion": 3e-4, "sgd": 0.05},
                     optimizer_kwargs={"weight_decay": 0.0, "adamw": {"eps": 1e-6}}, out=tmp_path, progress=False)
    labels = [r.label for r in result.rows]
    assert labels == ["fp32@adamw", "fp32@lion", "default@adamw", "default@lion", "default@sgd"]
    assert result.reference == "fp32@adamw"
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*.json")]
    by_row = {r["row"]: r for r in records}
    assert {k: by_row[k]["lr"] for k in labels} == {"fp32@adamw": 3e-3, "fp32@lion": 3e-4, "default@adamw": 3e-3,
                                                   "default@lion": 3e-4, "default@sgd": 0.05}
    assert by_row["default@adamw"]["kwargs"] == {"weight_decay": 0.0, "eps": 1e-6}
    assert by_row["default@sgd"]["kwargs"] == {"weight_decay": 0.0}
    rows = {r["config"]: r for r in result.summary()}
    assert rows["default@sgd"]["optimizer"] == "sgd" and rows["default@lion"]["state_bytes_per_param"] < \
        rows["default@adamw"]["state_bytes_per_param"]  # one state against two
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["optimizers"] == ["adamw", "lion", "sgd"]
    assert "--optimizer adamw,lion" in data["settings"]["command"] and "default@sgd" in data["settings"]["command"]
    assert "--opt-arg adamw:eps=1e-06" in data["settings"]["command"]


@pytest.mark.parametrize("kwargs, words", [
    (dict(optimizer="adamw,lion", optimizer_kwargs={"eps": 1e-6}), ["lion has no argument 'eps'", "adamw:eps"]),
    (dict(optimizer="adamw", optimizer_kwargs={"lion": {"weight_decay": 0.1}}), ["'lion'", "does not use"]),
    (dict(optimizer="adamw", lr={"lion": 1e-3}), ["lr is given for 'lion'", "does not use"]),
    (dict(optimizer="adamw,adamww"), ["unknown optimizer 'adamww'", "did you mean 'adamw'"]),
    (dict(reference="nope"), ["reference 'nope' is not a row"]),
    (dict(optimizer="adamw", lr={"adamw": -1.0}), ["lr of adamw must be a positive number"]),
])
def test_bad_study_arguments(kwargs, words):
    with pytest.raises(StudyError) as e:
        compare(["fp32", "default"], task=TINY, steps=2, seeds=1, out=False, progress=False, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cli_parsers():
    assert parse_lr("1e-3") == 1e-3 and parse_lr("adamw=1e-3,lion=1e-4") == {"adamw": 1e-3, "lion": 1e-4}
    with pytest.raises(StudyError, match="--lr"):
        parse_lr("adamw=fast")
    assert parse_opt_args(["eps=1e-6", "lion:weight_decay=0.1", "adamw:betas=0.9,0.95"]) == {
        "eps": 1e-6, "lion": {"weight_decay": 0.1}, "adamw": {"betas": (0.9, 0.95)}}
    with pytest.raises(StudyError, match="unknown optimizer 'lyon'"):
        parse_opt_args(["lyon:weight_decay=0.1"])
    assert parse_opt_args(["muon:adamw.lr=3e-3", "muon:adamw.betas=0.9,0.95", "muon:ns_steps=3"]) == {
        "muon": {"adamw": {"lr": 3e-3, "betas": (0.9, 0.95)}, "ns_steps": 3}}
    with pytest.raises(StudyError, match="both as a value and as a mapping"):
        parse_opt_args(["muon:adamw=1", "muon:adamw.lr=3e-3"])
    # the reproducing command spells a mapping argument with dotted keys, which parse back
    args = [f"muon:{k}={v}" for k, v in _opt_args("adamw", {"lr": 3e-3, "betas": (0.9, 0.95)})]
    assert args == ["muon:adamw.lr=0.003", "muon:adamw.betas=0.9,0.95"]
    assert parse_opt_args(args) == {"muon": {"adamw": {"lr": 3e-3, "betas": (0.9, 0.95)}}}


def test_muon_in_a_study_keeps_each_part_its_lr_and_measures_the_momentum_error():
    """Muon's two param groups keep their own lr through the schedule (the shadow too), and the
    momentum's quantization error is measured like any state's."""
    result = compare(["muon_8bit@muon"], task=TINY, steps=6, seeds=1, out=False, progress=False, eval_every=3,
                     lr={"muon": 0.02}, optimizer_kwargs={"muon": {"adamw": {"lr": 1e-3}}})
    (run,) = result.runs
    assert run.status == "ok", run.reason
    assert run.qerr["momentum_buffer"][-1][1] > 0  # quantized against the fp32 shadow


# -- bad input on the command line: exit 2, one line, nothing run, nothing written ---------------------------
@pytest.mark.parametrize("argv, words", [
    (["default", "--vary", "states.exp_avg.bitz=3,4"], ["unknown field 'bitz'", "did you mean 'bits'"]),
    (["default", "--vary", "states.exp_avg.bits=4,9"], ["--vary point default:exp_avg.bits=9", "1..8"]),
    (["default", "--vary", "states.exp_avg.bits=1,2,3,4,5,6,7,8", "--vary", "states.exp_avg.group_size=32,64,128,256,512"],
     ["40 points", "--yes"]),
    (["default@adamx"], ["unknown optimizer 'adamx' after '@'"]),
    (["default", "--reference", "fp33"], ["reference 'fp33' is not a row"]),
    (["--collect"], ["--collect needs --out"]),
])
def test_cli_bad_sweeps_exit_2_and_write_nothing(capsys, tmp_path, argv, words):
    out = tmp_path / "study"
    code, stdout, err = run_cli(capsys, *argv, "--task", TINY, "--steps", "2", "--no-progress",
                                *(["--out", str(out)] if "--collect" not in argv else []))
    assert code == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconf compare: error:"), err
    assert all(w in lines[0] for w in words), lines[0]
    assert not out.exists()


def test_cli_sweep_writes_points_configs_and_plot(capsys, tmp_path):
    out = tmp_path / "study"
    code, stdout, err = run_cli(capsys, "default", "fp32", "--vary", "states.exp_avg.bits=3,4", "--vary",
                                "states.exp_avg_sq.map=power-1,linear", "--task", TINY, "--steps", "4", "--seeds", "1",
                                "--out", str(out), "--no-progress", "--no-qerr")
    assert code == 0, err
    assert "sweep of default: 4 row(s) over exp_avg.bits (2) x exp_avg_sq.map (2)" in stdout
    table = stdout[stdout.index("config "):].splitlines()   # the sweep's table: a column per field
    assert table[0].split()[:3] == ["config", "exp_avg.bits", "exp_avg_sq.map"]
    assert table[2].split()[:3] == ["default", "3", "power-1"] and table[6].split()[:2] == ["fp32", "8.000"]
    names = sorted(p.name for p in (out / "configs").iterdir())
    assert names == sorted(["default_exp_avg.bits=3,exp_avg_sq.map=power-1.yml",
                            "default_exp_avg.bits=3,exp_avg_sq.map=linear.yml",
                            "default_exp_avg.bits=4,exp_avg_sq.map=power-1.yml",
                            "default_exp_avg.bits=4,exp_avg_sq.map=linear.yml", "fp32.yml"])
    saved = load_config(out / "configs" / "default_exp_avg.bits=3,exp_avg_sq.map=linear.yml")  # the full config
    assert saved.states["exp_avg"].bits == 3 and saved.states["exp_avg_sq"].map == "linear"
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert report.splitlines()[3].startswith("qconf compare default fp32 --vary states.exp_avg.bits=3,4 --vary "
                                             "states.exp_avg_sq.map=power-1,linear --task")  # the command, on top
    assert "**sweep**: `states.exp_avg.bits` = 3, 4 x `states.exp_avg_sq.map` = power-1, linear (4 points)" in report
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0].split(",")[:8] == ["config", "source", "optimizer", "lr", "vary exp_avg.bits", "vary exp_avg_sq.map",
                                      "same_runs_as", "seeds_planned"]


def test_sweep_plot_is_a_line_for_one_field_and_heatmap_panels_for_more(tmp_path, monkeypatch):
    from qconf.study import sweep_plot

    drawn = []
    for name in ("_line", "_heatmaps"):
        real = getattr(sweep_plot, name)
        monkeypatch.setattr(sweep_plot, name, lambda *a, _real=real, _name=name: drawn.append(
            (_name, len(a[2]) if _name == "_heatmaps" else None)) or _real(*a))
    one = compare(["default", "fp32"], task=TINY, steps=2, seeds=1, measure_error=False, progress=False,
                  out=tmp_path / "one", vary=["states.exp_avg.bits=3,4,8"])
    three = compare(["default"], task=TINY, steps=2, seeds=1, measure_error=False, progress=False,
                    out=tmp_path / "three", vary=["states.exp_avg.bits=3,4", "states.exp_avg.map=nonlinear,linear",
                                                  "states.exp_avg.group_size=64,128,256"])
    assert drawn == [("_line", None), ("_heatmaps", 3)]   # one panel per exp_avg.group_size
    for result in (one, three):
        assert (result.out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    monkeypatch.setattr(sweep_plot, "MAX_PANELS", 2)  # more panels than that: no sweep plot
    assert sweep_plot.plot_sweep(three, tmp_path / "none.png", plt) is None and not (tmp_path / "none.png").exists()


def test_the_shipped_ablation_is_one_command_that_plans_what_its_doc_reports(tmp_path, capsys):
    """docs/studies/ablation_4bit.md opens with the command that produced it: planned here (nothing
    trained), it makes the rows and distinct runs the page reports."""
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[1] / "docs" / "studies" / "ablation_4bit.md").read_text()
    block = doc.split("```bash\n", 1)[1].split("```", 1)[0]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:2] == ["qconf", "compare"] and argv.count("--vary") == 5
    out = argv.index("--out")
    argv[out + 1] = str(tmp_path / "ablation")
    assert main([*argv[1:], "--plan"]) == 0
    printed = capsys.readouterr()[0]
    plan = json.loads((tmp_path / "ablation" / "study.json").read_text())
    rows, runs = len(plan["rows"]), len(plan["runs"])
    assert f"{runs} run(s)" in printed
    claim = re.search(r"(\d+) rows .*?(\d+) distinct runs", doc.replace("\n", " "))
    assert claim and (int(claim.group(1)), int(claim.group(2))) == (rows, runs)
