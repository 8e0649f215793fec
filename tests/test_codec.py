"""Reference codec: maps, scale types, rounding, packing, errors, non-finite and zero handling."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qconf import Codec, QTensor, create_qmap
from qconf.codec import MAP_NAMES, SCALE_TYPES
from qconf.codec import packing, rng
from qconf.codec.scales import expand_scales

# lpmm create_general_qmap values (fp32 as float.hex), copied from ../shared/reference/lpmm_qmaps.json
GOLDEN = Path(__file__).resolve().parent / "fixtures" / "lpmm_qmaps.json"


def _golden_maps():
    return json.loads(GOLDEN.read_text())["maps"]


# ---------------------------------------------------------------------------------------------
# maps
@pytest.mark.parametrize("key", sorted(_golden_maps()))
def test_qmap_equals_lpmm_golden_bits(key):
    entry = _golden_maps()[key]
    name, bits, sign = key.split("/")
    gold = torch.tensor([float.fromhex(h) for h in entry["values_hex"]], dtype=torch.float32)
    q = create_qmap(name, int(bits), sign == "signed")
    assert q.dtype == torch.float32 and q.shape == (entry["len"],)
    assert torch.equal(q.view(torch.int32), gold.view(torch.int32)), key  # bit patterns, incl. -0.0


def test_golden_file_covers_every_nonlinear_family_map():
    keys = set(_golden_maps())
    expected = {f"{m}/{b}/{s}" for m in MAP_NAMES if m not in ("linear", "ternary")  # not lpmm's
                for b in range(1, 9) for s in ("signed", "unsigned")}
    assert expected == keys


@pytest.mark.parametrize("bits", range(1, 9))
def test_linear_map_is_symmetric_integer_grid(bits):
    unsigned = create_qmap("linear", bits, False)
    mrq = 2**bits - 1
    assert torch.equal(unsigned, torch.arange(0, mrq + 1, dtype=torch.float32) / mrq)
    if bits >= 2:
        signed = create_qmap("linear", bits, True)
        mrq = 2 ** (bits - 1) - 1
        assert signed.numel() == 2**bits - 1
        assert torch.equal(signed, torch.arange(-mrq, mrq + 1, dtype=torch.float32) / mrq)
        assert (signed == 0).any() and signed[0] == -1 and signed[-1] == 1


def test_codec_qmap_property_is_a_copy():
    c = Codec(bits=4)
    q = c.qmap
    q.zero_()
    assert c.qmap.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# scale types against hand-written expectations
X2 = torch.tensor([[1.0, -4.0, 0.5], [2.0, 3.0, -6.0]])


@pytest.mark.parametrize("scale,group_size,expected_scales,expected_per_elem", [
    ("tensor", 128, [6.0], [[6, 6, 6], [6, 6, 6]]),
    ("dim0", 128, [4.0, 6.0], [[4, 4, 4], [6, 6, 6]]),
    ("dim1", 128, [2.0, 4.0, 6.0], [[2, 4, 6], [2, 4, 6]]),
    ("group", 4, [4.0, 6.0], [[4, 4, 4], [4, 6, 6]]),  # blocks [1,-4,.5,2] [3,-6] (short last block)
    ("rank1", 128, [4.0, 6.0, 2.0, 4.0, 6.0], [[2, 4, 4], [2, 4, 6]]),  # min(row max, col max)
])
def test_scale_types_by_hand(scale, group_size, expected_scales, expected_per_elem):
    c = Codec(bits=8, map="linear", signed=True, scale=scale, group_size=group_size)
    q = c.encode(X2)
    assert q.scales.tolist() == expected_scales
    n, _ = c.normalize(X2)
    per_elem = torch.tensor(expected_per_elem, dtype=torch.float32)
    torch.testing.assert_close(n, X2 * (1 / per_elem), rtol=0, atol=0)
    # 8-bit linear: level spacing 1/127, so decode is within half a level of x
    torch.testing.assert_close(c.decode(q), X2, rtol=0, atol=0.5 / 127 * 6 + 1e-6)


def test_rank1_three_dims_by_hand():
    x = torch.arange(1.0, 25.0).reshape(2, 3, 4)
    c = Codec(bits=8, map="linear", signed=True, scale="rank1")
    q = c.encode(x)
    r0 = [12.0, 24.0]
    r1 = [16.0, 20.0, 24.0]
    r2 = [21.0, 22.0, 23.0, 24.0]
    assert q.scales.tolist() == r0 + r1 + r2
    n, _ = c.normalize(x)
    s = torch.minimum(torch.minimum(torch.tensor(r0).view(2, 1, 1), torch.tensor(r1).view(1, 3, 1)),
                      torch.tensor(r2).view(1, 1, 4))
    assert torch.equal(n, x * (1 / s))
    torch.testing.assert_close(n, x / s, rtol=2.5e-7, atol=0)  # within ~2 ulp of true division


def test_dim1_on_3d_and_fallbacks():
    x = torch.randn(3, 5, 2)
    q = Codec(scale="dim1").encode(x)
    assert torch.equal(q.scales, x.abs().amax(dim=(0, 2)))
    v = torch.randn(300)
    assert Codec(scale="dim0").encode(v).scales.numel() == 1  # 1-D dim0 -> tensor
    assert Codec(scale="dim1").encode(v).scales.numel() == 1
    assert Codec(scale="rank1", group_size=128).encode(v).scales.numel() == 3  # 1-D rank1 -> group
    assert Codec(scale="rank1", group_size=128).effective_scale((300,)) == "group"


def test_group_short_last_block_and_no_padding_in_storage():
    x = torch.randn(4097)
    c = Codec(bits=4, scale="group", group_size=128)
    q = c.encode(x)
    assert q.scales.numel() == 33
    assert q.codes.numel() == 2049  # ceil(4097 * 4 / 8)
    assert q.scales[-1] == x[-1].abs()


# ---------------------------------------------------------------------------------------------
# rounding
def _max_gap(qmap):
    return (qmap[1:] - qmap[:-1]).max().item()


def _nearest_bound(qmap, signed):
    lo = -1.0 if signed else 0.0
    # half the widest gap inside the map, or the distance from the map's ends to the range ends
    return max(_max_gap(qmap) / 2, qmap[0].item() - lo, 1.0 - qmap[-1].item())


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(shape=shapes, bits=st.integers(1, 8), map=st.sampled_from(MAP_NAMES), signed=st.booleans(),
       scale=st.sampled_from(SCALE_TYPES), group_size=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       magnitude=st.sampled_from([1e-6, 1e-2, 1.0, 3e3]), seed=st.integers(0, 2**16), transpose=st.booleans())
def test_nearest_round_trip_error_bound(shape, bits, map, signed, scale, group_size, dtype, magnitude, seed,
                                        transpose):
    if map == "linear" and signed and bits == 1:
        return
    if map == "ternary":
        bits, signed = 2, True  # its only width
    if scale in ("dim0", "dim1") and len(shape) == 0:
        return
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * magnitude
    if not signed:
        x = x.abs()
    x = x.to(dtype)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, 1)  # non-contiguous input
    c = Codec(bits=bits, map=map, signed=signed, scale=scale, group_size=group_size)
    q = c.encode(x)
    y = c.decode(q)
    assert y.dtype == torch.float32 and y.shape == x.shape
    x32 = x.float()
    n, scales = c.normalize(x)
    s = expand_scales(scales, tuple(x.shape), scale, group_size)
    bound = _nearest_bound(c.qmap, signed) * s * (1 + 1e-5) + 1e-30
    assert ((y - x32).abs() <= bound).all()
    # nearest really is nearest: no map value is strictly closer than the chosen one
    dist_all = (n.reshape(-1, 1) - c.qmap.reshape(1, -1)).abs()
    chosen = (n.reshape(-1) - (y.reshape(-1) / torch.where(s.reshape(-1) == 0, torch.ones_like(n.reshape(-1)),
                                                                s.reshape(-1)))).abs()
    assert (chosen <= dist_all.min(dim=1).values * (1 + 1e-5) + 1e-6).all()


def test_nearest_ties_go_to_lower_code():
    c = Codec(bits=4, map="power-1", signed=False, scale="tensor")  # qmap k/16, k = 1..16
    mids = c.midpoints
    n = mids[4:6].clone()  # exactly on midpoints between codes 4|5 and 5|6
    codes = c.quantize(n)
    assert codes.tolist() == [4, 5]
    assert c.quantize(torch.nextafter(n, torch.tensor(2.0))).tolist() == [5, 6]


def test_values_beyond_map_clamp_to_ends():
    c = Codec(bits=4, map="nonlinear", signed=True, scale="tensor")
    n = torch.tensor([-5.0, -1.0, 5.0])
    assert c.quantize(n).tolist() == [0, 0, 15]
    cs = Codec(bits=4, map="nonlinear", signed=True, scale="tensor", rounding="stochastic")
    assert cs.quantize(n, noise=torch.zeros(3)).tolist() == [0, 0, 15]
    assert cs.quantize(n, noise=torch.full((3,), 0.999)).tolist() == [0, 0, 15]


def _sr_draws(qmap):
    # Enough draws that 1e-3 (relative to scale) is >= 5 standard deviations of the mean even for
    # the widest gap (variance of one draw <= gap**2 / 4), and never fewer than 20k.
    sigma = _max_gap(qmap) / 2
    return max(20000, int((5 * sigma / 1e-3) ** 2) + 1)


@pytest.mark.parametrize("map,bits,signed", [
    ("nonlinear", 4, True), ("nonlinear", 4, False), ("power-1", 4, False), ("linear", 4, True),
    ("float-point", 4, True), ("nonlinear", 8, True), ("power-2", 5, False), ("nonlinear-nozero", 3, False),
])
def test_stochastic_rounding_is_unbiased(map, bits, signed):
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(48, generator=g) * (2 if signed else 1) - (1 if signed else 0)
    x[0] = 1.0  # pins the group scale to 1
    c = Codec(bits=bits, map=map, signed=signed, scale="group", group_size=48, rounding="stochastic")
    qmap = c.qmap
    inside = (x >= qmap[0]) & (x <= qmap[-1])  # unbiased inside the map's range (outside: clamped)
    draws = _sr_draws(qmap)
    rows = x.expand(draws, -1)  # every row is one group with the same scale
    mean = c.decode(c.encode(rows, generator=g)).double().mean(dim=0)
    err = (mean - x.double()).abs()[inside]
    assert err.max().item() <= 1e-3, (err.max().item(), draws)


def test_stochastic_rounding_reproducible_from_seed():
    x = torch.randn(1000)
    c = Codec(rounding="stochastic")
    a = c.encode(x, generator=torch.Generator().manual_seed(7))
    b = c.encode(x, generator=torch.Generator().manual_seed(7))
    d = c.encode(x, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert not torch.equal(a.codes, d.codes)


def test_stochastic_with_explicit_noise_brackets_value():
    c = Codec(bits=4, map="power-1", signed=False, scale="tensor", rounding="stochastic")
    n = torch.tensor([0.3])  # between 4/16 = .25 (code 3) and 5/16 = .3125 (code 4); p_up = 0.8
    assert c.quantize(n, noise=torch.tensor([0.79])).item() == 4
    assert c.quantize(n, noise=torch.tensor([0.81])).item() == 3


def test_counter_rng_matches_scalar_oracle_and_is_uniform():
    key = rng.stream_key(seed=42, step=3, tensor=5, stream=rng.STREAM_EXP_AVG)
    bits = rng.hash_bits(key, 1000)
    k0, k1 = key
    for i in (0, 1, 2, 999):
        want = rng.mix32_int(rng.mix32_int(i ^ k0) ^ ((0 + k1) & rng.MASK32))
        assert bits[i].item() == want
    u = rng.uniform(key, 200000)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 3e-3
    assert not torch.equal(rng.uniform(rng.stream_key(42, 4, 5, 0), 100), u[:100])


# ---------------------------------------------------------------------------------------------
# packing
@settings(max_examples=200, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 200), seed=st.integers(0, 2**16))
def test_pack_round_trip_every_width(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), generator=g)
    packed = packing.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(packing.unpack(packed, bits, n), codes)
    narrow = packing.unpack(packed, bits, n, torch.int16)
    assert narrow.dtype == torch.int16 and torch.equal(narrow.long(), codes)


def test_pack_layout_is_little_endian_bit_stream():
    # 4-bit: element 2k in the low nibble of byte k
    assert packing.pack(torch.tensor([0x1, 0xA, 0x3]), 4).tolist() == [0xA1, 0x03]
    # 5-bit: codes 1, 2, 31 -> stream bits 00001 | 00010 | 11111 (LSB first)
    # byte0 = bits 0..7 = 1 | (2 << 5) & 0xFF = 0x41; byte1 = (2 >> 3) | (31 << 2) = 0x7C
    assert packing.pack(torch.tensor([1, 2, 31]), 5).tolist() == [0x41, 0x7C]
    # 1-bit: eight codes per byte, first code in bit 0
    assert packing.pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).tolist() == [0x81, 0x01]


@pytest.mark.parametrize("bits", range(1, 9))
def test_nbytes_is_honest_for_every_width(bits):
    c = Codec(bits=bits, map="power-1", signed=False, scale="group", group_size=128)
    x = torch.rand(1000)
    q = c.encode(x)
    assert q.codes.numel() == math.ceil(1000 * bits / 8)
    assert q.nbytes == math.ceil(1000 * bits / 8) + 4 * 8 == c.nbytes((1000,))


def test_five_bit_state_really_costs_five_eighths():
    q = Codec(bits=5, map="nonlinear", scale="group", group_size=2048).encode(torch.randn(4096, 64))
    assert q.nbytes / (4096 * 64) == pytest.approx(5 / 8 + 4 / 2048)


# ---------------------------------------------------------------------------------------------
# zeros, non-finite input, dtypes, contiguity
@pytest.mark.parametrize("scale", SCALE_TYPES)
@pytest.mark.parametrize("map", ["nonlinear", "power-1", "nonlinear-nozero", "linear"])
def test_zero_blocks_decode_to_exact_zero(scale, map):
    x = torch.randn(8, 64).abs()
    if scale != "tensor":
        # a zero block: a zero row is one group (size 64), one dim0 block and zeroes rank1's row max;
        # for dim1 the block is a column
        block = (slice(None), 2) if scale == "dim1" else (2,)
        x[block] = 0.0
        c = Codec(bits=4, map=map, signed=False, scale=scale, group_size=64)
        y = c.decode(c.encode(x))
        assert torch.equal(y[block], torch.zeros_like(y[block])) and not y.isnan().any()
    z = torch.zeros(5, 7)
    for rounding in ("nearest", "stochastic"):
        c = Codec(bits=4, map=map, signed=False, scale=scale, group_size=8, rounding=rounding)
        y = c.decode(c.encode(z))
        assert torch.equal(y, z) and not y.isnan().any()


def test_non_finite_elements_cost_only_themselves():
    # scales are the absmax of the finite elements: every other element of a block with NaN/Inf
    # decodes exactly as with a 0 there (tests/test_non_finite.py sweeps the maps and layouts)
    x = torch.randn(4, 128)
    x[1, 5] = float("nan")
    x[3, 0] = float("inf")
    clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    others = torch.isfinite(x)
    for c in (Codec(bits=4, scale="group", group_size=128), Codec(bits=4, scale="rank1"),
              Codec(bits=8, scale="dim0"), Codec(bits=4, scale="tensor")):
        q = c.encode(x)
        y = c.decode(q)
        assert torch.equal(q.scales, c.encode(clean).scales) and torch.isfinite(y).all(), c
        assert torch.equal(y[others], c.decode(c.encode(clean))[others]), c
        assert y[1, 5] == c.decode(c.encode(clean))[1, 5]  # NaN encodes as 0 does
        assert packing.unpack(q.codes, c.bits, x.numel()).reshape(4, 128)[3, 0] == c.qmap.numel() - 1, c  # +Inf: top


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_input_equals_its_fp32_value(dtype):
    x = torch.randn(300).to(dtype)
    c = Codec()
    a, b = c.encode(x), c.encode(x.float())
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


def test_non_contiguous_equals_contiguous():
    x = torch.randn(64, 96)
    for scale in SCALE_TYPES:
        c = Codec(scale=scale, group_size=32)
        a, b = c.encode(x.t()), c.encode(x.t().contiguous())
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


# ---------------------------------------------------------------------------------------------
# misuse
@pytest.mark.parametrize("kwargs,needle", [
    ({"bits": 0}, "bits must be an integer in 1..8"),
    ({"bits": 9}, "bits must be an integer in 1..8"),
    ({"bits": 4.0}, "bits must be an integer"),
    ({"group_size": 0}, "group_size must be a positive integer"),
    ({"map": "dynamic"}, "unknown map 'dynamic'"),
    ({"scale": "row"}, "unknown scale 'row'"),
    ({"rounding": "sr"}, "unknown rounding 'sr'"),
    ({"signed": "yes"}, "signed must be True or False"),
    ({"map": "linear", "bits": 1, "signed": True}, "needs bits >= 2"),
])
def test_codec_construction_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Codec(**kwargs)


def test_dim_scale_on_0d_tensor_is_an_error():
    for scale in ("dim0", "dim1"):
        with pytest.raises(ValueError, match="0-d tensor"):
            Codec(scale=scale).encode(torch.tensor(3.0))
    assert Codec(scale="tensor").decode(Codec(scale="tensor").encode(torch.tensor(3.0))).shape == ()


def test_decode_with_another_codec_is_an_error():
    q = Codec(bits=4).encode(torch.randn(10))
    with pytest.raises(ValueError, match="cannot be decoded with"):
        Codec(bits=8).decode(q)
    with pytest.raises(TypeError, match="expects a QTensor"):
        Codec().decode(torch.zeros(3))


def test_integer_input_is_an_error():
    with pytest.raises(TypeError, match="can only encode floating tensors"):
        Codec().encode(torch.arange(10))


def test_qtensor_validates_its_parts():
    c = Codec(bits=4, group_size=128)
    with pytest.raises(ValueError, match="codes must be 1-D uint8 with 5 bytes"):
        QTensor(torch.zeros(6, dtype=torch.uint8), torch.zeros(1), torch.Size([10]), c)
    with pytest.raises(ValueError, match="scales must be 1-D float32 with 1 values"):
        QTensor(torch.zeros(5, dtype=torch.uint8), torch.zeros(2), torch.Size([10]), c)


def test_qtensor_dict_round_trip():
    q = Codec(bits=5, map="power-2", signed=False, scale="rank1").encode(torch.rand(7, 9))
    r = QTensor.from_dict(q.to_dict())
    assert r.codec == q.codec and torch.equal(r.codes, q.codes) and torch.equal(r.decode(), q.decode())


def test_subnormal_block_is_quantized_on_flt_min_grid():
    from qconf.codec.scales import FLT_MIN
    x = torch.tensor([1e-40, -3e-41, 0.0, 5e-39])
    c = Codec(bits=8, map="linear", signed=True, scale="tensor")
    q = c.encode(x)
    assert q.scales.item() == FLT_MIN
    y = c.decode(q)
    assert torch.isfinite(y).all() and ((y - x).abs() <= 0.5 / 127 * FLT_MIN).all()


def test_reciprocal_expansion_is_exactly_one_over_the_scale():
    from qconf.codec.scales import expand_reciprocals
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 5, 6, generator=g) * torch.logspace(-20, 20, 6)
    for scale in SCALE_TYPES:
        scales = Codec(scale=scale, group_size=4).encode(x).scales
        s = expand_scales(scales, tuple(x.shape), scale, 4)
        r = expand_reciprocals(scales, tuple(x.shape), scale, 4)
        assert torch.equal(r, 1.0 / s), scale
