"""``export_torch_state_dict``: a qconf optimizer's state as torch.optim keeps it (quantized states
decoded, qconf-only keys dropped), for moving a run back to ``torch.optim``."""
from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..codec import Codec
from .checkpoint import SECTION_KEY
from .records import from_record
from .states import factored_dense

__all__ = ["export_torch_state_dict"]


def export_torch_state_dict(opt: Any) -> dict[str, Any]:
    """A state dict that ``torch.optim.AdamW``/``Adam``/``SGD`` (same param groups) can load,
    from a qconf optimizer ``opt``.

    Quantized states are decoded to the parameter's dtype (as torch.optim keeps them). A factored
    second moment is expanded to the dense ``exp_avg_sq`` it stands for (with a warning).
    """
    if any("use_muon" in g for g in opt.param_groups):
        raise ValueError("export_torch_state_dict: qconf.optim.Muon keeps the states of two torch optimizers "
                         "(torch.optim.Muon for its use_muon=True groups, AdamW for the others), which no single "
                         "torch.optim optimizer loads; save it with opt.state_dict() instead")
    sd = opt.state_dict()
    params = [(p, g) for g in opt.param_groups for p in g["params"]]
    state = {}
    for index, entry in sd["state"].items():
        p, group = params[index]
        out = {}
        for key, value in entry.items():
            if isinstance(value, Mapping):
                value = from_record(value, Codec.from_dict(value["codec"])).decode()
            if key == "step":
                if opt.requires_step:
                    out["step"] = value.clone()
                continue
            if key in ("exp_avg_sq_row", "exp_avg_sq_col", "kahan_comp"):  # no torch.optim counterpart
                continue
            out[key] = _torch_form(value, p)
        if group.get("factor_second_moment") and "exp_avg_sq_row" in entry:
            warnings.warn(f"export_torch_state_dict: parameter {index} has a factored second moment; exported "
                          "as the dense exp_avg_sq it approximates", stacklevel=2)
            out["exp_avg_sq"] = _torch_form(factored_dense(entry["exp_avg_sq_row"], entry["exp_avg_sq_col"]), p)
        for key in opt.lazy_states:
            out.setdefault(key, None)
        state[index] = out
    groups = []
    for g in sd["param_groups"]:
        drop = (*opt.qconf_only_group_keys, SECTION_KEY)
        g = copy.deepcopy({k: v for k, v in g.items() if k not in drop})
        g.update(opt.torch_group_defaults)
        groups.append(g)
    return {"state": state, "param_groups": groups}


def _torch_form(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state as torch.optim keeps it: a new tensor of ``p``'s dtype (a complex parameter's state,
    kept as its ``view_as_real``, back as a complex tensor of ``p``'s shape)."""
    if p.is_complex():
        return torch.view_as_complex(value.to(torch.view_as_real(p).dtype).contiguous()).clone()
    return value.to(p.dtype).clone()
