"""The qconfig model: frozen dataclasses for one state's storage (:class:`StateConfig`), the
low-precision weights (:class:`WeightsConfig`), per-parameter exceptions (:class:`Override`) and
the whole config (:class:`QConfig`). Every constructor validates with :mod:`qconf.config.rules`.

Which codec each state of a parameter gets is resolved by :func:`qconf.config.plan.resolve_plan`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

from ..codec import Codec
from ..errors import QConfigError
from .bitnet import BITNET_FIELDS, BitNetConfig
from .frozen import FrozenDict
from .rules import (BAD, OVERRIDE_KEYS, OVERRIDE_STATE_FIELDS, STATE_FIELDS, STATE_NAMES, TOP_FIELDS, WEIGHTS_FIELDS,
                    Reporter, check_override, check_section, check_value, combo_allowed, compile_match, join, kind,
                    normalize_fields, state_combo_problem, unknown_key)

__all__ = ["StateConfig", "WeightsConfig", "Override", "QConfig", "BitNetConfig", "DEFAULT_STATES", "STATE_NAMES",
           "make_codec"]


def _reraise(e: QConfigError, file: str, prefix: str) -> QConfigError:
    return QConfigError([dataclasses.replace(p, file=file, key_path=join(prefix, p.key_path) if p.key_path
                                             else prefix) for p in e.problems])


@functools.lru_cache(maxsize=1024)
def make_codec(bits: int, map: str, signed: bool, scale: str, group_size: int, rounding: str) -> Codec:
    """A shared :class:`~qconf.codec.Codec` per distinct description (codecs are immutable)."""
    return Codec(bits=bits, map=map, signed=signed, scale=scale, group_size=group_size, rounding=rounding)


@dataclasses.dataclass(frozen=True)
class StateConfig:
    """How one optimizer state is stored (lpmm: one ``QUANT.M`` / ``QUANT.SQM`` section).

    ``min_numel=None`` inherits :attr:`QConfig.min_numel`. See docs/config.md for every field.
    """

    enable: bool = True
    bits: int = 4
    map: str = "nonlinear"
    signed: bool = True
    scale: str = "group"
    group_size: int = 128
    rounding: str = "nearest"
    min_numel: int | None = None

    def __post_init__(self) -> None:
        rep = Reporter("<StateConfig>")
        normalize_fields(self, STATE_FIELDS, rep)
        if not rep.problems:
            msg = state_combo_problem(self.bits, self.map, self.signed)
            if msg:
                rep.add("bits", self.bits, msg, combo_allowed(self.map))
        rep.raise_if_any()

    def codec(self) -> Codec:
        """The codec this section describes (ignores ``enable`` and ``min_numel``)."""
        return make_codec(self.bits, self.map, self.signed, self.scale, self.group_size, self.rounding)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in STATE_FIELDS}


#: The default section of each state (keys: :data:`~qconf.config.rules.STATE_NAMES`): lpmm's
#: ``_C`` defaults (``QUANT.M`` and ``QUANT.SQM``). A new state section is a name there and an
#: entry here; an optimizer rule that stores it also needs a kernel slot (docs/architecture.md).
DEFAULT_STATES: Mapping[str, StateConfig] = FrozenDict({
    "exp_avg": StateConfig(),                                   # first moment / SGD momentum
    "exp_avg_sq": StateConfig(signed=False, map="power-1"),     # second moment
})
assert tuple(DEFAULT_STATES) == STATE_NAMES


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    """How low-precision (bf16/fp16) parameters receive their updates."""

    rounding: str = "nearest"       # nearest | stochastic
    compensation: str = "none"      # none | kahan
    compensation_codec: Mapping[str, Any] | None = None  # Kahan buffer codec; None = parameter dtype

    def __post_init__(self) -> None:
        rep = Reporter("<WeightsConfig>")
        for name, spec in WEIGHTS_FIELDS.items():
            checked = check_value(spec, getattr(self, name), name, rep)
            if name == "compensation_codec" and checked is not BAD:
                object.__setattr__(self, name, checked)
        rep.raise_if_any()

    def codec(self) -> "Codec | None":  # noqa: F821
        """The Codec of the Kahan compensation buffer, or None to keep it in the parameter's dtype."""
        c = self.compensation_codec
        return None if c is None else make_codec(c["bits"], c["map"], c["signed"], c["scale"], c["group_size"],
                                                  c["rounding"])

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in WEIGHTS_FIELDS}
        if out["compensation_codec"] is not None:
            out["compensation_codec"] = dict(out["compensation_codec"])
        return out


def _shape_numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _check_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, or ValueError when it is not a sequence of non-negative integers."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be a sequence of non-negative integers, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not hasattr(d, "__index__") or int(d) < 0:
            raise ValueError(f"shape must be a sequence of non-negative integers, got {shape!r}")
    return tuple(int(d) for d in dims)


