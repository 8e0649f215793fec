"""Training runs inside the frameworks users run our optimizers in (HF Trainer, Lightning), set up
the one way every client test needs: CPU, no logging, saving or progress bars, their warnings
silenced, 8 examples a step."""
from __future__ import annotations

import warnings

import torch

from helpers import regression_batches

BATCH = 8


def regression_data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` batches of :data:`BATCH` examples of helpers' regression task, concatenated:
    x (steps*8, 64) and y (steps*8, 10), float32."""
    xs, ys = zip(*regression_batches(steps, seed=11, batch=BATCH))
    return torch.cat(xs), torch.cat(ys)


def hf_trainer_run(model, opt, sched, output_dir, steps: int, callbacks=(), **args):
    """Train ``model`` (``forward(x, y)`` returning ``{"loss": ...}``) for ``steps`` steps on
    :func:`regression_data` under HF Trainer with ``optimizers=(opt, sched)``; ``args`` override
    TrainingArguments (``max_grad_norm`` is 0.0 unless given). Returns the Trainer."""
    import transformers

    x, y = regression_data(steps)
    dataset = [{"x": a, "y": b} for a, b in zip(x, y)]
    targs = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=BATCH, report_to="none",
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        seed=0, data_seed=0, **{"max_grad_norm": 0.0, **args})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset, optimizers=(opt, sched),
                                       callbacks=list(callbacks))
        trainer.train()
    return trainer


def regression_loader(steps: int) -> torch.utils.data.DataLoader:
    """:func:`regression_data` in batches of :data:`BATCH`, in order."""
    x, y = regression_data(steps)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def lightning_fit(net: torch.nn.Module, configure_optimizers, steps: int):
    """Fit ``net`` to :func:`regression_loader` (MSE) for ``steps`` steps under Lightning's
    automatic optimization; ``configure_optimizers(module)`` is the LightningModule's (it may
    prepare gradient release on the module). Returns the module (``module.net`` is ``net``)."""
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return configure_optimizers(self)

    module = Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(module, regression_loader(steps))
    return module
