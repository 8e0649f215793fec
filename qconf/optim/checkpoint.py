"""Checkpoint parsing and conversion for qconf optimizers.

``parse`` turns a state dict -- qconf's own (any qconfig, format 1 or 2) or torch.optim's
AdamW/Adam/SGD -- into fully built new optimizer contents *without touching the optimizer*, so a
bad checkpoint raises ``ValueError`` before anything changes. The optimizer describes itself to
it as a :class:`Target`. :func:`qconf.optim.export.export_torch_state_dict` goes the other way.

**Where qconf's own data lives (format 2).** Every param group carries a ``"qconf"`` section (see
:func:`section`): format version, optimizer class, qconfig (a record of how the states were
written; on load it is only checked to be readable -- states carry their own codecs), the RNG
seed and the ``override_quantize_enable`` calls. ``torch.distributed.checkpoint``'s
``get_optimizer_state_dict`` keeps only ``state`` and ``param_groups``, so a top-level section
(format 1, still read) was lost there. DCP loads a checkpoint into the loading optimizer's own
state dict leaf by leaf, so the overrides are stored as one leaf (a list of ``[index, enable]``
pairs), not as a dict whose keys the loading optimizer may not have.

**Param groups** round-trip as in torch.optim: every saved key is kept (``initial_lr``,
``max_lr``, ... of LR schedulers too), ``params`` (and ``param_names``, which feed the qconfig's
overrides) stay the optimizer's own. A hyperparameter the checkpoint lacks keeps the optimizer's
value; the hyperparameters are checked by the constructor's own rules (``validate_group``).

**Which states an entry may hold.** A rule's ``layout_variants`` are the settings of its
layout-deciding hyperparameters (Adam's ``factor_second_moment``, SGD's ``momentum`` zero or not).
An entry is accepted when every key is a state the rule keeps under some variant and it holds all
states of at least one variant -- which is what a live optimizer holds after a user changed such a
hyperparameter mid-run (the old states stay; the new ones are created at the next step). So an
Adam entry with ``exp_avg`` and ``exp_avg_sq`` loads under ``factor_second_moment=True`` and an
entry with ``exp_avg`` alone does not. States the optimizer creates on demand are never required:
lazy states (SGD's momentum buffer, as in torch.optim) and the Kahan buffer (starts at zero). An
empty entry means "no state yet", as in torch.

**Values** are checked before use: tensors finite and of the state's shape, second moments
(``exp_avg_sq`` and its factored statistics) non-negative, quantized states with a valid codec,
finite non-negative scales and codes inside the map; steps whole numbers in ``[0, 2**53]``.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from ..codec import Codec, QTensor
from ..codec import packing
from ..config import load_config
from ..errors import QConfigError
from . import records, sharded_state
from ._validate import check_seed
from .sharded import PendingEncode, is_sharded, shard_geometry
from .spec import Slot, StateSpec
from .states import convert_state

__all__ = ["FORMAT_VERSION", "SECTION_KEY", "Target", "Loaded", "section", "pack", "parse", "adopt_entry"]

FORMAT_VERSION = 2
#: the param-group key (format 2) or top-level key (format 1) of qconf's section
SECTION_KEY = "qconf"
_MAX_STEP = 2**53
_NON_NEGATIVE = (Slot.SECOND, Slot.ROW, Slot.COL)  # second-moment states: v >= 0 (the rule takes sqrt(v))
_OWN_GROUP_KEYS = ("params", "param_names", SECTION_KEY)  # never taken from a checkpoint's group


@dataclasses.dataclass(frozen=True)
class Target:
    """The optimizer a checkpoint is loaded into, as :func:`parse` needs it.

    Attributes:
        optimizer: its class name (a qconf checkpoint names the class that wrote it).
        defaults: its hyperparameter defaults (their keys are the hyperparameters).
        param_groups: its current param groups.
        names, params: every parameter's qualified name ('' if unnamed) and tensor, in state_dict order.
        seed, enable_overrides: its current RNG seed and ``override_quantize_enable`` calls.
        requires_step: whether a state must carry a step count.
        lazy_states: states torch.optim saves as None before their first use.
        planned_states: ``(index, group, force_enable) -> [(spec, codec)]``: the states parameter
            ``index`` keeps under ``group``'s hyperparameters and an enable override, with codecs.
        validate_group: the constructor's check of one group's hyperparameters (ValueError), which
            returns them normalized.
        layout_variants: group settings that give every layout of states the rule can keep.
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
    validate_group: Callable[[Mapping[str, Any]], dict[str, Any]]
    layout_variants: Sequence[Mapping[str, Any]]


