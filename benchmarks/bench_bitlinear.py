#!/usr/bin/env python
"""BitLinear (qconf.nn) against nn.Linear: forward, backward, forward+backward, on the CPU or CUDA.

    python benchmarks/bench_bitlinear.py [--threads 2] [--reps 7] [--slow-reps 1]
        [--shapes 2048x1024x4096,2048x4096x1024] [--no-int-mm] [--breakdown] [--ops] [--json out.json]
    python benchmarks/bench_bitlinear.py --device cuda [--reps 10] [--input-dtype fp32]
        [--shapes 8192x4096x4096,8192x4096x11008,8192x11008x4096] [--json out.json]

CPU (the default). For each shape ``MxKxN`` (input ``[M, K]``, ``K -> N`` features) the contenders --
nn.Linear fp32, nn.Linear bf16 (bf16 weights and input), nn.Linear under bf16 autocast (fp32 weights
and input), BitLinear with fp32 latent weights, BitLinear with bf16 latent weights and input,
BitLinear under bf16 autocast -- run in interleaved rounds after one warm-up round; each time is
the median over ``--reps`` rounds, and every ratio is against nn.Linear fp32 measured in the same
run (``min fwd+bwd x`` compares the fastest rounds instead, less sensitive to other jobs on the
machine). nn.Linear bf16 and under autocast run in the first ``--slow-reps`` rounds only, without a
warm-up: on a CPU without AVX-512 BF16 their GEMMs take seconds (the first call is not slower than
the next). ``backward`` times ``y.backward(g)`` after an untimed forward; ``fwd+bwd`` times both.
``saved B`` is what autograd keeps for backward (summed with saved_tensors_hooks: activations and
weights alike), ``act B`` the part that is not a parameter.

First it times the matrix products themselves: qconf's int8 x ternary kernel (``qconf.ops.ternary_mm``,
AVX2; what BitLinear's forward uses on this CPU), ``torch._int_mm`` int8 x int8 -> int32 once (without
AVX-512 VNNI torch runs it as a scalar loop), fp32 and bf16 ``mm``; with ``--breakdown`` each step of
BitLinear's forward and backward, to say where the time goes. ``--ops`` instead (no timing) counts
the aten ops one forward and one backward run (TorchDispatchMode), on this CPU's paths and on the
torch-op path that CUDA runs (each op there is one kernel launch).

CUDA (``--device cuda``; without CUDA it says so and exits with status 2). The LLM shapes by default.
Contenders: nn.Linear and BitLinear (fp32 weights), each in fp32 and under bf16 autocast (its
input in ``--input-dtype``: fp32, as from a norm that autocast runs in fp32, or bf16, as from a
matmul's output). Interleaved rounds after two warm-up rounds; each round synchronizes,
then times the forward and the backward with CUDA events (so the kernels' launch gaps count);
median of ``--reps`` rounds. Ratios from this one run: BitLinear against nn.Linear of the same
precision (the issue-27 targets: fwd+bwd at most 1.3x and forward at most 1.0x under autocast)
and against nn.Linear fp32; saved bytes as on the CPU; the CUDA kernels each layer launches in one
forward and one backward (torch.profiler).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qconf._table import format_table
from qconf.bench.device import cuda_unavailable_reason
from qconf.nn import BitLinear
from qconf.nn import bitlinear as bl
from qconf.memory import saved_bytes
from qconf.ops import ternary_mm


def _time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_table(shapes: list[tuple[int, int, int]], reps: int, int_mm: bool) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        a, b = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.randint(-1, 2, (n, k), dtype=torch.int8)
        af, bf = a.float(), b.float()
        ab, bb = a.bfloat16(), b.bfloat16()
        out = torch.empty(m, n)
        row = {"shape": f"{m}x{k}x{n}", "fp32_ms": 1e3 * _time(lambda: torch.mm(af, bf.t(), out=out), reps),
               "bf16_ms": 1e3 * _time(lambda: ab @ bb.t(), max(1, reps // 3)),
               "qconf_ms": 1e3 * _time(lambda: ternary_mm(a, b, out), reps) if bl._TERNARY_MM else float("nan")}
        if int_mm:  # one call: it can take seconds (torch's scalar fallback)
            t = time.perf_counter()
            torch._int_mm(a, b.t())
            row["int_mm_ms"] = 1e3 * (time.perf_counter() - t)
        rows.append(row)
    return rows


#: CPU contenders: (module dtype, input dtype, under bf16 autocast); the nn.Linear ones that run bf16
#: GEMMs are timed in the first --slow-reps rounds only
CPU_CONTENDERS = {"linear fp32": (nn.Linear, torch.float32, False),
                  "linear bf16": (nn.Linear, torch.bfloat16, False),
                  "linear autocast": (nn.Linear, torch.float32, True),
                  "bitlinear fp32": (BitLinear, torch.float32, False),
                  "bitlinear bf16": (BitLinear, torch.bfloat16, False),
                  "bitlinear autocast": (BitLinear, torch.float32, True)}
SLOW = ("linear bf16", "linear autocast")


def _autocast(device: str, on: bool) -> contextlib.AbstractContextManager:
    return torch.autocast(device, dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _build(contenders: dict, k: int, n: int, device: str = "cpu") -> dict[str, tuple[nn.Module, torch.dtype, bool]]:
    """Each contender's layer, the same initial weights for all (seed 0)."""
    mods = {}
    for name, (cls, dtype, autocast) in contenders.items():
        torch.manual_seed(0)
        mods[name] = (cls(k, n, device=device, dtype=dtype), dtype, autocast)
    return mods


