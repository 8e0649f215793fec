"""Sweeps: ``qconf compare BASE --vary FIELD=V1,V2 [--vary ...]``.

A sweep is the cartesian product of the listed values over qconfig fields, written dotted as in
the YAML (``states.exp_avg.bits``, ``states.exp_avg_sq.map``, ``weights.rounding``, ``min_numel``,
``bitnet.activation_bits``, ``overrides[0].enable`` / ``overrides.0.states.exp_avg.bits``). Each point
is the base config with those fields set, validated as a whole config; it is named by what it
changes (``default:exp_avg.bits=3,exp_avg_sq.map=linear``: the base's label, then each field without
its ``states.`` prefix).

Everything is checked before a point is built: a field the schema does not have, an empty or
repeated value, a field given twice, and a product larger than :data:`MAX_POINTS` (without
``allow_many``) or :data:`HARD_LIMIT` (always) are :class:`~qconf.study.task.StudyError`\\ s; a value
the field rejects is one too, naming the point.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import re
from typing import Any, Sequence

from ..config import STATE_NAMES, QConfig, load_config
from ..config.bitnet import BITNET_FIELDS, BitNetConfig
from ..config.report import suggest
from ..config.rules import (CODEC_FIELDS, OVERRIDE_STATE_FIELDS, STATE_FIELDS, TOP_FIELDS, WEIGHTS_FIELDS)
from ..errors import QConfigError
from .task import StudyError

#: More points than this need ``--yes`` (``allow_many=True``): each point is ``seeds`` training runs.
MAX_POINTS = 32
#: No sweep may have more points than this, ``--yes`` or not (the points are built and validated up front).
HARD_LIMIT = 10_000

_OVERRIDE_FIELDS = ("match", "ndim", "min_numel", "max_numel", "enable")
_INDEX = re.compile(r"\[(\d+)\]")


@dataclasses.dataclass(frozen=True)
class Vary:
    """One ``--vary FIELD=V1,V2,...``: the field as a key path (``("states", "exp_avg", "bits")``,
    list indices as ints), its values parsed as YAML scalars, and the values as written (labels)."""

    path: tuple[str | int, ...]
    values: tuple[Any, ...]
    texts: tuple[str, ...]

    @property
    def field(self) -> str:
        """The dotted name as qconf writes key paths: ``states.exp_avg.bits``, ``overrides[0].enable``."""
        return _display(self.path)

    @property
    def short(self) -> str:
        """The field in point labels: without the ``states.`` prefix (state names are unique)."""
        return self.field[len("states."):] if self.path[0] == "states" else self.field


def parse_value(text: str) -> Any:
    """A value as written on the command line: ``true``/``false``, ``null``/``none``, an int, a
    float, else the string itself (``nonlinear``, ``power-1``)."""
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _split_path(field: str) -> tuple[str | int, ...]:
    """``overrides[0].states.exp_avg.bits`` or ``overrides.0.states...`` -> ``("overrides", 0, "states", ...)``."""
    parts: list[str | int] = []
    for piece in _INDEX.sub(r".\1", field).split("."):
        if not piece:
            raise StudyError(f"--vary field {field!r} is not a dotted field name (e.g. states.exp_avg.bits)")
        parts.append(int(piece) if piece.isdigit() else piece)
    return tuple(parts)


def _fields_at(path: tuple[str | int, ...], base: QConfig) -> tuple[Sequence[str], str]:
    """The field names allowed after ``path[:-1]`` (and what to call that place in messages);
    StudyError where the prefix itself is not a place in the schema."""
    head, rest = path[0], path[1:-1]
    where = ".".join(map(str, path[:-1])) or "the top level"
    if head == "states" and len(rest) == 1:
        if rest[0] not in STATE_NAMES:
            _unknown("state", rest[0], STATE_NAMES, path)
        return list(STATE_FIELDS), where
    if head == "weights" and rest == ():
        return list(WEIGHTS_FIELDS), where
    if head == "weights" and rest == ("compensation_codec",):
        return list(CODEC_FIELDS), where
    if head == "bitnet" and rest == ():
        return list(BITNET_FIELDS), where
    if head == "overrides" and rest and isinstance(rest[0], int):
        if rest[0] >= len(base.overrides):
            raise StudyError(f"--vary field {_display(path)!r}: the base config has {len(base.overrides)} override(s) "
                             f"(indices 0..{len(base.overrides) - 1})" if base.overrides else
                             f"--vary field {_display(path)!r}: the base config has no overrides")
        if len(rest) == 1:
            return list(_OVERRIDE_FIELDS), where
        if len(rest) == 3 and rest[1] == "states":
            if rest[2] not in STATE_NAMES:
                _unknown("state", rest[2], STATE_NAMES, path)
            return list(OVERRIDE_STATE_FIELDS), where
        if len(rest) == 2 and rest[1] == "weights":
            return list(WEIGHTS_FIELDS), where
    if len(path) == 1 and path[0] in TOP_FIELDS and path[0] != "version":
        return [path[0]], where
    hint = suggest(path[0], ["min_numel", "states", "weights", "bitnet", "overrides"]) if len(path) == 1 else None
    raise StudyError(f"--vary field {_display(path)!r} is not a qconfig field (allowed: min_numel, "
                     "states.<exp_avg|exp_avg_sq>.<field>, weights.<field>, weights.compensation_codec.<field>, "
                     "bitnet.<field>, overrides[<i>].<field>, overrides[<i>].states.<state>.<field>)"
                     + (f"; did you mean {hint!r}?" if hint else ""))


def _display(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _unknown(noun: str, word: Any, allowed: Sequence[str], path: tuple[str | int, ...]) -> None:
    hint = suggest(word, allowed)
    raise StudyError(f"--vary field {_display(path)!r}: unknown {noun} {str(word)!r} (allowed: {', '.join(allowed)})"
                     + (f"; did you mean {hint!r}?" if hint else ""))


def parse_vary(item: str, base: QConfig) -> Vary:
    """``"states.exp_avg.bits=3,4,5"`` -> :class:`Vary`, its field checked against the schema (and
    against ``base``'s overrides for ``overrides[i]`` fields). Values are not checked here: a point
    is checked as a whole config (:func:`expand`)."""
    field, eq, values = item.partition("=")
    field = field.strip()
    if not eq or not field:
        raise StudyError(f"--vary {item!r} is not FIELD=V1,V2,... (e.g. states.exp_avg.bits=3,4,5)")
    path = _split_path(field)
    allowed, where = _fields_at(path, base)
    if path[-1] not in allowed:
        hint = suggest(path[-1], allowed)
        raise StudyError(f"--vary field {field!r}: unknown field {str(path[-1])!r} in {where} (allowed: "
                         f"{', '.join(allowed)})" + (f"; did you mean {hint!r}?" if hint else ""))
    texts = tuple(t.strip() for t in values.split(","))
    if any(not t for t in texts):
        raise StudyError(f"--vary {item!r}: empty value (give V1,V2,... without empty items)")
    parsed = tuple(parse_value(t) for t in texts)
    for i, v in enumerate(parsed):
        if any(type(v) is type(w) and v == w for w in parsed[:i]):
            raise StudyError(f"--vary {field}: value {texts[i]!r} is listed twice")
    return Vary(path, parsed, texts)


def sweep_size(varies: Sequence[Vary]) -> int:
    """The number of points (the product of the value counts; 0 fields -> 0 points)."""
    return math.prod(len(v.values) for v in varies) if varies else 0


def check_size(varies: Sequence[Vary], seeds: int, allow_many: bool) -> None:
    """StudyError for a field given twice or a sweep that is too large (before any point is built)."""
    seen: set[tuple[str | int, ...]] = set()
    for v in varies:
        if v.path in seen:
            raise StudyError(f"--vary {v.field} is given twice (list all its values in one --vary)")
        seen.add(v.path)
    n = sweep_size(varies)
    if n > HARD_LIMIT:
        raise StudyError(f"the sweep has {n} points, more than the limit of {HARD_LIMIT} (split it into studies)")
    if n > MAX_POINTS and not allow_many:
        raise StudyError(f"the sweep has {n} points ({n * seeds} training runs with {seeds} seed(s)), more than "
                         f"{MAX_POINTS}: pass --yes to run them all")


@dataclasses.dataclass(frozen=True)
class Point:
    """One point of a sweep: its label, the fields it sets (``(short field, value text)`` pairs, in
    ``--vary`` order) and the validated config."""

    label: str
    changes: tuple[tuple[str, str], ...]
    config: QConfig


def _full_dict(cfg: QConfig) -> dict[str, Any]:
    """``cfg`` as plain data with every section present (``bitnet`` too), for setting a field."""
    data = copy.deepcopy(cfg.to_dict())
    if "bitnet" not in data:  # to_dict leaves out an all-default bitnet section
        data["bitnet"] = BitNetConfig().to_dict()
    return data


def _set(data: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    node: Any = data
    for part in path[:-1]:
        if isinstance(part, int):
            node = node[part]
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
    node[path[-1]] = value


def expand(base_label: str, base: QConfig, varies: Sequence[Vary]) -> list[Point]:
    """Every point of the sweep, in ``--vary`` order (the last field varies fastest). A point whose
    config is invalid raises StudyError naming the point and what its config breaks."""
    points = []
    template = _full_dict(base)
    for combo in itertools.product(*[list(zip(v.values, v.texts)) for v in varies]):
        data = copy.deepcopy(template)
        for v, (value, _) in zip(varies, combo):
            _set(data, v.path, value)
        changes = tuple((v.short, text) for v, (_, text) in zip(varies, combo))
        label = f"{base_label}:" + ",".join(f"{f}={t}" for f, t in changes)
        try:
            config = load_config(data)
        except QConfigError as e:
            raise StudyError(f"--vary point {label}: " + "; ".join(_problem_text(p) for p in e.problems)) from None
        points.append(Point(label, changes, config))
    return points


def _problem_text(p: Any) -> str:
    """A config problem without the ``<dict>:`` file prefix (the point is named instead)."""
    text = str(p)
    return text.split(": ", 1)[1] if text.startswith("<dict>: ") else text

