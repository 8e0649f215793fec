"""Seeded property tests of ``load_config`` on hostile input: random values in every field (wrong
types, huge and negative integers, NaN, nested junk), mutated YAML text (anchors, merge keys, tags,
unbalanced brackets, bad bytes), alias/merge-key bombs and random ``base`` graphs (diamonds,
cycles, missing files, devices).

Whatever the input, ``load_config`` must either return a valid :class:`QConfig` (it round-trips
and resolves a plan) or raise :class:`QConfigError` whose problems print -- never another
exception -- and each case must stay within a time and memory bound. The examples are derandomized
(the same on every run) and few, so the file runs in seconds.
"""
from __future__ import annotations

import os
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qconf.config import QConfig, load_config, resolve_plan
from qconf.errors import QConfigError

CASE_SECONDS = 10.0        # per case, on a loaded machine; a bounded case takes milliseconds
CASE_BYTES = 64 << 20      # peak Python allocation per case

FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check(src: Any, **kwargs: Any) -> QConfig | None:
    """Load ``src``; assert the outcome is a valid QConfig or a printable QConfigError, in bounds."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        cfg = load_config(src, **kwargs)
        error = None
    except QConfigError as e:
        cfg, error = None, e
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < CASE_SECONDS, f"load_config took {elapsed:.1f} s"
    assert peak < CASE_BYTES, f"load_config allocated {peak >> 20} MiB"
    if error is not None:
        assert error.problems, "a QConfigError without problems"
        lines = str(error).splitlines()  # one line per problem, none empty
        assert len(lines) == len(error.problems) and all(lines)
        return None
    assert isinstance(cfg, QConfig)
    assert load_config(cfg.to_dict()) == cfg  # valid: the full explicit form loads back equal
    resolve_plan(cfg, "layers.0.weight", (64, 96))
    return cfg


# -- random values in every field of a valid config -------------------------------------------------
NAMES = ["version", "base", "min_numel", "states", "exp_avg", "exp_avg_sq", "enable", "bits", "map", "signed",
         "scale", "group_size", "rounding", "weights", "compensation", "compensation_codec", "overrides", "match",
         "ndim", "max_numel", "QUANT", "M", "SQM", "BITS", "GROUP_SIZE", "THRESHOLD", "SCALE_TYPE", "DEFAULT",
         "ROUND_TYPE", "QUANT_TYPE", "BASE", "nonlinear", "power-1", "linear", "group", "rank1", "tensor", "dim0",
         "nearest", "stochastic", "kahan", "none", "*.bias", "re:(a+)+$", "re:(", "[", "", "\0", "\udcff"]
INTS = (st.integers() | st.sampled_from([0, 1, -1, 8, 9, 2**24, 2**24 + 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64,
                                         -(2**63)])
        | st.integers(4290, 5000).map(lambda digits: 10**digits))  # past Python's int <-> str limit
SCALARS = (st.none() | st.booleans() | INTS | st.floats() | st.sampled_from(NAMES) | st.text(max_size=12)
           | st.binary(max_size=4))
KEYS = st.sampled_from(NAMES) | st.text(max_size=8) | INTS | st.none() | st.booleans() | st.floats(allow_nan=False)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                    | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12)

VALID = {
    "version": 1, "min_numel": 64,
    "states": {"exp_avg": {"bits": 8, "group_size": 64}, "exp_avg_sq": {"bits": 4, "map": "power-1", "signed": False}},
    "weights": {"rounding": "stochastic", "compensation": "kahan", "compensation_codec": {"bits": 8}},
    "overrides": [{"match": "*.bias", "enable": False},
                  {"ndim": 1, "max_numel": 10, "states": {"exp_avg": {"bits": 4}}}],
}
LPMM = {"QUANT": {"M": {"BITS": 4, "GROUP_SIZE": 128, "SCALE_TYPE": {"DEFAULT": "group"}, "THRESHOLD": 4096},
                  "SQM": {"ENABLE": True, "ROUND_TYPE": "real-nearest", "QUANT_TYPE": {"DEFAULT": "power-1"}}},
        "BASE": [""]}


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key/index path into nested dicts and lists (the root included)."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _copy(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _copy(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_copy(v) for v in node]
    return node


@st.composite
def mutated(draw: st.DrawFn, start: dict) -> dict:
    """`start` with 1-3 random edits: a value replaced by junk, a key dropped or a junk key added."""
    doc = _copy(start)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if not path or action == "add":
            target = parent[path[-1]] if path else doc
            if isinstance(target, dict):
                target[draw(KEYS)] = draw(JUNK)
            elif isinstance(target, list):
                target.append(draw(JUNK))
        elif action == "drop" and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JUNK)
    return doc


@settings(FUZZ, max_examples=100)
@given(doc=mutated(VALID) | mutated(LPMM) | JUNK)
def test_fuzz_dicts(doc):
    with tempfile.TemporaryDirectory() as tmp:
        check(doc, base_dir=tmp)


# -- mutated YAML text ---------------------------------------------------------------------------------
FRAGMENTS = ["&a ", "*a", "<<: *a", "<<: [*a, *a]", "!!python/object/apply:os.getcwd []", "!!int ", "!!float ",
             "!!binary ", "!!timestamp ", "!!set ", "[", "]", "{", "}", ": ", "- ", "? ", "\t", "'", '"', "#", "|",
             ">", "---\n", "...\n", "%YAML 1.1\n", "9" * 5000, "1:" * 200 + "1", "0x" + "f" * 300, "2001-13-01",
             ".nan", "-.inf", "~", "\x00", "\ufeff", "\u2028", "\udcff", "\xff", "\x85"]


def _dumpable(doc: Any) -> bool:
    try:
        yaml.safe_dump(doc)
        return True
    except (yaml.YAMLError, ValueError, TypeError):
        return False


#: YAML scalars and nodes that break naive loading: over-long and base-60 integers, dates that do not exist,
#: tags that cannot build, undefined and recursive aliases, unsafe tags.
HOSTILE_VALUES = ["9" * 5000, "-" + "9" * 4400, "1:" * 300 + "1", "0x" + "f" * 200, "0b" + "1" * 200, "2001-13-01",
                  "2001-02-30 25:61:61", "!!float abc", "!!int x", "!!timestamp x", "!!bool maybe", "!!binary '%%'",
                  "*undefined", "&a [*a]", "&b {x: *b}", "!!python/name:os.system", "!!set {a, b}", "1e999", ".nan",
                  "[" * 100 + "]" * 100, "{<<: 3}", "{<<: [1]}", "? [a]\n  : 1"]
HOLE = "@@hole@@"


def _edit(draw: st.DrawFn, text: str) -> str:
    at = draw(st.integers(0, len(text)))
    edit = draw(st.sampled_from(["insert", "insert", "delete", "repeat"]))
    if edit == "insert":
        return text[:at] + draw(st.sampled_from(FRAGMENTS) | st.text(max_size=6)) + text[at:]
    if edit == "delete":
        return text[:at] + text[at + draw(st.integers(1, 20)):]
    lines = text.splitlines(keepends=True) or [""]
    i = min(at, len(lines) - 1)
    return "".join(lines[:i] + [lines[i]] * draw(st.integers(2, 30)) + lines[i:])


@st.composite
def yaml_text(draw: st.DrawFn) -> bytes:
    """A valid config's YAML (or a mutated one) with one field's value replaced by a hostile YAML
    value, and/or 0-3 text edits: a hostile fragment inserted, a slice deleted, a line repeated."""
    doc = _copy(draw(st.sampled_from([VALID, LPMM]) | mutated(VALID).filter(_dumpable)))
    hole = draw(st.booleans())
    if hole:  # a random field (or list item) becomes the hole
        path = draw(st.sampled_from([p for p in _paths(doc) if p]))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = HOLE
    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=draw(st.sampled_from([None, False, True])))
    if hole:
        value = draw(st.sampled_from(HOSTILE_VALUES)).replace("\n", "\n" + " " * 40)
        assert f"'{HOLE}'" in text
        text = text.replace(f"'{HOLE}'", value)
    for _ in range(draw(st.integers(0, 3))):
        text = _edit(draw, text)
    return text.encode("utf-8", "surrogateescape") if draw(st.booleans()) else text.encode("utf-16", "surrogatepass")


@settings(FUZZ, max_examples=75)
@given(data=yaml_text())
def test_fuzz_yaml_text(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yml"
        path.write_bytes(data)
        check(path)


# -- alias and merge-key bombs ---------------------------------------------------------------------------
@st.composite
def bomb(draw: st.DrawFn) -> str:
    """Nested anchors, each level `width` aliases (in a list or a merge key) of the one below."""
    levels, width = draw(st.integers(1, 12)), draw(st.integers(1, 16))
    merge = draw(st.booleans())
    lines = ["x0: &a0 {k: 1, bits: 4}" if merge else "x0: &a0 [1, 2]"]
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * width)
        lines.append(f"x{i}: &a{i}\n  <<: [{refs}]\n  k{i}: 1" if merge else f"x{i}: &a{i} [{refs}]")
    top = f"*a{levels - 1}"
    lines.append(draw(st.sampled_from([f"states:\n  exp_avg:\n    <<: {top}" if merge else f"states: {top}",
                                       f"overrides: [{top}]", f"weights: {top}"])))
    return "\n".join(lines) + "\n"


@settings(FUZZ, max_examples=40)
@given(text=bomb())
def test_fuzz_bombs(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bomb.yml"
        path.write_text(text)
        check(path)


# -- random base graphs ------------------------------------------------------------------------------
CONTENTS = ["min_numel: 7\n", "states: {exp_avg: {bits: 8}}\n", "overrides: [{match: '*.bias', enable: false}]\n",
            "overrides: [{match: x, enable: false}, {ndim: 2, enable: true}]\n", "QUANT: {SQM: {BITS: 3}}\n",
            "weights: {rounding: stochastic}\noverrides: [{ndim: 1, states: {exp_avg: {bits: 8}}}]\n", "",
            "states: {exp_avg: {bits: 99}}\n", "[1, 2]\n", "{{{\n"]
BAD_BASES = ["missing.yml", "sub", "/dev/zero", "", "~/nope.yml"]


@st.composite
def base_graph(draw: st.DrawFn) -> list[tuple[str, list[str]]]:
    """Files f0..fn, each with some content (mostly valid) and a list of bases: mostly later files
    (diamonds), sometimes any file (cycles, itself, the same file by another path) or a bad one
    (missing, a directory, a device)."""
    n = draw(st.integers(1, 8))
    graph = []
    for i in range(n):
        later = [f"f{j}.yml" for j in range(i + 1, n)]
        anywhere = [f"f{j}.yml" for j in range(n)] + [f"./f{i}.yml", "sub/../f0.yml"]
        ref = st.one_of(*[st.sampled_from(later)] * (6 if later else 0), st.sampled_from(anywhere),
                        st.sampled_from(BAD_BASES))
        content = draw(st.sampled_from(CONTENTS[:6]) | st.sampled_from(CONTENTS))
        graph.append((content, draw(st.lists(ref, max_size=3))))
    return graph


@settings(FUZZ, max_examples=60)
@given(graph=base_graph(), lpmm=st.booleans())
def test_fuzz_base_graphs(graph, lpmm):
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(Path(tmp) / "sub")
        for i, (content, bases) in enumerate(graph):
            key = "BASE" if lpmm and (content.startswith("QUANT") or not content) else "base"
            (Path(tmp) / f"f{i}.yml").write_text((f"{key}: {bases!r}\n" if bases else "") + content)
        cfg = check(Path(tmp) / "f0.yml")
        if cfg is not None:  # each file's overrides at most once: diamonds do not multiply them
            assert len(cfg.overrides) <= sum(content.count("match") + content.count("ndim") for content, _ in graph)
