"""A seeded shape fuzz of the native optimizer step (tests/test_native_fuzz.py, tests/sanitize.py).

Each case is a plain dict (JSON): an update rule, one parameter's shape and dtype, the qconfig of
its states (bits 1-8, every map and scale kind, group sizes from 1 to the validator's maximum,
nearest or stochastic rounding), how bf16/fp16 weights take their update, whether the parameter
and its gradient are strided, a thread count and an ISA. ``run_case`` steps the parameter twice on
the reference path and twice in the extension (``fused=True``) on the same gradients and compares
parameters, codes, scales and fp32 states bit for bit (the factored second moment within its
documented 1e-6 of each tensor's magnitude, docs/kernels.md).

Muon (``qconf.optim.Muon``) steps a matrix: its cases are 2-D (tall, wide, odd sizes, a row or a
column) and carry Muon's hyperparameters (``"muon"``: momentum, Nesterov, adjust_lr_fn,
ns_steps). Its fused step is two kernel calls (the momentum into a bf16 scratch, then the update)
around Newton–Schulz, which is torch code on both paths: bf16 matrix products on a CPU are slow
(~3 ns per multiply-add on the 2-core test machine), so ``ns_steps`` is as many of 5, 2, 1, 0 as
fit ~1e6 multiply-adds (0: the normalization alone), and Newton–Schulz runs on one thread on both
paths (its products and norm must not depend on the case's thread count, which is the kernels').

Run as a script it is the child process that executes cases, so that a case that crashes the
process fails its test instead of the test run::

    python tests/native_fuzz.py CASES.json    # prints "start i", then "ok i" or "fail i <message>"

``run_isolated`` is the parent side: it runs the cases in such children (a new one after a crash)
and returns each failed or crashed case with what it printed.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

MAX_GROUP = 1 << 24  # qconf.config.rules.MAX_GROUP_SIZE (checked in test_native_fuzz.py)
RULES = ("adamw", "adam", "sgd", "lion", "factored", "muon")
DTYPES = ("float32", "bfloat16", "float16")
MAPS = ("nonlinear", "nonlinear-nozero", "power-1", "power-2", "power-3", "linear", "float-point", "ternary")
SCALES = ("tensor", "dim0", "dim1", "group", "rank1")
MAX_NUMEL = 300_000


def _numels() -> list[int]:
    """Primes, powers of two and their neighbours, and sizes around the kernels' tile lengths."""
    out = {1, 2, 3, 5, 7, 31, 97, 127, 251, 509, 1021, 4093, 8191, 16381, 65521, 131071, 262139}
    for k in range(0, 19):
        out.update({(1 << k) - 1, 1 << k, (1 << k) + 1})
    out.update({5000, 2048 * 3, 8192 * 3 + 64, 16384 + 64, 100_000, 250_000})
    return sorted(n for n in out if 1 <= n <= MAX_NUMEL)


NUMELS = _numels()
GROUPS = sorted({1, 2, 3, 7, 8, 16, 31, 32, 33, 64, 96, 127, 128, 129, 160, 1000, 2048, 4096, 8192, 16384,
                 16385, 65536, 999_218, 1_000_000, 1 << 20, MAX_GROUP - 1, MAX_GROUP})


def _shape(rng: random.Random, numel: int, min_ndim: int) -> list[int]:
    """A random shape of ``numel`` elements with ``min_ndim``..4 dimensions (factors of numel)."""
    ndim = rng.randint(min_ndim, 4)
    dims, rest = [], numel
    for _ in range(ndim - 1):
        divisors = [d for d in range(1, min(rest, 4096) + 1) if rest % d == 0]
        d = rng.choice(divisors)
        dims.append(d)
        rest //= d
    dims.append(rest)
    rng.shuffle(dims)
    return dims


#: rows of Muon's matrices besides the divisors of numel (cols = numel // rows: odd sizes)
MUON_ROWS = (1, 2, 3, 7, 8, 31, 33, 64, 127, 129, 640, 2049)
NS_BUDGET = 1_000_000  # multiply-adds of Newton–Schulz per call (module docstring)


