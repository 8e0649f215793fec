"""qconf.optim.Muon (Muon for the hidden matrices, AdamW for the rest, one optimizer) inside the
training frameworks users run it in, unchanged: HF Trainer (``optimizers=(opt, None)``: the
Trainer creates the LR scheduler) and Lightning (``configure_optimizers`` returning a Muon, a
per-step scheduler, ``step(closure)`` on every batch). Each framework run equals the same training
written as a plain loop with the same optimizer, bit for bit, with and without gradient release
(each matrix's Newton–Schulz runs in its backward hook); the schedulers scale both param groups.
"""
from __future__ import annotations

import io

import pytest
import torch

from qconf.optim import Muon, prepare_gradient_release
from qconf.optim.release import ReleasedGrad

from client_runs import hf_trainer_run, lightning_fit, regression_data, regression_loader
from helpers import CONFIGS, assert_same_run, assert_same_state, flat_state, mlp

#: Muon's 8-bit momentum recipe, every state quantized, bf16 weights stochastically rounded
QCONFIG = {"base": str(CONFIGS / "muon_8bit.yml"), "min_numel": 0, "weights": {"rounding": "stochastic"}}
MUON_LR, ADAMW_LR = 0.02, 1e-2
STEPS = 6
#: mlp()'s three weights take Muon (2-D, no embedding/head name), its biases the AdamW part
ROUTING = {"0.weight": "muon", "2.weight": "muon", "4.weight": "muon",
           "0.bias": "adamw", "2.bias": "adamw", "4.bias": "adamw"}


def _muon(named_params, release=False, qconfig=QCONFIG):
    return Muon(named_params, lr=MUON_LR, adamw={"lr": ADAMW_LR}, qconfig=qconfig, seed=5, gradient_release=release)


def _record_released(opt):
    """A list that gets, after every ``opt.step()``, whether every gradient was already released
    (stepped in backward by gradient release) -- True on every step of a release run only."""
    released = []
    opt.register_step_post_hook(lambda o, args, kwargs: released.append(
        all(isinstance(p.grad, ReleasedGrad) for g in o.param_groups for p in g["params"])))
    return released


def _full_loss(net, dtype=torch.float32):
    x, y = regression_data(STEPS)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(net(x.to(dtype)).float(), y).item()


# ---------------------------------------------------------------------------------------------
# HF Trainer

class _Regression(torch.nn.Module):
    """A bf16 MLP under HF Trainer's calling convention; records the batches it trains on."""

    def __init__(self):
        super().__init__()
        self.net = mlp(0, dtype=torch.bfloat16)
        self.seen = []

    def forward(self, x, y):
        if self.training:
            self.seen.append((x.clone(), y.clone()))
        return {"loss": torch.nn.functional.mse_loss(self.net(x.bfloat16()).float(), y)}


def _hf_run(tmp_path, release):
    """STEPS steps under HF Trainer with ``optimizers=(Muon, None)``: the Trainer's own linear
    schedule (no warmup). Returns (net, opt, batches seen, the lrs of both groups at each step,
    whether each step's gradients were released)."""
    import transformers

    model = _Regression()
    opt = _muon(model.net.named_parameters(), release)
    if release:
        prepare_gradient_release(model, opt, grad_norms=True)  # HF Trainer takes the global norm on every step
    released = _record_released(opt)
    lrs = []

    class RecordLR(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            lrs.append([g["lr"] for g in opt.param_groups])

    trainer = hf_trainer_run(model, opt, None, tmp_path / f"hf{int(release)}", STEPS, callbacks=[RecordLR()])
    assert isinstance(trainer.lr_scheduler, torch.optim.lr_scheduler.LambdaLR)  # the Trainer's own (linear)
    return model.net, opt, model.seen, lrs, released


def _hand_loop(batches, dtype, make_sched):
    """The same training as a plain loop: a fresh mlp and Muon, the given batches in order."""
    net = mlp(0, dtype=dtype)
    opt = _muon(net.named_parameters(), qconfig=QCONFIG if dtype == torch.bfloat16 else QCONFIG | {"weights": {}})
    sched = make_sched(opt)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x.to(dtype)).float(), y).backward()
        opt.step()
        sched.step()
    return net, opt


def test_hf_trainer_runs_muon_with_its_scheduler_and_equals_a_plain_loop(tmp_path):
    before = _full_loss(mlp(0, dtype=torch.bfloat16), torch.bfloat16)
    normal, release = _hf_run(tmp_path, False), _hf_run(tmp_path, True)
    net, opt, seen, lrs, _ = normal
    assert normal[4] == [False] * STEPS and release[4] == [True] * STEPS  # Newton–Schulz ran in the hooks
    assert opt.routing() == ROUTING and [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert len(seen) == STEPS and all(x.shape == (8, 64) for x, _ in seen)
    assert int(opt.state[net[0].weight]["step"]) == int(opt.state[net[0].bias]["step"]) == STEPS
    # HF's linear schedule scaled both groups, each from its own initial lr
    expected = [[MUON_LR * (STEPS - s) / STEPS, ADAMW_LR * (STEPS - s) / STEPS] for s in range(STEPS)]
    assert lrs == [pytest.approx(e, rel=1e-12) for e in expected]
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    assert [g["initial_lr"] for g in opt.param_groups] == [MUON_LR, ADAMW_LR]
    assert _full_loss(net, torch.bfloat16) < 0.9 * before
    # the Trainer's run is the plain loop's, bit for bit; gradient release changes nothing
    hand = _hand_loop(seen, torch.bfloat16, lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: max(0.0, (STEPS - s) / STEPS)))
    assert_same_run(normal[:2], hand)
    assert len(release[2]) == STEPS and all(torch.equal(a, c) and torch.equal(b, d)
                                            for (a, b), (c, d) in zip(release[2], seen))
    assert release[3] == lrs
    assert_same_run(normal[:2], release[:2])
    # what the Trainer's optimizer saves loads with weights_only=True and resumes into a fresh Muon
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    other = _muon(mlp(1, dtype=torch.bfloat16).named_parameters())
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert_same_state(flat_state(other), flat_state(opt))


# ---------------------------------------------------------------------------------------------
# Lightning

def _lightning_run(release):
    def configure_optimizers(module):
        module.opt = _muon(module.net.named_parameters(), release, QCONFIG | {"weights": {}})
        if release:
            prepare_gradient_release(module, module.opt)
        module.released = _record_released(module.opt)
        sched = torch.optim.lr_scheduler.StepLR(module.opt, step_size=2, gamma=0.5)
        return {"optimizer": module.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = lightning_fit(mlp(0), configure_optimizers, STEPS)
    return module.net, module.opt, module.released


def test_lightning_runs_muon_and_equals_a_plain_loop():
    before = _full_loss(mlp(0))
    normal, release = _lightning_run(False), _lightning_run(True)
    net, opt, _ = normal
    assert normal[2] == [False] * STEPS and release[2] == [True] * STEPS  # Newton–Schulz ran in the hooks
    assert opt.routing() == ROUTING
    assert int(opt.state[net[2].weight]["step"]) == int(opt.state[net[2].bias]["step"]) == STEPS
    # the per-step StepLR halved both groups' lr every 2 steps
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([MUON_LR / 8, ADAMW_LR / 8], rel=1e-12)
    assert _full_loss(net) < 0.9 * before
    hand = _hand_loop(list(regression_loader(STEPS)), torch.float32,
                      lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))
    assert_same_run(normal[:2], hand)
    assert_same_run(normal[:2], release[:2])
    assert int(release[1].state[release[0][0].weight]["step"]) == STEPS
