"""Gradient release (qconf.optim.release): each parameter steps inside backward and its gradient is
freed. N steps with release give the parameters and states of N normal steps bit for bit, on the
fused CPU kernel and the reference path, for every rule, 4-bit (group-128 and rank-1), 8-bit and
fp32 states, fp32 / bf16+SR / bf16+Kahan parameters; it keeps working with schedulers, changed
group values, overrides, closures, checkpoints (both directions) and DCP; what cannot work is
refused. (HF Trainer and Lightning: tests/test_gradient_release_clients.py.)"""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from qconf.optim import SGD, Adam, AdamW, Lion, Muon, prepare_gradient_release, remove_gradient_release
from qconf.optim.release import ReleasedGrad

from helpers import CONFIGS, assert_same_run, mlp, regression_batches

QCONFIGS = {"group128": "2nd_moment_group_128.yml", "rank1": "default.yml", "8bit": "8bit.yml", "fp32": "fp32.yml"}
WEIGHTS = {"fp32": (torch.float32, {}), "bf16_sr": (torch.bfloat16, {"rounding": "stochastic"}),
           "bf16_kahan": (torch.bfloat16, {"compensation": "kahan"})}
RULES = {
    "adamw": lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.01, **kw),
    "adam": lambda ps, **kw: Adam(ps, lr=1e-2, weight_decay=0.01, **kw),
    "factored": lambda ps, **kw: AdamW(ps, lr=1e-2, factor_second_moment=True, **kw),
    "sgd": lambda ps, **kw: SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, **kw),
    "lion": lambda ps, **kw: Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
    "muon": lambda ps, **kw: Muon(ps, lr=0.02, adamw={"lr": 1e-2}, **kw),
}


def _qconfig(config: str, weights: dict) -> dict:
    return {"base": str(CONFIGS / QCONFIGS[config]), "min_numel": 0, "weights": weights}


def _make(rule="adamw", config="rank1", weights="fp32", fused=None, release=False, seed=0, grad_norms=False):
    dtype, w = WEIGHTS[weights]
    model = mlp(seed, dtype=dtype)
    opt = RULES[rule](model.named_parameters(), qconfig=_qconfig(config, w), fused=fused, seed=5,
                      gradient_release=release)
    if release:
        prepare_gradient_release(model, opt, grad_norms=grad_norms)
    return model, opt


def _loss(model, x, y):
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def _train(model, opt, batches, on_step=None):
    """The plain loop every user writes: zero_grad, backward, step (release or not)."""
    losses = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(i)
    return losses


# ---------------------------------------------------------------------------------------------
# same numbers

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("config", sorted(QCONFIGS))
def test_release_is_bit_identical_to_normal_steps(config, weights, fused):
    batches = list(regression_batches(5, seed=1))
    normal, release = _make(config=config, weights=weights, fused=fused), _make(config=config, weights=weights,
                                                                                fused=fused, release=True)
    assert _train(*normal, batches) == _train(*release, batches)
    assert_same_run(normal, release)
    assert all(isinstance(p.grad, ReleasedGrad) for p in release[0].parameters())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("rule", ["adam", "factored", "sgd", "lion", "muon"])
@pytest.mark.parametrize("config,weights", [("rank1", "bf16_sr"), ("8bit", "fp32"), ("group128", "bf16_kahan")])
def test_every_rule_is_bit_identical(rule, config, weights, fused):
    batches = list(regression_batches(4, seed=2))
    normal = _make(rule, config, weights, fused)
    release = _make(rule, config, weights, fused, release=True)
    _train(*normal, batches)
    _train(*release, batches)
    assert_same_run(normal, release)


def test_the_fused_path_really_runs_per_parameter_plans():
    model, opt = _make(fused=True, release=True)
    _train(model, opt, regression_batches(2))
    assert {k for k in opt._kernel._plans if isinstance(k, tuple)} == {("release", i) for i in range(6)}


# ---------------------------------------------------------------------------------------------
# where users run us: loops, schedulers, group values, overrides, removal

