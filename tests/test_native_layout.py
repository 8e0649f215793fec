"""``torch.ops.qconf.layout()``: the argument layout of the native ops, as the kernels read it.

The layout (csrc/include/qconf/layout.h) is the one source of the positions in the ops' ``hyper``
list, ``meta`` table, ``states`` list and codec int list, and of the state / scale / rule codes.
These tests build the ops' arguments from the dict alone -- nothing from qconf's own argument
builders -- and compare the kernels' results with the reference path (public classes only), so a
wrong value in the dict, or a kernel reading another position than the dict says, fails here.

The codec tables are built here too, from the public ``Codec.qmap`` / ``Codec.midpoints``: the
rows every path reads (the map, the midpoints then +inf, the map then +inf), the rest zero, which
means "no shortcut" (no midpoint grid, no octave lines). The fused step runs on the scalar ISA,
which needs nothing else; the layout does not depend on the ISA.
"""
from __future__ import annotations

import math

import pytest
import torch

import qconf
from qconf import _native
from qconf.optim import SGD, Adam, AdamW, Lion

if not _native.fused_available():  # pragma: no cover - the CI build always has the extension
    pytest.skip(f"fused kernels unavailable: {_native.native_error()}", allow_module_level=True)

KEYS = {
    "hyper.lr", "hyper.beta1", "hyper.beta2", "hyper.eps", "hyper.weight_decay", "hyper.momentum",
    "hyper.dampening", "hyper.maximize", "hyper.nesterov", "hyper.decoupled", "hyper.adjusted_lr", "hyper.len",
    "meta.index", "meta.first", "meta.factored", "meta.ndim", "meta.shape", "meta.state0", "meta.state1",
    "meta.weights", "meta.comp", "meta.rng_offset", "meta.cols",
    "state.kind", "state.table", "state.codec", "state.cols",
    "codec.bits", "codec.levels", "codec.scale_kind", "codec.block", "codec.d1", "codec.inner", "codec.stochastic",
    "codec.len",
    "encode.num_scales", "encode.len",
    "slot.state0", "slot.state0_scales", "slot.state1", "slot.state1_scales", "slot.row", "slot.col", "slot.comp",
    "slot.comp_scales", "slot.len",
    "kind.none", "kind.fp32", "kind.quant", "kind.param_dtype",
    "scale.block", "scale.dim1", "scale.rank1",
    "rule.adam", "rule.sgd", "rule.lion", "rule.muon_momentum", "rule.muon_update",
    "weights.stochastic", "weights.kahan",
    "lines.seg_bounds", "lines.seg_slope", "lines.seg_offset", "lines.seg_cap", "lines.seg_top", "lines.seg_eps",
    "lines.seg_present", "lines.val_shift", "lines.val_center", "lines.val_slope", "lines.val_offset", "lines.val_bias",
    "lines.val_words", "lines.val_present",
    "table.rows", "table.size", "max_dims",
}
SEED = 1234


@pytest.fixture(scope="module")
def L() -> dict[str, int]:
    return dict(torch.ops.qconf.layout())


@pytest.fixture
def scalar_isa(monkeypatch):
    monkeypatch.setenv("QCONF_CPU_ISA", "scalar")