def _saved(mod: nn.Module, x: torch.Tensor, device: str, autocast: bool) -> tuple[int, int]:
    with _autocast(device, autocast):
        return saved_bytes(mod, x)


def layer_table(shapes: list[tuple[int, int, int]], reps: int, slow_reps: int) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        mods = _build(CPU_CONTENDERS, k, n)
        x32 = torch.randn(m, k)
        g32 = torch.randn(m, n)
        out_dtype = {name: torch.bfloat16 if ac else dt for name, (_, dt, ac) in mods.items()}
        inputs = {name: (x32.to(dt).requires_grad_(), g32.to(out_dtype[name])) for name, (_, dt, _) in mods.items()}
        times: dict[str, dict[str, list[float]]] = {name: {"fwd": [], "bwd": [], "both": []} for name in mods}
        for r in range(reps + 1):  # interleaved rounds; round 0 is a warm-up
            for name, (mod, _, autocast) in mods.items():
                if name in SLOW and not 1 <= r <= slow_reps:
                    continue
                x, g = inputs[name]
                for p in mod.parameters():
                    p.grad = None
                x.grad = None
                t0 = time.perf_counter()
                with _autocast("cpu", autocast):
                    y = mod(x)
                t1 = time.perf_counter()
                y.backward(g)
                t2 = time.perf_counter()
                for key, value in (("fwd", t1 - t0), ("bwd", t2 - t1), ("both", t2 - t0)):
                    if r > 0:
                        times[name][key].append(value)
        base = {key: statistics.median(times["linear fp32"][key]) for key in ("fwd", "bwd", "both")}
        base_min = min(times["linear fp32"]["both"])
        base_saved = saved_bytes(mods["linear fp32"][0], inputs["linear fp32"][0])
        for name, (mod, _, autocast) in mods.items():
            med = {key: statistics.median(times[name][key]) for key in ("fwd", "bwd", "both")}
            saved, act = _saved(mod, inputs[name][0], "cpu", autocast)
            rows.append({"shape": f"{m}x{k}x{n}", "layer": name, "rounds": len(times[name]["fwd"]),
                         **{f"{key}_ms": 1e3 * med[key] for key in med},
                         **{f"{key}_ratio": med[key] / base[key] for key in med},
                         "both_min_ms": 1e3 * min(times[name]["both"]),
                         "both_min_ratio": min(times[name]["both"]) / base_min,
                         "saved_bytes": saved, "saved_ratio": saved / base_saved[0],
                         "act_bytes": act, "act_ratio": act / base_saved[1]})
    return rows


