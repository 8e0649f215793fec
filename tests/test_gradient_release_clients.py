"""Gradient release inside the training frameworks users run us in, unchanged: HF Trainer (its
optimizer.step() and model.zero_grad() around our hooks, a scheduler) and Lightning (automatic
optimization: step(closure) on every batch, a per-step scheduler). Each run equals the same run
without gradient release bit for bit; the framework features that cannot work are refused."""
from __future__ import annotations

import pytest
import torch

from qconf.optim import AdamW, prepare_gradient_release

from client_runs import hf_trainer_run, lightning_fit
from helpers import CONFIGS, assert_same_run, mlp

QCONFIG = {"base": str(CONFIGS / "default.yml"), "min_numel": 0, "weights": {"rounding": "stochastic"}}


# ---------------------------------------------------------------------------------------------
# HF Trainer

class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp(0, dtype=torch.bfloat16)

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x.bfloat16()).float(), y)}


def _hf_run(tmp_path, release, grad_norms=True, **args):
    """Train 6 steps under HF Trainer. It computes the gradients' global norm on every step (to log
    it, clip_grad_norm_ with an infinite threshold when max_grad_norm=0), so a release run keeps the
    norms (``grad_norms=True``) unless told otherwise."""
    model = _Regression()
    opt = AdamW(model.named_parameters(), lr=1e-2, qconfig=QCONFIG, seed=5, gradient_release=release)
    if release:
        prepare_gradient_release(model, opt, grad_norms=grad_norms)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    hf_trainer_run(model, opt, sched, tmp_path / f"hf{int(release)}", 6, **args)
    return model, opt


def test_hf_trainer_runs_unchanged_and_equals_the_normal_step(tmp_path):
    normal, release = _hf_run(tmp_path, False), _hf_run(tmp_path, True)
    assert_same_run(normal, release)
    assert int(release[1].state[release[0].net[0].weight]["step"]) == 6
    assert release[1].param_groups[0]["lr"] == normal[1].param_groups[0]["lr"] == pytest.approx(1e-2 / 7)


def test_hf_trainer_clipping_and_accumulation_are_refused(tmp_path):
    # with grad_norms=True a clip that clips nothing changes nothing (the gradients' norm here is ~0.4);
    # one that would scale the gradients is refused at that step
    assert_same_run(_hf_run(tmp_path, False, max_grad_norm=10.0), _hf_run(tmp_path, True, max_grad_norm=10.0))
    with pytest.raises(RuntimeError, match="which gradient release already used for its step and freed.*max_grad_norm"):
        _hf_run(tmp_path, True, max_grad_norm=1e-3)
    # without grad_norms=True, HF Trainer's norm on the first step is refused, naming the fix
    with pytest.raises(RuntimeError, match="kept no norm of the gradient of .*grad_norms=True.*max_grad_norm=0"):
        _hf_run(tmp_path, True, grad_norms=False)
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps=1"):
        _hf_run(tmp_path, True, gradient_accumulation_steps=2)


# ---------------------------------------------------------------------------------------------
# Lightning

def _lightning_run(release):
    def configure_optimizers(module):
        opt = AdamW(module.net.named_parameters(), lr=1e-2, qconfig=QCONFIG | {"weights": {}}, seed=5,
                    gradient_release=release)
        if release:
            prepare_gradient_release(module, opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        module.opt = opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = lightning_fit(mlp(0), configure_optimizers, 6)
    return module.net, module.opt


def test_lightning_runs_unchanged_and_equals_the_normal_step():
    normal, release = _lightning_run(False), _lightning_run(True)
    assert_same_run(normal, release)
    assert int(release[1].state[release[0][0].weight]["step"]) == 6
