"""Low-precision weights: stochastic rounding (bf16, fp16) and Kahan compensation."""
from __future__ import annotations

import io
import math

import pytest
import torch

import qconf
from qconf.codec import QTensor
from qconf.optim import SGD, Adam, AdamW, Lion
from qconf.optim import weights as w
from qconf.study.digits import _data, digits_task

from helpers import CONFIGS, assert_same_state, flat_state

BF16_MAX = 3.3895313892515355e38


def _sr_mean(x, draws, fp16=False):
    acc = torch.zeros(x.numel(), dtype=torch.float64)
    chunk = 20000
    g = torch.Generator().manual_seed(7)
    for _ in range(draws // chunk):
        bits = torch.randint(0, 2**32, (chunk, x.numel()), generator=g, dtype=torch.int64)
        xs = x.expand(chunk, -1)
        out = w.f16_stochastic(xs, (bits >> 8).float() * 2.0**-24) if fp16 else w.bf16_stochastic(xs, bits >> 16)
        acc += out.double().sum(0)
    return acc / draws


def test_bf16_stochastic_rounding_is_unbiased_across_magnitudes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, generator=g) * torch.logspace(-30, 30, 48).float()
    # 400k draws: the standard error of the mean is <= 2^-8 / 2 / sqrt(4e5) = 6e-6 relative, so
    # 3e-5 is a 5-sigma bound for every value
    mean = _sr_mean(x, 400_000)
    rel = (mean - x.double()).abs() / x.double().abs()
    assert rel.max().item() <= 3e-5, rel.max().item()


def test_fp16_stochastic_rounding_is_unbiased_in_the_normal_range():
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(48, generator=g) * 2 - 1) * torch.logspace(-4, 4.5, 48).float()
    mean = _sr_mean(x, 400_000, fp16=True)
    rel = (mean - x.double()).abs() / x.double().abs()
    assert rel.max().item() <= 3e-5, rel.max().item()


def test_stochastic_rounding_edge_cases():
    r_all = torch.full((1,), 0xFFFF, dtype=torch.int64)  # the largest random value: rounds up whenever it can
    r_none = torch.zeros(1, dtype=torch.int64)
    cases = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, BF16_MAX, -BF16_MAX,
             3.4028234663852886e38, 1e-40, -1e-40, 1.17e-38]
    for v in cases:
        x = torch.tensor([v])
        for r in (r_all, r_none):
            y = w.bf16_stochastic(x, r)
            assert y.dtype == torch.bfloat16
            if math.isnan(v):
                assert torch.isnan(y).all()
            elif math.isinf(v):
                assert y.item() == v
            else:
                assert math.isfinite(y.item())  # a finite value never rounds to infinity
                assert math.copysign(1.0, y.item()) == math.copysign(1.0, v)  # signs, incl. -0.0, kept
    # the fp32 maximum saturates at the largest finite bf16 when rounding up
    assert w.bf16_stochastic(torch.tensor([3.4028234663852886e38]), r_all).item() == BF16_MAX
    # exactly representable values never move; subnormals round between their neighbours
    assert w.bf16_stochastic(torch.tensor([1.5]), r_all).item() == 1.5
    sub = torch.tensor([1e-40])
    lo, hi = w.bf16_stochastic(sub, r_none).item(), w.bf16_stochastic(sub, r_all).item()
    assert lo < 1e-40 < hi and hi - lo == pytest.approx(2.0**-133)
    # fp16: NaN/Inf pass through, overflow saturates at 65504, -0.0 stays -0.0
    u_hi, u_lo = torch.tensor([0.0]), torch.tensor([0.999999])
    for v in (float("nan"), float("inf"), -float("inf")):
        y = w.f16_stochastic(torch.tensor([v]), u_hi)
        assert (torch.isnan(y) if math.isnan(v) else y == v).all()
    assert w.f16_stochastic(torch.tensor([1e6]), u_hi).item() == 65504.0
    assert w.f16_stochastic(torch.tensor([-70000.0]), u_hi).item() == -65504.0
    assert str(w.f16_stochastic(torch.tensor([-0.0]), u_hi).item()) == "-0.0"
    assert w.f16_stochastic(torch.tensor([1e-8]), u_lo).item() == 0.0  # below the smallest subnormal
    assert w.f16_stochastic(torch.tensor([1e-8]), u_hi).item() == 2.0**-24


