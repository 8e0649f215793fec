#!/usr/bin/env python
"""BitLinear (qconf.nn) against nn.Linear on the CPU: forward, backward, forward+backward.

    python benchmarks/bench_bitlinear.py [--threads 2] [--reps 7] [--slow-reps 1]
        [--shapes 2048x1024x4096,2048x4096x1024] [--no-int-mm] [--breakdown] [--json out.json]

For each shape ``MxKxN`` (input ``[M, K]``, ``K -> N`` features) the contenders -- nn.Linear fp32,
nn.Linear bf16 (bf16 weights and input), BitLinear with fp32 latent weights, BitLinear with bf16
latent weights and input -- run in interleaved rounds after one warm-up round; each time is the
median over ``--reps`` rounds, and every ratio is against nn.Linear fp32 measured in the same run
(``min fwd+bwd x`` compares the fastest rounds instead, less sensitive to other jobs on the machine).
nn.Linear bf16 runs in the first ``--slow-reps`` rounds only, without a warm-up: on a CPU without
AVX-512 BF16 its GEMMs take seconds (its first call is not slower than the next). ``backward`` times
``y.backward(g)`` after an untimed forward; ``fwd+bwd`` times both. ``saved B`` is what autograd
keeps for backward (summed with saved_tensors_hooks: activations and weights alike), ``act B`` the
part that is not a parameter.

First it times the matrix products themselves: qconf's int8 x ternary kernel (``qconf.ops.ternary_mm``,
AVX2; what BitLinear's forward uses on this CPU), ``torch._int_mm`` int8 x int8 -> int32 once (without
AVX-512 VNNI torch runs it as a scalar loop), fp32 and bf16 ``mm``; with ``--breakdown`` each step of
BitLinear's forward and backward, to say where the time goes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
from torch import nn

from qconf._table import format_table
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


def _contenders(k: int, n: int) -> dict[str, tuple[nn.Module, torch.dtype]]:
    torch.manual_seed(0)
    return {
        "linear fp32": (nn.Linear(k, n), torch.float32),
        "linear bf16": (nn.Linear(k, n, dtype=torch.bfloat16), torch.bfloat16),
        "bitlinear fp32": (BitLinear(k, n), torch.float32),
        "bitlinear bf16": (BitLinear(k, n, dtype=torch.bfloat16), torch.bfloat16),
    }


def layer_table(shapes: list[tuple[int, int, int]], reps: int, slow_reps: int) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        mods = _contenders(k, n)
        x32 = torch.randn(m, k)
        g32 = torch.randn(m, n)
        inputs = {name: (x32.to(dt).requires_grad_(), g32.to(dt)) for name, (_, dt) in mods.items()}
        times: dict[str, dict[str, list[float]]] = {name: {"fwd": [], "bwd": [], "both": []} for name in mods}
        for r in range(reps + 1):  # interleaved rounds; round 0 is a warm-up
            for name, (mod, _) in mods.items():
                if name == "linear bf16" and not 1 <= r <= slow_reps:
                    continue
                x, g = inputs[name]
                for p in mod.parameters():
                    p.grad = None
                x.grad = None
                t0 = time.perf_counter()
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
        for name, (mod, _) in mods.items():
            med = {key: statistics.median(times[name][key]) for key in ("fwd", "bwd", "both")}
            saved, act = saved_bytes(mod, inputs[name][0])
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
            "encode activations (int8 per row)": lambda: ac.encode_integers(x),
            "encode weights (ternary absmean)": lambda: wc.encode_integers(w),
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


def _product_path() -> str:
    if bl._TERNARY_MM:
        return "qconf AVX2 int8 kernel"
    return "torch._int_mm" if bl._CPU_INT_MM_FAST else "fp32 GEMM of the levels"


def _shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]  # type: ignore[misc]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--slow-reps", type=int, default=1, help="timed rounds of nn.Linear bf16 (slow without AVX-512 BF16)")
    p.add_argument("--shapes", default="2048x1024x4096,2048x4096x1024", help="MxKxN,...")
    p.add_argument("--no-int-mm", action="store_true", help="skip timing torch._int_mm (slow without VNNI)")
    p.add_argument("--breakdown", action="store_true", help="time each step of BitLinear alone")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes = _shapes(args.shapes)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"AVX-512 VNNI: {torch.cpu._is_vnni_supported()}; BitLinear's integer product: {_product_path()}\n")
    out: dict = {"threads": args.threads, "torch": torch.__version__, "product": _product_path()}
    out["matmul"] = matmul_table(shapes, args.reps, not args.no_int_mm)
    cols = ["shape", "fp32_ms", "bf16_ms", "qconf_ms"] + ([] if args.no_int_mm else ["int_mm_ms"])
    print("# matrix product [M,K] @ [K,N] alone, ms")
    print(format_table(cols, [[r[c] for c in cols] for r in out["matmul"]], float_format=".1f") + "\n")
    out["layers"] = layer_table(shapes, args.reps, args.slow_reps)
    cols = ["shape", "layer", "fwd_ms", "bwd_ms", "both_ms", "fwd_ratio", "bwd_ratio", "both_ratio", "both_min_ratio",
            "saved_bytes", "saved_ratio", "act_bytes", "act_ratio"]
    print(f"# per layer, median ms ({args.reps} rounds; nn.Linear bf16: {args.slow_reps}); ratios against nn.Linear "
          "fp32 of this run (min: of the fastest rounds); saved = bytes kept for backward, act = those that are not "
          "parameters")
    print(format_table(["shape", "layer", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd x", "bwd x", "fwd+bwd x",
                        "min fwd+bwd x", "saved B", "saved x", "act B", "act x"],
                       [[r[c] for c in cols] for r in out["layers"]], float_format=".2f"))
    if args.breakdown:
        out["breakdown"] = breakdown(shapes, args.reps)
        print("\n# BitLinear steps alone (fp32 latent weights), median ms")
        print(format_table(["shape", "step", "ms"], [[r["shape"], r["step"], r["ms"]] for r in out["breakdown"]],
                           float_format=".1f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
