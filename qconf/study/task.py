"""The task protocol used by ``qconf compare`` and the learning tests.

A task is a small object with a model factory, a batch stream, a loss and an evaluation. Write
one for your own model and pass ``--task mypkg.mymod:make_task`` (a function returning a Task).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping

import torch


@dataclasses.dataclass(frozen=True)
class Task:
    """A training task.

    Attributes:
        name: short identifier.
        make_model: ``seed -> nn.Module``; the same seed must give the same initial weights.
        batches: ``seed -> iterator of batches`` (any object ``loss`` accepts); the same seed must
            give the same order. It may be infinite; the runner takes as many as it needs.
        loss: ``(model, batch) -> scalar tensor`` (training loss, differentiable).
        evaluate: ``model -> {"loss": float, ...}`` on held-out data (e.g. ``"accuracy"`` too),
            called under ``torch.no_grad()`` with the model in eval mode.
        default_steps, default_lr: used when the caller gives none.
        description: one line for reports.
        info: free-form facts about the task recorded in results.json (data files, sizes, ...).
        baselines: named reference eval losses drawn in the plots and listed in the report
            (e.g. ``{"unigram": 3.2}``: the loss a model ignoring its input reaches).
        lr_schedule: ``(step, total_steps) -> multiplier`` of the learning rate at 0-based
            ``step`` (e.g. warm-up + cosine); None keeps the learning rate constant.
    """

    name: str
    make_model: Callable[[int], torch.nn.Module]
    batches: Callable[[int], Iterator[Any]]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], dict[str, float]]
    default_steps: int = 300
    default_lr: float = 1e-3
    description: str = ""
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    baselines: Mapping[str, float] = dataclasses.field(default_factory=dict)
    lr_schedule: Callable[[int, int], float] | None = None


class StudyError(ValueError):
    """A study cannot run as asked (bad task, argument or config); the message is one line."""
