"""The ``qconf`` command line.

    qconf validate FILE... | --list                check configs; one line per problem; list built-ins
    qconf show FILE [--model-shapes SPEC] [--json] the resolved config and per-parameter plan
    qconf bench [--size big|many|both] [...]       optimizer-step benchmark tables (qconf.bench)
    qconf bench --memory [...]                     training-memory benchmark (qconf.bench.memory)
    qconf compare CONFIG... [--vary F=V,..] [...]  train a task under each config, compare (qconf.study)

Subcommands are registered by the functions in :data:`COMMANDS` (each adds one subparser and
sets ``func``), so new ones (``compare``, ``bench``) are one more entry.
A FILE may be a built-in config name (``default``, ``8bit``, ``fp32``, ...: :mod:`qconf.config.builtin`).
Exit codes: 0 success, 1 invalid config, 2 bad command-line usage (one line on stderr), 141 stdout
closed early by its reader (``| head``; quiet, like a tool ended by SIGPIPE).
"""
from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import shutil
import sys
import textwrap
import warnings
from typing import Any, Callable, Sequence

from ._table import format_table
from .config import STATE_NAMES, QConfig, load_config, resolve_plan
from .config.builtin import builtin_dir, builtin_names, builtin_summary, is_builtin_name
from .config.report import Reporter, fmt
from .config.yamlfile import check_config_path
from .errors import QConfigError

__all__ = ["main", "build_parser", "parse_model_shapes", "COMMANDS", "MAX_SHAPE_NUMEL"]

_BUILTIN_HINT = "(e.g. default, 8bit, fp32; qconf validate --list shows all)"
#: exit code of a command whose stdout was closed early (``qconf show ... | head``): 128 + SIGPIPE, what a
#: shell reports for a tool that the signal ended
EXIT_BROKEN_PIPE = 141


def _usage_error(command: str, message: str) -> int:
    """One line on stderr, exit code 2 (bad command-line usage)."""
    print(f"qconf {command}: error: {message}", file=sys.stderr)
    return 2


def _load(path: str) -> tuple[QConfig | None, list[str], QConfigError | None]:
    """Load one config, capturing warnings: ``(config or None, warning messages, error or None)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg, err = load_config(path), None
        except QConfigError as e:
            cfg, err = None, e
    return cfg, [str(w.message) for w in caught], err


def _unreadable_config(path: str) -> str | None:
    """Why the config argument ``path`` names no readable file (not found, a directory, a device), in
    the words ``qconf validate`` uses, or None: a regular file, or a built-in name (loading checks it)."""
    if is_builtin_name(path):
        return None
    rep = Reporter(path)
    return None if check_config_path(path, rep) else "; ".join(map(str, rep.problems))


# ---------------------------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------------------------
def _register_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check config files; --list shows the built-in configs",
                       description="Check qconfig files (native or lpmm format) or built-in configs by name. "
                                   "Prints 'OK  FILE' or one line per problem; exits 1 if any file is invalid.")
    p.add_argument("files", nargs="*", metavar="FILE", help=f"YAML config file or built-in name {_BUILTIN_HINT}")
    p.add_argument("--list", action="store_true", help="list the built-in config names (and check them)")
    p.set_defaults(func=_cmd_validate)


def _cmd_validate(args: argparse.Namespace) -> int:
    if args.list:
        return _list_builtins(args.files)
    if not args.files:
        return _usage_error("validate", "give at least one FILE (a YAML path or a built-in name), or --list")
    status = 0
    for path in args.files:
        _, messages, err = _load(path)
        for message in messages:
            print(f"warning: {message}")
        if err is None:
            print(f"OK  {path}")
        else:
            status = 1
            for problem in err.problems:
                print(problem)
    return status


def _list_builtins(files: Sequence[str]) -> int:
    """``qconf validate --list``: one line per built-in config (name, what it is); exit 1 if any is invalid."""
    if files:
        return _usage_error("validate", "--list takes no FILE")
    status = 0
    names = builtin_names()
    width = max(map(len, names))
    columns = _terminal_columns()
    for name in names:
        _, _, err = _load(name)
        status = status if err is None else 1
        mark = "" if err is None else "  [INVALID: " + "; ".join(map(str, err.problems)) + "]"
        print(_list_entry(f"{name:{width}}  ", builtin_summary(name) + mark, columns))
    print(f"# {len(names)} built-in configs in {builtin_dir()}; use a name wherever a config file is taken")
    return status


def _terminal_columns() -> int | None:
    """The terminal's width when stdout is one, else None (a pipe or file gets one line per entry)."""
    isatty = getattr(sys.stdout, "isatty", None)
    return shutil.get_terminal_size().columns if isatty is not None and isatty() else None


