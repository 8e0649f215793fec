"""The integer codec's native row passes (csrc/cpu/integer_codec.cpp: absmax_rows, round_levels,
divide_levels) give the reference torch ops' bits: on NaN, +-Inf, -0, .5 ties, values past the
clamp, subnormals, zero rows and scales, every row length around the vector widths (8 and 32), one
factor per row or one for all, every ISA this CPU has and 1 or 2 threads."""
from __future__ import annotations

import pytest
import torch

from qconf import Codec, _native
from qconf.codec import integer, scales

from helpers import machine_isas

if not _native.native_available():  # pragma: no cover
    pytest.skip(f"extension unavailable: {_native.native_error()}", allow_module_level=True)

ISAS = machine_isas()
SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 126.5, 127.5, -127.5,
           1e30, -1e30, 1e-40, -1e-45, 3.4e38]


def rows(r: int, c: int, seed: int) -> torch.Tensor:
    """fp32 [r, c]: normal values at several magnitudes with the special values scattered in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * torch.logspace(-3, 3, r).unsqueeze(1)
    if r * c:
        idx = torch.randint(0, r * c, (min(r * c, 3 * len(SPECIAL)),), generator=g)
        x.view(-1)[idx] = torch.tensor(SPECIAL * 3)[: idx.numel()]
    return x


def reference(monkeypatch) -> None:
    monkeypatch.setattr(integer, "row_kernels", lambda *t: False)
    monkeypatch.setattr(scales, "row_kernels", lambda *t: False)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int8) if a.dtype == torch.int8
                                                                       else a.view(torch.int32),
                                                                       b.view(torch.int8) if b.dtype == torch.int8
                                                                       else b.view(torch.int32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (4, 8), (5, 31), (6, 33), (17, 64), (9, 95), (2, 1000), (40, 0)])
def test_row_passes_equal_the_reference(monkeypatch, isa, threads, shape):
    monkeypatch.setenv("QCONF_CPU_ISA", isa)
    x = rows(*shape, seed=shape[0] * 100 + shape[1])
    f_rows = integer.level_factors(torch.rand(shape[0]) * 10 + torch.tensor([0.0] + [1.0] * (shape[0] - 1)), 127)
    f_one = torch.tensor([0.37])
    levels = torch.randint(-127, 128, shape, dtype=torch.int8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = [scales.compute_scales(x, "dim0", 2048, native_rows=True)]
        for f in (f_rows.unsqueeze(1).expand(shape), f_one.reshape(()).expand(shape)):
            assert (integer._row_factors(x, f) is not None) == (x.numel() > 0)  # the native passes run
            got += [integer.round_to_levels(x, f, 127), integer.round_to_levels(x, f, 1),
                    integer.levels_to_values(levels, f)]
        reference(monkeypatch)
        want = [scales.compute_scales(x, "dim0", 2048)]
        for f in (f_rows.unsqueeze(1).expand(shape), f_one.reshape(()).expand(shape)):
            assert integer._row_factors(x, f) is None
            want += [integer.round_to_levels(x, f, 127), integer.round_to_levels(x, f, 1),
                     integer.levels_to_values(levels, f)]
    finally:
        torch.set_num_threads(before)
    assert all(same(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("codec", [
    Codec(bits=8, map="linear", signed=True, scale="dim0", rounding="nearest-even", min_scale=1e-5),
    Codec(bits=2, map="ternary", scale="tensor", statistic="absmean", rounding="nearest-even", min_scale=1e-5),
], ids=["int8-rows", "ternary"])
def test_codecs_equal_the_reference(monkeypatch, codec):
    """BitLinear's two codecs end to end: encode_integers and decode_integers."""
    x = rows(33, 70, seed=5)
    native = codec.encode_integers(x)
    decoded = codec.decode_integers(*native)
    reference(monkeypatch)
    want = codec.encode_integers(x)
    assert same(native[0], want[0]) and same(native[1], want[1])
    assert same(decoded, codec.decode_integers(*want))


def test_not_taken_where_it_does_not_apply():
    x = torch.randn(4, 6)
    per_column = torch.rand(1, 6).expand(4, 6)
    assert integer._row_factors(x, per_column) is None  # dim1 factors: the torch ops
    assert integer._row_factors(x.requires_grad_(), torch.rand(4, 1).expand(4, 6)) is None
    assert integer._row_factors(torch.randn(2, 3, 4), torch.rand(2, 1, 1).expand(2, 3, 4)) is None
    rows = torch.rand(4, 1).expand(4, 6)
    wide = torch.randint(-127, 128, (4, 6), dtype=torch.int16)  # other integer dtypes: the torch ops
    assert same(integer.levels_to_values(wide, rows), wide.float() / rows)
    assert same(integer.levels_to_values(wide.to(torch.int8), rows), wide.float() / rows)


@pytest.mark.parametrize("call,match", [
    (lambda: torch.ops.qconf.round_levels(torch.zeros(2, 3), torch.ones(3), 127), "factors must be .* of 2 or 1"),
    (lambda: torch.ops.qconf.round_levels(torch.zeros(2, 3), torch.ones(2), 128), "mrq must be in 1..127"),
    (lambda: torch.ops.qconf.round_levels(torch.zeros(2, 3).double(), torch.ones(2), 127), "x must be a 2-D Float"),
    (lambda: torch.ops.qconf.divide_levels(torch.zeros(2, 3), torch.ones(2)), "levels must be a 2-D Char"),
    (lambda: torch.ops.qconf.absmax_rows(torch.zeros(3)), "x must be a 2-D Float"),
])
def test_bad_arguments_are_clear_errors(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()
