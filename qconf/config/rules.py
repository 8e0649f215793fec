"""The validation rules of the native qconfig schema: one :class:`Spec` per scalar field, the
checks of every section (``states``, ``weights``, ``overrides``, ``bitnet``, codec sections,
``match`` selectors); the problem reporting they share is :mod:`qconf.config.report` (re-exported here).

Each check appends :class:`~qconf.errors.Problem` records (file, key path, bad value, what is
allowed, did-you-mean) to a :class:`Reporter` and returns the valid part, or :data:`BAD`. The YAML
loader (:mod:`qconf.config.loader`, :mod:`qconf.config.lpmm`) and the dataclass constructors
(:mod:`qconf.config.model`) use the same rules, so a value rejected in a file is also rejected
from Python.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import numbers
import re
from typing import Any, Mapping

from ..codec import MAP_NAMES, ROUNDING_MODES, SCALE_TYPES
from .frozen import FrozenDict
from .report import Reporter, as_text, fmt, join, kind, suggest, unknown_key

__all__ = [
    "BAD", "Reporter", "Spec", "join", "fmt", "kind", "suggest", "unknown_key", "check_value", "check_section",
    "check_states", "check_codec", "check_override", "check_match", "check_selectors", "compile_match",
    "state_combo_problem",
    "STATE_NAMES", "STATE_FIELDS", "OVERRIDE_STATE_FIELDS", "CODEC_FIELDS", "WEIGHTS_FIELDS", "TOP_FIELDS",
    "TOP_KEYS", "SELECTOR_FIELDS", "OVERRIDE_SELECTORS", "OVERRIDE_ACTIONS", "OVERRIDE_KEYS", "OPTIMIZER_ROUTES",
    "OPTIMIZER_ROUTE", "MAX_GROUP_SIZE", "MAX_NUMEL", "MAX_NDIM", "MAX_MATCH_CHARS", "as_text",
]

#: The optimizer-state sections of a qconfig (their defaults: :data:`qconf.config.model.DEFAULT_STATES`).
STATE_NAMES: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

# Upper bounds of the integer fields, so that no config value can overflow or allocate at the first step.
#: A group is padded to whole blocks on the reference path (up to ``group_size - 1`` extra elements per
#: tensor, 64 MiB of fp32 at 2^24) and its block count is int64 arithmetic in the kernels; a larger group
#: than any tensor is ``scale: tensor``.
MAX_GROUP_SIZE = 1 << 24
#: A tensor's numel is an int64 in torch, so a numel threshold or bound beyond it is meaningless.
MAX_NUMEL = (1 << 63) - 1
#: An ``ndim`` selector: far more dimensions than any real parameter has.
MAX_NDIM = 64


# ---------------------------------------------------------------------------------------------
# Field rules
# ---------------------------------------------------------------------------------------------
BAD = object()  #: what a check returns for an invalid value (after reporting it)


@dataclasses.dataclass(frozen=True)
class Spec:
    """The rule for one scalar field: a boolean, a bounded integer, or one of a set of strings."""

    kind: str                       # "bool" | "int" | "float" | "enum" | "codec" (a nested codec section)
    lo: int | float | None = None   # | "selectors" (a list of match patterns, at least ``lo`` of them)
    hi: int | float | None = None
    choices: tuple[str, ...] = ()
    nullable: bool = False
    noun: str = "value"             # enum messages: "'grop' is not a valid scale type"
    note: str = ""                  # why the bounds are what they are, appended to allowed()

    def allowed(self) -> str:
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "int":
            if self.lo is not None and self.lo == self.hi:
                text = str(self.lo)
            elif self.hi is not None:
                text = f"integer {self.lo}..{_bound(self.hi)}"
            else:
                text = f"integer >= {self.lo}"
        elif self.kind == "float":
            text = f"a number {self.lo:g}..{self.hi:g}"
        elif self.kind == "selectors":
            count = "one or more" if self.lo else "zero or more"
            text = f"a list of {count} globs or 're:<regex>' patterns on qualified names"
        elif self.kind == "codec":
            text = f"a mapping with keys {', '.join(CODEC_FIELDS)} (scale group)"
        else:
            text = ", ".join(self.choices)
        return text + (" or null" if self.nullable else "") + (f"; {self.note}" if self.note else "")


def _bound(n: int) -> str:
    """A large bound with its power of two: ``16777216 = 2^24``, ``... = 2^63-1``."""
    if n >= 1 << 20 and n & (n - 1) == 0:
        return f"{n} = 2^{n.bit_length() - 1}"
    if n >= 1 << 20 and (n + 1) & n == 0:
        return f"{n} = 2^{n.bit_length()}-1"
    return str(n)


def normalize_fields(obj: Any, fields: Mapping[str, Spec], rep: Reporter) -> None:
    """Check each of a frozen dataclass's ``fields`` (name -> Spec) and store its normalized value
    in place; invalid ones are reported to ``rep`` and left as they are."""
    for name, spec in fields.items():
        value = check_value(spec, getattr(obj, name), name, rep)
        if value is not BAD:
            object.__setattr__(obj, name, value)


def check_value(spec: Spec, value: Any, path: str, rep: Reporter) -> Any:
    """Return the (normalized) value, or ``BAD`` after reporting why it is invalid."""
    if value is None and spec.nullable:
        return None
    if spec.kind == "codec":
        return check_codec(value, path, rep)
    if spec.kind == "selectors":
        return check_selectors(spec, value, path, rep)
    if spec.kind == "float":
        return _check_float(spec, value, path, rep)
    if spec.kind == "bool":
        if not isinstance(value, bool):
            rep.add(path, value, f"{fmt(value)} is not a boolean", spec.allowed())
            return BAD
        return value
    if spec.kind == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            rep.add(path, value, f"{fmt(value)} is not an integer", spec.allowed())
            return BAD
        value = int(value)
        if (spec.lo is not None and value < spec.lo) or (spec.hi is not None and value > spec.hi):
            what = "is not supported" if spec.lo == spec.hi else "is out of range"
            rep.add(path, value, f"{as_text(value)} {what}", spec.allowed())
            return BAD
        return value
    if not isinstance(value, str):
        rep.add(path, value, f"{fmt(value)} is not a string", spec.allowed())
        return BAD
    if value not in spec.choices:
        rep.add(path, value, f"{fmt(value)} is not a valid {spec.noun}", spec.allowed(), suggest(value, spec.choices))
        return BAD
    return value


def _check_float(spec: Spec, value: Any, path: str, rep: Reporter) -> Any:
    """A real number (an integer too; not a bool) within ``[lo, hi]``, returned as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = " (YAML reads a number without a dot, such as 1e-5, as text: write 1.0e-5)" \
            if isinstance(value, str) and re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", value) else ""
        rep.add(path, value, f"{fmt(value)} is not a number{hint}", spec.allowed())
        return BAD
    if not spec.lo <= value <= spec.hi:  # NaN fails both comparisons
        rep.add(path, value, f"{as_text(value)} is out of range", spec.allowed())
        return BAD
    return float(value)


