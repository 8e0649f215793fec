"""Checkpoint parsing and conversion for qconf optimizers.

``parse`` turns a state dict -- qconf's own (any qconfig) or torch.optim's AdamW/Adam/SGD -- into
fully built new optimizer state *without touching the optimizer*, so a bad checkpoint raises
before anything changes. The optimizer describes itself to it as a :class:`Target`.
``export_torch_state_dict`` goes the other way.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from ..codec import Codec, QTensor
from ..config import load_config
from ..errors import QConfigError
from .spec import StateSpec
from .states import convert_state, factored_dense

__all__ = ["FORMAT_VERSION", "Target", "Loaded", "parse", "export_torch_state_dict"]

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Target:
    """The optimizer a checkpoint is loaded into, as :func:`parse` needs it.

    Attributes:
        optimizer: its class name (a qconf checkpoint names the class that wrote it).
        defaults: its hyperparameter defaults (which group keys are hyperparameters, and their types).
        param_groups: its current param groups.
        names, params: every parameter's qualified name ('' if unnamed) and tensor, in state_dict order.
        seed, enable_overrides: its current RNG seed and ``override_quantize_enable`` calls.
        requires_step: whether a state must carry a step count.
        lazy_states: states torch.optim saves as None before their first use.
        planned_states: ``(index, group, force_enable) -> [(spec, codec)]``: the states parameter
            ``index`` keeps under ``group``'s hyperparameters and an enable override, with codecs.
    """

    optimizer: str
    defaults: Mapping[str, Any]
    param_groups: Sequence[Mapping[str, Any]]
    names: Sequence[str]
    params: Sequence[torch.Tensor]
    seed: int
    enable_overrides: Mapping[int, bool]
    requires_step: bool
    lazy_states: tuple[str, ...]
    planned_states: Callable[[int, dict[str, Any], bool | None], list[tuple[StateSpec, Codec | None]]]


@dataclasses.dataclass
class Loaded:
    """New optimizer contents produced by :func:`parse` (committed by ``load_state_dict``)."""

    states: dict[int, dict[str, Any]]
    group_hyper: list[dict[str, Any]]
    enable_overrides: dict[int, bool]
    seed: int


class _Fail(ValueError):
    pass


def _fail(msg: str) -> None:
    raise _Fail(f"load_state_dict: {msg}; the optimizer was left unchanged")


def parse(sd: Any, opt: Target) -> Loaded:
    """Validate ``sd`` against the optimizer ``opt`` and build the new state (see module docstring)."""
    try:
        return _parse(opt, sd)
    except _Fail as e:
        raise ValueError(str(e)) from None


def _parse(opt: Target, sd: Any) -> Loaded:
    if not isinstance(sd, Mapping):
        _fail(f"expected a dict, got {type(sd).__name__}")
    for key in ("state", "param_groups"):
        if key not in sd:
            _fail(f"missing top-level key {key!r} (found: {sorted(map(str, sd))})")
    saved_groups = sd["param_groups"]
    if not isinstance(saved_groups, (list, tuple)) or not all(isinstance(g, Mapping) and "params" in g
                                                               for g in saved_groups):
        _fail("'param_groups' must be a list of dicts with a 'params' list")
    if len(saved_groups) != len(opt.param_groups):
        _fail(f"the checkpoint has {len(saved_groups)} param groups, the optimizer has {len(opt.param_groups)}")
    saved_to_index: dict[Any, int] = {}
    offset = 0
    for gi, (sg, g) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            _fail(f"param group {gi} has {len(sg['params'])} params in the checkpoint, "
                  f"{len(g['params'])} in the optimizer")
        for k, saved_id in enumerate(sg["params"]):
            saved_to_index[saved_id] = offset + k
        offset += len(g["params"])

    qsec = sd.get("qconf")
    if qsec is not None:
        seed, saved_overrides = _parse_qconf_section(opt, qsec)
    else:  # a torch.optim state dict
        seed, saved_overrides = opt.seed, {}
    overrides = {**saved_overrides, **opt.enable_overrides}  # explicit calls on this optimizer win

    group_hyper = [_parse_hyper(opt, gi, sg) for gi, sg in enumerate(saved_groups)]
    group_of_index = []
    for gi, g in enumerate(opt.param_groups):
        merged = {**g, **group_hyper[gi]}
        group_of_index.extend([merged] * len(g["params"]))

    saved_state = sd["state"]
    if not isinstance(saved_state, Mapping):
        _fail("'state' must be a dict")
    states: dict[int, dict[str, Any]] = {}
    for saved_id, entry in saved_state.items():
        if saved_id not in saved_to_index:
            _fail(f"state entry {saved_id!r} does not belong to any param group")
        index = saved_to_index[saved_id]
        name = opt.names[index]
        where = f"parameter {index} ({name!r})" if name else f"parameter {index}"
        if not isinstance(entry, Mapping):
            _fail(f"{where}: state must be a dict, got {type(entry).__name__}")
        planned = opt.planned_states(index, group_of_index[index], overrides.get(index))
        states[index] = _parse_entry(opt, where, opt.params[index], entry, planned, torch_format=qsec is None)
    return Loaded(states, group_hyper, overrides, seed)


def _parse_qconf_section(opt: Target, qsec: Any) -> tuple[int, dict[int, bool]]:
    if not isinstance(qsec, Mapping):
        _fail("'qconf' section must be a dict")
    version = qsec.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        _fail(f"unsupported qconf checkpoint format_version {version!r} (this qconf reads 1..{FORMAT_VERSION})")
    saved_opt = qsec.get("optimizer")
    if saved_opt is not None and saved_opt != opt.optimizer:
        _fail(f"checkpoint was written by {saved_opt}, not {opt.optimizer}")
    if qsec.get("qconfig") is not None:  # read it (its schema version too): a reader for it must exist
        try:
            load_config(qsec["qconfig"])
        except QConfigError as e:
            _fail("'qconf.qconfig' is not a qconfig this qconf reads: " + "; ".join(str(p) for p in e.problems))
    seed = qsec.get("seed", opt.seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        _fail(f"'qconf.seed' must be an int, got {seed!r}")
    raw = qsec.get("enable_overrides", {})
    if not isinstance(raw, Mapping) or not all(isinstance(k, int) and isinstance(v, bool) for k, v in raw.items()):
        _fail("'qconf.enable_overrides' must map parameter indexes to booleans")
    n = sum(len(g["params"]) for g in opt.param_groups)
    bad = [k for k in raw if not 0 <= k < n]
    if bad:
        _fail(f"'qconf.enable_overrides' names parameter {bad[0]}, but the optimizer has {n} parameters")
    return seed, dict(raw)


def _parse_hyper(opt: Target, gi: int, saved_group: Mapping[str, Any]) -> dict[str, Any]:
    """Hyperparameters this optimizer knows, taken from a saved group (others are ignored)."""
    hyper = {}
    for key, default in opt.defaults.items():
        if key in saved_group:
            value = saved_group[key]
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                ok = isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool)
            elif isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, tuple):
                ok = isinstance(value, (tuple, list)) and len(value) == len(default)
                value = tuple(value) if ok else value
            else:
                ok = True
            if not ok:
                _fail(f"param group {gi}: {key!r} is {value!r}, expected a value like {default!r}")
            hyper[key] = value
    return hyper


def _as_tensor_state(where: str, key: str, value: Any, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(f"{where}: key {key!r} must be a tensor or a quantized-state dict, got {type(value).__name__}")
    if not value.is_floating_point():
        _fail(f"{where}: key {key!r} has dtype {value.dtype}, expected a floating dtype")
    if tuple(value.shape) != tuple(shape):
        _fail(f"{where}: key {key!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value.detach().to(device=device, dtype=torch.float32, copy=True)


def _as_qtensor(where: str, key: str, value: Mapping[str, Any], shape: tuple[int, ...],
                device: torch.device) -> QTensor:
    missing = [k for k in ("codes", "scales", "shape", "codec") if k not in value]
    if missing:
        _fail(f"{where}: quantized state {key!r} is missing {missing}")
    try:
        codec = Codec.from_dict(dict(value["codec"]))
        q = QTensor(value["codes"], value["scales"], torch.Size(value["shape"]), codec)
    except (ValueError, TypeError) as e:
        _fail(f"{where}: quantized state {key!r} is invalid: {e}")
    if tuple(q.shape) != tuple(shape):
        _fail(f"{where}: key {key!r} has shape {tuple(q.shape)}, expected {tuple(shape)}")
    return QTensor(q.codes.to(device, copy=True), q.scales.to(device, copy=True), q.shape, q.codec)


def _parse_entry(opt: Target, where: str, p: torch.Tensor, entry: Mapping[str, Any],
                 planned: list[tuple[StateSpec, Codec | None]], torch_format: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    step = entry.get("step")
    if step is None:
        if not torch_format or opt.requires_step:
            _fail(f"{where}: missing key 'step'")
        step = 0
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or not torch.isfinite(step.float()).all():
            _fail(f"{where}: key 'step' must be one finite number, got a tensor of shape {tuple(step.shape)}")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 0 or step != int(step):
        _fail(f"{where}: key 'step' must be a non-negative whole number, got {step!r}")
    out["step"] = torch.tensor(float(step), dtype=torch.float32)

    known = {s.key for s, _ in planned} | {"step"}
    for key, value in entry.items():
        if key not in known and value is not None:
            hint = " (amsgrad is not supported)" if key == "max_exp_avg_sq" else ""
            _fail(f"{where}: unexpected state key {key!r}{hint}; this {opt.optimizer} keeps "
                  f"{sorted(known)}")
    for spec, codec in planned:
        if spec.key not in entry:
            _fail(f"{where}: missing key {spec.key!r}")
        value = entry[spec.key]
        if value is None:
            if opt.lazy_states and spec.key in opt.lazy_states:
                continue  # e.g. torch SGD's momentum_buffer before its first use
            _fail(f"{where}: key {spec.key!r} is None")
        if isinstance(value, Mapping):
            value = _as_qtensor(where, spec.key, value, spec.shape, p.device)
        else:
            value = _as_tensor_state(where, spec.key, value, spec.shape, p.device)
        out[spec.key] = convert_state(value, codec, spec.dtype)
    return out


def export_torch_state_dict(opt: Any) -> dict[str, Any]:
    """A state dict that ``torch.optim.AdamW``/``Adam``/``SGD`` (same param groups) can load,
    from a qconf optimizer ``opt``.

    Quantized states are decoded to the parameter's dtype (as torch.optim keeps them). A factored
    second moment is expanded to the dense ``exp_avg_sq`` it stands for (with a warning).
    """
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for index, entry in sd["state"].items():
        p = params[index]
        out = {}
        for key, value in entry.items():
            if isinstance(value, Mapping):
                value = QTensor.from_dict(value).decode()
            if key == "step":
                if opt.requires_step:
                    out["step"] = value.clone()
                continue
            if key in ("exp_avg_sq_row", "exp_avg_sq_col", "kahan_comp"):  # no torch.optim counterpart
                continue
            out[key] = value.to(p.dtype).clone()
        if "exp_avg_sq_row" in entry:
            warnings.warn(f"export_torch_state_dict: parameter {index} has a factored second moment; exported "
                          "as the dense exp_avg_sq it approximates", stacklevel=2)
            out["exp_avg_sq"] = factored_dense(entry["exp_avg_sq_row"], entry["exp_avg_sq_col"]).to(p.dtype)
        for key in opt.lazy_states:
            out.setdefault(key, None)
        state[index] = out
    groups = []
    for g in sd["param_groups"]:
        g = copy.deepcopy({k: v for k, v in g.items() if k not in opt.qconf_only_group_keys})
        g.update(opt.torch_group_defaults)
        groups.append(g)
    return {"state": state, "param_groups": groups}
