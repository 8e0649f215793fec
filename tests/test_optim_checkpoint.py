"""Checkpoints: plain-data state dicts, bit-exact resume, conversion to/from torch.optim, and bad
checkpoints that must leave the optimizer untouched."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from qconf.codec import QTensor
from qconf.codec.codec import RECORD_FIELDS
from qconf.optim import SGD, Adam, AdamW, Lion, export_torch_state_dict

from helpers import CONFIGS, assert_rel_close, assert_same_state, flat_state, mlp, regression_batches, train_steps

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
    section = sd["param_groups"][0]["qconf"]  # in every param group, where DCP carries it
    assert section["format_version"] == 2 and section["optimizer"] == "AdamW"
    assert section["qconfig"]["states"]["exp_avg_sq"]["scale"] == "rank1"
    assert section["seed"] == opt._seed and section["enable_overrides"] == []
    assert "qconf" not in sd
    q = sd["state"][0]["exp_avg"]
    assert set(q) == {"codes", "scales", "shape", "codec", "packed"} and q["codes"].dtype == torch.uint8
    assert q["packed"] == "rows" and q["codes"].shape == (q["shape"][0], -(-q["shape"][1] * 4 // 8))


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
    assert opt4.state_dict()["param_groups"][0]["qconf"]["qconfig"]["states"]["exp_avg_sq"]["scale"] == "rank1"


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


def _section(sd):
    return sd["param_groups"][0]["qconf"]


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
     "parameter 0 ('0.weight'): quantized state 'exp_avg' is invalid: row-packed codes must be uint8 of shape "
     "(96, 32), got torch.uint8 (5,)"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"].pop("scales")), "quantized state 'exp_avg' is missing ['scales']"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"]["codec"].__setitem__("bits", 11)),
     "quantized state 'exp_avg' is invalid: Codec: bits must be an integer in 1..8"),
    (_corrupt(lambda sd: sd["state"][3].__setitem__("max_exp_avg_sq", torch.zeros(96))),
     "unexpected state key 'max_exp_avg_sq' (amsgrad is not supported)"),
    (_corrupt(lambda sd: sd["state"][3].__setitem__("step", torch.tensor(float("nan")))), "key 'step' must be"),
    (_corrupt(lambda sd: sd["param_groups"][0]["params"].pop()), "param group 0 has 5 params in the checkpoint, 6"),
    (_corrupt(lambda sd: sd["param_groups"].append({"params": []})), "the checkpoint has 2 param groups"),
    (_corrupt(lambda sd: sd.pop("param_groups")), "missing top-level key 'param_groups'"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("betas", 0.9)),
     "param group 0: betas must be a pair of floats, got 0.9"),
    # hyperparameters the constructor rejects
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("lr", float("nan"))),
     "param group 0: Invalid learning rate: nan"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("lr", torch.tensor([1e-3, 1e-3]))),
     "param group 0: Tensor lr must be 1-element"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("betas", ("a", "b"))),
     "param group 0: beta parameter at index 0 must be a real number or a one-element tensor, got str 'a'"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("betas", (0.9, 1.5))),
     "param group 0: Invalid beta parameter at index 1: 1.5"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("eps", -1.0)), "param group 0: Invalid epsilon value: -1.0"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("eps", float("inf"))),
     "param group 0: Invalid epsilon value: inf (must be finite)"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("weight_decay", -0.5)),
     "param group 0: Invalid weight_decay value: -0.5"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("maximize", "yes")),
     "param group 0: maximize must be True or False, got 'yes'"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("amsgrad", True)),
     "param group 0: AdamW: amsgrad=True is not supported"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("decoupled_weight_decay", False)),
     "param group 0: AdamW: decoupled_weight_decay=False is not supported; use qconf.optim.Adam"),
    # state values that would turn into NaN at the next step
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"]["scales"].__setitem__(3, float("nan"))),
     "parameter 0 ('0.weight'): quantized state 'exp_avg' has NaN, infinite or negative scales"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"]["scales"].__setitem__(0, float("inf"))),
     "quantized state 'exp_avg' has NaN, infinite or negative scales"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg_sq"]["scales"].__setitem__(0, -1.0)),
     "quantized state 'exp_avg_sq' has NaN, infinite or negative scales"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"].__setitem__("codes", sd["state"][0]["exp_avg"]["codes"].long())),
     "quantized state 'exp_avg' is invalid: row-packed codes must be uint8 of shape (96, 32), got torch.int64"),
    (_corrupt(lambda sd: sd["state"][1]["exp_avg"].__setitem__(5, float("nan"))),
     "parameter 1 ('0.bias'): key 'exp_avg' holds NaN or infinite values"),
    (_corrupt(lambda sd: sd["state"][1]["exp_avg_sq"].__setitem__(5, -1e-3)),
     "parameter 1 ('0.bias'): key 'exp_avg_sq' holds negative values"),
    (_corrupt(lambda sd: sd["state"][3].__setitem__("step", 10**400)), "key 'step' must be a whole number"),
    (_corrupt(lambda sd: sd["state"][3].__setitem__("step", torch.tensor(-2.0))), "key 'step' must be a whole number"),
    (_corrupt(lambda sd: sd["state"].__setitem__(2, {"step": torch.tensor(2.0)})),
     "parameter 2 ('2.weight'): missing key 'exp_avg'"),
    # wrong containers and types
    (_corrupt(lambda sd: sd.__setitem__("state", [1])), "'state' must be a dict, got list"),
    (_corrupt(lambda sd: sd.__setitem__("param_groups", {"params": [0]})),
     "'param_groups' must be a list of dicts with a 'params' list"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("params", 6)),
     "'param_groups' must be a list of dicts with a 'params' list"),
    (_corrupt(lambda sd: sd["state"].__setitem__(0, [1, 2])),
     "parameter 0 ('0.weight'): state must be a dict, got list"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"].__setitem__("shape", "96x64")),
     "quantized state 'exp_avg': 'shape' must be a list of ints, got '96x64'"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"].__setitem__("codec", 4)),
     "quantized state 'exp_avg': 'codec' must be a dict, got int"),
    (_corrupt(lambda sd: sd["state"][0]["exp_avg"].__setitem__("codes", [1, 2])),
     "quantized state 'exp_avg': 'codes' must be a tensor or a quantized-state dict, got list"),
    (_corrupt(lambda sd: sd["param_groups"][0].__setitem__("qconf", "x")), "'qconf' section must be a dict, got str"),
    (_corrupt(lambda sd: _section(sd).__setitem__("seed", -1)), "'qconf.seed' must be an int in [0, 2**64), got -1"),
    (_corrupt(lambda sd: _section(sd)["qconfig"].__setitem__("base", ["other.yml"])),
     "'qconf.qconfig' must be self-contained"),
    (_corrupt(lambda sd: _section(sd).__setitem__("format_version", 99)), "unsupported qconf checkpoint format_version 99"),
    (_corrupt(lambda sd: _section(sd).__setitem__("optimizer", "SGD")), "checkpoint was written by SGD, not AdamW"),
    (_corrupt(lambda sd: _section(sd)["qconfig"].__setitem__("version", 2)),
     "'qconf.qconfig' is not a qconfig this qconf reads: <dict>: version: 2 is not supported (allowed: 1)"),
    (_corrupt(lambda sd: _section(sd).__setitem__("enable_overrides", [[42, True]])), "names parameter 42"),
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


@pytest.mark.parametrize("field", [*RECORD_FIELDS, "unknown"])
def test_a_codec_record_missing_a_field_or_with_an_unknown_one_is_refused(field):
    """A record that lost a field would otherwise load with the field's default (a dropped ``map``
    of exp_avg_sq, saved power-1, decoded with the nonlinear map: 29% of its largest value off)."""
    model, opt = _good()
    sd = copy.deepcopy(opt.state_dict())
    record = sd["state"][0]["exp_avg_sq"]["codec"]
    if field == "unknown":
        record["zero_point"] = True
        needle = "unknown field(s) 'zero_point'"
    else:
        del record[field]
        needle = f"missing field(s) {field!r}"
    before = flat_state(opt)
    with pytest.raises(ValueError) as e:
        opt.load_state_dict(sd)
    msg = str(e.value)
    assert "parameter 0 ('0.weight'): quantized state 'exp_avg_sq' is invalid: codec record: " + needle in msg
    assert "the optimizer was left unchanged" in msg
    assert_same_state(before, flat_state(opt))


def test_codec_records_without_the_later_optional_fields_load():
    """Records written before ``statistic`` / ``min_scale`` existed (and every record at their
    defaults, which to_dict leaves out) load as absmax / 0."""
    model, opt = _good()
    sd = opt.state_dict()
    assert all(k not in sd["state"][0]["exp_avg"]["codec"] for k in ("statistic", "min_scale"))
    assert set(sd["state"][0]["exp_avg"]["codec"]) == set(RECORD_FIELDS)
    before = flat_state(opt)
    opt2 = AdamW(model.named_parameters(), qconfig=DEFAULT, fused=False)
    opt2.load_state_dict(_roundtrip(sd))
    assert_same_state(before, flat_state(opt2))


def test_wrong_param_count_against_torch_state_dict():
    a = mlp()
    topt = torch.optim.AdamW(a.parameters())
    train_steps(a, topt, 1)
    opt = AdamW(list(a.parameters())[:-1], fused=False)
    with pytest.raises(ValueError, match="param group 0 has 6 params in the checkpoint, 5 in the optimizer"):
        opt.load_state_dict(topt.state_dict())


def test_codes_outside_the_map_are_refused():
    # signed 4-bit linear has 15 levels: code 15 names no map value
    model = mlp()
    cfg = {"states": {"exp_avg": {"map": "linear", "signed": True}}}
    opt = AdamW(model.parameters(), qconfig=cfg, fused=False)
    train_steps(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"]["codes"][7] = 0xFF
    before = flat_state(opt)
    with pytest.raises(ValueError, match=r"parameter 0: quantized state 'exp_avg' has codes outside its 15-entry map"):
        opt.load_state_dict(sd)
    assert_same_state(before, flat_state(opt))


@pytest.mark.parametrize("ctor,key,value,needle", [
    (AdamW, "lr", float("nan"), "Invalid learning rate: nan"),
    (AdamW, "lr", torch.tensor([1e-3, 1e-3]), "Tensor lr must be 1-element"),
    (Adam, "betas", ("0.9", "0.99"), "beta parameter at index 0 must be a real number or a one-element tensor"),
    (AdamW, "eps", -1e-8, "Invalid epsilon value: -1e-08"),
    (Adam, "weight_decay", float("inf"), "Invalid weight_decay value: inf (must be finite)"),
    (AdamW, "factor_second_moment", 1, "factor_second_moment must be True or False, got 1"),
    (SGD, "momentum", float("nan"), "Invalid momentum value: nan"),
    (SGD, "dampening", float("inf"), "Invalid dampening value: inf (must be finite)"),
    (SGD, "nesterov", True, "Nesterov momentum requires a momentum and zero dampening"),
    (Lion, "betas", (0.9,), "betas must be a pair of floats, got (0.9,)"),
    (Lion, "lr", "1e-3", "lr must be a real number or a one-element tensor, got str '1e-3'"),
])
def test_constructor_and_loader_share_hyperparameter_rules(ctor, key, value, needle):
    with pytest.raises(ValueError) as e:
        ctor(mlp().parameters(), fused=False, **{key: value})
    assert needle in str(e.value)
    model = mlp()
    opt = ctor(model.parameters(), qconfig=DEFAULT, fused=False)
    train_steps(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0][key] = value
    before = flat_state(opt)
    with pytest.raises(ValueError) as e:
        opt.load_state_dict(sd)
    assert f"param group 0: {needle}" in str(e.value)
    assert_same_state(before, flat_state(opt))


@pytest.mark.parametrize("torch_opt,ours,needle", [
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), AdamW, "amsgrad=True is not supported"),
    (lambda ps: torch.optim.Adam(ps, decoupled_weight_decay=True), Adam,
     "Adam: decoupled_weight_decay=True is not supported; use qconf.optim.AdamW"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=float("nan")), SGD, "Invalid dampening value: nan"),
])
def test_torch_options_qconf_does_not_implement_are_refused_on_load(torch_opt, ours, needle):
    a = mlp()
    topt = torch_opt(a.parameters())
    opt = ours(mlp().parameters(), fused=False)
    with pytest.raises(ValueError, match=f"param group 0: .*{needle}"):
        opt.load_state_dict(topt.state_dict())


def test_format_1_checkpoints_still_load():
    model = mlp(3)
    opt = AdamW(model.parameters(), lr=3e-3, qconfig=SR_CFG, fused=False, seed=1)
    opt.override_quantize_enable(model[2], "bias", True)
    train_steps(model, opt, 3)
    v1 = _roundtrip(opt.state_dict())  # rewritten in format 1's layout: one top-level section
    section = v1["param_groups"][0]["qconf"]
    for g in v1["param_groups"]:
        del g["qconf"]
    v1["qconf"] = {**section, "format_version": 1, "enable_overrides": dict(section["enable_overrides"])}
    model2 = mlp(3)
    model2.load_state_dict(model.state_dict())
    opt2 = AdamW(model2.parameters(), lr=3e-3, qconfig=SR_CFG, fused=False, seed=99)
    opt2.load_state_dict(v1)
    assert opt2._seed == 1 and opt2._enable_overrides == {3: True}
    train_steps(model, opt, 3, seed=1)
    train_steps(model2, opt2, 3, seed=1)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert_same_state(flat_state(opt), flat_state(opt2))


# ---------------------------------------------------------------------------------------------
# param groups round-trip every key as torch does (LR schedulers store theirs there)
SCHEDULERS = {
    "OneCycleLR": lambda o, last: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=12, last_epoch=last),
    "CosineAnnealingLR": lambda o, last: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12, last_epoch=last),
    "CyclicLR": lambda o, last: torch.optim.lr_scheduler.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=3,
                                                                  last_epoch=last),
}


def _scheduled_run(make_opt, make_sched, steps, resume_at=None):
    """Train with a scheduler; at ``resume_at``, rebuild optimizer and scheduler the standard way
    (load the optimizer's state dict, then a scheduler with ``last_epoch >= 0``)."""
    model = mlp(2)
    opt = make_opt(model.parameters())
    sched = make_sched(opt, -1)
    hyper = []
    for i, (x, y) in enumerate(regression_batches(steps, seed=4)):
        if i == resume_at:
            saved = _roundtrip(opt.state_dict())
            opt = make_opt(model.parameters())
            opt.load_state_dict(saved)
            sched = make_sched(opt, i - 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        hyper.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
    return model, opt, hyper


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
def test_scheduler_resume_recipe_matches_torch(sched):
    make_sched = SCHEDULERS[sched]
    ours = lambda ps: AdamW(ps, lr=1e-3, qconfig=DEFAULT, fused=False, seed=2)  # noqa: E731
    _, topt, torch_hyper = _scheduled_run(lambda ps: torch.optim.AdamW(ps, lr=1e-3), make_sched, 8, resume_at=4)
    ref_model, ref, ref_hyper = _scheduled_run(ours, make_sched, 8)
    model, opt, hyper = _scheduled_run(ours, make_sched, 8, resume_at=4)
    assert hyper == ref_hyper == torch_hyper
    torch_keys = set(topt.param_groups[0]) - set(AdamW.torch_group_defaults)
    assert set(opt.param_groups[0]) == torch_keys | {"factor_second_moment"}  # scheduler keys included
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert_same_state(flat_state(ref), flat_state(opt))


def test_every_group_key_round_trips_and_torch_keys_are_kept():
    model = mlp()
    opt = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    opt.param_groups[0]["my_note"] = {"warmup": [1, 2]}
    train_steps(model, opt, 1)
    opt2 = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    opt2.param_groups[0]["stale"] = 1  # keys the checkpoint lacks go, as in torch
    opt2.load_state_dict(_roundtrip(opt.state_dict()))
    assert opt2.param_groups[0]["my_note"] == {"warmup": [1, 2]} and "stale" not in opt2.param_groups[0]
    assert "qconf" not in opt2.param_groups[0]  # the section is read, not kept as a group key
    topt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    train_steps(model, topt, 1)
    opt2.load_state_dict(topt.state_dict())
    assert {k: v for k, v in opt2.param_groups[0].items() if k != "params"} == {
        **{k: v for k, v in topt.param_groups[0].items() if k != "params"}, "factor_second_moment": False}
    torch.optim.AdamW(model.parameters()).load_state_dict(export_torch_state_dict(opt2))


# ---------------------------------------------------------------------------------------------
# state-dict and load-state-dict hooks, as torch runs them
def _is_plain(x) -> bool:
    if isinstance(x, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(_is_plain(v) for v in x)
    return x is None or isinstance(x, (bool, int, float, str, torch.Tensor))


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                  lambda ps: AdamW(ps, lr=1e-3, qconfig=DEFAULT, fused=False)],
                         ids=["torch", "qconf"])
def test_state_dict_hooks_run_as_in_torch(make):
    model = mlp()
    opt = make(model.parameters())
    train_steps(model, opt, 2)
    events = []
    opt.register_state_dict_pre_hook(lambda o: events.append(("sd_pre", o is opt)))

    def sd_post(o, sd):
        events.append(("sd_post", _is_plain(sd)))
        _roundtrip(sd)  # what the hook sees is what is saved: weights_only-loadable
        return {**sd, "note": "from hook"}

    opt.register_state_dict_post_hook(sd_post)
    opt.register_state_dict_post_hook(lambda o, sd: events.append(("sd_post_first", "note" in sd)), prepend=True)
    sd = opt.state_dict()
    assert sd["note"] == "from hook"

    def load_pre(o, d):
        events.append(("load_pre", d is sd))  # a shallow copy
        d["note"] = "changed"

    def load_pre_replace(o, d):
        events.append(("load_pre_replace", d["note"]))
        groups = copy.deepcopy(d["param_groups"])
        groups[0]["lr"] = 0.25
        return {**d, "param_groups": groups}

    opt.register_load_state_dict_pre_hook(load_pre_replace)
    opt.register_load_state_dict_pre_hook(load_pre, prepend=True)
    opt.register_load_state_dict_post_hook(lambda o: events.append(("load_post", o.param_groups[0]["lr"])))
    opt.load_state_dict(sd)
    assert sd["note"] == "from hook" and sd["param_groups"][0]["lr"] == 1e-3
    assert opt.param_groups[0]["lr"] == 0.25
    assert events == [("sd_pre", True), ("sd_post_first", False), ("sd_post", True),
                      ("load_pre", False), ("load_pre_replace", "changed"), ("load_post", 0.25)]


def test_load_post_hook_does_not_run_when_loading_fails():
    model, opt = _good()
    calls = []
    opt.register_load_state_dict_post_hook(lambda o: calls.append(o))
    with pytest.raises(ValueError):
        opt.load_state_dict({"state": {}, "param_groups": []})
    assert calls == []


# ---------------------------------------------------------------------------------------------
# an optimizer's own checkpoint after a layout hyperparameter changed mid-run
@pytest.mark.parametrize("make,key,value", [
    (lambda ps: SGD(ps, lr=0.05, momentum=0.0, qconfig=DEFAULT, fused=False, seed=1), "momentum", 0.9),
    (lambda ps: SGD(ps, lr=0.05, momentum=0.9, qconfig=DEFAULT, fused=False, seed=1), "momentum", 0.0),
    (lambda ps: AdamW(ps, lr=3e-3, qconfig=DEFAULT, fused=False, seed=1), "factor_second_moment", True),
    (lambda ps: AdamW(ps, lr=3e-3, qconfig=DEFAULT, factor_second_moment=True, fused=False, seed=1),
     "factor_second_moment", False),
    (lambda ps: AdamW(ps, lr=3e-3, qconfig=SR_CFG, fused=None, seed=1), "factor_second_moment", True),  # native
    (lambda ps: SGD(ps, lr=0.05, momentum=0.9, qconfig=SR_CFG, fused=None, seed=1), "momentum", 0.0),
])
@pytest.mark.parametrize("steps_after_change", [0, 1])
def test_own_checkpoint_loads_after_a_layout_hyperparameter_changes(make, key, value, steps_after_change):
    model = mlp(3)
    opt = make(model.parameters())
    train_steps(model, opt, 3, seed=1)
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    train_steps(model, opt, steps_after_change, seed=2)
    model2 = copy.deepcopy(model)
    opt2 = make(model2.parameters())
    opt2.load_state_dict(_roundtrip(opt.state_dict()))
    assert_same_state(flat_state(opt), flat_state(opt2))
    for flip, seed in ((value, 3), (old, 4)):  # continue, then change back: old states come back into use
        opt.param_groups[0][key] = opt2.param_groups[0][key] = flip
        train_steps(model, opt, 2, seed=seed)
        train_steps(model2, opt2, 2, seed=seed)
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)
        assert_same_state(flat_state(opt), flat_state(opt2))