def test_bf16_nearest_matches_torch_for_finite_values():
    x = torch.randn(100000) * torch.logspace(-35, 35, 100000)
    assert torch.equal(w.bf16_nearest(x), x.to(torch.bfloat16))


def test_kahan_update_carries_the_rounding_residual():
    p_old = torch.tensor([1.0, 256.0, -3.0])
    upd = torch.tensor([1e-4, 0.4, -2e-5])  # far below the bf16 spacing at these magnitudes
    comp = torch.zeros(3)
    p = p_old.to(torch.bfloat16)
    total = torch.zeros(3, dtype=torch.float64)
    for _ in range(1000):
        target = p.float() + upd  # the fp32 result an optimizer computes
        total += (target - p.float()).double()
        p, comp = w.kahan_update(p.float(), target, comp, torch.bfloat16, False, None)
    # what was applied plus what is pending equals the sum of the fp32 updates (up to fp32 rounding of c)
    applied = p.double() - p_old.to(torch.bfloat16).double()
    torch.testing.assert_close(applied + comp.double(), total, rtol=1e-5, atol=1e-7)
    assert (p != p_old.to(torch.bfloat16)).all()  # the small updates did arrive


def _train_digits(dtype, steps=600, lr=1e-4, seeds=(0,), fused=True, **kw):
    task = digits_task()
    _, _, xe, ye = _data()
    out = []
    for seed in seeds:
        model = task.make_model(seed).to(dtype)
        opt = AdamW(model.parameters(), lr=lr, weight_decay=0.0, qconfig=CONFIGS / "fp32.yml", fused=fused, **kw)
        batches = task.batches(seed)
        for _ in range(steps):
            x, y = next(batches)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
            opt.step()
        with torch.no_grad():
            out.append(torch.nn.functional.cross_entropy(model(xe.to(dtype)).float(), ye).item())
    return sum(out) / len(out)


def test_pure_bf16_training_with_sr_or_kahan_matches_fp32():
    """With a small learning rate, updates fall below bf16's resolution: plain bf16 stalls while
    stochastic rounding and Kahan compensation end within 2% of fp32 training. One seed: on each
    of seeds 0, 1 and 2 alone both end within 0.25% of fp32 and plain bf16 above 3x."""
    fp32 = _train_digits(torch.float32)
    plain = _train_digits(torch.bfloat16)
    sr = _train_digits(torch.bfloat16, bf16_stochastic_round=True)
    kahan = _train_digits(torch.bfloat16, compensation="kahan")
    print(f"held-out loss after 600 steps at lr 1e-4 (seed 0): fp32 {fp32:.4f}, bf16 nearest {plain:.4f}, "
          f"bf16 + stochastic rounding {sr:.4f}, bf16 + Kahan {kahan:.4f}")
    assert abs(sr - fp32) <= 0.02 * fp32
    assert abs(kahan - fp32) <= 0.02 * fp32
    assert plain > 1.5 * fp32  # measurably behind


@pytest.mark.parametrize("make", [
    lambda ps, **k: AdamW(ps, lr=1e-3, **k),
    lambda ps, **k: Adam(ps, lr=1e-3, weight_decay=0.01, **k),
    lambda ps, **k: SGD(ps, lr=0.05, momentum=0.9, **k),
    lambda ps, **k: Lion(ps, lr=1e-4, **k),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_optimizer_takes_weights_policies(make, dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 80).to(dtype)), torch.nn.Parameter(torch.randn(80).to(dtype))]
    cfg = {"weights": {"rounding": "stochastic", "compensation": "kahan",
                       "compensation_codec": {"bits": 8}}}
    opt = make(params, qconfig=cfg, fused=False, seed=3)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    big, small = opt.state[params[0]]["kahan_comp"], opt.state[params[1]]["kahan_comp"]
    assert isinstance(big, QTensor) and big.codec.bits == 8  # quantized with the configured codec
    assert isinstance(small, QTensor)  # the compensation codec has no size threshold
    assert all(p.dtype == dtype for p in params)


