"""The specialized CUDA kernels measured without a GPU (``qconf bench --cuda-static``,
``benchmarks/cuda_static.py``).

For each shipped config and float32 / bfloat16 parameters, the specs AdamW gives a config's
parameters -- a 2-D weight (4096 x 2048), a 1-D one (8192) and one at or below the config's
min_numel -- come from the extension itself (``torch.ops.qconf.cuda_specs``). Each spec is
compiled for sm_90 exactly as the CUDA step compiles it at first use (``torch.ops.qconf.cuda_compile``:
NVRTC, the same program and options, plus ``--ptxas-options=-v``), and its cubin is read with
cuobjdump (:mod:`qconf.bench.sass` says how the main loop is counted). The table gives, per
kernel, registers, stack frame and spills, SASS instructions per element of the main loop (hot /
static) and the local-memory, barrier and atomic instructions in it, the bytes a step moves per
parameter, and the time this predicts on an H100 for 537M parameters: the larger of the bytes
at 3.3 TB/s and the instructions at 60% of the issue rate (132 SMs x 4 schedulers x 32 lanes x
1.98 GHz), against the bytes of fp32 AdamW (28 per parameter) at the same bandwidth.

Targets for the group-scaled specs (every quantized state with group scales): at most 64
registers, no stack, no spills, at most 100 hot instructions per element, no local-memory or
atomic instruction in the main loop and no barrier -- but one per iteration where a group spans
several warps (more than 256 elements), whose maximum goes through shared memory. Rank-1 specs
(default.yml's 2-D weights) are reported beside them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .sass import LoopCount, count_main_loop, parse_ptxas, parse_sass

__all__ = ["H100", "Tools", "find_tools", "config_specs", "KernelReport", "analyze_spec", "report", "format_table",
           "target_failures", "barriers_allowed", "compile_summary", "main"]

PARAMS = 64 * 4096 * 2048  # the GPU benchmark's parameters (537M)
SHAPES = {"2-D 4096x2048": (4096, 2048), "1-D 8192": (8192,), "small 1024": (1024,)}
H100 = {"bandwidth": 3.3e12, "issue": 132 * 4 * 32 * 1.98e9, "efficiency": 0.6}
ADAMW_BYTES = 28.0  # fp32 AdamW: parameter read + write, gradient, two fp32 states read + write
TARGETS = {"registers": 64, "stack": 0, "spills": 0, "hot_per_element": 100.0}


@dataclasses.dataclass(frozen=True)
class Tools:
    """Where the NVRTC library and cuobjdump are."""
    nvrtc: str
    cuobjdump: str


def find_tools(nvrtc: str | None = None, cuobjdump: str | None = None) -> Tools:
    """NVRTC and cuobjdump: as given, else $QCONF_NVRTC_LIBRARY / $QCONF_CUOBJDUMP, else the pip
    packages nvidia-cuda-nvrtc / nvidia-cuda-cuobjdump, else PATH. FileNotFoundError naming what
    to install if one is missing."""
    roots = []
    try:
        import nvidia  # the pip packages' namespace
        roots = [Path(p) for p in nvidia.__path__]
    except ImportError:
        pass
    nvrtc = nvrtc or os.environ.get("QCONF_NVRTC_LIBRARY") or next(
        (str(p) for r in roots for p in (r / "cu13/lib/libnvrtc.so.13", r / "cuda_nvrtc/lib/libnvrtc.so.12")
         if p.exists()), None)
    cuobjdump = cuobjdump or os.environ.get("QCONF_CUOBJDUMP") or next(
        (str(p) for r in roots for p in (r / "cu13/bin/cuobjdump", r / "cuda_cuobjdump/bin/cuobjdump") if p.exists()),
        shutil.which("cuobjdump"))
    if not nvrtc:
        raise FileNotFoundError("NVRTC not found: pip install nvidia-cuda-nvrtc (or set QCONF_NVRTC_LIBRARY)")
    if not cuobjdump:
        raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump (or set QCONF_CUOBJDUMP)")
    return Tools(nvrtc, cuobjdump)


def _state_bytes(opt) -> dict[str, float]:
    """Bytes per parameter of each parameter's optimizer state (codes, scales, values)."""
    out = {}
    for name, p, _ in opt._named_params():
        total = 0
        for v in opt.state[p].values():
            if hasattr(v, "nbytes") and not isinstance(v, torch.Tensor):
                total += v.nbytes
            elif isinstance(v, torch.Tensor) and v.numel() > 1:
                total += v.numel() * v.element_size()
        out[name] = total / p.numel()
    return out