def test_step_and_zero_grad_are_harmless_no_ops():
    model, opt = _make(release=True)
    x, y = next(regression_batches(1))
    _loss(model, x, y).backward()
    after_backward = [p.detach().clone() for p in model.parameters()]
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    assert steps == [1] * 6
    assert opt.step() is None
    assert all(isinstance(p.grad, ReleasedGrad) for p in model.parameters())
    assert "ReleasedGrad(parameter 0 ('0.weight')" in repr(model[0].weight.grad)
    opt.zero_grad(set_to_none=False)  # the markers stay: zeroing would read gradients that are gone
    assert all(isinstance(p.grad, ReleasedGrad) for p in model.parameters())
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(a, p) for a, p in zip(after_backward, model.parameters()))
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == steps


@pytest.mark.parametrize("rule", sorted(RULES))
def test_zero_grad_set_to_none_leaves_no_grad(rule):
    """As with torch.optim: after zero_grad() (set_to_none=True) no parameter has a .grad, released or
    held -- and the next backward and step run as before."""
    batches = list(regression_batches(3, seed=4))
    normal, release = _make(rule), _make(rule, release=True)
    for model, opt in (normal, release):
        for x, y in batches:
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
    assert_same_run(normal, release)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_schedulers_and_changed_group_values_take_effect_from_the_next_backward(fused):
    batches = list(regression_batches(6, seed=3))
    runs = []
    for release in (False, True):
        model, opt = _make(fused=fused, release=release)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)

        def on_step(i, opt=opt, sched=sched):
            sched.step()
            if i == 2:
                opt.param_groups[0]["weight_decay"] = 0.5
                opt.param_groups[0]["betas"] = (0.8, 0.99)

        _train(model, opt, batches, on_step)
        runs.append((model, opt))
    assert_same_run(*runs)
    assert runs[1][1].param_groups[0]["lr"] == runs[0][1].param_groups[0]["lr"]


def test_override_quantize_enable_works_during_release():
    batches = list(regression_batches(4, seed=4))
    runs = []
    for release in (False, True):
        model, opt = _make(release=release)
        _train(model, opt, batches[:2])
        opt.override_quantize_enable(model[0], "weight", False)
        opt.override_quantize_enable(model[2], "bias", True)
        _train(model, opt, batches[2:])
        runs.append((model, opt))
    assert_same_run(*runs)
    assert not hasattr(runs[1][1].state[runs[1][0][0].weight]["exp_avg"], "codes")


def test_removing_the_hooks_returns_to_normal_stepping():
    batches = list(regression_batches(6, seed=5))
    normal = _make()
    _train(*normal, batches)
    model, opt = _make(release=True)
    _train(model, opt, batches[:3])
    remove_gradient_release(model)
    assert all(p.grad is None for p in model.parameters())
    _train(model, opt, batches[3:])  # normal steps: step() steps, zero_grad() clears
    assert all(p.grad is not None and not isinstance(p.grad, ReleasedGrad) for p in model.parameters())
    assert_same_run(normal, (model, opt))
    prepare_gradient_release(model, opt)  # and back
    with pytest.raises(ValueError, match="already has gradient release hooks"):
        prepare_gradient_release(model, opt)


def test_a_parameter_without_a_gradient_is_not_stepped():
    model, opt = _make(release=True)
    model[4].weight.requires_grad_(False)
    x, y = next(regression_batches(1))
    _loss(model, x, y).backward()
    assert "step" not in opt.state[model[4].weight] and model[4].weight.grad is None
    model[4].weight.requires_grad_(True)
    _loss(model, x, y).backward()
    assert int(opt.state[model[4].weight]["step"]) == 1 and int(opt.state[model[0].weight]["step"]) == 2


def test_deepcopy_and_pickle_keep_the_flag_not_the_hooks():
    model, opt = _make(release=True)
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other.gradient_release and not other._release_active
    assert opt._release_active


