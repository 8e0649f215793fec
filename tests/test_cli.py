"""The qconf CLI (validate, show) via qconf.cli.main([...]); closed pipes, unusable --out directories and
non-UTF-8 file names under an ASCII locale in a real subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import qconf.cli
from qconf._table import format_table
from qconf.bench.cli import SIZE_CHOICES
from qconf.cli import MAX_SHAPE_NUMEL, build_parser, main, parse_model_shapes
from qconf.config import load_config, resolve_plan
from qconf.config.builtin import builtin_names

REPO = Path(__file__).resolve().parents[1]
DEFAULT = str(REPO / "configs" / "default.yml")
SHAPES = "embed.weight=1000x64,layers.0.attn.weight=64x64,layers.0.attn.bias=64,head.weight=64x1000,temp=scalar"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- validate ----------------------------------------------------------------------------------------
def test_validate_shipped(capsys):
    files = sorted(str(p) for p in (REPO / "configs").glob("*.yml"))
    code, out, _ = run(capsys, "validate", *files)
    assert code == 0
    assert out.splitlines() == [f"OK  {f}" for f in files]


def test_validate_bad_file_one_line_per_problem(capsys, tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("states:\n  exp_avg_sq:\n    bits: 9\n    grop_size: 4\nweights: {rounding: sr}\n")
    code, out, _ = run(capsys, "validate", DEFAULT, str(bad))
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"OK  {DEFAULT}"
    assert lines[1:] == [
        f"{bad}: states.exp_avg_sq.bits: 9 is out of range (allowed: integer 1..8)",
        f"{bad}: states.exp_avg_sq.grop_size: unknown key 'grop_size' (allowed: enable, bits, map, signed, scale, "
        "group_size, rounding, min_numel); did you mean 'group_size'?",
        f"{bad}: weights.rounding: 'sr' is not a valid weights rounding mode (allowed: nearest, stochastic); "
        "did you mean 'stochastic'?",
    ]


def test_validate_missing_and_syntax(capsys, tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text("a: [1,\n")
    code, out, _ = run(capsys, "validate", str(tmp_path / "missing.yml"), str(broken))
    assert code == 1
    lines = out.splitlines()
    assert len(lines) == 2
    assert "missing.yml" in lines[0] and "not found" in lines[0]
    assert lines[1].startswith(f"{broken}:2:1: YAML syntax error:")


def test_validate_not_utf8_names_byte_line_and_column(capsys, tmp_path):
    f = tmp_path / "latin1.yml"
    f.write_bytes("min_numel: 4096\n# café\n".encode("latin-1"))
    code, out, _ = run(capsys, "validate", str(f))
    assert code == 1
    assert out.splitlines() == [f"{f}:2:6: config file is not UTF-8 text: byte 0xe9 at byte offset 21 does not begin "
                                "a valid UTF-8 character (allowed: UTF-8 text)"]  # not PyYAML's '"<byte string>"'


@pytest.mark.parametrize("kind", ["directory", "missing", "device"])
def test_compare_reports_unreadable_config_as_validate_does(capsys, tmp_path, kind):
    path = {"directory": str(tmp_path), "missing": str(tmp_path / "missing.yml"), "device": os.devnull}[kind]
    code, out, _ = run(capsys, "validate", path)
    assert code == 1
    (problem,) = out.splitlines()
    assert problem == {"directory": f"{path}: cannot read config file: it is a directory (allowed: a YAML file)",
                       "missing": f"{path}: config file not found",
                       "device": f"{path}: cannot read config file: it is not a regular file (a device, FIFO or "
                                 "socket) (allowed: a YAML file)"}[kind]
    code, out, err = run(capsys, "compare", "default", path, "--no-progress")  # checked before any training
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"qconf compare: error: {problem}"]


def test_validate_warnings_are_not_failures(capsys, tmp_path):
    f = tmp_path / "lpmm.yml"
    f.write_text("QUANT:\n  P: {BITS: 8}\n  M:\n    EXCLUDE_SUFFIX: ['bias']\n    BITS: 4\n")
    code, out, _ = run(capsys, "validate", str(f))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("warning: ") and "QUANT.P" in lines[0] and "QUANT.M.EXCLUDE_SUFFIX" in lines[0]
    assert lines[1] == f"OK  {f}"


def test_validate_lpmm_twins(capsys):
    files = sorted(str(p) for p in (REPO / "tests" / "fixtures" / "lpmm").glob("*.yml"))
    code, out, _ = run(capsys, "validate", *files)
    assert code == 0 and len(out.splitlines()) == len(files)


# -- show ----------------------------------------------------------------------------------------------
def test_show_prints_resolved_yaml(capsys):
    code, out, _ = run(capsys, "show", str(REPO / "configs" / "2nd_moment_only_default.yml"))
    assert code == 0
    body = "\n".join(line for line in out.splitlines() if not line.startswith("#"))
    data = yaml.safe_load(body)
    assert data == load_config(REPO / "configs" / "2nd_moment_only_default.yml").to_dict()
    assert data["states"]["exp_avg"]["enable"] is False and "base" not in data


def test_show_table(capsys):
    code, out, _ = run(capsys, "show", DEFAULT, "--model-shapes", SHAPES)
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("param"))
    assert lines[header].split() == ["param", "shape", "numel", "exp_avg", "exp_avg", "B", "exp_avg_sq",
                                     "exp_avg_sq", "B", "total", "B", "fp32", "B"]
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    rows = {line.split()[0]: line for line in lines[header + 2:] if line.strip()}
    embed = rows["embed.weight"]
    assert "1000x64" in embed and "64000" in embed
    assert "4-bit nonlinear group128" in embed and "4-bit unsigned power-1 rank1" in embed
    plan = resolve_plan(load_config(DEFAULT), "embed.weight", (1000, 64))
    assert str(plan.state_nbytes("exp_avg")) in embed and str(plan.nbytes()) in embed
    assert str(plan.fp32_nbytes() * 2) in embed
    assert rows["layers.0.attn.weight"].count("fp32") == 2            # 4096 elements: not > 4096
    assert rows["layers.0.attn.bias"].count("fp32") == 2
    assert "scalar" in rows["temp"]
    assert "total" in rows and "B/param" in rows
    total_numel = 64000 + 4096 + 64 + 64000 + 1
    assert str(total_numel) in rows["total"]
    assert rows["B/param"].split()[-1] == "8.000"


def test_show_numbers_right_aligned(capsys):
    _, out, _ = run(capsys, "show", DEFAULT, "--model-shapes", "a=10000,bb=5")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("param"))
    a, b = lines[header + 2], lines[header + 3]
    col_end = lines[header].index("numel") + len("numel")
    assert a[:col_end].endswith("10000") and b[:col_end].endswith("5")


def test_show_json(capsys):
    code, out, _ = run(capsys, "show", DEFAULT, "--model-shapes", SHAPES, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["config"] == load_config(DEFAULT).to_dict()
    names = [p["name"] for p in data["params"]]
    assert names == ["embed.weight", "layers.0.attn.weight", "layers.0.attn.bias", "head.weight", "temp"]
    embed = data["params"][0]
    assert embed["shape"] == [1000, 64] and embed["numel"] == 64000
    assert embed["states"]["exp_avg_sq"]["codec"]["scale"] == "rank1"
    assert data["params"][1]["states"]["exp_avg"] == {"quantized": False, "codec": None, "description": "fp32",
                                                      "nbytes": 4 * 4096}
    assert data["params"][4]["shape"] == []
    totals = data["totals"]
    assert totals["nbytes"] == sum(p["nbytes"] for p in data["params"])
    assert totals["fp32_nbytes"] == 8 * totals["numel"]


def test_show_json_without_shapes(capsys):
    code, out, _ = run(capsys, "show", DEFAULT, "--json")
    assert code == 0
    data = json.loads(out)
    assert "params" not in data and data["config"]["states"]["exp_avg_sq"]["scale"] == "rank1"


def test_show_overrides_in_table(capsys, tmp_path):
    f = tmp_path / "o.yml"
    f.write_text(f"base: {DEFAULT}\noverrides:\n  - {{match: 'embed*', states: {{exp_avg_sq: {{bits: 8}}}}}}\n"
                 "  - {match: '*.bias', enable: true}\n")
    code, out, _ = run(capsys, "show", str(f), "--model-shapes", SHAPES)
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "8-bit unsigned power-1 rank1" in rows["embed.weight"]
    assert "4-bit unsigned power-1 rank1" in rows["head.weight"]
    assert "fp32" not in rows["layers.0.attn.bias"]                     # forced on below the threshold


@pytest.mark.parametrize("spec", ["w=4xa", "w", "=4", "w=", "w=4x", "w=-1", "w=4,w=5", "a=1,,b=2", "w=4.5"])
def test_show_bad_shapes_exit_2(capsys, spec):
    code, out, err = run(capsys, "show", DEFAULT, "--model-shapes", spec)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--model-shapes" in lines[0]


@pytest.mark.parametrize("spec, words", [
    ("w=x", ["'w=x'", "shape 'x' has an empty dimension"]),
    ("w=1²", ["'w=1²'", "dimension '1²' is not a positive integer"]),             # str.isdigit() takes '²'
    ("w=4x0", ["'w=4x0'", "dimension '0' is not a positive integer"]),
    ("w=1" + "0" * 40, ["shape '1000", "has more than 2**48 = 281474976710656 elements"]),   # printed 1e40 B before
    ("w=65536x65536x65536x2", ["'w=65536x65536x65536x2'", "has more than 2**48"]),
    ("w=" + "9" * 5000, ["has more than 2**48"]),                                 # no int() of 5000 digits
])
def test_show_bad_sizes_name_item_and_bound(capsys, spec, words):
    code, out, err = run(capsys, "show", DEFAULT, "--model-shapes", spec)
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("qconf show: error: --model-shapes: ") and "int()" not in line
    assert all(w in line for w in words), line
    assert "(allowed: name=AxB,... with positive integer dimensions, at most 2**48 elements per parameter" in line


def test_model_shapes_bound_is_inclusive():
    assert MAX_SHAPE_NUMEL == 2**48
    assert parse_model_shapes("w=65536x65536x65536,b=0001") == [("w", (65536, 65536, 65536)), ("b", (1,))]


def test_show_bad_config_exit_1(capsys, tmp_path):
    f = tmp_path / "bad.yml"
    f.write_text("states: {exp_avg: {map: nonlinar}}\n")
    code, out, err = run(capsys, "show", str(f), "--model-shapes", "w=5")
    assert code == 1 and out == ""
    assert err.strip() == (f"{f}: states.exp_avg.map: 'nonlinar' is not a valid map (allowed: nonlinear, "
                           "nonlinear-nozero, power-1, power-2, power-3, linear, float-point, ternary); did you mean "
                           "'nonlinear'?")


def test_parse_model_shapes():
    assert parse_model_shapes("a=4x5, b.c = 7 ,d=scalar,e=()") == [("a", (4, 5)), ("b.c", (7,)), ("d", ()), ("e", ())]
    assert parse_model_shapes("w=2X3x4") == [("w", (2, 3, 4))]


def test_model_shapes_may_repeat(capsys):
    code, out, _ = run(capsys, "show", DEFAULT, "--model-shapes", "a=5", "--model-shapes", "b=6", "--json")
    assert code == 0 and [p["name"] for p in json.loads(out)["params"]] == ["a", "b"]


# -- help and usage ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["validate", "--help"], ["show", "--help"]])
def test_help(capsys, argv):
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "usage: qconf" in out


def test_usage_errors(capsys):
    assert run(capsys)[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "validate")[0] == 2


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("qconf ")


def test_bench_size_help_and_error_list_the_same_choices(capsys):
    code, out, _ = run(capsys, "bench", "--help")
    assert code == 0 and "--size {big,many,one,both,all}" in out
    assert SIZE_CHOICES == ("big", "many", "one", "both", "all")
    code, _, err = run(capsys, "bench", "--size", "huge")
    assert code == 2
    assert err.splitlines()[-1] == ("qconf bench: error: argument --size: invalid choice: 'huge' (choose from big, "
                                    "many, one, both, all)")  # not the smoke-test 'tiny' that --help hides
    assert build_parser().parse_args(["bench", "--size", "tiny"]).size == "tiny"  # still accepted


# -- table formatter -------------------------------------------------------------------------------------
def test_format_table():
    text = format_table(["name", "n", "x"], [["a", 1, 0.5], ["long", 12345, None]])
    assert text.splitlines() == [
        "name      n      x",
        "----  -----  -----",
        "a         1  0.500",
        "long  12345",
    ]
    with pytest.raises(ValueError):
        format_table(["a"], [[1, 2]])


# -- built-in config names -------------------------------------------------------------------------------
def test_validate_and_show_builtin_names(capsys):
    code, out, _ = run(capsys, "validate", "default", "8bit", "fp32", "2nd_moment_group_128")
    assert code == 0
    assert out.splitlines() == ["OK  default", "OK  8bit", "OK  fp32", "OK  2nd_moment_group_128"]
    code, out, _ = run(capsys, "show", "default", "--json")
    assert code == 0 and json.loads(out)["config"] == load_config(DEFAULT).to_dict()


def test_validate_list_shows_every_builtin(capsys):
    code, out, _ = run(capsys, "validate", "--list")
    assert code == 0
    lines = out.splitlines()
    names = sorted(p.stem for p in (REPO / "configs").glob("*.yml"))
    assert [line.split()[0] for line in lines[:-1]] == names == builtin_names()
    assert lines[names.index("default")].split(None, 1)[1].startswith("The paper's \"4-bit AdamW\"")
    assert lines[-1].startswith(f"# {len(names)} built-in configs in ")
    code, _, err = run(capsys, "validate", "--list", "default")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--list takes no FILE" in err


def test_validate_list_descriptions_are_whole_sentences(capsys):
    """A first sentence that runs over several comment lines is shown whole, on one line when piped."""
    code, out, _ = run(capsys, "validate", "--list")
    assert code == 0
    rows = dict(line.split(None, 1) for line in out.splitlines()[:-1])
    assert rows["8bit"].endswith("exp_avg signed, exp_avg_sq unsigned; tensors with <= 4096 elements keep fp32 "
                                 "states (bnb min_8bit_size=4096).")
    assert rows["bitnet"].endswith("output heads stay full precision (the default exclude list).")
    assert rows["fp32"].endswith("i.e. plain AdamW/SGD/Lion state.")                 # 'i.e.' ends no sentence
    assert rows["default"].endswith('exp_avg B128/DE -- 4-bit, blocks of 128, signed dynamic-exponent map '
                                    '("nonlinear"); exp_avg_sq Rank-1/Linear -- 4-bit, scale = min(row absmax, '
                                    "column absmax), unsigned power-1 map (the paper's \"Linear\": (i+1)/16, no "
                                    "zero point)")                                   # its table, not cut at ':'
    assert all(text.endswith((".", ")")) and "Re-expresses" not in text for text in rows.values())


def test_validate_list_wraps_to_the_terminal(capsys, monkeypatch):
    _, piped, _ = run(capsys, "validate", "--list")
    monkeypatch.setattr(qconf.cli, "_terminal_columns", lambda: 60)
    code, out, _ = run(capsys, "validate", "--list")
    assert code == 0
    lines = out.splitlines()
    indent = " " * (max(map(len, builtin_names())) + 2)
    assert all(len(line) <= 60 for line in lines[:-1]) and any(line.startswith(indent) for line in lines)
    rejoined = "\n".join(lines).replace("\n" + indent, " ")
    assert rejoined.split() == piped.split()  # the same words, nothing dropped


def test_validate_unknown_name_lists_builtins(capsys):
    code, out, _ = run(capsys, "validate", "defualt")
    assert code == 1
    (line,) = out.splitlines()
    assert "'defualt' is neither a config file nor a built-in config name" in line
    assert all(name in line for name in ("default", "8bit", "fp32", "2nd_moment_group_128"))


def test_validate_without_files_is_one_line_usage_error(capsys):
    code, out, err = run(capsys, "validate")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["qconf validate: error: give at least one FILE (a YAML path or a built-in "
                                        "name), or --list"]


# -- the CLI as a process: closed pipes, --out, non-UTF-8 file names ----------------------------------------
def _env(**extra: str) -> dict[str, str]:
    """This checkout (and tests/, for test_study_tasks) first on the path; no inherited I/O encoding."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "PYTHONUTF8", "LC_ALL", "LANG")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def qconf_process(*argv, env=None, cwd=None, **kwargs):
    """``python -m qconf.cli ARGV`` (argv items may be bytes: file names that are not UTF-8)."""
    return subprocess.run([sys.executable, "-m", "qconf.cli", *argv], env=env or _env(), cwd=cwd,
                          capture_output="stdout" not in kwargs, timeout=300, **kwargs)


