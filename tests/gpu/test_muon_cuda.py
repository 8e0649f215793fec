"""qconf.optim.Muon on a CUDA GPU (both kernel families: benchmarks/gpu_check.sh runs tests/gpu
with the generic and with the specialized kernels).

* quantization off: torch.optim.Muon on the same device, bit for bit (its lerps and ``add_(alpha=)``
  are fused multiply-adds in nvcc's code, as in our rules);
* the two native Muon calls on CUDA equal the CPU's bit for bit, Newton–Schulz computed on the CPU
  for both runs (bf16 matmuls on a GPU and a CPU differ; the calls around them must not);
* fused == reference on CUDA, Newton–Schulz on the GPU for both.

``QCONF_GPU_TEST_DEVICE=cpu`` runs the same tests on the CPU (a dry run of the test code before a
GPU is lent: CPU against CPU).
"""
from __future__ import annotations

import os

import pytest
import torch

import qconf.optim.muon
from qconf.optim import Muon
from qconf.optim.newton_schulz import zeropower

from helpers import CONFIGS, assert_same_run, flat_state

DEVICE = os.environ.get("QCONF_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: tall, wide, square, vector tails, and a matrix of several groups / rank-1 rows of 640 columns
SHAPES = [(48, 20), (20, 48), (32, 32), (37, 53), (129, 7), (96, 640)]
STEPS = 8
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, seed=3)

CASES = {
    "muon_8bit": (str(CONFIGS / "muon_8bit.yml"), {}),
    "muon_4bit": (str(CONFIGS / "muon_4bit.yml"), {}),
    "4bit_sr": (str(CONFIGS / "muon_4bit.yml"), {"states": {"exp_avg": {"rounding": "stochastic", "scale": "group",
                                                                        "group_size": 64}}}),
    "fp32": (str(CONFIGS / "fp32.yml"), {}),
    "bf16_sr": (str(CONFIGS / "muon_8bit.yml"), {"weights": {"rounding": "stochastic"}}),
    "bf16_kahan": (str(CONFIGS / "muon_8bit.yml"), {"weights": {"compensation": "kahan"}}),
    "bf16_sr_kahan": (str(CONFIGS / "muon_4bit.yml"), {"weights": {"rounding": "stochastic", "compensation": "kahan"}}),
}


def _dtype(case):
    return torch.bfloat16 if case.startswith("bf16") else torch.float32


def _run(case, device, fused, nesterov=True, steps=STEPS):
    base, extra = CASES[case]
    dtype = _dtype(case)
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in SHAPES]
    opt = Muon([{"params": params, "use_muon": True}], qconfig={"base": base, "min_numel": 0, **extra},
               fused=fused, nesterov=nesterov, **KW)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        for p, s in zip(params, SHAPES):
            p.grad = (torch.randn(s, generator=g) * 10.0 ** (step % 3 - 2)).to(dtype).to(device)
        opt.step()
    return params, opt


@pytest.fixture
def newton_schulz_on_the_cpu(monkeypatch):
    """Muon's Newton–Schulz computed on the CPU whatever the parameter's device (the same bits for
    a CUDA and a CPU run; the bf16 result goes back to the parameter's device)."""
    def on_cpu(u, coefficients, steps, eps):
        return zeropower(u.cpu(), coefficients, steps, eps).to(u.device)

    monkeypatch.setattr(qconf.optim.muon, "zeropower", on_cpu)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_quantization_off_equals_torch_muon_on_the_device(nesterov, adjust_lr_fn, fused):
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ours = [torch.nn.Parameter(t.to(DEVICE)) for t in init]
    theirs = [torch.nn.Parameter(t.to(DEVICE)) for t in init]
    opt = Muon(ours, qconfig=CONFIGS / "fp32.yml", fused=fused, **kw)
    torch_opt = torch.optim.Muon(theirs, **kw)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 + step)
        for p, q, s in zip(ours, theirs, SHAPES):
            p.grad = torch.randn(s, generator=g).to(DEVICE)
            q.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"parameter {i}: max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_muon_calls_equal_the_cpu_fused_calls(case, newton_schulz_on_the_cpu):
    assert_same_run(_run(case, DEVICE, True), _run(case, "cpu", True))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_reference_on_the_device(case, nesterov):
    assert_same_run(_run(case, DEVICE, True, nesterov), _run(case, DEVICE, False, nesterov))


def test_non_finite_gradients_equal_the_cpu(newton_schulz_on_the_cpu):
    """A NaN and an infinity in one step's gradient of each matrix: NaN spreads the same way."""
    runs = []
    for device in (DEVICE, "cpu"):
        params, opt = _run("muon_8bit", device, True, steps=2)
        g = torch.Generator().manual_seed(7)
        for p in params:
            grad = torch.randn(p.shape, generator=g)
            grad.view(-1)[3], grad.view(-1)[5] = float("nan"), float("inf")
            p.grad = grad.to(device)
        opt.step()
        runs.append((params, opt))
    (pa, oa), (pb, ob) = runs
    for i, (a, b) in enumerate(zip(pa, pb)):
        assert torch.isnan(b).any()
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=0, atol=0, equal_nan=True, msg=f"parameter {i}")
    sa, sb = flat_state(oa), flat_state(ob)
    for k in sb:
        if isinstance(sb[k], torch.Tensor):
            torch.testing.assert_close(sa[k].cpu(), sb[k], rtol=0, atol=0, equal_nan=True, msg=k)
