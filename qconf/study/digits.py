"""Built-in task: handwritten digit classification on scikit-learn's bundled digits data.

1797 8x8 images (UCI optical digits, shipped inside scikit-learn, no download), split once
80/20 with a fixed permutation; pixels scaled to [0, 1]. Model: MLP 64-256-256-10 (GELU), whose two
hidden weight matrices (16384 and 65536 elements) are above lpmm's 4096 threshold and get quantized
states, while the head and biases stay full precision -- as in a real network.
"""
from __future__ import annotations

import functools
import math
from typing import Iterator

import torch

from .task import Task

_SPLIT_SEED = 20231  # fixed: the split never depends on the run's seed


@functools.lru_cache(maxsize=1)
def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - sklearn is in the [study] and [test] extras
        raise ImportError("the 'digits' task needs scikit-learn (pip install 'qconf[study]')") from e
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    n_train = int(0.8 * len(y))
    tr, te = perm[:n_train], perm[n_train:]
    return x[tr], y[tr], x[te], y[te]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 10))


def _batches(seed: int, batch_size: int = 64) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    x, y, _, _ = _data()
    g = torch.Generator().manual_seed(seed)
    while True:  # epochs of a seeded shuffle
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y) - batch_size + 1, batch_size):
            idx = perm[i:i + batch_size]
            yield x[idx], y[idx]


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _evaluate(model: torch.nn.Module) -> dict[str, float]:
    _, _, x, y = _data()
    logits = model(x)
    return {"loss": torch.nn.functional.cross_entropy(logits, y).item(),
            "accuracy": (logits.argmax(-1) == y).float().mean().item()}


def digits_task() -> Task:
    """The digits classification task (see module docstring)."""
    return Task("digits", _model, _batches, _loss, _evaluate, default_steps=300, default_lr=1e-3,
                description="sklearn digits (1797 8x8 images, 360 held out), MLP 64-256-256-10, batch 64; "
                            "eval: cross-entropy and accuracy on the held-out images",
                baselines={"uniform": math.log(10)}, info={"train": 1437, "eval": 360, "batch_size": 64})
