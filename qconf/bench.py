"""Optimizer-step benchmark: qconf vs torch.optim.AdamW, torchao and bitsandbytes low-bit AdamW.

    python benchmarks/bench_step.py [--size big|many|both] [--rounds N] [--threads T] [--json out.json]
    qconf bench ...                                   (same options)

Every contender gets its own copy of the same parameters and the same fixed gradients. After a
warm-up (which also absorbs torch.compile time for torchao), the benchmark runs *rounds*: in each
round it times one ``step()`` of every contender, in a shuffled order, and divides each time by the
time of torch's fused AdamW (fp32) in the same round. A contender's ratio is the median of those
per-round ratios, so slow drifts of the machine (this is a noisy 2-core VM) cancel out; ns/param is
the median of its own step times. Contenders whose step is much slower than the baseline (the
qconf reference path, torchao and bitsandbytes on CPU) are timed in fewer, evenly spread rounds;
the ``rounds`` column says how many.

State bytes/param count the tensors the optimizer actually holds after warm-up (``step`` counters
excluded; qconf: :func:`qconf.memory_report`). Peak extra RSS is measured in a fresh subprocess
per contender: build, warm up, reset the kernel's high-water mark (``/proc/self/clear_refs`` = 5),
run a few steps, read ``VmHWM``; the difference to the RSS before those steps, relative to the
parameter bytes, is the scratch memory a step needs. The child runs glibc malloc with a fixed mmap
threshold and calls ``malloc_trim(0)`` before the baseline, so the previous step's freed
temporaries go back to the OS instead of hiding in the heap.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ._table import format_table

__all__ = ["SIZES", "Contender", "contenders", "add_arguments", "run", "format_report", "execute", "main"]

#: Parameter shapes per size. ``tiny`` is for smoke tests (not advertised in --help).
SIZES: dict[str, list[tuple[int, ...]]] = {
    "big": [(4096, 1024)] * 3,          # 12.6M params in 3 tensors
    "many": [(4096,)] * 1000,           # 4.1M params in 1000 tensors (per-tensor overhead)
    "one": [(1000, 4096)],              # the same 4.1M params as one tensor (what `many` is compared to)
    "tiny": [(64, 128), (64, 128), (100,)],
}
SIZE_TEXT = {"big": "3 tensors of 4096x1024", "many": "1000 tensors of 4096", "one": "1 tensor of 1000x4096",
             "tiny": "2 x 64x128 + 1 x 100"}
#: what --size names: the groups run one after another in one process
SIZE_GROUPS = {"both": ["big", "many"], "all": ["big", "many", "one"]}

LR, WEIGHT_DECAY = 1e-3, 1e-2
BASELINE = "torch-fused"
#: a contender whose warm-up step takes longer than this many baseline steps is timed in fewer rounds
SLOW_FACTOR = 20.0
#: printed before the child's JSON result line
_CHILD_MARK = "@@qconf-bench-rss@@ "
#: qconf configs benchmarked, with the short name used in contender keys
_CONFIGS = {"default.yml": "default", "2nd_moment_group_128.yml": "group128", "8bit.yml": "8bit"}


# ---------------------------------------------------------------------------------------------
# contenders
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Contender:
    """One row: ``build(params) -> optimizer``; ``requires`` names a module that must be importable."""

    key: str
    label: str
    dtype: torch.dtype
    build: Callable[[list[torch.Tensor]], Any]
    requires: str | None = None
    family: str = "torch"
    #: also report this row's per-round time ratio to the row with this key (its cost over that row)
    relative_to: str | None = None


def _qconfig(path: Path, min_numel: int | None) -> Any:
    """The config to hand qconf: the file itself, or its dict with ``min_numel`` replaced."""
    if min_numel is None:
        return str(path)
    import qconf

    data = qconf.load_config(str(path)).to_dict()
    data["min_numel"] = min_numel
    for section in data.get("states", {}).values():
        if isinstance(section, dict) and section.get("min_numel") is not None:
            section["min_numel"] = min_numel
    return data


def contenders(config_dir: str | os.PathLike | None = None, min_numel: int | None = None) -> list[Contender]:
    """Every contender, in table order (the baseline, torch fused fp32, is ``BASELINE``)."""
    cdir = Path(config_dir) if config_dir is not None else default_config_dir()
    f32, bf16 = torch.float32, torch.bfloat16

    def torch_adamw(**kw: Any) -> Callable[[list[torch.Tensor]], Any]:
        return lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, **kw)

    def qconf_adamw(cfg: str, fused: bool, **kw: Any) -> Callable[[list[torch.Tensor]], Any]:
        def build(ps: list[torch.Tensor]) -> Any:
            import qconf

            return qconf.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, qconfig=_qconfig(cdir / cfg, min_numel),
                                     fused=fused, **kw)
        return build

    def torchao_adamw(name: str) -> Callable[[list[torch.Tensor]], Any]:
        def build(ps: list[torch.Tensor]) -> Any:
            cls = getattr(importlib.import_module("torchao.optim"), name)
            return cls(ps, lr=LR, weight_decay=WEIGHT_DECAY)
        return build

    def bnb_adamw8bit(ps: list[torch.Tensor]) -> Any:
        bnb = importlib.import_module("bitsandbytes")
        return bnb.optim.AdamW8bit(ps, lr=LR, weight_decay=WEIGHT_DECAY)

    rows = [
        Contender("torch-forloop", "torch AdamW for-loop", f32, torch_adamw(foreach=False)),
        Contender("torch-foreach", "torch AdamW foreach", f32, torch_adamw(foreach=True)),
        Contender(BASELINE, "torch AdamW fused", f32, torch_adamw(fused=True)),
        Contender("torch-fused-bf16", "torch AdamW fused", bf16, torch_adamw(fused=True)),
    ]
    for dtype, tag in ((f32, "fp32"), (bf16, "bf16")):
        for cfg, short in _CONFIGS.items():
            rows.append(Contender(f"qconf-fused-{short}-{tag}", f"qconf fused {cfg}", dtype,
                                  qconf_adamw(cfg, True), family="qconf"))
    # pure-bf16 weights (docs/precision.md): the same step with stochastic rounding / Kahan
    plain = "qconf-fused-default-bf16"
    rows += [
        Contender(f"{plain}-sr", "qconf fused default.yml + SR weights", bf16,
                  qconf_adamw("default.yml", True, bf16_stochastic_round=True), family="qconf", relative_to=plain),
        Contender(f"{plain}-kahan", "qconf fused default.yml + Kahan weights", bf16,
                  qconf_adamw("default.yml", True, compensation="kahan"), family="qconf", relative_to=plain),
    ]
    rows += [
        Contender("qconf-reference-default-fp32", "qconf reference default.yml", f32,
                  qconf_adamw("default.yml", False), family="qconf"),
        Contender("torchao-adamw4bit", "torchao AdamW4bit", f32, torchao_adamw("AdamW4bit"), "torchao", "torchao"),
        Contender("torchao-adamw8bit", "torchao AdamW8bit", f32, torchao_adamw("AdamW8bit"), "torchao", "torchao"),
        Contender("bnb-adamw8bit", "bitsandbytes AdamW8bit", f32, bnb_adamw8bit, "bitsandbytes", "bitsandbytes"),
    ]
    return rows


def default_config_dir() -> Path:
    """``configs/`` of the source tree qconf is imported from (an editable install or a checkout)."""
    return Path(__file__).resolve().parents[1] / "configs"


def select(all_rows: list[Contender], patterns: Sequence[str] | None) -> list[Contender]:
    """Rows whose key matches one of the fnmatch ``patterns`` (all when None); the baseline is always kept."""
    if not patterns:
        return list(all_rows)
    from fnmatch import fnmatchcase

    keep = [c for c in all_rows if c.key == BASELINE or any(fnmatchcase(c.key, p) for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatchcase(c.key, p) for c in all_rows)]
    if unknown:
        raise ValueError(f"--contenders: {', '.join(map(repr, unknown))} match no contender "
                         f"(known: {', '.join(c.key for c in all_rows)})")
    return keep


# ---------------------------------------------------------------------------------------------
# tensors, state bytes, memory
# ---------------------------------------------------------------------------------------------
def make_base(shapes: Sequence[tuple[int, ...]], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 parameters (N(0, 0.02^2)) and gradients (N(0, 1)), fixed for the run by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    return params, grads


def copy_for(base: tuple[list[torch.Tensor], list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """A contender's own parameters (leaf tensors in ``dtype``) with their own gradient copies."""
    out = []
    for p0, g0 in zip(*base):
        p = p0.to(dtype, copy=True).requires_grad_(True)
        p.grad = g0.to(dtype, copy=True)
        out.append(p)
    return out


def _tensor_storages(t: Any) -> list[torch.Tensor]:
    """Plain tensors behind ``t``: a wrapper subclass (torchao's OptimState*) is flattened."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in _tensor_storages(getattr(t, n))]
    return [t]


def state_bytes(opt: Any) -> int:
    """Bytes of the tensors held in ``opt.state`` (step counters excluded, shared storages once)."""
    from .codec import QTensor

    seen: set[int] = set()
    total = 0
    for state in opt.state.values():
        for key, value in state.items():
            if key == "step":
                continue
            if isinstance(value, QTensor):
                total += value.nbytes
                continue
            if not isinstance(value, torch.Tensor):
                continue
            for t in _tensor_storages(value):
                storage = t.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def state_bytes_per_param(c: Contender, opt: Any, numel: int) -> float:
    if c.family == "qconf":
        import qconf

        return qconf.memory_report(opt).bytes_per_param
    return state_bytes(opt) / numel


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _malloc_trim() -> bool:
    """glibc ``malloc_trim(0)``: give free heap pages (also those between live chunks) back to the OS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# peak extra RSS: one subprocess per contender
# ---------------------------------------------------------------------------------------------
#: glibc malloc: a fixed mmap threshold (which also turns off its dynamic growth) returns freed large
#: temporaries to the OS, and ``malloc_trim(0)`` before the baseline releases the free pages of small
#: ones, so the RSS before the measured steps does not already hold the previous step's scratch.
CHILD_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _child_main(spec_json: str) -> int:
    """Subprocess body: build one contender, warm up, measure the RSS peak of a few steps."""
    spec = json.loads(spec_json)
    torch.set_num_threads(spec["threads"])
    warnings.simplefilter("ignore")
    c = {c.key: c for c in contenders(spec["config_dir"], spec["min_numel"])}[spec["key"]]
    shapes = [tuple(s) for s in spec["shapes"]]
    params = copy_for(make_base(shapes, spec["seed"]), c.dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    opt = c.build(params)
    for _ in range(spec["warmup"]):
        opt.step()
    gc.collect()
    trimmed = _malloc_trim()
    if _reset_hwm():
        method = "clear_refs"
        base_kb = _status_kb("VmRSS")
        for _ in range(spec["steps"]):
            opt.step()
        peak_kb = _status_kb("VmHWM")
    else:  # sample VmRSS from a thread while the steps run (may miss short peaks)
        method = "sampling"
        base_kb = _status_kb("VmRSS")
        peak = [base_kb]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _status_kb("VmRSS"))
                time.sleep(0.0005)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        for _ in range(spec["steps"]):
            opt.step()
        done.set()
        thread.join()
        peak_kb = max(peak[0], _status_kb("VmRSS"))
    extra = max(peak_kb - base_kb, 0) * 1024
    out = {"method": method, "baseline_bytes": base_kb * 1024, "peak_bytes": peak_kb * 1024,
           "extra_bytes": extra, "param_bytes": param_bytes, "pct_of_param_bytes": 100.0 * extra / param_bytes,
           "steps": spec["steps"], "malloc_trim": trimmed}
    print(_CHILD_MARK + json.dumps(out), flush=True)
    return 0


def measure_rss(c: Contender, shapes: Sequence[tuple[int, ...]], opts: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`_child_main` for ``c`` in a fresh interpreter; ``{"error": ...}`` when it fails."""
    spec = {"key": c.key, "shapes": [list(s) for s in shapes], "seed": opts.seed, "threads": opts.threads,
            "warmup": 3, "steps": opts.rss_steps, "config_dir": str(opts.configs), "min_numel": opts.min_numel}
    env = dict(os.environ, **CHILD_MALLOC_ENV)
    code = "import sys, qconf.bench as b; sys.exit(b._child_main(sys.argv[1]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                              env=env, timeout=opts.rss_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {opts.rss_timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_CHILD_MARK):
            return json.loads(line[len(_CHILD_MARK):])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return {"error": f"exit {proc.returncode}: {tail[-1] if tail else 'no output'}"}


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _timed_step(opt: Any) -> int:
    t0 = time.perf_counter_ns()
    opt.step()
    return time.perf_counter_ns() - t0


def _spread(k: int, n: int) -> set[int]:
    """``k`` round indices spread evenly over ``range(n)``."""
    if k >= n:
        return set(range(n))
    return {round(i * (n - 1) / max(k - 1, 1)) for i in range(k)} if k > 1 else {n // 2}


def _log(opts: argparse.Namespace, msg: str) -> None:
    if not opts.quiet:
        print(msg, file=sys.stderr, flush=True)


def bench_size(size: str, rows: list[Contender], opts: argparse.Namespace) -> dict[str, Any]:
    """Time and measure every contender of ``rows`` on one size; returns the JSON-ready result."""
    shapes = SIZES[size]
    numel = sum(math.prod(s) for s in shapes)
    base = make_base(shapes, opts.seed)
    results: dict[str, dict[str, Any]] = {}
    live: dict[str, Any] = {}
    warm_ns: dict[str, int] = {}
    for c in rows:
        r: dict[str, Any] = {"key": c.key, "label": c.label, "dtype": str(c.dtype).replace("torch.", ""),
                             "family": c.family, "status": "ok", "error": None}
        results[c.key] = r
        if c.requires is not None and importlib.util.find_spec(c.requires) is None:
            r.update(status="not installed", error=f"{c.requires} is not installed")
            continue
        _log(opts, f"[{size}] {c.key}: build + {opts.warmup} warm-up steps")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = c.build(copy_for(base, c.dtype))
                times = [_timed_step(opt) for _ in range(opts.warmup)]
        except Exception as e:  # a contender that cannot run here is a row with its error, not a crash
            r.update(status="error", error=_one_line(e))
            continue
        live[c.key] = opt
        warm_ns[c.key] = min(times[1:] or times)
        r["state_bytes_per_param"] = state_bytes_per_param(c, opt, numel)

    rounds = opts.rounds
    schedule: dict[str, set[int]] = {}
    base_warm = warm_ns.get(BASELINE)
    for key in live:
        slow = key != BASELINE and base_warm is not None and warm_ns[key] > SLOW_FACTOR * base_warm
        schedule[key] = _spread(min(opts.slow_rounds, rounds), rounds) if slow else set(range(rounds))
    times: dict[str, list[int | None]] = {key: [None] * rounds for key in live}
    rng = random.Random(opts.seed)
    _log(opts, f"[{size}] {rounds} interleaved rounds over {len(live)} contenders")
    gc.collect()
    cpu_start = _cpu_snapshot()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(rounds):
            order = [key for key in live if i in schedule[key]]
            rng.shuffle(order)
            for key in order:
                if results[key]["status"] != "ok":
                    continue
                try:
                    times[key][i] = _timed_step(live[key])
                except Exception as e:
                    results[key].update(status="error", error=_one_line(e))
    finally:
        if gc_was_enabled:
            gc.enable()
    contention = _contention(cpu_start)

    base_times = times.get(BASELINE)
    for key, ts in times.items():
        r = results[key]
        got = [t for t in ts if t is not None]
        r["times_ns"] = ts
        r["rounds_timed"] = len(got)
        if r["status"] != "ok" or not got:
            continue
        r["ns_per_param"] = statistics.median(got) / numel
        if base_times is not None:
            ratios = [t / b for t, b in zip(ts, base_times) if t is not None and b]
            r["ratios"] = ratios
            if ratios:
                r.update(ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
    for c in rows:  # cost over a related row, from the same rounds
        ref = times.get(c.relative_to) if c.relative_to else None
        if ref is None or c.key not in times or results[c.key]["status"] != "ok":
            continue
        rel = [t / b for t, b in zip(times[c.key], ref) if t is not None and b]
        if rel:
            results[c.key].update(relative_to=c.relative_to, ratio_vs_relative=statistics.median(rel))
    live.clear()
    gc.collect()

    if opts.rss:
        for c in rows:
            r = results[c.key]
            if r["status"] != "ok" or (opts.rss_contenders and not _matches(c.key, opts.rss_contenders)):
                continue
            _log(opts, f"[{size}] {c.key}: peak RSS subprocess")
            r["rss"] = measure_rss(c, shapes, opts)
    return {"size": size, "shapes": SIZE_TEXT[size], "tensors": len(shapes), "numel": numel, "rounds": rounds,
            "other_cpu": contention,
            "slow_rounds": min(opts.slow_rounds, rounds), "rows": [results[c.key] for c in rows]}


def _cpu_snapshot() -> tuple[int, int, int, float] | None:
    """(busy, total, steal) ticks of the whole machine from /proc/stat and this process's CPU seconds."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    t = os.times()
    return busy, busy + idle + iowait, steal, t.user + t.system


def _contention(start: tuple[int, int, int, float] | None) -> dict[str, float] | None:
    """Share of the machine's CPU time that *other* processes (and the hypervisor: steal) used since
    ``start``: the noise indicator printed under each table."""
    end = _cpu_snapshot()
    if start is None or end is None or end[1] <= start[1]:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = end[1] - start[1]
    own = (end[3] - start[3]) * hz
    other = max(end[0] - start[0] - own, 0.0)
    return {"other_pct": 100.0 * other / total, "steal_pct": 100.0 * (end[2] - start[2]) / total}


def _matches(key: str, patterns: Sequence[str]) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(key, p) for p in patterns)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "?"


