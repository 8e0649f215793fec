"""Problem collection and value formatting for config validation: :class:`Reporter` gathers
:class:`~qconf.errors.Problem` records (file, key path, value, what is allowed, did-you-mean), and
``join``/``fmt``/``kind``/``as_text``/``suggest`` write the one-line messages. Every check of
:mod:`qconf.config.rules` (which re-exports these names) reports through them.
"""
from __future__ import annotations

import difflib
import numbers
from typing import Any, Mapping, Sequence

from ..errors import Problem, QConfigError

__all__ = ["Reporter", "as_text", "join", "fmt", "kind", "suggest", "unknown_key"]


class Reporter:
    """Collects :class:`Problem` for one file (or one constructor call)."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []

    def add(self, key_path: str, value: Any, message: str, allowed: str = "",
            suggestion: str | None = None, line: int | None = None, column: int | None = None) -> None:
        if _huge_int(value):  # keep Problem printable: repr() of an int over 4300 digits raises
            value = as_text(value)
        self.problems.append(Problem(self.file, key_path, value, allowed, message, suggestion, line, column))

    def raise_if_any(self) -> None:
        if self.problems:
            raise QConfigError(self.problems)


def _huge_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128


def as_text(value: Any) -> str:
    """``str(value)``, except that an integer too long to print in full (Python refuses to convert
    ints over 4300 digits to text) is described by its size."""
    if _huge_int(value):
        digits = int(value.bit_length() * 0.30103) + 1  # log10(2): decimal digits of a b-bit integer
        return f"{'a negative' if value < 0 else 'an'} integer of about {digits} digits"
    return str(value)


def join(path: str, key: Any) -> str:
    """Extend a dotted key path: ``join("states", "exp_avg") == "states.exp_avg"``. Control
    characters, line breaks and lone surrogates in a key are escaped (a problem is one printable line)."""
    key = as_text(key)
    if not key.isprintable():
        key = key.encode("unicode_escape").decode("ascii")
    return f"{path}.{key}" if path else key


def fmt(value: Any, _depth: int = 0) -> str:
    """Show a value the way it is written in YAML (``true``, ``null``, ``'group'``), shortened.
    Nesting is cut at depth 3, so self-referencing YAML anchors cannot recurse forever."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = repr(value)
    elif _huge_int(value):
        text = as_text(value)
    elif isinstance(value, (Mapping, list, tuple)) and _depth >= 3:
        text = "{...}" if isinstance(value, Mapping) else "[...]"
    elif isinstance(value, Mapping):
        items = list(value.items())[:8]
        text = "{" + ", ".join(f"{fmt(k, _depth + 1)}: {fmt(v, _depth + 1)}" for k, v in items) + "}"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(fmt(v, _depth + 1) for v in list(value)[:8]) + "]"
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def kind(value: Any) -> str:
    """``'a list'``, ``'a string'``, ... for 'expected X, got Y' messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, numbers.Integral):
        return "an integer"
    if isinstance(value, numbers.Real):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"


# Spellings people carry over from lpmm or elsewhere, for did-you-mean.
_ALIASES = {
    "threshold": "min_numel", "quant_type": "map", "qmap": "map", "scale_type": "scale",
    "round_type": "rounding", "gp_sz": "group_size", "block_size": "group_size", "bit": "bits",
    "real-nearest": "nearest", "sr": "stochastic", "real-sr": "stochastic", "m": "exp_avg",
    "sqm": "exp_avg_sq", "momentum_buffer": "exp_avg", "dynamic": "nonlinear", "block": "group",
    "blockwise": "group",
}


def suggest(word: Any, candidates: Sequence[str]) -> str | None:
    """The closest candidate to a misspelled ``word`` (difflib), or None."""
    if not isinstance(word, str) or not candidates:
        return None
    lowered = {c.lower(): c for c in candidates}
    w = word.lower()
    if w in lowered and lowered[w] != word:
        return lowered[w]
    alias = _ALIASES.get(w)
    if alias in candidates and alias != word:
        return alias
    close = difflib.get_close_matches(w, list(lowered), n=1, cutoff=0.6)
    return lowered[close[0]] if close and lowered[close[0]] != word else None


def unknown_key(rep: Reporter, path: str, key: Any, allowed: Sequence[str], noun: str = "key") -> None:
    rep.add(join(path, key), key, f"unknown {noun} {fmt(key)}", ", ".join(allowed), suggest(key, allowed))
