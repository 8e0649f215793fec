"""``qconf compare``: arguments and execution (registered by :mod:`qconf.cli`).

Bad arguments (unknown task, unimportable module, missing or invalid config, a ``--vary`` field or
value the schema rejects, a sweep too large without ``--yes``, a non-positive count, an ``--out``
that is a file, cannot be written or holds another study, ...) print one line on stderr and exit
with code 2, before any training. Ctrl-C stops the study cleanly: outputs are written for what is
done and the exit code is 130; the same command continues it.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import QConfigError
from .sweep import MAX_POINTS, parse_value
from .task import StudyError

PROG = "qconf compare"

DESCRIPTION = """\
Train a task under each config (and optimizer) and seed and compare them: final and best
held-out loss (and accuracy), the paired difference to a reference row with its 95% interval,
p-value and verdict, divergence share ("unstable"), step time, optimizer state bytes/param, and
the quantization error of every optimizer state against an fp32 shadow optimizer fed the same
gradients. Every run of a seed starts from the same initial weights and reads the same batches.
--vary sweeps qconfig fields; runs are stored under --out by a key of everything that determines
them, so running a study again runs only what is missing. Prints a table and writes results.json,
results.csv, report.md and PNG plots to --out. See docs/studies.md."""

EPILOG = f"""\
built-in tasks:
  charlm   byte-level GPT (2 layers, d_model 128, context 64) on 60 CPython stdlib modules;
           eval = nats/char on 128 fixed held-out windows (default task: 400 steps, batch 16, lr 1.5e-3,
           5% warm-up then cosine to 10%)
  digits   MLP on scikit-learn's digits (1437 train / 360 held-out images); eval loss and accuracy
           (300 steps, lr 1e-3)
  module:function   your own: imports module (a dotted name, or a path to a .py file) and calls
           function(), which returns a qconf.study.Task

configs: YAML files or built-in names (default, 8bit, fp32, ...: qconf validate --list); CONFIG@OPTIMIZER
  trains that config with that optimizer only (default.yml@sgd).

sweeps: --vary FIELD=V1,V2,... sets a qconfig field of the FIRST config, dotted as in the YAML
  (states.exp_avg.bits=3,4,5, states.exp_avg_sq.map=nonlinear,power-1, weights.rounding=...,
  overrides[0].enable=...); several --vary make the cartesian product, whose points replace that
  config (the other configs run as given). Points named by what they change; points that resolve
  to the same codecs run once. More than {MAX_POINTS} points need --yes.

paired statistics: each row minus the reference row (--reference, default the first fp32 row),
  seed by seed: mean difference of the final eval loss, its 95% t interval, the paired t-test's
  p-value and a verdict (better / worse / within noise / identical / unstable / too few seeds).

divergence: a seed diverged if its train loss is non-finite, or its eval loss exceeds the initial
eval loss after 10% of the steps; it stops early and counts in the "unstable" share. A run that
crashes is recorded as crashed and the study goes on.

resume and clusters: runs are stored in --out/runs/ as they finish; the same command with the same
  --out runs only the runs that are missing (added points or seeds, an interrupted study).
  --jobs N runs N runs at a time in worker processes (same numbers as --jobs 1).
  --plan writes --out/study.json and lists the runs; --run-one INDEX --out DIR runs one of them
  (an array job: one index per task, a shared DIR); --collect --out DIR makes the table and report.

examples:
  qconf compare fp32 8bit default
  qconf compare default fp32 --vary states.exp_avg_sq.map=nonlinear,nonlinear-nozero,power-1 \\
      --vary states.exp_avg_sq.group_size=128,2048 --seeds 5 --jobs 2 --out results/v_map
  qconf compare fp32 default 8bit@lion --optimizer adamw --lr adamw=1.5e-3,lion=3e-4
  qconf compare default --task digits --optimizer sgd --lr 0.05
  qconf compare my_config.yml default --task mypkg.tasks:make_task --out results/mine

