"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with a quantized
momentum (qconfig section ``exp_avg``).

Update of one element, each operation one correctly rounded fp32 operation (the native kernels
do the same sequence)::

    g = -g                                 if maximize
    p = p * (1 - lr*wd)                    (decoupled decay)
    p = p - sign(m * b1 + g * (1 - b1)) * lr
    m = m * b2 + g * (1 - b2)
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ._validate import lion_group, scalar
from .base import QOptimizer
from .spec import Hyper, Slot, StateSpec


class Lion(QOptimizer):
    """Lion with a quantized momentum. Defaults follow the paper: lr=1e-4, betas=(0.9, 0.99)."""

    kernel_rule = "lion"
    elementwise_rule = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, qconfig: Any = None,
                 fused: bool | None = None, seed: int | None = None, bf16_stochastic_round: bool = False,
                 compensation: str | None = None, gradient_release: bool = False) -> None:
        defaults = self.validate_group({"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize})
        super().__init__(params, defaults, qconfig=qconfig, fused=fused, seed=seed,
                         bf16_stochastic_round=bf16_stochastic_round, compensation=compensation,
                         gradient_release=gradient_release)

    @classmethod
    def validate_group(cls, group: Mapping[str, Any]) -> dict[str, Any]:
        return lion_group(group)

    def _state_specs(self, group: dict[str, Any], p: torch.Tensor) -> list[StateSpec]:
        return [StateSpec("exp_avg", "exp_avg", tuple(p.shape), Slot.FIRST)]

    def _hyper(self, group: dict[str, Any]) -> Hyper:
        beta1, beta2 = group["betas"]
        return Hyper(lr=scalar(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                     maximize=group["maximize"], decoupled=True)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], step: int,
                group: dict[str, Any], new: frozenset[str]) -> None:
        lr = scalar(group["lr"])
        beta1, beta2 = group["betas"]
        if group["maximize"]:
            grad = -grad
        if group["weight_decay"] != 0:
            p.mul_(1 - lr * group["weight_decay"])
        exp_avg = states["exp_avg"]
        update = exp_avg.mul(beta1).add_(grad * (1 - beta1)).sign_()
        p.sub_(update.mul_(lr))
        exp_avg.mul_(beta2).add_(grad * (1 - beta2))