# ---------------------------------------------------------------------------------------------
# gradient accumulation

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_micro_batches_accumulate_inside_no_release(fused):
    batches = list(regression_batches(9, seed=6))
    normal = _make("sgd", "8bit", fused=fused)
    release = _make("sgd", "8bit", fused=fused, release=True)
    for k in range(0, 9, 3):  # 3 micro-batches per step
        (model, opt) = normal
        opt.zero_grad()
        for x, y in batches[k:k + 3]:
            _loss(model, x, y).backward()
        opt.step()
        (model, opt) = release
        opt.zero_grad()
        with opt.no_release():
            for x, y in batches[k:k + 2]:
                _loss(model, x, y).backward()
        assert not any(isinstance(p.grad, ReleasedGrad) for p in model.parameters())
        _loss(model, *batches[k + 2]).backward()  # the last micro-batch steps on the sum
        opt.step()
    assert_same_run(normal, release)


def test_a_last_micro_batch_inside_no_release_steps_at_step():
    batches = list(regression_batches(2, seed=7))
    normal, release = _make(), _make(release=True)
    model, opt = normal
    for x, y in batches:
        _loss(model, x, y).backward()
    opt.step()
    model, opt = release
    with opt.no_release():
        for x, y in batches:
            _loss(model, x, y).backward()
    opt.step()  # the gradients still held are stepped, as the normal step would
    assert_same_run(normal, release)


def test_micro_batches_without_no_release_are_refused_at_step():
    model, opt = _make(release=True)
    for x, y in regression_batches(2):
        _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match=r"stepped parameter 0 \('0.weight'\) 2 times since the previous step\(\).*"
                                           r"no_release"):
        opt.step()
    opt.step()  # counted afresh


# ---------------------------------------------------------------------------------------------
# refused: global-norm clipping, GradScaler, bad preparation

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_a_closure_runs_once_and_its_backward_steps(fused):
    """torch.optim calls a closure once in step(); with release its backward takes the steps (as
    Lightning's automatic optimization does on every step), the same as a normal step(closure)."""
    batches = list(regression_batches(4, seed=10))
    runs = []
    for release in (False, True):
        model, opt = _make(fused=fused, release=release)
        calls = []
        for x, y in batches:
            def closure(model=model, opt=opt, x=x, y=y):
                calls.append(1)
                opt.zero_grad()
                loss = _loss(model, x, y)
                loss.backward()
                return loss
            assert isinstance(opt.step(closure), torch.Tensor)
        assert len(calls) == len(batches)
        runs.append((model, opt))
    assert_same_run(*runs)


def test_gradient_norms_work_and_a_clip_that_would_scale_is_refused():
    normal, release = _make(), _make(release=True, grad_norms=True)
    x, y = next(regression_batches(1))
    for model, _ in (normal, release):
        _loss(model, x, y).backward()
    # the global norm of the gradients each step used (HF Trainer logs it), and a clip above it
    norm = torch.nn.utils.clip_grad_norm_(normal[0].parameters(), float("inf"))
    assert torch.allclose(torch.nn.utils.clip_grad_norm_(release[0].parameters(), float("inf")), norm, rtol=1e-6)
    assert torch.allclose(torch.nn.utils.clip_grad_norm_(release[0].parameters(), 2 * norm.item()), norm, rtol=1e-6)
    with pytest.raises(RuntimeError, match=r"read the gradient of parameter \d \('.*'\), which gradient release "
                                           r"already used for its step and freed; .*max_grad_norm=0"):
        torch.nn.utils.clip_grad_norm_(release[0].parameters(), norm.item() / 2)
    with pytest.raises(RuntimeError, match="linalg_vector_norm"):
        release[0][0].weight.grad.norm(p=1)
    with pytest.raises(RuntimeError, match="zero_"):
        release[0].zero_grad(set_to_none=False)