def test_layout_keys_and_self_consistency(L):
    assert set(L) == KEYS
    assert all(isinstance(v, int) for v in L.values())
    # each group's positions are distinct and fit its length
    for group, length in (("hyper", "hyper.len"), ("slot", "slot.len")):
        pos = [v for k, v in L.items() if k.startswith(group + ".") and k != length]
        assert sorted(pos) == list(range(L[length])), group
    codec = [v for k, v in L.items() if k.startswith("codec.") and k != "codec.len"]
    assert sorted(codec) == list(range(L["codec.len"]))
    assert L["encode.len"] == L["codec.len"] + 1 and 0 <= L["encode.num_scales"] < L["encode.len"]
    assert L["encode.num_scales"] not in codec
    # the segment-line fields of the codec table's lines row: in order, inside the row
    seg = [L[f"lines.seg_{k}"] for k in ("bounds", "slope", "offset", "cap", "top", "eps", "present")]
    assert seg == sorted(seg) and seg[-1] < L["table.size"]
    for group in ("kind", "scale", "rule"):
        values = [v for k, v in L.items() if k.startswith(group + ".")]
        assert len(set(values)) == len(values), group
    assert L["weights.stochastic"] & L["weights.kahan"] == 0
    # a state's column block: kind, table and the codec fields, inside one meta row
    assert L["state.cols"] >= L["state.codec"] + L["codec.len"]
    assert len({L["state.kind"], L["state.table"], L["state.codec"]}) == 3
    blocks = [(L[k], L[k] + w) for k, w in (("meta.index", 1), ("meta.first", 1), ("meta.factored", 1),
                                            ("meta.ndim", 1), ("meta.shape", L["max_dims"]),
                                            ("meta.state0", L["state.cols"]), ("meta.state1", L["state.cols"]),
                                            ("meta.weights", 1), ("meta.comp", L["state.cols"]),
                                            ("meta.rng_offset", 1))]
    blocks.sort()
    assert all(a[1] <= b[0] for a, b in zip(blocks, blocks[1:])), blocks
    assert blocks[-1][1] <= L["meta.cols"]


# ---------------------------------------------------------------------------------------------
# helpers: everything from the layout dict and public classes

def _table(L, codec: qconf.Codec) -> torch.Tensor:
    """One codec's [table.rows, table.size] table: rows 0-2 as the kernels read them, zeros after."""
    size = L["table.size"]
    qmap = codec.qmap
    levels = qmap.numel()
    t = torch.zeros(L["table.rows"], size)
    t[0, :levels] = qmap
    t[0, levels:] = qmap[-1]
    t[1] = math.inf
    t[1, : levels - 1] = codec.midpoints
    t[2] = math.inf
    t[2, :levels] = qmap
    return t


def _scale_fields(L, codec: qconf.Codec, shape) -> dict[str, int]:
    """codec.scale_kind / block / d1 / inner of a codec on `shape` (no rank fallbacks in these tests)."""
    numel = math.prod(shape)
    if codec.scale == "group":
        return {"scale_kind": L["scale.block"], "block": codec.group_size, "d1": 0, "inner": 0}
    if codec.scale == "tensor":
        return {"scale_kind": L["scale.block"], "block": numel, "d1": 0, "inner": 0}
    if codec.scale == "dim0":
        return {"scale_kind": L["scale.block"], "block": numel // shape[0], "d1": 0, "inner": 0}
    if codec.scale == "dim1":
        assert len(shape) >= 2
        return {"scale_kind": L["scale.dim1"], "block": 0, "d1": shape[1], "inner": math.prod(shape[2:])}
    assert codec.scale == "rank1" and len(shape) >= 2
    return {"scale_kind": L["scale.rank1"], "block": 0, "d1": 0, "inner": 0}


def _codec_ints(L, codec: qconf.Codec, shape) -> list[int]:
    fields = {"bits": codec.bits, "levels": codec.qmap.numel(), "stochastic": int(codec.rounding == "stochastic"),
              **_scale_fields(L, codec, shape)}
    out = [-1] * L["codec.len"]
    for name, value in fields.items():
        out[L["codec." + name]] = value
    assert -1 not in out
    return out


CODECS = [
    ((40, 100), dict(bits=4, map="nonlinear", signed=True, scale="group", group_size=64)),
    ((40, 100), dict(bits=4, map="power-1", signed=False, scale="rank1")),
    ((6, 5, 7), dict(bits=4, map="nonlinear", signed=True, scale="dim1")),
    ((6, 5, 7), dict(bits=3, map="linear", signed=True, scale="dim0")),
    ((513,), dict(bits=2, map="nonlinear", signed=True, scale="tensor")),
    ((12, 34), dict(bits=4, map="nonlinear", signed=True, scale="group", group_size=32, rounding="stochastic")),
]


@pytest.mark.parametrize("shape,kw", CODECS, ids=[f"{kw['scale']}-{kw['bits']}" for _, kw in CODECS])
def test_encode_decode_codec_list(L, shape, kw):
    codec = qconf.Codec(**kw)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))
    noise = torch.rand(shape, generator=g) if codec.rounding == "stochastic" else None
    ref = codec.encode(x, noise=noise)
    args = [-1] * L["encode.len"]
    for k, v in enumerate(_codec_ints(L, codec, shape)):  # the codec fields, then num_scales
        args[k] = v
    args[L["encode.num_scales"]] = codec.num_scales(shape)
    assert ref.scales.numel() == codec.num_scales(shape)
    table = _table(L, codec)
    codes, scales = torch.ops.qconf.encode(x.contiguous(), table, args, noise)
    assert torch.equal(scales, ref.scales)
    assert torch.equal(codes, ref.codes)
    out = torch.ops.qconf.decode(ref.codes, ref.scales, table, args, list(shape))
    assert torch.equal(out, codec.decode(ref))


