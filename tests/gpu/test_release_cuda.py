"""Gradient release and checkpoints on a CUDA GPU (issue 50: never run on one before).

* Each parameter stepped inside backward on CUDA gives, after N steps, the parameters and states of
  N normal CUDA steps bit for bit: every rule, 4-bit group-128 / rank-1 and 8-bit states, fp32,
  bf16 + stochastic rounding and bf16 + Kahan parameters.
* A checkpoint saved on CUDA loads with ``map_location="cpu", weights_only=True`` into a CPU
  optimizer, and training goes on there exactly as it goes on on the GPU.

``QCONF_GPU_TEST_DEVICE=cpu`` runs the same tests on the CPU (a dry run of the test code).
"""
from __future__ import annotations

import io
import os

import pytest
import torch

import qconf.optim.muon
from qconf.optim import SGD, AdamW, Lion, Muon, prepare_gradient_release
from qconf.optim.newton_schulz import zeropower

from helpers import CONFIGS, assert_same_run, flat_state, mlp, regression_batches

DEVICE = os.environ.get("QCONF_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

QCONFIGS = {"group128": "2nd_moment_group_128.yml", "rank1": "default.yml", "8bit": "8bit.yml"}
WEIGHTS = {"fp32": (torch.float32, {}), "bf16_sr": (torch.bfloat16, {"rounding": "stochastic"}),
           "bf16_kahan": (torch.bfloat16, {"compensation": "kahan"})}
RULES = {
    "adamw": lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.01, **kw),
    "sgd": lambda ps, **kw: SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, **kw),
    "lion": lambda ps, **kw: Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
    "muon": lambda ps, **kw: Muon(ps, lr=0.02, adamw={"lr": 1e-2}, **kw),
}


def _make(rule, config, weights, device, release=False):
    dtype, w = WEIGHTS[weights]
    model = mlp(0, dtype=dtype).to(device)
    qconfig = {"base": str(CONFIGS / QCONFIGS[config]), "min_numel": 0, "weights": w}
    opt = RULES[rule](model.named_parameters(), qconfig=qconfig, fused=True, seed=5, gradient_release=release)
    if release:
        prepare_gradient_release(model, opt)
    return model, opt


def _train(model, opt, batches):
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(device, dtype)).float(), y.to(device)).backward()
        opt.step()


@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("config", sorted(QCONFIGS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_release_on_the_device_equals_normal_steps(rule, config, weights):
    batches = list(regression_batches(5, seed=2))
    normal, released = _make(rule, config, weights, DEVICE), _make(rule, config, weights, DEVICE, release=True)
    _train(*normal, batches)
    _train(*released, batches)
    assert int(released[1].state[released[0][0].weight]["step"]) == 5
    assert_same_run(normal, released)


@pytest.mark.parametrize("rule,weights", [("adamw", "fp32"), ("adamw", "bf16_sr"), ("sgd", "bf16_kahan"),
                                          ("muon", "bf16_sr")])
def test_a_device_checkpoint_resumes_on_the_cpu(rule, weights, monkeypatch):
    """Saved after 3 steps on the device, loaded on the CPU: 3 more steps there equal 3 more on the
    device (Newton–Schulz on the CPU for both, so that Muon's runs see the same bits)."""
    monkeypatch.setattr(qconf.optim.muon, "zeropower",
                        lambda u, *a: zeropower(u.cpu(), *a).to(u.device))
    batches = list(regression_batches(6, seed=3))
    model, opt = _make(rule, "rank1", weights, DEVICE)
    _train(model, opt, batches[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, map_location="cpu", weights_only=True)
    cpu_model, cpu_opt = _make(rule, "rank1", weights, "cpu")
    cpu_model.load_state_dict(saved["model"])
    cpu_opt.load_state_dict(saved["optim"])
    assert all(v.device.type == "cpu" for v in flat_state(cpu_opt).values() if isinstance(v, torch.Tensor))
    _train(model, opt, batches[3:])
    _train(cpu_model, cpu_opt, batches[3:])
    assert_same_run((model, opt), (cpu_model, cpu_opt))
