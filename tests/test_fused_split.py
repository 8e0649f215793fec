"""The fused CPU step in two calls (``GroupPlan.reduce`` then ``GroupPlan.apply``), as FSDP uses it
to combine the new scales' maxima across ranks in between.

With the maxima unchanged the split step is bit-identical to ``GroupPlan.run`` (parameters, codes,
scales, fp32 states, steps); with maxima increased (what an all-reduce MAX does) the stored scales
are those maxima (a nonzero one below FLT_MIN becomes FLT_MIN) and the codes are the reference
encoder's with those scales. A shard with ``FusedParam.rng_offset`` draws the random bits of its
elements in the whole parameter.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qconf import _native
from qconf.codec import QTensor
from qconf.codec.packing import pack
from qconf.codec.scales import FLT_MIN, expand_reciprocals
from qconf.optim import SGD, AdamW, Lion
from qconf.optim.fused import GroupPlan, _signed64

from helpers import CONFIGS, ISA_ORDER, machine_isas

if not _native.fused_available():  # pragma: no cover - the CI build always has the extension
    pytest.skip(f"fused kernels unavailable: {_native.native_error()}", allow_module_level=True)

# several tiles (> 16384 elements), one tile, 3-D, 1-D (rank1 -> group, dim0/dim1 -> tensor), rows
# longer than the largest single-pass block (two-pass dim0), and a bias below min_numel (fp32 states)
SHAPES = [(130, 160), (33, 130), (3, 40, 150), (20000,), (2, 17000), (7,)]

RULES = {
    "adamw": lambda ps, cfg: AdamW(ps, lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=True, seed=3),
    "sgd": lambda ps, cfg: SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, qconfig=cfg, fused=True, seed=3),
    "lion": lambda ps, cfg: Lion(ps, lr=1e-3, weight_decay=0.1, qconfig=cfg, fused=True, seed=3),
}


def _state_cfg(scale, bits, rounding, group_size=32):
    state = {"bits": bits, "map": "nonlinear", "scale": scale, "group_size": group_size, "rounding": rounding}
    return {"min_numel": 100, "states": {"exp_avg": {**state, "signed": True},
                                         "exp_avg_sq": {**state, "map": "power-1", "signed": False}}}


def _params(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def _grads(shapes, step, dtype):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 10.0 ** (step % 3 - 3)).to(dtype) for s in shapes]


def _split_step(opt, grads, change_maxima=None):
    """One step of every group by reduce() + apply() with ``grads`` passed explicitly (the
    parameters' .grad only selects the plan's parameters and is poisoned before reduce());
    ``change_maxima(plan, maxima, offsets)`` may edit the maxima in between. Returns the last
    group's (plan, maxima as applied, offsets)."""
    out = None
    given = {id(p): g for group in opt.param_groups for p, g in zip(group["params"], grads)}
    for group in opt.param_groups:
        source = opt._plan_source(group)
        if source is None:
            continue
        plan = opt._kernel.plan(id(group), *source)
        if plan.one_shot:  # as FusedStepper.step: a plan that starts a state is good for one step
            opt._kernel._plans.pop(id(group), None)
        for p in plan.params:
            p.grad = torch.full_like(p, float("nan"))
        maxima, offsets = plan.reduce(opt._kernel.hyper_values(opt._hyper(group)), opt._seed,
                                      [given[id(p)] for p in plan.params])
        assert maxima.dtype == torch.float32 and maxima.dim() == 1
        assert offsets.dtype == torch.int64 and offsets.shape == (len(plan.params), 3)
        if change_maxima is not None:
            change_maxima(plan, maxima, offsets)
        plan.apply(maxima)
        out = plan, maxima, offsets
    return out


def _assert_same(pa, oa, pb, ob, params=True):
    for a, b in zip(pa, pb):
        if params:
            assert torch.equal(a, b), (a.float() - b.float()).abs().max()
        sa, sb = oa.state[a], ob.state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            x, y = sa[k], sb[k]
            if isinstance(x, QTensor):
                assert torch.equal(x.codes, y.codes), f"{k} codes differ in {int((x.codes != y.codes).sum())} bytes"
                assert torch.equal(x.scales, y.scales), f"{k} scales differ"
            else:
                assert torch.equal(x, y), k