def config_specs(config: Path, dtype: torch.dtype) -> list[dict[str, Any]]:
    """AdamW's spec of each parameter in SHAPES under `config` (CPU tensors: the specs do not
    depend on the device), with the bytes a step moves per parameter."""
    from ..optim import AdamW
    from ..optim.fused import _signed64

    params = [(role, torch.nn.Parameter(torch.zeros(shape, dtype=dtype))) for role, shape in SHAPES.items()]
    opt = AdamW(params, lr=1e-3, weight_decay=0.01, qconfig=config, fused=True)
    for _, p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    group = opt.param_groups[0]
    plan = opt._kernel._eager_plan(id(group), *opt._plan_source(group))
    names = torch.ops.qconf.cuda_specs(plan.rule, plan.params, [p.grad for p in plan.params], plan.steps,
                                       plan.states, plan.meta, plan.tables, opt._kernel.hyper_values(opt._hyper(group)),
                                       _signed64(opt._seed))
    state = _state_bytes(opt)
    width = torch.finfo(dtype).bits // 8
    rows = []
    for (role, p), spec in zip(params, names):
        moved = 3 * width + 2 * state[role]  # parameter read + write, gradient; states read + write
        if ".r1." in spec:  # the reduce pass reads the gradient and the rank-1 state's codes again
            moved += width + state[role] / 2
        rows.append({"config": config.name, "dtype": str(dtype).replace("torch.", ""), "role": role, "spec": spec,
                     "bytes_per_param": moved})
    return rows


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One kernel of a spec: its resources, and the counts of its main loop."""
    kernel: str
    registers: int
    stack: int
    spills: int
    loop: LoopCount
    compile_s: float  # NVRTC's time for the whole spec (its kernels together); 0.0 on a cache hit


def analyze_spec(spec: str, tools: Tools, arch: int = 90, cache_dir: str = "") -> list[KernelReport]:
    """Compile `spec` for sm_<arch> as the CUDA step does, and read its kernels' cost."""
    start = time.perf_counter()
    cubin, log, hit, _ = torch.ops.qconf.cuda_compile(spec, arch, cache_dir, tools.nvrtc, ["--ptxas-options=-v"])
    seconds = 0.0 if hit else time.perf_counter() - start
    ptxas = parse_ptxas(log)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.cubin"
        path.write_bytes(bytes(cubin.numpy()))
        text = subprocess.run([tools.cuobjdump, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    functions = parse_sass(text)
    kernels = ["qconf_spec_apply"] + (["qconf_spec_reduce"] if ".r1." in spec else [])
    out = []
    for k in kernels:
        r = ptxas[k]
        out.append(KernelReport(k.replace("qconf_spec_", ""), r["registers"], r["stack"],
                                r["spill_stores"] + r["spill_loads"], count_main_loop(functions[k]), seconds))
    return out


def _predicted_ms(bytes_per_param: float, kernels: list[KernelReport]) -> tuple[float, str]:
    """The H100 time of one step of PARAMS parameters, and what bounds it (bytes or issue)."""
    memory = PARAMS * bytes_per_param / H100["bandwidth"]
    issue = PARAMS * sum(k.loop.hot_per_element for k in kernels) / (H100["issue"] * H100["efficiency"])
    return 1e3 * max(memory, issue), "bytes" if memory >= issue else "issue"


def report(configs: Sequence[Path], arch: int = 90, tools: Tools | None = None, cache_dir: str = "",
           dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)) -> list[dict[str, Any]]:
    """A row per (config, dtype, parameter role) with its spec's kernels (each spec compiled once)."""
    tools = tools or find_tools()
    cache: dict[str, list[KernelReport]] = {}
    rows = []
    for config in configs:
        for dtype in dtypes:
            for row in config_specs(config, dtype):
                if row["spec"].startswith("generic"):
                    rows.append({**row, "kernels": []})
                    continue
                if row["spec"] not in cache:
                    cache[row["spec"]] = analyze_spec(row["spec"], tools, arch, cache_dir)
                ms, bound = _predicted_ms(row["bytes_per_param"], cache[row["spec"]])
                rows.append({**row, "kernels": cache[row["spec"]], "predicted_ms": ms, "bound": bound,
                             "x_adamw": ms / (1e3 * PARAMS * ADAMW_BYTES / H100["bandwidth"]),
                             "group_scaled": ".r1." not in row["spec"]})
    return rows


def barriers_allowed(spec: str) -> int:
    """Barriers a spec's main loop may hold: one where a group spans several warps (more than 256
    elements: 32 threads x 8), whose maximum is exchanged through shared memory; else none."""
    return 1 if any(int(g) > 256 for g in re.findall(r"\.g(\d+)\.", spec)) else 0


def target_failures(rows: list[dict[str, Any]]) -> list[str]:
    """Why each group-scaled spec misses a target, with the figure (none: all met)."""
    out = []
    for row in rows:
        for k in row["kernels"] if row.get("group_scaled") else []:
            f = k.loop.forbidden
            checks = {"registers": (k.registers <= TARGETS["registers"], k.registers),
                      "stack": (k.stack <= TARGETS["stack"], k.stack), "spills": (k.spills <= TARGETS["spills"], k.spills),
                      "hot SASS per element": (k.loop.hot_per_element <= TARGETS["hot_per_element"],
                                               f"{k.loop.hot_per_element:.1f}"),
                      "local/barrier/atomic": (not f["local"] and not f["atomic"]
                                               and f["barrier"] <= barriers_allowed(row["spec"]),
                                               f"{f['local']}/{f['barrier']}/{f['atomic']}")}
            out += [f"{row['spec']} {k.kernel}: {what} {value}" for what, (ok, value) in checks.items() if not ok]
    return sorted(set(out))


def compile_summary(rows: list[dict[str, Any]]) -> str:
    """One line: how long NVRTC took per spec (what a spec's first use costs, on this CPU)."""
    seconds = sorted({r["spec"]: r["kernels"][0].compile_s for r in rows if r["kernels"]}.values())
    compiled = [t for t in seconds if t > 0]
    if not compiled:
        return f"first-use compile: every one of {len(seconds)} specs came from the cache ($QCONF_CACHE_DIR)"
    return (f"first-use compile (NVRTC, this CPU, one thread): median {compiled[len(compiled) // 2]:.2f} s, "
            f"max {compiled[-1]:.2f} s per spec ({len(compiled)} specs compiled)")


def format_table(rows: list[dict[str, Any]], arch: int) -> str:
    """The report as a text table (a line per kernel of a row)."""
    head = (f"Specialized CUDA kernels, compiled for sm_{arch} with NVRTC as at first use; SASS per element of the "
            f"main loop (hot / static; qconf/bench/sass.py); predicted: one AdamW step of {PARAMS / 1e6:.0f}M "
            f"parameters on an H100 (3.3 TB/s, 60% of issue)")
    cols = ["config", "params", "parameter", "spec", "kernel", "regs", "stack", "spills", "SASS/elem", "LDL/BAR/ATOM",
            "B/param", "predicted ms", "x fp32 AdamW"]
    lines = []
    for r in rows:
        if not r["kernels"]:
            lines.append([r["config"], r["dtype"], r["role"], r["spec"], "", "", "", "", "", "", "", "", ""])
        for j, k in enumerate(r["kernels"]):
            first = j == 0
            f = k.loop.forbidden
            lines.append([r["config"] if first else "", r["dtype"] if first else "", r["role"] if first else "",
                          r["spec"] if first else "", k.kernel, str(k.registers), str(k.stack), str(k.spills),
                          f"{k.loop.hot_per_element:.1f} / {k.loop.static_per_element:.1f}",
                          f"{f['local']}/{f['barrier']}/{f['atomic']}",
                          f"{r['bytes_per_param']:.2f}" if first else "",
                          f"{r['predicted_ms']:.2f} ({r['bound']})" if first else "",
                          f"{r['x_adamw']:.2f}" if first else ""])
    widths = [max(len(c), *(len(l[i]) for l in lines)) for i, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([head, "", fmt(cols), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The static report's options (``qconf bench --cuda-static`` adds --arch; the script all)."""
    p.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90: H100/H200)")


def main(argv: Sequence[str] | None = None, prog: str = "python benchmarks/cuda_static.py") -> int:
    """Print the table for the shipped configs (--json FILE: also write it); exit 1 if a target is missed."""
    from ..config.builtin import builtin_dir

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--configs", type=Path, nargs="*", metavar="YML", help="configs (default: every shipped one)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    opts = parser.parse_args(argv)
    return run_cli(opts, prog, opts.configs or sorted(builtin_dir().glob("*.yml")))


def run_cli(opts: argparse.Namespace, prog: str, configs: Sequence[Path]) -> int:
    """Report, print, --json; the exit code (2: tools missing, 1: a target missed)."""
    try:
        # no cache unless $QCONF_CACHE_DIR names one: every spec is compiled as at its first use
        rows = report(configs, opts.arch, cache_dir=os.environ.get("QCONF_CACHE_DIR", ""))
    except (FileNotFoundError, RuntimeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows, opts.arch))
    print("\n" + compile_summary(rows))
    failures = target_failures(rows)
    print("\ntargets (group-scaled specs: <= 64 registers, no stack or spills, <= 100 hot SASS per element, no "
          "local/atomic in the main loop, no barrier but one where a group spans warps): "
          + ("all met" if not failures else "MISSED: " + "; ".join(failures)))
    if getattr(opts, "json", None):
        Path(opts.json).write_text(json.dumps([{**r, "kernels": [dataclasses.asdict(k) for k in r["kernels"]]}
                                               for r in rows], indent=1) + "\n")
    return 1 if failures else 0
