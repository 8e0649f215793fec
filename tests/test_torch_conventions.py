"""torch.optim conventions the optimizer base keeps (issue 14): float64 and complex parameters,
``opt.state.clear()`` under the fused plan cache, duplicate parameters, deepcopy and pickle,
zero-size factored parameters. Muon (with its AdamW part) keeps them too."""
from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

from qconf.optim import SGD, Adam, AdamW, Lion, Muon

from helpers import CONFIGS, assert_same_state, flat_state

FP32 = CONFIGS / "fp32.yml"


def _lion_step(p, g, m, lr, betas, wd):
    """Lion (Chen et al. 2023, Algorithm 2) written out, in p's dtype (complex: on the real view)."""
    pr, gr, mr = (torch.view_as_real(t) if t.is_complex() else t for t in (p, g, m))
    pr.mul_(1 - lr * wd)
    pr.sub_(lr * torch.sign(betas[0] * mr + (1 - betas[0]) * gr))
    mr.mul_(betas[1]).add_((1 - betas[1]) * gr)


class _TorchMuonAdamW:
    """torch.optim.Muon for the real matrices, torch.optim.AdamW for the rest (complex matrices
    included): qconf Muon's routing of plain tensors, as two torch optimizers."""

    def __init__(self, params):
        mats = [p for p in params if p.dim() == 2 and not p.is_complex()]
        rest = [p for p in params if not (p.dim() == 2 and not p.is_complex())]
        self.opts = ([torch.optim.Muon(mats, lr=0.02, weight_decay=0.1)] if mats else []) + \
            [torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.05)]

    def step(self):
        for o in self.opts:
            o.step()


_RULES = {
    "AdamW": (lambda ps: AdamW(ps, lr=3e-3, weight_decay=0.05, qconfig=FP32),
              lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.05)),
    "Adam": (lambda ps: Adam(ps, lr=2e-3, weight_decay=0.01, maximize=True, qconfig=FP32),
             lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.01, maximize=True)),
    "SGD": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, qconfig=FP32),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "Lion": (lambda ps: Lion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, qconfig=FP32), None),
    "Muon": (lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, adamw={"lr": 3e-3, "weight_decay": 0.05}, qconfig=FP32),
             _TorchMuonAdamW),
}


def _run_pair(rule: str, dtype: torch.dtype, n_steps: int = 30):
    """The same params and gradients through qconf's ``rule`` (quantization off) and torch's."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(40, 7), (13,), (3, 5, 4)]
    init = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    ours = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone() for t in init]
    make_ours, make_torch = _RULES[rule]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float64/complex take the reference path (a warning under fused=None)
        opt = make_ours(ours)
    ref = make_torch([t.requires_grad_() for t in theirs]) if make_torch else None
    lion_m = [torch.zeros_like(t) for t in theirs]
    for _ in range(n_steps):
        grads = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        if ref is not None:
            ref.step()
        else:
            with torch.no_grad():
                for q, g, m in zip(theirs, grads, lion_m):
                    _lion_step(q, g, m, 1e-3, (0.9, 0.99), 0.1)
    return ours, theirs, opt


@pytest.mark.parametrize("rule", sorted(_RULES))
@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-12), (torch.complex128, 1e-12), (torch.complex64, 1e-5)])
def test_float64_and_complex_match_torch(rule, dtype, rel):
    ours, theirs, opt = _run_pair(rule, dtype)
    for p, q in zip(ours, theirs):
        assert p.dtype == dtype
        err = (p.detach() - q.detach()).abs().max().item()
        assert err <= rel * q.abs().max().item(), (rule, dtype, err)
    if dtype == torch.float64:  # states are kept in float64 too, as torch.optim keeps them
        for state in opt.state.values():
            assert all(v.dtype == torch.float64 for k, v in state.items() if k != "step")


def test_float64_param_is_not_rounded_through_a_narrow_type():
    """The issue's example: 70000 overflowed fp16 (inf) and pi lost its digits (3.140625)."""
    p = torch.tensor([70000.0, 3.14159265358979], dtype=torch.float64, requires_grad=True)
    expected = p.detach().clone()
    opt = AdamW([p], lr=1e-3, weight_decay=0.0, fused=False)  # default qconfig: 4-bit states
    p.grad = torch.tensor([1.0, -1.0], dtype=torch.float64)
    opt.step()
    # first Adam step: m_hat / sqrt(v_hat) = sign(g) up to eps and the 4-bit states' error
    expected -= 1e-3 * torch.tensor([1.0, -1.0], dtype=torch.float64)
    assert torch.isfinite(p).all()
    assert (p.detach() - expected).abs().max().item() < 1e-5
    assert p[1].item() != 3.140625


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_fused_true_refuses_float64_and_complex(dtype):
    p = torch.zeros(8, dtype=dtype, requires_grad=True)
    opt = AdamW([p], fused=True)
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=f"parameter 0 has dtype {dtype}"):
        opt.step()


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 3))


