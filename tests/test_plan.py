"""Per-parameter resolution (StatePlan): threshold, per-state min_numel, overrides, forcing, bytes."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from qconf.codec import Codec
from qconf.config import STATE_NAMES, QConfig, StatePlan, WeightsConfig, load_config, resolve_plan
from qconf.errors import QConfigError

REPO = Path(__file__).resolve().parents[1]
DEFAULT = load_config(REPO / "configs" / "default.yml")


def quantized(plan: StatePlan) -> dict[str, bool]:
    return {s: plan.codec(s) is not None for s in STATE_NAMES}


def test_plan_fields():
    plan = resolve_plan(DEFAULT, "layers.0.w", [64, 128])
    assert plan.name == "layers.0.w" and plan.shape == (64, 128) and plan.numel == 8192
    assert set(plan.codecs) == set(STATE_NAMES)
    assert plan.codec("exp_avg") == Codec(4, "nonlinear", True, "group", 128, "nearest")
    assert plan.codec("exp_avg_sq") == Codec(4, "power-1", False, "rank1", 128, "nearest")
    assert plan.weights == WeightsConfig()
    with pytest.raises(ValueError, match="unknown state"):
        plan.codec("momentum")


@pytest.mark.parametrize("shape,expect", [
    ((4096,), False), ((64, 64), False), ((4097,), True), ((4097, 1), True), ((1,), False), ((), False)])
def test_strict_threshold(shape, expect):
    plan = resolve_plan(load_config({}), "w", shape)
    assert quantized(plan) == {"exp_avg": expect, "exp_avg_sq": expect}


def test_top_level_min_numel():
    cfg = load_config({"min_numel": 0})
    assert all(quantized(resolve_plan(cfg, "w", (1,))).values())
    assert not any(quantized(resolve_plan(cfg, "w", (0,))).values())
    cfg = load_config({"min_numel": 10**9})
    assert not any(quantized(resolve_plan(cfg, "w", (4096, 4096))).values())


def test_per_state_min_numel():
    cfg = load_config({"min_numel": 100, "states": {"exp_avg_sq": {"min_numel": 1000}}})
    assert quantized(resolve_plan(cfg, "w", (500,))) == {"exp_avg": True, "exp_avg_sq": False}
    assert quantized(resolve_plan(cfg, "w", (1000,))) == {"exp_avg": True, "exp_avg_sq": False}
    assert quantized(resolve_plan(cfg, "w", (1001,))) == {"exp_avg": True, "exp_avg_sq": True}
    assert quantized(resolve_plan(cfg, "w", (100,))) == {"exp_avg": False, "exp_avg_sq": False}
    cfg = load_config({"states": {"exp_avg": {"min_numel": 0}}})       # 0 = no threshold
    assert quantized(resolve_plan(cfg, "w", (1,))) == {"exp_avg": True, "exp_avg_sq": False}


def test_enable_false():
    cfg = load_config(REPO / "configs" / "2nd_moment_only_default.yml")
    assert quantized(resolve_plan(cfg, "w", (10**6,))) == {"exp_avg": False, "exp_avg_sq": True}


def test_override_by_glob():
    cfg = load_config({"overrides": [{"match": "*.bias", "enable": False}]})
    assert not any(quantized(resolve_plan(cfg, "layers.0.attn.bias", (8192,))).values())
    assert all(quantized(resolve_plan(cfg, "layers.0.attn.weight", (8192,))).values())
    assert all(quantized(resolve_plan(cfg, "bias", (8192,))).values())            # '*.bias' needs the dot
    assert all(quantized(resolve_plan(cfg, "layers.0.attn.BIAS", (8192,))).values())  # case-sensitive


def test_glob_star_crosses_dots_and_brackets():
    cfg = load_config({"overrides": [{"match": "layers.[0-2].*", "enable": False},
                                     {"match": "layers.?.mlp.*", "states": {"exp_avg": {"bits": 8}}}]})
    assert not any(quantized(resolve_plan(cfg, "layers.1.attn.qkv.weight", (8192,))).values())
    assert all(quantized(resolve_plan(cfg, "layers.3.attn.qkv.weight", (8192,))).values())
    assert resolve_plan(cfg, "layers.5.mlp.fc1.weight", (8192,)).codec("exp_avg").bits == 8
    assert resolve_plan(cfg, "layers.15.mlp.fc1.weight", (8192,)).codec("exp_avg").bits == 4


def test_override_by_regex_fullmatch():
    cfg = load_config({"overrides": [{"match": r"re:layers\.\d+\.norm\d?\.weight", "enable": False}]})
    assert not any(quantized(resolve_plan(cfg, "layers.12.norm2.weight", (8192,))).values())
    assert all(quantized(resolve_plan(cfg, "layers.12.norm2.weight_extra", (8192,))).values())   # fullmatch
    assert all(quantized(resolve_plan(cfg, "x.layers.1.norm.weight", (8192,))).values())


def test_override_by_ndim():
    cfg = load_config({"overrides": [{"ndim": 1, "enable": False}]})
    assert not any(quantized(resolve_plan(cfg, "w", (10**5,))).values())
    assert all(quantized(resolve_plan(cfg, "w", (100, 1000))).values())


def test_override_by_numel_bounds_inclusive():
    cfg = load_config({"min_numel": 0, "overrides": [{"min_numel": 10, "max_numel": 20, "enable": False}]})
    assert all(quantized(resolve_plan(cfg, "w", (9,))).values())
    assert not any(quantized(resolve_plan(cfg, "w", (10,))).values())
    assert not any(quantized(resolve_plan(cfg, "w", (4, 5))).values())
    assert not any(quantized(resolve_plan(cfg, "w", (20,))).values())
    assert all(quantized(resolve_plan(cfg, "w", (21,))).values())


def test_all_selectors_must_hold():
    cfg = load_config({"overrides": [{"match": "*.weight", "ndim": 2, "max_numel": 10**5, "enable": False}]})
    assert not any(quantized(resolve_plan(cfg, "a.weight", (100, 100))).values())
    assert all(quantized(resolve_plan(cfg, "a.weight", (1000, 1000))).values())   # too big
    assert all(quantized(resolve_plan(cfg, "a.weight", (10**4,))).values())       # wrong ndim
    assert all(quantized(resolve_plan(cfg, "a.bias", (100, 100))).values())       # wrong name


def test_overrides_in_order_later_wins():
    ovs = [{"match": "*", "enable": False}, {"match": "head.*", "enable": True},
           {"match": "*", "states": {"exp_avg": {"bits": 8}}}, {"match": "head.*", "states": {"exp_avg": {"bits": 6}}}]
    cfg = load_config({"overrides": ovs})
    head, body = resolve_plan(cfg, "head.weight", (10**5,)), resolve_plan(cfg, "body.weight", (10**5,))
    assert not any(quantized(body).values())
    assert all(quantized(head).values())
    assert head.codec("exp_avg").bits == 6
    cfg = load_config({"overrides": list(reversed(ovs))})
    assert not any(quantized(resolve_plan(cfg, "head.weight", (10**5,))).values())


def test_forcing_enable_true_below_threshold():
    cfg = load_config({"overrides": [{"match": "tiny", "enable": True}]})
    plan = resolve_plan(cfg, "tiny", (3,))
    assert all(quantized(plan).values())
    assert plan.codec("exp_avg") == cfg.states["exp_avg"].codec()
    # forcing also beats enable: false of a state (like lpmm override_quantize_enable(True))
    cfg = load_config({"states": {"exp_avg": {"enable": False}}, "overrides": [{"match": "tiny", "enable": True}]})
    assert quantized(resolve_plan(cfg, "tiny", (3,))) == {"exp_avg": True, "exp_avg_sq": True}
    assert quantized(resolve_plan(cfg, "other", (10**5,))) == {"exp_avg": False, "exp_avg_sq": True}


def test_per_state_enable_in_override_forces_that_state():
    cfg = load_config({"overrides": [{"match": "x", "states": {"exp_avg_sq": {"enable": True}}},
                                     {"match": "y", "states": {"exp_avg": {"enable": False}}}]})
    assert quantized(resolve_plan(cfg, "x", (10,))) == {"exp_avg": False, "exp_avg_sq": True}
    assert quantized(resolve_plan(cfg, "y", (10**5,))) == {"exp_avg": False, "exp_avg_sq": True}


def test_partial_state_override_embed_bits8():
    cfg = load_config({"base": str(REPO / "configs" / "default.yml"),
                       "overrides": [{"match": "embed*", "states": {"exp_avg_sq": {"bits": 8}}}]})
    plan = resolve_plan(cfg, "embed_tokens.weight", (50000, 512))
    assert plan.codec("exp_avg_sq") == Codec(8, "power-1", False, "rank1", 128, "nearest")   # other fields kept
    assert plan.codec("exp_avg") == DEFAULT.states["exp_avg"].codec()
    assert resolve_plan(cfg, "lm_head.weight", (50000, 512)).codec("exp_avg_sq").bits == 4
    # a partial override does not turn on a state that the threshold leaves off
    assert resolve_plan(cfg, "embed.small", (10,)).codec("exp_avg_sq") is None


def test_weights_override():
    cfg = load_config({"weights": {"rounding": "stochastic"},
                       "overrides": [{"match": "*.norm", "weights": {"compensation": "kahan"}},
                                     {"match": "a.norm", "weights": {"rounding": "nearest"}}]})
    assert resolve_plan(cfg, "w", (5,)).weights == WeightsConfig("stochastic", "none")
    assert resolve_plan(cfg, "b.norm", (5,)).weights == WeightsConfig("stochastic", "kahan")
    assert resolve_plan(cfg, "a.norm", (5,)).weights == WeightsConfig("nearest", "kahan")


@pytest.mark.parametrize("scale", ["dim0", "dim1"])
def test_zero_d_fallback(scale):
    cfg = load_config({"min_numel": 0, "states": {"exp_avg": {"scale": scale}}})
    plan = resolve_plan(cfg, "temperature", ())
    assert plan.codec("exp_avg").scale == "tensor"
    assert plan.state_nbytes("exp_avg") == Codec(4, "nonlinear", True, "tensor").nbytes(())
    assert resolve_plan(cfg, "w", (8, 8)).codec("exp_avg").scale == scale
    assert resolve_plan(cfg, "w", (64,)).codec("exp_avg").scale == scale   # the codec falls back itself for 1-D


SHAPES = [(), (1,), (7,), (4097,), (128, 33), (5000, 3), (2, 3, 4097), (10**5,)]


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yml")), ids=lambda p: p.name)
def test_state_nbytes_match_codec(config):
    cfg = load_config(config)
    for shape in SHAPES:
        plan = resolve_plan(cfg, "p", shape)
        numel = math.prod(shape)
        assert plan.fp32_nbytes() == 4 * numel
        for state in STATE_NAMES:
            codec = plan.codec(state)
            want = 4 * numel if codec is None else codec.nbytes(shape)
            assert plan.state_nbytes(state) == want
        assert plan.nbytes() == sum(plan.state_nbytes(s) for s in STATE_NAMES)


def test_4bit_group128_bytes_per_param():
    plan = resolve_plan(load_config({}), "w", (4096, 4096))
    numel = 4096 * 4096
    assert plan.state_nbytes("exp_avg") == numel // 2 + 4 * (numel // 128)
    assert plan.state_nbytes("exp_avg") / numel <= 0.53125


def test_rank1_1d_uses_state_group_size():
    cfg = load_config({"min_numel": 0, "states": {"exp_avg_sq": {"scale": "rank1", "group_size": 64}}})
    plan = resolve_plan(cfg, "b", (1000,))
    assert plan.codec("exp_avg_sq").effective_scale((1000,)) == "group"
    assert plan.codec("exp_avg_sq").num_scales((1000,)) == math.ceil(1000 / 64)
    assert plan.describe("exp_avg_sq") == "4-bit unsigned power-1 group64"


def test_describe():
    plan = resolve_plan(DEFAULT, "w", (64, 100))
    assert plan.describe("exp_avg") == "4-bit nonlinear group128"
    assert plan.describe("exp_avg_sq") == "4-bit unsigned power-1 rank1"
    assert resolve_plan(DEFAULT, "b", (3,)).describe("exp_avg") == "fp32"
    cfg = load_config({"states": {"exp_avg": {"rounding": "stochastic", "bits": 8}}})
    assert resolve_plan(cfg, "w", (10**5,)).describe("exp_avg") == "8-bit nonlinear group128 stochastic"


def test_plan_to_dict():
    d = resolve_plan(DEFAULT, "w", (64, 100)).to_dict()
    assert d["shape"] == [64, 100] and d["numel"] == 6400
    assert d["states"]["exp_avg"]["codec"]["group_size"] == 128
    assert d["fp32_nbytes"] == 2 * 4 * 6400


def test_plan_equality_and_codec_sharing():
    a, b = resolve_plan(DEFAULT, "w", (64, 100)), resolve_plan(DEFAULT, "w", (64, 100))
    assert a == b and hash(a) == hash(b)
    assert a.codec("exp_avg") is b.codec("exp_avg")    # codecs are shared, not rebuilt per parameter


@pytest.mark.parametrize("shape", [(-1,), (2.0,), "ab", 5, (True,)])
def test_bad_shape(shape):
    with pytest.raises(ValueError):
        resolve_plan(DEFAULT, "w", shape)


def test_invalid_combination_across_overrides_is_a_qconfig_error():
    # each override is valid with the base section, together they make signed 1-bit linear
    cfg = QConfig(states={"exp_avg": {"bits": 1, "signed": False}},
                  overrides=[{"match": "a*", "states": {"exp_avg": {"map": "linear"}}},
                             {"match": "*b", "states": {"exp_avg": {"signed": True}}}])
    assert resolve_plan(cfg, "ax", (10**5,)).codec("exp_avg").map == "linear"
    with pytest.raises(QConfigError, match="'ab'"):
        resolve_plan(cfg, "ab", (10**5,))


def test_force_enable_runtime_override_applies_last():
    cfg = load_config({"overrides": [{"match": "small", "enable": True}, {"match": "big", "enable": False}]})
    assert not any(quantized(resolve_plan(cfg, "small", (3,), force_enable=False)).values())
    assert all(quantized(resolve_plan(cfg, "big", (10**5,), force_enable=True)).values())
    assert all(quantized(resolve_plan(cfg, "x", (3,), force_enable=True)).values())
    assert resolve_plan(cfg, "x", (10**5,), force_enable=None) == resolve_plan(cfg, "x", (10**5,))
    fp32 = load_config(REPO / "configs" / "fp32.yml")
    assert all(quantized(resolve_plan(fp32, "w", (10,), force_enable=True)).values())
    with pytest.raises(TypeError):
        resolve_plan(cfg, "x", (3,), force_enable=1)
