"""Reading one config file into plain data, with the work a hostile file can cause bounded.

A config is a few kilobytes of YAML, so every resource it could claim has a limit far above any
real config, and each failure is a :class:`~qconf.errors.Problem` naming the limit:

* the file: a regular file (no device such as ``/dev/zero``, no FIFO, no directory; opened
  non-blocking, so a FIFO without a writer cannot hang the open) of at most
  :data:`MAX_FILE_BYTES`, holding UTF-8 text (UTF-16 with a byte-order mark too, as YAML allows);
  :func:`check_config_path` words these problems for every command that takes a config path;
* parsing: at most :data:`MAX_YAML_NODES` nodes and :data:`MAX_YAML_DEPTH` levels, counted while
  composing (the pure-Python parser costs ~0.1 ms a node; the composer recurses per level);
* the document after aliases and merge keys: at most :data:`MAX_YAML_NODES` nodes when every use
  of an anchor counts its whole subtree, and at most :data:`MAX_YAML_DEPTH` levels deep -- checked
  on the node graph before anything is built, so an alias/merge-key bomb (each level ~10x the
  previous) is refused in time linear in the file;
* integer scalars: at most :data:`MAX_INT_CHARS` characters (Python refuses to convert more than
  4300 digits, and a YAML 1.1 base-60 integer such as ``1:2:3`` costs quadratic time in its length).

Duplicate keys are problems too (YAML silently keeps the last one), and a value YAML cannot build
(``2001-13-01``, ``!!float abc``) is a problem at its line and column, never a raw exception.
"""
from __future__ import annotations

import codecs
import os
import stat
from typing import Any

import yaml

from .rules import BAD, Reporter, join

__all__ = ["MAX_FILE_BYTES", "MAX_YAML_NODES", "MAX_YAML_DEPTH", "MAX_INT_CHARS", "check_config_path", "read_yaml"]

MAX_FILE_BYTES = 64 << 10  # 50x the largest shipped config; the pure-Python parser takes ~3 us a byte
MAX_YAML_NODES = 10_000  # a real config has tens to hundreds; the parser takes ~0.1 ms a node
MAX_YAML_DEPTH = 64  # a real config nests 4-6 levels
MAX_INT_CHARS = 100  # int64 needs 20 digits (66 characters in binary with 0b)


class _LimitExceeded(Exception):
    """A bound on the work of one file was exceeded (reported as a Problem, with the position)."""

    def __init__(self, message: str, allowed: str, mark: Any = None) -> None:
        super().__init__(message)
        self.message, self.allowed, self.mark = message, allowed, mark


def read_yaml(path: str, rep: Reporter) -> Any:
    """Parse one YAML file; report (and return ``BAD``) on unreadable or oversized files, syntax
    errors, exceeded bounds, values YAML cannot build and duplicate keys. An empty file is ``None``."""
    data = _read_bytes(path, rep)
    source = None if data is None else _decode(data, rep)
    if source is None:
        return BAD
    loader = None
    try:
        loader = _BoundedLoader(source)
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        before = len(rep.problems)
        _find_duplicate_keys(node, "", rep, set())
        if len(rep.problems) != before:
            return BAD
        return loader.construct_document(node)
    except _LimitExceeded as e:
        mark = e.mark
        rep.add("", None, e.message, e.allowed, line=mark.line + 1 if mark else None,
                column=mark.column + 1 if mark else None)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        label = "YAML error" if isinstance(e, yaml.constructor.ConstructorError) else "YAML syntax error"
        text = e.problem or e.context or "invalid YAML"
        if e.context and e.problem:
            text = f"{text} ({e.context})"
        rep.add("", None, f"{label}: {text}", line=mark.line + 1 if mark else None,
                column=mark.column + 1 if mark else None)
    except yaml.reader.ReaderError as e:  # a control character (the text is decoded already)
        line, column = _position(source[:e.position])
        rep.add("", None, f"YAML error: non-printable character U+{e.character:04X} is not allowed",
                "printable characters, tabs and line breaks", line=line, column=column)
    except yaml.YAMLError as e:
        rep.add("", None, f"YAML error: {e}")
    except RecursionError:
        rep.add("", None, "YAML error: document nests too deeply", f"at most {MAX_YAML_DEPTH} levels")
    except (ValueError, TypeError, ArithmeticError, LookupError, AttributeError) as e:  # any other value
        rep.add("", None, f"YAML error: cannot build a value: {e}")                    # YAML cannot build
    finally:
        if loader is not None:
            loader.dispose()
    return BAD


def check_config_path(path: str, rep: Reporter) -> bool:
    """Whether ``path`` is a regular file; if not, report why it cannot be a config file (not found,
    a directory, a device/FIFO/socket, not accessible). The one wording of these problems for
    ``load_config`` and every command that takes a config path (``qconf compare DIR`` says what
    ``qconf validate DIR`` says)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        broken = " (it is a broken symbolic link)" if os.path.islink(path) else ""
        rep.add("", path, "config file not found" + broken)
        return False
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL in the path
        rep.add("", path, f"cannot read config file: {getattr(e, 'strerror', None) or e}")
        return False
    return _is_regular(path, mode, rep)


def _is_regular(path: str, mode: int, rep: Reporter) -> bool:
    """Whether ``mode`` is a regular file's; if not, report that ``path`` is a directory or other non-file."""
    if stat.S_ISREG(mode):
        return True
    what = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, FIFO or socket)"
    rep.add("", path, f"cannot read config file: it is {what}", "a YAML file")
    return False