def _list_entry(head: str, text: str, columns: int | None) -> str:
    """``head + text``, wrapped at word boundaries to ``columns`` with continuation lines indented
    under ``text`` (unwrapped when ``columns`` is None or leaves under 30 characters for the text)."""
    if columns is None or columns - len(head) < 30:
        return head + text
    return textwrap.fill(text, columns, initial_indent=head, subsequent_indent=" " * len(head),
                         break_long_words=False, break_on_hyphens=False)




# ---------------------------------------------------------------------------------------------
# show
# ---------------------------------------------------------------------------------------------
#: the most elements ``--model-shapes`` takes for one parameter: 2**48 (~2.8e14, 1 PiB of fp32 per
#: state) is far above any model's largest tensor, and keeps every byte count an exact int64
MAX_SHAPE_NUMEL = 2**48
_SHAPE_ALLOWED = ("name=AxB,... with positive integer dimensions, at most 2**48 elements per parameter, "
                  "e.g. w=4096x1024; or name=scalar")


def parse_model_shapes(spec: str) -> list[tuple[str, tuple[int, ...]]]:
    """Parse ``'name=AxB,name2=C,bias=scalar'`` into ``[(name, shape), ...]``; ``ValueError`` naming the
    bad entry and what is allowed on bad input. ``scalar`` or ``()`` is a 0-d shape; dimensions are
    positive and a shape has at most :data:`MAX_SHAPE_NUMEL` elements."""
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"empty entry in {spec!r} (expected name=AxB,name2=C,...)")
        name, eq, dims = (s.strip() for s in item.partition("="))
        if not eq or not name or not dims:
            raise ValueError(f"{item!r} is not name=shape (expected name=AxB,name2=C,...)")
        shape = _parse_shape(item, dims)
        if name in seen:
            raise ValueError(f"parameter {name!r} is given twice")
        seen.add(name)
        out.append((name, shape))
    return out


def _parse_shape(item: str, dims: str) -> tuple[int, ...]:
    """The shape ``dims`` (``'AxB'``, ``'scalar'``) of the ``--model-shapes`` entry ``item``; ValueError
    naming the entry, the bad dimension and what is allowed."""
    if dims.lower() in ("scalar", "()"):
        return ()
    parts = [d.strip() for d in dims.lower().split("x")]
    for d in parts:
        if not d:
            raise ValueError(f"{fmt(item)}: shape {fmt(dims)} has an empty dimension (allowed: {_SHAPE_ALLOWED})")
        if not (d.isascii() and d.isdigit()) or not d.strip("0"):  # isdigit alone takes '²'; int() does not
            raise ValueError(f"{fmt(item)}: dimension {fmt(d)} is not a positive integer (allowed: {_SHAPE_ALLOWED})")
    # more than 15 digits is more than 2**48; checked before int(), which is slow on (and refuses) huge texts
    if any(len(d.lstrip("0")) > 15 for d in parts) or math.prod(map(int, parts)) > MAX_SHAPE_NUMEL:
        raise ValueError(f"{fmt(item)}: shape {fmt(dims)} has more than 2**48 = {MAX_SHAPE_NUMEL} elements "
                         f"(allowed: {_SHAPE_ALLOWED})")
    return tuple(map(int, parts))


