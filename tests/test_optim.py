"""Optimizers on the reference path: parity with torch.optim, API surface, overrides, memory."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import qconf
from qconf.codec import QTensor
from qconf.optim import SGD, Adam, AdamW, Lion

from helpers import CONFIGS, assert_rel_close, mlp, regression_batches, train_steps

FP32 = CONFIGS / "fp32.yml"
DEFAULT = CONFIGS / "default.yml"
EIGHT = CONFIGS / "8bit.yml"


def _lion_reference(params, lr, betas, wd, grads_fn, n_steps):
    """A written-out Lion (Chen et al. 2023, Algorithm 2) for parity checks."""
    m = [torch.zeros_like(p) for p in params]
    for step in range(n_steps):
        grads = grads_fn(step)
        for p, g, mi in zip(params, grads, m):
            p.mul_(1 - lr * wd)
            c = betas[0] * mi + (1 - betas[0]) * g
            p.sub_(lr * torch.sign(c))
            mi.mul_(betas[1]).add_((1 - betas[1]) * g)


@pytest.mark.parametrize("make_ours,make_torch", [
    (lambda ps: AdamW(ps, lr=3e-3, weight_decay=0.05, qconfig=FP32, fused=False),
     lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.05)),
    (lambda ps: AdamW(ps, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, maximize=True, qconfig=FP32, fused=False),
     lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, maximize=True)),
    (lambda ps: Adam(ps, lr=2e-3, weight_decay=0.01, qconfig=FP32, fused=False),
     lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.01)),
    (lambda ps: SGD(ps, lr=0.05, momentum=0.9, qconfig=FP32, fused=False),
     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    (lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, qconfig=FP32, fused=False),
     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (lambda ps: SGD(ps, lr=0.05, momentum=0.5, dampening=0.3, maximize=True, qconfig=FP32, fused=False),
     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, dampening=0.3, maximize=True)),
    (lambda ps: SGD(ps, lr=0.05, qconfig=FP32, fused=False), lambda ps: torch.optim.SGD(ps, lr=0.05)),
])
def test_quantization_off_matches_torch_for_100_steps(make_ours, make_torch):
    a, b = mlp(0), mlp(0)
    opt_a, opt_b = make_ours(a.parameters()), make_torch(b.parameters())
    train_steps(a, opt_a, 100)
    train_steps(b, opt_b, 100)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel_close(pa, pb, 1e-6)


def test_lion_quantization_off_matches_written_reference():
    a, b = mlp(0), mlp(0)
    opt = Lion(a.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, qconfig=FP32, fused=False)
    grads = []
    train_steps(a, opt, 100, on_step=lambda i: grads.append([p.grad.clone() for p in a.parameters()]))
    with torch.no_grad():
        _lion_reference(list(b.parameters()), 1e-3, (0.9, 0.99), 0.1, lambda s: grads[s], 100)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel_close(pa, pb, 1e-6)


# ---------------------------------------------------------------------------------------------
# argument validation mirrors torch.optim
@pytest.mark.parametrize("ctor,kwargs,needle", [
    (AdamW, {"lr": -1.0}, "Invalid learning rate: -1.0"),
    (AdamW, {"eps": -1e-8}, "Invalid epsilon value"),
    (AdamW, {"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0"),
    (Adam, {"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1"),
    (Adam, {"weight_decay": -0.1}, "Invalid weight_decay value"),
    (AdamW, {"amsgrad": True}, "amsgrad=True is not supported"),
    (AdamW, {"differentiable": True}, "differentiable=True is not supported"),
    (AdamW, {"capturable": True}, "capturable=True"),
    (SGD, {"momentum": -0.5}, "Invalid momentum value"),
    (SGD, {"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening"),
    (SGD, {"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "Nesterov momentum requires"),
    (Lion, {"betas": (0.9, 1.5)}, "Invalid beta parameter at index 1"),
    (AdamW, {"fused": "yes"}, "fused must be None, True or False"),
])
def test_argument_validation(ctor, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ctor(mlp().parameters(), **kwargs)


def test_torch_defaults_are_kept():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert AdamW(p, fused=False).defaults["weight_decay"] == torch.optim.AdamW(p).defaults["weight_decay"]
    assert Adam(p, fused=False).defaults["weight_decay"] == 0
    assert SGD(p, fused=False).defaults["lr"] == torch.optim.SGD(p).defaults["lr"]
    assert Lion(p, fused=False).defaults["lr"] == 1e-4


# ---------------------------------------------------------------------------------------------
# params: iterables, groups, named_parameters, frozen and grad-less params
def test_param_groups_with_per_group_hyperparameters_match_torch():
    a, b = mlp(1), mlp(1)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 1e-2, "betas": (0.8, 0.9)},
                {"params": list(m[2].parameters()) + list(m[4].parameters()), "weight_decay": 0.3}]

    train_steps(a, AdamW(groups(a), lr=1e-3, qconfig=FP32, fused=False), 20)
    train_steps(b, torch.optim.AdamW(groups(b), lr=1e-3), 20)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel_close(pa, pb, 1e-6)


def test_named_parameters_feed_config_overrides():
    model = mlp()
    cfg = {"min_numel": 0, "overrides": [{"match": "2.*", "enable": False},
                                         {"match": "re:4\\.(weight|bias)", "states": {"exp_avg_sq": {"bits": 8}}}]}
    opt = AdamW(model.named_parameters(), qconfig=cfg, fused=False)
    train_steps(model, opt, 1)
    st = {name: opt.state[p] for name, p in model.named_parameters()}
    assert isinstance(st["0.weight"]["exp_avg"], QTensor) and st["0.weight"]["exp_avg"].codec.bits == 4
    assert not isinstance(st["2.weight"]["exp_avg"], QTensor) and st["2.weight"]["exp_avg"].dtype == torch.float32
    assert st["4.weight"]["exp_avg_sq"].codec.bits == 8 and st["4.bias"]["exp_avg_sq"].codec.bits == 8
    assert opt.param_name(2) == "2.weight"


def test_named_param_groups():
    model = mlp()
    opt = AdamW([{"params": list(model[0].named_parameters()), "lr": 0.1},
                 {"params": list(model[2].named_parameters())}], qconfig=FP32, fused=False)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]


def test_frozen_and_gradless_params_are_skipped():
    model = mlp()
    model[0].weight.requires_grad_(False)
    extra = torch.nn.Parameter(torch.randn(5000))  # never receives a gradient
    opt = AdamW(list(model.parameters()) + [extra], qconfig=DEFAULT, fused=False)
    before = model[0].weight.clone(), extra.clone()
    train_steps(model, opt, 3)
    assert torch.equal(model[0].weight, before[0]) and torch.equal(extra, before[1])
    assert model[0].weight not in opt.state and extra not in opt.state
    assert len(opt.state) == 5


def test_zero_grad_and_closure():
    model = mlp()
    opt = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    x, y = torch.randn(8, 64), torch.randn(8, 10)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure).item()
    for _ in range(20):
        last = opt.step(closure).item()
    assert last < first
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_fused_argument_without_extension(monkeypatch):
    from qconf import _native

    monkeypatch.setattr(_native, "fused_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"AdamW\(fused=True\) needs the native extension"):
        AdamW(mlp().parameters(), fused=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        AdamW(mlp().parameters(), fused=None)
    assert len([x for x in w if "reference path" in str(x.message)]) == 1


# ---------------------------------------------------------------------------------------------
# training utilities
def test_lr_scheduler_and_grad_clipping_match_torch():
    a, b = mlp(2), mlp(2)
    oa = AdamW(a.parameters(), lr=1e-2, qconfig=FP32, fused=False)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for model, opt in ((a, oa), (b, ob)):
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
        for x, y in regression_batches(30, 0):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            sched.step()
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"]
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel_close(pa, pb, 1e-6)


def test_grad_scaler_including_skipped_steps():
    model = mlp()
    opt = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = torch.randn(8, 64), torch.randn(8, 10)
    for i in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if i == 3:  # an overflow: the step must be skipped and nothing may change
            model[0].weight.grad[0, 0] = float("inf")
            snapshot = copy.deepcopy(opt.state_dict()), [p.clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if i == 3:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), snapshot[1]))
            assert int(opt.state[model[0].weight]["step"]) == 3
    assert int(opt.state[model[0].weight]["step"]) == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ctor", [AdamW, SGD, Lion])
def test_low_precision_params_keep_fp32_math(dtype, ctor):
    kwargs = {"momentum": 0.9, "lr": 0.05} if ctor is SGD else {"lr": 1e-3}
    model = mlp(dtype=dtype)
    opt = ctor(model.parameters(), qconfig=DEFAULT, fused=False, **kwargs)
    losses = train_steps(model, opt, 30, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    assert losses[-1] < losses[0]
    for p in model.parameters():
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert v.dtype == torch.float32  # unquantized states are kept in fp32


# ---------------------------------------------------------------------------------------------
# override_quantize_enable
def test_override_quantize_enable_before_and_after_states_exist():
    model = mlp()
    opt = AdamW(model.parameters(), qconfig=DEFAULT, fused=False)
    opt.override_quantize_enable(model[2], "bias", True)  # 96 elements: below min_numel, forced on
    train_steps(model, opt, 2)
    assert isinstance(opt.state[model[2].bias]["exp_avg"], QTensor)
    w = model[0].weight
    before = opt.state[w]["exp_avg"].decode()
    opt.override_quantize_enable(model[0], "weight", False)  # converted on the spot
    assert not isinstance(opt.state[w]["exp_avg"], QTensor)
    assert torch.equal(opt.state[w]["exp_avg"], before)
    train_steps(model, opt, 1)
    assert not isinstance(opt.state[w]["exp_avg"], QTensor)
    opt.override_quantize_enable(model[0], "weight", True)
    assert isinstance(opt.state[w]["exp_avg"], QTensor)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["qconf"]["enable_overrides"] == [[0, True], [3, True]]


def test_override_quantize_enable_errors():
    model = mlp()
    opt = AdamW(model[0].parameters(), fused=False)
    with pytest.raises(ValueError, match="no tensor attribute 'weigth'"):
        opt.override_quantize_enable(model[0], "weigth", False)
    with pytest.raises(ValueError, match="is not optimized by this optimizer"):
        opt.override_quantize_enable(model[2], "weight", False)


# ---------------------------------------------------------------------------------------------
# factored second moment ("4-bit Factor")
def test_factored_second_moment_states_and_math():
    model = mlp()
    opt = AdamW(model.parameters(), lr=1e-3, factor_second_moment=True, qconfig=DEFAULT, fused=False)
    w, bias = model[0].weight, model[0].bias
    train_steps(model, opt, 1)
    st = opt.state[w]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq_row", "exp_avg_sq_col"}
    assert st["exp_avg_sq_row"].shape == (96,) and st["exp_avg_sq_col"].shape == (64,)
    assert isinstance(st["exp_avg"], QTensor)
    assert "exp_avg_sq" in opt.state[bias]  # 1-D params keep a dense second moment
    g2 = w.grad.float() ** 2  # first step: r = (1 - b2) mean(g^2), c likewise
    torch.testing.assert_close(st["exp_avg_sq_row"], 0.001 * g2.mean(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(st["exp_avg_sq_col"], 0.001 * g2.mean(-2), rtol=1e-5, atol=0)
    from qconf.optim.states import factored_dense

    dense = factored_dense(st["exp_avg_sq_row"], st["exp_avg_sq_col"])
    expect = (st["exp_avg_sq_row"] / st["exp_avg_sq_row"].mean())[:, None] * st["exp_avg_sq_col"][None, :]
    torch.testing.assert_close(dense, expect)
    assert not factored_dense(torch.zeros(3), torch.zeros(4)).isnan().any()


def test_factored_with_quantization_off_is_adafactor_like_adam():
    """With fp32.yml the factored optimizer equals a hand-written factored Adam."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 20))
    ref = w.detach().clone()
    opt = AdamW([w], lr=1e-2, weight_decay=0.0, factor_second_moment=True, qconfig=FP32, fused=False)
    m, r, c = torch.zeros(12, 20), torch.zeros(12), torch.zeros(20)
    for t in range(1, 11):
        g = torch.randn(12, 20)
        w.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        r = 0.999 * r + 0.001 * (g * g).mean(1)
        c = 0.999 * c + 0.001 * (g * g).mean(0)
        v = (r / r.mean())[:, None] * c[None, :]
        ref -= 1e-2 / (1 - 0.9**t) * m / (v.sqrt() / (1 - 0.999**t) ** 0.5 + 1e-8)
    torch.testing.assert_close(w.detach(), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# memory
def test_memory_report_4096_square_default_config():
    p = torch.nn.Parameter(torch.zeros(4096, 4096))
    opt = AdamW([p], qconfig=DEFAULT, fused=False)
    planned = qconf.memory_report(opt)
    assert planned.bytes_per_param <= 1.07
    p.grad = torch.randn(4096, 4096) * 1e-3
    opt.step()
    actual = sum(v.nbytes if isinstance(v, QTensor) else v.numel() * v.element_size()
                 for k, v in opt.state[p].items() if k != "step")
    assert actual / p.numel() <= 1.07
    report = qconf.memory_report(opt)
    assert report.total_bytes == actual == planned.total_bytes
    assert report.fp32_bytes == 8 * p.numel()
    text = str(report)
    assert "exp_avg_sq" in text and "B/param" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_report_training_bytes(dtype):
    """params + grads + states: every gradient normally, the largest one with gradient release."""
    model = mlp(dtype=dtype)
    size = 4 if dtype == torch.float32 else 2
    numel = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    for release, grads in ((False, numel * size), (True, largest * size)):
        opt = AdamW(model.named_parameters(), qconfig=DEFAULT, gradient_release=release)
        rep = qconf.memory_report(opt)
        assert rep.gradient_release is release and rep.param_bytes == numel * size and rep.grad_bytes == grads
        assert rep.train_bytes == numel * size + grads + rep.total_bytes
        assert rep.train_bytes_per_param == pytest.approx(rep.train_bytes / numel)
        assert rep.to_dict()["train_bytes_per_param"] == rep.train_bytes_per_param
        assert f"{rep.train_bytes_per_param:.2f} B/param" in str(rep)
        assert ("the largest gradient: gradient release" in str(rep)) is release


def test_memory_report_plans_a_bf16_kahan_buffer_at_2_bytes():
    p = torch.nn.Parameter(torch.randn(64, 96).bfloat16())
    opt = AdamW([p], qconfig={"base": "default", "min_numel": 0, "weights": {"compensation": "kahan"}})
    planned = qconf.memory_report(opt).rows[0].states["kahan_comp"]
    p.grad = torch.randn(64, 96).bfloat16()
    opt.step()
    assert planned == qconf.memory_report(opt).rows[0].states["kahan_comp"] == 2 * p.numel()


def test_memory_report_rows_and_totals():
    model = mlp()
    opt = SGD(model.named_parameters(), lr=0.1, momentum=0.9, qconfig=EIGHT, fused=False)
    rep = qconf.memory_report(opt)
    names = [r.name for r in rep.rows]
    assert names == [n for n, _ in model.named_parameters()]
    w_row = rep.rows[0]
    assert w_row.states["momentum_buffer"] == 96 * 64 + 4 * 24  # 8-bit codes + group-256 scales
    b_row = rep.rows[1]
    assert b_row.states["momentum_buffer"] == 4 * 96  # below min_numel: fp32
    assert rep.total_bytes == sum(sum(r.states.values()) for r in rep.rows)
    assert rep.to_dict()["total_bytes"] == rep.total_bytes