@pytest.mark.parametrize("argv", [
    ["show", "default", "--json"],                                             # fits the buffer: fails at exit
    ["show", DEFAULT, "--model-shapes", ",".join(f"p{i}=64x64" for i in range(400))],  # fails mid-print
    ["validate", DEFAULT],
], ids=["show-json", "show-long", "validate"])
def test_closed_stdout_ends_quietly(argv):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`| head -c1`) is gone: every write to stdout fails with EPIPE
    try:
        proc = qconf_process(*argv, stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert proc.stderr == b""
    assert proc.returncode == 141  # 128 + SIGPIPE, what a shell shows for `yes | head -1`


def _one_line_error(proc) -> str:
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconf compare: error: --out "), err
    return lines[0]


COMPARE_FAST = ["--task", "test_study_tasks:tiny_task", "--steps", "1", "--seeds", "1", "--no-progress"]


def test_compare_out_existing_file(tmp_path):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    line = _one_line_error(qconf_process("compare", "default", *COMPARE_FAST, "--out", str(target)))
    assert "exists and is not a directory" in line
    assert target.read_text() == "keep me"
    line = _one_line_error(qconf_process("compare", "default", *COMPARE_FAST, "--out", str(target / "sub")))
    assert "results.txt' is not a directory" in line


def _unwritable(tmp_path: Path) -> Path:
    """A directory path that cannot be created: under a read-only directory, or (for root, whom file
    modes do not stop) under /sys, where even root cannot make entries."""
    if os.geteuid() != 0:
        parent = tmp_path / "read-only"
        parent.mkdir(mode=0o500)
    else:
        parent = Path("/sys")
    target = parent / "qconf-test-out"
    with pytest.raises(OSError):  # the premise: this place is not writable
        target.mkdir()
    return target


def test_compare_out_unwritable(tmp_path):
    target = _unwritable(tmp_path)
    line = _one_line_error(qconf_process("compare", "default", *COMPARE_FAST, "--out", str(target)))
    assert f"cannot write in '{target.parent}'" in line
    assert not target.exists()


#: LC_ALL=C: Python's UTF-8 mode (argv bytes as surrogate escapes); and a strict ASCII stdout with it off
ASCII_LOCALES = {"C": {"LC_ALL": "C"}, "C-no-utf8-mode": {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}}


def _non_utf8_config(tmp_path: Path) -> bytes:
    """A copy of default.yml whose file name is not UTF-8 (argv carries it as a surrogate escape)."""
    name = b"cfg-\xff.yml"
    with open(os.path.join(os.fsencode(tmp_path), name), "wb") as f:
        f.write(Path(DEFAULT).read_bytes())
    return name


@pytest.mark.parametrize("locale", list(ASCII_LOCALES))
def test_non_utf8_file_names_validate_show(tmp_path, locale):
    env = _env(**ASCII_LOCALES[locale])
    name = _non_utf8_config(tmp_path)
    proc = qconf_process("validate", name, "8bit", env=env, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert proc.stdout.splitlines() == [b"OK  " + name, b"OK  8bit"]  # the name's own bytes come back
    proc = qconf_process("show", name, env=env, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert proc.stdout.startswith(b"# " + name + b", resolved")


def test_non_utf8_file_names_compare(tmp_path):
    """The strict ASCII locale: outputs are still written (UTF-8, undecodable bytes escaped), the table's
    ± is escaped on stdout; the label shows the undecodable byte as \\xff."""
    name = _non_utf8_config(tmp_path)
    out = b"out-\xfe"
    proc = qconf_process("compare", name, "8bit", *COMPARE_FAST, "--eval-every", "1", "--out", out,
                         env=_env(**ASCII_LOCALES["C-no-utf8-mode"]), cwd=tmp_path)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")
    assert b"\\xb1 " in proc.stdout  # mean \xb1 std: the ASCII terminal cannot show the plus-minus sign
    out_dir = os.path.join(os.fsencode(tmp_path), out)
    written = sorted(os.listdir(out_dir))
    assert written == [b"configs", b"curves.png", b"qerror.png", b"report.md", b"results.csv", b"results.json",
                       b"runs", b"study.json", b"summary.png"]
    assert sorted(os.listdir(os.path.join(out_dir, b"configs"))) == [b"8bit.yml", b"cfg-_xff.yml"]  # ASCII-safe
    with open(os.path.join(out_dir, b"results.csv"), encoding="utf-8") as f:
        assert [row.split(",")[0] for row in f.read().splitlines()] == ["config", "cfg-\\xff", "8bit"]
    with open(os.path.join(out_dir, b"report.md"), encoding="utf-8") as f:
        assert "`cfg-\\xff` (cfg-\\udcff.yml)" in f.read()