def _register_show(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print the resolved config and per-parameter plan",
                       description="Print a config in resolved native form (every key explicit) and, with "
                                   "--model-shapes, which codec each optimizer state of each parameter gets "
                                   "and how many bytes it takes.")
    p.add_argument("file", metavar="FILE", help=f"YAML config file or built-in name {_BUILTIN_HINT}")
    p.add_argument("--model-shapes", action="append", metavar="SPEC",
                   help="parameters as name=AxB,name2=C,... (name is the qualified parameter name, e.g. "
                        "layers.0.attn.weight; dimensions are positive integers, at most 2**48 elements per "
                        "parameter; 'scalar' for a 0-d parameter); may be repeated")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead")
    p.set_defaults(func=_cmd_show)


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def _plan_data(cfg: QConfig, params: list[tuple[str, tuple[int, ...]]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    plans = [resolve_plan(cfg, name, shape) for name, shape in params]
    rows = [p.to_dict() for p in plans]
    numel = sum(p.numel for p in plans)
    total = sum(p.nbytes() for p in plans)
    fp32 = sum(p.fp32_nbytes() for p in plans) * len(STATE_NAMES)
    totals = {
        "numel": numel,
        "states": {s: sum(p.state_nbytes(s) for p in plans) for s in STATE_NAMES},
        "nbytes": total,
        "fp32_nbytes": fp32,
        "bytes_per_param": total / numel if numel else None,
        "fp32_bytes_per_param": fp32 / numel if numel else None,
    }
    return rows, totals


def _plan_table(rows: list[dict[str, Any]], totals: dict[str, Any]) -> str:
    headers = ["param", "shape", "numel"]
    for s in STATE_NAMES:
        headers += [s, f"{s} B"]
    headers += ["total B", "fp32 B"]
    body: list[list[Any]] = []
    for r in rows:
        line: list[Any] = [r["name"], _shape_text(r["shape"]), r["numel"]]
        for s in STATE_NAMES:
            line += [r["states"][s]["description"], r["states"][s]["nbytes"]]
        body.append(line + [r["nbytes"], r["fp32_nbytes"]])
    n = totals["numel"]
    line = ["total", "", n]
    for s in STATE_NAMES:
        line += ["", totals["states"][s]]
    body.append(line + [totals["nbytes"], totals["fp32_nbytes"]])
    line = ["B/param", "", None]
    for s in STATE_NAMES:
        line += ["", totals["states"][s] / n if n else None]
    body.append(line + [totals["bytes_per_param"], totals["fp32_bytes_per_param"]])
    return format_table(headers, body)


def _cmd_show(args: argparse.Namespace) -> int:
    params = None
    if args.model_shapes:
        try:
            params = parse_model_shapes(",".join(args.model_shapes))
        except ValueError as e:
            return _usage_error("show", f"--model-shapes: {e}")
    cfg, messages, err = _load(args.file)
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)
    if err is not None:
        for problem in err.problems:
            print(problem, file=sys.stderr)
        return 1
    assert cfg is not None
    rows, totals = _plan_data(cfg, params) if params is not None else (None, None)
    if args.json:
        out: dict[str, Any] = {"file": args.file, "config": cfg.to_dict(), "warnings": messages}
        if rows is not None:
            out["params"] = rows
            out["totals"] = totals
        print(json.dumps(out, indent=2))
        return 0
    print(f"# {args.file}, resolved (every key explicit)")
    print(cfg.to_yaml().rstrip())
    if rows is not None:
        print()
        print(f"# per-parameter plan: a state is quantized iff enabled and numel > min_numel "
              f"({cfg.min_numel} unless the state sets its own), unless an override decides")
        print(_plan_table(rows, totals))
        if totals["fp32_nbytes"]:
            ratio = totals["nbytes"] / totals["fp32_nbytes"]
            print(f"\nstate memory: {totals['nbytes']} B = {100 * ratio:.1f}% of fp32 ({totals['fp32_nbytes']} B)")
    return 0


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------
def _register_bench(sub: argparse._SubParsersAction) -> None:
    from .bench import add_arguments

    p = sub.add_parser("bench", help="benchmark the optimizer step against torch/torchao/bitsandbytes",
                       description="Time one AdamW step of qconf (fused and reference), torch.optim.AdamW "
                                   "(for-loop, foreach, fused), torchao and bitsandbytes low-bit AdamW on the same "
                                   "parameters and gradients, in interleaved rounds, and print one table per size: "
                                   "ns/param, ratio to torch fused AdamW, state bytes/param, peak extra RSS during "
                                   "step(). See docs/benchmarks.md. With --memory instead: train a 105M-parameter "
                                   "GPT-style transformer with each optimizer and report peak bytes/param split into "
                                   "params, grads, optimizer states and other, ms/step and the final loss.")
    add_arguments(p)
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import execute

    return execute(args, "qconf bench")


# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------
def _register_compare(sub: argparse._SubParsersAction) -> None:
    from .study.cli import DESCRIPTION, EPILOG, add_arguments, one_line_errors

    p = sub.add_parser("compare", help="compare configs by training a task (loss, stability, memory, state error)",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    one_line_errors(p)
    p.set_defaults(func=_cmd_compare)


def _cmd_compare(args: argparse.Namespace) -> int:
    from .study.arguments import split_optimizer
    from .study.cli import execute
    from .study.task import StudyError

    for item in args.configs:  # a directory or device is reported as validate reports it, not as "not found"
        try:
            path, _ = split_optimizer(item)  # CONFIG@OPTIMIZER
        except StudyError:
            continue  # execute() reports the unknown optimizer
        problem = _unreadable_config(path)
        if problem is not None:
            return _usage_error("compare", problem)
    return execute(args)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
#: Subcommand registrations, in help order: each takes the subparsers action, adds its parser and
#: sets ``func(args) -> int`` as a default.
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_register_validate, _register_show, _register_bench,
                                                                _register_compare]


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="qconf", description="Configurable quantization of optimizer states: check and inspect qconfigs, compare them on a task, benchmark the optimizer step.")
    parser.add_argument("--version", action="version", version=f"qconf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def _escape_unencodable(err: UnicodeError) -> tuple[str | bytes, int]:
    """Encoding error handler for stdout: a file name's undecodable bytes (surrogate escapes from
    ``sys.argv``) go out as those very bytes, any other character the terminal cannot encode (a
    table's ``±`` on an ASCII terminal) as a backslash escape."""
    try:
        return codecs.lookup_error("surrogateescape")(err)
    except UnicodeError:
        return codecs.lookup_error("backslashreplace")(err)


def _encodable_stdout() -> None:
    """Never fail on printing: on a stdout whose encoding is not UTF-8 (ASCII under ``LC_ALL=C``
    with UTF-8 mode off, a legacy locale) use :func:`_escape_unencodable`. (stderr already escapes.)"""
    encoding = (getattr(sys.stdout, "encoding", None) or "utf-8").lower().replace("_", "-")
    if encoding not in ("utf-8", "utf8") and hasattr(sys.stdout, "reconfigure"):
        codecs.register_error("qconf.escape", _escape_unencodable)
        sys.stdout.reconfigure(errors="qconf.escape")


def _quiet_broken_pipe() -> int:
    """stdout was closed by the reader: point it at /dev/null so that the interpreter's final flush
    cannot fail again (Python's documented recipe for SIGPIPE), and end quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (e.g. a test's capture)
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit code (0 success, 1 invalid
    config, 2 bad usage, 141 stdout closed early by its reader)."""
    _encodable_stdout()
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version, usage errors: keep main() returning an int
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        else:
            code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()


if __name__ == "__main__":
    raise SystemExit(main())