def _matrix(rng: random.Random, numel: int) -> list[int]:
    """A 2-D shape of about ``numel`` elements: rows a divisor of numel (numel elements) or one of
    MUON_ROWS (rows * (numel // rows)), as rows x cols or cols x rows."""
    divisors = [d for d in range(1, min(numel, 4096) + 1) if numel % d == 0]
    rows = rng.choice(divisors) if rng.random() < 0.5 else rng.choice([r for r in MUON_ROWS if r <= numel])
    shape = [rows, max(1, numel // rows)]
    return shape if rng.random() < 0.5 else shape[::-1]


def ns_steps_for(shape: list[int]) -> int:
    """The most Newton–Schulz steps (5, 2, 1 or 0) that fit NS_BUDGET on a matrix of ``shape``
    (one step: X X^T, A A and B X, about 2 m^2 n + m^3 multiply-adds for m <= n)."""
    m, n = sorted(shape)
    per_step = 2 * m * m * n + m ** 3
    return next(k for k in (5, 2, 1, 0) if k * per_step <= NS_BUDGET)


def _muon_hyper(rng: random.Random, shape: list[int]) -> dict:
    """Muon's hyperparameters: momenta on both sides of torch.lerp's |w| < 0.5 switch and at it."""
    return {"momentum": rng.choice((0.95, 0.9, 0.5, 0.3)), "nesterov": rng.random() < 0.7,
            "adjust_lr_fn": rng.choice((None, "original", "match_rms_adamw")), "ns_steps": ns_steps_for(shape)}


def _codec(rng: random.Random, signed: bool, numel: int) -> dict:
    """Codec fields the validator accepts: the ternary map is 2-bit signed, signed linear needs 2 bits."""
    qmap = rng.choice(MAPS)
    if qmap == "ternary":
        bits, signed = 2, True
    else:
        bits = rng.randint(2 if (qmap == "linear" and signed) else 1, 8)
    group = rng.choice(GROUPS + [numel, numel + 1, max(1, numel - 1)])
    return {"bits": bits, "map": qmap, "signed": signed, "scale": rng.choice(SCALES),
            "group_size": min(group, MAX_GROUP), "rounding": rng.choice(("nearest", "stochastic"))}


def random_case(rng: random.Random, isas: list[str]) -> dict:
    """One random case for a machine whose kernels run ``isas``."""
    rule = rng.choice(RULES)
    numel = rng.choice(NUMELS)
    min_ndim = 2 if rule == "factored" else 1
    shape = _matrix(rng, numel) if rule == "muon" else _shape(rng, numel, min_ndim)
    numel = shape[0] * shape[1] if rule == "muon" else numel
    # (the factored statistics are summed in another order: the documented bound is for fp32
    # parameters, whose values it moves by ~1e-7; a bf16/fp16 parameter could round either way)
    dtype = "float32" if rule == "factored" else rng.choice(DTYPES)
    states = {"exp_avg": {"enable": rng.random() < 0.9, **_codec(rng, True, numel)}}
    if rule in ("adamw", "adam"):
        states["exp_avg_sq"] = {"enable": rng.random() < 0.9, **_codec(rng, False, numel)}
    weights = None
    if dtype != "float32":
        weights = {"rounding": rng.choice(("nearest", "stochastic")),
                   "compensation": rng.choice(("none", "kahan"))}
        if weights["compensation"] == "kahan" and rng.random() < 0.5:
            weights["compensation_codec"] = {"bits": rng.choice((4, 8)), "group_size": rng.choice(
                (1, 7, 32, 64, 128, 1000, 4096, 16383, 16384))}
    case = {"rule": rule, "shape": shape, "dtype": dtype, "states": states, "weights": weights,
            "strided": rng.random() < 0.3, "threads": rng.randint(1, 4), "isa": rng.choice(isas)}
    if rule == "muon":
        case["muon"] = _muon_hyper(rng, shape)
    return case


def edge_cases(isas: list[str]) -> list[dict]:
    """Groups far larger than the tensor on one-tile tensors whose length is whole vectors (the
    register path of single-pass blocks) and on multi-tile ones, on every ISA: the sizes that
    overflowed a tile buffer before it was fixed."""
    out = []
    for isa in isas:
        for numel in (2048, 4096, 5000, 16384, 16448, 100_000):
            for group in (1 << 20, 1_000_000, MAX_GROUP):
                state = {"enable": True, "bits": 4, "map": "nonlinear", "signed": True, "scale": "group",
                         "group_size": group, "rounding": "nearest"}
                out.append({"rule": "adamw", "shape": [numel], "dtype": "float32",
                            "states": {"exp_avg": state, "exp_avg_sq": {**state, "signed": False, "map": "power-1",
                                                                         "bits": 8}},
                            "weights": None, "strided": False, "threads": 1 + numel % 2, "isa": isa})
    return out


def muon_cases(isas: list[str]) -> list[dict]:
    """Fixed Muon cases on every ISA: a multi-tile wide matrix with 4-bit group momentum, a tall
    bf16 one with a rank-1 stochastic 8-bit momentum and stochastic + quantized Kahan weights, a
    wide fp16 one with dim1 scales and an fp16 Kahan buffer, a strided bf16 one with an fp32
    momentum, and a single row with one stochastic tensor scale."""
    def state(bits, scale, group=128, rounding="nearest", qmap="nonlinear"):
        return {"exp_avg": {"enable": True, "bits": bits, "map": qmap, "signed": True, "scale": scale,
                            "group_size": group, "rounding": rounding}}

    fixed = [
        ([20, 1029], "float32", state(4, "group"), None, False, (0.95, True, None)),
        ([1031, 9], "bfloat16", state(8, "rank1", rounding="stochastic", qmap="linear"),
         {"rounding": "stochastic", "compensation": "kahan", "compensation_codec": {"bits": 8, "group_size": 64}},
         False, (0.3, False, "match_rms_adamw")),
        ([3, 4099], "float16", state(3, "dim1", qmap="power-1"), {"rounding": "nearest", "compensation": "kahan"},
         False, (0.5, True, "original")),
        ([129, 65], "bfloat16", {"exp_avg": {"enable": False}}, {"rounding": "nearest", "compensation": "none"},
         True, (0.9, True, None)),
        ([1, 5000], "float32", state(5, "tensor", rounding="stochastic", qmap="float-point"), None, False,
         (0.95, False, None)),
    ]
    out = []
    for isa in isas:
        for k, (shape, dtype, states, weights, strided, (momentum, nesterov, fn)) in enumerate(fixed):
            out.append({"rule": "muon", "shape": shape, "dtype": dtype, "states": states, "weights": weights,
                        "strided": strided, "threads": 1 + k % 3, "isa": isa,
                        "muon": {"momentum": momentum, "nesterov": nesterov, "adjust_lr_fn": fn,
                                 "ns_steps": ns_steps_for(shape)}})
    return out


def cases(seed: int, count: int, isas: list[str]) -> list[dict]:
    """``count`` random cases from ``seed`` (the same list on every machine with the same ISAs)."""
    rng = random.Random(seed)
    return [random_case(rng, isas) for _ in range(count)]


def describe(case: dict) -> str:
    """One line naming a case (for failure messages)."""
    return json.dumps(case, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# the child: run cases


def _qconfig(case: dict) -> dict:
    cfg = {"min_numel": 0, "states": case["states"]}
    if case["weights"] is not None:
        cfg["weights"] = case["weights"]
    return cfg


def _make(case: dict, params, fused: bool):
    from qconf.optim import SGD, Adam, AdamW, Lion, Muon

    kw = {"qconfig": _qconfig(case), "fused": fused, "seed": 11}
    rule = case["rule"]
    if rule == "muon":
        return Muon([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.1, **case["muon"], **kw)
    if rule == "adamw":
        return AdamW(params, lr=1e-2, weight_decay=0.01, **kw)
    if rule == "adam":
        return Adam(params, lr=1e-2, weight_decay=0.01, **kw)
    if rule == "factored":
        return AdamW(params, lr=1e-2, weight_decay=0.01, factor_second_moment=True, **kw)
    if rule == "sgd":
        return SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, **kw)
    return Lion(params, lr=1e-3, weight_decay=0.1, **kw)


def _strided(x):
    """The same values with other strides: transposed storage (2+ dims) or every other element."""
    if x.dim() >= 2:
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    import torch

    wide = torch.zeros(2 * x.numel(), dtype=x.dtype)
    wide[::2] = x
    return wide[::2]


def _tensors(case: dict, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(case["shape"], generator=g) * (0.5 if step < 0 else 10.0 ** (step % 3 - 3))
    x = x.to(getattr(torch, case["dtype"]))
    return _strided(x) if case["strided"] else x


def _trajectory(case: dict, fused: bool, steps: int):
    import torch

    param = torch.nn.Parameter(_tensors(case, -1))
    opt = _make(case, [param], fused)
    for step in range(steps):
        param.grad = _tensors(case, step)
        opt.step()
    return param, opt


def factored_bound(name: str, shape: list[int]) -> float:
    """The documented bound (docs/optimizers.md) of a factored tensor's value against the
    reference, relative to its largest magnitude: 1e-6 for the parameter; for a row / column
    statistic, the fp32 error of two orders of summing its L >= 0 terms: the kernel adds 16 fixed
    lanes or row chunks of L/16 terms, then the 16, the reference in torch's order, each within
    (L/16 + 16) * 2^-24 of the sum of the (non-negative) terms."""
    if name.endswith("_row") or name.endswith("_col"):
        terms = shape[-1] if name.endswith("_row") else shape[-2]
        return max(1e-6, (terms / 16 + 16) * 2.0 ** -23)
    return 1e-6


def _compare(case: dict, ref, fus) -> None:
    import torch

    from qconf.codec import QTensor

    (p_ref, o_ref), (p_fus, o_fus) = ref, fus
    exact = case["rule"] != "factored"

    def close(name, a, b):
        if exact or name == "step":
            assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item():.3e}"
        else:
            bound = factored_bound(name, case["shape"])
            err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
            mag = a.float().abs().max().item() if a.numel() else 0.0
            assert err <= bound * mag, f"{name}: max |diff| {err:.3e} > {bound:.2e} * {mag:.3e}"

    close("param", p_ref.detach(), p_fus.detach())
    s_ref, s_fus = o_ref.state[p_ref], o_fus.state[p_fus]
    assert s_ref.keys() == s_fus.keys(), f"state keys {sorted(s_ref)} != {sorted(s_fus)}"
    for k, x in s_ref.items():
        y = s_fus[k]
        if isinstance(x, QTensor):
            assert isinstance(y, QTensor) and x.codec == y.codec, f"{k}: codec differs"
            assert torch.equal(x.codes, y.codes), f"{k}: codes differ in {int((x.codes != y.codes).sum())} bytes"
            assert torch.equal(x.scales, y.scales), f"{k}: scales differ"
        elif isinstance(x, torch.Tensor):
            close(k, x, y)


def run_case(case: dict, steps: int = 2) -> None:
    """Steps the case's parameter on the reference path and in the extension; AssertionError
    naming what differs. The thread count and ISA apply to the fused run."""
    import torch

    with _one_thread_newton_schulz():
        ref = _trajectory(case, False, steps)
        old = torch.get_num_threads()
        os.environ["QCONF_CPU_ISA"] = case["isa"]
        torch.set_num_threads(case["threads"])
        try:
            fus = _trajectory(case, True, steps)
        finally:
            torch.set_num_threads(old)
            del os.environ["QCONF_CPU_ISA"]
    _compare(case, ref, fus)


@contextlib.contextmanager
def _one_thread_newton_schulz():
    """Muon's Newton–Schulz (torch's bf16 products and norm, the same code on both paths) on one
    thread, so that its result does not depend on the thread count the case gives the kernels."""
    import torch

    from qconf.optim import muon

    real = muon.zeropower

    def pinned(*args, **kwargs):
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return real(*args, **kwargs)
        finally:
            torch.set_num_threads(old)

    muon.zeropower = pinned
    try:
        yield
    finally:
        muon.zeropower = real


def _child_main(path: str) -> int:
    import qconf  # noqa: F401  (the extension, before the first case)

    for i, case in enumerate(json.loads(Path(path).read_text())):
        print(f"start {i}", flush=True)
        try:
            run_case(case)
        except Exception as e:  # noqa: BLE001 - every failure is reported as the case's
            print(f"fail {i} {type(e).__name__}: {e}".replace("\n", " "), flush=True)
        else:
            print(f"ok {i}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# the parent: children that may crash


def _report(err: str) -> str:
    """The sanitizer's report (its first line and frames) if the child printed one, else the end of
    its stderr."""
    for mark in ("ERROR: AddressSanitizer", "runtime error:", "AddressSanitizer"):
        at = err.find(mark)
        if at >= 0:
            return err[max(0, err.rfind("\n", 0, at) + 1):][:4000]
    return err[-3000:]


def run_isolated(case_list: list[dict], workdir: Path, timeout: float = 600.0) -> list[str]:
    """Runs the cases in child processes; returns one message per case that failed or crashed
    (empty: all equal). After a crash the next child starts at the case after the crashed one."""
    problems, first = [], 0
    while first < len(case_list):
        path = workdir / f"cases_{first}.json"
        path.write_text(json.dumps(case_list[first:]))
        try:
            done = subprocess.run([sys.executable, __file__, str(path)], capture_output=True, text=True,
                                  timeout=timeout)
            out, err, rc = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = f"timed out after {timeout:.0f} s", "timeout"
        started, finished = None, set()
        for line in out.splitlines():
            word, _, rest = line.partition(" ")
            idx, _, msg = rest.partition(" ")
            if word == "start":
                started = int(idx)
            elif word in ("ok", "fail"):
                finished.add(int(idx))
                if word == "fail":
                    problems.append(f"case {first + int(idx)} {describe(case_list[first + int(idx)])}: {msg}")
        if rc == 0:
            break
        crashed = started if started is not None and started not in finished else None
        if crashed is None:  # died before its first case, or after its last
            problems.append(f"child exited with {rc} outside any case: {err[-3000:]}")
            break
        k = first + crashed
        problems.append(f"case {k} {describe(case_list[k])}: the process died ({rc}): {_report(err)}")
        first = k + 1
    return problems


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
