"""The ``qconf`` command line.

    qconf validate FILE...                         check configs; one line per problem
    qconf show FILE [--model-shapes SPEC] [--json] the resolved config and per-parameter plan
    qconf bench [--size big|many|both] [...]       optimizer-step benchmark tables (qconf.bench)
    qconf compare CONFIG... [--task NAME] [...]    train a task under each config, compare (qconf.study)

Subcommands are registered by the functions in :data:`COMMANDS` (each adds one subparser and
sets ``func``), so new ones (``compare``, ``bench``) are one more entry.
Exit codes: 0 success, 1 invalid config, 2 bad command-line usage.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Callable, Sequence

from ._table import format_table
from .config import STATE_NAMES, QConfig, load_config, resolve_plan
from .errors import QConfigError

__all__ = ["main", "build_parser", "parse_model_shapes", "COMMANDS"]


def _load(path: str) -> tuple[QConfig | None, list[str], QConfigError | None]:
    """Load one config, capturing warnings: ``(config or None, warning messages, error or None)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg, err = load_config(path), None
        except QConfigError as e:
            cfg, err = None, e
    return cfg, [str(w.message) for w in caught], err


# ---------------------------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------------------------
def _register_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check config files",
                       description="Check qconfig files (native or lpmm format). Prints 'OK  FILE' or one "
                                   "line per problem; exits 1 if any file is invalid.")
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML config file")
    p.set_defaults(func=_cmd_validate)


def _cmd_validate(args: argparse.Namespace) -> int:
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


# ---------------------------------------------------------------------------------------------
# show
# ---------------------------------------------------------------------------------------------
def parse_model_shapes(spec: str) -> list[tuple[str, tuple[int, ...]]]:
    """Parse ``'name=AxB,name2=C,bias=scalar'`` into ``[(name, shape), ...]``; ``ValueError`` on bad
    input. ``scalar`` or ``()`` is a 0-d shape."""
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"empty entry in {spec!r} (expected name=AxB,name2=C,...)")
        name, eq, dims = (s.strip() for s in item.partition("="))
        if not eq or not name or not dims:
            raise ValueError(f"{item!r} is not name=shape (expected name=AxB,name2=C,...)")
        if dims.lower() in ("scalar", "()"):
            shape: tuple[int, ...] = ()
        else:
            parts = [d.strip() for d in dims.lower().split("x")]
            bad = [d for d in parts if not d.isdigit()]
            if bad:
                raise ValueError(f"{item!r}: {bad[0]!r} is not a non-negative integer dimension "
                                 "(expected name=AxB, e.g. w=4096x1024)")
            shape = tuple(int(d) for d in parts)
        if name in seen:
            raise ValueError(f"parameter {name!r} is given twice")
        seen.add(name)
        out.append((name, shape))
    return out


def _register_show(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print the resolved config and per-parameter plan",
                       description="Print a config in resolved native form (every key explicit) and, with "
                                   "--model-shapes, which codec each optimizer state of each parameter gets "
                                   "and how many bytes it takes.")
    p.add_argument("file", metavar="FILE", help="YAML config file")
    p.add_argument("--model-shapes", action="append", metavar="SPEC",
                   help="parameters as name=AxB,name2=C,... (name is the qualified parameter name, e.g. "
                        "layers.0.attn.weight; 'scalar' for a 0-d parameter); may be repeated")
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
            print(f"qconf show: error: --model-shapes: {e}", file=sys.stderr)
            return 2
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
                                   "step(). See docs/benchmarks.md.")
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
    from .study.cli import execute

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: keep main() returning an int
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