@dataclasses.dataclass(frozen=True)
class Override:
    """A per-parameter exception. Selectors (all given must hold, at least one required):
    ``match`` (glob, or ``re:<regex>`` fullmatch, on the qualified name), ``ndim``, and inclusive
    ``min_numel``/``max_numel`` bounds. Actions: ``enable`` (forces every state on or off, even
    below the threshold), ``states`` (partial state fields; an ``enable`` there forces that
    state), ``weights`` (partial weights fields) and ``optimizer`` (``"muon"`` or ``"adamw"``:
    which update rule of the hybrid :class:`qconf.optim.Muon` steps the parameter; read only by
    that optimizer, see :meth:`QConfig.optimizer_route`)."""

    match: str | None = None
    ndim: int | None = None
    min_numel: int | None = None
    max_numel: int | None = None
    enable: bool | None = None
    states: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=FrozenDict)
    weights: Mapping[str, Any] = dataclasses.field(default_factory=FrozenDict)
    optimizer: str | None = None

    def __post_init__(self) -> None:
        rep = Reporter("<Override>")
        raw = {k: getattr(self, k) for k in OVERRIDE_KEYS}
        clean = check_override(raw, "", rep)
        rep.raise_if_any()
        assert clean is not None
        states = clean.get("states", {})
        object.__setattr__(self, "states", FrozenDict(
            (s, FrozenDict((f, states[s][f]) for f in OVERRIDE_STATE_FIELDS if f in states[s]))
            for s in STATE_NAMES if s in states))
        weights = clean.get("weights", {})
        object.__setattr__(self, "weights", FrozenDict((f, weights[f]) for f in WEIGHTS_FIELDS if f in weights))
        for key in ("ndim", "min_numel", "max_numel"):
            if clean.get(key) is not None:
                object.__setattr__(self, key, clean[key])
        object.__setattr__(self, "_regex", compile_match(self.match) if self.match is not None else None)

    def matches(self, name: str, shape: Sequence[int]) -> bool:
        """Whether every given selector holds for parameter ``name`` of ``shape``."""
        if self.ndim is not None and len(shape) != self.ndim:
            return False
        if self.min_numel is not None or self.max_numel is not None:
            numel = _shape_numel(shape)
            if self.min_numel is not None and numel < self.min_numel:
                return False
            if self.max_numel is not None and numel > self.max_numel:
                return False
        if self._regex is not None and self._regex.fullmatch(name) is None:
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """Plain data with only the keys that are set."""
        out: dict[str, Any] = {}
        for key in ("match", "ndim", "min_numel", "max_numel", "enable"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.states:
            out["states"] = {s: dict(f) for s, f in self.states.items()}
        if self.weights:
            out["weights"] = dict(self.weights)
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer
        return out


@dataclasses.dataclass(frozen=True)
class QConfig:
    """A validated qconfig. Build one with :func:`qconf.load_config` (file, dict) or directly.

    ``states`` always holds every name in :data:`STATE_NAMES`; when constructing directly, a
    missing state gets its :data:`DEFAULT_STATES` section and a state given as a mapping is
    applied on top of it. ``weights`` and ``bitnet`` may be mappings and ``overrides`` a list of
    mappings. ``bitnet`` (:class:`BitNetConfig`) is for :func:`qconf.nn.quantize_`; the optimizers
    ignore it.
    """

    version: int = 1
    min_numel: int = 4096
    states: Mapping[str, StateConfig] = dataclasses.field(default_factory=lambda: DEFAULT_STATES)
    weights: WeightsConfig = dataclasses.field(default_factory=WeightsConfig)
    overrides: tuple[Override, ...] = ()
    source: str | None = dataclasses.field(default=None, compare=False)
    bitnet: BitNetConfig = dataclasses.field(default_factory=BitNetConfig)

    def __post_init__(self) -> None:
        rep = Reporter("<QConfig>")
        for key, spec in TOP_FIELDS.items():
            check_value(spec, getattr(self, key), key, rep)
        states = self._normalize_states(rep)
        weights = self._normalize_section("weights", WeightsConfig, WEIGHTS_FIELDS, rep)
        overrides = self._normalize_overrides(rep)
        bitnet = self._normalize_section("bitnet", BitNetConfig, BITNET_FIELDS, rep)
        if states is not None and overrides is not None:
            for i, ov in enumerate(overrides):
                for name, fields in ov.states.items():
                    merged = {**states[name].to_dict(), **fields}
                    msg = state_combo_problem(merged["bits"], merged["map"], merged["signed"])
                    if msg:
                        rep.add(f"overrides[{i}].states.{name}", dict(fields),
                                msg + f" (combined with states.{name})", combo_allowed(merged["map"]))
        rep.raise_if_any()
        object.__setattr__(self, "states", states)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "overrides", overrides)
        object.__setattr__(self, "bitnet", bitnet)

    def _normalize_states(self, rep: Reporter) -> FrozenDict | None:
        if not isinstance(self.states, Mapping):
            rep.add("states", self.states, f"expected a mapping, got {kind(self.states)}",
                    f"a mapping with keys {', '.join(STATE_NAMES)}")
            return None
        out: dict[str, StateConfig] = {}
        for name, section in self.states.items():
            path = join("states", name)
            if name not in STATE_NAMES:
                unknown_key(rep, "states", name, STATE_NAMES, noun="state")
            elif isinstance(section, StateConfig):
                out[name] = section
            elif isinstance(section, Mapping) or section is None:
                fields = check_section(section, STATE_FIELDS, path, rep)
                try:
                    out[name] = dataclasses.replace(DEFAULT_STATES[name], **fields)
                except QConfigError as e:
                    rep.problems.extend(_reraise(e, rep.file, path).problems)
            else:
                rep.add(path, section, f"expected a StateConfig or a mapping, got {kind(section)}",
                        f"a mapping with keys {', '.join(STATE_FIELDS)}")
        if len(out) != len(self.states):
            return None
        return FrozenDict((name, out.get(name, DEFAULT_STATES[name])) for name in STATE_NAMES)

    def _normalize_section(self, key: str, cls: type, fields: Mapping[str, Any], rep: Reporter) -> Any:
        """``weights`` / ``bitnet``: an instance of ``cls`` as is, or a mapping of its fields."""
        value = getattr(self, key)
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping) or value is None:
            before = len(rep.problems)
            checked = check_section(value, fields, key, rep)
            return cls(**checked) if len(rep.problems) == before else None
        rep.add(key, value, f"expected a {cls.__name__} or a mapping, got {kind(value)}",
                f"a mapping with keys {', '.join(fields)}")
        return None

    def _normalize_overrides(self, rep: Reporter) -> tuple[Override, ...] | None:
        if self.overrides is None:
            return ()
        if isinstance(self.overrides, (str, bytes, Mapping)) or not isinstance(self.overrides, Sequence):
            rep.add("overrides", self.overrides, f"expected a list, got {kind(self.overrides)}",
                    "a list of overrides")
            return None
        out: list[Override] = []
        for i, ov in enumerate(self.overrides):
            path = f"overrides[{i}]"
            if isinstance(ov, Override):
                out.append(ov)
                continue
            clean = check_override(ov, path, rep)
            if clean is not None:
                out.append(Override(**clean))
        return tuple(out) if len(out) == len(self.overrides) else None

    def optimizer_route(self, name: str, shape: Sequence[int]) -> str | None:
        """The update rule the overrides give parameter ``name`` of ``shape`` in the hybrid
        :class:`qconf.optim.Muon` (the only reader of the ``optimizer`` action).

        Args:
            name: the parameter's qualified name (``layers.0.attn.weight``), as ``match`` sees it.
            shape: its global shape (a sequence of non-negative ints, e.g. ``torch.Size``), on which
                the ``ndim``/``min_numel``/``max_numel`` selectors are judged.

        Returns:
            The ``optimizer`` value (``"muon"`` or ``"adamw"``) of the last override that matches
            and sets ``optimizer`` (later overrides win, as for every action), or ``None`` when none
            does (the optimizer then routes the parameter by its own rule).

        Raises:
            TypeError: ``name`` is not a string. ValueError: ``shape`` is not a valid shape.
        """
        if not isinstance(name, str):
            raise TypeError(f"parameter name must be a string, got {type(name).__name__}")
        dims = _check_shape(shape)
        route = None
        for ov in self.overrides:
            if ov.optimizer is not None and ov.matches(name, dims):
                route = ov.optimizer
        return route

    def to_dict(self) -> dict[str, Any]:
        """Plain data in the full explicit native form: ``load_config(cfg.to_dict()) == cfg``.
        ``bitnet`` is there, with every field, unless it is all defaults: configs without BitNet
        (and the qconfig that optimizer checkpoints record) read exactly as before the section
        existed."""
        out = {
            "version": self.version,
            "min_numel": self.min_numel,
            "states": {name: self.states[name].to_dict() for name in STATE_NAMES},
            "weights": self.weights.to_dict(),
            "overrides": [ov.to_dict() for ov in self.overrides],
        }
        if self.bitnet != BitNetConfig():
            out["bitnet"] = self.bitnet.to_dict()
        return out

    def to_yaml(self) -> str:
        """``to_dict()`` as YAML text (keys in schema order)."""
        import yaml
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