exit codes: 0 done, 1 --run-one's run crashed, 2 bad arguments (one line on stderr), 130 interrupted
(outputs written)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="*", metavar="CONFIG",
                   help="qconfig YAML files (native or lpmm format) or built-in names (default, 8bit, fp32, ...), "
                        "each optionally CONFIG@OPTIMIZER")
    p.add_argument("--vary", action="append", default=[], metavar="FIELD=V1,V2",
                   help="sweep a qconfig field of the first CONFIG over the values (repeatable: the cartesian "
                        "product), e.g. states.exp_avg.bits=3,4,5")
    p.add_argument("--task", default=None, metavar="NAME|module:function",
                   help="built-in task (charlm, digits) or module:function returning a qconf.study.Task "
                        "(default: charlm)")
    p.add_argument("--optimizer", default="adamw", metavar="{adamw,adam,sgd,lion,muon}[,...]",
                   help="qconf.optim optimizer(s) for every CONFIG without @ (sgd uses momentum 0.9); default adamw")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="training steps per run (default: the task's)")
    p.add_argument("--seeds", type=int, default=None, metavar="K", help="seeds 0..K-1 per row (default 2)")
    p.add_argument("--lr", default=None, metavar="X|OPT=X,...",
                   help="(peak) learning rate, for every optimizer or per optimizer (adamw=1e-3,lion=1e-4); "
                        "default: the task's; the task's schedule scales it")
    p.add_argument("--fused", default="auto", metavar="{auto,on,off}",
                   help="native fused kernel: auto = when built, on = required, off = reference path")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory and run store (default qconf-results/<timestamp>; reuse it to resume or "
                        "extend a study)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="evaluate and measure state errors every N steps (default steps/20)")
    p.add_argument("--threads", type=int, default=1, metavar="T",
                   help="torch intra-op threads of each run (default 1: the built-in models are small, and "
                        "one thread is the fastest on a shared machine)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="runs at a time, in worker processes (default 1)")
    p.add_argument("--opt-arg", action="append", default=[], metavar="[OPT:]KEY=VALUE",
                   help="extra optimizer argument, e.g. eps=1e-6, weight_decay=0, betas=0.9,0.95, or for one "
                        "optimizer lion:weight_decay=0.1, a mapping's key muon:adamw.lr=3e-3 (repeatable)")
    p.add_argument("--reference", default=None, metavar="NAME",
                   help="the row every other row is compared with (default: the first fp32 row, else the first)")
    p.add_argument("--gradient-release", action="store_true",
                   help="step each parameter inside backward and free its gradient (gradient_release=True; "
                        "docs/memory.md): the training B/param column drops by the gradients")
    p.add_argument("--no-qerr", action="store_true",
                   help="skip the fp32 shadow optimizer (no quantization-error columns; slightly faster)")
    p.add_argument("--yes", action="store_true", help=f"run a sweep of more than {MAX_POINTS} points")
    p.add_argument("--no-progress", action="store_true", help="no progress bar and per-run lines on stderr")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true",
                      help="write the study's plan to --out/study.json and list its runs; run nothing")
    mode.add_argument("--run-one", type=int, default=None, metavar="INDEX",
                      help="run one run of the plan in --out (an array job's task) and store it")
    mode.add_argument("--collect", action="store_true",
                      help="make the table and report of the study in --out from the runs stored there")


def _parse_value(text: str) -> Any:
    """An optimizer argument's value: a scalar (:func:`~qconf.study.sweep.parse_value`) or, with
    commas, a tuple of them (``betas=0.9,0.95``)."""
    return tuple(parse_value(t) for t in text.split(",")) if "," in text else parse_value(text)


def parse_opt_args(items: list[str]) -> dict[str, Any]:
    """``["eps=1e-6", "lion:weight_decay=0.1"]`` -> ``{"eps": 1e-06, "lion": {"weight_decay": 0.1}}``;
    StudyError on bad input."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        scope, colon, key = key.strip().rpartition(":") if ":" in key else ("", "", key)
        key = key.strip().replace("-", "_")
        *outer, key = key.split(".")  # muon:adamw.lr=3e-3 -> {"muon": {"adamw": {"lr": 0.003}}}
        if not eq or not all(k.isidentifier() for k in (*outer, key)) or not value.strip():
            raise StudyError(f"--opt-arg {item!r} is not [OPTIMIZER:]KEY=VALUE (e.g. eps=1e-6, lion:weight_decay=0.1, "
                             "muon:adamw.lr=3e-3)")
        if not outer and key in ("lr", "qconfig", "fused", "params"):
            raise StudyError(f"--opt-arg {key}: set it with --{key}" if key in ("lr", "fused")
                             else f"--opt-arg {key} cannot be set (the study sets it)")
        from .runner import OPTIMIZERS  # (qconf.optim: loaded only when compare runs)

        if colon and scope.strip() not in OPTIMIZERS:
            raise StudyError(f"--opt-arg {item!r}: unknown optimizer {scope.strip()!r} (choose from "
                             f"{', '.join(OPTIMIZERS)})")
        target = out.setdefault(scope.strip(), {}) if colon else out
        for k in outer:
            target = target.setdefault(k, {})
            if not isinstance(target, dict):
                raise StudyError(f"--opt-arg {item!r}: {k} is given both as a value and as a mapping")
        target[key] = _parse_value(value)
    return out


def parse_lr(text: str | None) -> float | dict[str, float] | None:
    """``"1e-3"`` -> 0.001; ``"adamw=1e-3,lion=1e-4"`` -> ``{"adamw": 0.001, "lion": 0.0001}``."""
    if text is None:
        return None
    try:
        if "=" not in text:
            return float(text)
        pairs = [part.split("=", 1) for part in text.split(",")]
        return {name.strip(): float(value) for name, value in pairs}
    except ValueError:
        raise StudyError(f"--lr {text!r} is not a number or OPTIMIZER=NUMBER,... (e.g. 1e-3, adamw=1e-3,lion=1e-4)") \
            from None


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
    try:
        check_out_dir(args.out)
        if args.run_one is not None or args.collect:
            return _cluster_step(args)
        study = _study_arguments(args)
        if args.plan:
            return _plan(args, study)
        from .compare import compare

        result = compare(args.configs, **study, out=args.out, progress=not args.no_progress, announce=True,
                         jobs=args.jobs)
    except QConfigError as e:
        return _fail("invalid config: " + "; ".join(str(p) for p in e.problems))
    except StudyError as e:
        return _fail(str(e))
    except BrokenPipeError:  # stdout closed by its reader (`| head`): qconf.cli ends quietly
        raise
    except OSError as e:  # e.g. writing the outputs failed after all (the disk filled up)
        return _fail(f"{e.strerror or e}" + (f": {e.filename!r}" if e.filename else ""))
    _print_result(result)
    if result.interrupted:
        print(f"{PROG}: interrupted; outputs cover the finished runs (the same command continues the study)",
              file=sys.stderr)
        return 130
    return 0


def _study_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`~qconf.study.compare` / ``plan_study`` from the command line."""
    from .compare import DEFAULT_SEEDS
    from .tasks import DEFAULT_TASK

    if not args.configs:
        raise StudyError("give at least one CONFIG (a YAML file or a built-in name such as default)")
    kwargs = parse_opt_args(args.opt_arg)
    if args.gradient_release:
        kwargs["gradient_release"] = True
    return dict(task=args.task or DEFAULT_TASK, optimizer=args.optimizer, steps=args.steps,
                seeds=DEFAULT_SEEDS if args.seeds is None else args.seeds, lr=parse_lr(args.lr), fused=args.fused,
                eval_every=args.eval_every, threads=args.threads, optimizer_kwargs=kwargs,
                measure_error=not args.no_qerr, vary=args.vary, reference=args.reference, allow_many=args.yes)


def _plan(args: argparse.Namespace, study: dict[str, Any]) -> int:
    """``--plan``: write study.json to --out and list the runs an array job runs."""
    from .._table import format_table
    from .compare import plan_study

    if args.out is None:
        raise StudyError("--plan needs --out DIR (the directory every --run-one shares)")
    plan = plan_study(args.configs, **study, out=args.out)
    runs = plan.runs()
    print(format_table(["index", "seed", "key", "rows"], [[r.index, r.seed, r.key, ", ".join(r.rows)] for r in runs],
                       align="rrll"))
    print(f"\nwrote {args.out}/study.json: {len(runs)} run(s). Run each (an array job of {len(runs)} tasks):\n"
          f"  qconf compare --run-one INDEX --out {args.out}      INDEX = 0..{len(runs) - 1}\n"
          f"then: qconf compare --collect --out {args.out}")
    return 0


def _cluster_step(args: argparse.Namespace) -> int:
    """``--run-one INDEX`` or ``--collect``: the plan comes from --out, so no CONFIG is given."""
    from .compare import collect, run_one
    from .progress import run_line

    flag = "--collect" if args.collect else "--run-one"
    if args.out is None:
        raise StudyError(f"{flag} needs --out DIR (the directory --plan wrote)")
    if args.configs or args.vary:
        raise StudyError(f"{flag} reads the study from --out/study.json: give no CONFIG or --vary")
    if args.collect:
        _print_result(collect(args.out))
        return 0
    result = run_one(args.out, args.run_one, progress=not args.no_progress)
    print(run_line(result))
    return {"interrupted": 130, "crashed": 1}.get(result.status, 0)


def _print_result(result: Any) -> None:
    from .._table import format_table
    from .report import reading

    print()
    if result.varied:  # a sweep: one column per swept field instead of long labels
        headers, rows, align = result.sweep_table_rows()
        print(format_table(headers, rows, align=align))
        print("(a sweep's table; the full one, with timings and state errors, is in report.md and results.csv)")
    else:
        print(result.table())
    print()
    for line in reading(result):
        print("- " + line.replace("**", "").replace("*", ""))
    if result.out is not None:
        print(f"\nwrote {result.out}/: results.json, results.csv, report.md, "
              + ", ".join(p.name for p in sorted(result.out.glob("*.png"))))
