"""Peak extra RSS of one optimizer step, measured in a fresh subprocess per contender.

:func:`measure_rss` starts ``python -c "import qconf.bench.rss ...; child_main(spec)"``; the child
(:func:`child_main`) builds the contender, warms it up, resets the kernel's high-water mark
(``/proc/self/clear_refs`` = 5), runs a few steps and reads ``VmHWM``; the difference to the RSS
before those steps, relative to the parameter bytes, is the scratch memory a step needs. The child
runs glibc malloc with a fixed mmap threshold and calls ``malloc_trim(0)`` before the baseline, so
the previous step's freed temporaries go back to the OS instead of hiding in the heap. Where
``clear_refs`` is not writable, a thread samples ``VmRSS`` instead (and may miss short peaks).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from typing import Any, Callable, Sequence

import torch

from .roster import Contender, contenders
from .tensors import copy_for, make_base

#: glibc malloc: a fixed mmap threshold (which also turns off its dynamic growth) returns freed large
#: temporaries to the OS, and ``malloc_trim(0)`` before the baseline releases the free pages of small
#: ones, so the RSS before the measured steps does not already hold the previous step's scratch.
CHILD_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
#: printed before the child's JSON result line
_CHILD_MARK = "@@qconf-bench-rss@@ "
#: what the child interpreter runs (``sys.argv[1]`` is the JSON spec)
_CHILD_CODE = "import sys, qconf.bench.rss as r; sys.exit(r.child_main(sys.argv[1]))"


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def malloc_trim() -> bool:
    """glibc ``malloc_trim(0)``: give free heap pages (also those between live chunks) back to the OS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def sampled_peak_kb(step: Callable[[], Any], steps: int, base_kb: int) -> int:
    """Run ``step()`` ``steps`` times while a thread samples VmRSS every 0.5 ms; the highest sample
    (kB, at least ``base_kb``)."""
    peak = [base_kb]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], status_kb("VmRSS"))
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    for _ in range(steps):
        step()
    done.set()
    thread.join()
    return max(peak[0], status_kb("VmRSS"))


def child_main(spec_json: str) -> int:
    """Subprocess body: build one contender, warm up, measure the RSS peak of a few steps."""
    spec = json.loads(spec_json)
    torch.set_num_threads(spec["threads"])
    warnings.simplefilter("ignore")
    c = {c.key: c for c in contenders(spec["config_dir"], spec["min_numel"], muon=spec.get("muon", False))}[spec["key"]]
    shapes = [tuple(s) for s in spec["shapes"]]
    params = copy_for(make_base(shapes, spec["seed"]), c.dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    opt = c.build(params)
    for _ in range(spec["warmup"]):
        opt.step()
    gc.collect()
    trimmed = malloc_trim()
    if reset_hwm():
        method = "clear_refs"
        base_kb = status_kb("VmRSS")
        for _ in range(spec["steps"]):
            opt.step()
        peak_kb = status_kb("VmHWM")
    else:  # sample VmRSS from a thread while the steps run (may miss short peaks)
        method = "sampling"
        base_kb = status_kb("VmRSS")
        peak_kb = sampled_peak_kb(opt.step, spec["steps"], base_kb)
    extra = max(peak_kb - base_kb, 0) * 1024
    out = {"method": method, "baseline_bytes": base_kb * 1024, "peak_bytes": peak_kb * 1024,
           "extra_bytes": extra, "param_bytes": param_bytes, "pct_of_param_bytes": 100.0 * extra / param_bytes,
           "steps": spec["steps"], "malloc_trim": trimmed}
    print(_CHILD_MARK + json.dumps(out), flush=True)
    return 0


def measure_rss(c: Contender, shapes: Sequence[tuple[int, ...]], opts: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`child_main` for ``c`` in a fresh interpreter; ``{"error": ...}`` when it fails."""
    spec = {"key": c.key, "shapes": [list(s) for s in shapes], "seed": opts.seed, "threads": opts.threads,
            "warmup": 3, "steps": opts.rss_steps, "config_dir": str(opts.configs), "min_numel": opts.min_numel,
            "muon": bool(getattr(opts, "muon", False))}
    return run_child(_CHILD_CODE, _CHILD_MARK, spec, opts.rss_timeout)


def run_child(code: str, mark: str, spec: dict[str, Any], timeout: float, malloc_env: bool = True) -> dict[str, Any]:
    """Run ``python -c code json(spec)`` (with :data:`CHILD_MALLOC_ENV` when ``malloc_env``, else
    with glibc's default allocator settings); the JSON object the child printed after ``mark``, or
    ``{"error": ...}`` (timeout, crash, no result line)."""
    env = dict(os.environ, **(CHILD_MALLOC_ENV if malloc_env else {}))
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                              env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(mark):
            return json.loads(line[len(mark):])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return {"error": f"exit {proc.returncode}: {tail[-1] if tail else 'no output'}"}
