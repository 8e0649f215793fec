"""The configs shipped with qconf, by name: ``"default"`` is ``default.yml`` of the shipped set.

Every place that takes a config (``load_config``, the optimizers' ``qconfig=``, ``qconf validate``,
``show``, ``compare``, ``bench``) accepts a built-in name, so an installed wheel works without the
repository's files:

    qconf.optim.AdamW(model.parameters(), qconfig="default")
    qconf validate default 8bit          # qconf validate --list shows every name

The shipped files live in ``qconf/configs/`` of an installed wheel (the build copies the
repository's ``configs/*.yml`` there) and in ``configs/`` of a checkout or an editable install.

A string names a built-in config when it has no path separator, no ``.yml``/``.yaml`` suffix and
is not an existing file: ``"default"`` is the built-in, ``"./default"`` or ``"default.yml"`` a path.
"""
from __future__ import annotations

import difflib
import functools
import os
from pathlib import Path
from typing import Any

from ..errors import Problem, QConfigError

__all__ = ["builtin_dir", "builtin_names", "builtin_path", "builtin_summary", "is_builtin_name", "resolve_builtin"]

_SUFFIXES = (".yml", ".yaml")


@functools.cache
def builtin_dir() -> Path:
    """The directory of the shipped configs: ``qconf/configs/`` (wheel), else the ``configs/``
    beside the package (checkout, editable install). QConfigError when neither exists."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "configs", package.parent / "configs"):
        if candidate.is_dir() and any(candidate.glob("*.yml")):
            return candidate
    raise QConfigError(Problem("<built-in>", "", str(package), "", "the shipped configs are missing (looked in "
                               f"{package / 'configs'} and {package.parent / 'configs'}); reinstall qconf"))


def builtin_names() -> list[str]:
    """Names of the shipped configs (file stems), sorted."""
    return sorted(p.stem for p in builtin_dir().glob("*.yml"))


def builtin_path(name: str) -> Path:
    """The file of the built-in config ``name``; QConfigError naming every built-in for an unknown one."""
    names = builtin_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        raise QConfigError(Problem(name, "", name, "a built-in name (" + ", ".join(names) + ") or a path to a "
                                   ".yml file", f"{name!r} is neither a config file nor a built-in config name",
                                   suggestion=close[0] if close else None))
    return builtin_dir() / f"{name}.yml"


def builtin_summary(name: str) -> str:
    """What the built-in config ``name`` is: the first whole sentence of its file's leading comment,
    which may run over several comment lines (``''`` without a comment)."""
    return _first_sentence(_comment_paragraph(builtin_path(name).read_text(encoding="utf-8")))


def _comment_paragraph(text: str) -> str:
    """The first paragraph of ``text``'s leading ``#`` comment as one line: its lines joined by spaces;
    an indented block (default.yml's table) ends it, its items (lines at the block's indent) joined
    by '; '. A blank comment line, the end of a block or the first non-comment line ends it."""
    out, block = "", None  # block: the indent of the block's items, once in one
    for line in text.splitlines():
        body = line[1:].removeprefix(" ") if line.startswith("#") else None
        indent = len(body) - len(body.lstrip()) if body else 0
        if body is None or (not body.strip() and out) or (block is not None and not indent):
            break
        if indent and block is not None and indent <= block:
            out += ";"
        block = indent if indent and block is None else block
        out += " " + " ".join(body.split())  # a table's aligning spaces collapse
    return out.strip()


def _first_sentence(text: str) -> str:
    """``text`` up to the first '.', '!' or '?' outside parentheses that is followed by the end, or by
    a space and a capital letter, quote or bracket (so ``e.g.``, ``et al. 2022`` and ``b1.58`` go
    on); the whole text when no sentence ends in it."""
    depth = 0
    for i, ch in enumerate(text):
        depth = depth + (ch in "([") - (ch in ")]" and depth > 0)
        after = text[i + 1:i + 3]
        if ch in ".!?" and depth == 0 and (not after or after[0] == " " and after[1:2] in _SENTENCE_STARTS):
            return text[:i + 1]
    return text


_SENTENCE_STARTS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ\"'`([")


def is_builtin_name(src: Any) -> bool:
    """Whether ``src`` is meant as a built-in name: a non-empty ``str`` without a path separator or a
    YAML suffix that is not an existing file (a ``Path`` object is always a path)."""
    if not isinstance(src, str) or not src or src in (".", ".."):
        return False
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if any(s in src for s in separators) or src.lower().endswith(_SUFFIXES):
        return False
    return not os.path.exists(src)


def resolve_builtin(src: Any) -> Any:
    """``src`` with a built-in name replaced by its file path (a ``str``); anything else unchanged.
    QConfigError for a name that is not built in."""
    return str(builtin_path(src)) if is_builtin_name(src) else src
