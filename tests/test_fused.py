"""Fused native kernels against the reference path: every shipped config, a sweep of codecs,
odd shapes, dtypes and non-contiguous gradients, every ISA and thread count.

The fused kernels perform the reference's fp32 operations in the same order, so codes, scales
and parameters are compared for exact equality; the factored second moment (whose row/column
means are summed in a different order) is compared within 1e-6 of each tensor's magnitude.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from qconf import _native
from qconf.codec import MAP_NAMES, SCALE_TYPES, QTensor, packing
from qconf.optim import SGD, Adam, AdamW, Lion

from helpers import CONFIGS, assert_rel_close, machine_isas

if not _native.fused_available():  # pragma: no cover - the CI build always has the extension
    pytest.skip(f"fused kernels unavailable: {_native.native_error()}", allow_module_level=True)

SHAPES = [(1,), (127,), (4097,), (33, 130), (3, 5, 7), (2, 3, 4, 5), (64, 96), (3, 4, 32)]
ALL_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yml"))


def _params(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def _grads(shapes, step, dtype, noncontig):
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for s in shapes:
        x = torch.randn(s, generator=g) * (10.0 ** (step % 3 - 3))
        if noncontig and len(s) >= 2:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous strides
        out.append(x.to(dtype))
    return out


def _run(make, shapes, dtype, steps, fused, noncontig=False, isa=None, threads=None, monkeypatch=None):
    params = _params(shapes, dtype)
    opt = make(params, fused)
    if isa is not None:
        monkeypatch.setenv("QCONF_CPU_ISA", isa)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for step in range(steps):
            for p, g in zip(params, _grads(shapes, step, dtype, noncontig)):
                p.grad = g
            opt.step()
    finally:
        torch.set_num_threads(old_threads)
        if isa is not None:
            monkeypatch.delenv("QCONF_CPU_ISA")
    return params, opt


def _fused_on_each_isa(make, shapes, dtype, steps, monkeypatch, noncontig=False):
    """The fused run once per instruction set this machine has (scalar, avx2, ... up to the best):
    each one must give the reference's bits."""
    return [_run(make, shapes, dtype, steps, True, noncontig, isa=isa, monkeypatch=monkeypatch) for isa in machine_isas()]


def _assert_same(ref, fused, exact_params=True):
    (p_ref, o_ref), (p_fus, o_fus) = ref, fused
    for a, b in zip(p_ref, p_fus):
        if exact_params:
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            assert_rel_close(b, a, 1e-6)
        sa, sb = o_ref.state[a], o_fus.state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            x, y = sa[k], sb[k]
            if isinstance(x, QTensor):
                assert isinstance(y, QTensor) and x.codec == y.codec
                assert torch.equal(x.codes, y.codes), f"{k} codes differ in {int((x.codes != y.codes).sum())} bytes"
                assert torch.equal(x.scales, y.scales), f"{k} scales differ"
            elif exact_params or k == "step":
                assert torch.equal(x, y), k
            else:
                assert_rel_close(y, x, 1e-6)


RULES = {
    "adamw": lambda cfg: lambda ps, f: AdamW(ps, lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=f, seed=3),
    "adam": lambda cfg: lambda ps, f: Adam(ps, lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=f, seed=3),
    "adamw_max": lambda cfg: lambda ps, f: AdamW(ps, lr=1e-2, maximize=True, qconfig=cfg, fused=f, seed=3),
    "sgd": lambda cfg: lambda ps, f: SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, qconfig=cfg, fused=f, seed=3),
    "sgd_nesterov": lambda cfg: lambda ps, f: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, qconfig=cfg,
                                                  fused=f, seed=3),
    "sgd_damp": lambda cfg: lambda ps, f: SGD(ps, lr=0.05, momentum=0.5, dampening=0.3, qconfig=cfg, fused=f,
                                              seed=3),
    "sgd_plain": lambda cfg: lambda ps, f: SGD(ps, lr=0.05, qconfig=cfg, fused=f, seed=3),
    "lion": lambda cfg: lambda ps, f: Lion(ps, lr=1e-3, weight_decay=0.1, qconfig=cfg, fused=f, seed=3),
}


@pytest.mark.parametrize("config", ALL_CONFIGS)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_shipped_config_and_rule_matches_reference(config, rule, monkeypatch):
    cfg = {"base": str(CONFIGS / config), "min_numel": 0}  # quantize every shape, even the tiny ones
    make = RULES[rule](cfg)
    ref = _run(make, SHAPES, torch.float32, 20, False)
    for fus in _fused_on_each_isa(make, SHAPES, torch.float32, 20, monkeypatch):
        _assert_same(ref, fus)


