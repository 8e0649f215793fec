"""lpmm's upper-case config format loads unchanged and means the same as the native configs."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from qconf.config import QConfig, StateConfig, load_config, resolve_plan
from qconf.errors import QConfigError, QConfigWarning

REPO = Path(__file__).resolve().parents[1]
TWINS = sorted((REPO / "tests" / "fixtures" / "lpmm").glob("*.yml"))
LPMM_SHIPPED = ["default.yml", "2nd_moment_group_128.yml", "default_5b.yml", "default_6b.yml", "default_7b.yml",
                "default_8b.yml", "1st_moment_group_256.yml", "1st_moment_group_512.yml", "1st_moment_group_1024.yml",
                "1st_moment_group_2048.yml", "1st_moment_group_4096.yml", "2nd_moment_only_default.yml",
                "2nd_moment_only_group_128.yml"]
SHAPES = [(), (1,), (4096,), (4097,), (8192,), (64, 64), (64, 65), (1000, 1000), (4096, 1024), (3, 4, 500),
          (2, 3, 4, 200)]
NAMES = ["w", "layers.0.attn.weight", "bias"]

# lpmm's whole _C tree, as yacs would dump it (every key, every default).
LPMM_C_DEFAULTS = """\
BASE: ['']
DEBUG:
  TRUNCATED_SHAPE: false
INIT_STATES: []
LOCAL_RANK: 0
OUTPUT: .
TAG: default
TRAIN:
  EPOCHS: 1
QUANT:
  P:
    ENABLE: False
    THRESHOLD: 4096
    BITS: 8
    GROUP_SIZE: 64
    SCALE_TYPE: {DEFAULT: group, DEFAULT_ONLY: True}
    QUANT_TYPE: {DEFAULT: linear, DEFAULT_ONLY: True}
    ROUND_TYPE: sr
    SIGNED: True
  G:
    ENABLE: False
    THRESHOLD: 4096
  M:
    ENABLE: True
    THRESHOLD: 4096
    EXCLUDE_SUFFIX: ['']
    EXCLUDE_REGEX: ['']
    BITS: 4
    GROUP_SIZE: 128
    SCALE_TYPE: {DEFAULT: group, DEFAULT_ONLY: True}
    QUANT_TYPE: {DEFAULT: nonlinear, DEFAULT_ONLY: True}
    ROUND_TYPE: real-nearest
    SIGNED: True
  SQM:
    ENABLE: True
    THRESHOLD: 4096
    EXCLUDE_SUFFIX: ['']
    EXCLUDE_REGEX: ['']
    BITS: 4
    GROUP_SIZE: 128
    SCALE_TYPE: {DEFAULT: group, DEFAULT_ONLY: True}
    QUANT_TYPE: {DEFAULT: power-1, DEFAULT_ONLY: True}
    ROUND_TYPE: real-nearest
    SIGNED: False
