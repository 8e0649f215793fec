"""``qconf compare``: arguments and execution (registered by :mod:`qconf.cli`).

Bad arguments (unknown task, unimportable module, missing or invalid config, a non-positive
count, an ``--out`` that is a file or cannot be written, ...) print one line on stderr and exit with
code 2, before any training. Ctrl-C stops the
study cleanly: outputs are written for what is done and the exit code is 130.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import QConfigError
from .task import StudyError

PROG = "qconf compare"

DESCRIPTION = """\
Train a task under each config and seed and compare them: final and best held-out loss (and
accuracy), divergence share ("unstable %"), step time, optimizer state bytes/param, and the
quantization error of every optimizer state against an fp32 shadow optimizer fed the same
gradients. Every config x seed run starts from the same initial weights and reads the same
batches (both seeded by the seed). Prints a table and writes results.json, results.csv,
report.md and PNG plots to --out. See docs/studies.md."""

EPILOG = """\
built-in tasks:
  charlm   byte-level GPT (2 layers, d_model 128, context 64) on 60 CPython stdlib modules;
           eval = nats/char on 128 fixed held-out windows (default task: 400 steps, batch 16, lr 1.5e-3,
           5% warm-up then cosine to 10%)
  digits   MLP on scikit-learn's digits (1437 train / 360 held-out images); eval loss and accuracy
           (300 steps, lr 1e-3)
  module:function   your own: imports module (a dotted name, or a path to a .py file) and calls
           function(), which returns a qconf.study.Task

divergence: a seed diverged if its train loss is non-finite, or its eval loss exceeds the initial
eval loss after 10% of the steps; it stops early and counts in the "unstable" share.

configs: YAML files or built-in names (default, 8bit, fp32, ...: qconf validate --list).

examples:
  qconf compare fp32 8bit default
  qconf compare configs/studies/zero_point/*.yml --seeds 3 --steps 600     (in a checkout)
  qconf compare default --task digits --optimizer sgd --lr 0.05
  qconf compare my_config.yml default --task mypkg.tasks:make_task --out results/mine

exit codes: 0 done, 2 bad arguments (one line on stderr), 130 interrupted (outputs written)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="+", metavar="CONFIG",
                   help="qconfig YAML files (native or lpmm format) or built-in names (default, 8bit, fp32, ...)")
    p.add_argument("--task", default=None, metavar="NAME|module:function",
                   help="built-in task (charlm, digits) or module:function returning a qconf.study.Task "
                        "(default: charlm)")
    p.add_argument("--optimizer", default="adamw", metavar="{adamw,adam,sgd,lion}",
                   help="qconf.optim optimizer (sgd uses momentum 0.9); default adamw")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="training steps per run (default: the task's)")
    p.add_argument("--seeds", type=int, default=None, metavar="K", help="seeds 0..K-1 per config (default 2)")
    p.add_argument("--lr", type=float, default=None, metavar="X",
                   help="(peak) learning rate (default: the task's); the task's schedule scales it")
    p.add_argument("--fused", default="auto", metavar="{auto,on,off}",
                   help="native fused kernel: auto = when built, on = required, off = reference path")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default qconf-results/<timestamp>)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="evaluate and measure state errors every N steps (default steps/20)")
    p.add_argument("--threads", type=int, default=1, metavar="T",
                   help="torch intra-op threads during the study (default 1: the built-in models are small, and "
                        "one thread is the fastest on a shared machine)")
    p.add_argument("--opt-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra optimizer argument for every run, e.g. eps=1e-6, weight_decay=0, betas=0.9,0.95 "
                        "(repeatable)")
    p.add_argument("--gradient-release", action="store_true",
                   help="step each parameter inside backward and free its gradient (gradient_release=True; "
                        "docs/memory.md): the training B/param column drops by the gradients")
    p.add_argument("--no-qerr", action="store_true",
                   help="skip the fp32 shadow optimizer (no quantization-error columns; slightly faster)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar and per-run lines on stderr")


def _parse_value(text: str) -> Any:
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if "," in text:
        return tuple(_parse_value(t) for t in text.split(","))
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_opt_args(items: list[str]) -> dict[str, Any]:
    """``["eps=1e-6", "betas=0.9,0.95"]`` -> ``{"eps": 1e-06, "betas": (0.9, 0.95)}``; StudyError on bad input."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key.isidentifier() or not value.strip():
            raise StudyError(f"--opt-arg {item!r} is not KEY=VALUE (e.g. eps=1e-6)")
        if key in ("lr", "qconfig", "fused", "params"):
            raise StudyError(f"--opt-arg {key}: set it with --{key}" if key in ("lr", "fused")
                             else f"--opt-arg {key} cannot be set (the study sets it)")
        out[key] = _parse_value(value)
    return out


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make argparse usage errors of ``parser`` one line on stderr (exit code 2)."""

    def error(message: str) -> None:
        print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]


def _fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def check_out_dir(out: str | None) -> None:
    """StudyError unless ``--out`` can become the output directory: it is a directory or can be
    created, and files can be written there. Checked before training (no hours lost at the end);
    creates nothing that stays."""
    if out is None:
        return
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise StudyError(f"--out {out!r} exists and is not a directory (give a new or existing directory)")
    parent = path
    while not parent.exists():  # the nearest existing ancestor is where the directory would be made
        parent = parent.parent
    if not parent.is_dir():
        raise StudyError(f"--out {out!r}: {str(parent)!r} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qconf-out-check-", dir=parent))
    except OSError as e:
        raise StudyError(f"--out {out!r}: cannot write in {str(parent)!r} ({e.strerror or e})") from None


def execute(args: argparse.Namespace) -> int:
    """Run ``qconf compare`` for parsed ``args``; returns the exit code."""
    from .compare import DEFAULT_SEEDS, compare
    from .tasks import DEFAULT_TASK

    try:
        check_out_dir(args.out)
        kwargs = parse_opt_args(args.opt_arg)
        if args.gradient_release:
            kwargs["gradient_release"] = True
        result = compare(args.configs, task=args.task or DEFAULT_TASK, optimizer=args.optimizer, steps=args.steps,
                         seeds=DEFAULT_SEEDS if args.seeds is None else args.seeds, lr=args.lr, fused=args.fused,
                         out=args.out, eval_every=args.eval_every, threads=args.threads, optimizer_kwargs=kwargs,
                         measure_error=not args.no_qerr, progress=not args.no_progress,
                         announce=True)
    except QConfigError as e:
        return _fail("invalid config: " + "; ".join(str(p) for p in e.problems))
    except StudyError as e:
        return _fail(str(e))
    except OSError as e:  # e.g. writing the outputs failed after all (the disk filled up)
        return _fail(f"{e.strerror or e}" + (f": {e.filename!r}" if e.filename else ""))
    print()
    print(result.table())
    print()
    from .report import reading

    for line in reading(result):
        print("- " + line.replace("**", ""))
    if result.out is not None:
        print(f"\nwrote {result.out}/: results.json, results.csv, report.md, "
              + ", ".join(p.name for p in sorted(result.out.glob("*.png"))))
    if result.interrupted:
        print(f"{PROG}: interrupted; outputs cover the finished runs", file=sys.stderr)
        return 130
    return 0