def _run_pair(make, cfg, dtype, steps, change_maxima=None, shapes=SHAPES):
    """The same optimizer stepped by run() (opt.step) and by reduce() + apply() (``change_maxima``
    at the last step only)."""
    pa, pb = _params(shapes, dtype), _params(shapes, dtype)
    oa, ob = make(pa, cfg), make(pb, cfg)
    seen = []
    for step in range(steps):
        grads = _grads(shapes, step, dtype)
        for p, g in zip(pa, grads):
            p.grad = g.clone()
        oa.step()
        for p, g in zip(pb, grads):
            p.grad = g.clone()
        seen.append(_split_step(ob, grads, change_maxima if step == steps - 1 else None))
    return (pa, oa), (pb, ob), seen


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale", ["tensor", "dim0", "dim1", "group", "rank1", "group_huge"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_split_step_is_bit_identical_to_run(rule, scale, bits, rounding):
    cfg = (_state_cfg("group", bits, rounding, group_size=20000) if scale == "group_huge"  # two-pass blocks
           else _state_cfg(scale, bits, rounding))
    (pa, oa), (pb, ob), seen = _run_pair(RULES[rule], cfg, torch.float32, 3)
    _assert_same(pa, oa, pb, ob)
    plan, maxima, offsets = seen[-1]
    _check_layout(pb, ob, rule, maxima, offsets)
    if scale != "group":  # small blocks are single-pass; every other layout has two-pass states here
        assert maxima.numel() > 0
    if scale in ("tensor", "dim1", "rank1", "group_huge"):
        assert (offsets[0, :STATES[rule]] >= 0).all()
    assert (offsets[-1] == -1).all() and (offsets[:, 2] == -1).all()  # fp32 states; Kahan buffer


STATES = {"adamw": 2, "sgd": 1, "lion": 1}
KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "lion": ("exp_avg",)}


def _check_layout(params, opt, rule, maxima, offsets):
    """maxima hold the two-pass states' scale counts back to back, in parameter then slot order."""
    total = 0
    for i, p in enumerate(params):
        for k, key in enumerate(KEYS[rule]):
            if int(offsets[i, k]) >= 0:
                assert int(offsets[i, k]) == total
                total += opt.state[p][key].scales.numel()
    assert total == maxima.numel()


WEIGHTS = {
    "sr": {"rounding": "stochastic"},
    "sr_kahan": {"rounding": "stochastic", "compensation": "kahan"},
    "kahan_q8": {"compensation": "kahan", "compensation_codec": {"bits": 8}},
    "sr_kahan_q4_sr": {"rounding": "stochastic", "compensation": "kahan",
                       "compensation_codec": {"bits": 4, "group_size": 64, "rounding": "stochastic"}},
}


@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_split_step_with_bf16_weights_is_bit_identical_to_run(rule, weights):
    """bf16 parameters with stochastic rounding / Kahan compensation, rank-1 second moment and
    stochastically rounded tensor-scale first moment."""
    cfg = {"base": str(CONFIGS / "default.yml"), "min_numel": 100, "weights": WEIGHTS[weights],
           "states": {"exp_avg": {"scale": "tensor", "rounding": "stochastic", "bits": 8}}}
    (pa, oa), (pb, ob), _ = _run_pair(RULES[rule], cfg, torch.bfloat16, 4)
    _assert_same(pa, oa, pb, ob)


