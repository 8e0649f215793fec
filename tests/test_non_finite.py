"""NaN / Inf values and overflowing gradients damage only their own element (issue 14, item 2).

A block's scale is the absmax of its finite elements (qconf/codec/scales.py): one NaN or Inf
element -- or a huge finite gradient whose square overflows the fp32 second moment -- must leave
every other element of its block (and of the parameter) as it would be without it, on the
reference path, the native encode and the fused step, where it used to turn the whole block NaN.
"""
from __future__ import annotations

import math

import pytest
import torch

from qconf import _native
from qconf.codec import MAP_NAMES, SCALE_TYPES, Codec, packing
from qconf.codec.scales import expand_scales
from qconf.optim import SGD, AdamW

from helpers import CONFIGS

NATIVE = _native.fused_available()
BACKENDS = ["reference"] + (["native"] if NATIVE else [])
FUSED = [False] + ([True] if NATIVE else [])

# ---------------------------------------------------------------------------------------------
# codec level: the other elements of a block with NaN / +-Inf encode exactly as with a 0 there

# (5, 7) lies in an all-zero row: a zero block for group/dim0 (and a zero row maximum for rank1),
# where the Inf encodes as 0 (scale 0 decodes to zeros); in the other layouts it saturates
BAD = {(1, 5): math.nan, (3, 0): math.inf, (3, 9): -math.inf, (4, 63): math.inf, (5, 7): math.inf}


def _codes(q) -> torch.Tensor:
    return packing.unpack(q.codes, q.codec.bits, q.numel()).reshape(q.shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("scale", SCALE_TYPES)
@pytest.mark.parametrize("map,signed", [("nonlinear", True), ("power-1", False), ("linear", True),
                                        ("nonlinear-nozero", False)])
def test_non_finite_elements_leave_the_rest_of_their_block_unchanged(map, signed, scale, rounding, backend):
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(6, 64, generator=g)
    clean = clean if signed else clean.abs()
    clean[5] = 0.0
    for idx in BAD:
        clean[idx] = 0.0
    x = clean.clone()
    for idx, v in BAD.items():
        x[idx] = v
    noise = torch.rand(x.numel(), generator=g)
    for bits in (4, 8):
        c = Codec(bits=bits, map=map, signed=signed, scale=scale, group_size=64, rounding=rounding)
        q_bad = c.encode(x, noise=noise, backend=backend)
        q_ref = c.encode(clean, noise=noise, backend=backend)
        assert torch.equal(q_bad.scales, q_ref.scales) and torch.isfinite(q_bad.scales).all()
        elem_scale = expand_scales(q_ref.scales, (6, 64), scale, 64)
        # NaN is encoded as 0 is; +-Inf saturate to the map's ends where the scale is not 0
        saturated = torch.zeros_like(x, dtype=torch.bool)
        for idx, v in BAD.items():
            saturated[idx] = math.isinf(v) and bool(elem_scale[idx] > 0)
        assert torch.equal(_codes(q_bad)[~saturated], _codes(q_ref)[~saturated]), bits
        y = c.decode(q_bad, backend=backend)
        assert torch.isfinite(y).all()
        assert torch.equal(y[~saturated], c.decode(q_ref, backend=backend)[~saturated])
        ends = torch.where(x > 0, c.qmap[-1], c.qmap[0]) * elem_scale
        assert torch.equal(y[saturated], ends[saturated]), bits


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_takes_the_code_nearest_zero(backend):
    # a signed map's code 0 is its most negative value: NaN must not decode to -scale
    for name in MAP_NAMES:
        for signed in (True, False) if name != "ternary" else (True,):  # ternary: 2-bit signed only
            c = Codec(bits=4 if name != "ternary" else 2, map=name, signed=signed, scale="tensor")
            x = torch.tensor([0.5, math.nan, -0.25 if signed else 0.25])
            y = c.decode(c.encode(x, backend=backend))
            zero = c.decode(c.encode(torch.where(torch.isnan(x), 0.0, x), backend=backend))
            assert torch.equal(y, zero), (name, signed)
            assert y[1].abs() == c.qmap.abs().min() * 0.5, (name, signed)  # |nearest map value to 0| * scale


# ---------------------------------------------------------------------------------------------
# optimizer level: two AdamW steps, one element of the gradient bad at the first, against a run
# where that element's gradient is 0 (so the other elements' blocks see the same values)

SHAPE = (64, 128)  # 8192 > min_numel: quantized; one row = one block of 128
BOTH_GROUP128 = None  # qconfig=None: both states 4-bit group-128 (lpmm's defaults)
FP32_M = {"states": {"exp_avg": {"enable": False}}}  # only the second moment is quantized


def _steps(qconfig, fused, bad: dict, steps=2, **kw):
    """(param, optimizer) after `steps` AdamW steps; gradient element idx is `bad[idx]` at the
    first step and 0 afterwards, every other element is the same random value in every run."""
    p = torch.nn.Parameter(torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)))
    opt = AdamW([p], lr=1e-3, weight_decay=0.01, qconfig=qconfig, fused=fused, **kw)
    for step in range(steps):
        grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + step)) * 1e-2
        for idx, v in bad.items():
            grad[idx] = v if step == 0 else 0.0
        p.grad = grad
        opt.step()
    return p.detach(), opt


def _state(opt) -> dict:
    return opt.state[opt.param_groups[0]["params"][0]]


def _others(bad_idx) -> torch.Tensor:
    keep = torch.ones(SHAPE, dtype=torch.bool)
    for idx in bad_idx:
        keep[idx] = False
    return keep


