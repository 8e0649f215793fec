"""A pre-LN transformer block, shared by the models qconf trains itself: the study's byte-level
language model (:mod:`qconf.study.charlm`) and the training-memory benchmark's GPT
(:mod:`qconf.bench.model`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class PreLNBlock(nn.Module):
    """GPT-2's block on ``(batch, seq, d_model)`` activations of any float dtype:
    ``x + attn_out(causal_attention(ln_1(x)))``, then ``x + mlp_out(gelu(mlp_in(ln_2(x))))``
    with ``mlp_in: d_model -> 4 d_model``; ``n_heads`` must divide ``d_model``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn_in = nn.Linear(d_model, 3 * d_model)
        self.attn_out = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_in = nn.Linear(d_model, 4 * d_model)
        self.mlp_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn_in(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_2(x))))
