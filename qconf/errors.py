"""Errors and warnings raised while loading a qconfig.

Every malformed config raises :class:`QConfigError` (a ``ValueError``). It carries the list of
:class:`Problem` found -- all of them, not just the first -- and its message is one line per
problem::

    configs/x.yml: states.exp_avg_sq.bits: 9 is out of range (allowed: integer 1..8)
    configs/x.yml: states.exp_avg.grop_size: unknown key 'grop_size' (allowed: ...); did you mean 'group_size'?
    configs/x.yml:4:9: YAML syntax error: mapping values are not allowed here
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

__all__ = ["Problem", "QConfigError", "QConfigWarning"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a config.

    Attributes:
        file: the file the problem is in (as given or resolved), or ``"<dict>"`` for a dict.
        key_path: dotted path of the offending key, list items as ``overrides[2].match``;
            ``""`` when the problem concerns the whole document.
        value: the offending value (or key, for an unknown key).
        allowed: human-readable description of what is allowed (may be ``""``).
        message: what is wrong, e.g. ``"9 is out of range"``.
        suggestion: closest valid spelling for a typo, or ``None``.
        line, column: 1-based position in the file when known (YAML-level problems).
    """

    file: str
    key_path: str
    value: Any
    allowed: str
    message: str
    suggestion: str | None = None
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}" + (f":{self.column}" if self.column is not None else "")
        text = f"{where}: "
        if self.key_path:
            text += f"{self.key_path}: "
        text += self.message
        if self.allowed:
            text += f" (allowed: {self.allowed})"
        if self.suggestion is not None:
            text += f"; did you mean {self.suggestion!r}?"
        return text.replace("\r", "\\r").replace("\n", "\\n")  # always one line


class QConfigError(ValueError):
    """A config is malformed. ``problems`` lists every problem found; ``str()`` is one per line."""

    def __init__(self, problems: Iterable[Problem] | Problem | str):
        if isinstance(problems, str):
            problems = [Problem("<config>", "", None, "", problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self):  # keep the structured problems when pickled (e.g. across processes)
        return (type(self), (self.problems,))


class QConfigWarning(UserWarning):
    """A config loaded, but something in it is ignored (e.g. lpmm keys lpmm itself never used)."""
