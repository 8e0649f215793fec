"""Measuring one size: warm-up, interleaved timing rounds, ratios, peak RSS, CPU contention, and
the machine description the report starts with.

After a warm-up (which also absorbs torch.compile time for torchao), :func:`bench_size` runs
*rounds*: in each round it times one ``step()`` of every contender, in a shuffled order, and divides
each time by the time of torch's fused AdamW (fp32) in the same round. A contender's ratio is the
median of those per-round ratios, so slow drifts of the machine cancel out; ns/param is the median
of its own step times. Contenders whose warm-up step is more than :data:`SLOW_FACTOR` times the
baseline's are timed in fewer, evenly spread rounds.

Every device-specific call goes through a :class:`~qconf.bench.device.Backend` (``--device cpu``
or ``cuda``): its ``sync`` runs before and after each timed step, its ``clock`` times it. On CUDA
the rounds also time the device copy (:func:`~qconf.bench.device.copy_step`) as one more
pseudo-contender, and the warm-up records each contender's peak device memory.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import platform
import random
import statistics
import sys
import warnings
from typing import Any, Callable

import torch

from .. import __version__
from .. import _native  # the native probe loads qconf._C, which registers torch.ops.qconf.cpu_isa
from .device import COPY_KEY, Backend, bytes_per_param_moved, copy_step, cpu_backend, grads_checksum, with_env
from .roster import BASELINE, Contender, matches
from .rss import measure_rss
from .tensors import copy_for, make_base, shared_grads, state_bytes_per_param

#: Parameter shapes per size. ``tiny`` is for smoke tests (not advertised in --help).
SIZES: dict[str, list[tuple[int, ...]]] = {
    "big": [(4096, 1024)] * 3,          # 12.6M params in 3 tensors
    "many": [(4096,)] * 1000,           # 4.1M params in 1000 tensors (per-tensor overhead)
    "one": [(1000, 4096)],              # the same 4.1M params as one tensor (what `many` is compared to)
    "gpu": [(4096, 2048)] * 64,         # 537M params in 64 tensors (--device cuda)
    "tiny": [(64, 128), (64, 128), (100,)],
    # --muon: matrices only, small enough that torch's bf16 Newton-Schulz takes seconds, not minutes,
    # on a CPU; a wide and a tall one (Newton-Schulz transposes the tall one)
    "muon": [(256, 512), (512, 256)],   # 262,144 params in 2 matrices
    "muon-smoke": [(64, 128), (128, 64)],  # (smoke tests; not advertised; quantized: numel > 4096)
}
SIZE_TEXT = {"big": "3 tensors of 4096x1024", "many": "1000 tensors of 4096", "one": "1 tensor of 1000x4096",
             "gpu": "64 tensors of 4096x2048",
             "tiny": "2 x 64x128 + 1 x 100", "muon": "2 matrices, 256x512 and 512x256",
             "muon-smoke": "2 matrices, 64x128 and 128x64"}
#: the sizes of the Muon roster (``--muon``: 2-D parameters only)
MUON_SIZES = ("muon", "muon-smoke")
#: what --size names: the groups run one after another in one process
SIZE_GROUPS = {"both": ["big", "many"], "all": ["big", "many", "one"]}
#: a contender whose warm-up step takes longer than this many baseline steps is timed in fewer rounds
SLOW_FACTOR = 20.0


def one_line(e: BaseException) -> str:
    """``Type: message`` of ``e`` on one line, at most 160 characters."""
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _timed_step(step: Callable[[], Any], backend: Backend) -> int:
    """Nanoseconds of one ``step()``, with ``backend.sync()`` before and after it."""
    backend.sync()
    t0 = backend.clock()
    step()
    backend.sync()
    return backend.clock() - t0


def _last_step(step: Callable[[], Any], backend: Backend) -> tuple[int, int | None]:
    """One timed step: ``(ns, peak device bytes during it above the bytes allocated before it)``;
    the peak is None without memory probes (which it resets)."""
    if not backend.measures_memory:
        return _timed_step(step, backend), None
    before = backend.allocated()
    backend.reset_peak()
    ns = _timed_step(step, backend)
    return ns, backend.max_allocated() - before


def _spread(k: int, n: int) -> set[int]:
    """``k`` round indices spread evenly over ``range(n)``."""
    if k >= n:
        return set(range(n))
    return {round(i * (n - 1) / max(k - 1, 1)) for i in range(k)} if k > 1 else {n // 2}


def _log(opts: argparse.Namespace, msg: str) -> None:
    if not opts.quiet:
        print(msg, file=sys.stderr, flush=True)


def _warm_up(size: str, rows: list[Contender], base: Any, numel: int, opts: argparse.Namespace,
             backend: Backend, grads: dict[torch.dtype, list[torch.Tensor]] | None = None
             ) -> tuple[dict[str, dict[str, Any]], dict[str, Callable[[], Any]], dict[str, int]]:
    """Build every contender on its copy of ``base`` (on ``backend.device``; ``grads``: shared
    gradients per dtype) and run the warm-up steps: ``(results, live steps, fastest warm-up step
    ns)``. A contender that cannot run is a row with its error. With memory probes, a row's
    ``peak_mem_bytes`` is the peak allocated during its build and warm-up above what was allocated
    before (its parameters, states and step temporaries; shared gradients not counted) and
    ``step_extra_bytes`` the last warm-up step's peak above what was allocated before it."""
    results: dict[str, dict[str, Any]] = {}
    live: dict[str, Callable[[], Any]] = {}
    warm_ns: dict[str, int] = {}
    for c in rows:
        r: dict[str, Any] = {"key": c.key, "label": c.label, "dtype": str(c.dtype).replace("torch.", ""),
                             "family": c.family, "status": "ok", "error": None}
        results[c.key] = r
        if c.requires is not None and importlib.util.find_spec(c.requires) is None:
            r.update(status="not installed", error=f"{c.requires} is not installed")
            continue
        _log(opts, f"[{size}] {c.key}: build + {opts.warmup} warm-up steps")
        before = backend.allocated() if backend.measures_memory else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt, step, times, peak, step_extra = _build_and_warm(c, base, opts.warmup, backend, grads)
        except Exception as e:  # a contender that cannot run here is a row with its error, not a crash
            r.update(status="error", error=one_line(e))
            backend.release()
            continue
        if before is not None:
            r.update(peak_mem_bytes=peak - before, step_extra_bytes=step_extra)
        live[c.key] = step
        warm_ns[c.key] = min(times[1:] or times)
        r["state_bytes_per_param"] = state_bytes_per_param(c, opt, numel)
        if backend.copy_bytes_per_param:
            r["bytes_per_param_moved"] = bytes_per_param_moved(c.dtype, r["state_bytes_per_param"])
    return results, live, warm_ns


