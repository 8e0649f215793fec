"""Tiny study tasks for tests/test_study.py (importable as ``test_study_tasks:<function>``, the way a
user's ``--task mymod:make_task`` is). No tests here."""
from __future__ import annotations

import itertools
import os
import time

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


def crashing_task() -> Task:
    """Like tiny_task, but seed 1's loss raises at its 3rd step (a bug in a user's task)."""
    def make_model(seed):
        model = _model(seed)
        model.qconf_test = {"seed": seed, "calls": 0}
        return model

    def loss(model, batch):
        model.qconf_test["calls"] += 1
        if model.qconf_test["seed"] == 1 and model.qconf_test["calls"] == 3:
            raise RuntimeError("loss exploded in user code")
        return _loss(model, batch)
    return Task("crashing", make_model, _batches, loss, _evaluate, default_steps=8, default_lr=3e-3)


def dying_task() -> Task:
    """Like tiny_task, but seed 1 ends its process at its first step (a crash in native code, the OOM
    killer): only a worker process can survive that."""
    def batches(seed: int):
        for b in _batches(seed):
            if seed == 1:
                os._exit(3)
            yield b
    return Task("dying", _model, batches, _loss, _evaluate, default_steps=8, default_lr=3e-3)


GATE = "QCONF_TEST_GATE"


def gated_task() -> Task:
    """Like tiny_task, but seed 1's first batch waits (up to 120 s) for the file named by $QCONF_TEST_GATE:
    a study killed while it waits has finished exactly the seed-0 runs."""
    def batches(seed: int):
        gate = os.environ.get(GATE)
        deadline = time.monotonic() + 120
        while seed == 1 and gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield from _batches(seed)
    return Task("gated", _model, batches, _loss, _evaluate, default_steps=8, default_lr=3e-3)
