"""Malformed configs: every one raises QConfigError naming the file, key path and what is allowed."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from qconf.config import load_config
from qconf.errors import Problem, QConfigError

# (id, YAML text, expected key path, substrings that must appear in the message)
CASES = [
    # unknown keys at every level, with did-you-mean
    ("top-unknown", "min_numell: 5\n", "min_numell", ["unknown key", "did you mean 'min_numel'?"]),
    ("state-unknown", "states:\n  exp_avg:\n    grop_size: 64\n", "states.exp_avg.grop_size",
     ["did you mean 'group_size'?"]),
    ("state-upper-in-native", "states:\n  exp_avg:\n    BITS: 4\n", "states.exp_avg.BITS", ["did you mean 'bits'?"]),
    ("state-lpmm-name", "states:\n  exp_avg:\n    threshold: 4\n", "states.exp_avg.threshold",
     ["did you mean 'min_numel'?"]),
    ("weights-unknown", "weights:\n  compensate: kahan\n", "weights.compensate", ["did you mean 'compensation'?"]),
    ("override-unknown", "overrides:\n  - {match: x, enabled: false}\n", "overrides[0].enabled",
     ["did you mean 'enable'?"]),
    ("unknown-state", "states:\n  exp_avg_sqq: {bits: 4}\n", "states.exp_avg_sqq",
     ["unknown state", "did you mean 'exp_avg_sq'?"]),
    ("unknown-state-in-override", "overrides:\n  - {match: x, states: {exp_av: {bits: 8}}}\n",
     "overrides[0].states.exp_av", ["unknown state", "did you mean 'exp_avg'?"]),
    # wrong types
    ("bits-bool", "states:\n  exp_avg:\n    bits: true\n", "states.exp_avg.bits", ["is not an integer"]),
    ("bits-float", "states:\n  exp_avg:\n    bits: 4.0\n", "states.exp_avg.bits", ["4.0 is not an integer"]),
    ("bits-string", "states:\n  exp_avg:\n    bits: '4'\n", "states.exp_avg.bits", ["is not an integer"]),
    ("signed-string", "states:\n  exp_avg_sq:\n    signed: 'false'\n", "states.exp_avg_sq.signed",
     ["is not a boolean", "true or false"]),
    ("enable-int", "states:\n  exp_avg:\n    enable: 1\n", "states.exp_avg.enable", ["is not a boolean"]),
    ("map-int", "states:\n  exp_avg:\n    map: 4\n", "states.exp_avg.map", ["is not a string"]),
    ("top-min_numel-null", "min_numel: null\n", "min_numel", ["null is not an integer"]),
    # out of range
    ("bits-9", "states:\n  exp_avg_sq:\n    bits: 9\n", "states.exp_avg_sq.bits",
     ["9 is out of range (allowed: integer 1..8)"]),
    ("bits-0", "states:\n  exp_avg:\n    bits: 0\n", "states.exp_avg.bits", ["out of range"]),
    ("group-size-0", "states:\n  exp_avg:\n    group_size: 0\n", "states.exp_avg.group_size",
     ["integer 1..16777216 = 2^24"]),
    ("min-numel-negative", "min_numel: -1\n", "min_numel", ["out of range", "integer 0..9223372036854775807 = 2^63-1"]),
    ("state-min-numel-negative", "states:\n  exp_avg:\n    min_numel: -5\n", "states.exp_avg.min_numel",
     ["out of range"]),
    ("version-2", "version: 2\n", "version", ["not supported", "allowed: 1"]),
    # enums
    ("map-typo", "states:\n  exp_avg:\n    map: nonlinar\n", "states.exp_avg.map", ["did you mean 'nonlinear'?"]),
    ("map-power", "states:\n  exp_avg:\n    map: power1\n", "states.exp_avg.map", ["did you mean 'power-1'?"]),
    ("scale-typo", "states:\n  exp_avg:\n    scale: rank-1\n", "states.exp_avg.scale", ["did you mean 'rank1'?"]),
    ("rounding-typo", "states:\n  exp_avg:\n    rounding: nearst\n", "states.exp_avg.rounding",
     ["did you mean 'nearest'?"]),
    ("rounding-lpmm-name", "states:\n  exp_avg:\n    rounding: real-sr\n", "states.exp_avg.rounding",
     ["did you mean 'stochastic'?"]),
    ("weights-rounding", "weights:\n  rounding: stochastik\n", "weights.rounding", ["did you mean 'stochastic'?"]),
    ("weights-compensation", "weights:\n  compensation: kahn\n", "weights.compensation", ["did you mean 'kahan'?"]),
    # cross-field
    ("signed-linear-1bit", "states:\n  exp_avg:\n    map: linear\n    bits: 1\n", "states.exp_avg.bits",
     ["needs bits >= 2"]),
    ("signed-linear-1bit-override", "overrides:\n  - {match: x, states: {exp_avg: {map: linear, bits: 1, signed: true}}}\n",
     "overrides[0].states.exp_avg", ["needs bits >= 2"]),
    ("signed-linear-1bit-via-override", "states: {exp_avg: {map: linear}}\noverrides:\n"
     "  - {match: x, states: {exp_avg: {bits: 1}}}\n", "overrides[0].states.exp_avg", ["needs bits >= 2"]),
    # structure
    ("states-list", "states: [1, 2]\n", "states", ["expected a mapping", "a list"]),
    ("state-section-scalar", "states:\n  exp_avg: 4\n", "states.exp_avg", ["expected a mapping"]),
    ("weights-string", "weights: kahan\n", "weights", ["expected a mapping"]),
    ("top-list", "- 1\n- 2\n", "", ["expected a mapping at the top level"]),
    ("top-scalar", "hello\n", "", ["expected a mapping at the top level"]),
    ("overrides-mapping", "overrides: {match: x}\n", "overrides", ["expected a list"]),
    ("override-scalar", "overrides:\n  - '*.bias'\n", "overrides[0]", ["expected a mapping"]),
    # overrides
    ("override-no-selector", "overrides:\n  - {enable: false}\n", "overrides[0]", ["no selector"]),
    ("override-no-action", "overrides:\n  - {match: '*.bias'}\n", "overrides[0]", ["no action"]),
    ("override-bad-regex", "overrides:\n  - {match: 're:(bias', enable: false}\n", "overrides[0].match",
     ["does not compile", "missing )"]),
    ("override-empty-regex", "overrides:\n  - {match: 're:', enable: false}\n", "overrides[0].match", ["empty regex"]),
    ("override-bad-glob", "overrides:\n  - {match: 'layers.[0-9.weight', enable: false}\n", "overrides[0].match",
     ["unclosed '['"]),
    ("override-empty-glob", "overrides:\n  - {match: '', enable: false}\n", "overrides[0].match", ["empty pattern"]),
    ("override-match-int", "overrides:\n  - {match: 3, enable: false}\n", "overrides[0].match", ["is not a string"]),
    ("override-ndim-negative", "overrides:\n  - {ndim: -1, enable: false}\n", "overrides[0].ndim", ["out of range"]),
    ("override-ndim-float", "overrides:\n  - {ndim: 1.5, enable: false}\n", "overrides[0].ndim", ["not an integer"]),
    ("override-numel-negative", "overrides:\n  - {max_numel: -3, enable: false}\n", "overrides[0].max_numel",
     ["out of range"]),
    ("override-min-gt-max", "overrides:\n  - {min_numel: 10, max_numel: 5, enable: false}\n",
     "overrides[0].min_numel", ["greater than max_numel"]),
    ("override-enable-string", "overrides:\n  - {match: x, enable: 'no'}\n", "overrides[0].enable",
     ["is not a boolean"]),
    ("override-state-bits", "overrides:\n  - {match: x, states: {exp_avg_sq: {bits: 16}}}\n",
     "overrides[0].states.exp_avg_sq.bits", ["out of range"]),
    ("override-state-min-numel", "overrides:\n  - {match: x, states: {exp_avg: {min_numel: 0}}}\n",
     "overrides[0].states.exp_avg.min_numel", ["cannot be set"]),
    ("override-weights", "overrides:\n  - {match: x, weights: {compensation: kahan2}}\n",
     "overrides[0].weights.compensation", ["did you mean 'kahan'?"]),
    ("override-states-list", "overrides:\n  - {match: x, states: [exp_avg]}\n", "overrides[0].states",
     ["expected a mapping"]),
    # base
    ("base-int", "base: 3\n", "base", ["expected a path"]),
    ("base-empty-entry", "base: ['']\n", "base[0]", ["is not a path"]),
    ("base-missing", "base: nothere.yml\n", "base", ["nothere.yml", "does not exist"]),
    # format mixing and lpmm
    ("mixed-formats", "QUANT: {}\nstates: {}\n", "", ["mixes lpmm upper-case keys (QUANT)", "native keys (states)"]),
    ("lpmm-unknown-top", "QUANTS: {}\n", "QUANTS", ["did you mean 'QUANT'?"]),
    ("lpmm-unknown-section", "QUANT:\n  SQ: {BITS: 4}\n", "QUANT.SQ", ["did you mean 'SQM'?"]),
    ("lpmm-unknown-key", "QUANT:\n  M: {GROUPSIZE: 4}\n", "QUANT.M.GROUPSIZE", ["did you mean 'GROUP_SIZE'?"]),
    ("lpmm-bits", "QUANT:\n  SQM: {BITS: 9}\n", "QUANT.SQM.BITS", ["out of range"]),
    ("lpmm-scale-dim01", "QUANT:\n  SQM:\n    SCALE_TYPE: {DEFAULT: dim01}\n", "QUANT.SQM.SCALE_TYPE.DEFAULT",
     ["not supported", "allowed: tensor, dim0, dim1, group, rank1"]),
    ("lpmm-scale-rank1-group", "QUANT:\n  SQM:\n    SCALE_TYPE: {DEFAULT: rank1-group}\n",
     "QUANT.SQM.SCALE_TYPE.DEFAULT", ["not supported"]),
    ("lpmm-scale-id", "QUANT:\n  M:\n    SCALE_TYPE: {DEFAULT: id}\n", "QUANT.M.SCALE_TYPE.DEFAULT", ["not supported"]),
    ("lpmm-scale-string", "QUANT:\n  M:\n    SCALE_TYPE: group\n", "QUANT.M.SCALE_TYPE", ["{DEFAULT: ...}"]),
    ("lpmm-round-sr1", "QUANT:\n  M: {ROUND_TYPE: sr1}\n", "QUANT.M.ROUND_TYPE",
     ["simulation mode", "allowed: real-nearest, nearest, real-sr, sr"]),
    ("lpmm-round-down", "QUANT:\n  M: {ROUND_TYPE: down}\n", "QUANT.M.ROUND_TYPE", ["simulation mode"]),
    ("lpmm-round-typo", "QUANT:\n  M: {ROUND_TYPE: real-neares}\n", "QUANT.M.ROUND_TYPE",
     ["did you mean 'real-nearest'?"]),
    ("lpmm-quant-type", "QUANT:\n  M:\n    QUANT_TYPE: {DEFAULT: power-4}\n", "QUANT.M.QUANT_TYPE.DEFAULT",
     ["not a valid map"]),
    ("lpmm-threshold", "QUANT:\n  M: {THRESHOLD: -1}\n", "QUANT.M.THRESHOLD", ["out of range"]),
    ("lpmm-base-type", "BASE: 3\n", "BASE", ["expected a list"]),
    # YAML level
    ("duplicate-key", "states:\n  exp_avg:\n    bits: 4\n    bits: 8\n", "states.exp_avg.bits",
     ["duplicate key 'bits' (first defined at line 3)"]),
    ("duplicate-top-key", "min_numel: 1\nmin_numel: 2\n", "min_numel", ["duplicate key"]),
]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yml"
    path.write_text(text)
    return path


def test_enough_distinct_cases():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)
    assert len({c[1] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,text,key_path,fragments", CASES, ids=[c[0] for c in CASES])
def test_malformed(tmp_path, name, text, key_path, fragments):
    path = _write(tmp_path, text)
    with pytest.raises(QConfigError) as info:
        load_config(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert any(p.key_path == key_path for p in err.problems), [str(p) for p in err.problems]
    message = str(err)
    assert str(path) in message
    hit = next(p for p in err.problems if p.key_path == key_path)
    assert str(hit).startswith(str(path))
    if key_path:
        assert f": {key_path}: " in str(hit)
    if hit.line is None:
        assert str(hit).startswith(f"{path}: {key_path}: " if key_path else f"{path}: ")
    for fragment in fragments:
        assert fragment in message, message
    for problem in err.problems:
        assert "\n" not in str(problem)
        assert isinstance(problem, Problem) and problem.file == str(path)
    assert message == "\n".join(str(p) for p in err.problems)


# YAML-level cases have no dict form; a bare string is a path, not a document.
DICT_CASES = [c for c in CASES if not c[0].startswith("duplicate") and c[0] != "top-scalar"]


@pytest.mark.parametrize("name,text,key_path,fragments", DICT_CASES, ids=[c[0] for c in DICT_CASES])
def test_malformed_as_dict(name, text, key_path, fragments, tmp_path, monkeypatch):
    """The same problems are found when the config is a dict (file shown as <dict>)."""
    monkeypatch.chdir(tmp_path)  # a dict's base paths are relative to the CWD
    data = yaml.safe_load(text)
    with pytest.raises(QConfigError) as info:
        load_config(data)
    assert any(p.key_path == key_path for p in info.value.problems)
    assert all(p.file == "<dict>" for p in info.value.problems)


def test_problem_format_exact(tmp_path):
    path = _write(tmp_path, "states:\n  exp_avg_sq:\n    bits: 9\n")
    with pytest.raises(QConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: states.exp_avg_sq.bits: 9 is out of range (allowed: integer 1..8)"
    (p,) = info.value.problems
    assert (p.file, p.key_path, p.value, p.allowed) == (str(path), "states.exp_avg_sq.bits", 9, "integer 1..8")


def test_typo_format_exact(tmp_path):
    path = _write(tmp_path, "states:\n  exp_avg:\n    grop_size: 64\n")
    with pytest.raises(QConfigError) as info:
        load_config(path)
    (p,) = info.value.problems
    assert str(p).endswith("; did you mean 'group_size'?")
    assert p.suggestion == "group_size"


@pytest.mark.parametrize("text,line,col", [
    ("states:\n  exp_avg:\n    bits: 4\n   map: linear\n", 4, 4),
    ("min_numel: 5\nstates: {exp_avg: {bits: 4}\n", 3, 1),
    ("a: [1, 2\n", 2, 1),
    ("states:\n\texp_avg: 1\n", 2, 1),
])
def test_yaml_syntax_error_keeps_line(tmp_path, text, line, col):
    path = _write(tmp_path, text)
    with pytest.raises(QConfigError) as info:
        load_config(path)
    (p,) = info.value.problems
    assert (p.line, p.column) == (line, col)
    assert str(p).startswith(f"{path}:{line}:{col}: YAML syntax error: ")


def test_yaml_multiple_documents(tmp_path):
    path = _write(tmp_path, "min_numel: 1\n---\nmin_numel: 2\n")
    with pytest.raises(QConfigError, match=r":2:1: YAML syntax error: .*single document"):
        load_config(path)


def test_yaml_python_tag_rejected(tmp_path):
    path = _write(tmp_path, "min_numel: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(QConfigError, match=r":1:\d+: YAML error"):
        load_config(path)


def test_yaml_merge_keys_allowed(tmp_path):
    # anchors and merge keys are fine; a key after '<<' is not a duplicate
    text = "states:\n  exp_avg: &s {bits: 8, group_size: 64}\n  exp_avg_sq:\n    <<: *s\n    bits: 6\n"
    path = _write(tmp_path, text)
    cfg = load_config(path)
    assert cfg.states["exp_avg_sq"].bits == 6 and cfg.states["exp_avg_sq"].group_size == 64


def test_binary_file(tmp_path):
    path = tmp_path / "bin.yml"
    path.write_bytes(b"\xff\xfe\x00\x00garbage\x00\x01")
    with pytest.raises(QConfigError):
        load_config(path)


@pytest.mark.parametrize("data, line, column, offset", [
    ("min_numel: 4096\n# café\n".encode("latin-1"), 2, 6, 21),
    (b"min_numel: 5 # caf\xc3", 1, 19, 18),                                  # a character cut at the end
    (b"\xef\xbb\xbfmin_numel: 5\nx: \x80\n", 2, 4, 19),                    # after a UTF-8 byte-order mark
], ids=["latin-1", "truncated", "after-bom"])
def test_not_utf8_names_offset_line_and_column(tmp_path, data, line, column, offset):
    path = tmp_path / "c.yml"
    path.write_bytes(data)
    with pytest.raises(QConfigError) as info:
        load_config(path)
    (p,) = info.value.problems
    assert (p.line, p.column) == (line, column)
    assert p.message == (f"config file is not UTF-8 text: byte 0x{data[offset]:02x} at byte offset {offset} does not "
                         "begin a valid UTF-8 character") and p.allowed == "UTF-8 text"
    assert "position" not in str(p) and "<byte string>" not in str(p)


@pytest.mark.parametrize("data", [b"\xef\xbb\xbfmin_numel: 5\n", "min_numel: 5\n".encode("utf-16"),
                                  "min_numel: 5 # café\n".encode("utf-8")], ids=["utf8-bom", "utf16-bom", "utf8"])
def test_utf8_and_utf16_with_bom_load(tmp_path, data):
    path = tmp_path / "c.yml"
    path.write_bytes(data)
    assert load_config(path).min_numel == 5


def test_control_character_names_line_and_column(tmp_path):
    path = _write(tmp_path, "min_numel: 5\nx: 'a\x00'\n")
    with pytest.raises(QConfigError) as info:
        load_config(path)
    (p,) = info.value.problems
    assert str(p) == (f"{path}:2:6: YAML error: non-printable character U+0000 is not allowed (allowed: printable "
                      "characters, tabs and line breaks)")


def test_directory_is_not_a_config(tmp_path):
    with pytest.raises(QConfigError):
        load_config(tmp_path)


def test_all_problems_collected(tmp_path):
    path = _write(tmp_path, """\
