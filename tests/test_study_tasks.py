"""Tiny study tasks for tests/test_study.py (importable as ``test_study_tasks:<function>``, the way a
user's ``--task mymod:make_task`` is). No tests here."""
from __future__ import annotations

import itertools

import torch

from qconf.study.digits import _data
from qconf.study.task import Task


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # 64x80 = 5120 > 4096: the hidden weight's states are quantized
    return torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 10))


def _batches(seed: int, batch_size: int = 32):
    x, y, _, _ = _data()
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, len(y), (batch_size,), generator=g)
        yield x[idx], y[idx]


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _evaluate(model):
    _, _, x, y = _data()
    logits = model(x[:120])
    return {"loss": torch.nn.functional.cross_entropy(logits, y[:120]).item(),
            "accuracy": (logits.argmax(-1) == y[:120]).float().mean().item()}


def tiny_task() -> Task:
    """Digits, a 64-80-10 MLP, 24 steps."""
    return Task("tiny", _model, _batches, _loss, _evaluate, default_steps=24, default_lr=3e-3,
                description="tiny digits MLP (tests)", baselines={"uniform": 2.302585})


def poisoned_task() -> Task:
    """Like tiny_task, but seed 1's data turns to NaN after 5 batches: that seed must diverge."""
    def batches(seed: int):
        for i, (x, y) in enumerate(_batches(seed)):
            yield (x * float("nan"), y) if seed == 1 and i >= 5 else (x, y)
    return Task("poisoned", _model, batches, _loss, _evaluate, default_steps=24, default_lr=3e-3)


def interrupted_task() -> Task:
    """Like tiny_task, but the batch stream of seed 1 raises KeyboardInterrupt (Ctrl-C) at its 4th batch."""
    def batches(seed: int):
        for i, b in enumerate(_batches(seed)):
            if seed == 1 and i == 3:
                raise KeyboardInterrupt
            yield b
    return Task("interrupted", _model, batches, _loss, _evaluate, default_steps=24, default_lr=3e-3)


def not_a_task():
    return 42


def broken_task():
    raise RuntimeError("dataset missing")


def first(n, it):  # helper used by the determinism test
    return list(itertools.islice(it, n))