@pytest.mark.parametrize("config", ["default.yml", "8bit.yml", "2nd_moment_group_128.yml"])
def test_factored_second_moment_matches_reference(config):
    cfg = {"base": str(CONFIGS / config), "min_numel": 0}
    make = lambda ps, f: AdamW(ps, lr=1e-2, factor_second_moment=True, qconfig=cfg, fused=f, seed=3)  # noqa: E731
    _assert_same(_run(make, SHAPES, torch.float32, 20, False), _run(make, SHAPES, torch.float32, 20, True),
                 exact_params=False)


# (ternary is 2-bit signed only: test_ternary_first_moment_matches_reference)
SWEEP = list(itertools.product(SCALE_TYPES, [m for m in MAP_NAMES if m != "ternary"], (4, 8), ("nearest", "stochastic")))


@pytest.mark.parametrize("scale,map,bits,rounding", SWEEP)
def test_codec_sweep_matches_reference(scale, map, bits, rounding, monkeypatch):
    state = {"bits": bits, "map": map, "scale": scale, "group_size": 32, "rounding": rounding}
    cfg = {"min_numel": 0, "states": {"exp_avg": {**state, "signed": True},
                                      "exp_avg_sq": {**state, "signed": False}}}
    make = RULES["adamw"](cfg)
    for dtype, noncontig in ((torch.float32, True), (torch.bfloat16, False), (torch.float16, True)):
        ref = _run(make, SHAPES, dtype, 6, False, noncontig)
        for fus in _fused_on_each_isa(make, SHAPES, dtype, 6, monkeypatch, noncontig):
            _assert_same(ref, fus)


@pytest.mark.parametrize("group_size", [16, 48, 96, 160])
def test_block_sizes_around_the_main_loop_chunk_match_reference(group_size, monkeypatch):
    # Single-pass block states take the register paths only when a block is whole 32-element
    # main-loop chunks (one old scale per chunk, the block maxima from the chunks'): 96 and 160
    # do, with 3 and 5 chunks per block and partial last chunks and blocks; 16 and 48 take the
    # generic dequantize and quantize. Every ISA gives the reference's bits.
    state = {"scale": "group", "group_size": group_size}
    cfg = {"min_numel": 0, "states": {"exp_avg": {**state, "bits": 4, "signed": True},
                                      "exp_avg_sq": {**state, "bits": 8, "signed": False}}}
    shapes = [(4097,), (33, 130), (7, 1000), (3, 4, 32)]
    make = RULES["adamw"](cfg)
    for dtype in (torch.float32, torch.bfloat16):
        ref = _run(make, shapes, dtype, 4, False)
        for fus in _fused_on_each_isa(make, shapes, dtype, 4, monkeypatch):
            _assert_same(ref, fus)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("scale", ["rank1", "group", "dim1"])
