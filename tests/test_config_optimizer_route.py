"""The overrides' ``optimizer`` action (read by qconf.optim.Muon): validation, QConfig.optimizer_route,
serialization."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from qconf.config import Override, QConfig, load_config, resolve_plan
from qconf.config.rules import OVERRIDE_ACTIONS, OPTIMIZER_ROUTES
from qconf.errors import QConfigError

REPO = Path(__file__).resolve().parents[1]


def test_schema_names():
    assert "optimizer" in OVERRIDE_ACTIONS and OPTIMIZER_ROUTES == ("muon", "adamw")


@pytest.mark.parametrize("value", ["muon", "adamw"])
def test_valid_values_load(value, tmp_path):
    cfg = load_config({"overrides": [{"match": "w", "optimizer": value}]})
    assert cfg.overrides == (Override(match="w", optimizer=value),)
    path = tmp_path / "c.yml"
    path.write_text(f"overrides:\n  - {{ndim: 2, optimizer: {value}}}\n")
    assert load_config(path).overrides[0].optimizer == value


def test_only_optimizer_is_an_action():
    """An override whose only action is ``optimizer`` is valid; without any action it is not."""
    ov = Override(ndim=2, optimizer="muon")
    assert ov.to_dict() == {"ndim": 2, "optimizer": "muon"}
    with pytest.raises(QConfigError, match="no action"):
        Override(ndim=2)
    with pytest.raises(QConfigError, match="no action"):
        load_config({"overrides": [{"ndim": 2, "optimizer": None}]})   # null = not given


def test_null_is_not_given():
    cfg = load_config({"overrides": [{"match": "w", "enable": False, "optimizer": None}]})
    assert cfg.overrides[0].optimizer is None and "optimizer" not in cfg.to_dict()["overrides"][0]


@pytest.mark.parametrize("value,message", [
    ("sgd", "'sgd' is not a valid update rule for qconf.optim.Muon"),
    ("Muon", "'Muon' is not a valid update rule for qconf.optim.Muon"),
    (3, "3 is not a string"),
    (True, "true is not a string"),
    (["muon"], "is not a string"),
])
def test_bad_value(value, message):
    with pytest.raises(QConfigError) as info:
        load_config({"overrides": [{"match": "w", "enable": False}, {"match": "w", "optimizer": value}]})
    [problem] = info.value.problems
    assert problem.key_path == "overrides[1].optimizer" and problem.file == "<dict>"
    assert problem.allowed == "muon, adamw"
    text = str(info.value)
    assert "overrides[1].optimizer" in text and message in text and "(allowed: muon, adamw)" in text


def test_bad_value_in_file_and_did_you_mean(tmp_path):
    path = tmp_path / "bad.yml"
    path.write_text("overrides:\n  - {match: w, optimizer: adamW}\n")
    with pytest.raises(QConfigError) as info:
        load_config(path)
    [problem] = info.value.problems
    assert problem.file == str(path) and problem.key_path == "overrides[0].optimizer"
    assert "did you mean 'adamw'?" in str(info.value)


@pytest.mark.parametrize("value", ["sgd", 3, True])
def test_bad_value_direct_construction(value):
    with pytest.raises(QConfigError, match=re.escape("optimizer: ") + ".*" + re.escape("(allowed: muon, adamw)")):
        Override(match="w", optimizer=value)
    with pytest.raises(QConfigError, match=re.escape("overrides[0].optimizer")):
        QConfig(overrides=[{"match": "w", "optimizer": value}])


def test_unknown_key_suggests_optimizer():
    with pytest.raises(QConfigError, match="did you mean 'optimizer'"):
        load_config({"overrides": [{"match": "w", "optimiser": "muon"}]})


def test_optimizer_route():
    cfg = load_config({"overrides": [
        {"ndim": 2, "optimizer": "muon"},
        {"match": "*embed*", "optimizer": "adamw"},
        {"match": "*embed*", "enable": False},                  # matches, sets no optimizer: no effect
        {"match": "layers.0.*", "ndim": 2, "max_numel": 100, "optimizer": "adamw"},
        {"match": "layers.0.big", "min_numel": 10**6, "optimizer": "muon"},
        {"ndim": 1, "optimizer": "adamw"},
    ]})
    assert cfg.optimizer_route("layers.1.attn.weight", (64, 64)) == "muon"
    assert cfg.optimizer_route("tok_embed.weight", (1000, 64)) == "adamw"      # later wins
    assert cfg.optimizer_route("layers.0.small", (8, 8)) == "adamw"              # ndim and max_numel hold
    assert cfg.optimizer_route("layers.0.wide", (8, 100)) == "muon"              # max_numel fails
    assert cfg.optimizer_route("layers.0.wide", [8, 100]) == "muon"              # any sequence
    assert cfg.optimizer_route("layers.0.big", (10, 100)) == "muon"              # min_numel fails
    assert cfg.optimizer_route("layers.0.big", (1000, 1000)) == "muon"           # min_numel holds
    assert cfg.optimizer_route("layers.0.norm", (64,)) == "adamw"
    assert cfg.optimizer_route("x", ()) is None                                  # nothing matches
    assert cfg.optimizer_route("x", (2, 2, 2)) is None
    assert load_config({}).optimizer_route("w", (64, 64)) is None
    assert load_config({"overrides": [{"match": "w", "enable": False}]}).optimizer_route("w", (4, 4)) is None


def test_optimizer_route_torch_shape():
    torch = pytest.importorskip("torch")
    cfg = load_config({"overrides": [{"ndim": 2, "optimizer": "muon"}]})
    assert cfg.optimizer_route("w", torch.zeros(3, 4).shape) == "muon"
    assert cfg.optimizer_route("b", torch.zeros(3).shape) is None


def test_optimizer_route_checks_arguments():
    cfg = load_config({"overrides": [{"ndim": 2, "optimizer": "muon"}]})
    with pytest.raises(TypeError, match="parameter name must be a string"):
        cfg.optimizer_route(3, (2, 2))
    for bad in [(2, -1), (2.0, 2), 5, (True, 2)]:
        with pytest.raises(ValueError, match="shape must be"):
            cfg.optimizer_route("w", bad)


def test_optimizer_does_not_change_the_plan():
    base = load_config({"min_numel": 0})
    routed = load_config({"min_numel": 0, "overrides": [{"match": "*", "optimizer": "muon"}]})
    for name, shape in [("w", (64, 64)), ("b", (64,)), ("s", ())]:
        assert resolve_plan(routed, name, shape) == resolve_plan(base, name, shape)


def test_round_trip():
    cfg = load_config({"overrides": [
        {"match": "*.bias", "enable": False},
        {"ndim": 2, "optimizer": "muon"},
        {"match": "embed*", "states": {"exp_avg_sq": {"bits": 8}}, "optimizer": "adamw"},
    ]})
    d = cfg.to_dict()
    assert d["overrides"] == [{"match": "*.bias", "enable": False}, {"ndim": 2, "optimizer": "muon"},
                              {"match": "embed*", "states": {"exp_avg_sq": {"bits": 8}}, "optimizer": "adamw"}]
    assert load_config(d) == cfg and load_config(d).to_dict() == d
    assert load_config(yaml.safe_load(cfg.to_yaml())) == cfg
    assert cfg != load_config({"overrides": [{"match": "*.bias", "enable": False}, {"ndim": 2, "optimizer": "adamw"},
                                             d["overrides"][2]]})
    assert hash(cfg) == hash(load_config(d))


def test_configs_without_it_serialize_unchanged():
    """No override that leaves ``optimizer`` unset shows the key, so existing dumps do not change."""
    for path in sorted((REPO / "configs").glob("*.yml")):
        assert "optimizer" not in load_config(path).to_yaml()
    d = load_config({"overrides": [{"match": "*.bias", "enable": False},
                                   {"ndim": 1, "weights": {"rounding": "stochastic"}}]}).to_dict()
    assert d["overrides"] == [{"match": "*.bias", "enable": False}, {"ndim": 1, "weights": {"rounding": "stochastic"}}]


def test_base_chain_later_wins(tmp_path):
    (tmp_path / "base.yml").write_text("overrides:\n  - {ndim: 2, optimizer: muon}\n")
    top = tmp_path / "top.yml"
    top.write_text("base: base.yml\noverrides:\n  - {match: head.weight, optimizer: adamw}\n")
    cfg = load_config(top)
    assert cfg.optimizer_route("head.weight", (10, 64)) == "adamw"
    assert cfg.optimizer_route("layers.0.w", (64, 64)) == "muon"


def test_docs_example_loads():
    """The ``optimizer`` example in docs/config.md is a valid config that routes as its comments say."""
    text = (REPO / "docs" / "config.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "optimizer:" in b]
    assert blocks
    cfg = load_config(yaml.safe_load(blocks[0]))
    assert cfg.optimizer_route("model.embed.weight", (1000, 64)) == "adamw"
    assert cfg.optimizer_route("layers.3.mlp.fc1.weight", (256, 64)) == "muon"
    assert cfg.optimizer_route("layers.3.mlp.fc1.bias", (256,)) is None


@pytest.mark.parametrize("value", [None, True, 0, -1, 1.5, "", "x", [], [1], {}, {"a": 1}, 10**30])
def test_odd_values_never_crash(value):
    try:
        cfg = load_config({"overrides": [{"match": "w", "enable": False, "optimizer": value}]})
    except QConfigError as e:
        assert [p.key_path for p in e.problems] == ["overrides[0].optimizer"]
    else:
        assert value is None and cfg.optimizer_route("w", (2, 2)) is None
