"""Built-in task: a character-level transformer language model on Python's own standard library.

Data (offline, no download): the source files of a fixed list of well-known pure-Python stdlib
modules (:data:`MODULES`, sorted), read as bytes from ``sysconfig.get_paths()["stdlib"]``. A module
``a.b`` is looked up as ``a/b.py`` and then ``a/b/__init__.py`` (``re`` and ``pathlib`` became
packages in 3.11/3.13); a module found in neither place is skipped, so the corpus is a
deterministic function of the Python installation (the file list and a SHA-256 of the corpus are
recorded in :attr:`Task.info`, hence in every results.json). The vocabulary is the 256 byte values.

Split: the last 10% of every file is held out (cut at a byte offset, so every module contributes
to both sides); train and eval texts are the concatenations of the 90% and 10% parts.

Model: a small GPT (pre-LayerNorm, learned positions, causal self-attention, GELU MLP, untied
head). Defaults: 2 layers, d_model 128, 4 heads, context 64: every weight matrix (token embedding
256x128, attention in/out 128x384 and 128x128, MLP 128x512 and 512x128, head 128x256) has more
than 4096 elements, so its optimizer states are quantized; LayerNorm weights, biases and the
position embedding (64x128 = 8192 elements: quantized too) follow the config's min_numel.

Training batches: ``batch_size`` windows of ``context + 1`` bytes at uniformly random offsets of
the train text, drawn from a generator seeded with the run's seed. Evaluation: mean next-byte
cross-entropy (nats per character) over ``eval_windows`` fixed windows spread evenly over the
held-out text (the same windows for every run), plus the top-1 next-byte accuracy.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig
from typing import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from ..nn.transformer import PreLNBlock
from .task import Task

#: The corpus: module names of pure-Python standard-library modules present in every CPython >= 3.10
#: (a module missing from an installation is skipped; see the module docstring).
MODULES: tuple[str, ...] = tuple(sorted((
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "difflib", "enum", "fnmatch", "fractions", "functools",
    "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "inspect", "ipaddress", "json.decoder",
    "json.encoder", "keyword", "locale", "logging", "numbers", "operator", "optparse", "os", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "sched", "shlex", "shutil", "socket", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback",
    "types", "typing", "uuid", "warnings", "weakref", "zipfile",
)))

EVAL_FRACTION = 0.1  # the last 10% of every file is held out
VOCAB = 256          # bytes


@functools.lru_cache(maxsize=4)
def _corpus(stdlib: str | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...], str]:
    """``(train bytes, eval bytes, files used, sha256 of the concatenated files)``; uint8 tensors."""
    root = stdlib or sysconfig.get_paths()["stdlib"]
    train, held, used = [], [], []
    digest = hashlib.sha256()
    for module in MODULES:
        rel = module.replace(".", "/")
        for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
            path = os.path.join(root, candidate)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    data = f.read()
                cut = len(data) - int(EVAL_FRACTION * len(data))
                train.append(data[:cut])
                held.append(data[cut:])
                used.append(candidate)
                digest.update(data)
                break
    if not used:
        raise FileNotFoundError(f"the 'charlm' task found none of its {len(MODULES)} source files under {root!r}")

    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).clone()

    return as_tensor(train), as_tensor(held), tuple(used), digest.hexdigest()


def unigram_loss(stdlib: str | None = None) -> float:
    """Cross-entropy (nats/char) of the held-out text under the train text's byte frequencies
    (add-one smoothed): the loss of the best model that ignores context."""
    train, held, _, _ = _corpus(stdlib)
    counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1.0
    logp = (counts / counts.sum()).log()
    return -logp[held.long()].mean().item()


class TinyGPT(nn.Module):
    """A GPT-2-style byte-level language model (logits over 256 bytes for every position)."""

    def __init__(self, n_layers: int = 2, d_model: int = 128, n_heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(VOCAB, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(PreLNBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers), zero biases
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("attn_out.weight", "mlp_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def charlm_task(*, n_layers: int = 2, d_model: int = 128, n_heads: int = 4, context: int = 64,
                batch_size: int = 16, eval_windows: int = 128, steps: int = 400, lr: float = 1.5e-3,
                stdlib: str | None = None) -> Task:
    """The stdlib character-level LM task (see the module docstring); every size is a keyword."""
    train, held, files, sha = _corpus(stdlib)
    if len(train) <= context + 1 or len(held) <= context + 1:
        raise ValueError(f"the charlm corpus is too small for context {context}")
    # fixed eval windows, evenly spaced over the held-out text (independent of the run's seed)
    starts = torch.linspace(0, len(held) - context - 1, eval_windows).long()
    eval_x = torch.stack([held[s:s + context + 1] for s in starts.tolist()]).long()

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return TinyGPT(n_layers, d_model, n_heads, context)

    def batches(seed: int) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        offsets = torch.arange(context + 1)
        while True:
            starts = torch.randint(0, len(train) - context - 1, (batch_size,), generator=g)
            yield train[starts[:, None] + offsets].long()

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def evaluate(model: nn.Module) -> dict[str, float]:
        total, correct, n = 0.0, 0, 0
        for chunk in eval_x.split(64):
            logits = model(chunk[:, :-1]).reshape(-1, VOCAB)
            target = chunk[:, 1:].reshape(-1)
            total += F.cross_entropy(logits, target, reduction="sum").item()
            correct += (logits.argmax(-1) == target).sum().item()
            n += target.numel()
        return {"loss": total / n, "accuracy": correct / n}

    info = {"files": list(files), "corpus_sha256": sha, "train_chars": len(train), "eval_chars": len(held),
            "eval_windows": eval_windows, "context": context, "batch_size": batch_size, "n_layers": n_layers,
            "d_model": d_model, "n_heads": n_heads, "stdlib": stdlib or sysconfig.get_paths()["stdlib"]}
    description = (f"byte-level GPT ({n_layers} layers, d_model {d_model}, {n_heads} heads, context {context}) "
                   f"on {len(files)} CPython stdlib modules ({len(train) / 1e6:.2f} M train / "
                   f"{len(held) / 1e3:.0f} k held-out chars), batch {batch_size}; eval: nats/char on "
                   f"{eval_windows} held-out windows")
    return Task("charlm", make_model, batches, loss, evaluate, default_steps=steps, default_lr=lr,
                description=description, info=info, baselines={"unigram": unigram_loss(stdlib)},
                lr_schedule=warmup_cosine)


def warmup_cosine(step: int, total: int) -> float:
    """LR multiplier: linear warm-up over the first 5% of the steps, then cosine decay to 10%."""
    warm = max(1, round(0.05 * total))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