@pytest.mark.parametrize("bits", [4, 8])
def test_non_finite_gradients_give_the_same_states(scale, bits, rounding, monkeypatch):
    # NaN / inf gradients: the scales leave the non-finite values out and the values saturate,
    # the same way in the kernel as in the reference (tests/test_non_finite.py: only the bad
    # elements themselves are damaged). At the first step row 2 of the first parameter is 0 but
    # for one inf: a zero group (scale 0) whose inf element must get the code of 0.
    state = {"bits": bits, "scale": scale, "group_size": 64, "rounding": rounding}
    cfg = {"min_numel": 0, "states": {"exp_avg": state, "exp_avg_sq": {**state, "map": "power-1"}}}
    shapes = [(48, 64), (3, 4, 32)]
    runs = []
    for fused, isa in [(False, None)] + [(True, isa) for isa in machine_isas()]:
        params = _params(shapes, torch.float32)
        opt = AdamW(params, lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=fused, seed=3)
        if isa is not None:
            monkeypatch.setenv("QCONF_CPU_ISA", isa)
        for step in range(4):
            for p, g in zip(params, _grads(shapes, step, torch.float32, False)):
                if step in (1, 2):
                    g.view(-1)[[5, 700][: g.numel() // 384]] = float("nan") if step == 1 else float("inf")
                if step == 0 and g.dim() == 2:
                    g[2] = 0.0
                    g[2, 3] = float("inf")
                p.grad = g
            opt.step()
        runs.append((params, opt))
    (p_ref, o_ref) = runs[0]
    for p_fus, o_fus in runs[1:]:
        for a, b in zip(p_ref, p_fus):
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
            for k, x in o_ref.state[a].items():
                y = o_fus.state[b][k]
                if isinstance(x, QTensor):
                    assert torch.equal(x.codes, y.codes), k
                    assert torch.equal(y.scales, x.scales), k
    assert all(torch.isfinite(o_fus.state[p][k].scales).all() for p in p_fus for k in ("exp_avg", "exp_avg_sq"))
    assert any(torch.isnan(p).any() for p in p_fus)  # the NaN gradient element's parameter, as in torch


def test_bf16_parameters_stay_nan_where_the_nan_has_low_bits(monkeypatch):
    # A float32 gradient NaN whose low 16 mantissa bits are set (0x7fffffff) reaches its bf16
    # parameter with those bits. The kernels round bf16 without the NaN select and write a run
    # again with it where a NaN went by: rounding 0x7fffffff as a number carries into the sign
    # bit and gives -0.0. The NaNs sit at elements 3 and 64: in the first pair of vectors and in a
    # later one on every ISA (each tensor is one tile).
    nan = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    shapes = [(4, 40), (97,)]
    cfg = {"min_numel": 0, "states": {"exp_avg": {"bits": 4, "scale": "group", "group_size": 32},
                                      "exp_avg_sq": {"bits": 4, "scale": "group", "group_size": 32,
                                                     "signed": False}}}
    runs = []
    for fused, isa in [(False, None)] + [(True, isa) for isa in machine_isas()]:
        if isa is not None:
            monkeypatch.setenv("QCONF_CPU_ISA", isa)
        params = _params(shapes, torch.bfloat16)
        opt = AdamW(params, lr=1e-2, weight_decay=0.01, qconfig=cfg, fused=fused)
        for step in range(2):
            for p, g in zip(params, _grads(shapes, step, torch.float32, False)):
                g.view(-1)[[3, 64]] = nan
                p.grad_dtype = None  # (torch checks a gradient against grad_dtype; None allows float32 here)
                p.grad = g
            opt.step()
        runs.append(params)
    for params in runs:
        for p in params:
            assert torch.isnan(p.view(-1)[[3, 64]].float()).all()
            assert torch.isfinite(p.view(-1)[:3].float()).all()
    for params in runs[1:]:
        for a, b in zip(runs[0], params):
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


def _first_sgd_steps(blocks, state_cfg, tail=(), isa=None, monkeypatch=None):
    """Reference and fused runs of one SGD momentum step whose gradient is `blocks` (each at most
    63 values) after a 1.0 in every block of 64, then `tail`: the first step stores the gradient
    as the momentum buffer, so with group_size 64 the values the kernel quantizes are exactly the
    blocks' values. `isa` (with `monkeypatch`) forces the fused step's ISA."""
    grad = torch.cat([torch.cat([torch.ones(1), b, torch.zeros(63 - b.numel())]) for b in blocks] + list(tail))
    cfg = {"min_numel": 0, "states": {"exp_avg": state_cfg}}
    runs = []
    for fused in (False, True):
        p = torch.nn.Parameter(torch.zeros(grad.numel()))
        opt = SGD([p], lr=0.1, momentum=0.9, qconfig=cfg, fused=fused)
        p.grad = grad.clone()
        if isa is not None:
            monkeypatch.setenv("QCONF_CPU_ISA", isa)
        opt.step()
        if isa is not None:
            monkeypatch.delenv("QCONF_CPU_ISA")
        runs.append(([p], opt))
    return runs


@pytest.mark.parametrize("bits", [4, 8])
def test_grid_maps_round_like_the_search_at_and_around_every_midpoint(bits):
    # power-1 unsigned maps have midpoints (k + 1.5) / 2**bits: the kernel computes their codes
    # arithmetically (qconf.codec.native.midpoint_grid). SGD's first step stores the gradient as the
    # momentum buffer, and every block of 64 holds a 1.0, so the normalized values are exactly
    # the gradient: each midpoint, its float neighbours, and the awkward values.
    from qconf.codec import Codec
    from qconf.codec.native import midpoint_grid

    codec = Codec(bits=bits, map="power-1", signed=False, scale="group", group_size=64)
    mids = codec.midpoints
    assert midpoint_grid(mids) == (2.0 ** bits, 1.5)
    assert midpoint_grid(Codec(bits=bits, map="nonlinear", signed=True).midpoints) == (0.0, 0.0)
    around = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-1.0))])
    odd = torch.tensor([0.0, -0.0, -0.5, -1.0, 1e-40, 1e-30, 0.25 - 2 ** -26, 0.5 + 2 ** -24, 0.999999, 1.0])
    values = torch.cat([around, odd])
    runs = _first_sgd_steps(values.split(63), {"bits": bits, "map": "power-1", "signed": False,
                                               "scale": "group", "group_size": 64})
    _assert_same(*runs)
    buf = runs[1][1].state[runs[1][0][0]]["momentum_buffer"]
    assert torch.equal(buf.scales, torch.ones_like(buf.scales))  # the values were normalized by 1