def _increase(plan, maxima, offsets):
    """What an all-reduce MAX might do: raise every other maximum (x 1.75 + 1e-3), and lift the
    zero maxima (rows whose gradient is 0) to a subnormal, which stores FLT_MIN."""
    maxima[::2] = maxima[::2] * 1.75 + 1e-3
    maxima[maxima == 0] = 1e-40


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("scale", ["tensor", "dim0", "dim1", "rank1", "group_huge"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_increased_maxima_become_the_scales(rule, scale, rounding):
    cfg = (_state_cfg("group", 4, rounding, group_size=20000) if scale == "group_huge"
           else _state_cfg(scale, 4, rounding))
    (pa, oa), (pb, ob), seen = _run_pair(RULES[rule], cfg, torch.float32, 3, change_maxima=_increase)
    plan, maxima, offsets = seen[-1]
    _check_layout(pb, ob, rule, maxima, offsets)
    for i, p in enumerate(pb):
        for k, key in enumerate(KEYS[rule]):
            o = int(offsets[i, k])
            q = ob.state[p][key]
            if o < 0:
                continue
            m = maxima[o:o + q.scales.numel()]
            expected = torch.where((m > 0) & (m < FLT_MIN), torch.full_like(m, FLT_MIN), m)
            assert torch.equal(q.scales, expected), (i, key)
            # the scales are at least run()'s; the parameters (updated from the unquantized new
            # states) are not affected
            assert (q.scales >= oa.state[pa[i]][key].scales).all()
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale", ["tensor", "dim0", "dim1", "rank1", "group_huge"])
def test_increased_maxima_give_the_reference_codes(scale, bits):
    """SGD's first step stores the gradient itself as the momentum buffer (no weight decay or
    dampening): its codes must be the reference quantization of g with the increased scales."""
    cfg = (_state_cfg("group", bits, "nearest", group_size=20000) if scale == "group_huge"
           else _state_cfg(scale, bits, "nearest"))
    shapes = SHAPES[:5]
    params = _params(shapes, torch.float32)
    opt = SGD(params, lr=0.05, momentum=0.9, qconfig=cfg, fused=True, seed=3)
    grads = _grads(shapes, 0, torch.float32)
    grads[0][5] = 0.0  # zero rows: their rank-1 / dim0 maxima are 0, then lifted to a subnormal
    grads[4][1] = 0.0
    for p, g in zip(params, grads):
        p.grad = g.clone()
    plan, maxima, offsets = _split_step(opt, grads, _increase)
    checked = 0
    for i, (p, g) in enumerate(zip(params, grads)):
        q = opt.state[p]["momentum_buffer"]
        codec = q.codec
        if int(offsets[i, 0]) < 0:
            continue
        m = maxima[int(offsets[i, 0]):int(offsets[i, 0]) + q.scales.numel()]
        scales = torch.where((m > 0) & (m < FLT_MIN), torch.full_like(m, FLT_MIN), m)
        assert torch.equal(q.scales, scales)
        r = expand_reciprocals(scales, tuple(g.shape), codec.scale, codec.group_size)
        n = g * r
        n = torch.where(torch.isinf(r) | torch.isnan(n), torch.zeros_like(n), n)
        assert torch.equal(q.codes, pack(codec.quantize(n), codec.bits)), i
        checked += 1
    assert checked >= 2
    if scale in ("dim0", "rank1"):  # the zero row's scale
        assert (opt.state[params[0 if scale == "rank1" else 4]]["momentum_buffer"].scales == FLT_MIN).any()


def _one_plan(opt, shapes, dtype=torch.float32):
    params = opt.param_groups[0]["params"]
    grads = _grads(shapes, 0, dtype)
    for p, g in zip(params, grads):
        p.grad = g
    group = opt.param_groups[0]
    plan = opt._kernel.plan(id(group), *opt._plan_source(group))
    return plan, opt._kernel.hyper_values(opt._hyper(group)), grads


def test_reduce_writes_nothing_and_apply_checks_its_input():
    cfg = _state_cfg("rank1", 4, "stochastic")
    params = _params(SHAPES, torch.float32)
    opt = AdamW(params, lr=1e-2, qconfig=cfg, fused=True, seed=3)
    plan, hyper, grads = _one_plan(opt, SHAPES)
    with pytest.raises(RuntimeError, match="no pending reduce"):
        plan.apply(torch.zeros(0))
    before = [t.clone() for t in [*plan.params, *plan.steps, *plan.states]]
    maxima, offsets = plan.reduce(hyper, opt._seed, grads)
    after = [*plan.params, *plan.steps, *plan.states]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(RuntimeError, match="elements"):
        plan.apply(maxima[1:])
    with pytest.raises(RuntimeError, match="float32"):
        plan.apply(maxima.double())
    bad = maxima.clone()
    bad[3] = float("nan")
    with pytest.raises(RuntimeError, match="finite"):
        plan.apply(bad)
    bad[3] = -1.0
    with pytest.raises(RuntimeError, match="finite"):
        plan.apply(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # failed applies change nothing
    plan.apply(maxima)
    assert all(float(s) == 1.0 for s in plan.steps)
    with pytest.raises(RuntimeError, match="no pending reduce"):
        plan.apply(maxima)
    # a plain step in between drops the pending split step
    plan.reduce(hyper, opt._seed, grads)
    plan.run(hyper, 0)
    with pytest.raises(RuntimeError, match="no pending reduce"):
        plan.apply(maxima)


def test_reduce_refuses_factored_second_moments():
    shapes = [(130, 160)]
    opt = AdamW(_params(shapes, torch.float32), lr=1e-2, factor_second_moment=True,
                qconfig=_state_cfg("rank1", 4, "nearest"), fused=True, seed=3)
    plan, hyper, grads = _one_plan(opt, shapes)
    with pytest.raises(RuntimeError, match="factored"):
        plan.reduce(hyper, opt._seed, grads)
    with pytest.raises(RuntimeError, match="no pending reduce"):
        plan.apply(torch.zeros(0))


def test_reduce_checks_the_gradients():
    opt = AdamW(_params(SHAPES, torch.float32), lr=1e-2, qconfig=_state_cfg("rank1", 4, "nearest"), fused=True)
    plan, hyper, grads = _one_plan(opt, SHAPES)
    with pytest.raises(RuntimeError, match="grads"):
        plan.reduce(hyper, opt._seed, grads[:-1])
    grads[1] = grads[1][:5]
    with pytest.raises(RuntimeError, match="elements"):
        plan.reduce(hyper, opt._seed, grads)


@pytest.mark.parametrize("scale,group_size", [("rank1", 32), ("group", 1 << 20)])
@pytest.mark.parametrize("isa", ISA_ORDER)
def test_split_step_on_every_isa(isa, scale, group_size, monkeypatch):
    # (groups of 2^20, longer than every tensor: one group; single-pass in the one-tile tensors,
    # where the apply pass once wrote past its tile buffers, two-pass in the others)
    if isa not in machine_isas():
        pytest.skip(f"{isa} not supported here")
    monkeypatch.setenv("QCONF_CPU_ISA", isa)
    cfg = _state_cfg(scale, 4, "stochastic", group_size)
    (pa, oa), (pb, ob), _ = _run_pair(RULES["adamw"], cfg, torch.float32, 2, shapes=SHAPES + [(64, 80)])
    _assert_same(pa, oa, pb, ob)


# ---------------------------------------------------------------------------------------------
# FusedParam.rng_offset: a shard x[a:] draws the random bits of elements a.. of the whole x

def _offset_plan(opt, offset):
    """A plan of ``opt``'s single group whose parameters start at stream element ``offset``."""
    group = opt.param_groups[0]
    fps = [dataclasses.replace(fp, rng_offset=offset) for fp in opt._fused_params(group, group["params"])]
    return GroupPlan(opt._kernel._rule, fps), opt._kernel.hyper_values(opt._hyper(group))


@pytest.mark.parametrize("a", [1, 12345])
def test_rng_offset_shard_rounds_bf16_weights_like_the_whole(a):
    """bf16 weights with stochastic rounding, fp32 states: only the parameter's stream matters."""
    cfg = {"min_numel": 0, "weights": {"rounding": "stochastic"},
           "states": {"exp_avg": {"enable": False}, "exp_avg_sq": {"enable": False}}}
    full = torch.nn.Parameter((torch.randn(40000, generator=torch.Generator().manual_seed(0)) * 0.5).bfloat16())
    shard = torch.nn.Parameter(full.detach()[a:].clone())
    of, os_ = (AdamW([p], lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=True, seed=3) for p in (full, shard))
    for step in range(3):
        g = _grads([(40000,)], step, torch.bfloat16)[0]
        full.grad, shard.grad = g.clone(), g[a:].clone()
        of.step()
        plan, hyper = _offset_plan(os_, a)
        plan.run(hyper, _signed64(os_._seed))
        assert torch.equal(shard.view(torch.int16), full.detach()[a:].view(torch.int16)), step
    # without the offset the shard would draw other bits
    plan, hyper = _offset_plan(os_, 0)
    shard.grad = full.grad[a:].clone()
    before = full.detach()[a:].clone()
    of.step()
    plan.run(hyper, _signed64(os_._seed))
    assert not torch.equal(shard.view(torch.int16), full.detach()[a:].view(torch.int16))
    assert not torch.equal(before, full.detach()[a:])


def _offset_run(offset):
    """Two steps at rng_offset ``offset`` of a bf16 parameter with stochastic weights and states."""
    cfg = {"min_numel": 0, "weights": {"rounding": "stochastic"},
           "states": {"exp_avg": {"group_size": 64, "rounding": "stochastic"},
                      "exp_avg_sq": {"group_size": 64, "rounding": "stochastic", "map": "power-1", "signed": False}}}
    p = torch.nn.Parameter((torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 0.5).bfloat16())
    opt = AdamW([p], lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=True, seed=3)
    opt.step()  # (creates the states; no gradient yet)
    for step in range(2):
        p.grad = _grads([(5000,)], step, torch.bfloat16)[0]
        plan, hyper = _offset_plan(opt, offset)
        plan.run(hyper, _signed64(opt._seed))
    return p.detach().clone(), {k: v for k, v in opt.state[p].items()}


@pytest.mark.parametrize("isa", ISA_ORDER[1:])
@pytest.mark.parametrize("offset", [2**32 - 37, 2**33 - 36, 2**33 - 37])
def test_rng_offsets_across_word_boundaries_give_every_isa_the_scalar_bits(isa, offset, monkeypatch):
    """Vector lanes whose stream elements (or, for bf16's half hashes, pair indexes) cross a 2^32
    boundary draw the bits of the scalar path (element.h, checked against qconf.codec.rng)."""
    if isa not in machine_isas():
        pytest.skip(f"{isa} not supported here")
    monkeypatch.setenv("QCONF_CPU_ISA", "scalar")
    want_p, want_state = _offset_run(offset)
    monkeypatch.setenv("QCONF_CPU_ISA", isa)
    got_p, got_state = _offset_run(offset)
    assert torch.equal(got_p.view(torch.int16), want_p.view(torch.int16))
    for key, v in want_state.items():
        if isinstance(v, QTensor):
            assert torch.equal(got_state[key].codes, v.codes) and torch.equal(got_state[key].scales, v.scales), key


def test_rng_offset_shard_with_global_maxima_matches_the_whole():
    """A shard x[a:] with rng_offset=a whose tensor-scale states get the whole tensor's maxima (what
    the all-reduce gives FSDP) stores the whole tensor's codes, scales and parameter bits."""
    a, n = 12345, 40000
    cfg = {"min_numel": 0, "weights": {"rounding": "stochastic"},
           "states": {"exp_avg": {"bits": 8, "scale": "tensor", "rounding": "stochastic"},
                      "exp_avg_sq": {"bits": 8, "scale": "tensor", "rounding": "stochastic", "map": "power-1",
                                     "signed": False}}}
    full = torch.nn.Parameter((torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.5).bfloat16())
    shard = torch.nn.Parameter(full.detach()[a:].clone())
    of, os_ = (AdamW([p], lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=True, seed=3) for p in (full, shard))
    for step in range(3):
        g = _grads([(n,)], step, torch.bfloat16)[0]
        full.grad, shard.grad = g.clone(), g[a:].clone()
        pf, hyper = _offset_plan(of, 0)
        ps, _ = _offset_plan(os_, a)
        mf, off_f = pf.reduce(hyper, of._seed, [full.grad])
        ms, off_s = ps.reduce(hyper, os_._seed, [shard.grad])
        assert torch.equal(off_f, off_s) and mf.numel() == ms.numel() == 2
        assert (ms <= mf).all()
        pf.apply(mf)
        ps.apply(torch.maximum(ms, mf))  # the all-reduce MAX over the shards
        assert torch.equal(shard.view(torch.int16), full.detach()[a:].view(torch.int16)), step
        for key in ("exp_avg", "exp_avg_sq"):
            qf, qs = of.state[full][key], os_.state[shard][key]
            assert torch.equal(qs.scales, qf.scales), (step, key)
            assert torch.equal(qs.codes, qf.codes[a:]), (step, key)
