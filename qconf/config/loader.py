"""``load_config``: YAML file / dict / QConfig -> validated, frozen :class:`QConfig`.

Steps for a file:

1. Parse the YAML (duplicate keys are errors; syntax errors keep line and column).
2. Detect the format by the top-level keys (lower case = native, upper case = lpmm; mixing is
   an error) and validate it into a *partial* native dict holding only the keys the file sets
   (lpmm files are translated by :mod:`qconf.config.lpmm`).
3. Load each ``base`` (paths relative to the file; cycles and missing files are errors), merge
   them in order, then the file itself on top: mappings merge key by key, later wins, and
   ``overrides`` lists concatenate base-first.
4. Build the :class:`QConfig` from the merged dict (defaults fill what no file sets).

Problems from every file in the chain are collected and raised together as one
:class:`~qconf.errors.QConfigError`; nothing is returned or mutated unless all is valid.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import warnings
from typing import Any, Mapping

import yaml

from ..errors import Problem, QConfigError, QConfigWarning
from .builtin import resolve_builtin
from .lpmm import is_upper_key, lpmm_to_native
from .model import Override, QConfig, WeightsConfig
from .rules import (BAD, TOP_FIELDS, TOP_KEYS, WEIGHTS_FIELDS, Reporter, check_override, check_section, check_states,
                    check_value, fmt, join, kind, unknown_key)

__all__ = ["load_config"]

_DICT = "<dict>"


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
        merged = loader.load_mapping(src, _DICT, os.fspath(base_dir) if base_dir is not None else os.getcwd())
        source = None
    elif isinstance(src, (str, os.PathLike)):
        top = os.fspath(src)
        loader.top_dir = os.path.dirname(os.path.abspath(top))
        merged = loader.load_top_file(top)
        source = top
    else:
        raise QConfigError(Problem(_DICT, "", src, "a path, a dict or a QConfig",
                                   f"cannot load a config from {kind(src)} ({type(src).__name__})"))
    for message in loader.warnings:
        warnings.warn(QConfigWarning(message), stacklevel=2)
    if loader.problems:
        raise QConfigError(loader.problems)
    return _build(merged, top, source)


@dataclasses.dataclass(frozen=True)
class _OverrideEntry:
    """A validated override and where it was written (for error messages after merging)."""

    file: str
    index: int
    fields: dict[str, Any]


class _Loader:
    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.warnings: list[str] = []
        self.cache: dict[str, dict[str, Any]] = {}   # realpath -> merged partial dict of that file
        self.top_dir = os.getcwd()

    # -- files ---------------------------------------------------------------------------------
    def load_top_file(self, path: str) -> dict[str, Any]:
        if not os.path.exists(path):
            self.problems.append(Problem(path, "", path, "", "config file not found"))
            return {}
        return self.load_file(path, [])

    def load_file(self, path: str, stack: list[tuple[str, str]]) -> dict[str, Any]:
        real = os.path.realpath(path)
        if real in self.cache:
            return copy.deepcopy(self.cache[real])
        rep = Reporter(path)
        raw = _read_yaml(path, rep)
        merged: dict[str, Any] = {}
        if raw is not BAD:
            merged = self._load_document(raw, rep, os.path.dirname(path), stack + [(real, path)])
        self.problems.extend(rep.problems)
        self.cache[real] = merged
        return copy.deepcopy(merged)

    def load_mapping(self, raw: Mapping[Any, Any], display: str, base_dir: str) -> dict[str, Any]:
        rep = Reporter(display)
        merged = self._load_document(raw, rep, base_dir, [])
        self.problems.extend(rep.problems)
        return merged

    # -- one document ----------------------------------------------------------------------------
    def _load_document(self, raw: Any, rep: Reporter, here: str, stack: list[tuple[str, str]]) -> dict[str, Any]:
        own = self._partial(raw, rep)
        merged: dict[str, Any] = {}
        for entry, key_path in own.pop("base", []):
            path = os.path.normpath(os.path.join(here, os.path.expanduser(entry)))
            real = os.path.realpath(path)
            chain = [r for r, _ in stack]
            if real in chain:
                names = [self._short(d) for _, d in stack[chain.index(real):]] + [self._short(path)]
                rep.add(key_path, entry, "base cycle: " + " -> ".join(names))
                continue
            if not os.path.isfile(path):
                what = "is a directory" if os.path.isdir(path) else "does not exist"
                rep.add(key_path, entry, f"base file {path!r} {what}")
                continue
            _merge(merged, self.load_file(path, stack))
        _merge(merged, own)
        return merged

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
            rep.add("", sorted(map(str, raw)), "mixes lpmm upper-case keys (" + ", ".join(map(str, upper)) +
                    ") with native keys (" + ", ".join(map(str, lower)) + "); use one format per file",
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
        elif key == "overrides":
            out["overrides"] = _native_overrides(value, rep)
        else:
            unknown_key(rep, "", key, TOP_KEYS)
    return out


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
        elif key == "weights":
            into.setdefault("weights", {}).update(value)
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


# ---------------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------------
def _read_yaml(path: str, rep: Reporter) -> Any:
    """Parse one YAML file; report (and return ``BAD``) on unreadable files, syntax errors and
    duplicate keys. An empty file is ``None``."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        rep.add("", path, f"cannot read config file: {e.strerror or e}")
        return BAD
    loader = None
    try:
        loader = yaml.SafeLoader(data)
        node = loader.get_single_node()
        if node is None:
            return None
        before = len(rep.problems)
        _find_duplicate_keys(node, "", rep, set())
        if len(rep.problems) != before:
            return BAD
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        label = "YAML error" if isinstance(e, yaml.constructor.ConstructorError) else "YAML syntax error"
        text = e.problem or e.context or "invalid YAML"
        if e.context and e.problem:
            text = f"{text} ({e.context})"
        rep.add("", None, f"{label}: {text}", line=mark.line + 1 if mark else None,
                column=mark.column + 1 if mark else None)
    except yaml.YAMLError as e:  # e.g. undecodable bytes
        rep.add("", None, f"YAML error: {e}")
    except RecursionError:
        rep.add("", None, "YAML error: document nests too deeply")
    finally:
        if loader is not None:
            loader.dispose()
    return BAD


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _find_duplicate_keys(node: yaml.Node, path: str, rep: Reporter, seen: set[int]) -> None:
    """Report repeated keys in any mapping (YAML silently keeps the last one)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # '<<: *anchor' may legitimately repeat keys
                _find_duplicate_keys(value_node, path, rep, seen)
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None:
                line = key_node.start_mark.line + 1
                if key in first:
                    rep.add(join(path, key), key, f"duplicate key {key!r} (first defined at line {first[key]})",
                            line=line, column=key_node.start_mark.column + 1)
                else:
                    first[key] = line
            _find_duplicate_keys(value_node, join(path, key if key is not None else "?"), rep, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _find_duplicate_keys(item, f"{path}[{i}]", rep, seen)
