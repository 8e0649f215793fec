"""Muon's matrix pieces, as torch.optim.Muon (torch 2.13) computes them: the Newton–Schulz
orthogonalization ("zeroth power") of the update and the shape-adjusted learning rate.

Newton–Schulz, for an update ``G`` of shape (A, B)::

    X = G.bfloat16(); X = X.T if A > B
    X = X / max(||X||_F, eps)
    ns_steps times:  A = X @ X.T;  B = b*A + c*(A @ A);  X = a*X + B @ X
    X = X.T if A > B

in bf16 with the same ``addmm`` calls as torch, so the result is torch's bit for bit.
"""
from __future__ import annotations

import math

import torch

__all__ = ["zeropower", "adjusted_lr", "ADJUST_LR_FNS"]

#: torch.optim.Muon's ``adjust_lr_fn`` values (None means "original")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def zeropower(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """The orthogonalized ``update`` (2-D, any float dtype): a bf16 tensor of its shape (a
    transposed view when rows > cols). A bf16 ``update`` is used as the scratch (divided in place)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...] | torch.Size) -> float:
    """torch.optim.Muon's step size for a matrix of ``shape`` (A, B): ``lr * sqrt(max(1, A/B))``
    ("original", the default), ``lr * 0.2 * sqrt(max(A, B))`` ("match_rms_adamw")."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio
