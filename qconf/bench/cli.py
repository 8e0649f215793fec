"""The benchmark's entry points: its options (:func:`add_arguments`, shared by ``qconf bench``,
``benchmarks/bench_step.py`` and ``benchmarks/bench_memory.py``), the explicit command that repeats
a run, :func:`run` (every size, JSON-ready result), :func:`execute` (print the tables as they
finish, write ``--json``; ``--memory`` goes to :func:`qconf.bench.memory_cli.execute_memory`) and
:func:`main` (the scripts).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import cuda_static
from .device import Backend, make_backend
from .memory_cli import MEMORY_DESTS, MEMORY_ONLY, add_memory_arguments, execute_memory
from .measure import MUON_SIZES, SIZE_GROUPS, SIZE_TEXT, SLOW_FACTOR, bench_size, machine_info
from .roster import CONFIGS, LR, MUON_CONFIGS, WEIGHT_DECAY, baseline_key, contenders, default_config_dir, select
from .rss import CHILD_MALLOC_ENV
from .tables import format_footer, format_header, format_many_vs_one, format_size

#: the script's --help description
DESCRIPTION = ("Optimizer-step benchmark: qconf vs torch.optim.AdamW, torchao and bitsandbytes low-bit AdamW "
               "(--muon: qconf Muon vs torch.optim.Muon).")


#: the --size values that --help and usage errors list; ``tiny`` (measure.SIZES: 3 small tensors) and
#: ``muon-smoke`` (2 small matrices, --muon) are accepted too but not advertised -- they exist for smoke
#: tests, and their percentages mean nothing; ``gpu`` (537M params, --device cuda only) and ``muon``
#: (--muon's matrices) are described in the option's help text
SIZE_CHOICES = ("big", "many", "one", "both", "all")
#: the --size of each --device when none is given (with --muon: ``muon`` on both)
DEFAULT_SIZE = {"cpu": "both", "cuda": "gpu"}
#: --rounds when none is given; with --muon fewer (a Muon step of the ``muon`` size takes seconds on a CPU)
DEFAULT_ROUNDS, MUON_ROUNDS = 50, 10


def size_choice(text: str) -> str:
    """``--size`` value: one of :data:`SIZE_CHOICES` (or ``gpu``, ``muon``, or the unadvertised ``tiny``,
    ``muon-smoke``); an error lists only the choices of the usage line, as --help does."""
    if text in SIZE_CHOICES or text in ("tiny", "gpu", "muon", "muon-smoke"):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(SIZE_CHOICES)})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``qconf bench`` and ``benchmarks/bench_step.py``)."""
    p.add_argument("--size", type=size_choice, default=None, metavar="{" + ",".join(SIZE_CHOICES) + "}",
                   help="big = 3 tensors of 4096x1024 (12.6M params); many = 1000 tensors of 4096; one = the same "
                        "4.1M params as one 1000x4096 tensor; both (default on the CPU) = big and many; all = big, "
                        "many, one; one table each. With --device cuda also gpu = 64 tensors of 4096x2048 (537M "
                        "params; the default there). muon = 2 matrices, 256x512 and 512x256 (262,144 params; the "
                        "default and only size of --muon)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cpu (default) or cuda: time the step on the current GPU (torch.cuda.synchronize around "
                        "every step), with a device copy of 28 B/param in the same rounds, GB/s, the fraction of "
                        "the copy's bandwidth and peak GPU memory per row; no RSS subprocesses. With --memory: "
                        "train on this device only (default: cpu, then cuda)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help=f"interleaved rounds; each times one step of every contender (default {DEFAULT_ROUNDS}; "
                        f"{MUON_ROUNDS} with --muon)")
    p.add_argument("--slow-rounds", type=int, default=7, metavar="N",
                   help=f"rounds for contenders slower than {SLOW_FACTOR:g}x the baseline (default 7)")
    p.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="untimed steps per contender first (absorbs torch.compile time; default 3)")
    p.add_argument("--threads", type=int, default=2, metavar="T", help="torch.set_num_threads (default 2)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the parameters, gradients and round order (--memory: initial weights, tokens)")
    p.add_argument("--contenders", metavar="GLOB,...", type=lambda s: [x for x in s.split(",") if x],
                   help="only these contender keys (fnmatch globs, e.g. 'qconf-fused-*,torch-*'); the baseline "
                        "torch-fused (with --muon: torch-muon) is always run. --list shows the keys (--memory --list: "
                        "the memory rows')")
    p.add_argument("--list", action="store_true", help="list contender keys (with --memory: row keys) and exit")
    p.add_argument("--muon", action="store_true",
                   help="the Muon rows instead of the AdamW ones: torch.optim.Muon (fp32 momentum; the baseline of "
                        f"every ratio) and qconf.optim.Muon with {' and '.join(MUON_CONFIGS)} (8-bit / 4-bit momentum) "
                        "on --size muon, timed in the same rounds on the same matrices and gradients (Newton-Schulz "
                        "in bf16 takes seconds per step on a CPU). With --memory: the Muon training rows "
                        "(--memory-model small by default)")
    p.add_argument("--no-rss", dest="rss", action="store_false", help="skip the peak-RSS subprocesses")
    p.add_argument("--rss-contenders", metavar="GLOB,...", type=lambda s: [x for x in s.split(",") if x],
                   help="measure peak RSS only for these contender keys")
    p.add_argument("--rss-steps", type=int, default=3, metavar="N", help="steps measured for peak RSS (default 3)")
    p.add_argument("--rss-timeout", type=float, default=900.0, help=argparse.SUPPRESS)
    p.add_argument("--min-numel", type=int, default=None, metavar="N",
                   help="override the qconf configs' min_numel (a state is quantized iff numel > min_numel; the "
                        "shipped configs use 4096, so 'many' tensors of exactly 4096 keep fp32 states)")
    p.add_argument("--configs", type=Path, default=None, metavar="DIR",
                   help="directory holding default.yml, 2nd_moment_group_128.yml, 8bit.yml (default: the built-in "
                        "configs shipped with qconf)")
    p.add_argument("--json", metavar="FILE", help="also write every number (raw per-round times too) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--cuda-static", action="store_true",
                   help="instead of timing: compile the specialized CUDA kernels of every config in --configs for "
                        "--arch (NVRTC, no GPU needed) and print registers, stack, spills, SASS per element and the "
                        "H100 time they predict (benchmarks/cuda_static.py; docs/kernels.md)")
    cuda_static.add_arguments(p)
    add_memory_arguments(p)


