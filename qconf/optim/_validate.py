"""Argument validation and small numeric helpers shared by the optimizers (messages match
torch.optim's)."""
from __future__ import annotations

from typing import Any

import torch


def scalar(x: Any) -> float:
    """A Python float from a float or a one-element tensor (torch allows tensor lr)."""
    return x.item() if isinstance(x, torch.Tensor) else float(x)


def check_lr(lr: Any) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_adam_like(lr: Any, betas: Any, eps: float | None, weight_decay: float) -> tuple[float, float]:
    """torch.optim.Adam's checks; returns betas as floats."""
    check_lr(lr)
    if eps is not None and not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    return scalar(betas[0]), scalar(betas[1])


def refuse_unsupported(name: str, *, amsgrad: bool = False, capturable: bool = False,
                       differentiable: bool = False) -> None:
    """Options of torch.optim that qconf does not implement get a clear error, never a silent no-op."""
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True is not supported (its max_exp_avg_sq state would need a "
                         "codec of its own); use amsgrad=False")
    if capturable:
        raise ValueError(f"{name}: capturable=True (CUDA graph capture) is not supported; use capturable=False")
    if differentiable:
        raise ValueError(f"{name}: differentiable=True is not supported; use differentiable=False")


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (what the native kernels compute).

    torch's float32 ``sqrt`` on CPU is not always correctly rounded; the float64 square root
    rounded to float32 is (double rounding is innocuous for sqrt: 53 >= 2 * 24 + 2 bits). A
    float64 ``x`` (float64 parameters) gets its own correctly rounded float64 square root.
    """
    if x.dtype == torch.float64:
        return x.sqrt()
    return x.double().sqrt_().float()
