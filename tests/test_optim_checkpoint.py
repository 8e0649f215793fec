"""Checkpoints: plain-data state dicts, bit-exact resume, conversion to/from torch.optim, and bad
checkpoints that must leave the optimizer untouched."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from qconf.codec import QTensor
from qconf.optim import SGD, Adam, AdamW, Lion, export_torch_state_dict

from helpers import CONFIGS, assert_rel_close, assert_same_state, flat_state, mlp, train_steps

DEFAULT = CONFIGS / "default.yml"
SR_CFG = {"states": {"exp_avg": {"rounding": "stochastic"}, "exp_avg_sq": {"rounding": "stochastic",
                                                                        "map": "power-1", "signed": False}}}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=3e-3, qconfig=DEFAULT, fused=False, seed=1),
    lambda ps: AdamW(ps, lr=3e-3, qconfig=SR_CFG, fused=False, seed=1),
    lambda ps: AdamW(ps, lr=3e-3, qconfig=CONFIGS / "8bit.yml", factor_second_moment=True, fused=False, seed=1),
    lambda ps: Adam(ps, lr=3e-3, qconfig=CONFIGS / "default_5b.yml", fused=False, seed=1),
    lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, qconfig=DEFAULT, fused=False, seed=1),
    lambda ps: Lion(ps, lr=3e-4, qconfig=SR_CFG, fused=False, seed=1),
])
def test_save_load_continue_is_bit_exact(make):
    ref_model = mlp(3)
    ref = make(ref_model.parameters())
    train_steps(ref_model, ref, 20, seed=5)

    model = mlp(3)
    opt = make(model.parameters())
    train_steps(model, opt, 10, seed=5)
    saved_sd = _roundtrip(opt.state_dict())
    saved_model = _roundtrip(model.state_dict())

    model2 = mlp(99)
    model2.load_state_dict(saved_model)
    opt2 = make(model2.parameters())
    opt2._seed = 12345  # the checkpoint's seed must win
    opt2.load_state_dict(saved_sd)
    # continue with batches 10..19 of the same stream
    from helpers import regression_batches
    for i, (x, y) in enumerate(regression_batches(20, seed=5)):
        if i < 10:
            continue
        opt2.zero_grad()
        torch.nn.functional.mse_loss(model2(x), y).backward()
        opt2.step()
    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert_same_state(flat_state(ref), flat_state(opt2))


def test_state_dict_is_plain_data_with_versioned_qconfig():
    model = mlp()
    opt = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    train_steps(model, opt, 2)
    sd = _roundtrip(opt.state_dict())  # weights_only=True
    assert sd["qconf"]["format_version"] == 1
    assert sd["qconf"]["qconfig"]["states"]["exp_avg_sq"]["scale"] == "rank1"
    q = sd["state"][0]["exp_avg"]
    assert set(q) == {"codes", "scales", "shape", "codec"} and q["codes"].dtype == torch.uint8


def test_load_torch_adamw_state_dict_quantizes_on_load():
    a, b = mlp(4), mlp(4)
    topt = torch.optim.AdamW(a.parameters(), lr=2e-3)
    train_steps(a, topt, 15)
    b.load_state_dict(a.state_dict())
    opt = AdamW(b.parameters(), lr=1.0, qconfig=DEFAULT, fused=False)
    opt.load_state_dict(_roundtrip(topt.state_dict()))
    assert opt.param_groups[0]["lr"] == 2e-3  # hyperparameters come from the checkpoint
    st = opt.state[b[0].weight]
    assert isinstance(st["exp_avg"], QTensor) and int(st["step"]) == 15
    m_torch = topt.state[a[0].weight]["exp_avg"]
    assert (st["exp_avg"].decode() - m_torch).abs().max() <= 0.12 * m_torch.abs().max()
    small = opt.state[b[0].bias]["exp_avg"]  # below min_numel: kept exactly
    assert torch.equal(small, topt.state[a[0].bias]["exp_avg"])
    la = train_steps(a, topt, 10, seed=1)
    lb = train_steps(b, opt, 10, seed=1)
    assert abs(la[-1] - lb[-1]) <= 0.05 * la[-1]


@pytest.mark.parametrize("torch_cls,ours,kwargs", [
    (torch.optim.Adam, Adam, {"lr": 1e-3, "weight_decay": 0.01}),
    (torch.optim.SGD, SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.SGD, SGD, {"lr": 0.05}),
])
def test_load_torch_state_dicts_with_quantization_off_is_exact(torch_cls, ours, kwargs):
    a, b = mlp(5), mlp(5)
    topt = torch_cls(a.parameters(), **kwargs)
    train_steps(a, topt, 7)
    b.load_state_dict(a.state_dict())
    opt = ours(b.parameters(), qconfig=CONFIGS / "fp32.yml", fused=False, **kwargs)
    opt.load_state_dict(_roundtrip(topt.state_dict()))
    train_steps(a, topt, 5, seed=2)
    train_steps(b, opt, 5, seed=2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel_close(pa, pb, 1e-6)


@pytest.mark.parametrize("torch_cls,ours,kwargs", [
    (torch.optim.AdamW, AdamW, {"lr": 1e-3}),
    (torch.optim.SGD, SGD, {"lr": 0.05, "momentum": 0.9}),
])
def test_export_torch_state_dict_loads_into_torch(torch_cls, ours, kwargs):
    a, b = mlp(6), mlp(6)
    opt = ours(a.parameters(), qconfig=CONFIGS / "fp32.yml", fused=False, **kwargs)
    train_steps(a, opt, 8)
    b.load_state_dict(a.state_dict())
    topt = torch_cls(b.parameters(), **kwargs)
    topt.load_state_dict(_roundtrip(export_torch_state_dict(opt)))
    train_steps(a, opt, 5, seed=3)
    train_steps(b, topt, 5, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel_close(pa, pb, 1e-6)


def test_export_quantized_decodes_states():
    model = mlp()
    opt = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    train_steps(model, opt, 3)
    sd = export_torch_state_dict(opt)
    assert torch.equal(sd["state"][0]["exp_avg"], opt.state[model[0].weight]["exp_avg"].decode())
    assert sd["param_groups"][0]["decoupled_weight_decay"] is True
    assert "factor_second_moment" not in sd["param_groups"][0]
    torch.optim.AdamW(mlp().parameters()).load_state_dict(sd)


def test_load_under_another_qconfig_reencodes():
    model = mlp()
    opt8 = AdamW(model.parameters(), qconfig=CONFIGS / "8bit.yml", fused=False)
    train_steps(model, opt8, 5)
    opt4 = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    opt4.load_state_dict(_roundtrip(opt8.state_dict()))
    w = model[0].weight
    q8, q4 = opt8.state[w]["exp_avg_sq"], opt4.state[w]["exp_avg_sq"]
    assert q8.codec.bits == 8 and q4.codec.bits == 4 and q4.codec.scale == "rank1"
    assert (q4.decode() - q8.decode()).abs().max() <= 0.07 * q8.decode().abs().max()
    assert opt4.state_dict()["qconf"]["qconfig"]["states"]["exp_avg_sq"]["scale"] == "rank1"


def test_overrides_are_saved_restored_and_applicable_after_load():
    model = mlp()
    opt = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    opt.override_quantize_enable(model[0], "weight", False)
    train_steps(model, opt, 2)
    sd = _roundtrip(opt.state_dict())
    opt2 = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    opt2.load_state_dict(sd)
    assert not isinstance(opt2.state[model[0].weight]["exp_avg"], QTensor)
    opt2.override_quantize_enable(model[0], "weight", True)  # after load_state_dict
    assert isinstance(opt2.state[model[0].weight]["exp_avg"], QTensor)
    train_steps(model, opt2, 1)


# ---------------------------------------------------------------------------------------------
# bad checkpoints: clear error naming parameter and key; optimizer unchanged
def _good():
    model = mlp()
    opt = AdamW(model.named_parameters(), qconfig=DEFAULT, fused=False)
    train_steps(model, opt, 2)
    return model, opt


def _corrupt(fn):
    def make(sd):
        sd = copy.deepcopy(sd)
        fn(sd)
        return sd
    return make


@pytest.mark.parametrize("mutate,needle", [
    (_corrupt(lambda sd: sd["state"][0].__setitem__("exp_avg_sq", torch.zeros(3, 3))),
     "parameter 0 ('0.weight'): key 'exp_avg_sq' has shape (3, 3), expected (96, 64)"),
    (_corrupt(lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(96, dtype=torch.int64))),
     "parameter 1 ('0.bias'): key 'exp_avg' has dtype torch.int64"),
    (_corrupt(lambda sd: sd["state"][2].pop("exp_avg")), "parameter 2 ('2.weight'): missing key 'exp_avg'"),
    (_corrupt(lambda sd: sd["state"][2].pop("step")), "parameter 2 ('2.weight'): missing key 'step'"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"].__setitem__("codes", torch.zeros(5, dtype=torch.uint8))),
     "parameter 0 ('0.weight'): quantized state 'exp_avg' is invalid: QTensor codes must be"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"].pop("scales")), "quantized state 'exp_avg' is missing ['scales']"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"]["codec"].__setitem__("bits", 11)),
     "quantized state 'exp_avg' is invalid: Codec: bits must be an integer in 1..8"),
    (_corrupt(lambda sd: sd["state"][3].__setitem__("max_exp_avg_sq", torch.zeros(96))),
     "unexpected state key 'max_exp_avg_sq' (amsgrad is not supported)"),
    (_corrupt(lambda sd: sd["state"][3].__setitem__("step", torch.tensor(float("nan")))), "key 'step' must be"),
    (_corrupt(lambda sd: sd["param_groups"][0]["params"].pop()), "param group 0 has 5 params in the checkpoint, 6"),
    (_corrupt(lambda sd: sd["param_groups"].append({"params": []})), "the checkpoint has 2 param groups"),
    (_corrupt(lambda sd: sd.pop("param_groups")), "missing top-level key 'param_groups'"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("betas", 0.9)), "'betas' is 0.9"),
    (_corrupt(lambda sd: sd["qconf"].__setitem__("format_version", 99)), "unsupported qconf checkpoint format_version 99"),
    (_corrupt(lambda sd: sd["qconf"].__setitem__("optimizer", "SGD")), "checkpoint was written by SGD, not AdamW"),
    (_corrupt(lambda sd: sd["qconf"]["qconfig"].__setitem__("version", 2)),
     "'qconf.qconfig' is not a qconfig this qconf reads: <dict>: version: 2 is not supported (allowed: 1)"),
    (_corrupt(lambda sd: sd["qconf"].__setitem__("enable_overrides", {42: True})), "names parameter 42"),
    (_corrupt(lambda sd: sd["state"].__setitem__(17, {"step": torch.tensor(1.0)})),
     "state entry 17 does not belong to any param group"),
    (lambda sd: [1, 2], "expected a dict, got list"),
])
def test_bad_checkpoint_raises_and_leaves_optimizer_unchanged(mutate, needle):
    model, opt = _good()
    good = opt.state_dict()
    before = flat_state(opt)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError) as e:
        opt.load_state_dict(mutate(good))
    assert needle in str(e.value)
    assert "the optimizer was left unchanged" in str(e.value)
    assert_same_state(before, flat_state(opt))
    assert groups_before == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    train_steps(model, opt, 1)  # still usable


def test_wrong_param_count_against_torch_state_dict():
    a = mlp()
    topt = torch.optim.AdamW(a.parameters())
    train_steps(a, topt, 1)
    opt = AdamW(list(a.parameters())[:-1], fused=False)
    with pytest.raises(ValueError, match="param group 0 has 6 params in the checkpoint, 5 in the optimizer"):
        opt.load_state_dict(topt.state_dict())
