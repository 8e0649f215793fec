"""torch's Muon for a whole model as one optimizer (:class:`TorchMuonAdamW`: the pairing torch's
documentation asks for, the memory benchmark's baseline for qconf.optim.Muon), and the state bytes
of a Muon row per part (:func:`state_parts`)."""
from __future__ import annotations

from typing import Any

import torch

from .. import optim as qoptim
from ..config import load_config
from ..memory import memory_report
from ..optim.muon_routing import MUON, Router
from .roster import LR, WEIGHT_DECAY
from .tensors import state_bytes

__all__ = ["TorchMuonAdamW", "state_parts"]


class TorchMuonAdamW:
    """torch's Muon for a whole model, as one optimizer: torch.optim.Muon (fp32 momentum, torch's
    defaults but ``lr`` and ``weight_decay``) on the parameters qconf.optim.Muon's default routing
    gives Muon (2-D hidden matrices), torch.optim.AdamW (fused) on the rest -- the pairing
    torch.optim.Muon's documentation asks for. ``parts``: ``{"muon": ..., "adamw": ...}``."""

    def __init__(self, named_params: Any, lr: float = LR, weight_decay: float = WEIGHT_DECAY):
        router = Router(None, load_config({}))
        split: dict[str, list[torch.Tensor]] = {"muon": [], "adamw": []}
        for name, p in named_params:
            split["muon" if router.rule(name, p) == MUON else "adamw"].append(p)
        self.parts = {"muon": torch.optim.Muon(split["muon"], lr=lr, weight_decay=weight_decay),
                      "adamw": torch.optim.AdamW(split["adamw"], lr=lr, weight_decay=weight_decay, fused=True)}

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        """Both parts' states, by parameter."""
        return {**self.parts["muon"].state, **self.parts["adamw"].state}

    def step(self) -> None:
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)


def state_parts(opt: Any) -> dict[str, dict[str, int]] | None:
    """A Muon row's state bytes and parameters per part: ``{"muon": {"numel", "state_bytes"},
    "adamw": {...}}`` (qconf: :func:`qconf.memory_report`'s rows; torch: each part's
    :func:`~qconf.bench.tensors.state_bytes`); None for an optimizer without parts."""
    if isinstance(opt, TorchMuonAdamW):
        return {part: {"numel": sum(p.numel() for g in o.param_groups for p in g["params"]),
                       "state_bytes": state_bytes(o)} for part, o in opt.parts.items()}
    if not isinstance(opt, qoptim.Muon):
        return None
    out = {part: {"numel": 0, "state_bytes": 0} for part in ("muon", "adamw")}
    rows = iter(memory_report(opt).rows)  # (in param_groups order)
    for group in opt.param_groups:
        part = out["muon" if group["use_muon"] else "adamw"]
        for _ in group["params"]:
            row = next(rows)
            part["numel"] += row.numel
            part["state_bytes"] += row.total_bytes
    return out