def test_compensation_buffer_in_param_dtype_and_memory_report():
    p = torch.nn.Parameter(torch.randn(128, 128).to(torch.bfloat16))
    opt = AdamW([p], qconfig=CONFIGS / "default.yml", compensation="kahan", fused=False)
    p.grad = torch.randn_like(p)
    opt.step()
    comp = opt.state[p]["kahan_comp"]
    assert comp.dtype == torch.bfloat16 and comp.shape == p.shape
    rep = qconf.memory_report(opt)
    assert rep.rows[0].states["kahan_comp"] == 2 * p.numel()
    assert rep.rows[0].formats["kahan_comp"] == "bfloat16"
    # fp32 params never get a buffer: compensation only concerns low-precision weights
    q = torch.nn.Parameter(torch.randn(10))
    opt2 = AdamW([q], compensation="kahan", fused=False)
    q.grad = torch.randn_like(q)
    opt2.step()
    assert "kahan_comp" not in opt2.state[q]


def test_weights_config_overrides_per_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(torch.bfloat16)
    cfg = {"overrides": [{"match": "0.*", "weights": {"compensation": "kahan"}},
                         {"match": "1.weight", "weights": {"rounding": "stochastic"}}]}
    opt = AdamW(model.named_parameters(), qconfig=cfg, fused=False)
    assert opt.plan(0).weights.compensation == "kahan" and opt.plan(2).weights.compensation == "none"
    assert opt.plan(2).weights.rounding == "stochastic" and opt.plan(3).weights.rounding == "nearest"
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    assert "kahan_comp" in opt.state[model[0].weight] and "kahan_comp" not in opt.state[model[1].weight]


def test_weights_arguments_are_validated():
    with pytest.raises(ValueError, match="compensation must be None, 'none' or 'kahan'"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], compensation="kahn")
    with pytest.raises(ValueError, match="bf16_stochastic_round must be True or False"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], bf16_stochastic_round="yes")
    with pytest.raises(qconf.QConfigError, match="weights.rounding"):
        qconf.load_config({"weights": {"rounding": "sr"}})
    with pytest.raises(qconf.QConfigError, match="weights.compensation_codec.scale"):
        qconf.load_config({"weights": {"compensation_codec": {"scale": "rank1"}}})
    with pytest.raises(qconf.QConfigError, match=r"weights.compensation_codec.group_size.*1..16384"):
        qconf.load_config({"weights": {"compensation_codec": {"group_size": 20000}}})


def test_checkpoint_with_compensation_resumes_bit_exactly():
    def make(ps):
        return AdamW(ps, lr=1e-3, bf16_stochastic_round=True, compensation="kahan", fused=False, seed=9,
                     qconfig={"weights": {"compensation_codec": {"bits": 8}}})

    def run(params, opt, steps, first=0):
        for s in range(first, first + steps):
            g = torch.Generator().manual_seed(s)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()

    torch.manual_seed(0)
    init = [torch.randn(70, 90), torch.randn(90)]
    full = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
    opt_full = make(full)
    run(full, opt_full, 10)
    part = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
    opt_part = make(part)
    run(part, opt_part, 5)
    buf = io.BytesIO()
    torch.save(opt_part.state_dict(), buf)
    buf.seek(0)
    opt_resumed = make(part)
    opt_resumed.load_state_dict(torch.load(buf, weights_only=True))
    run(part, opt_resumed, 5, first=5)
    assert all(torch.equal(a, b) for a, b in zip(full, part))
    assert_same_state(flat_state(opt_full), flat_state(opt_resumed))