def _quantized_opt(shapes, cfg, seed=0):
    """An AdamW on parameters of ``shapes`` after one step (states from ``seed``'s gradients)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = AdamW(params, lr=1e-2, qconfig=cfg, fused=False, seed=1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return params, opt


@pytest.mark.parametrize("layout", ["flat", "unpacked"])
def test_checkpoints_in_the_earlier_codes_layouts_still_load(layout):
    # before the row layout (qconf.optim.records), unsharded runs saved flat packed codes
    # (QTensor.to_dict) and sharded runs unpacked ones ("packed": False)
    shapes = [(96, 130), (5000,), (71, 73)]
    cfg = {"min_numel": 0, "states": {"exp_avg": {"bits": 4}, "exp_avg_sq": {"bits": 3, "scale": "rank1"}}}
    params, opt = _quantized_opt(shapes, cfg)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        for key, q in opt.state[p].items():
            if isinstance(q, QTensor):
                old = q.to_dict()
                if layout == "unpacked":
                    from qconf.codec import packing
                    old = {**old, "codes": packing.unpack(q.codes, q.codec.bits, q.numel()).view(q.shape).to(torch.uint8),
                           "packed": False}
                sd["state"][i][key] = old
    _, fresh = _quantized_opt(shapes, cfg, seed=1)  # other states until the load
    fresh.load_state_dict(_roundtrip(sd))
    assert_same_state(flat_state(opt), flat_state(fresh))


def test_state_dict_codes_are_packed_row_by_row():
    # rows of whole bytes (4 bits x 130) are the flat packing viewed as rows (shared, no copy);
    # 73 codes of 4 bits and a 1-D state (a byte per element) pad each row's last byte
    from qconf.codec import packing
    shapes = [(96, 130), (5000,), (71, 73)]
    params, opt = _quantized_opt(shapes, {"min_numel": 0})
    sd = opt.state_dict()
    expect = {0: (96, 65), 1: (5000, 1), 2: (71, 37)}
    for i, p in enumerate(params):
        q, rec = opt.state[p]["exp_avg"], sd["state"][i]["exp_avg"]
        assert rec["packed"] == "rows" and tuple(rec["codes"].shape) == expect[i]
        rows, inner = expect[i][0], q.numel() // expect[i][0]
        codes = packing.unpack(q.codes, 4, q.numel()).view(rows, inner)
        assert torch.equal(packing.unpack_rows(rec["codes"], 4, inner), codes)
    assert sd["state"][0]["exp_avg"]["codes"].data_ptr() == opt.state[params[0]]["exp_avg"].codes.data_ptr()
    _, again = _quantized_opt(shapes, {"min_numel": 0}, seed=1)
    again.load_state_dict(_roundtrip(sd))
    assert_same_state(flat_state(opt), flat_state(again))