# ---------------------------------------------------------------------------------------------
# the fused step


def _state_block(L, meta_row, base, value, shape, tables, slots, value_slot, scales_slot, dense_kind):
    """A state's meta columns (kind, table, codec fields) and tensor slots."""
    if isinstance(value, qconf.QTensor):
        table = len(tables)
        tables.append(_table(L, value.codec))
        meta_row[base + L["state.kind"]] = L["kind.quant"]
        meta_row[base + L["state.table"]] = table
        ints = _codec_ints(L, value.codec, shape)
        meta_row[base + L["state.codec"]: base + L["state.codec"] + L["codec.len"]] = torch.tensor(ints)
        slots[value_slot] = value.codes.clone()
        slots[scales_slot] = value.scales.clone()
    elif value is not None:
        meta_row[base + L["state.kind"]] = dense_kind
        slots[value_slot] = value.clone()


def _fused_step(L, rule, p, grad, step, states, hyper, *, index=0, first=False, factored=False, weights=0):
    """One fused step of one parameter through torch.ops.qconf.fused_step; `states`: the
    optimizer's state entries by their role (state0, state1, row, col, comp). Returns the
    parameter and the state slots after the step."""
    shape = tuple(p.shape)
    meta = torch.zeros(1, L["meta.cols"], dtype=torch.int64)
    m = meta[0]
    m[L["meta.index"]] = index
    m[L["meta.first"]] = int(first)
    m[L["meta.factored"]] = int(factored)
    m[L["meta.ndim"]] = len(shape)
    m[L["meta.shape"]: L["meta.shape"] + len(shape)] = torch.tensor(shape)
    m[L["meta.weights"]] = weights
    slots = [torch.empty(0)] * L["slot.len"]
    tables: list[torch.Tensor] = []
    _state_block(L, m, L["meta.state0"], states.get("state0"), shape, tables, slots, L["slot.state0"],
                 L["slot.state0_scales"], L["kind.fp32"])
    _state_block(L, m, L["meta.state1"], states.get("state1"), shape, tables, slots, L["slot.state1"],
                 L["slot.state1_scales"], L["kind.fp32"])
    _state_block(L, m, L["meta.comp"], states.get("comp"), shape, tables, slots, L["slot.comp"],
                 L["slot.comp_scales"], L["kind.param_dtype"])
    if factored:
        slots[L["slot.row"]] = states["row"].clone()
        slots[L["slot.col"]] = states["col"].clone()
    table = torch.stack(tables) if tables else torch.zeros(1, L["table.rows"], L["table.size"])
    hyper_list = [0.0] * L["hyper.len"]
    for name, value in hyper.items():
        hyper_list[L["hyper." + name]] = float(value)
    p = p.detach().clone()
    steps = [torch.tensor([float(step)])]
    torch.ops.qconf.fused_step(L["rule." + rule], [p], [grad], steps, slots, meta, table, hyper_list, SEED)
    assert steps[0].item() == step + 1
    return p, slots