def machine_info(threads: int) -> dict[str, Any]:
    import qconf

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import qconf.ops  # noqa: F401  (registers torch.ops.qconf)

        isa = str(torch.ops.qconf.cpu_isa())
    except Exception as e:
        isa = f"unavailable ({_one_line(e)})"
    return {"cpu": cpu, "cpus": os.cpu_count(), "qconf_isa": isa,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads,
            "torch": torch.__version__, "qconf": qconf.__version__, "torchao": _version("torchao"),
            "bitsandbytes": _version("bitsandbytes"), "python": platform.python_version()}


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _fmt_ns(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def format_size(res: dict[str, Any]) -> str:
    """One size's table plus footnotes."""
    head = (f"== {res['size']}: {res['shapes']} = {res['numel']:,} params; {res['rounds']} rounds; "
            f"ratios = median (min) over rounds of step time / torch AdamW fused fp32 step time in the same round ==")
    headers = ["contender", "params", "ns/param", "x fused med", "x fused min", "rounds", "state B/param",
               "peak extra RSS", "note"]
    body = []
    slow = False
    methods = set()
    for r in res["rows"]:
        rss = r.get("rss") or {}
        if "pct_of_param_bytes" in rss:
            methods.add(rss["method"])
        note = r["error"] or ""
        if r["status"] == "ok" and rss.get("error"):
            note = f"RSS: {rss['error']}"
        rounds = r.get("rounds_timed")
        mark = ""
        if r["status"] == "ok" and rounds is not None and rounds < res["rounds"]:
            mark, slow = "*", True
        body.append([r["label"] + ("  (baseline)" if r["key"] == BASELINE else ""), r["dtype"],
                     _fmt_ns(r.get("ns_per_param")), _fmt(r.get("ratio_median"), ".2f"), _fmt(r.get("ratio_min"), ".2f"),
                     f"{rounds}{mark}" if r["status"] == "ok" else "", _fmt(r.get("state_bytes_per_param"), ".3f"),
                     f"{rss['pct_of_param_bytes']:.1f}%" if "pct_of_param_bytes" in rss else "", note])
    out = [head, format_table(headers, body, align="llrrrrrrl")]
    labels = {r["key"]: f"{r['label']} ({r['dtype']})" for r in res["rows"]}
    for r in res["rows"]:
        if r.get("ratio_vs_relative") is not None:
            out.append(f"cost: {labels[r['key']]}: {r['ratio_vs_relative']:.2f}x the step time of "
                       f"{labels[r['relative_to']]} (median of per-round ratios).")
    other = res.get("other_cpu")
    if other is not None:
        out.append(f"noise: other processes used {other['other_pct']:.0f}% of the machine's CPU time during the "
                   f"timed rounds (VM steal {other['steal_pct']:.0f}%).")
    if slow:
        out.append(f"* slow contender (warm-up step > {SLOW_FACTOR:g}x the baseline's): timed in {res['slow_rounds']} "
                   f"of the {res['rounds']} rounds, spread evenly; its ratios use the baseline time of those rounds.")
    if "sampling" in methods:
        out.append("peak extra RSS: /proc/self/clear_refs was not writable; sampled VmRSS every 0.5 ms instead "
                   "(can miss short peaks).")
    return "\n".join(out)


def format_header(result: dict[str, Any]) -> str:
    m = result["machine"]
    ext = ", ".join(f"{k} {m[k] or 'not installed'}" for k in ("torchao", "bitsandbytes"))
    lines = [f"qconf optimizer-step benchmark, {result['date']}",
             f"machine: {m['cpu']} ({m['cpus']} CPUs), qconf ISA {m['qconf_isa']} "
             f"(torch capability {m['torch_cpu_capability']}), threads {m['threads']}; torch {m['torch']}, "
             f"qconf {m['qconf']}, {ext}, Python {m['python']}",
             f"command: {result['command']}"]
    if result["settings"]["min_numel"] is not None:
        lines.append(f"qconf configs with min_numel overridden to {result['settings']['min_numel']}")
    return "\n".join(lines)


def format_footer(result: dict[str, Any]) -> str:
    text = ("ns/param = median step time / params. state B/param = optimizer-state tensors after warm-up "
            "(step counters excluded).")
    if result["settings"]["rss"]:
        text += (f" peak extra RSS = VmHWM during {result['settings']['rss_steps']} steps minus RSS before them, "
                 "% of the parameter bytes (fresh subprocess per contender).")
    lines = [text]
    return "\n".join(lines)


def format_report(result: dict[str, Any]) -> str:
    """The whole printed report: header, one table per size, footer."""
    parts = [format_header(result), ""]
    for res in result["sizes"].values():
        parts += [format_size(res), ""]
    if "many" in result["sizes"] and "one" in result["sizes"]:
        parts += [format_many_vs_one(result["sizes"]["many"], result["sizes"]["one"]), ""]
    return "\n".join(parts + [format_footer(result)])


def format_many_vs_one(many: dict[str, Any], one: dict[str, Any]) -> str:
    """Per-tensor overhead: ns/param on 1000 tensors of 4096 over ns/param on one 1000x4096 tensor."""
    lines = ["== per-tensor overhead: ns/param on `many` (1000 x 4096) / ns/param on `one` (1 x 1000x4096) =="]
    by_key = {r["key"]: r for r in one["rows"]}
    for r in many["rows"]:
        o = by_key.get(r["key"])
        if r.get("ns_per_param") and o and o.get("ns_per_param"):
            lines.append(f"{r['label']} ({r['dtype']}): {r['ns_per_param'] / o['ns_per_param']:.2f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``qconf bench`` and ``benchmarks/bench_step.py``)."""
    p.add_argument("--size", choices=["big", "many", "one", "both", "all", "tiny"], default="both",
                   metavar="{big,many,one,both,all}",
                   help="big = 3 tensors of 4096x1024 (12.6M params); many = 1000 tensors of 4096; one = the same "
                        "4.1M params as one 1000x4096 tensor; both (default) = big and many; all = big, many, one; "
                        "one table each")
    p.add_argument("--rounds", type=int, default=50, metavar="N",
                   help="interleaved rounds; each times one step of every contender (default 50)")
    p.add_argument("--slow-rounds", type=int, default=7, metavar="N",
                   help=f"rounds for contenders slower than {SLOW_FACTOR:g}x the baseline (default 7)")
    p.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="untimed steps per contender first (absorbs torch.compile time; default 3)")
    p.add_argument("--threads", type=int, default=2, metavar="T", help="torch.set_num_threads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the parameters, gradients and round order")
    p.add_argument("--contenders", metavar="GLOB,...", type=lambda s: [x for x in s.split(",") if x],
                   help="only these contender keys (fnmatch globs, e.g. 'qconf-fused-*,torch-*'); the baseline "
                        "torch-fused is always run. --list shows the keys")
    p.add_argument("--list", action="store_true", help="list contender keys and exit")
    p.add_argument("--no-rss", dest="rss", action="store_false", help="skip the peak-RSS subprocesses")
    p.add_argument("--rss-contenders", metavar="GLOB,...", type=lambda s: [x for x in s.split(",") if x],
                   help="measure peak RSS only for these contender keys")
    p.add_argument("--rss-steps", type=int, default=3, metavar="N", help="steps measured for peak RSS (default 3)")
    p.add_argument("--rss-timeout", type=float, default=900.0, help=argparse.SUPPRESS)
    p.add_argument("--min-numel", type=int, default=None, metavar="N",
                   help="override the qconf configs' min_numel (a state is quantized iff numel > min_numel; the "
                        "shipped configs use 4096, so 'many' tensors of exactly 4096 keep fp32 states)")
    p.add_argument("--configs", type=Path, default=None, metavar="DIR",
                   help="directory holding default.yml, 2nd_moment_group_128.yml, 8bit.yml (default: the repo's)")
    p.add_argument("--json", metavar="FILE", help="also write every number (raw per-round times too) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def canonical_command(prog: str, opts: argparse.Namespace) -> str:
    """The command with every option explicit (reproduces the run)."""
    argv = ["--size", opts.size, "--rounds", str(opts.rounds), "--slow-rounds", str(opts.slow_rounds),
            "--warmup", str(opts.warmup), "--threads", str(opts.threads), "--seed", str(opts.seed)]
    if opts.contenders:
        argv += ["--contenders", ",".join(opts.contenders)]
    if not opts.rss:
        argv.append("--no-rss")
    else:
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


def run(opts: argparse.Namespace, prog: str = "qconf bench",
        on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark described by ``opts`` (see :func:`add_arguments`); returns the JSON-ready result.
    ``on_event("start", result)`` and ``on_event(size, result)`` report progress (for printing)."""
    for name in ("rounds", "slow_rounds", "threads", "rss_steps"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.warmup < 1:
        raise ValueError("--warmup must be >= 1 (state bytes are read after warm-up)")
    command = canonical_command(prog, opts)
    if opts.configs is None:
        opts.configs = default_config_dir()
    missing = [c for c in _CONFIGS if not (Path(opts.configs) / c).is_file()]
    if missing:
        raise ValueError(f"config(s) {', '.join(missing)} not found in {opts.configs} (pass --configs DIR)")
    torch.set_num_threads(opts.threads)
    rows = select(contenders(opts.configs, opts.min_numel), opts.contenders)
    sizes = SIZE_GROUPS.get(opts.size, [opts.size])
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "machine": machine_info(opts.threads),
        "settings": {"rounds": opts.rounds, "slow_rounds": opts.slow_rounds, "slow_factor": SLOW_FACTOR,
                     "warmup": opts.warmup, "threads": opts.threads, "seed": opts.seed, "rss": opts.rss,
                     "rss_steps": opts.rss_steps, "min_numel": opts.min_numel, "lr": LR,
                     "weight_decay": WEIGHT_DECAY, "child_malloc_env": CHILD_MALLOC_ENV,
                     "configs": str(opts.configs)},
        "sizes": {},
    }
    if on_event is not None:
        on_event("start", result)
    for size in sizes:
        result["sizes"][size] = bench_size(size, rows, opts)
        if on_event is not None:
            on_event(size, result)
    return result


def execute(opts: argparse.Namespace, prog: str) -> int:
    """Run, print the report (each size's table as soon as it is done) and write --json; exit code."""
    if opts.list:
        for c in contenders(opts.configs or default_config_dir(), opts.min_numel):
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


def main(argv: Sequence[str] | None = None, prog: str = "python benchmarks/bench_step.py") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return execute(parser.parse_args(argv), prog)
