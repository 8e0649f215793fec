"""Gradient release inside the training frameworks users run us in, unchanged: HF Trainer (its
optimizer.step() and model.zero_grad() around our hooks, a scheduler) and Lightning (automatic
optimization: step(closure) on every batch, a per-step scheduler). Each run equals the same run
without gradient release bit for bit; the framework features that cannot work are refused."""
from __future__ import annotations

import warnings

import pytest
import torch

from qconf.optim import AdamW, prepare_gradient_release

from helpers import CONFIGS, assert_same_state, flat_state, mlp, regression_batches

QCONFIG = {"base": str(CONFIGS / "default.yml"), "min_numel": 0, "weights": {"rounding": "stochastic"}}


def _data(n_batches=6, batch=8):
    xs, ys = zip(*regression_batches(n_batches, seed=11, batch=batch))
    return torch.cat(xs), torch.cat(ys)


def _assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
    assert_same_state(flat_state(oa), flat_state(ob))


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
    import transformers
    x, y = _data()
    dataset = [{"x": a, "y": b} for a, b in zip(x, y)]
    model = _Regression()
    opt = AdamW(model.named_parameters(), lr=1e-2, qconfig=QCONFIG, seed=5, gradient_release=release)
    if release:
        prepare_gradient_release(model, opt, grad_norms=grad_norms)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"hf{int(release)}"), max_steps=6, per_device_train_batch_size=8,
        report_to="none", use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, data_seed=0, **{"max_grad_norm": 0.0, **args})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=targs, train_dataset=dataset, optimizers=(opt, sched)).train()
    return model, opt


def test_hf_trainer_runs_unchanged_and_equals_the_normal_step(tmp_path):
    normal, release = _hf_run(tmp_path, False), _hf_run(tmp_path, True)
    _assert_same(normal, release)
    assert int(release[1].state[release[0].net[0].weight]["step"]) == 6
    assert release[1].param_groups[0]["lr"] == normal[1].param_groups[0]["lr"] == pytest.approx(1e-2 / 7)


def test_hf_trainer_clipping_and_accumulation_are_refused(tmp_path):
    # with grad_norms=True a clip that clips nothing changes nothing (the gradients' norm here is ~0.4);
    # one that would scale the gradients is refused at that step
    _assert_same(_hf_run(tmp_path, False, max_grad_norm=10.0), _hf_run(tmp_path, True, max_grad_norm=10.0))
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
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp(0)
            self.opt = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            self.opt = AdamW(self.net.named_parameters(), lr=1e-2, qconfig=QCONFIG | {"weights": {}}, seed=5,
                             gradient_release=release)
            if release:
                prepare_gradient_release(self, self.opt)
            sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
            return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    module = Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(module, loader)
    return module.net, module.opt


def test_lightning_runs_unchanged_and_equals_the_normal_step():
    normal, release = _lightning_run(False), _lightning_run(True)
    _assert_same(normal, release)
    assert int(release[1].state[release[0][0].weight]["step"]) == 6