@pytest.mark.parametrize("isa", machine_isas())
@pytest.mark.parametrize("map,signed", [("nonlinear", True), ("nonlinear", False), ("linear", True),
                                        ("float-point", True), ("power-2", True), ("power-2", False)])
def test_octave_lines_round_like_the_search_at_every_interval_end(map, signed, isa, monkeypatch):
    # 8-bit maps with octave lines (qconf.codec.octave_lines) take the line estimate plus one probe in the
    # kernel. SGD's first step stores the gradient as the momentum buffer with a 1.0 in every
    # block of 64, so the normalized values are exactly every point where the estimate could go
    # wrong (all in [-1, 1]), plus a block with NaN and one with inf. (Unsigned power-2 has no
    # lines: the search, for comparison.) An odd number of vectors exercises the tail after the
    # last whole group of Isa::lookup256n. On every ISA: AVX-512 with and without VBMI looks up
    # 4 or 2 vectors at a time; AVX2 takes the segment lines where the codec has them
    # (qconf.codec.segment_lines: their check points, bounds and junction midpoints included, are
    # the values then), else probes with a gather; scalar searches.
    from qconf.codec import Codec
    from qconf.codec import segment_lines
    from qconf.codec.native import codec_table
    from qconf.codec.octave_lines import _interval_ends

    codec = Codec(bits=8, map=map, signed=signed, scale="group", group_size=64)
    row = codec_table(codec)[7]
    assert bool(row.any()) == ((map, signed) != ("power-2", False))
    assert bool(row[segment_lines.SEG_PRESENT]) == (map in ("nonlinear", "linear"))
    if row[segment_lines.SEG_PRESENT]:
        ends = segment_lines._ends(row, codec.midpoints)
    else:
        ends = _interval_ends(row, codec.midpoints) if row.any() else torch.cat([codec.midpoints] * 3)
    values = ends[torch.isfinite(ends) & (ends.abs() <= 1)]
    blocks = list(values.split(63)) + [torch.tensor([float("nan"), 0.5]), torch.tensor([float("inf"), -0.25])]
    runs = _first_sgd_steps(blocks, {"bits": 8, "map": map, "signed": signed, "scale": "group", "group_size": 64},
                            tail=[torch.ones(16)], isa=isa, monkeypatch=monkeypatch)
    (p_ref, o_ref), (p_fus, o_fus) = runs
    assert (p_fus[0].numel() // 16) % 2 == 1
    a, b = o_ref.state[p_ref[0]]["momentum_buffer"], o_fus.state[p_fus[0]]["momentum_buffer"]
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(b.scales[:-3], torch.ones_like(b.scales[:-3]))  # normalized by 1


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 6, 7])
def test_other_widths_are_fused_and_match(bits, monkeypatch):
    cfg = {"min_numel": 0, "states": {"exp_avg": {"bits": bits, "map": "linear" if bits > 1 else "power-1"},
                                      "exp_avg_sq": {"bits": bits, "map": "power-1", "scale": "rank1"}}}
    make = RULES["adamw"](cfg)
    ref = _run(make, SHAPES, torch.float32, 8, False)
    for fus in _fused_on_each_isa(make, SHAPES, torch.float32, 8, monkeypatch):
        _assert_same(ref, fus)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("scale", ["group", "tensor", "dim0", "rank1"])