def check_selectors(spec: Spec, value: Any, path: str, rep: Reporter) -> Any:
    """A list of ``match`` patterns (:func:`check_match` each), at least ``spec.lo`` of them; a tuple."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        rep.add(path, value, f"expected a list, got {kind(value)} {fmt(value)}", spec.allowed())
        return BAD
    if len(value) < (spec.lo or 0):
        rep.add(path, value, "empty list (selects nothing)", spec.allowed())
        return BAD
    checked = [check_match(v, f"{path}[{i}]", rep) for i, v in enumerate(value)]
    return BAD if any(c is BAD for c in checked) else tuple(checked)


WEIGHT_ROUNDING = ("nearest", "stochastic")
WEIGHT_COMPENSATION = ("none", "kahan")

#: Rules for the fields of a state section (``states.<name>``), in dataclass order.
STATE_FIELDS: Mapping[str, Spec] = FrozenDict({
    "enable": Spec("bool"),
    "bits": Spec("int", 1, 8),
    "map": Spec("enum", choices=tuple(MAP_NAMES), noun="map"),
    "signed": Spec("bool"),
    "scale": Spec("enum", choices=tuple(SCALE_TYPES), noun="scale type"),
    "group_size": Spec("int", 1, MAX_GROUP_SIZE, note="for one scale per tensor use scale: tensor"),
    "rounding": Spec("enum", choices=tuple(ROUNDING_MODES), noun="rounding mode"),
    "min_numel": Spec("int", 0, MAX_NUMEL, nullable=True),
})
#: Fields an override may set for a state (``min_numel`` is a selector of the override instead).
OVERRIDE_STATE_FIELDS: Mapping[str, Spec] = FrozenDict(
    {k: v for k, v in STATE_FIELDS.items() if k != "min_numel"})
#: Fields of a codec section without a state's enable/threshold (the Kahan buffer's codec).
CODEC_FIELDS: Mapping[str, Spec] = FrozenDict(  # (no 'scale: tensor' hint: this codec must use group scales)
    {k: dataclasses.replace(v, note="") for k, v in STATE_FIELDS.items() if k not in ("enable", "min_numel")})
MAX_COMPENSATION_GROUP = 16384  # the kernels quantize the buffer within one tile (csrc/cpu/step.cpp)
#: Defaults of ``weights.compensation_codec`` fields the user leaves out: 8-bit signed blockwise.
COMPENSATION_CODEC_DEFAULTS: Mapping[str, Any] = FrozenDict(
    bits=8, map="nonlinear", signed=True, scale="group", group_size=128, rounding="nearest")
#: Rules for ``weights``.
WEIGHTS_FIELDS: Mapping[str, Spec] = FrozenDict({
    "rounding": Spec("enum", choices=WEIGHT_ROUNDING, noun="weights rounding mode"),
    "compensation": Spec("enum", choices=WEIGHT_COMPENSATION, noun="compensation"),
    "compensation_codec": Spec("codec", nullable=True),
})


def check_codec(raw: Any, path: str, rep: Reporter) -> Any:
    """Validate a codec section (``weights.compensation_codec``); return it complete (defaults
    filled in) as a FrozenDict, or ``BAD``. The Kahan buffer is quantized block by block in the
    same pass as the parameter, so only group scales with blocks that fit a kernel tile are allowed."""
    if not isinstance(raw, Mapping):
        rep.add(path, raw, f"expected a mapping of codec fields, got {kind(raw)} {fmt(raw)}",
                Spec("codec", nullable=True).allowed())
        return BAD
    before = len(rep.problems)
    fields = check_section(raw, CODEC_FIELDS, path, rep)
    if len(rep.problems) != before:
        return BAD
    merged = {**COMPENSATION_CODEC_DEFAULTS, **fields}
    combo = state_combo_problem(merged["bits"], merged["map"], merged["signed"])
    if combo:
        rep.add(path, dict(raw), combo, combo_allowed(merged["map"]))
        return BAD
    if merged["scale"] != "group":
        rep.add(join(path, "scale"), merged["scale"], f"{fmt(merged['scale'])} is not supported for the "
                "compensation buffer (it is quantized block by block in the same pass as the parameter)", "group")
        return BAD
    if merged["group_size"] > MAX_COMPENSATION_GROUP:
        rep.add(join(path, "group_size"), merged["group_size"], f"{merged['group_size']} is too large for the "
                "compensation buffer (a block must fit one kernel tile)", f"integer 1..{MAX_COMPENSATION_GROUP}")
        return BAD
    return FrozenDict(merged)
#: Rules for the scalar top-level keys.
TOP_FIELDS: Mapping[str, Spec] = FrozenDict({
    "version": Spec("int", 1, 1),
    "min_numel": Spec("int", 0, MAX_NUMEL),
})
TOP_KEYS = ("version", "base", "min_numel", "states", "weights", "overrides", "bitnet")
SELECTOR_FIELDS: Mapping[str, Spec] = FrozenDict({
    "ndim": Spec("int", 0, MAX_NDIM),
    "min_numel": Spec("int", 0, MAX_NUMEL),
    "max_numel": Spec("int", 0, MAX_NUMEL),
})
OVERRIDE_SELECTORS = ("match", "ndim", "min_numel", "max_numel")
OVERRIDE_ACTIONS = ("enable", "states", "weights", "optimizer")
#: Values of an override's ``optimizer`` action: which update rule of the hybrid :class:`qconf.optim.Muon`
#: steps the parameter (Muon, for a 2-D matrix, or the hybrid's AdamW part). Other optimizers ignore it.
OPTIMIZER_ROUTES: tuple[str, ...] = ("muon", "adamw")
#: The rule for an override's ``optimizer``.
OPTIMIZER_ROUTE = Spec("enum", choices=OPTIMIZER_ROUTES, noun="update rule for qconf.optim.Muon")
OVERRIDE_KEYS = OVERRIDE_SELECTORS + OVERRIDE_ACTIONS
MATCH_ALLOWED = "an fnmatch glob on the qualified name such as '*.bias', or 're:<regex>'"
#: A ``match`` pattern is compiled to a regex on load (Python's re: ~40 us a character); names are far shorter.
MAX_MATCH_CHARS = 2000


def check_section(raw: Any, fields: Mapping[str, Spec], path: str, rep: Reporter) -> dict[str, Any]:
    """Validate a mapping of scalar fields; return the valid ones (problems go to ``rep``).
    ``None`` (an empty YAML section) is an empty mapping."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        rep.add(path, raw, f"expected a mapping, got {kind(raw)} {fmt(raw)}",
                f"a mapping with keys {', '.join(fields)}")
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            if key == "min_numel" and fields is OVERRIDE_STATE_FIELDS:
                rep.add(join(path, key), value, "min_numel cannot be set for a state inside an override; "
                        "select parameters with the override's min_numel/max_numel and set enable instead",
                        ", ".join(fields))
            else:
                unknown_key(rep, path, key, list(fields))
            continue
        checked = check_value(fields[key], value, join(path, key), rep)
        if checked is not BAD:
            out[key] = checked
    return out


