"""Per-parameter resolution: which codec (or none) each optimizer state of a parameter gets.

For one state of a parameter ``(name, shape)`` with ``numel = prod(shape)``:

1. Start from ``cfg.states[state]``. The threshold is that section's ``min_numel``, or the
   top-level ``min_numel`` when it is null. ``quantized = enable and numel > threshold``
   (strict, on the global parameter size, like lpmm's ``THRESHOLD``).
2. For each override, in order, whose selectors all hold:
   ``enable`` (if given) sets ``quantized`` (forcing, in both directions, even below the
   threshold -- lpmm's ``override_quantize_enable``); ``states[state]`` replaces fields of the
   section, and an ``enable`` there again sets ``quantized`` for that state; ``weights``
   replaces fields of the weights config. Later overrides win. (An override's ``optimizer``
   plays no part in the plan: :meth:`~qconf.config.model.QConfig.optimizer_route` reads it.)
3. A quantized state gets ``Codec(bits, map, signed, scale, group_size, rounding)``; a 0-d
   parameter with scale ``dim0``/``dim1`` uses ``tensor`` (one scale, the same thing). An
   unquantized state is ``None`` (kept in fp32).

A run-time ``force_enable`` (the optimizer's ``override_quantize_enable``) is applied last and
sets ``quantized`` for every state.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from ..codec import Codec
from ..errors import Problem, QConfigError
from .frozen import FrozenDict
from .model import STATE_NAMES, QConfig, WeightsConfig, _check_shape, make_codec

__all__ = ["StatePlan", "resolve_plan", "describe_codec"]

_FP32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """The resolved storage of every optimizer state of one parameter.

    ``codecs[state]`` is the :class:`~qconf.codec.Codec` of a quantized state, or ``None`` for a
    state kept in full precision (fp32).
    """

    name: str
    shape: tuple[int, ...]
    codecs: Mapping[str, Codec | None]
    weights: WeightsConfig

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _check_shape(self.shape))
        object.__setattr__(self, "codecs", FrozenDict(self.codecs))

    def codec(self, state: str) -> Codec | None:
        """The codec of ``state``, or ``None`` when it stays fp32."""
        try:
            return self.codecs[state]
        except KeyError:
            raise ValueError(f"unknown state {state!r}; states: {', '.join(self.codecs)}") from None

    def quantized(self, state: str) -> bool:
        return self.codec(state) is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def state_nbytes(self, state: str) -> int:
        """Bytes ``state`` occupies: packed codes + scales, or ``4 * numel`` in fp32."""
        codec = self.codec(state)
        return _FP32_BYTES * self.numel if codec is None else codec.nbytes(self.shape)

    def fp32_nbytes(self) -> int:
        """The fp32 equivalent of one state, ``4 * numel``."""
        return _FP32_BYTES * self.numel

    def nbytes(self) -> int:
        """Bytes of all states together."""
        return sum(self.state_nbytes(s) for s in self.codecs)

    def describe(self, state: str) -> str:
        """Short text such as ``'4-bit nonlinear group128'`` or ``'fp32'``."""
        codec = self.codec(state)
        return "fp32" if codec is None else describe_codec(codec, self.shape)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for ``--json`` and logs)."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "numel": self.numel,
            "states": {
                s: {
                    "quantized": c is not None,
                    "codec": None if c is None else c.to_dict(),
                    "description": self.describe(s),
                    "nbytes": self.state_nbytes(s),
                }
                for s, c in self.codecs.items()
            },
            "weights": self.weights.to_dict(),
            "nbytes": self.nbytes(),
            "fp32_nbytes": self.fp32_nbytes() * len(self.codecs),
        }


def describe_codec(codec: Codec, shape: Sequence[int]) -> str:
    """``'4-bit nonlinear group128'``, ``'4-bit unsigned power-1 rank1'``: the effective scale for
    ``shape`` (e.g. a 1-D ``rank1`` shows as ``group<N>``)."""
    scale = codec.effective_scale(tuple(shape))
    parts = [f"{codec.bits}-bit"]
    if not codec.signed:
        parts.append("unsigned")
    parts.append(codec.map)
    parts.append(f"group{codec.group_size}" if scale == "group" else scale)
    if codec.rounding != "nearest":
        parts.append(codec.rounding)
    return " ".join(parts)


def resolve_plan(cfg: QConfig, name: str, shape: Sequence[int], *, force_enable: bool | None = None) -> StatePlan:
    """Resolve ``cfg`` for parameter ``name`` of ``shape`` (see the module docstring).

    ``force_enable`` is a run-time decision (lpmm's ``override_quantize_enable``) applied after
    all overrides: when not None it sets whether every state is quantized."""
    if not isinstance(name, str):
        raise TypeError(f"parameter name must be a string, got {type(name).__name__}")
    if force_enable is not None and not isinstance(force_enable, bool):
        raise TypeError(f"force_enable must be True, False or None, got {force_enable!r}")
    dims = _check_shape(shape)
    numel = math.prod(dims)
    hits = [ov for ov in cfg.overrides if ov.matches(name, dims)]

    weights = cfg.weights
    for ov in hits:
        if ov.weights:
            weights = dataclasses.replace(weights, **ov.weights)

    codecs: dict[str, Codec | None] = {}
    for state in STATE_NAMES:
        section = cfg.states[state]
        threshold = section.min_numel if section.min_numel is not None else cfg.min_numel
        quantized = section.enable and numel > threshold
        fields: dict[str, Any] = {}
        for ov in hits:
            if ov.enable is not None:
                quantized = ov.enable
            changes = ov.states.get(state)
            if changes:
                fields.update((k, v) for k, v in changes.items() if k != "enable")
                if "enable" in changes:
                    quantized = changes["enable"]
        if force_enable is not None:
            quantized = force_enable
        if not quantized:
            codecs[state] = None
            continue
        bits, qmap, signed = (fields.get("bits", section.bits), fields.get("map", section.map),
                              fields.get("signed", section.signed))
        scale = fields.get("scale", section.scale)
        if len(dims) == 0 and scale in ("dim0", "dim1"):
            scale = "tensor"
        try:
            codecs[state] = make_codec(bits, qmap, signed, scale, fields.get("group_size", section.group_size),
                                       fields.get("rounding", section.rounding))
        except ValueError as e:  # only cross-field combinations spread over several overrides get here
            raise QConfigError(Problem(cfg.source or "<QConfig>", f"states.{state}", fields, "",
                                       f"overrides resolve to an invalid codec for parameter {name!r}: {e}")) from None
    return StatePlan(name, dims, codecs, weights)