def test_ternary_first_moment_matches_reference(scale, rounding):
    # map ternary (levels -1, 0, +1 in 2-bit codes): the kernel reads its table like any other map's
    cfg = {"min_numel": 0, "states": {"exp_avg": {"bits": 2, "map": "ternary", "signed": True, "scale": scale,
                                                  "group_size": 32, "rounding": rounding}}}
    make = RULES["adamw"](cfg)
    ref, fus = _run(make, SHAPES, torch.float32, 6, False), _run(make, SHAPES, torch.float32, 6, True)
    _assert_same(ref, fus)
    (params, opt) = fus
    m = opt.state[params[-1]]["exp_avg"]
    assert m.codec.map == "ternary" and m.codes.numel() == -(-params[-1].numel() // 4)  # 4 codes a byte
    codes = packing.unpack(m.codes, 2, params[-1].numel())
    assert set(codes.unique().tolist()) == {0, 1, 2}  # all three levels occur (code 3 never does)


@pytest.mark.parametrize("config", ["default.yml", "8bit.yml", "default_5b.yml", "2nd_moment_group_128.yml"])
def test_identical_across_isas_and_thread_counts(config, monkeypatch):
    cfg = {"base": str(CONFIGS / config), "min_numel": 0,
           "states": {"exp_avg": {"rounding": "stochastic"}}}
    shapes = SHAPES + [(256, 1024)]  # big enough for several tiles per thread
    make = RULES["adamw"](cfg)
    runs = [_run(make, shapes, torch.float32, 5, True, isa=isa, threads=t, monkeypatch=monkeypatch)
            for isa in machine_isas() for t in (1, 2)]
    for other in runs[1:]:
        _assert_same(runs[0], other)


def test_huge_blocks_and_tensor_scale_take_two_passes_correctly():
    # blocks larger than a tile (two-pass "group"), tensor scale over a multi-tile tensor, dim0 rows
    cfg = {"min_numel": 0, "states": {"exp_avg": {"scale": "group", "group_size": 40000},
                                      "exp_avg_sq": {"scale": "tensor"}}}
    make = RULES["adamw"](cfg)
    shapes = [(300, 500), (70001,)]
    _assert_same(_run(make, shapes, torch.float32, 5, False), _run(make, shapes, torch.float32, 5, True))
    cfg = {"min_numel": 0, "states": {"exp_avg": {"scale": "dim0"}, "exp_avg_sq": {"scale": "dim1"}}}
    make = RULES["sgd"](cfg)
    _assert_same(_run(make, shapes[:1], torch.float32, 5, False), _run(make, shapes[:1], torch.float32, 5, True))


def test_mixed_groups_params_without_grads_and_lazy_state():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(100, 50)), torch.nn.Parameter(torch.randn(10)),
         torch.nn.Parameter(torch.randn(7000))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa = SGD([{"params": a[:2], "momentum": 0.9}, {"params": a[2:], "lr": 0.01}], lr=0.1, fused=False)
    ob = SGD([{"params": b[:2], "momentum": 0.9}, {"params": b[2:], "lr": 0.01}], lr=0.1, fused=True)
    for step in range(6):
        for i, (x, y) in enumerate(zip(a, b)):
            if step % 2 == 1 and i == 1:  # a param that sometimes has no gradient
                x.grad = y.grad = None
                continue
            g = torch.randn_like(x)
            x.grad, y.grad = g.clone(), g.clone()
        if step == 3:  # momentum switched on later: the buffer starts from the gradient
            oa.param_groups[1]["momentum"] = ob.param_groups[1]["momentum"] = 0.5
        oa.step()
        ob.step()
    _assert_same((a, oa), (b, ob))


WEIGHTS = {
    "sr": {"rounding": "stochastic"},
    "kahan": {"compensation": "kahan"},
    "sr_kahan": {"rounding": "stochastic", "compensation": "kahan"},
    "kahan_q8": {"compensation": "kahan", "compensation_codec": {"bits": 8}},
    "sr_kahan_q4_sr": {"rounding": "stochastic", "compensation": "kahan",
                       "compensation_codec": {"bits": 4, "group_size": 64, "rounding": "stochastic"}},
    "kahan_q8_odd_group": {"compensation": "kahan", "compensation_codec": {"bits": 8, "group_size": 100}},
}


