"""Peak extra memory of one optimizer step, and the chunked reference step's exactness.

Memory (docs/optimizers.md, "Non-contiguous parameters and the memory of a step"): a fresh
interpreter with ``qconf.bench.rss``'s malloc settings (large temporaries go back to the OS when
freed) builds each case and takes one warm-up step (states and plans exist); then it resets the
kernel's RSS high-water mark (``/proc/self/clear_refs``) and reads ``VmHWM - VmRSS`` around one more
step. Before, the transposed parameter fell back to the reference path (+9.3x its size), a 2-bit SGD
step on a bf16 parameter with ``fused=False`` took +25x its size and ``configs/default.yml`` +9.3x;
the bounds below are 1x (2x with a non-contiguous gradient, which the kernel copies too) plus a few
MiB.

Exactness: the chunked reference step gives the whole-tensor step's bits; with tiny chunks (many
chunks per tensor, rows split between chunks) it is compared with the fused kernel, which matches
the reference bit for bit (tests/test_fused.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from qconf import _native
from qconf.bench.rss import CHILD_MALLOC_ENV
from qconf.codec import QTensor
from qconf.optim import SGD, AdamW, Lion
from qconf.optim import reference

MiB = 1 << 20
#: what one step may take beyond its bound: interpreter, allocator and page-granularity noise
SLACK = 6 * MiB

needs_fused = pytest.mark.skipif(not _native.fused_available(), reason="fused kernels unavailable")
needs_hwm = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                               reason="needs a writable /proc/self/clear_refs (Linux) to reset the RSS high-water mark")

_MARK = "@@qconf-memory@@ "
_CHILD = r'''
import gc, json, sys, warnings
import torch
import qconf.optim as optim
from qconf.bench.rss import malloc_trim, reset_hwm, status_kb

torch.set_num_threads(1)
results = []
for case in json.loads(sys.argv[1]):
    dtype = getattr(torch, case["dtype"])
    rows, cols = case["shape"]
    g = torch.Generator().manual_seed(0)
    if case["transposed"]:  # a (rows, cols) parameter stored column-major: strides (1, rows)
        p = torch.nn.Parameter(torch.randn(cols, rows, generator=g).to(dtype).t())
    else:
        p = torch.nn.Parameter(torch.randn(rows, cols, generator=g).to(dtype))
    grad = torch.randn(rows, cols, generator=g).to(dtype)
    p.grad = grad.t().contiguous().t() if case["grad_transposed"] else grad
    ptr, strides = p.data_ptr(), p.stride()
    opt = getattr(optim, case["opt"])([p], qconfig=case["qconfig"], fused=case["fused"], **case["kwargs"])
    if case["forbid_reference"]:
        def refuse(*args, **kwargs):
            raise AssertionError("the reference path ran")
        opt._reference_group = refuse
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # warm-up: states and plans
        gc.collect()
        malloc_trim()
        if not reset_hwm():
            raise SystemExit("cannot reset the RSS high-water mark")
        base = status_kb("VmRSS")
        opt.step()
        peak = status_kb("VmHWM")
    results.append({"extra": (peak - base) * 1024, "param_bytes": p.numel() * p.element_size(),
                    "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
                    "same_storage": p.data_ptr() == ptr and p.stride() == strides,
                    "finite": bool(torch.isfinite(p).all())})
    del opt, p, grad, g
    gc.collect()
print("@@qconf-memory@@ " + json.dumps(results), flush=True)
'''


def _measure(cases: list[dict]) -> list[dict]:
    """Run ``cases`` one after the other in a fresh interpreter; their measurements."""
    env = dict(os.environ, **CHILD_MALLOC_ENV)
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise AssertionError(f"the measuring child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _case(opt, dtype, shape, fused, qconfig=None, transposed=False, grad_transposed=False, forbid_reference=False,
          **kwargs):
    return {"opt": opt, "dtype": dtype, "shape": list(shape), "fused": fused, "qconfig": qconfig,
            "transposed": transposed, "grad_transposed": grad_transposed, "forbid_reference": forbid_reference,
            "kwargs": kwargs}


TWO_BIT_SGD = {"states": {"exp_avg": {"bits": 2}}}  # SGD's momentum_buffer is the exp_avg section

MEMORY_CASES = [  # (case, bound in parameter sizes), 8 MiB parameters
    # a transposed fp32 parameter: fused (no warning, no reference step), one parameter-sized copy ...
    (_case("AdamW", "float32", (2048, 1024), None, transposed=True, forbid_reference=True, lr=1e-3), 1),
    # ... and with its gradient transposed too, which the kernel copies as well
    (_case("AdamW", "float32", (2048, 1024), True, transposed=True, grad_transposed=True, forbid_reference=True,
           lr=1e-3), 2),
    # the reference path in chunks: 2-bit SGD on bf16 (group scales: one pass) ...
    (_case("SGD", "bfloat16", (2048, 2048), False, TWO_BIT_SGD, lr=1e-2, momentum=0.9), 1),
    # ... and the paper's 4-bit AdamW (a rank-1 second moment: two passes) on fp32
    (_case("AdamW", "float32", (2048, 1024), False, "default", lr=1e-3), 1),
]


@needs_hwm
@needs_fused
def test_peak_extra_memory_of_one_step_is_bounded_by_the_parameter():
    results = _measure([case for case, _ in MEMORY_CASES])
    for (case, bound), r in zip(MEMORY_CASES, results):
        what = f"{case['opt']} {case['dtype']} {case['shape']} fused={case['fused']}"
        assert r["same_storage"] and r["finite"], what
        assert r["warnings"] == [], (what, r["warnings"])
        limit = bound * r["param_bytes"] + SLACK
        assert r["extra"] <= limit, (f"{what}: one step took {r['extra'] / MiB:.1f} MiB beyond its baseline, more "
                                     f"than {bound} x the parameter's {r['param_bytes'] / MiB:.0f} MiB + "
                                     f"{SLACK / MiB:.0f} MiB")


# -- non-contiguous parameters take the fused step ------------------------------------------------------
def _noncontig_params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(200, 96, generator=g).to(dtype).t()),              # transposed
            torch.nn.Parameter(torch.randn(4097, generator=g).to(dtype)),                     # contiguous
            torch.nn.Parameter(torch.randn(7, 3, 5, generator=g).to(dtype).permute(1, 2, 0)),  # permuted
            torch.nn.Parameter(torch.randn(64, 130, generator=g).to(dtype)[:, 1:129])]        # a column slice


def _steps(make, dtype, fused, grad_transposed, steps=3):
    params = _noncontig_params(dtype)
    layout = [(p.data_ptr(), p.stride()) for p in params]
    opt = make(params, fused)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            grad = torch.randn(p.shape, generator=g).to(dtype)
            p.grad = grad.transpose(0, 1).contiguous().transpose(0, 1) if grad_transposed and grad.dim() > 1 else grad
        opt.step()
    assert [(p.data_ptr(), p.stride()) for p in params] == layout  # updated in place
    return params, opt


def _assert_same_steps(a, b):
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
        for k, u in oa.state[x].items():
            v = ob.state[y][k]
            if isinstance(u, QTensor):
                assert torch.equal(u.codes, v.codes) and torch.equal(u.scales, v.scales), k
            else:
                assert torch.equal(u, v), k


NONCONTIG_RULES = {
    "adamw-default": lambda ps, f: AdamW(ps, lr=1e-2, weight_decay=0.1, qconfig="default", fused=f, seed=1),
    "sgd-2bit-sr-kahan": lambda ps, f: SGD(ps, lr=1e-2, momentum=0.9, fused=f, seed=1, qconfig={
        "min_numel": 0, "states": {"exp_avg": {"bits": 2, "rounding": "stochastic"}},
        "weights": {"rounding": "stochastic", "compensation": "kahan"}}),
    "lion-dim1": lambda ps, f: Lion(ps, lr=1e-3, fused=f, seed=1, qconfig={
        "min_numel": 0, "states": {"exp_avg": {"scale": "dim1", "bits": 8}}}),
}


@needs_fused
@pytest.mark.parametrize("rule", sorted(NONCONTIG_RULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_contiguous_parameters_take_the_fused_step(rule, dtype):
    """fused=True and fused=None (no warning) step non-contiguous parameters, with contiguous or
    non-contiguous gradients, in place and bit for bit as the reference path does."""
    make = NONCONTIG_RULES[rule]
    for grad_transposed in (False, True):
        ref = _steps(make, dtype, False, grad_transposed)
        _assert_same_steps(ref, _steps(make, dtype, True, grad_transposed))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # fused=None: no fallback warning
            _assert_same_steps(ref, _steps(make, dtype, None, grad_transposed))


@needs_fused
def test_a_parameter_that_becomes_non_contiguous_is_replanned():
    p = torch.nn.Parameter(torch.randn(64, 96))
    q = torch.nn.Parameter(p.detach().clone())
    fused, ref = AdamW([p], lr=1e-2, fused=True), AdamW([q], lr=1e-2, fused=False)
    for step in range(3):
        if step == 1:  # same values, now column-major (the cached plan took it contiguous)
            p.data = p.data.t().contiguous().t()
            q.data = q.data.t().contiguous().t()
        g = torch.randn(64, 96)
        p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        ref.step()
        assert torch.equal(p, q)
    assert not p.is_contiguous()


# -- the chunked reference step -------------------------------------------------------------------------
CHUNK_CONFIGS = {
    "default": "default",
    "group-odd-sr": {"min_numel": 0, "states": {"exp_avg": {"bits": 3, "group_size": 100, "rounding": "stochastic"},
                                               "exp_avg_sq": {"bits": 5, "group_size": 3}}},
    "dim0-tensor": {"min_numel": 0, "states": {"exp_avg": {"scale": "dim0", "rounding": "stochastic"},
                                              "exp_avg_sq": {"scale": "tensor", "bits": 6}}},
    "dim1-rank1": {"min_numel": 0, "states": {"exp_avg": {"scale": "dim1", "bits": 2},
                                             "exp_avg_sq": {"scale": "rank1", "rounding": "stochastic"}}},
    "kahan-quantized": {"min_numel": 0, "states": {"exp_avg": {"scale": "rank1", "bits": 8}},
                        "weights": {"rounding": "stochastic", "compensation": "kahan",
                                    "compensation_codec": {"bits": 8, "group_size": 64, "rounding": "stochastic"}}},
    "kahan-dense-fp32-states": {"min_numel": 0, "states": {"exp_avg": {"enable": False},
                                                          "exp_avg_sq": {"enable": False}},
                                "weights": {"compensation": "kahan"}},
}
CHUNK_SHAPES = [(48, 200), (4097,), (3, 5, 7), (1,), (2, 1500), (32, 3, 9)]
CHUNK_RULES = {
    "adamw": lambda cfg: lambda ps, f: AdamW(ps, lr=1e-2, weight_decay=0.1, qconfig=cfg, fused=f, seed=5),
    "sgd": lambda cfg: lambda ps, f: SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, qconfig=cfg,
                                         fused=f, seed=5),
    "lion": lambda cfg: lambda ps, f: Lion(ps, lr=1e-2, weight_decay=0.1, qconfig=cfg, fused=f, seed=5),
}


def _chunk_run(make, dtype, fused, strided, steps=3):
    g = torch.Generator().manual_seed(0)
    params = []
    for k, s in enumerate(CHUNK_SHAPES):
        x = torch.randn(s, generator=g).to(dtype)
        if strided and k % 2 == 0 and x.dim() >= 2:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)
        params.append(torch.nn.Parameter(x))
    opt = make(params, fused)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            grad = torch.randn(p.shape, generator=g).to(dtype)
            grad[..., :1] *= 50  # outliers: the scales differ between rows, columns and blocks
            p.grad = grad.transpose(0, 1).contiguous().transpose(0, 1) if strided and grad.dim() >= 2 else grad
        opt.step()
    return params, opt


@needs_fused
@pytest.mark.parametrize("scratch", [12, 100])  # a few chunks (whole rows where they fit); many (rows split)
@pytest.mark.parametrize("config", sorted(CHUNK_CONFIGS))
@pytest.mark.parametrize("rule", sorted(CHUNK_RULES))
def test_chunked_reference_step_matches_the_fused_kernel(rule, config, scratch, monkeypatch):
    make = CHUNK_RULES[rule](CHUNK_CONFIGS[config])
    for dtype, strided in ((torch.float32, False), (torch.bfloat16, True), (torch.float16, False)):
        fused = _chunk_run(make, dtype, True, strided)
        monkeypatch.setattr(reference, "CHUNK_FLOOR_BYTES", 0)
        monkeypatch.setattr(reference, "SCRATCH_BYTES_PER_ELEMENT", scratch)
        chunked = _chunk_run(make, dtype, False, strided)
        monkeypatch.undo()
        _assert_same_steps(fused, chunked)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
@pytest.mark.parametrize("config", ["default", "dim0-tensor", "dim1-rank1"])
def test_chunked_reference_step_matches_the_whole_tensor_step(dtype, config, monkeypatch):
    """float64 and complex parameters (no kernel): the chunked step against the whole-tensor one."""
    make = CHUNK_RULES["adamw"](CHUNK_CONFIGS[config])

    def run(chunked):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in CHUNK_SHAPES]
        opt = make(params, False)
        if not chunked:
            opt.elementwise_rule = False  # the whole-tensor step (as for a rule that is not elementwise)
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
            opt.step()
        return params, opt

    whole = run(False)
    monkeypatch.setattr(reference, "CHUNK_FLOOR_BYTES", 0)
    monkeypatch.setattr(reference, "SCRATCH_BYTES_PER_ELEMENT", 50)
    _assert_same_steps(whole, run(True))
