"""``load_config``: YAML file / dict / QConfig -> validated, frozen :class:`QConfig`.

Steps for a file:

1. Parse the YAML (duplicate keys are errors; syntax errors keep line and column).
2. Detect the format by the top-level keys (lower case = native, upper case = lpmm; mixing is
   an error) and validate it into a *partial* native dict holding only the keys the file sets
   (lpmm files are translated by :mod:`qconf.config.lpmm`).
3. Load each ``base`` (paths relative to the file; cycles and missing files are errors), merge
   them in order, then the file itself on top: mappings merge key by key, later wins, and
   ``overrides`` lists concatenate base-first. Every distinct file is merged once, at its first
   place in that depth-first order (a diamond's shared base does not repeat), and a chain holds at
   most :data:`MAX_BASE_FILES` files.
4. Build the :class:`QConfig` from the merged dict (defaults fill what no file sets).

Reading a file is bounded (:mod:`qconf.config.yamlfile`: its size, its YAML nodes counting each
alias use as a copy, its nesting), and every failure of any kind is a problem. Problems from
every file in the chain are collected and raised together as one
:class:`~qconf.errors.QConfigError`; nothing is returned or mutated unless all is valid.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Any, Mapping

from ..errors import Problem, QConfigError, QConfigWarning
from .builtin import builtin_names, builtin_path, is_builtin_name, resolve_builtin
from .lpmm import is_upper_key, lpmm_to_native
from .bitnet import BITNET_FIELDS, BitNetConfig
from .model import Override, QConfig, WeightsConfig
from .rules import (BAD, TOP_FIELDS, TOP_KEYS, WEIGHTS_FIELDS, Reporter, as_text, check_override, check_section,
                    check_states, check_value, fmt, kind, unknown_key)
from .yamlfile import check_config_path, read_yaml

__all__ = ["load_config"]

_DICT = "<dict>"
#: Distinct files one config may pull in through ``base`` (the top file included).
MAX_BASE_FILES = 32


def load_config(src: Any, *, base_dir: str | os.PathLike[str] | None = None) -> QConfig:
    """Load a qconfig.

    Args:
        src: a path (``str`` / ``os.PathLike``) to a native or lpmm YAML file, a built-in config
            name such as ``"default"`` (:mod:`qconf.config.builtin`), a ``dict`` in
            either format, a :class:`QConfig` (returned as is), or ``None`` (the defaults, equal
            to lpmm's ``_C`` defaults).
        base_dir: directory that ``base`` paths of a dict are relative to (default: the CWD).

    Raises:
        QConfigError: listing every problem found, one line each.

    Emits a :class:`~qconf.errors.QConfigWarning` per file that has lpmm keys lpmm never used.
    """
    if isinstance(src, QConfig):
        return src
    src = resolve_builtin(src)  # "default" -> the shipped default.yml (qconf.config.builtin)
    loader = _Loader()
    if src is None:
        return QConfig()
    if isinstance(src, Mapping):
        top = _DICT
        merged = loader.load_mapping(src, _DICT, _path_text(base_dir, "base_dir") if base_dir is not None
                                     else os.getcwd())
        source = None
    elif isinstance(src, (str, os.PathLike)):
        top = _path_text(src, "path")
        loader.top_dir = os.path.dirname(os.path.abspath(top))
        merged = loader.load_top_file(top)
        source = top
    else:
        rep = Reporter(_DICT)
        rep.add("", src, f"cannot load a config from {kind(src)} ({type(src).__name__})", "a path, a dict or a QConfig")
        raise QConfigError(rep.problems)
    for message in loader.warnings:
        warnings.warn(QConfigWarning(message), stacklevel=2)
    if loader.problems:
        raise QConfigError(loader.problems)
    return _build(merged, top, source)


def _path_text(path: Any, what: str) -> str:
    """A path as text (``os.PathLike`` may give bytes), or QConfigError."""
    try:
        return os.fsdecode(path)
    except TypeError:
        rep = Reporter(_DICT)
        rep.add("", path, f"{what} {fmt(path)} is not a path ({type(path).__name__})", "a str or os.PathLike path")
        raise QConfigError(rep.problems) from None


@dataclasses.dataclass(frozen=True)
class _OverrideEntry:
    """A validated override and where it was written (for error messages after merging)."""

    file: str
    index: int
    fields: dict[str, Any]


class _Loader:
    """Visits a config and its ``base`` files depth-first, bases before the file naming them, each
    distinct file (by resolved path) once: ``layers`` is that linear order, merged at the end. A
    file reached again through another path (a diamond) adds nothing, so inheritance cannot
    multiply overrides; a file reached again through its own chain is a cycle (an error)."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.warnings: list[str] = []
        self.visited: set[str] = set()          # realpaths of the files already in ``layers``
        self.layers: list[dict[str, Any]] = []  # partial dicts, each base before the files naming it
        self.top_dir = os.getcwd()

    # -- files ---------------------------------------------------------------------------------
    def load_top_file(self, path: str) -> dict[str, Any]:
        rep = Reporter(path)
        if not check_config_path(path, rep):  # missing, a directory, a device: worded as for every command
            self.problems.extend(rep.problems)
            return {}
        self._visit_file(path, [])
        return self._merged()

    def load_mapping(self, raw: Mapping[Any, Any], display: str, base_dir: str) -> dict[str, Any]:
        rep = Reporter(display)
        self._visit_document(raw, rep, base_dir, [])
        self.problems.extend(rep.problems)
        return self._merged()

    def _merged(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for layer in self.layers:
            _merge(merged, layer)
        return merged

    def _visit_file(self, path: str, stack: list[tuple[str, str]]) -> None:
        real = os.path.realpath(path)
        self.visited.add(real)
        rep = Reporter(path)
        raw = read_yaml(path, rep)
        if raw is not BAD:
            self._visit_document(raw, rep, os.path.dirname(path), stack + [(real, path)])
        self.problems.extend(rep.problems)

    # -- one document ----------------------------------------------------------------------------
    def _visit_document(self, raw: Any, rep: Reporter, here: str, stack: list[tuple[str, str]]) -> None:
        own = self._partial(raw, rep)
        for entry, key_path in own.pop("base", []):
            path = _base_path(here, entry)
            if "\0" in path:
                rep.add(key_path, entry, f"{fmt(path)} is not a path (it contains a NUL character)")
                continue
            real = os.path.realpath(path)
            chain = [r for r, _ in stack]
            if real in chain:
                names = [self._short(d) for _, d in stack[chain.index(real):]] + [self._short(path)]
                rep.add(key_path, entry, "base cycle: " + " -> ".join(names))
            elif real in self.visited:
                continue  # already merged, before every file that names it: each file counts once
            elif not os.path.lexists(path) or os.path.isdir(path):
                what = "is a directory" if os.path.isdir(path) else "does not exist"
                rep.add(key_path, entry, f"base file {path!r} {what}")
            elif len(self.visited) >= MAX_BASE_FILES:
                rep.add(key_path, entry, f"more than {MAX_BASE_FILES} files in the base chain",
                        f"at most {MAX_BASE_FILES} distinct files in one config, its own file included")
                break
            else:
                self._visit_file(path, stack)
        self.layers.append(own)

    def _short(self, path: str) -> str:
        """A path for cycle messages: relative to the top file's directory when below it."""
        rel = os.path.relpath(os.path.abspath(path), self.top_dir)
        return path if rel.startswith("..") else rel

    def _partial(self, raw: Any, rep: Reporter) -> dict[str, Any]:
        """Validate one document into a partial native dict (only the keys it sets)."""
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            rep.add("", raw, f"expected a mapping at the top level, got {kind(raw)} {fmt(raw)}",
                    "a mapping with keys " + ", ".join(TOP_KEYS))
            return {}
        upper = [k for k in raw if is_upper_key(k)]
        lower = [k for k in raw if not is_upper_key(k)]
        if upper and lower:
            rep.add("", sorted(map(as_text, raw)), "mixes lpmm upper-case keys (" + ", ".join(upper) +
                    ") with native keys (" + ", ".join(map(as_text, lower)) + "); use one format per file",
                    "all native lower-case keys, or all lpmm upper-case keys")
            return {}
        if upper:
            partial, ignored = lpmm_to_native(raw, rep)
            if ignored:
                self.warnings.append(f"{rep.file}: ignoring lpmm keys that lpmm itself never uses: "
                                     + ", ".join(ignored))
            return partial
        return _native_partial(raw, rep)


def _native_partial(raw: Mapping[Any, Any], rep: Reporter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in TOP_FIELDS:
            checked = check_value(TOP_FIELDS[key], value, key, rep)
            if checked is not BAD:
                out[key] = checked
        elif key == "base":
            out["base"] = _native_base(value, rep)
        elif key == "states":
            out["states"] = check_states(value, "states", rep)
        elif key == "weights":
            out["weights"] = check_section(value, WEIGHTS_FIELDS, "weights", rep)
        elif key == "bitnet":
            out["bitnet"] = check_section(value, BITNET_FIELDS, "bitnet", rep)
        elif key == "overrides":
            out["overrides"] = _native_overrides(value, rep)
        else:
            unknown_key(rep, "", key, TOP_KEYS)
    return out


def _base_path(here: str, entry: str) -> str:
    """The file a ``base`` entry names: a path relative to the naming file's directory ``here``,
    or, when no such file exists, a built-in config name (``base: default``)."""
    path = os.path.normpath(os.path.join(here, os.path.expanduser(entry)))
    if not os.path.lexists(path) and is_builtin_name(entry) and entry in builtin_names():
        return str(builtin_path(entry))
    return path


def _native_base(value: Any, rep: Reporter) -> list[tuple[str, str]]:
    if value is None:
        return []
    if isinstance(value, str):
        items = [(value, "base")]
    elif isinstance(value, (list, tuple)):
        items = [(v, f"base[{i}]") for i, v in enumerate(value)]
    else:
        rep.add("base", value, f"expected a path or a list of paths, got {kind(value)} {fmt(value)}",
                "a YAML path relative to this file, or a list of them")
        return []
    out = []
    for item, path in items:
        if not isinstance(item, str) or not item:
            rep.add(path, item, f"{fmt(item)} is not a path", "a non-empty YAML path relative to this file")
        else:
            out.append((item, path))
    return out


def _native_overrides(value: Any, rep: Reporter) -> list[_OverrideEntry]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        rep.add("overrides", value, f"expected a list, got {kind(value)} {fmt(value)}", "a list of overrides")
        return []
    out = []
    for i, item in enumerate(value):
        clean = check_override(item, f"overrides[{i}]", rep)
        if clean is not None:
            out.append(_OverrideEntry(rep.file, i, clean))
    return out


def _merge(into: dict[str, Any], layer: dict[str, Any]) -> None:
    """Deep-merge a partial native dict ``layer`` on top of ``into`` (in place)."""
    for key, value in layer.items():
        if key == "overrides":
            into.setdefault("overrides", []).extend(value)
        elif key == "states":
            states = into.setdefault("states", {})
            for name, fields in value.items():
                states.setdefault(name, {}).update(fields)
        elif key in ("weights", "bitnet"):  # field by field; a list (bitnet.modules) is one field
            into.setdefault(key, {}).update(value)
        else:
            into[key] = value


_OVERRIDE_PATH = re.compile(r"overrides\[(\d+)\](.*)")


def _build(merged: dict[str, Any], top: str, source: str | None) -> QConfig:
    entries: list[_OverrideEntry] = merged.get("overrides", [])
    try:
        overrides = tuple(Override(**e.fields) for e in entries)
        return QConfig(
            version=merged.get("version", 1),
            min_numel=merged.get("min_numel", 4096),
            states=merged.get("states", {}),
            weights=WeightsConfig(**merged.get("weights", {})),
            overrides=overrides,
            source=source,
            bitnet=BitNetConfig(**merged.get("bitnet", {})),
        )
    except QConfigError as e:  # cross-field problems that only show after merging
        problems = []
        for p in e.problems:
            m = _OVERRIDE_PATH.fullmatch(p.key_path)
            if m and int(m.group(1)) < len(entries):
                entry = entries[int(m.group(1))]
                problems.append(dataclasses.replace(p, file=entry.file, key_path=f"overrides[{entry.index}]{m.group(2)}"))
            else:
                problems.append(dataclasses.replace(p, file=top))
        raise QConfigError(problems) from None
