"""Adam and AdamW with quantized states (lpmm's "4-bit AdamW"), and the factored second moment
(lpmm's "4-bit Factor").

Update of one element at step t. Every operation is one correctly rounded fp32 operation, in this
order, and the scalars are fp32 values computed once on the host in double precision -- the native
kernels perform exactly the same sequence, so fused and reference results agree bit for bit::

    g = -g                                  if maximize
    p = p * (1 - lr*wd)                     AdamW (decoupled decay, before the update)
    g = g + p * wd                          Adam (coupled L2 decay)
    m = m * b1 + g * (1 - b1)
    v = v * b2 + (g * g) * (1 - b2)         (factored: see below)
    d = sqrt(v) * (1 / sqrt(1 - b2**t)) + eps
    p = p - (m / d) * (lr / (1 - b1**t))

With quantization off this is torch.optim.Adam/AdamW's update up to rounding (torch uses lerp and
addcdiv); parity is tested to 1e-6 relative over 100 steps.

Factored second moment (Adafactor form as in lpmm, no eps1/clipping): row statistics
``r = r * b2 + mean_{-1}(g*g) * (1 - b2)`` (shape ``p.shape[:-1]``), column statistics
``c = c * b2 + mean_{-2}(g*g) * (1 - b2)`` (shape ``p.shape[:-2] + p.shape[-1:]``), and
``v = (r / mean_{-1}(r))[..., None] * c[..., None, :]``; an all-zero row block gives v = 0 rather
than lpmm's 0/0 = NaN. 1-D parameters keep a (quantized) dense ``exp_avg_sq``. A ``g*g`` that is
not finite (a NaN/Inf gradient, or |g| above ~1.8e19, whose square overflows) adds 0 to the
statistics: they are shared by a whole row and column, and one Inf would make every ``v`` of the
tensor 0 or NaN (Inf / mean = 0). The element's own ``m`` and parameter still see its gradient.

Non-finite values (docs/optimizers.md): an element with a NaN/Inf gradient, or whose ``g*g``
overflows (|g| > ~1.8e19; torch's addcmul overflows only above ~5.8e20), is updated in fp32 as with
unquantized states (a NaN parameter, or an update of 0 where ``v`` is Inf); when the states are
quantized, that element is encoded at the map's end (Inf) or as 0 (NaN) and the scales ignore it
(:mod:`qconf.codec.scales`), so every other element of its block is unaffected.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ._validate import adam_group, ieee_sqrt, scalar
from .base import QOptimizer
from .spec import Hyper, Slot, StateSpec
from .states import factored_dense

_TORCH_ADAM_KEYS = {"amsgrad": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None}


class _AdamBase(QOptimizer):
    decoupled_weight_decay: bool = True
    elementwise_rule = True  # (a factored second moment steps whole: see qconf.optim.reference)
    qconf_only_group_keys = ("factor_second_moment",)
    layout_variants = ({"factor_second_moment": False}, {"factor_second_moment": True})

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 factor_second_moment: bool = False, maximize: bool = False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False, qconfig: Any = None,
                 fused: bool | None = None, seed: int | None = None, bf16_stochastic_round: bool = False,
                 compensation: str | None = None, gradient_release: bool = False) -> None:
        del foreach  # accepted for signature compatibility; qconf picks fused or reference itself
        defaults = self.validate_group({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                        "maximize": maximize, "factor_second_moment": factor_second_moment,
                                        "amsgrad": amsgrad, "capturable": capturable,
                                        "differentiable": differentiable})
        super().__init__(params, defaults, qconfig=qconfig, fused=fused, seed=seed,
                         bf16_stochastic_round=bf16_stochastic_round, compensation=compensation,
                         gradient_release=gradient_release)

    @classmethod
    def validate_group(cls, group: Mapping[str, Any]) -> dict[str, Any]:
        return adam_group(group, cls.__name__, cls.decoupled_weight_decay)

    def _state_specs(self, group: dict[str, Any], p: torch.Tensor) -> list[StateSpec]:
        shape = tuple(p.shape)
        specs = [StateSpec("exp_avg", "exp_avg", shape, Slot.FIRST)]
        if group["factor_second_moment"] and p.dim() >= 2:
            specs.append(StateSpec("exp_avg_sq_row", None, shape[:-1], Slot.ROW))
            specs.append(StateSpec("exp_avg_sq_col", None, shape[:-2] + shape[-1:], Slot.COL))
        else:
            specs.append(StateSpec("exp_avg_sq", "exp_avg_sq", shape, Slot.SECOND))
        return specs

    def _spec_signature(self, group: dict[str, Any]) -> tuple:
        return (bool(group["factor_second_moment"]),)

    def _hyper(self, group: dict[str, Any]) -> Hyper:
        beta1, beta2 = group["betas"]
        return Hyper(lr=scalar(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], maximize=group["maximize"],
                     decoupled=self.decoupled_weight_decay)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], step: int,
                group: dict[str, Any], new: frozenset[str]) -> None:
        lr = scalar(group["lr"])
        beta1, beta2 = group["betas"]
        wd = group["weight_decay"]
        if group["maximize"]:
            grad = -grad
        if wd != 0:
            if self.decoupled_weight_decay:
                p.mul_(1 - lr * wd)
            else:
                grad = grad + p * wd
        exp_avg = states["exp_avg"]
        exp_avg.mul_(beta1).add_(grad * (1 - beta1))
        g2 = grad * grad
        if "exp_avg_sq" in states:
            exp_avg_sq = states["exp_avg_sq"]
            exp_avg_sq.mul_(beta2).add_(g2 * (1 - beta2))
        else:
            row, col = states["exp_avg_sq_row"], states["exp_avg_sq_col"]
            g2 = torch.where(torch.isfinite(g2), g2, torch.zeros_like(g2))  # see the module docstring
            row.mul_(beta2).add_(g2.mean(dim=-1) * (1 - beta2))
            col.mul_(beta2).add_(g2.mean(dim=-2) * (1 - beta2))
            exp_avg_sq = factored_dense(row, col)
        t = float(step)
        inv_bias_correction2_sqrt = 1 / (1 - beta2**t) ** 0.5  # a multiply, not a divide, per element
        step_size = lr / (1 - beta1**t)
        denom = ieee_sqrt(exp_avg_sq).mul_(inv_bias_correction2_sqrt).add_(group["eps"])
        p.sub_(exp_avg.div(denom).mul_(step_size))


class AdamW(_AdamBase):
    """AdamW (decoupled weight decay) with quantized states; torch.optim.AdamW's arguments plus
    ``factor_second_moment``, ``qconfig``, ``fused`` and ``seed`` (see :class:`QOptimizer`)."""

    kernel_rule = "adam"
    decoupled_weight_decay = True
    torch_group_defaults = {**_TORCH_ADAM_KEYS, "decoupled_weight_decay": True}


class Adam(_AdamBase):
    """Adam (coupled L2 weight decay, like torch.optim.Adam) with quantized states."""

    kernel_rule = "adam"
    decoupled_weight_decay = False
    torch_group_defaults = {**_TORCH_ADAM_KEYS, "decoupled_weight_decay": False}

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, **kwargs: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