def breakdown(shapes: list[tuple[int, int, int]], reps: int) -> list[dict]:
    """Each step of BitLinear's forward and backward (fp32 latent weights), timed alone."""
    rows = []
    for m, k, n in shapes:
        mod = BitLinear(k, n)
        wc, ac = mod.weight_codec, mod.activation_codec
        x, g = torch.randn(m, k), torch.randn(m, n)
        w = mod.weight.detach()
        xl, xs = ac.encode_integers(x)
        wl, ws = wc.encode_integers(w)
        acc, b = bl.integer_matmul(xl, wl, 127, 1), mod.bias.detach()
        work = acc.clone()  # rescale_ works in place: each round starts from a fresh copy of the product
        steps = {
            "encode activations (int8 per row)": lambda: bl.encode_activations(ac, x),
            "encode weights (ternary absmean)": lambda: bl.encode_weight(wc, w),
            f"integer product ({_product_path()})": lambda: bl.integer_matmul(xl, wl, 127, 1, work),
            "rescale + bias (copy, then addcdiv in place)": lambda: bl.rescale_(work.copy_(acc), xs, ws, b, ac, wc),
            "decode weights (backward)": lambda: wc.decode_integers(wl, ws),
            "decode activations (backward)": lambda: ac.decode_integers(xl, xs),
            "grad_x GEMM": lambda: g @ wc.decode_integers(wl, ws),
            "grad_W GEMM": lambda: g.t() @ ac.decode_integers(xl, xs),
            "nn.Linear fp32 forward GEMM (reference)": lambda: torch.nn.functional.linear(x, w, b),
        }
        for step, fn in steps.items():
            rows.append({"shape": f"{m}x{k}x{n}", "step": step, "ms": 1e3 * _time(fn, reps)})
    return rows


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (views aside: they launch nothing) and those that read or write
    at least ``big`` elements (a pass over a whole matrix)."""
    VIEWS = {"view", "_unsafe_view", "expand", "t", "transpose", "unsqueeze", "squeeze", "select", "slice",
             "as_strided", "detach", "alias", "permute", "_reshape_alias", "empty"}

    def __init__(self, big: int) -> None:
        super().__init__()
        self.big, self.ops, self.passes = big, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in self.VIEWS:
            tensors = [t for t in (*args, *(out if isinstance(out, (tuple, list)) else (out,)))
                       if isinstance(t, torch.Tensor)]
            self.ops += 1
            self.passes += max((t.numel() for t in tensors), default=0) >= self.big
        return out


def op_counts(m: int = 64, k: int = 96, n: int = 80) -> list[dict]:
    """aten ops (each one kernel launch on CUDA) of one BitLinear forward and backward, [m, k] -> n,
    on this CPU's paths and on the torch-op path CUDA runs (no native row passes, torch._int_mm)."""
    import qconf.codec.integer as integer
    import qconf.codec.scales as scales
    rows = []
    for path in ("native (this CPU)", "torch ops (CUDA's)"):
        saved = (getattr(bl, "row_kernels", None), integer.row_kernels, scales.row_kernels, bl._TERNARY_MM,
                 bl._CPU_INT_MM_FAST)
        if path.startswith("torch"):
            bl.row_kernels = integer.row_kernels = scales.row_kernels = lambda *t: False
            bl._TERNARY_MM, bl._CPU_INT_MM_FAST = False, True
        try:
            for autocast in (False, True):
                torch.manual_seed(0)
                mod, x = BitLinear(k, n), torch.randn(m, k, requires_grad=True)
                fwd, bwd = _OpCounter(m * n), _OpCounter(m * n)
                with fwd, _autocast("cpu", autocast):
                    y = mod(x)
                g = torch.randn_like(y)
                with bwd:
                    y.backward(g)
                rows.append({"path": path, "autocast": autocast, "fwd_ops": fwd.ops, "fwd_passes": fwd.passes,
                             "bwd_ops": bwd.ops, "bwd_passes": bwd.passes})
        finally:
            bl.row_kernels, integer.row_kernels, scales.row_kernels, bl._TERNARY_MM, bl._CPU_INT_MM_FAST = saved
    return rows


#: CUDA contenders (fp32 weights): (module, under bf16 autocast); each BitLinear is compared with the
#: nn.Linear of the same precision
GPU_CONTENDERS = {"linear fp32": (nn.Linear, False), "linear autocast": (nn.Linear, True),
                  "bitlinear fp32": (BitLinear, False), "bitlinear autocast": (BitLinear, True)}