def test_gradient_norms_are_kept_only_on_request():
    """Without grad_norms=True a release keeps no norm (it would read every gradient once more): a
    norm, a clip (even one that would clip nothing) and a bad flag are refused, naming the fix."""
    model, opt = _make(release=True)
    x, y = next(regression_batches(1))
    _loss(model, x, y).backward()
    assert model[0].weight.grad.norm2 is None
    fix = r"kept no norm of the gradient of parameter 0 \('0.weight'\); .*grad_norms=True"
    with pytest.raises(RuntimeError, match=r"linalg_vector_norm.*" + fix):
        model[0].weight.grad.norm()
    with pytest.raises(RuntimeError, match=r"_foreach_norm.*" + fix + ".*max_grad_norm=0"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"), foreach=True)
    with pytest.raises(ValueError, match="grad_norms must be True or False, got 1"):
        prepare_gradient_release(model, opt, grad_norms=1)


def test_a_grad_scaler_is_refused():
    model, opt = _make(release=True)
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(regression_batches(1))
    scaler.scale(_loss(model, x, y)).backward()
    with pytest.raises(RuntimeError, match="_amp_foreach_non_finite_check_and_unscale_.*GradScaler"):
        scaler.step(opt)


def test_preparation_refuses_what_would_not_step():
    model = mlp()
    opt = AdamW(model.named_parameters())
    with pytest.raises(ValueError, match="built with gradient_release=True, got AdamW"):
        prepare_gradient_release(model, opt)
    with pytest.raises(ValueError, match="not a qconf optimizer"):
        prepare_gradient_release(model, torch.optim.AdamW(model.parameters()))
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = AdamW([*model.parameters(), extra], gradient_release=True)
    with pytest.raises(ValueError, match="parameter 6 of the optimizer is not a parameter of the model"):
        prepare_gradient_release(model, opt)
    with pytest.raises(ValueError, match="has no gradient release hooks"):
        remove_gradient_release(model)
    with pytest.raises(ValueError, match="gradient_release must be True or False"):
        AdamW(model.parameters(), gradient_release="yes")


# ---------------------------------------------------------------------------------------------
# checkpoints: the same state dict, both directions, DCP

def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("direction", ["release_to_normal", "normal_to_release"])
def test_checkpoints_move_between_release_and_normal_runs(direction):
    batches = list(regression_batches(6, seed=8))
    reference = _make(weights="bf16_sr")
    _train(*reference, batches)
    first, second = (True, False) if direction == "release_to_normal" else (False, True)
    model, opt = _make(weights="bf16_sr", release=first)
    _train(model, opt, batches[:3])
    model2, opt2 = _make(weights="bf16_sr", release=second, seed=9)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(_roundtrip(opt.state_dict()))
    _train(model2, opt2, batches[3:])
    assert_same_run(reference, (model2, opt2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_resume_with_release_equals_the_normal_run(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    batches = list(regression_batches(6, seed=9))
    reference = _make(weights="bf16_kahan")
    _train(*reference, batches)
    model, opt = _make(weights="bf16_kahan", release=True)
    _train(model, opt, batches[:3])
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "ckpt"))
    model2, opt2 = _make(weights="bf16_kahan", release=True, seed=3)
    # a fresh optimizer: DCP creates its states with a zero-gradient, lr=0 step(), which gradient
    # release runs on the gradients DCP holds (and zero_grad() frees them)
    template = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    assert all(p.grad is None for p in model2.parameters())
    dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    model2.load_state_dict(template["model"])
    set_optimizer_state_dict(model2, opt2, template["optim"])
    _train(model2, opt2, batches[3:])
    assert_same_run(reference, (model2, opt2))


def test_a_compiled_model_releases_the_same_way():
    """torch.compile compiles the model's forward and backward; the gradients still reach the
    parameters through autograd's accumulation, where the hooks step them."""
    batches = list(regression_batches(3, seed=12))
    runs = []
    for release in (False, True):
        model, opt = _make(release=release)
        compiled = torch.compile(model)
        for x, y in batches:
            torch.nn.functional.mse_loss(compiled(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_run(*runs)
