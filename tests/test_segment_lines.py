"""Segment lines (qconf/codec/segment_lines.py): the AVX2 kernels' 8-bit nearest rounding with
8-entry line tables and a midpoint probe only near code boundaries, and the exhaustive check that
decides where it applies."""
import pytest
import torch

from qconf.codec import Codec
from qconf.codec import segment_lines as sl
from qconf.codec.native import codec_table
from qconf.codec.octave_lines import octave_lines
from qconf.codec.value_lines import VAL_SHIFT

WITH_SEGMENTS = [("nonlinear", False), ("nonlinear", True), ("nonlinear-nozero", False), ("nonlinear-nozero", True),
                 ("linear", False), ("linear", True), ("power-1", False), ("power-1", True)]
WITHOUT_SEGMENTS = [("power-2", True), ("power-3", True), ("float-point", False), ("float-point", True)]


def _mids(map, signed):
    return Codec(bits=8, map=map, signed=signed).midpoints


def _count(mids, n):
    return torch.where(torch.isnan(n), 0, torch.searchsorted(mids, n))


def _row(map, signed):
    return codec_table(Codec(bits=8, map=map, signed=signed))[7]


def _values(mids, seed):
    """Random float32 bit patterns in (-2, 2), uniform values, every check point, and the odd ones."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 0x40000000, (400_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    odd = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 2.0, -2.0, 3e38, -3e38,
                        float("inf"), float("-inf"), float("nan")])
    return torch.cat([x, -x, torch.rand(200_000, generator=g) * 2 - 1, mids, odd])


@pytest.mark.parametrize("map,signed", WITH_SEGMENTS)
def test_segments_are_built_and_match_the_count(map, signed):
    mids = _mids(map, signed)
    row = _row(map, signed)
    assert float(row[sl.SEG_PRESENT]) == 1.0
    built = sl.segment_lines(mids, octave_lines(mids))
    assert torch.equal(row[:VAL_SHIFT], built[:VAL_SHIFT])  # (the value lines follow: test_value_lines)
    assert not built[VAL_SHIFT:].any()
    assert sl.segments_exact(row, mids)
    bounds = row[sl.SEG_BOUNDS:sl.SEG_BOUNDS + sl.SEGMENTS + 1]
    assert bool((bounds[1:] >= bounds[:-1]).all())  # sorted, +inf padded: the kernels' search needs it
    n = torch.cat([_values(mids, 0), sl._ends(row, mids)])
    assert torch.equal(sl.segment_codes(row, mids, n), _count(mids, n))


@pytest.mark.parametrize("map,signed", [("nonlinear", False), ("nonlinear", True)])
def test_the_dynamic_map_takes_one_segment_per_decade_and_rarely_probes(map, signed):
    # 7 decades and the zone above the last midpoint; a value probes the table only within eps
    # of an integer estimate: about 1e-5 of uniform values, not the octave lines' every value
    mids = _mids(map, signed)
    row = _row(map, signed)
    bounds = row[sl.SEG_BOUNDS:sl.SEG_BOUNDS + sl.SEGMENTS + 1]
    assert int(torch.isfinite(bounds).sum()) == sl.SEGMENTS - 1
    assert 0.0 <= float(row[sl.SEG_EPS]) < 1e-4
    n = torch.rand(1_000_000, generator=torch.Generator().manual_seed(1)) * 2 - 1
    j, _ = sl._segment_j(row, n)
    near = ((j - torch.round(j)).abs() <= row[sl.SEG_EPS]).float().mean()
    assert float(near) < 1e-3


@pytest.mark.parametrize("map,signed", WITHOUT_SEGMENTS)
def test_maps_off_a_few_lines_keep_the_octave_lines(map, signed):
    row = _row(map, signed)
    assert not row[sl.SEG_BOUNDS:].any()
    assert sl.segment_lines(_mids(map, signed), octave_lines(_mids(map, signed))) is None


def test_only_8bit_codecs_get_segments():
    for bits in (5, 6, 7):
        row = codec_table(Codec(bits=bits, map="nonlinear", signed=False))[7]
        assert row[161] != 0 and not row[sl.SEG_BOUNDS:].any()


def test_offsets_match_the_kernels_layout():
    from qconf import _native

    if not _native.fused_available():  # pragma: no cover - the CI build always has the extension
        pytest.skip(f"native extension unavailable: {_native.native_error()}")
    lay = _native.layout()
    assert [lay[f"lines.seg_{k}"] for k in ("bounds", "slope", "offset", "cap", "top", "eps", "present")] == [
        sl.SEG_BOUNDS, sl.SEG_SLOPE, sl.SEG_OFFSET, sl.SEG_CAP, sl.SEG_TOP, sl.SEG_EPS, sl.SEG_PRESENT]


@pytest.mark.parametrize("signed", [False, True])
def test_the_check_rejects_segments_that_are_off(signed):
    # each change makes a code wrong somewhere (or sends values outside the probe window); the
    # exhaustive check must notice every one
    mids = _mids("nonlinear", signed)
    row = _row("nonlinear", signed)
    assert sl.segments_exact(row, mids)
    mid = sl.SEGMENTS // 2
    changes = {
        "bound": lambda r: r.__setitem__(sl.SEG_BOUNDS + 2, r[sl.SEG_BOUNDS + 2] * 1.01),
        "slope": lambda r: r.__setitem__(sl.SEG_SLOPE + mid, r[sl.SEG_SLOPE + mid] * 1.001),
        "offset": lambda r: r.__setitem__(sl.SEG_OFFSET + mid, r[sl.SEG_OFFSET + mid] + 0.01),
        "cap": lambda r: r.__setitem__(sl.SEG_CAP + mid, r[sl.SEG_CAP + mid] + 1.0),
        "negative slope": lambda r: r.__setitem__(sl.SEG_SLOPE + 1, -1.0),
        "absent": lambda r: r.__setitem__(sl.SEG_PRESENT, 0.0),
        "eps": lambda r: r.__setitem__(sl.SEG_EPS, 0.5),
    }
    if signed:
        # the junction point itself needs the probe on the negative side (a probe's r = rint(j))
        changes["junction"] = lambda r: r.__setitem__(sl.SEG_TOP + mid, -1.0)
        changes["mirror"] = lambda r: r.__setitem__(160, r[160] + 1.0)
    else:
        changes["no probe window"] = lambda r: r.__setitem__(sl.SEG_EPS, 0.0)
    for name, change in changes.items():
        bad = row.clone()
        change(bad)
        assert not sl.segments_exact(bad, mids), name