GPU_SHAPES = "8192x4096x4096,8192x4096x11008,8192x11008x4096"


def _cuda_round(mod: nn.Module, x: torch.Tensor, g: torch.Tensor, autocast: bool,
                device: str = "cuda") -> tuple[float, float, float]:
    """(forward, backward, both) ms of one step, from CUDA events around each part; the GPU starts
    idle (synchronized), so launch gaps between small kernels count."""
    for p in mod.parameters():
        p.grad = None
    x.grad = None
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    events[0].record()
    with _autocast(device, autocast):
        y = mod(x)
    events[1].record()
    y.backward(g)
    events[2].record()
    torch.cuda.synchronize()
    return events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2]), events[0].elapsed_time(events[2])


def _cuda_kernels(mod: nn.Module, x: torch.Tensor, g: torch.Tensor, autocast: bool,
                  device: str = "cuda") -> tuple[int, int]:
    """CUDA kernels one forward and one backward launch (torch.profiler's device events, less memcpy
    and memset)."""
    from torch.profiler import ProfilerActivity, profile
    counts = []
    for part in ("fwd", "bwd"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if part == "fwd":
                with _autocast(device, autocast):
                    y = mod(x)
            else:
                y.backward(g)
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and not e.name.startswith(("Memcpy", "Memset"))))
    return counts[0], counts[1]


def gpu_table(shapes: list[tuple[int, int, int]], reps: int, input_dtype: torch.dtype,
              device: str = "cuda") -> list[dict]:
    """Interleaved rounds (two warm-ups) of every GPU contender per shape; medians and ratios."""
    rows = []
    for m, k, n in shapes:
        mods = _build({name: (cls, torch.float32, ac) for name, (cls, ac) in GPU_CONTENDERS.items()}, k, n, device)
        x32 = torch.randn(m, k, device=device)
        inputs = {name: (x32.to(input_dtype if ac else torch.float32).requires_grad_(),
                         torch.randn(m, n, device=device, dtype=torch.bfloat16 if ac else torch.float32))
                  for name, (_, _, ac) in mods.items()}
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in mods}
        for r in range(reps + 2):
            for name, (mod, _, autocast) in mods.items():
                t = _cuda_round(mod, *inputs[name], autocast, device)
                if r >= 2:
                    times[name].append(t)
        med = {name: [statistics.median(t[i] for t in times[name]) for i in range(3)] for name in mods}
        for name, (mod, _, autocast) in mods.items():
            same = med["linear autocast" if autocast else "linear fp32"]
            saved, act = _saved(mod, inputs[name][0], device, autocast)
            fwd_k, bwd_k = _cuda_kernels(mod, *inputs[name], autocast, device)
            rows.append({"shape": f"{m}x{k}x{n}", "layer": name, "fwd_ms": med[name][0], "bwd_ms": med[name][1],
                         "both_ms": med[name][2], "fwd_vs_same": med[name][0] / same[0],
                         "both_vs_same": med[name][2] / same[2], "both_vs_fp32": med[name][2] / med["linear fp32"][2],
                         "saved_bytes": saved, "act_bytes": act, "fwd_kernels": fwd_k, "bwd_kernels": bwd_k})
        del mods, x32, inputs
        torch.cuda.empty_cache()
    return rows