def _defaults() -> dict[str, Any]:
    """Every option's default (argparse dest -> value)."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    return vars(p.parse_args([]))


def check_mode(opts: argparse.Namespace) -> None:
    """ValueError (one line) for a step-timing option given with ``--memory``, or a ``--memory-*``
    option given without it (an option counts as given when it differs from its default)."""
    given = [dest for dest, default in _defaults().items() if getattr(opts, dest, default) != default]
    flag = {dest: "--no-rss" if dest == "rss" else "--" + dest.replace("_", "-") for dest in given}
    if opts.memory:
        wrong = [flag[d] for d in given if d not in MEMORY_DESTS]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: not an option of --memory (it takes --memory-model, --memory-steps, "
                             "--memory-warmup, --muon, --device, --threads, --seed, --contenders, --list, --json, "
                             "--quiet)")
    else:
        wrong = [flag[d] for d in given if d in MEMORY_ONLY]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} needs --memory")


def canonical_command(prog: str, opts: argparse.Namespace) -> str:
    """The command with every option explicit (reproduces the run)."""
    device = opts.device or "cpu"
    argv = ["--device", device] if device != "cpu" else []
    argv += ["--muon"] if opts.muon else []
    argv += ["--size", opts.size or default_size(device, opts.muon), "--rounds", str(rounds_of(opts)),
             "--slow-rounds", str(opts.slow_rounds), "--warmup", str(opts.warmup), "--threads", str(opts.threads),
             "--seed", str(opts.seed)]
    if opts.contenders:
        argv += ["--contenders", ",".join(opts.contenders)]
    if device == "cpu" and not opts.rss:  # (no RSS subprocesses on a GPU)
        argv.append("--no-rss")
    elif device == "cpu":
        argv += ["--rss-steps", str(opts.rss_steps)]
        if opts.rss_contenders:
            argv += ["--rss-contenders", ",".join(opts.rss_contenders)]
    if opts.min_numel is not None:
        argv += ["--min-numel", str(opts.min_numel)]
    if opts.configs is not None:
        argv += ["--configs", str(opts.configs)]
    if opts.json:
        argv += ["--json", opts.json]
    return f"{prog} {shlex.join(argv)}"


def default_size(device: str, muon: bool) -> str:
    """The --size when none is given."""
    return "muon" if muon else DEFAULT_SIZE[device]


def rounds_of(opts: argparse.Namespace) -> int:
    """--rounds, or its default (:data:`DEFAULT_ROUNDS`, :data:`MUON_ROUNDS` with --muon)."""
    if opts.rounds is not None:
        return opts.rounds
    return MUON_ROUNDS if opts.muon else DEFAULT_ROUNDS


def _check(opts: argparse.Namespace) -> None:
    """ValueError on counts below 1, on ``--size gpu`` without ``--device cuda``, on ``--muon`` with
    a size that is not all matrices and on a config directory without the benchmarked configs;
    fills in the default ``opts.size``, ``opts.rounds`` and ``opts.configs``."""
    opts.rounds = rounds_of(opts)
    for name in ("rounds", "slow_rounds", "threads", "rss_steps"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.warmup < 1:
        raise ValueError("--warmup must be >= 1 (state bytes are read after warm-up)")
    opts.size = opts.size or default_size(opts.device, opts.muon)
    if opts.size == "gpu" and opts.device != "cuda":
        raise ValueError("--size gpu (537M params) is for --device cuda")
    if opts.muon and opts.size not in MUON_SIZES:
        raise ValueError(f"--muon times Muon on matrices: --size muon ({SIZE_TEXT['muon']}), not {opts.size}")
    needed = {**CONFIGS, **MUON_CONFIGS} if opts.muon else CONFIGS
    if opts.configs is None:
        opts.configs = default_config_dir()
    if not Path(opts.configs).is_dir():
        raise ValueError(f"--configs {str(opts.configs)!r} is not a directory (allowed: a directory holding "
                         f"{', '.join(needed)})")
    missing = [c for c in needed if not (Path(opts.configs) / c).is_file()]
    if missing:
        raise ValueError(f"config(s) {', '.join(missing)} not found in {opts.configs} (pass --configs DIR)")


def _machine(threads: int, backend: Backend) -> dict[str, Any]:
    """:func:`machine_info` plus the GPU's description (``gpu``: None on the CPU)."""
    info = machine_info(threads)
    info["gpu"] = backend.info() if backend.info is not None else None
    return info


def run(opts: argparse.Namespace, prog: str = "qconf bench",
        on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark described by ``opts`` (see :func:`add_arguments`); returns the JSON-ready result.
    ``on_event("start", result)`` and ``on_event(size, result)`` report progress (for printing).
    ValueError (one line) for bad options and for ``--device cuda`` without CUDA."""
    opts.device = opts.device or "cpu"
    command = canonical_command(prog, opts)  # before _check fills in the default --configs
    _check(opts)
    backend = make_backend(opts.device)
    torch.set_num_threads(opts.threads)
    baseline = baseline_key(opts.muon)
    rows = select(contenders(opts.configs, opts.min_numel, opts.device, opts.muon), opts.contenders, baseline)
    sizes = SIZE_GROUPS.get(opts.size, [opts.size])
    rss = opts.rss and opts.device == "cpu"
    opts.rss = rss
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "device": opts.device,
        "machine": _machine(opts.threads, backend),
        "settings": {"muon": opts.muon, "baseline": baseline, "rounds": opts.rounds, "slow_rounds": opts.slow_rounds,
                     "slow_factor": SLOW_FACTOR, "warmup": opts.warmup, "threads": opts.threads, "seed": opts.seed,
                     "rss": rss,
                     "rss_steps": opts.rss_steps, "min_numel": opts.min_numel, "lr": LR,
                     "weight_decay": WEIGHT_DECAY, "child_malloc_env": CHILD_MALLOC_ENV,
                     "configs": str(opts.configs)},
        "sizes": {},
    }
    if on_event is not None:
        on_event("start", result)
    for size in sizes:
        result["sizes"][size] = bench_size(size, rows, opts, backend, baseline)
        if on_event is not None:
            on_event(size, result)
    return result


def execute(opts: argparse.Namespace, prog: str) -> int:
    """Run, print the report (each size's table as soon as it is done) and write --json; exit code.
    ``--memory`` runs :func:`~qconf.bench.memory_cli.execute_memory` instead."""
    try:
        check_mode(opts)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if opts.memory:
        return execute_memory(opts, prog)
    opts.device = opts.device or "cpu"
    if opts.cuda_static:
        return cuda_static.run_cli(opts, prog, sorted(Path(opts.configs or default_config_dir()).glob("*.yml")))
    if opts.list:
        for c in contenders(opts.configs or default_config_dir(), opts.min_numel, opts.device, opts.muon):
            print(f"{c.key:30s} {c.label} ({str(c.dtype).replace('torch.', '')})")
        return 0
    def show(event: str, result: dict[str, Any]) -> None:
        text = format_header(result) if event == "start" else format_size(result["sizes"][event])
        if event == "one" and "many" in result["sizes"]:
            text += "\n\n" + format_many_vs_one(result["sizes"]["many"], result["sizes"]["one"])
        print(text + "\n", flush=True)

    try:
        result = run(opts, prog, show)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(format_footer(result), flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "python benchmarks/bench_step.py",
         description: str = DESCRIPTION) -> int:
    """``benchmarks/bench_step.py`` (and ``bench_memory.py``, which passes ``--memory`` first): parse
    ``argv`` and :func:`execute`; returns the exit code."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return execute(parser.parse_args(argv), prog)
