"""SGD with momentum, dampening, Nesterov, weight decay and maximize; the momentum buffer is
quantized with the qconfig's ``exp_avg`` section.

Update of one element, each operation one correctly rounded fp32 operation (the native kernels
do the same sequence; with quantization off this is torch.optim.SGD up to rounding)::

    g = -g                                   if maximize
    g = g + p * wd                           if wd != 0
    b = g                                    on the buffer's first step
    b = b * momentum + g * (1 - dampening)   afterwards
    d = g + b * momentum if nesterov else b
    p = p - d * lr
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ._validate import scalar, sgd_group
from .base import QOptimizer
from .spec import Hyper, Slot, StateSpec


class SGD(QOptimizer):
    """SGD with a quantized momentum buffer; torch.optim.SGD's arguments plus ``qconfig``,
    ``fused`` and ``seed``."""

    kernel_rule = "sgd"
    requires_step = False
    lazy_states = ("momentum_buffer",)
    elementwise_rule = True
    layout_variants = ({"momentum": 0.0}, {"momentum": 0.9})  # no buffer; a buffer (any momentum != 0)
    torch_group_defaults = {"foreach": None, "differentiable": False, "fused": None}

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, qconfig: Any = None,
                 fused: bool | None = None, seed: int | None = None, bf16_stochastic_round: bool = False,
                 compensation: str | None = None, gradient_release: bool = False) -> None:
        del foreach
        defaults = self.validate_group({"lr": lr, "momentum": momentum, "dampening": dampening,
                                        "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
                                        "differentiable": differentiable})
        super().__init__(params, defaults, qconfig=qconfig, fused=fused, seed=seed,
                         bf16_stochastic_round=bf16_stochastic_round, compensation=compensation,
                         gradient_release=gradient_release)

    @classmethod
    def validate_group(cls, group: Mapping[str, Any]) -> dict[str, Any]:
        return sgd_group(group)

    def _state_specs(self, group: dict[str, Any], p: torch.Tensor) -> list[StateSpec]:
        if group["momentum"] == 0:
            return []
        return [StateSpec("momentum_buffer", "exp_avg", tuple(p.shape), Slot.FIRST)]

    def _spec_signature(self, group: dict[str, Any]) -> tuple:
        return (group["momentum"] != 0,)

    def _hyper(self, group: dict[str, Any]) -> Hyper:
        return Hyper(lr=scalar(group["lr"]), weight_decay=group["weight_decay"], momentum=group["momentum"],
                     dampening=group["dampening"], maximize=group["maximize"], nesterov=group["nesterov"])

    def _update(self, p: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], step: int,
                group: dict[str, Any], new: frozenset[str]) -> None:
        momentum, dampening, wd = group["momentum"], group["dampening"], group["weight_decay"]
        if group["maximize"]:
            grad = -grad
        if wd != 0:
            grad = grad + p * wd
        if momentum != 0:
            buf = states["momentum_buffer"]
            if "momentum_buffer" in new:
                buf.copy_(grad)
            else:
                buf.mul_(momentum).add_(grad * (1 - dampening))
            grad = grad + buf * momentum if group["nesterov"] else buf
        p.sub_(grad * scalar(group["lr"]))
