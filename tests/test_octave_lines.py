"""Octave lines (qconf/codec/octave_lines.py): the arithmetic estimate that replaces the 8-bit
nearest-rounding search in the kernels, and the exhaustive check that decides where it applies."""
import pytest
import torch

from qconf.codec import Codec
from qconf.codec.qmap import MAP_NAMES
from qconf.codec.native import codec_table
from qconf.codec.octave_lines import FORM_SIGNED, FORM_UNSIGNED, estimate_codes, lines_exact, octave_lines
from qconf.codec.segment_lines import SEG_BOUNDS

# maps that are linear per octave (or per decade) get lines; unsigned power-2/3 curve too much
WITHOUT_LINES = {("power-2", False), ("power-3", False)}


def _mids(map, signed, bits=8):
    return Codec(bits=bits, map=map, signed=signed).midpoints


def _count(mids, n):
    return torch.where(torch.isnan(n), 0, torch.searchsorted(mids, n))


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("map", [m for m in MAP_NAMES if m != "ternary"])  # ternary has no 8-bit form
def test_lines_are_built_where_exact_and_match_the_count(map, signed):
    mids = _mids(map, signed)
    row = octave_lines(mids)
    if (map, signed) in WITHOUT_LINES:
        assert row is None
        assert not codec_table(Codec(bits=8, map=map, signed=signed))[7].any()
        return
    assert row is not None
    assert int(row[161]) == (FORM_SIGNED if float(mids[0]) <= 0 else FORM_UNSIGNED)
    table_row = codec_table(Codec(bits=8, map=map, signed=signed))[7]
    assert torch.equal(table_row[:SEG_BOUNDS], row[:SEG_BOUNDS])  # (the segment lines follow: test_segment_lines)
    g = torch.Generator().manual_seed(0)
    n = torch.cat([torch.rand(200_000, generator=g) * 2 - 1, torch.rand(50_000, generator=g) ** 40,
                   -torch.rand(50_000, generator=g) ** 40, torch.randn(10_000, generator=g) * 1e3,
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, float("inf"), float("-inf"), float("nan")])])
    n = torch.cat([n, mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))])
    assert torch.equal(estimate_codes(row, mids, n), _count(mids, n))


@pytest.mark.parametrize("bits", [5, 6, 7])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("map", [m for m in MAP_NAMES if m != "ternary"])
def test_5_to_7_bit_maps_get_exact_lines(map, signed, bits):
    # the CUDA kernels' nearest rounding for 5-7-bit codes (the CPU kernel keeps its search there)
    mids = _mids(map, signed, bits)
    row = octave_lines(mids)
    assert row is not None
    assert torch.equal(codec_table(Codec(bits=bits, map=map, signed=signed))[7], row)
    g = torch.Generator().manual_seed(bits)
    n = torch.cat([torch.rand(100_000, generator=g) * 2 - 1, torch.rand(20_000, generator=g) ** 40,
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, float("inf"), float("-inf"), float("nan")]),
                   mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))])
    assert torch.equal(estimate_codes(row, mids, n), _count(mids, n))


def test_lines_reach_past_the_octave_where_the_map_gets_sparser_at_its_end():
    # 7-bit signed dynamic exponent: a decade boundary just below 1/8 and 1/64; lines through each
    # octave's own midpoints overshoot the code at the octave's end, lines through its neighbours too do not
    from qconf.codec.octave_lines import _finish, _fit
    mids = _mids("nonlinear", True, 7)
    assert _finish(_fit(mids, reach=False), mids) is None
    assert _finish(_fit(mids, reach=True), mids) is not None


def test_4bit_codecs_keep_the_search_in_the_table():
    assert not codec_table(Codec(bits=4, map="nonlinear", signed=True))[7].any()


@pytest.mark.parametrize("signed", [False, True])
def test_the_check_rejects_lines_that_are_off(signed):
    # each change moves the estimate by more than one code somewhere; the check must notice
    mids = _mids("nonlinear", signed)
    row = octave_lines(mids)
    assert lines_exact(row, mids)
    top = 30  # octave [0.5, 1): the densest codes
    two = (row[:32] != row[64:96]).nonzero().flatten()
    assert two.numel() > 0  # octaves with a decade boundary need two lines
    changes = {
        "offset": lambda r: r[32 + top:128:64].add_(1.0),  # A1 and A2 (one line: the same)
        "slope": lambda r: r[top:128:64].mul_(1.02),
        "second line": lambda r: r.__setitem__(96 + int(two[0]), r[96 + int(two[0])] - 1.5),
        "one line": lambda r: (r.__setitem__(64 + int(two[0]), r[int(two[0])]),
                               r.__setitem__(96 + int(two[0]), r[32 + int(two[0])])),
        "negative slope": lambda r: r.__setitem__(5, -1.0),
    }
    if signed:  # (an unsigned map's row is also exact in the signed form, with K = 0)
        changes["mirror"] = lambda r: r.__setitem__(160, r[160] + 1.0)
        changes["form"] = lambda r: r.__setitem__(161, FORM_UNSIGNED)
    for name, change in changes.items():
        bad = row.clone()
        change(bad)
        assert not lines_exact(bad, mids), name


def test_nan_and_out_of_range_values():
    mids = _mids("nonlinear", True)
    row = octave_lines(mids)
    n = torch.tensor([float("nan"), float("inf"), float("-inf"), 3.0e38, -3.0e38, 2.0, -2.0])
    assert estimate_codes(row, mids, n).tolist() == [0, 255, 0, 255, 0, 255, 0]


def test_fma32_rounds_once_like_the_kernels_fused_multiply_add():
    # the emulation the exactness check relies on, against exact rational arithmetic; the crafted
    # cases put a*b + c within a hair of a float32 midpoint, where rounding twice goes wrong
    from fractions import Fraction

    import numpy as np

    from qconf.codec.octave_lines import fma32

    def exact(x, y, z):
        v = Fraction(x) * Fraction(y) + Fraction(z)
        f = np.float32(float(v))
        near = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
        return float(min(near, key=lambda q: (abs(Fraction(float(q)) - v), int(np.float32(q).view(np.int32)) & 1)))

    g = torch.Generator().manual_seed(0)
    a = torch.rand(3000, generator=g) * 2
    b = (torch.rand(3000, generator=g) - 0.5) * 400
    c = (torch.rand(3000, generator=g) - 0.5) * 400
    ties = [(1 + 2.0**-k, s * (1 + 2.0**-k), t * 2.0**e) for k in (10, 11, 12) for s in (1, -1)
            for t in (1, -1) for e in (-60, -100, -140)]
    a = torch.cat([a, torch.tensor([x for x, _, _ in ties])])
    b = torch.cat([b, torch.tensor([y for _, y, _ in ties])])
    c = torch.cat([c, torch.tensor([z for _, _, z in ties])])
    want = torch.tensor([exact(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())])
    assert torch.equal(fma32(a, b, c), want)
    assert not torch.equal((a * b + c)[-len(ties):], want[-len(ties):])  # two roundings differ there
