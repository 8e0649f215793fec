"""qconf.ops.ternary_mm (csrc/cpu/ternary_mm*.cpp), BitLinear's int8 x ternary product on AVX2:
equal to the exact integer product on every shape class the kernel blocks by (row tiles of 4,
blocks of 64 rows, panels of 16 columns, groups of 4 k, int16 periods of 256 k, k blocks of 1024),
at the int16 bounds, past 2**24, on any thread count; bad input is a clear error that leaves out
as it was."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qconf import _native
from qconf.ops import ternary_mm, ternary_mm_available

if not _native.native_available():  # pragma: no cover
    pytest.skip(f"extension unavailable: {_native.native_error()}", allow_module_level=True)
if not ternary_mm_available():  # pragma: no cover - every x86-64 CPU of this project's CI has AVX2
    pytest.skip("this CPU has no AVX2", allow_module_level=True)


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The integer product in int64, rounded once to fp32 (to nearest even)."""
    return (x.long() @ w.long().t()).to(torch.float64).to(torch.float32)


def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ternary_mm(x, w, torch.full((x.shape[0], w.shape[0]), float("nan")))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


# (M, K, N): one row; a 4-row tile plus 1..3 rows; a 64-row block plus a tail; 16-column panels
# plus 1..15 columns; K with 1..3 bytes past a group; K across one int16 period (256) and one k
# block (1024) and several of both
SHAPES = [(1, 1, 1), (1, 4, 16), (3, 5, 17), (5, 7, 15), (4, 255, 16), (6, 257, 31), (65, 1023, 33),
          (67, 1025, 49), (130, 2051, 18), (2, 5000, 3), (129, 64, 1), (1, 3, 100)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_equals_the_integer_product(m, k, n):
    g = torch.Generator().manual_seed(m * 10007 + k * 31 + n)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-1, 2, (n, k), dtype=torch.int8, generator=g)
    assert same(run(x, w), exact(x, w))


@pytest.mark.parametrize("xv,wv", [(-128, 1), (-128, -1), (127, 1), (127, -1), (-128, 0), (0, 1)])
def test_int16_bounds(xv, wv):
    """Every pair sum at its extreme for 64 groups (int16 -32768 / 32512 before widening), over 3
    k blocks, with a partial last group."""
    k = 3 * 1024 + 2
    x = torch.full((5, k), xv, dtype=torch.int8)
    w = torch.full((17, k), wv, dtype=torch.int8)
    assert same(run(x, w), torch.full((5, 17), float(xv * wv * k)))


def test_past_two_to_the_24_rounds_once():
    k = 140_001  # 127 * k > 2**24: the sums are rounded to fp32, once
    x = torch.full((2, k), 127, dtype=torch.int8)
    x[1, :7] = -3
    w = torch.ones(3, k, dtype=torch.int8)
    got = run(x, w)
    assert same(got, exact(x, w)) and got[0, 0].item() != 127 * k  # 17780127 is odd, past 2**24: no fp32 number


def test_layouts_and_empty():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-128, 128, (40, 70), dtype=torch.int8, generator=g)
    w = torch.randint(-1, 2, (50, 70), dtype=torch.int8, generator=g)
    assert same(run(x.t().contiguous().t(), w[:, :].t().contiguous().t()), exact(x, w))  # column-major inputs
    assert same(run(x[:, 3:60], w[::2, 3:60]), exact(x[:, 3:60], w[::2, 3:60]))  # strided views
    assert same(run(x[:, :0], w[:, :0]), torch.zeros(40, 50))  # K = 0: empty sums
    assert run(x[:0], w).shape == (0, 50) and run(x, w[:0]).shape == (40, 0)


def test_threads_do_not_change_bits():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-128, 128, (300, 1100), dtype=torch.int8, generator=g)
    w = torch.randint(-1, 2, (70, 1100), dtype=torch.int8, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(run(x, w))
    finally:
        torch.set_num_threads(threads)
    assert all(same(o, exact(x, w)) for o in outs)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, o: (x, w + 1, o), "w must hold only -1, 0 and \\+1"),
    (lambda x, w, o: (x, w.clone().index_fill_(1, torch.tensor([5]), -2), o), "w must hold only -1, 0 and \\+1"),
    (lambda x, w, o: (x.float(), w, o), "x and w must be int8"),
    (lambda x, w, o: (x, w[:, :-1], o), "x must be \\[M, K\\] and w \\[N, K\\]"),
    (lambda x, w, o: (x, w, o[:, :-1]), "out must be a contiguous float32"),
    (lambda x, w, o: (x, w, o.double()), "out must be a contiguous float32"),
    (lambda x, w, o: (x, w, o.t()), "out must be a contiguous float32"),
])
def test_bad_input_is_an_error_and_leaves_out(bad, match):
    x = torch.randint(-128, 128, (9, 12), dtype=torch.int8)
    w = torch.randint(-1, 2, (9, 12), dtype=torch.int8)
    out = torch.full((9, 9), 7.0)
    args = bad(x, w, out)
    before = args[2].clone()
    with pytest.raises(RuntimeError, match=match):
        ternary_mm(*args)
    assert same(args[2], before)


def test_scalar_isa_is_refused():
    """QCONF_CPU_ISA=scalar: the op says it needs AVX2 and is reported unavailable (BitLinear then
    takes the fp32 GEMM path)."""
    code = ("import os, torch; os.environ['QCONF_CPU_ISA'] = 'scalar'\n"
            "from qconf.ops import ternary_mm, ternary_mm_available\n"
            "assert not ternary_mm_available()\n"
            "x = torch.zeros(2, 4, dtype=torch.int8)\n"
            "try:\n    ternary_mm(x, x, torch.empty(2, 2))\nexcept RuntimeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "qconf::ternary_mm needs AVX2; this CPU (or QCONF_CPU_ISA) gives scalar" in done.stdout


def test_an_unusable_isa_override_does_not_break_import():
    """QCONF_CPU_ISA naming no ISA: qconf.nn still imports (BitLinear takes the fp32 GEMM path); the
    kernels say what is wrong when they run."""
    code = ("import os; os.environ['QCONF_CPU_ISA'] = 'sse9'\n"
            "import qconf.nn\nfrom qconf.nn import bitlinear\nassert not bitlinear._TERNARY_MM\nprint('imported')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr
