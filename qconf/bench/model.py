"""The training-memory benchmark's model (``qconf bench --memory``): a GPT-style decoder-only
transformer trained on random tokens.

Token + learned position embeddings, ``layers`` pre-LN blocks (:class:`qconf.nn.transformer.PreLNBlock`:
LayerNorm -> causal self-attention -> residual; LayerNorm -> MLP ``d -> 4d -> d`` with GELU -> residual), a final LayerNorm and an untied LM head without bias.
The ``base`` preset (d_model 768, 13 layers, 12 heads, vocab 8192, context 128) has 104,825,088
parameters; its largest tensors, the embedding and the LM head, are 6.0% of them each (Llama-3-8B's
embedding: 6.5%), which is what bounds the gradient bytes of gradient release. ``base-32k`` is
GPT-2 small's shape with a 32000-token vocabulary (134,306,304 parameters, the embedding 18% of
them: a small model's outsized vocabulary). ``small`` (d_model 128, 4 layers, vocab 512, context 64:
932,608 parameters, the embedding and the LM head 7.0% of them each, as ``base``'s 6.0%) is for the
Muon rows on a CPU (``qconf bench --memory --muon``): torch's Newton–Schulz runs in bf16, which a
CPU without bf16 matrix instructions computes slowly (under a G multiply-add per second on 2 AVX2
cores), so one Muon step of ``base`` (824 G multiply-adds of Newton–Schulz) would take a quarter
of an hour or more there. The ``tiny`` one (about 1M) is for tests.

The model is built on the meta device and materialized directly in its dtype on its device, then
initialized per tensor from a seeded generator in fp32 chunks (weights N(0, 0.02^2), biases 0,
LayerNorm weights 1): no full-size fp32 copy of a bf16 model ever exists, and the fp32 and bf16
models start from the same values (rounded to bf16). The data are uniformly random tokens from a
seeded generator: nothing is downloaded.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.transformer import PreLNBlock

#: the initialization's standard deviation of every weight matrix and embedding (GPT-2's)
INIT_STD = 0.02
#: elements per fp32 chunk of the initialization (4 MiB)
_INIT_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model and of one training batch (``batch`` sequences of ``seq`` tokens)."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    batch: int

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of heads {self.heads}")

    @property
    def numel(self) -> int:
        """Parameters of :class:`GPT` with this config (without building it)."""
        d = self.d_model
        block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return self.vocab * d + self.seq * d + self.layers * block + 2 * d + self.vocab * d

    def describe(self) -> str:
        """One line: the shape, e.g. ``d_model 768, 12 layers, 12 heads, vocab 32000, batch 2 x 128 tokens``."""
        return (f"d_model {self.d_model}, {self.layers} layers, {self.heads} heads, vocab {self.vocab}, "
                f"batch {self.batch} x {self.seq} tokens")


#: the ``--memory-model`` presets; ``tiny`` (about 1M params) is for tests and not advertised
MODEL_PRESETS: dict[str, GPTConfig] = {
    "base": GPTConfig(vocab=8192, d_model=768, layers=13, heads=12, seq=128, batch=2),
    "base-32k": GPTConfig(vocab=32000, d_model=768, layers=12, heads=12, seq=128, batch=2),
    "small": GPTConfig(vocab=512, d_model=128, layers=4, heads=4, seq=64, batch=2),
    "tiny": GPTConfig(vocab=2560, d_model=128, layers=2, heads=4, seq=32, batch=2),
}


class GPT(nn.Module):
    """Decoder-only transformer: token ids ``(B, T)`` int64 -> logits ``(B, T, vocab)`` in the
    parameters' dtype."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(PreLNBlock(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32 scalar) of ``idx`` ``(B, T)`` against ``targets`` ``(B, T)``."""
        logits = self(idx)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def _fill_normal(p: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """``p`` (any float dtype, any device) <- N(0, std^2) drawn in fp32 on the CPU, chunk by chunk."""
    flat = p.view(-1)
    for start in range(0, flat.numel(), _INIT_CHUNK):
        chunk = flat[start:start + _INIT_CHUNK]
        chunk.copy_(torch.empty(chunk.numel()).normal_(0.0, std, generator=gen))


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Initialize every parameter in place, in ``named_parameters`` order, from ``seed``:
    LayerNorm weights 1, biases 0, every other tensor N(0, :data:`INIT_STD`^2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
        elif p.dim() == 1:  # LayerNorm weight
            p.fill_(1.0)
        else:
            _fill_normal(p, INIT_STD, gen)


def build_model(cfg: GPTConfig, dtype: torch.dtype, device: torch.device | str, seed: int) -> GPT:
    """:class:`GPT` with parameters in ``dtype`` on ``device``, initialized by :func:`init_weights`."""
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    model.to_empty(device=device)
    init_weights(model, seed)
    assert sum(p.numel() for p in model.parameters()) == cfg.numel, "GPTConfig.numel disagrees with the model"
    return model


def random_batches(cfg: GPTConfig, count: int, seed: int, device: torch.device | str = "cpu"
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches ``(idx, targets)``, both ``(batch, seq)`` int64 on ``device``: uniformly
    random token ids from ``seed``; ``targets`` is ``idx`` shifted by one token."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


def uniform_loss(cfg: GPTConfig) -> float:
    """Cross-entropy of a uniform prediction, ``ln(vocab)``: where random tokens keep the loss."""
    return math.log(cfg.vocab)
