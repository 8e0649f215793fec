"""Value lines (qconf/codec/value_lines.py): the AVX2 kernels' 8-bit decode by arithmetic instead of
a gather, the exhaustive check that decides where it applies, and every code through the kernels'
decodes on every ISA the machine has."""
import pytest
import torch

from qconf import _native
from qconf.codec import Codec
from qconf.codec import value_lines as vl
from qconf.codec.native import codec_table
from qconf.codec.native import decode as native_decode
from qconf.optim import SGD

from helpers import machine_isas

WITH_LINES = [("nonlinear", False), ("nonlinear", True), ("nonlinear-nozero", True), ("power-1", False),
              ("power-1", True), ("linear", False)]
WITHOUT_LINES = [("nonlinear-nozero", False), ("power-2", False), ("power-2", True), ("power-3", False),
                 ("power-3", True), ("float-point", False), ("float-point", True), ("linear", True)]


def _codec(map, signed):
    return Codec(bits=8, map=map, signed=signed, scale="group", group_size=64)


def _bits(x):
    return x.contiguous().view(torch.int32)


def _mixed_codes(n, seed=0):
    """n codes: every code at least n // 256 times, shuffled so each vector mixes runs and signs."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.arange(256).repeat(n // 256 + 1)[:n]
    return codes[torch.randperm(n, generator=g)]


@pytest.mark.parametrize("map,signed", WITH_LINES + WITHOUT_LINES)
def test_value_lines_exist_exactly_where_they_reproduce_the_map(map, signed):
    codec = _codec(map, signed)
    row = codec_table(codec)[7]
    assert (float(row[vl.VAL_PRESENT]) == 1.0) == ((map, signed) in WITH_LINES)
    if (map, signed) in WITH_LINES:
        assert vl.values_exact(row, codec.qmap)
        assert torch.equal(_bits(vl.decode(row, torch.arange(256))), _bits(codec.qmap))
    else:
        assert not row[vl.VAL_SHIFT:vl.VAL_END].any()


@pytest.mark.parametrize("signed", [False, True])
def test_the_check_rejects_lines_that_are_off(signed):
    # each change makes some code's bits wrong; the check over all 256 codes must notice every one
    codec = _codec("nonlinear", signed)
    row = codec_table(codec)[7]

    def flip_correction(r):
        words = r[vl.VAL_WORDS:vl.VAL_WORDS + vl.WORDS].view(torch.int32)
        words[3] ^= 1

    def nudge(k):
        return lambda r: r.__setitem__(k, float(torch.nextafter(r[k], torch.tensor(1.0))))

    changes = {
        "slope": nudge(vl.VAL_SLOPE + 6),
        "offset": nudge(vl.VAL_OFFSET + 5),
        "bias": lambda r: r.__setitem__(vl.VAL_BIAS + 4, r[vl.VAL_BIAS + 4] + 1),
        "correction": flip_correction,
        "centre": lambda r: r.__setitem__(vl.VAL_CENTER, r[vl.VAL_CENTER] + 2),
        "shift": lambda r: r.__setitem__(vl.VAL_SHIFT, 1.0 - r[vl.VAL_SHIFT]),
        "absent": lambda r: r.__setitem__(vl.VAL_PRESENT, 0.0),
    }
    assert vl.values_exact(row, codec.qmap)
    for name, change in changes.items():
        bad = row.clone()
        change(bad)
        assert not vl.values_exact(bad, codec.qmap), name


def test_offsets_match_the_kernels_layout():
    if not _native.fused_available():  # pragma: no cover - the CI build always has the extension
        pytest.skip(f"native extension unavailable: {_native.native_error()}")
    lay = _native.layout()
    names = ("shift", "center", "slope", "offset", "bias", "words", "present")
    assert [lay[f"lines.val_{k}"] for k in names] == [
        vl.VAL_SHIFT, vl.VAL_CENTER, vl.VAL_SLOPE, vl.VAL_OFFSET, vl.VAL_BIAS, vl.VAL_WORDS, vl.VAL_PRESENT]


@pytest.mark.parametrize("isa", machine_isas())
@pytest.mark.parametrize("map,signed", WITH_LINES + [("power-2", False)])
def test_every_code_decodes_to_its_value_on_every_isa(map, signed, isa, monkeypatch):
    # the native decode (tile_codec.h dequantize: value lines on AVX2 where the codec has them,
    # else a gather; planes on AVX-512; a load on scalar), block scales of 1 and 2**-3, and a tail
    # that is not a whole vector
    if not _native.fused_available():  # pragma: no cover
        pytest.skip(f"native extension unavailable: {_native.native_error()}")
    codec = _codec(map, signed)
    n = 1024 + 37
    codes = _mixed_codes(n)
    scales = torch.tensor([1.0, 0.125]).repeat(codec.num_scales((n,)))[: codec.num_scales((n,))]
    monkeypatch.setenv("QCONF_CPU_ISA", isa)
    got = native_decode(codec, codes.to(torch.uint8), scales, (n,))
    expect = codec.qmap[codes] * scales.repeat_interleave(64)[:n]
    assert torch.equal(_bits(got), _bits(expect))


@pytest.mark.parametrize("isa", machine_isas())
@pytest.mark.parametrize("map,signed", WITH_LINES)
def test_the_fused_step_reads_every_code_on_every_isa(map, signed, isa, monkeypatch):
    # SGD with momentum 1, no dampening, lr 1 and a zero gradient: the new parameter is exactly
    # 0 - qmap[code] * 1, read by the main loop's 8-bit decode (tile_codec.h decode8)
    n = 4096 + 64
    codes = _mixed_codes(n, seed=1)
    cfg = {"min_numel": 0, "states": {"exp_avg": {"bits": 8, "map": map, "signed": signed, "scale": "group",
                                                  "group_size": 64}}}
    p = torch.nn.Parameter(torch.zeros(n))
    opt = SGD([p], lr=1.0, momentum=1.0, qconfig=cfg, fused=True)
    p.grad = torch.ones(n)
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    buf.codes.copy_(codes.to(torch.uint8))
    buf.scales.fill_(1.0)
    with torch.no_grad():
        p.zero_()
    p.grad.zero_()
    monkeypatch.setenv("QCONF_CPU_ISA", isa)
    opt.step()
    assert torch.equal(_bits(p.detach()), _bits(0.0 - _codec(map, signed).qmap[codes]))