def _reference(make, shape, dtype, steps):
    """Run the reference optimizer `steps` steps; return the parameter, optimizer and the grads used
    for the last step, plus a snapshot (parameter, state) taken before the last step."""
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.5).to(dtype))
    opt = make([p])
    snap = None
    grad = None
    for s in range(steps):
        grad = (torch.randn(shape, generator=g) * 0.1).to(dtype)
        if s == steps - 1:
            snap = (p.detach().clone(), {k: (qconf.QTensor(v.codes.clone(), v.scales.clone(), v.shape, v.codec)
                                             if isinstance(v, qconf.QTensor) else
                                             v.clone() if isinstance(v, torch.Tensor) else v)
                                         for k, v in opt.state[p].items()})
        p.grad = grad
        opt.step()
    return p, opt, grad, snap


CFG_QUANT = {"min_numel": 0, "states": {
    "exp_avg": {"bits": 4, "map": "nonlinear", "signed": True, "scale": "group", "group_size": 64},
    "exp_avg_sq": {"bits": 4, "map": "power-1", "signed": False, "scale": "rank1"}}}
CFG_DIM1 = {"min_numel": 0, "states": {
    "exp_avg": {"bits": 4, "map": "nonlinear", "signed": True, "scale": "dim1"},
    "exp_avg_sq": {"enable": False}}}
CFG_FP32 = {"min_numel": 0, "states": {"exp_avg": {"enable": False}, "exp_avg_sq": {"enable": False}}}

ADAM_CASES = [
    # (name, make, shape, decoupled)
    ("adamw-quant", lambda ps: AdamW(ps, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, qconfig=CFG_QUANT,
                                     fused=False, seed=SEED), (48, 64), 1),
    ("adam-l2-dim1", lambda ps: Adam(ps, lr=2e-3, betas=(0.85, 0.9), eps=1e-5, weight_decay=0.05, maximize=True,
                                     qconfig=CFG_DIM1, fused=False, seed=SEED), (6, 8, 5), 0),
]


@pytest.mark.parametrize("name,make,shape,decoupled", ADAM_CASES, ids=[c[0] for c in ADAM_CASES])
def test_fused_step_adam(L, scalar_isa, name, make, shape, decoupled):
    p_ref, opt, grad, (p0, st0) = _reference(make, shape, torch.float32, steps=2)
    group = opt.param_groups[0]
    hyper = {"lr": group["lr"], "beta1": group["betas"][0], "beta2": group["betas"][1], "eps": group["eps"],
             "weight_decay": group["weight_decay"], "maximize": group["maximize"], "decoupled": decoupled}
    p, slots = _fused_step(L, "adam", p0, grad, st0["step"].item(), {"state0": st0["exp_avg"],
                                                                        "state1": st0["exp_avg_sq"]}, hyper)
    st = opt.state[p_ref]
    assert torch.equal(p, p_ref.detach())
    for k, slot in (("exp_avg", "state0"), ("exp_avg_sq", "state1")):
        ref = st[k]
        if isinstance(ref, qconf.QTensor):
            assert torch.equal(slots[L["slot." + slot]], ref.codes), k
            assert torch.equal(slots[L["slot." + slot + "_scales"]], ref.scales), k
        else:
            assert torch.equal(slots[L["slot." + slot]], ref), k


def test_fused_step_factored(L, scalar_isa):
    make = lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.0, factor_second_moment=True, qconfig=CFG_FP32,  # noqa: E731
                            fused=False, seed=SEED)
    p_ref, opt, grad, (p0, st0) = _reference(make, (3, 16, 24), torch.float32, steps=2)
    group = opt.param_groups[0]
    hyper = {"lr": group["lr"], "beta1": group["betas"][0], "beta2": group["betas"][1], "eps": group["eps"],
             "weight_decay": group["weight_decay"], "decoupled": 1}
    p, slots = _fused_step(L, "adam", p0, grad, st0["step"].item(),
                           {"state0": st0["exp_avg"], "row": st0["exp_avg_sq_row"], "col": st0["exp_avg_sq_col"]},
                           hyper, factored=True)
    st = opt.state[p_ref]
    # the factored statistics' means are summed in another order than the reference's (test_fused.py)
    torch.testing.assert_close(p, p_ref.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(slots[L["slot.row"]], st["exp_avg_sq_row"], rtol=1e-6, atol=0)
    torch.testing.assert_close(slots[L["slot.col"]], st["exp_avg_sq_col"], rtol=1e-6, atol=0)
    torch.testing.assert_close(slots[L["slot.state0"]], st["exp_avg"], rtol=1e-6, atol=0)
    assert not torch.equal(slots[L["slot.row"]], st0["exp_avg_sq_row"])  # the statistics were updated


SGD_CASES = [
    ("damp-max", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01, maximize=True)),
    ("nesterov", dict(lr=0.05, momentum=0.8, nesterov=True)),
]