"""


def load_quiet(src):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the twins use only keys lpmm reads: no warning expected
        return load_config(src)


def test_every_lpmm_file_has_a_twin():
    names = {p.name for p in TWINS}
    assert set(LPMM_SHIPPED) <= names
    for name in names:
        assert (REPO / "configs" / name).exists(), name


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.name)
def test_twin_equals_native(twin):
    lp = load_quiet(twin)
    native = load_quiet(REPO / "configs" / twin.name)
    assert lp == native
    for name in NAMES:
        for shape in SHAPES:
            assert resolve_plan(lp, name, shape) == resolve_plan(native, name, shape), (name, shape)


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.name)
def test_twin_round_trips_natively(twin):
    cfg = load_quiet(twin)
    assert load_config(cfg.to_dict()) == cfg


def test_lpmm_C_tree_equals_defaults():
    import yaml
    with pytest.warns(QConfigWarning) as record:
        cfg = load_config(yaml.safe_load(LPMM_C_DEFAULTS))
    # THRESHOLD is per section in lpmm; the same 4096 as the top-level default
    expected = QConfig(states={"exp_avg": StateConfig(min_numel=4096),
                               "exp_avg_sq": StateConfig(signed=False, map="power-1", min_numel=4096)})
    assert cfg == expected
    for shape in SHAPES:
        assert resolve_plan(cfg, "w", shape) == resolve_plan(QConfig(), "w", shape)
    assert len(record) == 1


def test_one_warning_per_file_naming_every_ignored_key(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text(LPMM_C_DEFAULTS)
    with pytest.warns(QConfigWarning) as record:
        load_config(path)
    assert len(record) == 1
    message = str(record[0].message)
    assert str(path) in message
    for key in ["DEBUG", "INIT_STATES", "LOCAL_RANK", "OUTPUT", "TAG", "TRAIN", "QUANT.P", "QUANT.G",
                "QUANT.M.EXCLUDE_SUFFIX", "QUANT.M.EXCLUDE_REGEX", "QUANT.M.SCALE_TYPE.DEFAULT_ONLY",
                "QUANT.M.QUANT_TYPE.DEFAULT_ONLY", "QUANT.SQM.EXCLUDE_SUFFIX", "QUANT.SQM.QUANT_TYPE.DEFAULT_ONLY"]:
        assert key in message, key


def test_warning_per_file_in_base_chain(tmp_path):
    (tmp_path / "b.yml").write_text("QUANT:\n  P: {BITS: 8}\n")
    (tmp_path / "t.yml").write_text("BASE: [b.yml]\nDEBUG: {X: 1}\nQUANT:\n  M: {BITS: 8}\n")
    with pytest.warns(QConfigWarning) as record:
        cfg = load_config(tmp_path / "t.yml")
    assert cfg.states["exp_avg"].bits == 8
    messages = sorted(str(r.message) for r in record)
    assert len(messages) == 2
    assert any("b.yml" in m and "QUANT.P" in m for m in messages)
    assert any("t.yml" in m and "DEBUG" in m for m in messages)


def test_empty_lpmm_documents_are_defaults():
    assert load_quiet({"BASE": [""]}) == QConfig()
    assert load_quiet({"QUANT": None}) == QConfig()
    assert load_quiet({"QUANT": {"M": None, "SQM": {}}}) == QConfig()


@pytest.mark.parametrize("lpmm,native", [
    ("real-nearest", "nearest"), ("nearest", "nearest"), ("real-sr", "stochastic"), ("sr", "stochastic")])
def test_round_type(lpmm, native):
    cfg = load_quiet({"QUANT": {"SQM": {"ROUND_TYPE": lpmm}}})
    assert cfg.states["exp_avg_sq"].rounding == native
    assert cfg.states["exp_avg"].rounding == "nearest"


@pytest.mark.parametrize("scale", ["tensor", "dim0", "dim1", "group", "rank1"])
def test_scale_types(scale):
    assert load_quiet({"QUANT": {"M": {"SCALE_TYPE": {"DEFAULT": scale}}}}).states["exp_avg"].scale == scale


@pytest.mark.parametrize("qmap", ["linear", "nonlinear", "nonlinear-nozero", "power-1", "power-2", "power-3",
                                  "float-point"])
def test_quant_types(qmap):
    assert load_quiet({"QUANT": {"SQM": {"QUANT_TYPE": {"DEFAULT": qmap}}}}).states["exp_avg_sq"].map == qmap


def test_threshold():
    cfg = load_quiet({"QUANT": {"M": {"THRESHOLD": 100}, "SQM": {"THRESHOLD": None}}})
    assert cfg.states["exp_avg"].min_numel == 100
    assert cfg.states["exp_avg_sq"].min_numel == 0           # yacs null: no threshold
    plan = resolve_plan(cfg, "w", (100,))
    assert plan.codec("exp_avg") is None and plan.codec("exp_avg_sq") is not None
    assert resolve_plan(cfg, "w", (101,)).codec("exp_avg") is not None
    assert resolve_plan(cfg, "w", (1,)).codec("exp_avg_sq") is not None


def test_enable_and_signed():
    cfg = load_quiet({"QUANT": {"M": {"ENABLE": False, "SIGNED": False}, "SQM": {"SIGNED": True}}})
    assert not cfg.states["exp_avg"].enable and not cfg.states["exp_avg"].signed
    assert cfg.states["exp_avg_sq"].signed
    assert resolve_plan(cfg, "w", (10**6,)).codec("exp_avg") is None


def test_lpmm_base_merges_like_lpmm(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.yml").write_text(
        "QUANT:\n  M: {BITS: 8, GROUP_SIZE: 64}\n  SQM:\n    SCALE_TYPE: {DEFAULT: rank1}\n")
    (tmp_path / "top.yml").write_text("BASE: ['', sub/base.yml]\nQUANT:\n  M: {BITS: 6}\n")
    cfg = load_quiet(tmp_path / "top.yml")
    assert cfg.states["exp_avg"].bits == 6 and cfg.states["exp_avg"].group_size == 64
    assert cfg.states["exp_avg_sq"].scale == "rank1"


def test_formats_mix_across_files(tmp_path):
    (tmp_path / "native.yml").write_text("min_numel: 10\nstates: {exp_avg: {bits: 8}}\n")
    (tmp_path / "lpmm.yml").write_text("BASE: [native.yml]\nQUANT:\n  SQM: {BITS: 5}\n")
    (tmp_path / "top.yml").write_text("base: lpmm.yml\nstates: {exp_avg_sq: {scale: rank1}}\n")
    cfg = load_quiet(tmp_path / "top.yml")
    assert cfg.min_numel == 10 and cfg.states["exp_avg"].bits == 8
    assert cfg.states["exp_avg_sq"].bits == 5 and cfg.states["exp_avg_sq"].scale == "rank1"


def test_lpmm_cycle(tmp_path):
    (tmp_path / "a.yml").write_text("BASE: [b.yml]\n")
    (tmp_path / "b.yml").write_text("BASE: ['', a.yml]\n")
    with pytest.raises(QConfigError) as e:
        load_config(tmp_path / "a.yml")
    assert "a.yml -> b.yml -> a.yml" in str(e.value)
    assert e.value.problems[0].key_path == "BASE[1]"


def test_unsupported_values_name_allowed():
    with pytest.raises(QConfigError) as e:
        load_config({"QUANT": {"M": {"SCALE_TYPE": {"DEFAULT": "dim10"}, "ROUND_TYPE": "sr2"},
                               "SQM": {"ROUND_TYPE": "up"}}})
    lines = str(e.value).splitlines()
    assert len(lines) == 3
    assert "QUANT.M.SCALE_TYPE.DEFAULT: lpmm scale type 'dim10' is not supported" in lines[0]
    assert "simulation mode" in lines[1] and "allowed: real-nearest, nearest, real-sr, sr" in lines[1]
    assert lines[2].startswith("<dict>: QUANT.SQM.ROUND_TYPE:")


def test_mixed_formats_in_one_file(tmp_path):
    path = tmp_path / "m.yml"
    path.write_text("QUANT:\n  M: {BITS: 4}\nmin_numel: 3\n")
    with pytest.raises(QConfigError, match="mixes lpmm upper-case keys"):
        load_config(path)
