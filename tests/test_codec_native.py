"""Codec.encode/decode with backend="native" (the compiled kernel) equal the reference path."""
from __future__ import annotations

import itertools

import pytest
import torch

from qconf import Codec, _native
from qconf.codec import MAP_NAMES, SCALE_TYPES

from helpers import machine_isas

if not _native.native_available():  # pragma: no cover
    pytest.skip(f"extension unavailable: {_native.native_error()}", allow_module_level=True)

SHAPES = [(1,), (127,), (4097,), (33, 130), (3, 5, 7), (2, 3, 4, 5), (300, 70), (40000,)]


@pytest.mark.parametrize("scale,map,bits,rounding", list(itertools.product(
    SCALE_TYPES, [m for m in MAP_NAMES if m != "ternary"], (1, 4, 5, 8), ("nearest", "stochastic"))) + [
    (scale, "ternary", 2, rounding) for scale in SCALE_TYPES for rounding in ("nearest", "stochastic")])
def test_native_equals_reference(scale, map, bits, rounding):
    for signed in (True, False):
        if (map == "linear" and signed and bits == 1) or (map == "ternary" and not signed):
            continue
        c = Codec(bits=bits, map=map, signed=signed, scale=scale, group_size=48, rounding=rounding)
        for shape in SHAPES:
            x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
            x = x if signed else x.abs()
            ref = c.encode(x, generator=torch.Generator().manual_seed(5))
            nat = c.encode(x, generator=torch.Generator().manual_seed(5), backend="native")
            assert torch.equal(ref.codes, nat.codes) and torch.equal(ref.scales, nat.scales), shape
            assert torch.equal(c.decode(ref), c.decode(ref, backend="native"))


def test_native_non_finite_and_zero_blocks_match():
    x = torch.randn(8, 256)
    x[1] = 0.0
    x[3, 7] = float("nan")
    x[5, 0] = float("inf")
    for scale in SCALE_TYPES:
        c = Codec(bits=4, scale=scale, group_size=256)
        ref, nat = c.encode(x), c.encode(x, backend="native")
        assert torch.equal(ref.codes, nat.codes)
        assert torch.equal(ref.scales, nat.scales) and torch.isfinite(nat.scales).all()  # finite elements' absmax


def test_native_identical_across_isas_and_threads(monkeypatch):
    isas = machine_isas()
    c = Codec(bits=8, map="nonlinear", scale="rank1", rounding="stochastic")
    x = torch.randn(300, 700)
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for isa in isas:
        monkeypatch.setenv("QCONF_CPU_ISA", isa)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(c.encode(x, noise=noise, backend="native"))
    for r in results[1:]:
        assert torch.equal(r.codes, results[0].codes) and torch.equal(r.scales, results[0].scales)


def test_bad_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        Codec().encode(torch.randn(3), backend="gpu")