@dataclasses.dataclass
class Loaded:
    """New optimizer contents produced by :func:`parse` (committed by ``load_state_dict``).
    ``groups`` are the new param groups without ``params``/``param_names``."""

    states: dict[int, dict[str, Any]]
    groups: list[dict[str, Any]]
    enable_overrides: dict[int, bool]
    seed: int
    #: sharded states to encode (collectively, ``sharded.finish_encodes``) before they are used
    pending: list[PendingEncode] = dataclasses.field(default_factory=list)


def section(optimizer: str, qconfig: dict[str, Any], seed: int, enable_overrides: Mapping[int, bool]) -> dict[str, Any]:
    """qconf's section of a param group in a format-2 state dict (plain data)."""
    return {"format_version": FORMAT_VERSION, "optimizer": optimizer, "qconfig": qconfig, "seed": seed,
            "enable_overrides": [[i, bool(e)] for i, e in sorted(enable_overrides.items())]}


def pack(param_groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Mapping[str, Any]],
         qsection: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict as plain data (format 2)::

        {"state": {i: {"step": tensor, "exp_avg": {"codes", "scales", "shape", "codec", "packed"} | tensor, ...}},
         "param_groups": [{...every group key..., "params": [i, ...], "qconf": qsection}, ...]}

    Parameter ids are torch's (a parameter's first position in the groups); every group gets its
    own copy of ``qsection`` (:func:`section`); quantized states become records
    (:func:`qconf.optim.records.to_record`; a sharded run's are already records)."""
    ids: dict[int, int] = {}
    groups = []
    start = 0
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        for i, p in enumerate(g["params"], start):
            ids.setdefault(id(p), i)
        packed["params"] = [ids[id(p)] for p in g["params"]]
        packed[SECTION_KEY] = copy.deepcopy(qsection)
        start += len(g["params"])
        groups.append(packed)
    packed_state = {(ids[id(k)] if isinstance(k, torch.Tensor) else k):
                    {n: (records.to_record(v) if isinstance(v, QTensor) else v) for n, v in s.items()}
                    for k, s in state.items()}
    return {"state": packed_state, "param_groups": groups}


class _Fail(ValueError):
    pass


def _fail(msg: str) -> None:
    raise _Fail(f"load_state_dict: {msg}; the optimizer was left unchanged")


def parse(sd: Any, opt: Target) -> Loaded:
    """Validate ``sd`` against the optimizer ``opt`` and build the new contents (see module docstring)."""
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
    saved_to_index = _param_ids(opt, saved_groups)
    sections = _find_sections(sd, saved_groups)
    if sections is not None:
        seed, saved_overrides = _parse_sections(opt, sections)
    else:  # a torch.optim state dict
        seed, saved_overrides = opt.seed, {}
    overrides = {**saved_overrides, **opt.enable_overrides}  # explicit calls on this optimizer win
    groups = [_parse_group(opt, gi, sg) for gi, sg in enumerate(saved_groups)]
    group_of_index = []
    for g, live in zip(groups, opt.param_groups):
        group_of_index.extend([g] * len(live["params"]))

    saved_state = sd["state"]
    if not isinstance(saved_state, Mapping):
        _fail(f"'state' must be a dict, got {type(saved_state).__name__}")
    states: dict[int, dict[str, Any]] = {}
    pending: list[PendingEncode] = []
    for saved_id, entry in saved_state.items():
        index = saved_to_index.get(saved_id)
        if index is None:
            _fail(f"state entry {saved_id!r} does not belong to any param group")
        name = opt.names[index]
        where = f"parameter {index} ({name!r})" if name else f"parameter {index}"
        if not isinstance(entry, Mapping):
            _fail(f"{where}: state must be a dict, got {type(entry).__name__}")
        if not entry:
            continue  # torch.optim's "no state yet"
        force = overrides.get(index)
        layouts = [opt.planned_states(index, {**group_of_index[index], **variant}, force)
                   for variant in ({}, *opt.layout_variants)]
        states[index] = _parse_entry(opt, where, opt.params[index], entry, layouts, sections is None, pending)
    return Loaded(states, groups, overrides, seed, pending)


def adopt_entry(opt: Target, index: int, group: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    """One parameter's state entry written into ``optimizer.state`` as a state dict holds it (what
    ``ZeroRedundancyOptimizer.load_state_dict`` does: it never calls the inner optimizer's
    ``load_state_dict``), validated and built like :func:`parse` does (``ValueError`` otherwise)."""
    name = opt.names[index]
    where = f"parameter {index} ({name!r})" if name else f"parameter {index}"
    force = opt.enable_overrides.get(index)
    layouts = [opt.planned_states(index, {**group, **variant}, force) for variant in ({}, *opt.layout_variants)]
    pending: list[PendingEncode] = []
    try:
        out = _parse_entry(opt, where, opt.params[index], entry, layouts, False, pending)
    except _Fail as e:
        raise ValueError(str(e).replace("load_state_dict", "a state written into optimizer.state")) from None
    if pending:
        raise ValueError(f"{where}: a sharded state written into optimizer.state must be loaded with load_state_dict")
    return out


def _param_ids(opt: Target, saved_groups: Any) -> dict[Any, int]:
    """Saved parameter id -> parameter index, after checking the groups match the optimizer's."""
    if not isinstance(saved_groups, (list, tuple)) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in saved_groups):
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
            if not isinstance(saved_id, (int, str)) or isinstance(saved_id, bool):
                _fail(f"param group {gi}: parameter ids must be ints (or names, as DCP writes them), "
                      f"got {type(saved_id).__name__}")
            saved_to_index.setdefault(saved_id, offset + k)  # a repeated id means the same parameter (torch)
        offset += len(g["params"])
    return saved_to_index


def _find_sections(sd: Mapping[str, Any], saved_groups: Sequence[Mapping[str, Any]]) -> list[Any] | None:
    """qconf's section of every group (format 2), or the top-level one (format 1), or None."""
    found = [g[SECTION_KEY] for g in saved_groups if SECTION_KEY in g]
    if found:
        if len(found) != len(saved_groups):
            _fail(f"only {len(found)} of {len(saved_groups)} param groups carry a {SECTION_KEY!r} section")
        return found
    if SECTION_KEY in sd:
        return [sd[SECTION_KEY]]
    return None


def _parse_sections(opt: Target, sections: list[Any]) -> tuple[int, dict[int, bool]]:
    """Seed and enable overrides from qconf's sections (all groups must agree)."""
    first = _parse_section(opt, sections[0], check_qconfig=True)
    for gi, sec in enumerate(sections[1:], 1):
        if _parse_section(opt, sec, check_qconfig=False) != first:
            _fail(f"param group {gi}'s {SECTION_KEY!r} section disagrees with param group 0's")
    return first[1], first[2]


def _parse_section(opt: Target, qsec: Any, check_qconfig: bool) -> tuple[int, int, dict[int, bool]]:
    if not isinstance(qsec, Mapping):
        _fail(f"{SECTION_KEY!r} section must be a dict, got {type(qsec).__name__}")
    version = qsec.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        _fail(f"unsupported qconf checkpoint format_version {version!r} (this qconf reads 1..{FORMAT_VERSION})")
    saved_opt = qsec.get("optimizer")
    if saved_opt is not None and not isinstance(saved_opt, str):
        _fail(f"'qconf.optimizer' must be a class name, got {type(saved_opt).__name__}")
    if saved_opt is not None and saved_opt != opt.optimizer:
        _fail(f"checkpoint was written by {saved_opt}, not {opt.optimizer}")
    if check_qconfig and qsec.get("qconfig") is not None:
        _check_qconfig(qsec["qconfig"])
    seed = qsec.get("seed", opt.seed)
    try:
        check_seed("'qconf.seed'", seed)  # the constructor's rule
    except ValueError as e:
        _fail(str(e))
    raw = qsec.get("enable_overrides", [] if version >= 2 else {})
    if version >= 2:  # [[index, enable], ...]
        ok = isinstance(raw, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in raw)
        pairs = list(raw) if ok else []
    else:  # {index: enable}
        ok = isinstance(raw, Mapping)
        pairs = list(raw.items()) if ok else []
    if not ok or not all(isinstance(k, int) and not isinstance(k, bool) and isinstance(v, bool) for k, v in pairs):
        _fail("'qconf.enable_overrides' must map parameter indexes to booleans"
              + (" (a list of [index, enable] pairs)" if version >= 2 else ""))
    n = len(opt.params)
    bad = [k for k, _ in pairs if not 0 <= k < n]
    if bad:
        _fail(f"'qconf.enable_overrides' names parameter {bad[0]}, but the optimizer has {n} parameters")
    return version, seed, dict(pairs)


def _check_qconfig(qconfig: Any) -> None:
    """The recorded qconfig must be one this qconf reads (its schema version too), self-contained."""
    if not isinstance(qconfig, Mapping):
        _fail(f"'qconf.qconfig' must be a dict, got {type(qconfig).__name__}")
    if any(isinstance(k, str) and k.lower() == "base" for k in qconfig):
        _fail("'qconf.qconfig' must be self-contained: a checkpoint's qconfig has no 'base' files")
    try:
        load_config(qconfig)
    except QConfigError as e:
        _fail("'qconf.qconfig' is not a qconfig this qconf reads: " + "; ".join(str(p) for p in e.problems))


def _parse_group(opt: Target, gi: int, saved: Mapping[str, Any]) -> dict[str, Any]:
    """The new param group ``gi`` (without params): every saved key, hyperparameters checked by
    the constructor's rules; hyperparameters the checkpoint lacks keep the optimizer's values."""
    live = opt.param_groups[gi]
    new = {k: live[k] for k in opt.defaults if k in live}
    for key, value in saved.items():
        if key in _OWN_GROUP_KEYS:
            continue
        try:
            new[key] = copy.deepcopy(value)
        except Exception as e:  # noqa: BLE001 -- an arbitrary object's __deepcopy__ may raise anything
            _fail(f"param group {gi}: key {key!r} cannot be copied ({type(e).__name__}: {e})")
    try:
        hyper = opt.validate_group(new)
    except ValueError as e:
        _fail(f"param group {gi}: {e}")
    new.update(hyper)
    return new


def _parse_step(opt: Target, where: str, entry: Mapping[str, Any], torch_format: bool) -> torch.Tensor:
    step = entry.get("step")
    if step is None:
        if not torch_format or opt.requires_step:
            _fail(f"{where}: missing key 'step'")
        step = 0
    if isinstance(step, torch.Tensor):
        if (step.numel() != 1 or step.layout != torch.strided or step.is_meta or step.is_complex()
                or step.dtype == torch.bool):
            _fail(f"{where}: key 'step' must be one real number, got a {step.dtype} tensor of shape "
                  f"{tuple(step.shape)}")
        step = step.item()
    if isinstance(step, float) and not math.isfinite(step):
        step = None
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 <= step <= _MAX_STEP or step != int(step):
        _fail(f"{where}: key 'step' must be a whole number in [0, 2**53], got {entry.get('step')!r}")
    return torch.tensor(float(step), dtype=torch.float32)


def _parse_entry(opt: Target, where: str, p: torch.Tensor, entry: Mapping[str, Any],
                 layouts: list[list[tuple[StateSpec, Codec | None]]], torch_format: bool,
                 pending: list[PendingEncode]) -> dict[str, Any]:
    """One parameter's new state. ``layouts[0]``: the states planned under the saved group;
    the others: under each layout variant (see the module docstring for the rule). A sharded
    parameter's states are its shard's (:mod:`qconf.optim.sharded_state`); those that must be
    re-encoded are added to ``pending``."""
    out: dict[str, Any] = {"step": _parse_step(opt, where, entry, torch_format)}
    known: dict[str, tuple[StateSpec, Codec | None]] = {}
    for layout in layouts:
        for spec, codec in layout:
            known.setdefault(spec.key, (spec, codec))
    for key, value in entry.items():
        if key != "step" and key not in known and value is not None:
            hint = " (amsgrad is not supported)" if key == "max_exp_avg_sq" else ""
            _fail(f"{where}: unexpected state key {key!r}{hint}; this {opt.optimizer} keeps "
                  f"{sorted(['step', *known])}")
    present = [k for k in known if entry.get(k) is not None]

    def optional(spec: StateSpec) -> bool:  # created on demand by the optimizer
        return spec.key in opt.lazy_states or spec.section == "compensation"

    if not any(all(s.key in present or optional(s) for s, _ in layout) for layout in layouts):
        key = next(s.key for s, _ in layouts[0] if s.key not in present and not optional(s))
        _fail(f"{where}: key {key!r} is None" if key in entry else f"{where}: missing key {key!r}")
    for key in present:
        spec, codec = known[key]
        value = entry[key]
        if isinstance(value, Mapping):
            value = _as_qtensor(where, key, value, spec, p)
        else:
            value = _as_tensor_state(where, key, value, spec, torch.float32 if codec is not None else spec.dtype, p)
        if is_sharded(p):
            out[key] = sharded_state.convert_local(value, codec, spec.dtype, p, out, key, pending)
        else:
            out[key] = convert_state(value, codec, spec.dtype)
    return out


def _check_dense(where: str, what: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        _fail(f"{where}: {what} must be a tensor or a quantized-state dict, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_meta:
        _fail(f"{where}: {what} must be a dense tensor with data, got layout {value.layout} on {value.device}")


def _as_tensor_state(where: str, key: str, value: Any, spec: StateSpec, dtype: torch.dtype,
                     p: torch.Tensor) -> torch.Tensor:
    """A full-precision state as a new ``dtype`` tensor on ``p``'s device (``dtype``: the state's
    own, so no precision is lost on the way, or fp32 for a state about to be encoded); of a
    sharded ``p``, this rank's rows."""
    device = p.device
    if is_sharded(p):
        value = sharded_state.import_dense(value, p, lambda m: _fail(f"{where}: {m}"), f"key {key!r}")
        spec = dataclasses.replace(spec, shape=tuple(value.shape))
    _check_dense(where, f"key {key!r}", value)
    if value.is_complex() and not dtype.is_complex:  # torch.optim's state of a complex parameter
        value = torch.view_as_real(value)
    if not (value.is_floating_point() or (value.is_complex() and dtype.is_complex)):
        _fail(f"{where}: key {key!r} has dtype {value.dtype}, expected a floating dtype")
    if tuple(value.shape) != tuple(spec.shape):
        _fail(f"{where}: key {key!r} has shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
    out = value.detach().to(device=device, dtype=dtype, copy=True)
    if not bool(torch.isfinite(out).all()):
        _fail(f"{where}: key {key!r} holds NaN or infinite values (as {dtype})")
    if spec.slot in _NON_NEGATIVE and bool((out < 0).any()):
        _fail(f"{where}: key {key!r} holds negative values; a second moment is never negative")
    return out


def _as_qtensor(where: str, key: str, value: Mapping[str, Any], spec: StateSpec, p: torch.Tensor) -> QTensor:
    """A quantized state record as a QTensor on ``p``'s device, checked to decode to finite values
    (of a sharded ``p``: its shard's QTensor; every codes layout of :mod:`records` is accepted for either)."""
    device = p.device
    missing = [k for k in ("codes", "scales", "shape", "codec") if k not in value]
    if missing:
        _fail(f"{where}: quantized state {key!r} is missing {missing}")
    for part in ("codes", "scales"):
        _check_dense(where, f"quantized state {key!r}: {part!r}", value[part])
    shape = value["shape"]
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        _fail(f"{where}: quantized state {key!r}: 'shape' must be a list of ints, got {shape!r}")
    if tuple(shape) != tuple(spec.shape):
        _fail(f"{where}: key {key!r} has shape {tuple(shape)}, expected {tuple(spec.shape)}")
    if not isinstance(value["codec"], Mapping):
        _fail(f"{where}: quantized state {key!r}: 'codec' must be a dict, got {type(value['codec']).__name__}")
    try:
        codec = Codec.from_dict(dict(value["codec"]))
        if is_sharded(p):
            q = sharded_state.import_qtensor(value, codec, p, lambda m: _fail(f"{where}: {m}"),
                                             f"quantized state {key!r}")
        else:
            q = records.from_record(value, codec)
    except (ValueError, TypeError) as e:
        _fail(f"{where}: quantized state {key!r} is invalid: {e}")
    q = QTensor(q.codes.to(device, copy=True), q.scales.to(device, copy=True), q.shape, codec)
    if not bool(torch.isfinite(q.scales).all()) or bool((q.scales < 0).any()):
        _fail(f"{where}: quantized state {key!r} has NaN, infinite or negative scales")
    levels = codec.qmap.numel()  # 2**bits - 1 for signed linear: the top code is outside the map
    if levels < 2**codec.bits and q.numel() > 0 and int(packing.unpack(q.codes, codec.bits, q.numel()).max()) >= levels:
        _fail(f"{where}: quantized state {key!r} has codes outside its {levels}-entry map")
    own = q.decode().reshape(-1)[shard_geometry(p).lead(codec):] if is_sharded(p) else q.decode()  # no padding
    if spec.slot in _NON_NEGATIVE and codec.signed and bool((own < 0).any()):
        _fail(f"{where}: key {key!r} holds negative values; a second moment is never negative")
    return q