version: 3
min_numel: -4
states:
  exp_avg:
    bits: 9
    grop_size: 3
    map: nonlinar
  exp_avg_sqq: {}
weights:
  compensation: kahn
overrides:
  - {enable: false}
  - {match: 're:[', enable: false}
""")
    with pytest.raises(QConfigError) as info:
        load_config(path)
    paths = [p.key_path for p in info.value.problems]
    assert paths == ["version", "min_numel", "states.exp_avg.bits", "states.exp_avg.grop_size",
                     "states.exp_avg.map", "states.exp_avg_sqq", "weights.compensation", "overrides[0]",
                     "overrides[1].match"]
    assert len(str(info.value).splitlines()) == len(paths)


def test_problems_in_several_files_collected(tmp_path):
    (tmp_path / "b1.yml").write_text("min_numel: x\n")
    (tmp_path / "b2.yml").write_text("states: {exp_avg: {bits: 0}}\n")
    path = _write(tmp_path, "base: [b1.yml, b2.yml, b3.yml]\nweights: {rounding: up}\n")
    with pytest.raises(QConfigError) as info:
        load_config(path)
    got = {(Path(p.file).name, p.key_path) for p in info.value.problems}
    assert got == {("b1.yml", "min_numel"), ("b2.yml", "states.exp_avg.bits"), ("bad.yml", "base[2]"),
                   ("bad.yml", "weights.rounding")}


def test_bad_src_type():
    with pytest.raises(QConfigError, match="cannot load a config"):
        load_config(42)


# Odd values in every slot: the loader must answer with QConfigError (or load), never crash.
_ODD = [None, True, 0, -1, 1.5, "", "x", [], [1], {}, {"a": 1}, {1: 2}, 10**30]
_SLOTS = [
    lambda v: {"version": v}, lambda v: {"min_numel": v}, lambda v: {"base": v}, lambda v: {"states": v},
    lambda v: {"states": {"exp_avg": v}}, lambda v: {"states": {"exp_avg": {"bits": v}}},
    lambda v: {"states": {"exp_avg": {"map": v}}}, lambda v: {"states": {"exp_avg": {"min_numel": v}}},
    lambda v: {"weights": v}, lambda v: {"weights": {"rounding": v}}, lambda v: {"overrides": v},
    lambda v: {"overrides": [v]}, lambda v: {"overrides": [{"match": v, "enable": False}]},
    lambda v: {"overrides": [{"ndim": v, "enable": False}]},
    lambda v: {"overrides": [{"match": "x", "states": v}]},
    lambda v: {"overrides": [{"match": "x", "states": {"exp_avg": v}}]},
    lambda v: {"overrides": [{"match": "x", "weights": v}]},
    lambda v: {"QUANT": v}, lambda v: {"QUANT": {"M": v}}, lambda v: {"QUANT": {"M": {"THRESHOLD": v}}},
    lambda v: {"QUANT": {"M": {"SCALE_TYPE": v}}}, lambda v: {"QUANT": {"M": {"ROUND_TYPE": v}}},
    lambda v: {"BASE": v}, lambda v: {v: 1} if not isinstance(v, (list, dict)) else {"x": v},
]


@pytest.mark.parametrize("slot,value", list(itertools.product(range(len(_SLOTS)), range(len(_ODD)))))
def test_odd_values_never_crash(slot, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = _SLOTS[slot](_ODD[value])
    try:
        load_config(data)
    except QConfigError as e:
        assert e.problems and all(isinstance(p, Problem) for p in e.problems)


@pytest.mark.parametrize("text,key_path", [
    ("states: &x [*x]\n", "states"),
    ("overrides: &x [*x]\n", "overrides[0]"),
    ("states: &x {exp_avg: *x}\n", "states.exp_avg.exp_avg"),
    ("? [a, b]\n: 1\n", ""),
])
def test_self_referencing_and_odd_yaml(tmp_path, text, key_path):
    path = _write(tmp_path, text)
    with pytest.raises(QConfigError) as info:
        load_config(path)
    assert info.value.problems[0].key_path == key_path
    assert len(str(info.value)) < 400


# -- hostile input: the work a config can cause is bounded, every failure is a QConfigError ----------
def _merge_key_bomb(levels: int, width: int = 11) -> str:
    """~80 bytes per level; each level merges `width` copies of the previous one (flattened by
    PyYAML into width**level key/value pairs)."""
    lines = ["x0: &a0 {k: 1}"]
    for i in range(1, levels):
        lines.append(f"x{i}: &a{i}\n  <<: [{', '.join([f'*a{i - 1}'] * width)}]\n  k{i}: 1")
    lines.append(f"states:\n  exp_avg:\n    <<: [*a{levels - 1}]")
    return "\n".join(lines) + "\n"


def _alias_bomb(levels: int, width: int = 10) -> str:
    """The billion-laughs list: each level a list of `width` aliases of the previous one."""
    lines = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + f"\noverrides: *l{levels - 1}\n"


@pytest.mark.parametrize("text", [_merge_key_bomb(6), _merge_key_bomb(8), _alias_bomb(9)],
                         ids=["merge-key-bomb-6", "merge-key-bomb-8", "alias-bomb-9"])
def test_yaml_bombs_refused_in_bounded_time_and_memory(tmp_path, text):
    # merge-key-bomb-6: 160k merged pairs, ~2 s and ~200 MB before; -8 (600 bytes): 19M pairs, minutes and GBs
    import time
    import tracemalloc
    path = _write(tmp_path, text)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(QConfigError) as info:
            load_config(path)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    (p,) = info.value.problems
    assert "YAML document expands to more than 10000 nodes (each use of an alias or merge key '<<' counts its " \
           "whole anchor) (allowed: at most 10000 nodes)" in str(p)
    assert elapsed < 10 and peak < 16 << 20, (elapsed, peak)


@pytest.mark.parametrize("text,fragment", [
    ("a: [" + ", ".join(["1"] * 12000) + "]\n", "has more than 10000 nodes"),
    ("a: " + "[" * 70 + "]" * 70 + "\n", "nests deeper than 64 levels"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper than 64 levels"),  # past the composer's recursion
    ("".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 200)).replace("[*a0]", "[1]"), "nests deeper than 64"),
], ids=["many-nodes", "deep-70", "deep-5000", "alias-chain"])
def test_yaml_size_and_depth_limits(tmp_path, text, fragment):
    import time
    start = time.perf_counter()
    with pytest.raises(QConfigError) as info:
        load_config(_write(tmp_path, text))
    (p,) = info.value.problems
    assert fragment in str(p) and "(allowed: at most " in str(p) and p.line is not None, str(p)
    assert time.perf_counter() - start < 10


def test_small_anchors_and_merges_still_load(tmp_path):
    text = "states:\n  exp_avg: &s {bits: 8, group_size: 64}\n  exp_avg_sq: {<<: *s, signed: false, map: power-1}\n" + \
        "overrides:\n" + "".join(f"  - {{match: 'l{i}.*', states: {{exp_avg: *s}}}}\n" for i in range(500))
    cfg = load_config(_write(tmp_path, text))
    assert len(cfg.overrides) == 500 and cfg.states["exp_avg_sq"].group_size == 64


@pytest.mark.parametrize("literal", ["9" * 5000, "-" + "9" * 4301, "0x" + "f" * 5000, "1:" + ":".join(["59"] * 3000),
                                     "0b" + "1" * 200, "1" + "_0" * 100])
def test_overlong_integer_literals(tmp_path, literal):
    path = _write(tmp_path, f"min_numel: {literal}\n")
    with pytest.raises(QConfigError) as info:
        load_config(path)
    (p,) = info.value.problems
    assert (p.line, p.column) == (1, 12)
    assert f"integer of {len(literal)} characters is too long (allowed: at most 100 characters)" in str(p)


@pytest.mark.parametrize("value,fragment", [
    ("2001-13-01", "cannot build a timestamp from '2001-13-01': month must be in 1..12"),
    ("!!float abc", "cannot build a float from 'abc'"),
    ("!!int abc", "cannot build a int from 'abc'"),
    ("!!timestamp x", "cannot build a timestamp from 'x'"),
    ("!!bool maybe", "cannot build a bool from 'maybe'"),
])
def test_unbuildable_scalars(tmp_path, value, fragment):
    path = _write(tmp_path, f"states:\n  exp_avg:\n    bits: {value}\n")
    with pytest.raises(QConfigError) as info:
        load_config(path)
    (p,) = info.value.problems
    assert p.line == 3 and "YAML error: " + fragment in str(p), str(p)


@pytest.mark.parametrize("data,key_path", [
    ({"min_numel": 10**5000}, "min_numel"),
    ({"states": {"exp_avg": {"group_size": -(10**5000)}}}, "states.exp_avg.group_size"),
    ({"overrides": [{"max_numel": 10**5000, "enable": False}]}, "overrides[0].max_numel"),
    ({"QUANT": {"SQM": {"THRESHOLD": 10**5000}}}, "QUANT.SQM.THRESHOLD"),
    ({10**5000: 1}, "an integer of about 5001 digits"),
    ({"states": {"exp_avg": {10**5000: 1}}}, "states.exp_avg.an integer of about 5001 digits"),
    ({"QUANT": {}, 10**5000: 1}, ""),
])
def test_huge_python_ints_give_readable_errors(data, key_path):
    with pytest.raises(QConfigError) as info:
        load_config(data)
    assert any(p.key_path == key_path for p in info.value.problems), [p.key_path for p in info.value.problems]
    assert "integer of about 5001 digits" in str(info.value)
    for p in info.value.problems:
        assert len(repr(p)) < 2000 and len(str(p)) < 1000  # printable: no 5000-digit conversion


# Every integer field has an upper bound that keeps the first step from overflowing or allocating.
@pytest.mark.parametrize("text,key_path,allowed", [
    (f"states: {{exp_avg: {{group_size: {2**63}}}}}\n", "states.exp_avg.group_size", "integer 1..16777216 = 2^24"),
    (f"states: {{exp_avg_sq: {{group_size: {2**30}}}}}\n", "states.exp_avg_sq.group_size", "1..16777216"),
    (f"states: {{exp_avg: {{group_size: {2**24 + 1}}}}}\n", "states.exp_avg.group_size", "1..16777216"),
    (f"QUANT: {{M: {{GROUP_SIZE: {2**30}}}}}\n", "QUANT.M.GROUP_SIZE", "1..16777216"),
    (f"min_numel: {2**63}\n", "min_numel", "integer 0..9223372036854775807 = 2^63-1"),
    (f"states: {{exp_avg: {{min_numel: {2**64}}}}}\n", "states.exp_avg.min_numel", "2^63-1 or null"),
    (f"QUANT: {{SQM: {{THRESHOLD: {2**63}}}}}\n", "QUANT.SQM.THRESHOLD", "2^63-1 or null"),
    ("overrides: [{ndim: 65, enable: false}]\n", "overrides[0].ndim", "integer 0..64"),
    (f"overrides: [{{min_numel: {2**63}, enable: false}}]\n", "overrides[0].min_numel", "2^63-1"),
    (f"overrides: [{{max_numel: {2**63}, enable: false}}]\n", "overrides[0].max_numel", "2^63-1"),
    (f"overrides: [{{match: x, states: {{exp_avg: {{group_size: {2**40}}}}}}}]\n",
     "overrides[0].states.exp_avg.group_size", "1..16777216"),
    (f"weights: {{compensation: kahan, compensation_codec: {{group_size: {2**63}}}}}\n",
     "weights.compensation_codec.group_size", "1..16777216"),
])
def test_integer_upper_bounds(tmp_path, text, key_path, allowed):
    with pytest.raises(QConfigError) as info:
        load_config(_write(tmp_path, text))
    (p,) = info.value.problems
    assert p.key_path == key_path and "is out of range" in p.message and allowed in p.allowed, str(p)


def test_integer_upper_bounds_are_inclusive_and_apply_to_constructors(tmp_path):
    from qconf.config import StateConfig
    cfg = load_config({"min_numel": 2**63 - 1, "states": {"exp_avg": {"group_size": 2**24}},
                       "overrides": [{"ndim": 64, "max_numel": 2**63 - 1, "enable": False}]})
    assert cfg.states["exp_avg"].group_size == 2**24 and cfg.min_numel == 2**63 - 1
    with pytest.raises(QConfigError, match="group_size: 1073741824 is out of range"):
        StateConfig(group_size=2**30)


# -- unbounded or blocking reads ---------------------------------------------------------------------
@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
@pytest.mark.parametrize("make", [lambda tmp: "/dev/zero", lambda tmp: {"base": "/dev/zero"}])
def test_device_is_not_a_config(tmp_path, make):
    with pytest.raises(QConfigError, match="/dev/zero: cannot read config file: it is not a regular file"):
        load_config(make(tmp_path))


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_without_blocking(tmp_path):
    import os
    import threading
    fifo = tmp_path / "pipe.yml"
    os.mkfifo(fifo)
    top = _write(tmp_path, "base: pipe.yml\n")
    outcome: list[BaseException | None] = []

    def run():
        for src in (fifo, top):
            try:
                load_config(src)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 -- reported by the assertions below
                outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():  # unblock a reader stuck in open() so the process can exit
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert len(outcome) == 2, "load_config blocked on a FIFO"
    assert all(isinstance(e, QConfigError) and "not a regular file" in str(e) for e in outcome), outcome


def test_oversized_file_is_refused_unread(tmp_path):
    path = tmp_path / "huge.yml"
    with open(path, "wb") as f:
        f.write(b"min_numel: 1\n# ")
        f.truncate(64 << 20)  # sparse: a 64 MiB file whose reading alone would take the whole budget
    with pytest.raises(QConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: config file is larger than 65536 bytes (allowed: at most 65536 bytes)"
    path.write_bytes(b"min_numel: 1\n" + b"#" * ((64 << 10) - 20) + b"\n")  # just under the limit loads
    assert load_config(path).min_numel == 1


@pytest.mark.parametrize("src", ["a\0b.yml", {"base": "a\0b.yml"}, {"base": ["x.yml", "\0"]}])
def test_nul_in_paths(tmp_path, monkeypatch, src):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(QConfigError):
        load_config(src)


def test_pathlike_giving_bytes(tmp_path):
    class BytesPath:
        def __fspath__(self):
            return bytes(tmp_path / "c.yml")

    (tmp_path / "c.yml").write_text("min_numel: 3\n")
    assert load_config(BytesPath()).min_numel == 3
    with pytest.raises(QConfigError, match="base_dir 3 is not a path"):
        load_config({}, base_dir=3)


# -- inheritance: each file counts once --------------------------------------------------------------
def test_doubling_base_chain_merges_each_file_once(tmp_path):
    # f0 names f1 twice, f1 names f2 twice, ...: 2**12 - 1 merged overrides before, one per file now
    n = 12
    (tmp_path / f"f{n - 1}.yml").write_text(f"overrides: [{{match: x{n - 1}, enable: false}}]\n")
    for i in range(n - 2, -1, -1):
        (tmp_path / f"f{i}.yml").write_text(f"base: [f{i + 1}.yml, ./f{i + 1}.yml]\n"
                                            f"overrides: [{{match: x{i}, enable: false}}]\n")
    cfg = load_config(tmp_path / "f0.yml")
    assert [o.match for o in cfg.overrides] == [f"x{i}" for i in range(n - 1, -1, -1)]


def test_diamond_applies_shared_base_once_before_its_users(tmp_path):
    # a -> [b, c], b -> d, c -> d: merged in the order d, b, c, a; c does not re-apply d over b
    (tmp_path / "d.yml").write_text("states: {exp_avg: {bits: 4}}\noverrides: [{match: d, enable: false}]\n")
    (tmp_path / "b.yml").write_text("base: d.yml\nstates: {exp_avg: {bits: 8}}\n"
                                    "overrides: [{match: b, enable: false}]\n")
    (tmp_path / "c.yml").write_text("base: d.yml\noverrides: [{match: c, enable: false}]\n")
    cfg = load_config(_write(tmp_path, "base: [b.yml, c.yml]\noverrides: [{match: a, enable: false}]\n"))
    assert [o.match for o in cfg.overrides] == ["d", "b", "c", "a"]
    assert cfg.states["exp_avg"].bits == 8


def test_cycle_through_a_diamond_is_an_error(tmp_path):
    (tmp_path / "b.yml").write_text("base: d.yml\n")
    (tmp_path / "c.yml").write_text("base: [d.yml, bad.yml]\n")
    (tmp_path / "d.yml").write_text("min_numel: 1\n")
    path = _write(tmp_path, "base: [b.yml, c.yml]\n")
    with pytest.raises(QConfigError, match=r"c.yml: base\[1\]: base cycle: bad.yml -> c.yml -> bad.yml"):
        load_config(path)


def test_too_many_base_files(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.yml").write_text(f"base: f{i + 1}.yml\n" if i < 39 else "min_numel: 1\n")
    with pytest.raises(QConfigError) as info:
        load_config(tmp_path / "f0.yml")
    (p,) = info.value.problems
    assert p.file.endswith("f31.yml") and p.key_path == "base"
    assert "more than 32 files in the base chain" in str(p) and "at most 32 distinct files" in str(p)
    assert load_config(tmp_path / "f8.yml").min_numel == 1  # 32 files: fine


def test_overlong_match_pattern(tmp_path):
    text = f"overrides: [{{match: '{'a*' * 1000}x', enable: false}}]\n"
    with pytest.raises(QConfigError) as info:
        load_config(_write(tmp_path, text))
    (p,) = info.value.problems
    assert p.key_path == "overrides[0].match" and "pattern of 2001 characters is too long" in p.message
    assert "at most 2000 characters" in p.allowed
    assert load_config(_write(tmp_path, text.replace("x'", "'"))).overrides[0].match == "a*" * 1000