def _build_and_warm(c: Contender, base: Any, warmup: int, backend: Backend,
                    grads: dict[torch.dtype, list[torch.Tensor]] | None
                    ) -> tuple[Any, Callable[[], Any], list[int], int | None, int | None]:
    """Build ``c`` (inside its ``env``) and run its warm-up: ``(optimizer, step, times, peak device
    bytes allocated during the build and warm-up, the last warm-up step's extra device bytes)``;
    both None without memory probes."""
    if backend.measures_memory:
        backend.reset_peak()
    own_grads = grads.get(c.dtype) if grads else None
    opt = with_env(lambda: c.build(copy_for(base, c.dtype, backend.device, own_grads)), c.env)()
    step = with_env(opt.step, c.env)
    times = [_timed_step(step, backend) for _ in range(warmup - 1)]
    peak = backend.max_allocated() if backend.measures_memory else None
    last, step_extra = _last_step(step, backend)
    if peak is not None:
        peak = max(peak, backend.max_allocated())
    return opt, step, times + [last], peak, step_extra


def _timed_rounds(size: str, live: dict[str, Callable[[], Any]], warm_ns: dict[str, int],
                  results: dict[str, dict[str, Any]], opts: argparse.Namespace, backend: Backend,
                  baseline: str = BASELINE) -> tuple[dict[str, list[int | None]], dict[str, float] | None]:
    """The interleaved rounds: ``(step ns per contender and round (None: not timed), CPU contention)``.
    Slow contenders (against ``baseline``'s warm-up) run in :func:`_spread` rounds only; the order
    within a round is shuffled."""
    rounds = opts.rounds
    schedule: dict[str, set[int]] = {}
    base_warm = warm_ns.get(baseline)
    for key in live:
        slow = key != baseline and base_warm is not None and warm_ns[key] > SLOW_FACTOR * base_warm
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
                    times[key][i] = _timed_step(live[key], backend)
                except Exception as e:
                    results[key].update(status="error", error=one_line(e))
    finally:
        if gc_was_enabled:
            gc.enable()
    return times, _contention(cpu_start)


def _summarize(rows: list[Contender], times: dict[str, list[int | None]], results: dict[str, dict[str, Any]],
               numel: int, baseline: str = BASELINE) -> None:
    """Add ns/param, the ratios to the ``baseline`` row and to ``relative_to`` rows to ``results``."""
    base_times = times.get(baseline)
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