def _steps(model, opt, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("make", [lambda ps, f: AdamW(ps, fused=f), lambda ps, f: SGD(ps, lr=0.1, momentum=0.9, fused=f),
                                  lambda ps, f: Muon(ps, lr=0.02, fused=f)], ids=["AdamW", "SGD", "Muon"])
def test_state_clear_restarts_states_on_both_paths(make):
    """After opt.state.clear() the next step starts fresh states (torch's semantics); the fused
    path's cached plan must not keep updating the orphaned tensors."""
    runs = []
    for fused in (False, True):
        model = _model()
        opt = make(model.parameters(), fused)
        _steps(model, opt, 3)
        opt.state.clear()
        _steps(model, opt, 2, seed=2)
        runs.append((model, opt))
    (m_ref, o_ref), (m_fused, o_fused) = runs
    for pa, pb in zip(m_ref.parameters(), m_fused.parameters()):
        assert torch.equal(pa, pb)
    for o in (o_ref, o_fused):
        assert len(o.state) == 4
        assert all(s["step"].item() == 2 for s in o.state.values())
    saved = o_fused.state_dict()
    assert len(saved["state"]) == 4
    assert_same_state(flat_state(o_ref), flat_state(o_fused))


def test_duplicate_parameter_in_a_group_is_refused():
    w = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="param group 0 lists the same parameter twice"):
        AdamW([w, w])
    opt = AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="param group 1 lists the same parameter twice"):
        opt.add_param_group({"params": [("a", w), ("b", w)]})
    assert len(opt.param_groups) == 1
    # Muon: a group is split by rule first; each part is checked (matrices and vectors alike)
    m = torch.nn.Parameter(torch.zeros(3, 2))
    for params in ([w, w], [m, w, m]):
        with pytest.raises(ValueError, match="param group 0 lists the same parameter twice"):
            Muon(params)
    opt = Muon([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="param group 1 lists the same parameter twice"):
        opt.add_param_group({"params": [("a", m), ("b", m)]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("rule", ["AdamW", "Muon"])
@pytest.mark.parametrize("fused", [False, True])
def test_deepcopy_and_pickle_keep_qconf_settings(fused, rule):
    qconfig = {"states": {"exp_avg": {"rounding": "stochastic"}}}
    model = _model()
    if rule == "AdamW":
        opt = AdamW(model.named_parameters(), qconfig=qconfig, seed=7, fused=fused)
    else:  # its AdamW part's defaults and its route are settings of its own
        opt = Muon(model.named_parameters(), lr=0.02, adamw={"lr": 3e-3, "betas": (0.8, 0.9)},
                   route={"extra.*": "adamw"}, qconfig=qconfig, seed=7, fused=fused)
    _steps(model, opt, 2)
    model2, opt2 = copy.deepcopy((model, opt))
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    model3, opt3 = torch.load(buf, weights_only=False)
    model4, opt4 = pickle.loads(pickle.dumps((model, opt)))
    for o in (opt2, opt3, opt4):
        assert o.qconfig == opt.qconfig and o._seed == 7 and o.param_name(0) == "0.weight"
        assert o.defaults == opt.defaults
    for m, o in ((model, opt), (model2, opt2), (model3, opt3), (model4, opt4)):
        _steps(m, o, 2, seed=3)
    for m in (model2, model3, model4):
        for pa, pb in zip(model.parameters(), m.parameters()):
            assert torch.equal(pa, pb)
    if rule == "Muon":
        for o in (opt, opt2, opt3, opt4):
            assert o.routing() == {"0.weight": "muon", "1.weight": "muon", "0.bias": "adamw", "1.bias": "adamw"}
            o.add_param_group({"params": [("extra.weight", torch.nn.Parameter(torch.zeros(3, 3))),
                                          ("more.weight", torch.nn.Parameter(torch.zeros(3, 3)))]})
            assert o.routing()["extra.weight"] == "adamw" and o.routing()["more.weight"] == "muon"
            assert [(g["use_muon"], g["lr"], g.get("betas")) for g in o.param_groups[2:]] == [
                (True, 0.02, None), (False, 3e-3, (0.8, 0.9))]


@pytest.mark.parametrize("shape", [(5, 0), (3, 0, 4), (0, 6), (0,)])
def test_zero_size_factored_params_step_on_both_paths(shape):
    runs = []
    for fused in (False, True):
        empty = torch.zeros(shape, requires_grad=True)
        other = torch.ones(6, 4, requires_grad=True)
        opt = AdamW([empty, other], factor_second_moment=True, fused=fused)
        for _ in range(2):
            empty.grad, other.grad = torch.zeros_like(empty), torch.full_like(other, 0.5)
            opt.step()
        runs.append((other.detach().clone(), opt.state[empty]))
    (o_ref, s_ref), (o_fused, s_fused) = runs
    assert torch.equal(o_ref, o_fused)
    assert s_ref.keys() == s_fused.keys()
    for k in s_ref:
        a, b = s_ref[k], s_fused[k]
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else torch.equal(a.codes, b.codes)), k
    assert s_fused["step"].item() == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_float64_and_complex_checkpoints_round_trip_with_torch(dtype):
    """torch.optim's state of a float64/complex parameter loads into qconf (complex states become
    their real view) and qconf's exports back in torch's form; both continue as torch does."""
    from qconf.optim import export_torch_state_dict
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(6, 5, generator=gen, dtype=dtype)
    grads = [torch.randn(6, 5, generator=gen, dtype=dtype) for _ in range(6)]
    a, b = init.clone().requires_grad_(), init.clone().requires_grad_()
    ref = torch.optim.AdamW([b], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = AdamW([a], lr=1e-2, qconfig=FP32)
        for g in grads[:3]:
            a.grad, b.grad = g.clone(), g.clone()
            ours.step()
            ref.step()
        fresh = AdamW([a], lr=1e-2, qconfig=FP32)
        fresh.load_state_dict(ref.state_dict())  # torch -> qconf
        back = torch.optim.AdamW([b], lr=1e-2)
        back.load_state_dict(export_torch_state_dict(ours))  # qconf -> torch
        exported = back.state_dict()["state"][0]
        assert exported["exp_avg"].dtype == dtype and exported["exp_avg"].shape == (6, 5)
        for g in grads[3:]:
            a.grad, b.grad = g.clone(), g.clone()
            fresh.step()
            back.step()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (a.detach() - b.detach()).abs().max().item() <= tol * b.abs().max().item()