@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("rule", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_match_reference_bit_for_bit(weights, rule, dtype, monkeypatch):
    """Stochastic rounding and Kahan compensation of bf16/fp16 weights: the fused kernel writes the
    same parameter bits and compensation buffer as the reference path (same seed)."""
    cfg = {"base": str(CONFIGS / "default.yml"), "min_numel": 100, "weights": WEIGHTS[weights]}
    make = RULES[rule](cfg)
    shapes = SHAPES + [(70, 300)]  # 21000 elements: several tiles
    ref = _run(make, shapes, dtype, 6, False)
    for fus in _fused_on_each_isa(make, shapes, dtype, 6, monkeypatch):
        _assert_same(ref, fus)
        assert "kahan_comp" in fus[1].state[fus[0][0]] or "kahan" not in weights


@pytest.mark.parametrize("isa", machine_isas())
def test_low_precision_weights_identical_across_isas_and_threads(isa, monkeypatch):
    cfg = {"base": str(CONFIGS / "2nd_moment_group_128.yml"),
           "weights": {"rounding": "stochastic", "compensation": "kahan"}}
    make = RULES["adamw"](cfg)
    shapes = [(4097,), (96, 200), (3, 5, 7)]
    ref = _run(make, shapes, torch.bfloat16, 4, False)
    for threads in (1, 2):
        _assert_same(ref, _run(make, shapes, torch.bfloat16, 4, True, isa=isa, threads=threads,
                               monkeypatch=monkeypatch))


def test_fused_true_rejects_what_it_cannot_fuse():
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    p.grad = torch.randn_like(p)
    with pytest.raises(RuntimeError, match=r"AdamW\(fused=True\) cannot fuse: parameter 0 has dtype torch.float64"):
        AdamW([p], fused=True).step()
    with pytest.warns(UserWarning, match="using the reference path for a param group"):
        AdamW([p], fused=None).step()


def test_resume_between_fused_and_reference_is_bit_exact():
    import io
    shapes = [(64, 96), (4097,)]
    make = RULES["adamw"]({"base": str(CONFIGS / "default.yml"), "min_numel": 0})
    full = _run(make, shapes, torch.float32, 10, True)
    part_params, part = _run(make, shapes, torch.float32, 5, True)
    buf = io.BytesIO()
    torch.save(part.state_dict(), buf)
    buf.seek(0)
    ref_opt = make(part_params, False)  # continue on the reference path
    ref_opt.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(5, 10):
        for p, g in zip(part_params, _grads(shapes, step, torch.float32, False)):
            p.grad = g
        ref_opt.step()
    _assert_same(full, (part_params, ref_opt))


def test_fused_op_compiles_without_graph_breaks():
    """The functional op runs under torch.compile(fullgraph=True) and matches eager."""
    from qconf.optim.fused import GroupPlan, hyper_values

    shapes = [(64, 96), (300,)]
    params = _params(shapes, torch.float32)
    opt = AdamW(params, lr=1e-2, qconfig=CONFIGS / "default.yml", fused=True, seed=1)
    for p, g in zip(params, _grads(shapes, 0, torch.float32, False)):
        p.grad = g
    opt.step()  # creates the states
    group = opt.param_groups[0]
    plan = GroupPlan(_native.layout()[f"rule.{opt.kernel_rule}"], opt._fused_params(group, params))
    grads = [p.grad for p in params]
    hyper = hyper_values(opt._hyper(group))
    snapshot = [t.clone() for t in plan.params + plan.states + plan.steps]

    def step(grads):
        torch.ops.qconf.fused_step(plan.rule, plan.params, grads, plan.steps, plan.states, plan.meta, plan.tables,
                                   hyper, 7)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(grads)
    after_compiled = [t.clone() for t in plan.params + plan.states + plan.steps]
    for t, s in zip(plan.params + plan.states + plan.steps, snapshot):
        t.data.copy_(s)
    step(grads)
    for x, y in zip(after_compiled, plan.params + plan.states + plan.steps):
        assert torch.equal(x, y)


def test_no_numel_temporaries_in_the_step():
    """A fused step allocates no torch tensor that scales with the parameter size. (The kernel's
    own scratch -- per-thread tile buffers and partial maxima -- is outside torch's allocator; the
    benchmark measures the whole step's peak RSS.)"""
    shapes = [(2048, 1024)]
    params = _params(shapes, torch.float32)
    opt = AdamW(params, qconfig=CONFIGS / "default.yml", fused=True)
    for p, g in zip(params, _grads(shapes, 0, torch.float32, False)):
        p.grad = g
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    peak = max((e.cpu_memory_usage for e in prof.key_averages()), default=0)
    assert peak < 0.02 * math.prod(shapes[0]) * 4, peak
