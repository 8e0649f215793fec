"""``qconf bench --memory``'s options, checks and entry point: :func:`add_memory_arguments` (the
option group, added to ``qconf bench``'s parser by :func:`qconf.bench.cli.add_arguments`), the
explicit command that repeats a run, and :func:`execute_memory` (progress on stderr, one table per
device as it finishes, ``--json``).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from .device import cuda_unavailable_reason
from .memory import DEVICES, roster, run_memory, unavailable
from .memory_tables import format_memory_device, format_memory_footer, format_memory_header
from .model import MODEL_PRESETS

#: the script's --help description (``benchmarks/bench_memory.py``)
MEMORY_DESCRIPTION = ("Training-memory benchmark: peak bytes/param of training a 105M-parameter GPT-style "
                      "transformer with torch AdamW, qconf 4-bit / 8-bit (with and without gradient release), "
                      "torchao, bitsandbytes and flashoptim (--muon: qconf Muon vs torch.optim.Muon).")
#: the --memory-model values --help lists (``tiny``, about 1M params, is accepted too, for tests)
MODEL_CHOICES = ("base", "base-32k", "small")
#: the --memory-model when none is given: ``base``; with --muon ``small`` (model.py: Newton-Schulz in
#: bf16 on a CPU would take a quarter of an hour or more per step of ``base``)
DEFAULT_MODEL, MUON_MODEL = "base", "small"
#: --memory-steps when none is given; with --muon fewer (a Muon training step of ``small`` takes seconds)
DEFAULT_STEPS, MUON_STEPS = 8, 3
#: the options (argparse dests) a --memory run takes; every other one is the step timing's
MEMORY_DESTS = frozenset({"memory", "memory_model", "memory_steps", "memory_warmup", "muon", "device", "threads",
                          "seed", "contenders", "list", "json", "quiet", "rss_timeout"})
#: the options that mean nothing without --memory
MEMORY_ONLY = ("memory_model", "memory_steps", "memory_warmup")


def model_choice(text: str) -> str:
    """``--memory-model`` value: one of :data:`MODEL_CHOICES` (or the unadvertised ``tiny``)."""
    if text in MODEL_PRESETS:
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(MODEL_CHOICES)})")


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--memory`` option group."""
    base, big, small = MODEL_PRESETS["base"], MODEL_PRESETS["base-32k"], MODEL_PRESETS["small"]
    g = p.add_argument_group(
        "training memory (--memory)",
        "Instead of timing one optimizer step: train a GPT-style transformer for a few steps with each optimizer "
        "(torch AdamW fused fp32 / bf16; qconf default.yml fp32, bf16 + stochastic rounding, each also with gradient "
        "release; qconf 8bit.yml; torchao, bitsandbytes, flashoptim where installed), every row in a fresh child "
        "process, and print peak bytes/param split into params, grads, optimizer states and other (activations, "
        "workspace), ms/step and the final loss. With --muon the Muon rows instead (torch.optim.Muon + AdamW fp32; "
        "qconf Muon 8-bit; qconf Muon 4-bit on bf16 + stochastic rounding, with and without gradient release; two "
        "AdamW rows for comparison), on --memory-model small by default. Besides these options --memory takes "
        "--device (default: cpu and cuda; CUDA rows say 'no CUDA' without a GPU), --threads, --seed (initial weights "
        "and tokens), --contenders (row keys; --memory --list shows them), --json and --quiet; the step-timing "
        "options above are refused.")
    g.add_argument("--memory", action="store_true", help="run the training-memory benchmark (see above)")
    g.add_argument("--memory-model", type=model_choice, default=None, metavar="{" + ",".join(MODEL_CHOICES) + "}",
                   help=f"the model: base = {base.describe()}, {base.numel:,} params (default); base-32k = "
                        f"{big.describe()}, {big.numel:,} params (its embedding and LM head are "
                        f"{100 * big.vocab * big.d_model / big.numel:.0f}%% of it each, and bound gradient release's "
                        f"grads); small = {small.describe()}, {small.numel:,} params (the default with --muon: "
                        "Muon's bf16 Newton-Schulz is slow on a CPU)")
    g.add_argument("--memory-steps", type=int, default=None, metavar="N",
                   help=f"measured training steps per row: peak memory, median ms/step (default {DEFAULT_STEPS}; "
                        f"{MUON_STEPS} with --muon)")
    g.add_argument("--memory-warmup", type=int, default=2, metavar="N",
                   help="training steps per row before the measured ones (default 2: the first creates the "
                        "optimizer states, the second builds the fused step's cached plans)")


