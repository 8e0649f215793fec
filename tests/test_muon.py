"""qconf.optim.Muon: torch.optim.Muon's algorithm with quantization off, fused == reference bit
for bit under every codec, Newton–Schulz equal to torch's, argument checks."""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from qconf import _native
from qconf.codec import QTensor
from qconf.optim import Muon
from qconf.optim.newton_schulz import zeropower

from helpers import CONFIGS

FP32 = CONFIGS / "fp32.yml"
FUSED = [False, True] if _native.fused_available() else [False]
#: (rows, cols): tall (transposed for Newton–Schulz), wide, square, and sizes that leave vector tails
SHAPES = [(48, 20), (20, 48), (32, 32), (37, 53), (129, 7)]


def _grads(shapes, steps, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(steps)]


def _params(shapes, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _run(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def _assert_equal(ours, theirs):
    for a, b in zip(ours, theirs):
        assert torch.equal(a.detach(), b.detach()), f"max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_quantization_off_equals_torch_muon_after_20_steps(fused, adjust_lr_fn, nesterov):
    """Bit for bit: the kernels compute torch's lerps and add_(alpha=) as its CPU kernels do (fused
    multiply-adds) and Newton–Schulz is the same bf16 torch calls."""
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours, theirs = _params(SHAPES), _params(SHAPES)
    grads = _grads(SHAPES, 20)
    _run(Muon(ours, qconfig=FP32, fused=fused, **kw), ours, grads)
    _run(torch.optim.Muon(theirs, **kw), theirs, grads)
    _assert_equal(ours, theirs)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("momentum", [0.3, 0.0])
def test_small_momentum_takes_the_other_lerp_form(fused, momentum):
    kw = dict(lr=0.01, weight_decay=0.0, momentum=momentum, ns_steps=3, ns_coefficients=(3.0, -3.2, 1.2), eps=1e-6)
    ours, theirs = _params(SHAPES[:3]), _params(SHAPES[:3])
    grads = _grads(SHAPES[:3], 20, seed=5)
    _run(Muon(ours, qconfig=FP32, fused=fused, **kw), ours, grads)
    _run(torch.optim.Muon(theirs, **kw), theirs, grads)
    _assert_equal(ours, theirs)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_bf16_parameters_step_as_torch_muon_in_fp32_rounded_once(fused, adjust_lr_fn):
    """qconf steps a bf16 parameter in fp32 (fp32 momentum) and rounds once: each step equals
    torch.optim.Muon run on the fp32 copy of the parameter and gradient, rounded to bf16."""
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    ours = _params(SHAPES, dtype=torch.bfloat16)
    oracle = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt, torch_opt = Muon(ours, qconfig=FP32, fused=fused, **kw), torch.optim.Muon(oracle, **kw)
    for step_grads in _grads(SHAPES, 20, dtype=torch.bfloat16):
        for p, q, g in zip(ours, oracle, step_grads):
            p.grad, q.grad = g.clone(), g.float()
            q.data.copy_(p.detach().float())
        opt.step()
        torch_opt.step()
        for p, q in zip(ours, oracle):
            assert torch.equal(p.detach(), q.detach().bfloat16())


@pytest.mark.parametrize("fused", [None, False])
def test_float64_parameters_step_in_float64_as_torch_muon(fused):
    """fp64 is not fused: fused=None takes the reference path (with a warning), which keeps an
    fp64 momentum, as torch's does."""
    ours, theirs = _params(SHAPES[:3], dtype=torch.float64), _params(SHAPES[:3], dtype=torch.float64)
    grads = _grads(SHAPES[:3], 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run(Muon(ours, qconfig=FP32, fused=fused), ours, grads)
    _run(torch.optim.Muon(theirs), theirs, grads)
    _assert_equal(ours, theirs)


def test_newton_schulz_is_torchs_bit_for_bit():
    from torch.optim._muon import _zeropower_via_newtonschulz
    for shape in SHAPES:
        g = torch.randn(shape)
        ours = zeropower(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert ours.dtype == torch.bfloat16 and ours.shape == g.shape
        assert torch.equal(ours, _zeropower_via_newtonschulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7))


CODEC_CASES = {
    "fp32": FP32,
    "8bit-linear": {"base": str(CONFIGS / "muon_8bit.yml"), "min_numel": 0},
    "4bit-group": {"base": str(CONFIGS / "default.yml"), "min_numel": 0},
    "4bit-rank1": {"min_numel": 0, "states": {"exp_avg": {"bits": 4, "map": "nonlinear", "scale": "rank1"}}},
    "4bit-tensor-sr": {"min_numel": 0, "states": {"exp_avg": {"bits": 4, "map": "linear", "scale": "tensor",
                                                              "rounding": "stochastic"}}},
    "3bit-dim0": {"min_numel": 0, "states": {"exp_avg": {"bits": 3, "map": "power-1", "scale": "dim0"}}},
}


def _fused_vs_reference(qconfig, dtype=torch.float32, steps=5, **kw):
    a, b = _params(SHAPES, dtype=dtype), _params(SHAPES, dtype=dtype)
    grads = _grads(SHAPES, steps, seed=3, dtype=dtype)
    opt_a = Muon(a, lr=0.02, qconfig=qconfig, fused=True, seed=11, **kw)
    opt_b = Muon(b, lr=0.02, qconfig=qconfig, fused=False, seed=11, **kw)
    _run(opt_a, a, grads)
    _run(opt_b, b, grads)
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
    for p, q in zip(a, b):
        for key in ("momentum_buffer", "kahan_comp"):
            sa, sb = opt_a.state[p].get(key), opt_b.state[q].get(key)
            if isinstance(sa, QTensor):
                assert torch.equal(sa.codes, sb.codes) and torch.equal(sa.scales, sb.scales)
            elif sa is not None:
                assert torch.equal(sa, sb)
        assert int(opt_a.state[p]["step"]) == int(opt_b.state[q]["step"]) == steps
    return opt_a


@pytest.mark.skipif(not _native.fused_available(), reason="native extension not built")
@pytest.mark.parametrize("case", sorted(CODEC_CASES))
@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_equals_reference_bit_for_bit(case, nesterov):
    opt = _fused_vs_reference(CODEC_CASES[case], nesterov=nesterov, weight_decay=0.05)
    quantized = [isinstance(opt.state[p]["momentum_buffer"], QTensor) for p in opt.param_groups[0]["params"]]
    assert any(quantized) == (case != "fp32")


@pytest.mark.skipif(not _native.fused_available(), reason="native extension not built")
@pytest.mark.parametrize("weights", ["nearest", "sr", "kahan", "sr-kahan-q8"])
def test_fused_equals_reference_bf16_weights_policies(weights):
    cfg = {"min_numel": 0, "states": {"exp_avg": {"bits": 8, "map": "linear", "group_size": 256}}}
    if weights in ("kahan", "sr-kahan-q8"):
        cfg["weights"] = {"compensation": "kahan"}
    if weights == "sr-kahan-q8":
        cfg["weights"]["compensation_codec"] = {"bits": 8, "map": "linear", "signed": True, "scale": "group",
                                                "group_size": 128}
    opt = _fused_vs_reference(cfg, dtype=torch.bfloat16, bf16_stochastic_round=weights.startswith("sr"))
    p = opt.param_groups[0]["params"][0]
    assert ("kahan_comp" in opt.state[p]) == ("kahan" in weights)


def test_state_is_the_exp_avg_section_and_step_count():
    p = _params([(64, 128)])[0]
    opt = Muon([p], qconfig=CONFIGS / "muon_8bit.yml")
    p.grad = torch.randn(64, 128)
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    assert isinstance(buf, QTensor) and buf.codec.bits == 8 and buf.codec.map == "linear"
    assert int(opt.state[p]["step"]) == 1


@pytest.mark.parametrize("kwargs,needle", [
    ({"ns_steps": 100}, "ns_steps must be a whole number in [0, 99]"),
    ({"ns_steps": -1}, "ns_steps"),
    ({"ns_steps": 2.5}, "ns_steps"),
    ({"ns_coefficients": (1.0, 2.0)}, "exactly 3 values"),
    ({"ns_coefficients": (1.0, float("nan"), 2.0)}, "ns_coefficients[1]"),
    ({"adjust_lr_fn": "rms"}, "Adjust learning rate function 'rms' is not supported"),
    ({"momentum": -0.1}, "Invalid momentum value"),
    ({"lr": -1.0}, "Invalid learning rate"),
    ({"eps": float("inf")}, "epsilon"),
    ({"nesterov": 1}, "nesterov must be True or False"),
    ({"adamw": {"betas": (0.9, 1.5)}}, "Invalid beta parameter at index 1"),
    ({"adamw": {"momentum": 0.9}}, "adamw: unknown key(s) ['momentum']"),
    ({"route": {"*.w": "sgd"}}, "to 'muon' or 'adamw'"),
])
def test_arguments_are_checked(kwargs, needle):
    with pytest.raises(ValueError) as e:
        Muon(_params([(8, 8)]), **kwargs)
    assert needle in str(e.value)


@pytest.mark.parametrize("fused", FUSED)
def test_non_finite_gradients_behave_as_torch_muon(fused):
    ours, theirs = _params([(16, 24)]), _params([(16, 24)])
    opt, torch_opt = Muon(ours, qconfig=FP32, fused=fused), torch.optim.Muon(theirs)
    g = torch.randn(16, 24)
    g[3, 5] = float("nan")
    for p, o in ((ours[0], opt), (theirs[0], torch_opt)):
        p.grad = g.clone()
        o.step()
    assert torch.isnan(ours[0]).all() and torch.isnan(theirs[0]).all()  # Newton–Schulz spreads a NaN everywhere


def test_deepcopy_and_pickle_keep_the_routing_settings():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = Muon(model.named_parameters(), adamw={"lr": 3e-4}, route={"1.*": "adamw"})
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.routing() == opt.routing() == {"0.weight": "muon", "0.bias": "adamw", "1.weight": "adamw",
                                                    "1.bias": "adamw"}
        assert clone._adamw_defaults["lr"] == 3e-4