def _copy_summary(results: dict[str, dict[str, Any]], times: dict[str, list[int | None]], nbytes: int,
                  numel: int) -> dict[str, Any] | None:
    """Pop the device copy's row out of ``results``; add each row's bandwidth and its fraction of
    the copy's, per round: ``(row bytes / row time) / (copy bytes / copy time in the same round)``,
    the median over rounds. Returns the copy's summary (None when it was not timed)."""
    r = results.pop(COPY_KEY, None)
    copy_times = times.pop(COPY_KEY, None)
    if r is None or copy_times is None or r.get("ns_per_param") is None:
        return None
    median_ns = r["ns_per_param"] * numel
    for row in results.values():
        moved = row.get("bytes_per_param_moved")
        if moved is None or row.get("ns_per_param") is None:
            continue
        row["gb_per_s"] = moved / row["ns_per_param"]  # bytes/ns = GB/s
        fractions = [(moved * numel / t) / (nbytes / b) for t, b in zip(times[row["key"]], copy_times) if t and b]
        if fractions:
            row["copy_fraction"] = statistics.median(fractions)
    return {"bytes": nbytes, "times_ns": copy_times, "median_ns": median_ns, "gb_per_s": nbytes / median_ns,
            "ratio_median": r.get("ratio_median")}


def _start_copy(numel: int, backend: Backend, results: dict[str, dict[str, Any]],
                live: dict[str, Callable[[], Any]], warm_ns: dict[str, int]) -> int:
    """Add the device copy to the rounds (``backend.copy_bytes_per_param`` B/param); its bytes per step."""
    step, nbytes = copy_step(numel, backend)
    results[COPY_KEY] = {"key": COPY_KEY, "label": "device copy", "dtype": "uint8", "family": "copy",
                         "status": "ok", "error": None}
    live[COPY_KEY] = step
    warm_ns[COPY_KEY] = min(_timed_step(step, backend) for _ in range(2))
    return nbytes


def bench_size(size: str, rows: list[Contender], opts: argparse.Namespace,
               backend: Backend | None = None, baseline: str = BASELINE) -> dict[str, Any]:
    """Time and measure every contender of ``rows`` on one size on ``backend`` (default: the CPU),
    every ratio against the row ``baseline`` (torch fused AdamW; the Muon roster's torch.optim.Muon);
    returns the JSON-ready result."""
    backend = backend or cpu_backend()
    shapes = SIZES[size]
    numel = sum(math.prod(s) for s in shapes)
    base = make_base(shapes, opts.seed)
    grads = shared_grads(base, [c.dtype for c in rows], backend.device) if backend.share_grads else None
    checksum = grads_checksum(grads) if grads else None
    results, live, warm_ns = _warm_up(size, rows, base, numel, opts, backend, grads)
    nbytes = _start_copy(numel, backend, results, live, warm_ns) if backend.copy_bytes_per_param else 0
    times, contention = _timed_rounds(size, live, warm_ns, results, opts, backend, baseline)
    _summarize(rows, times, results, numel, baseline)
    copy = _copy_summary(results, times, nbytes, numel) if nbytes else None
    modified = grads is not None and grads_checksum(grads) != checksum
    live.clear()
    del grads
    gc.collect()
    backend.release()
    extra = {"device": backend.device.type, "copy": copy, "grads_modified": modified} if nbytes else {}

    if opts.rss and not backend.measures_memory:  # a device reports its own peak memory instead
        for c in rows:
            r = results[c.key]
            if r["status"] != "ok" or (opts.rss_contenders and not matches(c.key, opts.rss_contenders)):
                continue
            _log(opts, f"[{size}] {c.key}: peak RSS subprocess")
            r["rss"] = measure_rss(c, shapes, opts)
    return {"size": size, "shapes": SIZE_TEXT[size], "tensors": len(shapes), "numel": numel, "rounds": opts.rounds,
            "baseline": baseline, "other_cpu": contention,
            "slow_rounds": min(opts.slow_rounds, opts.rounds), "rows": [results[c.key] for c in rows], **extra}


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


def package_version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "?"


def machine_info(threads: int) -> dict[str, Any]:
    """CPU model and count, qconf's selected CPU ISA, thread count and package versions."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if not _native.native_available():
        isa = "unavailable (qconf built without its extension qconf._C: reference path only)"
    else:
        try:
            isa = str(torch.ops.qconf.cpu_isa())
        except Exception as e:
            isa = f"unavailable ({one_line(e)})"
    return {"cpu": cpu, "cpus": os.cpu_count(), "qconf_isa": isa,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads,
            "torch": torch.__version__, "qconf": __version__, "torchao": package_version("torchao"),
            "bitsandbytes": package_version("bitsandbytes"), "python": platform.python_version()}
