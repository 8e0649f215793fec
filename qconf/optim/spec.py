"""What an update rule declares: its states (:class:`StateSpec`, each in a kernel :class:`Slot`)
and its hyperparameters as the fused kernel reads them (:class:`Hyper`).

A rule (AdamW, SGD, Lion, ...) lists the states it keeps for a parameter; the optimizer base
(:mod:`qconf.optim.base`) creates, (de)quantizes and checkpoints them, and hands the fused stepper
(:mod:`qconf.optim.fused`) each state's value with its slot, and the group's :class:`Hyper` --
the stepper never matches state names or reads optimizer internals.
"""
from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = ["Slot", "StateSpec", "Hyper"]


class Slot(enum.Enum):
    """Where the fused kernel takes a state from. The kernel's rules (csrc/include/qconf/element.h)
    see two per-element states: ``FIRST`` (Adam/Lion ``exp_avg``, SGD ``momentum_buffer``) and
    ``SECOND`` (Adam ``exp_avg_sq``); ``ROW``/``COL`` hold a factored second moment's statistics
    (which replace ``SECOND``), ``COMPENSATION`` the Kahan buffer of a bf16/fp16 parameter. The
    values are the names of the slots in the kernels' layout (``qconf._native.layout``)."""

    FIRST = "state0"
    SECOND = "state1"
    ROW = "row"
    COL = "col"
    COMPENSATION = "comp"


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One optimizer state of a parameter.

    Attributes:
        key: the key in ``optimizer.state[p]`` (torch.optim's name, e.g. ``momentum_buffer``).
        section: the qconfig state section that decides its codec (``exp_avg``/``exp_avg_sq``),
            ``"compensation"`` for the Kahan buffer (codec from ``weights.compensation_codec``), or
            None for states that are never quantized (factored row/column statistics).
        shape: the state's shape (the parameter's, except for factored statistics).
        slot: the fused kernel's slot for it.
        dtype: storage dtype when not quantized (fp32; the parameter's dtype for the Kahan buffer).
    """

    key: str
    section: str | None
    shape: tuple[int, ...]
    slot: Slot
    dtype: torch.dtype = torch.float32


@dataclasses.dataclass(frozen=True)
class Hyper:
    """One param group's hyperparameters as the fused kernel reads them (a rule sets those it
    uses; the kernel derives every per-step scalar from them in double precision, as the
    reference path does). ``maximize``/``nesterov``/``decoupled`` are flags;
    ``decoupled`` selects AdamW's (and Lion's) decay ``p * (1 - lr * wd)`` over Adam's L2 term;
    ``adjusted_lr`` is Muon's shape-adjusted step size (its update call; the decay uses ``lr``)."""

    lr: float
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    maximize: bool = False
    nesterov: bool = False
    decoupled: bool = False
    adjusted_lr: float = 0.0