def state_combo_problem(bits: Any, map: Any, signed: Any) -> str | None:
    """Cross-field rules of a state: the signed linear map needs 2 bits (1 bit leaves only 0); the
    ternary map (-1, 0, +1) is exactly bits 2, signed. Fields not given (None) are not judged."""
    if map == "linear" and signed is True and bits == 1:
        return "map 'linear' with signed: true needs bits >= 2 (1 bit leaves only the level 0)"
    if map == "ternary" and ((bits is not None and bits != 2) or signed is False):
        return (f"map 'ternary' (levels -1, 0, +1 in 2-bit codes) needs bits: 2 and signed: true, got bits: "
                f"{fmt(bits)}, signed: {fmt(signed)}; for other widths use map 'linear'")
    return None


def combo_allowed(map: Any) -> str:
    """What :func:`state_combo_problem` allows, for a problem's ``allowed`` text."""
    return "bits: 2 and signed: true for map 'ternary'" if map == "ternary" else "bits 2..8, or signed: false"


def check_states(raw: Any, path: str, rep: Reporter, *, fields: Mapping[str, Spec] = STATE_FIELDS
                 ) -> dict[str, dict[str, Any]]:
    """Validate ``states`` (state name -> partial section); return the valid partial sections."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        rep.add(path, raw, f"expected a mapping of state name to settings, got {kind(raw)} {fmt(raw)}",
                f"a mapping with keys {', '.join(STATE_NAMES)}")
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, section in raw.items():
        if name not in STATE_NAMES:
            unknown_key(rep, path, name, STATE_NAMES, noun="state")
            continue
        out[name] = check_section(section, fields, join(path, name), rep)
    return out


def _glob_problem(pattern: str) -> str | None:
    """fnmatch takes any string, but an unclosed ``[`` (silently literal) is always a typo here."""
    if not pattern:
        return "empty pattern"
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            close = pattern.find("]", j)
            if close < 0:
                return f"unclosed '[' at position {i} in glob {pattern!r} (write '[[]' for a literal '[')"
            i = close + 1
        else:
            i += 1
    return None


def compile_match(pattern: str) -> re.Pattern[str]:
    """The compiled regex for a ``match`` selector; use ``.fullmatch(name)``.
    Globs follow :func:`fnmatch.fnmatchcase` (case-sensitive, ``*`` also matches dots)."""
    if pattern.startswith("re:"):
        return re.compile(pattern[3:])
    return re.compile(fnmatch.translate(pattern))


def check_match(value: Any, path: str, rep: Reporter) -> Any:
    if not isinstance(value, str):
        rep.add(path, value, f"{fmt(value)} is not a string", MATCH_ALLOWED)
        return BAD
    if len(value) > MAX_MATCH_CHARS:
        rep.add(path, value, f"pattern of {len(value)} characters is too long",
                f"{MATCH_ALLOWED}, at most {MAX_MATCH_CHARS} characters")
        return BAD
    if value.startswith("re:"):
        regex = value[3:]
        if not regex:
            rep.add(path, value, "empty regex after 're:'", MATCH_ALLOWED)
            return BAD
        try:
            re.compile(regex)
        except (re.error, OverflowError, ValueError, RecursionError) as e:
            rep.add(path, value, f"regex {regex!r} does not compile: {e}", "a valid Python regular expression")
            return BAD
        return value
    problem = _glob_problem(value)
    if problem:
        rep.add(path, value, problem, MATCH_ALLOWED)
        return BAD
    return value


def check_override(raw: Any, path: str, rep: Reporter) -> dict[str, Any] | None:
    """Validate one override; return its cleaned fields (``None`` values dropped), or None if it
    has any problem."""
    before = len(rep.problems)
    if not isinstance(raw, Mapping):
        rep.add(path, raw, f"expected a mapping, got {kind(raw)} {fmt(raw)}",
                f"a mapping with selectors ({', '.join(OVERRIDE_SELECTORS)}) "
                f"and actions ({', '.join(OVERRIDE_ACTIONS)})")
        return None
    out: dict[str, Any] = {}
    for key, value in raw.items():
        p = join(path, key)
        if key not in OVERRIDE_KEYS:
            unknown_key(rep, path, key, OVERRIDE_KEYS)
        elif value is None:
            continue  # null = not given
        elif key == "match":
            checked = check_match(value, p, rep)
            if checked is not BAD:
                out[key] = checked
        elif key == "enable":
            checked = check_value(STATE_FIELDS["enable"], value, p, rep)
            if checked is not BAD:
                out[key] = checked
        elif key == "optimizer":
            checked = check_value(OPTIMIZER_ROUTE, value, p, rep)
            if checked is not BAD:
                out[key] = checked
        elif key in SELECTOR_FIELDS:
            checked = check_value(SELECTOR_FIELDS[key], value, p, rep)
            if checked is not BAD:
                out[key] = checked
        elif key == "states":
            states = check_states(value, p, rep, fields=OVERRIDE_STATE_FIELDS)
            for name, fields in states.items():
                msg = state_combo_problem(fields.get("bits"), fields.get("map"), fields.get("signed"))
                if msg:
                    rep.add(join(p, name), fields, msg, combo_allowed(fields.get("map")))
            out[key] = {name: fields for name, fields in states.items() if fields}
        else:  # weights
            out[key] = check_section(value, WEIGHTS_FIELDS, p, rep)
    if not any(raw.get(k) is not None for k in OVERRIDE_SELECTORS):
        rep.add(path, raw, "override has no selector", f"at least one of {', '.join(OVERRIDE_SELECTORS)}")
    lo, hi = out.get("min_numel"), out.get("max_numel")
    if lo is not None and hi is not None and lo > hi:
        rep.add(join(path, "min_numel"), lo, f"min_numel {lo} is greater than max_numel {hi} (matches nothing)",
                "min_numel <= max_numel")
    has_action = (raw.get("enable") is not None or any(_nonempty(v) for v in _values(raw.get("states")))
                  or _nonempty(raw.get("weights")) or raw.get("optimizer") is not None)
    if not has_action:
        rep.add(path, raw, "override has no action (it would change nothing)",
                f"at least one of {', '.join(OVERRIDE_ACTIONS)}")
    return out if len(rep.problems) == before else None


def _values(x: Any) -> list[Any]:
    return list(x.values()) if isinstance(x, Mapping) else ([x] if x is not None else [])


def _nonempty(x: Any) -> bool:
    return x is not None and not (isinstance(x, Mapping) and len(x) == 0)
