"""Reading lpmm's upper-case config format (thu-ml/low-bit-optimizers ``lpmm/configs/*.yml``).

An lpmm document is translated into a *partial* native dict holding only the keys it sets, so
that ``BASE`` files merge exactly like native ``base`` files. Mapping (lpmm -> native):

==========================================  ==========================================
``QUANT.M`` / ``QUANT.SQM``                 ``states.exp_avg`` / ``states.exp_avg_sq``
``<S>.ENABLE``                              ``states.<s>.enable``
``<S>.THRESHOLD`` (``null`` = 0)            ``states.<s>.min_numel``
``<S>.BITS`` / ``<S>.GROUP_SIZE``           ``states.<s>.bits`` / ``states.<s>.group_size``
``<S>.SCALE_TYPE.DEFAULT``                  ``states.<s>.scale``
``<S>.QUANT_TYPE.DEFAULT``                  ``states.<s>.map``
``<S>.ROUND_TYPE`` real-nearest|nearest     ``states.<s>.rounding: nearest``
``<S>.ROUND_TYPE`` real-sr|sr               ``states.<s>.rounding: stochastic``
``<S>.SIGNED``                              ``states.<s>.signed``
``BASE`` (list; ``''`` entries ignored)     ``base``
==========================================  ==========================================

Keys lpmm itself never reads are accepted and reported in one warning per file; lpmm values
qconf does not implement (scale types ``dim01 dim10 rank1-group id``, simulation rounding modes
``sr1 sr2 up down``) are errors.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..codec import SCALE_TYPES
from .rules import BAD, MAX_NUMEL, STATE_FIELDS, Reporter, Spec, check_value, fmt, join, kind, suggest, unknown_key

__all__ = ["LPMM_SECTIONS", "is_upper_key", "lpmm_to_native"]

#: lpmm ``QUANT`` section -> qconf state.
LPMM_SECTIONS = {"M": "exp_avg", "SQM": "exp_avg_sq"}

_TOP_KEYS = ("QUANT", "BASE")
_TOP_IGNORED = ("DEBUG", "INIT_STATES", "TRAIN", "TAG", "LOCAL_RANK", "OUTPUT")
_QUANT_IGNORED = ("P", "G")
_SECTION_SCALARS = {  # lpmm key -> native field
    "ENABLE": "enable", "BITS": "bits", "GROUP_SIZE": "group_size", "SIGNED": "signed",
}
_SECTION_KEYS = ("ENABLE", "THRESHOLD", "BITS", "GROUP_SIZE", "SCALE_TYPE", "QUANT_TYPE", "ROUND_TYPE",
                 "SIGNED", "EXCLUDE_SUFFIX", "EXCLUDE_REGEX")
_SECTION_IGNORED = ("EXCLUDE_SUFFIX", "EXCLUDE_REGEX")
_TYPE_KEYS = ("DEFAULT", "DEFAULT_ONLY")

ROUND_TYPES = {"real-nearest": "nearest", "nearest": "nearest", "real-sr": "stochastic", "sr": "stochastic"}
_ROUND_SIMULATION = ("sr1", "sr2", "up", "down")
_SCALE_UNSUPPORTED = ("dim01", "dim10", "rank1-group", "id")
_THRESHOLD = Spec("int", 0, MAX_NUMEL, nullable=True)


def is_upper_key(key: Any) -> bool:
    """An lpmm-style key: a string with letters, all upper case (``QUANT``, ``LOCAL_RANK``)."""
    return isinstance(key, str) and key.isupper()


def lpmm_to_native(raw: Mapping[Any, Any], rep: Reporter) -> tuple[dict[str, Any], list[str]]:
    """Translate one lpmm document; return ``(partial native dict, ignored key paths)``.

    Problems are reported under lpmm's own key paths (``QUANT.SQM.BITS``). ``base`` in the
    result is a list of ``(path, key_path)`` pairs.
    """
    out: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in raw.items():
        if key == "QUANT":
            states = _quant(value, "QUANT", rep, ignored)
            if states:
                out["states"] = states
        elif key == "BASE":
            out["base"] = _base(value, rep)
        elif key in _TOP_IGNORED:
            ignored.append(key)
        else:
            unknown_key(rep, "", key, _TOP_KEYS + _TOP_IGNORED)
    return out, ignored


def _base(value: Any, rep: Reporter) -> list[tuple[str, str]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [(value, "BASE")] if value else []
    if not isinstance(value, (list, tuple)):
        rep.add("BASE", value, f"expected a list of paths, got {kind(value)} {fmt(value)}", "a list of YAML paths")
        return []
    entries = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            rep.add(f"BASE[{i}]", item, f"{fmt(item)} is not a path string", "a YAML path relative to this file")
        elif item:  # lpmm's default BASE is [''], meaning "no base"
            entries.append((item, f"BASE[{i}]"))
    return entries


def _quant(value: Any, path: str, rep: Reporter, ignored: list[str]) -> dict[str, dict[str, Any]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        rep.add(path, value, f"expected a mapping, got {kind(value)} {fmt(value)}",
                "a mapping with keys " + ", ".join(list(LPMM_SECTIONS) + list(_QUANT_IGNORED)))
        return {}
    states: dict[str, dict[str, Any]] = {}
    for key, section in value.items():
        p = join(path, key)
        if key in LPMM_SECTIONS:
            fields = _section(section, p, rep, ignored)
            if fields:
                states[LPMM_SECTIONS[key]] = fields
        elif key in _QUANT_IGNORED:
            ignored.append(p)
        else:
            unknown_key(rep, path, key, tuple(LPMM_SECTIONS) + _QUANT_IGNORED)
    return states


def _section(value: Any, path: str, rep: Reporter, ignored: list[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        rep.add(path, value, f"expected a mapping, got {kind(value)} {fmt(value)}",
                "a mapping with keys " + ", ".join(_SECTION_KEYS))
        return {}
    out: dict[str, Any] = {}
    for key, item in value.items():
        p = join(path, key)
        if key in _SECTION_SCALARS:
            field = _SECTION_SCALARS[key]
            checked = check_value(STATE_FIELDS[field], item, p, rep)
            if checked is not BAD:
                out[field] = checked
        elif key == "THRESHOLD":
            checked = check_value(_THRESHOLD, item, p, rep)
            if checked is not BAD:
                out["min_numel"] = 0 if checked is None else checked  # yacs lets null disable it
        elif key == "SCALE_TYPE":
            scale = _typed_default(item, p, rep, ignored, _scale_type)
            if scale is not BAD:
                out["scale"] = scale
        elif key == "QUANT_TYPE":
            qmap = _typed_default(item, p, rep, ignored, _quant_type)
            if qmap is not BAD:
                out["map"] = qmap
        elif key == "ROUND_TYPE":
            rounding = _round_type(item, p, rep)
            if rounding is not BAD:
                out["rounding"] = rounding
        elif key in _SECTION_IGNORED:
            ignored.append(p)
        else:
            unknown_key(rep, path, key, _SECTION_KEYS)
    return out


def _typed_default(value: Any, path: str, rep: Reporter, ignored: list[str], convert) -> Any:
    """``SCALE_TYPE`` / ``QUANT_TYPE``: a mapping whose ``DEFAULT`` holds the value."""
    if not isinstance(value, Mapping):
        rep.add(path, value, f"expected a mapping, got {kind(value)} {fmt(value)}",
                "a mapping like {DEFAULT: ...} (lpmm's format)")
        return BAD
    result: Any = BAD
    for key, item in value.items():
        p = join(path, key)
        if key == "DEFAULT":
            result = convert(item, p, rep)
        elif key == "DEFAULT_ONLY":
            ignored.append(p)
        else:
            unknown_key(rep, path, key, _TYPE_KEYS)
    return result


def _scale_type(value: Any, path: str, rep: Reporter) -> Any:
    allowed = ", ".join(SCALE_TYPES)
    if not isinstance(value, str):
        rep.add(path, value, f"{fmt(value)} is not a string", allowed)
        return BAD
    if value in _SCALE_UNSUPPORTED:
        rep.add(path, value, f"lpmm scale type {value!r} is not supported by qconf", allowed)
        return BAD
    if value not in SCALE_TYPES:
        rep.add(path, value, f"{fmt(value)} is not a valid scale type", allowed,
                suggest(value, tuple(SCALE_TYPES) + _SCALE_UNSUPPORTED))
        return BAD
    return value


def _quant_type(value: Any, path: str, rep: Reporter) -> Any:
    return check_value(STATE_FIELDS["map"], value, path, rep)


def _round_type(value: Any, path: str, rep: Reporter) -> Any:
    allowed = ", ".join(ROUND_TYPES)
    if not isinstance(value, str):
        rep.add(path, value, f"{fmt(value)} is not a string", allowed)
        return BAD
    if value in _ROUND_SIMULATION:
        rep.add(path, value, f"ROUND_TYPE {value!r} is an lpmm simulation mode (unpacked codes, no memory "
                "saving) that qconf does not support", allowed)
        return BAD
    if value not in ROUND_TYPES:
        rep.add(path, value, f"{fmt(value)} is not a valid ROUND_TYPE", allowed,
                suggest(value, tuple(ROUND_TYPES) + _ROUND_SIMULATION))
        return BAD
    return ROUND_TYPES[value]