def _compare(run, normal, bad_idx, damaged_rows=()):
    """Every element but `bad_idx` is bit-identical to the normal run (parameter, states, scales),
    except in the rows (blocks) `damaged_rows` of exp_avg and of the parameter, whose elements
    must be finite and within 2 * lr of it."""
    (p, opt), (p0, opt0) = run, normal
    keep = _others(bad_idx)
    exact = keep.clone()
    exact[list(damaged_rows)] = False
    assert torch.isfinite(p[keep]).all()
    assert torch.equal(p[exact], p0[exact])
    assert ((p - p0)[keep & ~exact].abs() <= 2e-3).all()
    for name, s in _state(opt).items():
        s0 = _state(opt0)[name]
        if name == "step":
            continue
        if isinstance(s, torch.Tensor):
            assert torch.equal(s[keep], s0[keep]), name
            continue
        mask = exact if name == "exp_avg" else keep
        assert torch.isfinite(s.scales).all() and torch.isfinite(s.decode()).all(), name
        assert torch.equal(s.scales[mask.all(dim=1)], s0.scales[mask.all(dim=1)]), name
        assert torch.equal(_codes(s)[mask], _codes(s0)[mask]), name


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("qconfig", [BOTH_GROUP128, FP32_M], ids=["group128", "fp32_m"])
def test_huge_finite_gradient_element_damages_only_itself(qconfig, fused):
    # (3e19 * 3e19) * (1 - b2) overflows: v = inf for that element, whose update is m / inf = 0
    k = (10, 17)
    run = _steps(qconfig, fused, {k: 3e19})
    normal = _steps(qconfig, fused, {k: 0.0})
    # its m (3e18) is a legitimate maximum of its exp_avg block: the rest of that block rounds
    # to the code nearest 0 (finite, close); every other block and all of v are bit-identical
    _compare(run, normal, [k], damaged_rows=[10] if qconfig is BOTH_GROUP128 else [])
    # the first step updates in fp32 from zero states, so it is the fp32 run's, bit for bit: the
    # element's v is Inf and its update m / Inf = 0 (only the decoupled decay applies; torch's
    # addcmul scales by 1 - b2 before squaring and overflows only above ~5.8e20)
    p1, _ = _steps(qconfig, fused, {k: 3e19}, steps=1)
    p1_fp32, _ = _steps(str(CONFIGS / "fp32.yml"), fused, {k: 3e19}, steps=1)
    assert torch.equal(p1, p1_fp32)
    p0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    assert p1[k] == p0[k] * (1 - 1e-3 * 0.01)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("qconfig", [BOTH_GROUP128, FP32_M], ids=["group128", "fp32_m"])
def test_nan_gradient_element_damages_only_itself(qconfig, fused):
    # NaN makes the element's parameter NaN (as torch); its states encode as 0 would, so the
    # rest of the tensor -- its block included -- is bit-identical to a run with a 0 gradient
    k = (20, 3)
    run = _steps(qconfig, fused, {k: math.nan})
    _compare(run, _steps(qconfig, fused, {k: 0.0}), [k])
    assert math.isnan(run[0][k].item())


@pytest.mark.parametrize("fused", FUSED)
def test_inf_gradient_elements_damage_only_themselves(fused):
    # after one step everything else is bit-identical; the saturated states then decode to their
    # block's largest value, so in the second step their blocks' scales may move (finite, close)
    bad = {(30, 1): math.inf, (40, 2): -math.inf}
    zero = {k: 0.0 for k in bad}
    _compare(_steps(BOTH_GROUP128, fused, bad, steps=1), _steps(BOTH_GROUP128, fused, zero, steps=1), list(bad))
    run, normal = _steps(BOTH_GROUP128, fused, bad), _steps(BOTH_GROUP128, fused, zero)
    assert all(math.isnan(run[0][k].item()) for k in bad)  # m / d = inf / inf, as in torch
    _compare(run, normal, list(bad), damaged_rows=[30, 40])


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("factor", [False, True], ids=["rank1", "factored"])
def test_rank1_and_factored_second_moments_stay_finite(factor, fused):
    # default.yml: rank1 second moment (row/column maxima of the finite elements); factored:
    # non-finite g*g add 0 to the row/column statistics, so they equal the normal run's
    k = (10, 17)
    cfg = str(CONFIGS / "default.yml")
    (p, opt), (p0, opt0) = (_steps(cfg, fused, {k: v}, factor_second_moment=factor) for v in (3e19, 0.0))
    keep = _others([k])
    assert torch.isfinite(p[keep]).all()
    assert ((p - p0)[keep].abs() <= 2e-3).all()
    if factor:
        for name in ("exp_avg_sq_row", "exp_avg_sq_col"):
            assert torch.equal(_state(opt)[name], _state(opt0)[name]), name
        keep[10] = False  # the exp_avg block of k (its m is the block's maximum)
        assert torch.equal(p[keep], p0[keep])
    else:
        assert torch.isfinite(_state(opt)["exp_avg_sq"].scales).all()
        assert torch.isfinite(_state(opt)["exp_avg_sq"].decode()).all()


@pytest.mark.parametrize("fused", FUSED)
def test_sgd_momentum_with_a_nan_gradient_element(fused):
    # the momentum buffer (exp_avg section, group-128): NaN costs one element there as well
    runs = []
    for v in (math.nan, 0.0):
        p = torch.nn.Parameter(torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)))
        opt = SGD([p], lr=0.1, momentum=0.9, fused=fused)
        for step in range(2):
            grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + step))
            grad[5, 5] = v if step == 0 else 0.0
            p.grad = grad
            opt.step()
        runs.append((p.detach(), opt))
    keep = _others([(5, 5)])
    assert torch.equal(runs[0][0][keep], runs[1][0][keep]) and math.isnan(runs[0][0][5, 5].item())
    a, b = _state(runs[0][1])["momentum_buffer"], _state(runs[1][1])["momentum_buffer"]
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
