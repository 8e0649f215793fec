"""The benchmark's roster: every contender (:class:`Contender`, :func:`contenders`), the qconf configs
they load and the selection of rows by ``--contenders``.

A contender is one table row: how to build its optimizer on a list of parameters, the parameter
dtype, and which optional package it needs. The baseline every ratio is taken against is
:data:`BASELINE`, torch's fused AdamW on fp32 parameters.

``contenders(muon=True)`` (``qconf bench --muon``) is the Muon roster instead: torch.optim.Muon
(fp32 momentum, the baseline :data:`MUON_BASELINE`) and :class:`qconf.optim.Muon` with the
configs of :data:`MUON_CONFIGS`, on 2-D parameters only (Muon steps matrices).

``contenders(device="cuda")`` is the GPU roster: the same rows without the for-loop and the
reference path (slow and memory-hungry at 537M parameters), every qconf row pinned to the generic
CUDA kernels, plus a ``(specialized)`` twin of every fused row that sets
``QCONF_CUDA_KERNELS=specialized`` around its build and steps (the step reads the variable at
every call, so both kernels run in one process); its bf16 qconf rows also report their cost over
torch fused bf16.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import optim as qoptim
from ..config import load_config
from ..config.builtin import builtin_dir

LR, WEIGHT_DECAY = 1e-3, 1e-2
BASELINE = "torch-fused"
#: the environment variable choosing qconf's CUDA kernels (read by the step at every call)
KERNELS_ENV = "QCONF_CUDA_KERNELS"
#: rows the GPU roster leaves out (slow and memory-hungry at 537M parameters)
CPU_ONLY = ("torch-forloop", "qconf-reference-default-fp32")
#: qconf configs benchmarked, with the short name used in contender keys
CONFIGS = {"default.yml": "default", "2nd_moment_group_128.yml": "group128", "8bit.yml": "8bit"}
#: the Muon roster's baseline: torch.optim.Muon, fp32 parameters and momentum
MUON_BASELINE = "torch-muon"
#: qconf Muon configs benchmarked (their ``exp_avg`` section is the momentum), with the short name
#: used in contender keys: 8-bit linear group-256 momentum, 4-bit nonlinear group-128 momentum
MUON_CONFIGS = {"muon_8bit.yml": "8bit", "default.yml": "default"}
#: what the ratio columns and the table's title call each baseline: (column word, title text)
BASELINE_TEXT = {BASELINE: ("fused", "torch AdamW fused fp32"), MUON_BASELINE: ("Muon", "torch.optim.Muon fp32")}


@dataclasses.dataclass(frozen=True)
class Contender:
    """One row: ``build(params) -> optimizer``; ``requires`` names a module that must be importable."""

    key: str
    label: str
    dtype: torch.dtype
    build: Callable[[list[torch.Tensor]], Any]
    requires: str | None = None
    family: str = "torch"
    #: also report this row's per-round time ratio to the row with this key (its cost over that row)
    relative_to: str | None = None
    #: environment variables set around this row's build and every step (qconf's CUDA kernel choice)
    env: tuple[tuple[str, str], ...] = ()


def _qconfig(path: Path, min_numel: int | None) -> Any:
    """The config to hand qconf: the file itself, or its dict with ``min_numel`` replaced."""
    if min_numel is None:
        return str(path)
    data = load_config(str(path)).to_dict()
    data["min_numel"] = min_numel
    for section in data.get("states", {}).values():
        if isinstance(section, dict) and section.get("min_numel") is not None:
            section["min_numel"] = min_numel
    return data


def contenders(config_dir: str | os.PathLike | None = None, min_numel: int | None = None,
               device: str = "cpu", muon: bool = False) -> list[Contender]:
    """Every contender on ``device`` (``cpu`` or ``cuda``: :func:`cuda_rows`), in table order (the
    baseline, torch fused fp32, is ``BASELINE``); ``muon``: the Muon roster (:func:`_muon_rows`,
    baseline ``MUON_BASELINE``)."""
    rows = _muon_rows(config_dir, min_numel) if muon else _cpu_rows(config_dir, min_numel)
    return cuda_rows(rows) if device == "cuda" else rows


def baseline_key(muon: bool) -> str:
    """The key of the row every ratio of the roster is taken against."""
    return MUON_BASELINE if muon else BASELINE


def cuda_rows(rows: list[Contender]) -> list[Contender]:
    """The GPU roster from the CPU one: :data:`CPU_ONLY` dropped, qconf rows pinned to the generic
    kernels, a ``(specialized)`` twin after each fused qconf row (an SR / Kahan variant's twin
    compared with the plain row's twin), bf16 qconf rows without a ``relative_to`` compared with
    torch fused bf16."""
    out = []
    for c in rows:
        if c.key in CPU_ONLY:
            continue
        if c.family != "qconf":
            out.append(c)
            continue
        rel = c.relative_to or ("torch-fused-bf16" if c.dtype == torch.bfloat16 else None)
        out.append(dataclasses.replace(c, relative_to=rel, env=((KERNELS_ENV, "generic"),)))
        # the twin; an SR / Kahan variant's is compared with the specialized plain row
        twin_rel = f"{c.relative_to}-specialized" if c.relative_to else rel
        out.append(dataclasses.replace(c, key=f"{c.key}-specialized", label=f"{c.label} (specialized)",
                                       relative_to=twin_rel, env=((KERNELS_ENV, "specialized"),)))
    return out


def _cpu_rows(config_dir: str | os.PathLike | None, min_numel: int | None) -> list[Contender]:
    """The CPU roster (every contender), in table order."""
    cdir = Path(config_dir) if config_dir is not None else default_config_dir()
    f32, bf16 = torch.float32, torch.bfloat16

    def torch_adamw(**kw: Any) -> Callable[[list[torch.Tensor]], Any]:
        return lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, **kw)

    def qconf_adamw(cfg: str, fused: bool, **kw: Any) -> Callable[[list[torch.Tensor]], Any]:
        def build(ps: list[torch.Tensor]) -> Any:
            return qoptim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, qconfig=_qconfig(cdir / cfg, min_numel),
                                fused=fused, **kw)
        return build

    def torchao_adamw(name: str) -> Callable[[list[torch.Tensor]], Any]:
        def build(ps: list[torch.Tensor]) -> Any:
            cls = getattr(importlib.import_module("torchao.optim"), name)
            return cls(ps, lr=LR, weight_decay=WEIGHT_DECAY)
        return build

    def bnb_adamw8bit(ps: list[torch.Tensor]) -> Any:
        bnb = importlib.import_module("bitsandbytes")
        return bnb.optim.AdamW8bit(ps, lr=LR, weight_decay=WEIGHT_DECAY)

    rows = [
        Contender("torch-forloop", "torch AdamW for-loop", f32, torch_adamw(foreach=False)),
        Contender("torch-foreach", "torch AdamW foreach", f32, torch_adamw(foreach=True)),
        Contender(BASELINE, "torch AdamW fused", f32, torch_adamw(fused=True)),
        Contender("torch-fused-bf16", "torch AdamW fused", bf16, torch_adamw(fused=True)),
    ]
    for dtype, tag in ((f32, "fp32"), (bf16, "bf16")):
        for cfg, short in CONFIGS.items():
            rows.append(Contender(f"qconf-fused-{short}-{tag}", f"qconf fused {cfg}", dtype,
                                  qconf_adamw(cfg, True), family="qconf"))
    # pure-bf16 weights (docs/precision.md): each config's step with stochastic rounding, default.yml's
    # with a Kahan buffer, each compared with its plain bf16 row
    for cfg, short in CONFIGS.items():
        plain = f"qconf-fused-{short}-bf16"
        rows.append(Contender(f"{plain}-sr", f"qconf fused {cfg} + SR weights", bf16,
                              qconf_adamw(cfg, True, bf16_stochastic_round=True), family="qconf", relative_to=plain))
    plain = "qconf-fused-default-bf16"
    rows.append(Contender(f"{plain}-kahan", "qconf fused default.yml + Kahan weights", bf16,
                          qconf_adamw("default.yml", True, compensation="kahan"), family="qconf", relative_to=plain))
    rows += [
        Contender("qconf-reference-default-fp32", "qconf reference default.yml", f32,
                  qconf_adamw("default.yml", False), family="qconf"),
        Contender("torchao-adamw4bit", "torchao AdamW4bit", f32, torchao_adamw("AdamW4bit"), "torchao", "torchao"),
        Contender("torchao-adamw8bit", "torchao AdamW8bit", f32, torchao_adamw("AdamW8bit"), "torchao", "torchao"),
        Contender("bnb-adamw8bit", "bitsandbytes AdamW8bit", f32, bnb_adamw8bit, "bitsandbytes", "bitsandbytes"),
    ]
    return rows


def _muon_rows(config_dir: str | os.PathLike | None, min_numel: int | None) -> list[Contender]:
    """The Muon roster: torch.optim.Muon (fp32 momentum, the baseline) and qconf.optim.Muon (fused)
    with each config of :data:`MUON_CONFIGS`, all on fp32 matrices with the same hyperparameters
    (``lr`` :data:`LR`, ``weight_decay`` :data:`WEIGHT_DECAY`, torch's defaults otherwise)."""
    cdir = Path(config_dir) if config_dir is not None else default_config_dir()

    def torch_muon(ps: list[torch.Tensor]) -> Any:
        return torch.optim.Muon(ps, lr=LR, weight_decay=WEIGHT_DECAY)

    def qconf_muon(cfg: str) -> Callable[[list[torch.Tensor]], Any]:
        def build(ps: list[torch.Tensor]) -> Any:
            return qoptim.Muon(ps, lr=LR, weight_decay=WEIGHT_DECAY, qconfig=_qconfig(cdir / cfg, min_numel), fused=True)
        return build

    rows = [Contender(MUON_BASELINE, "torch Muon", torch.float32, torch_muon)]
    rows += [Contender(f"qconf-muon-{short}", f"qconf Muon {cfg}", torch.float32, qconf_muon(cfg), family="qconf")
             for cfg, short in MUON_CONFIGS.items()]
    return rows


def default_config_dir() -> Path:
    """The built-in configs' directory (:func:`qconf.config.builtin.builtin_dir`: shipped in the
    wheel, the repository's ``configs/`` in a checkout)."""
    return builtin_dir()


def matches(key: str, patterns: Sequence[str]) -> bool:
    """Whether ``key`` matches one of the fnmatch ``patterns``."""
    return any(fnmatchcase(key, p) for p in patterns)


def select(all_rows: list[Contender], patterns: Sequence[str] | None, baseline: str = BASELINE) -> list[Contender]:
    """Rows whose key matches one of the fnmatch ``patterns`` (all when None); the ``baseline`` is always kept."""
    if not patterns:
        return list(all_rows)
    keep = [c for c in all_rows if c.key == baseline or matches(c.key, patterns)]
    unknown = [p for p in patterns if not any(fnmatchcase(c.key, p) for c in all_rows)]
    if unknown:
        raise ValueError(f"--contenders: {', '.join(map(repr, unknown))} match no contender "
                         f"(known: {', '.join(c.key for c in all_rows)})")
    return keep