def _read_bytes(path: str, rep: Reporter) -> bytes | None:
    """The file's bytes, or None after reporting why not (not a regular file, too large, unreadable)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL in the path
        rep.add("", path, f"cannot read config file: {getattr(e, 'strerror', None) or e}")
        return None
    try:
        if not _is_regular(path, os.fstat(fd).st_mode, rep):  # fstat: what was opened, not what is there now
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)  # not st_size: the file may grow, or be a /proc file
    except OSError as e:
        rep.add("", path, f"cannot read config file: {e.strerror or e}")
        return None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        rep.add("", path, f"config file is larger than {MAX_FILE_BYTES} bytes", f"at most {MAX_FILE_BYTES} bytes")
        return None
    return data


_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def _decode(data: bytes, rep: Reporter) -> str | None:
    """The file's text -- UTF-8, or UTF-16 when it starts with a UTF-16 byte-order mark (YAML allows
    both) -- or None after reporting where the first byte that is not such text is (offset, line, column)."""
    name, codec = ("UTF-16", "utf-16") if data[:2] in _UTF16_BOMS else ("UTF-8", "utf-8")
    try:
        return data.decode(codec).removeprefix("\ufeff")  # a UTF-8 byte-order mark ('utf-16' drops its own)
    except UnicodeDecodeError as e:  # e.start: an offset in data ('utf-8-sig' would count from after the mark)
        line, column = _position(data[:e.start].decode(codec, "replace").removeprefix("\ufeff"))
        rep.add("", None, f"config file is not {name} text: byte 0x{data[e.start]:02x} at byte offset {e.start} "
                f"does not begin a valid {name} character", f"{name} text", line=line, column=column)
        return None


def _position(before: str) -> tuple[int, int]:
    """1-based ``(line, column)`` of the character that follows the text ``before``."""
    return before.count("\n") + 1, len(before) - (before.rfind("\n") + 1) + 1


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts the nodes it composes, refuses over-long integers and turns
    any failure to build a value into a ``ConstructorError`` at the value's position."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.composed, self.depth = 0, 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.composed += 1
        if self.composed > MAX_YAML_NODES:
            raise _LimitExceeded(f"YAML document has more than {MAX_YAML_NODES} nodes",
                                 f"at most {MAX_YAML_NODES} nodes", self.peek_event().start_mark)
        if self.depth >= MAX_YAML_DEPTH:  # before the composer's own recursion runs out
            raise _LimitExceeded(f"YAML document nests deeper than {MAX_YAML_DEPTH} levels",
                                 f"at most {MAX_YAML_DEPTH} levels", self.peek_event().start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer of {len(node.value)} characters is too long "
                f"(allowed: at most {MAX_INT_CHARS} characters)", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except (ValueError, TypeError, ArithmeticError, LookupError, AttributeError) as e:
            what = repr(node.value)[:60] if isinstance(node, yaml.ScalarNode) else "this node"
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot build a {node.tag.rsplit(':', 1)[-1]} from {what}: {e}", node.start_mark) from None


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _check_expansion(root: yaml.Node) -> None:
    """Raise if the document, with every alias use (merge keys included) expanded to a copy of its
    anchor, has more than MAX_YAML_NODES nodes or more than MAX_YAML_DEPTH levels. Each node's
    expanded size and height are computed once (memo), so this is linear in the node graph; a
    recursive alias (an anchor used inside itself) is built as a reference and counts one node."""
    memo: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, height)
    open_: set[int] = set()

    def walk(node: yaml.Node, depth: int) -> tuple[int, int]:
        if id(node) in open_:
            return 1, 0
        if id(node) not in memo:
            if depth >= MAX_YAML_DEPTH:
                raise _LimitExceeded(f"YAML document nests deeper than {MAX_YAML_DEPTH} levels",
                                     f"at most {MAX_YAML_DEPTH} levels", node.start_mark)
            open_.add(id(node))
            size, height = 1, 0
            for child in _children(node):
                s, h = walk(child, depth + 1)
                size, height = size + s, max(height, h + 1)
                if size > MAX_YAML_NODES:
                    raise _LimitExceeded(
                        f"YAML document expands to more than {MAX_YAML_NODES} nodes (each use of an alias or "
                        "merge key '<<' counts its whole anchor)", f"at most {MAX_YAML_NODES} nodes",
                        node.start_mark)
            open_.discard(id(node))
            memo[id(node)] = size, height
        size, height = memo[id(node)]
        if depth + height >= MAX_YAML_DEPTH:
            raise _LimitExceeded(f"YAML document nests deeper than {MAX_YAML_DEPTH} levels",
                                 f"at most {MAX_YAML_DEPTH} levels", node.start_mark)
        return size, height

    walk(root, 0)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


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