def run_gpu(args: argparse.Namespace, p: argparse.ArgumentParser) -> dict:
    """The CUDA section: checks CUDA, prints the device and the table."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        p.error(f"{reason}; run it on a machine with an NVIDIA GPU")
    input_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.input_dtype]
    shapes = _shapes(args.shapes or GPU_SHAPES)
    name = torch.cuda.get_device_name()
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), device: {name}; input {args.input_dtype}, "
          f"fp32 weights; median of {args.reps} rounds\n")
    rows = gpu_table(shapes, args.reps, input_dtype)
    cols = ["shape", "layer", "fwd_ms", "bwd_ms", "both_ms", "fwd_vs_same", "both_vs_same", "both_vs_fp32",
            "saved_bytes", "act_bytes", "fwd_kernels", "bwd_kernels"]
    print("# per layer on CUDA, median ms; 'same' = nn.Linear of the same precision (targets under autocast: "
          "fwd x <= 1.0, fwd+bwd x <= 1.3)")
    print(format_table(["shape", "layer", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd x same", "fwd+bwd x same",
                        "fwd+bwd x fp32", "saved B", "act B", "fwd kernels", "bwd kernels"],
                       [[r[c] for c in cols] for r in rows], float_format=".2f"))
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "input_dtype": args.input_dtype,
            "layers": rows}


def _product_path() -> str:
    if bl._TERNARY_MM:
        return "qconf AVX2 int8 kernel"
    return "torch._int_mm" if bl._CPU_INT_MM_FAST else "fp32 GEMM of the levels"


def _shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]  # type: ignore[misc]


def run_ops() -> dict:
    rows = op_counts()
    print(f"torch {torch.__version__}; aten ops of one BitLinear forward / backward, [64, 96] -> 80 (passes: "
          "ops that read or write a whole matrix)")
    cols = ["path", "autocast", "fwd_ops", "fwd_passes", "bwd_ops", "bwd_passes"]
    print(format_table(["path", "bf16 autocast", "fwd ops", "fwd passes", "bwd ops", "bwd passes"],
                       [[r[c] for c in cols] for r in rows]))
    return {"torch": torch.__version__, "ops": rows}


def run_cpu(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    shapes = _shapes(args.shapes or "2048x1024x4096,2048x4096x1024")
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, AVX-512 VNNI: {torch.cpu._is_vnni_supported()}; "
          f"BitLinear's integer product: {_product_path()}\n")
    out: dict = {"threads": args.threads, "torch": torch.__version__, "product": _product_path()}
    out["matmul"] = matmul_table(shapes, args.reps, not args.no_int_mm)
    cols = ["shape", "fp32_ms", "bf16_ms", "qconf_ms"] + ([] if args.no_int_mm else ["int_mm_ms"])
    print("# matrix product [M,K] @ [K,N] alone, ms")
    print(format_table(cols, [[r[c] for c in cols] for r in out["matmul"]], float_format=".1f") + "\n")
    out["layers"] = layer_table(shapes, args.reps, args.slow_reps)
    cols = ["shape", "layer", "fwd_ms", "bwd_ms", "both_ms", "fwd_ratio", "bwd_ratio", "both_ratio", "both_min_ratio",
            "saved_bytes", "saved_ratio", "act_bytes", "act_ratio"]
    print(f"# per layer, median ms ({args.reps} rounds; nn.Linear bf16 and autocast: {args.slow_reps}); ratios "
          "against nn.Linear fp32 of this run (min: of the fastest rounds); saved = bytes kept for backward, act = "
          "those that are not parameters")
    print(format_table(["shape", "layer", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd x", "bwd x", "fwd+bwd x",
                        "min fwd+bwd x", "saved B", "saved x", "act B", "act x"],
                       [[r[c] for c in cols] for r in out["layers"]], float_format=".2f"))
    if args.breakdown:
        out["breakdown"] = breakdown(shapes, args.reps)
        print("\n# BitLinear steps alone (fp32 latent weights), median ms")
        print(format_table(["shape", "step", "ms"], [[r["shape"], r["step"], r["ms"]] for r in out["breakdown"]],
                           float_format=".1f"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--slow-reps", type=int, default=1,
                   help="CPU: timed rounds of nn.Linear bf16 / autocast (slow without AVX-512 BF16)")
    p.add_argument("--shapes", help=f"MxKxN,... (CPU default 2048x1024x4096,2048x4096x1024; CUDA {GPU_SHAPES})")
    p.add_argument("--no-int-mm", action="store_true", help="CPU: skip timing torch._int_mm (slow without VNNI)")
    p.add_argument("--breakdown", action="store_true", help="CPU: time each step of BitLinear alone")
    p.add_argument("--ops", action="store_true", help="only count the aten ops of one forward and backward (no timing)")
    p.add_argument("--input-dtype", choices=["fp32", "bf16"], default="fp32", help="CUDA: the layers' input dtype")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    if args.ops:
        out = run_ops()
    else:
        out = run_gpu(args, p) if args.device == "cuda" else run_cpu(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