def model_of(opts: argparse.Namespace) -> str:
    """--memory-model, or its default (:data:`DEFAULT_MODEL`, :data:`MUON_MODEL` with --muon)."""
    return opts.memory_model or (MUON_MODEL if getattr(opts, "muon", False) else DEFAULT_MODEL)


def steps_of(opts: argparse.Namespace) -> int:
    """--memory-steps, or its default (:data:`DEFAULT_STEPS`, :data:`MUON_STEPS` with --muon)."""
    if opts.memory_steps is not None:
        return opts.memory_steps
    return MUON_STEPS if getattr(opts, "muon", False) else DEFAULT_STEPS


def memory_command(prog: str, opts: argparse.Namespace) -> str:
    """The --memory command with every option explicit (reproduces the run)."""
    argv = ["--memory"] + (["--muon"] if getattr(opts, "muon", False) else [])
    argv += ["--device", opts.device] if opts.device else []
    argv += ["--memory-model", model_of(opts), "--memory-warmup", str(opts.memory_warmup), "--memory-steps",
             str(steps_of(opts)), "--threads", str(opts.threads), "--seed", str(opts.seed)]
    if opts.contenders:
        argv += ["--contenders", ",".join(opts.contenders)]
    if opts.json:
        argv += ["--json", opts.json]
    return f"{prog} {shlex.join(argv)}"


def check_memory(opts: argparse.Namespace) -> None:
    """ValueError (one line) on counts below 1, ``--device cuda`` without CUDA and a ``--json`` file
    that cannot be written."""
    for name in ("memory_steps", "memory_warmup", "threads"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.device == "cuda" and cuda_unavailable_reason() is not None:
        raise ValueError(cuda_unavailable_reason())
    if opts.json:
        parent = Path(opts.json).expanduser().resolve().parent
        if Path(opts.json).is_dir() or not parent.is_dir():
            raise ValueError(f"--json {opts.json!r}: not a file in an existing directory")


def list_rows(opts: argparse.Namespace) -> int:
    """``--memory --list``: one line per row and device (key, name, why it cannot run here)."""
    for device in [opts.device] if opts.device else DEVICES:
        for row in roster(device, opts.muon):
            why = unavailable(row, device)
            print(f"{device:4s} {row.key:32s} {row.name}{f'  ({why})' if why else ''}")
    return 0


def execute_memory(opts: argparse.Namespace, prog: str) -> int:
    """Run ``--memory``: print the header, each device's table as it finishes and the footer;
    write ``--json``. The exit code (2: bad options, one line on stderr; 1: the JSON file could
    not be written)."""
    if opts.list:
        return list_rows(opts)

    def show(event: str, result: dict[str, Any]) -> None:
        text = format_memory_header(result) if event == "start" else format_memory_device(result, event)
        print(text + "\n", flush=True)

    opts.memory_model, opts.memory_steps = model_of(opts), steps_of(opts)
    try:
        check_memory(opts)
        result = run_memory(opts, memory_command(prog, opts), show)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(format_memory_footer(result), flush=True)
    if opts.json:
        try:
            Path(opts.json).expanduser().write_text(json.dumps(result, indent=1) + "\n")
        except OSError as e:
            print(f"{prog}: error: --json {opts.json!r}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0