@pytest.mark.parametrize("name,kw", SGD_CASES, ids=[c[0] for c in SGD_CASES])
@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
def test_fused_step_sgd(L, scalar_isa, name, kw, first):
    make = lambda ps: SGD(ps, qconfig=CFG_FP32, fused=False, seed=SEED, **kw)  # noqa: E731
    p_ref, opt, grad, (p0, st0) = _reference(make, (50, 30), torch.float32, steps=1 if first else 2)
    group = opt.param_groups[0]
    hyper = {name: group[name] for name in ("lr", "momentum", "dampening", "weight_decay", "maximize", "nesterov")}
    buf = torch.zeros(50, 30) if first else st0["momentum_buffer"]
    step = 0 if first else st0["step"].item()
    p, slots = _fused_step(L, "sgd", p0, grad, step, {"state0": buf}, hyper, first=first)
    assert torch.equal(p, p_ref.detach())
    assert torch.equal(slots[L["slot.state0"]], opt.state[p_ref]["momentum_buffer"])


def test_fused_step_lion(L, scalar_isa):
    make = lambda ps: Lion(ps, lr=1e-3, betas=(0.9, 0.97), weight_decay=0.1, qconfig=CFG_QUANT,  # noqa: E731
                           fused=False, seed=SEED)
    p_ref, opt, grad, (p0, st0) = _reference(make, (20, 64), torch.float32, steps=2)
    group = opt.param_groups[0]
    hyper = {"lr": group["lr"], "beta1": group["betas"][0], "beta2": group["betas"][1],
             "weight_decay": group["weight_decay"], "decoupled": 1}
    p, slots = _fused_step(L, "lion", p0, grad, st0["step"].item(), {"state0": st0["exp_avg"]}, hyper)
    st = opt.state[p_ref]
    assert torch.equal(p, p_ref.detach())
    assert torch.equal(slots[L["slot.state0"]], st["exp_avg"].codes)
    assert torch.equal(slots[L["slot.state0_scales"]], st["exp_avg"].scales)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_fused_step_bf16_weights(L, scalar_isa, stochastic):
    """weights.kahan / weights.stochastic bits, the Kahan buffer's slot, meta.index (the rng stream)."""
    index = 1
    make = lambda ps: AdamW([torch.nn.Parameter(torch.zeros(3)), *ps], lr=1e-2, qconfig=CFG_FP32,  # noqa: E731
                            fused=False, seed=SEED, compensation="kahan", bf16_stochastic_round=stochastic)
    p_ref, opt, grad, (p0, st0) = _reference(make, (32, 40), torch.bfloat16, steps=2)
    assert [id(q) for q in opt.param_groups[0]["params"]].index(id(p_ref)) == index
    group = opt.param_groups[0]
    hyper = {"lr": group["lr"], "beta1": group["betas"][0], "beta2": group["betas"][1], "eps": group["eps"],
             "weight_decay": group["weight_decay"], "decoupled": 1}
    weights = L["weights.kahan"] | (L["weights.stochastic"] if stochastic else 0)
    p, slots = _fused_step(L, "adam", p0, grad, st0["step"].item(),
                           {"state0": st0["exp_avg"], "state1": st0["exp_avg_sq"], "comp": st0["kahan_comp"]}, hyper,
                           index=index, weights=weights)
    st = opt.state[p_ref]
    assert torch.equal(p.view(torch.int16), p_ref.detach().view(torch.int16))
    assert torch.equal(slots[L["slot.comp"]].view(torch.int16), st["kahan_comp"].view(torch.int16))
    assert torch.equal(slots[L["slot.state0"]], st["exp_avg"])
