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
    """The first line of the built-in config's leading comment (what it is), or ``''``."""
    for line in builtin_path(name).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text:
            return text
    return ""


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
