"""QConfig loading: shipped configs, round trips, defaults, base merging, direct construction."""
from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml

import qconf
from qconf.codec import Codec
from qconf.config import (DEFAULT_STATES, STATE_NAMES, Override, QConfig, StateConfig, StatePlan, WeightsConfig,
                          load_config, resolve_plan)
from qconf.errors import QConfigError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yml"))
LPMM_SHIPPED = ["default.yml", "2nd_moment_group_128.yml", "default_5b.yml", "default_6b.yml", "default_7b.yml",
                "default_8b.yml", "1st_moment_group_256.yml", "1st_moment_group_512.yml", "1st_moment_group_1024.yml",
                "1st_moment_group_2048.yml", "1st_moment_group_4096.yml", "2nd_moment_only_default.yml",
                "2nd_moment_only_group_128.yml"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- public API --------------------------------------------------------------------------------
def test_public_names():
    assert qconf.QConfig is QConfig and qconf.StatePlan is StatePlan and qconf.load_config is load_config
    assert issubclass(qconf.QConfigError, ValueError)
    assert STATE_NAMES == ("exp_avg", "exp_avg_sq")
    assert tuple(DEFAULT_STATES) == STATE_NAMES


def test_shipped_set_is_complete():
    names = {p.name for p in CONFIGS}
    assert set(LPMM_SHIPPED) | {"8bit.yml", "fp32.yml"} <= names


def test_shipped_configs_are_commented():
    for path in CONFIGS:
        assert path.read_text().lstrip().startswith("#"), path


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_round_trip_dict(path):
    cfg = load_config(path)
    assert cfg.source == str(path)
    d = cfg.to_dict()
    assert load_config(d) == cfg
    assert load_config(copy.deepcopy(d)).to_dict() == d


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_round_trip_yaml_text(path, tmp_path):
    cfg = load_config(path)
    text = yaml.safe_dump(cfg.to_dict())
    assert load_config(yaml.safe_load(text)) == cfg
    out = write(tmp_path / "dumped.yml", cfg.to_yaml())
    assert load_config(out) == cfg


def test_to_dict_is_full_and_plain():
    d = load_config({}).to_dict()
    assert list(d) == ["version", "min_numel", "states", "weights", "overrides"]
    assert list(d["states"]) == list(STATE_NAMES)
    for section in d["states"].values():
        assert list(section) == ["enable", "bits", "map", "signed", "scale", "group_size", "rounding", "min_numel"]
    assert d["weights"] == {"rounding": "nearest", "compensation": "none", "compensation_codec": None}
    assert "source" not in d and "base" not in d

    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or isinstance(x, (str, int, bool))
    assert plain(d)


def test_round_trip_with_overrides():
    cfg = load_config({
        "min_numel": 100,
        "states": {"exp_avg_sq": {"scale": "rank1", "min_numel": 10}},
        "weights": {"rounding": "stochastic", "compensation": "kahan"},
        "overrides": [
            {"match": "*.bias", "enable": False},
            {"match": "re:embed.*", "states": {"exp_avg_sq": {"bits": 8}, "exp_avg": {"enable": True}}},
            {"ndim": 1, "min_numel": 5, "max_numel": 50, "weights": {"rounding": "nearest"}},
        ],
    })
    d = cfg.to_dict()
    assert d["overrides"][0] == {"match": "*.bias", "enable": False}
    assert d["overrides"][1]["states"] == {"exp_avg": {"enable": True}, "exp_avg_sq": {"bits": 8}}
    assert load_config(d) == cfg
    assert load_config(yaml.safe_load(yaml.safe_dump(d))) == cfg


def test_equality_hash_pickle():
    a = load_config(REPO / "configs" / "default.yml")
    b = load_config(str(REPO / "configs" / "default.yml"))
    assert a == b and hash(a) == hash(b)
    assert a != load_config({})
    c = pickle.loads(pickle.dumps(a))
    assert c == a and resolve_plan(c, "w", (100, 100)) == resolve_plan(a, "w", (100, 100))
    ov = Override(match="re:.*bias", enable=False)
    assert pickle.loads(pickle.dumps(ov)).matches("x.bias", (3,))
    assert copy.deepcopy(a) == a


def test_source_not_compared():
    a = load_config(REPO / "configs" / "default.yml")
    assert dataclasses.replace(a, source=None) == a


def test_frozen():
    cfg = load_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.min_numel = 3
    with pytest.raises(TypeError):
        cfg.states["exp_avg"] = StateConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.states["exp_avg"].bits = 8


def test_qconfig_passthrough_and_none():
    cfg = load_config({"min_numel": 1})
    assert load_config(cfg) is cfg
    assert load_config(None) == QConfig()


def test_loading_does_not_mutate_input():
    d = {"base": [], "states": {"exp_avg": {"bits": 8}}, "overrides": [{"match": "x", "enable": False}]}
    snapshot = copy.deepcopy(d)
    load_config(d)
    assert d == snapshot


# -- defaults --------------------------------------------------------------------------------------
def test_defaults_equal_lpmm_C():
    cfg = load_config({})
    assert cfg == QConfig()
    assert cfg.version == 1 and cfg.min_numel == 4096 and cfg.overrides == ()
    m, v = cfg.states["exp_avg"], cfg.states["exp_avg_sq"]
    # lpmm _C: M = 4-bit group-128 signed nonlinear real-nearest; SQM = 4-bit group-128 unsigned power-1
    assert (m.enable, m.bits, m.scale, m.group_size, m.map, m.signed, m.rounding) == \
        (True, 4, "group", 128, "nonlinear", True, "nearest")
    assert (v.enable, v.bits, v.scale, v.group_size, v.map, v.signed, v.rounding) == \
        (True, 4, "group", 128, "power-1", False, "nearest")
    assert m.min_numel is None and v.min_numel is None
    assert cfg.weights == WeightsConfig()


def test_defaults_equal_2nd_moment_group_128_not_default_yml():
    # lpmm's README says None gives default.yml; in code (and here) it gives the _C defaults
    assert load_config({}) == load_config(REPO / "configs" / "2nd_moment_group_128.yml")
    assert load_config({}) != load_config(REPO / "configs" / "default.yml")


def test_empty_file_is_defaults(tmp_path):
    assert load_config(write(tmp_path / "e.yml", "")) == QConfig()
    assert load_config(write(tmp_path / "c.yml", "# only a comment\n")) == QConfig()
    assert load_config(write(tmp_path / "n.yml", "states:\nweights:\noverrides:\n")) == QConfig()


def test_default_yml_is_paper_4bit_adamw():
    cfg = load_config(REPO / "configs" / "default.yml")
    assert cfg.states["exp_avg"] == StateConfig(bits=4, map="nonlinear", signed=True, scale="group", group_size=128)
    assert cfg.states["exp_avg_sq"] == StateConfig(bits=4, map="power-1", signed=False, scale="rank1")


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_default_nb(bits):
    cfg = load_config(REPO / "configs" / f"default_{bits}b.yml")
    base = load_config(REPO / "configs" / "default.yml")
    assert cfg.states["exp_avg"] == dataclasses.replace(base.states["exp_avg"], bits=bits)
    assert cfg.states["exp_avg_sq"] == dataclasses.replace(base.states["exp_avg_sq"], bits=bits)


@pytest.mark.parametrize("group", [256, 512, 1024, 2048, 4096])
def test_1st_moment_group(group):
    cfg = load_config(REPO / "configs" / f"1st_moment_group_{group}.yml")
    assert cfg.states["exp_avg"].group_size == group and cfg.states["exp_avg"].scale == "group"
    assert cfg.states["exp_avg_sq"].scale == "rank1"


def test_2nd_moment_only():
    a = load_config(REPO / "configs" / "2nd_moment_only_default.yml")
    assert not a.states["exp_avg"].enable and a.states["exp_avg_sq"].scale == "rank1"
    b = load_config(REPO / "configs" / "2nd_moment_only_group_128.yml")
    assert not b.states["exp_avg"].enable and b.states["exp_avg_sq"].scale == "group"
    assert b.states["exp_avg_sq"].group_size == 128


def test_8bit_and_fp32():
    e = load_config(REPO / "configs" / "8bit.yml")
    assert e.states["exp_avg"] == StateConfig(bits=8, map="nonlinear", signed=True, scale="group", group_size=256)
    assert e.states["exp_avg_sq"] == StateConfig(bits=8, map="nonlinear", signed=False, scale="group", group_size=256)
    f = load_config(REPO / "configs" / "fp32.yml")
    assert all(not s.enable for s in f.states.values())
    assert all(c is None for c in resolve_plan(f, "w", (1 << 20,)).codecs.values())


def test_state_codec():
    assert StateConfig().codec() == Codec(bits=4, map="nonlinear", signed=True, scale="group", group_size=128)
    assert DEFAULT_STATES["exp_avg_sq"].codec() == Codec(4, "power-1", False, "group", 128, "nearest")


# -- base merging --------------------------------------------------------------------------------
def test_base_merge_order_and_override_concat(tmp_path):
    write(tmp_path / "a.yml", """
min_numel: 10
states:
  exp_avg: {bits: 8, group_size: 64}
overrides:
  - {match: "a*", enable: false}
""")
    write(tmp_path / "b.yml", """
min_numel: 20
states:
  exp_avg: {bits: 6}
  exp_avg_sq: {scale: rank1}
overrides:
  - {match: "b*", enable: false}
""")
    top = write(tmp_path / "top.yml", """
base: [a.yml, b.yml]
states:
  exp_avg_sq: {bits: 5}
overrides:
  - {match: "t*", enable: true}
""")
    cfg = load_config(top)
    assert cfg.min_numel == 20                                  # later base wins
    assert cfg.states["exp_avg"].bits == 6                      # b over a
    assert cfg.states["exp_avg"].group_size == 64               # deep merge keeps a's other keys
    assert cfg.states["exp_avg_sq"].scale == "rank1" and cfg.states["exp_avg_sq"].bits == 5
    assert [o.match for o in cfg.overrides] == ["a*", "b*", "t*"]   # base-first concatenation
    assert cfg.source == str(top)


def test_file_wins_over_base(tmp_path):
    write(tmp_path / "base.yml", "min_numel: 1\nweights: {rounding: stochastic, compensation: kahan}\n")
    top = write(tmp_path / "top.yml", "base: base.yml\nmin_numel: 2\nweights: {compensation: none}\n")
    cfg = load_config(top)
    assert cfg.min_numel == 2
    assert cfg.weights == WeightsConfig(rounding="stochastic", compensation="none")


def test_base_relative_to_file_and_nested(tmp_path):
    write(tmp_path / "x" / "deep" / "root.yml", "states: {exp_avg: {bits: 3}}\n")
    write(tmp_path / "x" / "mid.yml", "base: deep/root.yml\nstates: {exp_avg: {group_size: 32}}\n")
    top = write(tmp_path / "y" / "top.yml", "base: ../x/mid.yml\n")
    cfg = load_config(top)
    assert cfg.states["exp_avg"].bits == 3 and cfg.states["exp_avg"].group_size == 32


def test_diamond_bases(tmp_path):
    write(tmp_path / "d.yml", "states: {exp_avg: {bits: 2}}\n")
    write(tmp_path / "b.yml", "base: d.yml\nmin_numel: 5\n")
    write(tmp_path / "c.yml", "base: d.yml\nstates: {exp_avg_sq: {bits: 3}}\n")
    cfg = load_config(write(tmp_path / "a.yml", "base: [b.yml, c.yml]\n"))
    assert cfg.states["exp_avg"].bits == 2 and cfg.states["exp_avg_sq"].bits == 3 and cfg.min_numel == 5


def test_dict_base_relative_to_cwd_or_base_dir(tmp_path, monkeypatch):
    write(tmp_path / "cfg" / "b.yml", "min_numel: 77\n")
    assert load_config({"base": "b.yml"}, base_dir=tmp_path / "cfg").min_numel == 77
    monkeypatch.chdir(tmp_path)
    assert load_config({"base": ["cfg/b.yml"], "states": {"exp_avg": {"bits": 8}}}).min_numel == 77


def test_shipped_base_configs_resolve():
    a = load_config(REPO / "configs" / "2nd_moment_only_default.yml")
    d = load_config(REPO / "configs" / "default.yml")
    assert a.states["exp_avg_sq"] == d.states["exp_avg_sq"]
    assert a.states["exp_avg"] == dataclasses.replace(d.states["exp_avg"], enable=False)


def test_base_cycle(tmp_path):
    write(tmp_path / "a.yml", "base: b.yml\n")
    write(tmp_path / "b.yml", "base: a.yml\n")
    with pytest.raises(QConfigError) as e:
        load_config(tmp_path / "a.yml")
    assert "a.yml -> b.yml -> a.yml" in str(e.value)
    assert e.value.problems[0].key_path == "base"


def test_self_cycle(tmp_path):
    write(tmp_path / "s.yml", "base: [s.yml]\n")
    with pytest.raises(QConfigError, match=r"base\[0\]: base cycle: s.yml -> s.yml"):
        load_config(tmp_path / "s.yml")


def test_missing_base(tmp_path):
    top = write(tmp_path / "top.yml", "base: [nope/missing.yml]\n")
    with pytest.raises(QConfigError) as e:
        load_config(top)
    msg = str(e.value)
    assert str(top) in msg and "missing.yml" in msg and "does not exist" in msg and "base[0]" in msg


def test_missing_file(tmp_path):
    with pytest.raises(QConfigError, match="not found"):
        load_config(tmp_path / "nope.yml")


def test_problem_in_base_names_base_file(tmp_path):
    write(tmp_path / "b.yml", "states: {exp_avg: {bits: 12}}\n")
    top = write(tmp_path / "t.yml", "base: b.yml\nstates: {exp_avg_sq: {bitz: 4}}\n")
    with pytest.raises(QConfigError) as e:
        load_config(top)
    files = {p.file for p in e.value.problems}
    assert files == {str(tmp_path / "b.yml"), str(top)}


def test_cross_file_override_problem_points_at_its_file(tmp_path):
    # exp_avg uses a signed linear map in the top file; the override (in the base) sets bits 1
    write(tmp_path / "b.yml", "overrides:\n  - {match: x, enable: true}\n  - {match: y, states: {exp_avg: {bits: 1}}}\n")
    top = write(tmp_path / "t.yml", "base: b.yml\nstates: {exp_avg: {map: linear}}\n")
    with pytest.raises(QConfigError) as e:
        load_config(top)
    (p,) = e.value.problems
    assert p.file == str(tmp_path / "b.yml") and p.key_path == "overrides[1].states.exp_avg"


# -- direct construction -----------------------------------------------------------------------------
def test_direct_construction():
    cfg = QConfig(states={"exp_avg": {"bits": 8}}, weights={"rounding": "stochastic"},
                  overrides=[{"match": "*.bias", "enable": False}])
    assert cfg.states["exp_avg"] == StateConfig(bits=8)
    assert cfg.states["exp_avg_sq"] == DEFAULT_STATES["exp_avg_sq"]     # missing state filled
    assert cfg.weights == WeightsConfig(rounding="stochastic")
    assert cfg.overrides == (Override(match="*.bias", enable=False),)
    assert cfg == load_config(cfg.to_dict())


@pytest.mark.parametrize("make", [
    lambda: StateConfig(bits=9),
    lambda: StateConfig(bits=True),
    lambda: StateConfig(map="dynamic"),
    lambda: StateConfig(map="linear", bits=1),
    lambda: WeightsConfig(compensation="kahn"),
    lambda: Override(enable=False),
    lambda: Override(match="x"),
    lambda: QConfig(version=2),
    lambda: QConfig(states={"m": StateConfig()}),
    lambda: QConfig(states={"exp_avg": {"bits": 0}}),
    lambda: QConfig(overrides=[{"match": "re:("}]),
])
def test_direct_construction_validates(make):
    with pytest.raises(QConfigError):
        make()
