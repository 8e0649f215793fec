"""BitNet b1.58 codecs (docs/bitnet.md): ternary absmean weights and int8 per-row activations.

Both equal the reference code of BitNet's "Training Tips, Code and FAQ", written out below with
plain torch ops, bit for bit (the one difference: an integer level has no sign of zero, so where
BitNet's float pipeline gives -0.0 the codec gives +0.0 -- ``_same``), on odd shapes, zeros,
outliers, tiny values, exact .5 ties and bf16/fp16 inputs. NaN/Inf inputs follow the documented
rule instead (BitNet's code turns a whole row or tensor NaN).
"""
from __future__ import annotations

import math

import pytest
import torch

from qconf import Codec, QTensor
from qconf.codec import integer, native, packing
from qconf.codec.scales import expand_scales
from qconf.config import load_config
from qconf.errors import QConfigError

W = Codec(bits=2, map="ternary", scale="tensor", statistic="absmean", rounding="nearest-even", min_scale=1e-5)
A = Codec(bits=8, map="linear", scale="dim0", rounding="nearest-even", min_scale=1e-5)


# BitNet's reference quantizers (weight_quant / activation_quant), split into levels and scale.
def bitnet_weight(w):
    scale = 1.0 / w.abs().mean().clamp_(min=1e-5)
    return (w * scale).round().clamp_(-1, 1), scale


def bitnet_activation(x):
    scale = 127.0 / x.abs().max(dim=-1, keepdim=True).values.clamp_(min=1e-5)
    return (x * scale).round().clamp_(-128, 127), scale


def _same(a, b):
    """Equal bit patterns, except that +0.0 matches -0.0."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    bits_equal = a.view(torch.int32) == b.view(torch.int32)
    return bool((bits_equal | ((a == 0) & (b == 0))).all())


def _check(codec, reference, x):
    """The codec on ``x`` equals BitNet's formula on ``x``'s fp32 value; returns the levels."""
    levels, scales = codec.encode_integers(x)
    q_ref, scale_ref = reference(x.float())
    assert levels.dtype == torch.int8 and levels.shape == x.shape and scales.dtype == torch.float32
    assert torch.equal(levels.float(), q_ref)
    y = codec.decode_integers(levels, scales)
    assert _same(y, q_ref / scale_ref)
    qt = codec.encode(x)
    assert torch.equal(qt.scales, scales)
    assert torch.equal(packing.unpack(qt.codes, codec.bits, x.numel()), levels.reshape(-1).long() + codec._mrq)
    y2 = codec.decode(qt)
    assert torch.equal(y2.view(torch.int32), y.view(torch.int32))  # decode(encode) is decode_integers, bit for bit
    return levels


# ---------------------------------------------------------------------------------------------
# equal to BitNet's formulas
@pytest.mark.parametrize("shape", [(7, 13), (1, 1), (3, 5, 2), (13,), (), (64, 33)])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_ternary_weights_equal_bitnet(shape, magnitude):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * magnitude
    levels = _check(W, bitnet_weight, w)
    assert set(levels.unique().tolist()) <= {-1, 0, 1}
    assert torch.equal(W.encode_integers(w)[1], w.abs().mean().clamp(min=1e-5).reshape(1))


@pytest.mark.parametrize("shape", [(7, 13), (1, 1), (1, 13), (13, 1), (13,), (64, 33)])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_int8_rows_equal_bitnet(shape, magnitude):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + 7)) * magnitude
    _check(A, bitnet_activation, x)
    rows = x.reshape(-1, shape[-1]) if len(shape) == 2 else x.reshape(1, -1)
    assert torch.equal(A.encode_integers(x)[1], rows.abs().amax(dim=1).clamp(min=1e-5))


def test_all_zeros_store_min_scale_and_decode_to_zeros():
    for codec, ref, shape in ((W, bitnet_weight, (5, 7)), (A, bitnet_activation, (5, 7))):
        z = torch.zeros(shape)
        levels = _check(codec, ref, z)
        _, scales = codec.encode_integers(z)
        assert torch.equal(scales, torch.full_like(scales, 1e-5)) and not levels.any()
        assert torch.equal(codec.decode(codec.encode(z)), z)
    x = torch.randn(4, 9)
    x[2] = 0.0  # one zero row among others: only its scale is the floor
    _check(A, bitnet_activation, x)
    assert A.encode_integers(x)[1][2] == torch.tensor(1e-5)


def test_zero_blocks_without_floor_decode_to_exact_zeros():
    for codec in (Codec(**{**W.to_dict(), "min_scale": 0.0}), Codec(**{**A.to_dict(), "min_scale": 0.0})):
        levels, scales = codec.encode_integers(torch.zeros(3, 4))
        assert not scales.any() and not levels.any()  # 0 * (MRQ / 0) = NaN -> level 0
        assert torch.equal(codec.decode_integers(levels, scales), torch.zeros(3, 4))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_huge_outlier(sign):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 11, generator=g) * 1e-2
    x[3, 4] = sign * 1e30
    levels = _check(W, bitnet_weight, x)
    assert levels[3, 4] == sign and levels.abs().sum() == 1  # absmean ~ 1e30 / 66: all else rounds to 0
    levels = _check(A, bitnet_activation, x)
    assert levels[3, 4] == sign * 127 and levels[3].abs().sum() == 127
    assert torch.equal(levels[:3], A.encode_integers(x[:3])[0])  # the other rows keep their own scales
    big = torch.tensor([3e38, -3e38, 1.0, 0.0])  # near FLT_MAX: finite scale, finite levels
    _check(A, bitnet_activation, big)
    _check(W, bitnet_weight, big[:1])


def test_tiny_values_below_the_floor():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(9, 5, generator=g) * 1e-7
    w[0, 0], w[1, 1] = 8e-6, -6e-6  # still absmean < 1e-5: gamma = 1e-5, these round to +-1
    levels = _check(W, bitnet_weight, w)
    assert W.encode_integers(w)[1].item() == torch.tensor(1e-5).item()
    assert levels[0, 0] == 1 and levels[1, 1] == -1 and levels.abs().sum() == 2
    x = torch.randn(9, 5, generator=g) * 3e-6  # every row max < 1e-5: scale 1e-5, levels up to ~127 * 0.9
    levels = _check(A, bitnet_activation, x)
    assert levels.abs().max() > 10
    sub = torch.tensor([[1e-40, -3e-41, 0.0], [1e-39, 2.0, -1e-44]])  # subnormals
    _check(A, bitnet_activation, sub)
    _check(W, bitnet_weight, sub)


def test_exact_ties_round_half_to_even():
    # int8: a row whose max is 127 has MRQ / s == 1.0 exactly, so x = n + 0.5 is an exact tie
    n = torch.arange(-126, 126, dtype=torch.float32)
    row = torch.cat([torch.tensor([127.0]), n + 0.5])
    x = torch.stack([row, row * 0.5])  # second row: max 63.5, MRQ / s == 2.0, x * 2 = n + 0.5 again
    levels = _check(A, bitnet_activation, x)
    even = torch.where(torch.remainder(n, 2) == 0, n, n + 1)  # the even neighbour of n + 0.5
    assert torch.equal(levels[0, 1:].float(), even) and torch.equal(levels[1], levels[0])
    half = torch.cat([torch.tensor([254.0]), n + 0.5])  # max 254: factor 0.5 exactly; x * 0.5 is no tie
    _check(A, bitnet_activation, half.reshape(1, -1))
    # ternary: absmean exactly 1.0 (factor 1): +-0.5 are ties and go to 0 (half away would give +-1)
    w = torch.tensor([0.5, -0.5, 1.5, -1.5, 0.5, -2.5, 0.5, -0.5])
    assert w.abs().mean().item() == 1.0
    levels = _check(W, bitnet_weight, w)
    assert levels.tolist() == [0, 0, 1, -1, 0, -1, 0, 0]
    w2 = torch.tensor([0.25, -0.25, 0.75, -0.75])  # absmean 0.5: factor 2, +-0.25 * 2 = +-0.5 ties
    assert _check(W, bitnet_weight, w2).tolist() == [0, 0, 1, -1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_their_fp32_value(dtype):
    g = torch.Generator().manual_seed(3)
    for codec, ref in ((W, bitnet_weight), (A, bitnet_activation)):
        x = (torch.randn(17, 31, generator=g) * 2).to(dtype)
        levels = _check(codec, ref, x)  # compares with BitNet's formula on x.float()
        assert torch.equal(levels, codec.encode_integers(x.float())[0])


def test_non_contiguous_input():
    x = torch.randn(20, 12, generator=torch.Generator().manual_seed(4))
    _check(W, bitnet_weight, x.t())
    _check(A, bitnet_activation, x.t())
    assert torch.equal(A.encode_integers(x.t())[0], A.encode_integers(x.t().contiguous())[0])


# ---------------------------------------------------------------------------------------------
# NaN and Inf: statistics count them as 0, NaN -> level 0, +-Inf -> +-MRQ
def test_non_finite_inputs_follow_the_documented_rule():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 16, generator=g)
    x[1, 3], x[2, 0], x[2, 5], x[4, 7] = math.nan, math.inf, -math.inf, math.nan
    x[3] = math.nan  # a row with no finite element
    bad = ~torch.isfinite(x)
    clean = torch.where(bad, torch.zeros_like(x), x)
    for codec, ref, mrq in ((W, bitnet_weight, 1), (A, bitnet_activation, 127)):
        levels, scales = codec.encode_integers(x)
        clean_levels, clean_scales = codec.encode_integers(clean)
        assert torch.equal(scales, clean_scales)  # NaN/Inf weigh as 0 (absmean: they stay in the count)
        assert torch.equal(levels[~bad], clean_levels[~bad])
        assert torch.equal(levels[~bad].float(), ref(clean)[0][~bad])  # BitNet on the cleaned input
        assert levels[1, 3] == 0 and levels[4, 7] == 0 and not levels[3].any()
        assert levels[2, 0] == mrq and levels[2, 5] == -mrq
        y = codec.decode(codec.encode(x))
        assert torch.isfinite(y).all() and torch.equal(y, codec.decode_integers(levels, scales))
        f = integer.level_factors(scales, mrq)
        f_inf = f if codec is W else f[2]
        assert y[2, 0] == mrq / f_inf and y[2, 5] == -mrq / f_inf
    assert A.encode_integers(x)[1][3] == torch.tensor(1e-5)  # the all-NaN row: the floor


def test_absmean_overflow_gives_a_finite_scale():
    # sum |w| beyond FLT_MAX: the fp32 mean overflows (BitNet's scale becomes 0 and its output NaN);
    # the stored scale saturates at FLT_MAX instead
    w = torch.tensor([3e38, 3e38, -3e38, 1.0])
    assert torch.isinf(w.abs().mean())
    levels, scales = W.encode_integers(w)
    assert scales.item() == torch.finfo(torch.float32).max
    assert levels.tolist() == [1, 1, -1, 0]
    f = 1.0 / scales  # subnormal: k / f may round past FLT_MAX, as BitNet's formula would (docs/bitnet.md)
    assert _same(W.decode_integers(levels, scales), levels.float() / f)


# ---------------------------------------------------------------------------------------------
# storage, round trips, descriptions
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 91, 1001])
def test_ternary_packs_four_codes_a_byte(n):
    w = torch.randn(n, generator=torch.Generator().manual_seed(n))
    q = W.encode(w)
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == math.ceil(n / 4)
    assert q.nbytes == W.nbytes(w.shape) == math.ceil(n / 4) + 4
    codes = packing.unpack(q.codes, 2, n)
    assert codes.max() <= 2 and torch.equal(codes - 1, W.encode_integers(w)[0].long())
    assert A.encode(torch.randn(3, n)).nbytes == 3 * n + 3 * 4


def test_round_trips_and_dicts():
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(6))
    for codec in (W, A):
        q = codec.encode(x)
        r = QTensor.from_dict(q.to_dict())
        assert r.codec == codec and torch.equal(r.decode(), codec.decode(q))
        d = codec.to_dict()
        assert d.get("statistic", "absmax") == codec.statistic and d["min_scale"] == 1e-5
        assert d["rounding"] == "nearest-even"
        assert Codec.from_dict(d) == codec and hash(Codec.from_dict(d)) == hash(codec)
        assert "statistic=" in repr(codec) and "min_scale=1e-05" in repr(codec)
        levels, scales = codec.encode_integers(x)
        assert torch.equal(codec.encode_integers(x * 0.5, scales=scales)[1], scales)  # given scales are kept
    old = {"bits": 4, "map": "nonlinear", "signed": True, "scale": "group", "group_size": 128, "rounding": "nearest"}
    c = Codec.from_dict(old)  # a dict from before these fields: the defaults
    assert c == Codec() and c.statistic == "absmax" and c.min_scale == 0.0
    assert Codec().to_dict() == old  # defaults are left out: older qconf versions read the checkpoints
    assert Codec(min_scale=1) == Codec(min_scale=1.0) and isinstance(Codec(min_scale=1).min_scale, float)


def test_absmean_on_other_scale_types_by_hand():
    x = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(7))
    x[1, 2, 0] = math.nan
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    cases = {"dim0": a.reshape(5, -1).mean(dim=1), "dim1": a.movedim(1, 0).reshape(7, -1).mean(dim=1),
             "group": torch.cat([a.reshape(-1)[:96].view(-1, 32).mean(dim=1), a.reshape(-1)[96:].mean().reshape(1)]),
             "tensor": a.mean().reshape(1)}
    for scale, want in cases.items():
        c = Codec(bits=8, map="linear", scale=scale, group_size=32, statistic="absmean")
        assert torch.equal(c.encode(x).scales, want), scale
        ce = Codec(bits=8, map="linear", scale=scale, group_size=32, statistic="absmean", rounding="nearest-even")
        levels, scales = ce.encode_integers(x)
        assert torch.equal(scales, want) and torch.equal(ce.decode(ce.encode(x)), ce.decode_integers(levels, scales))


def test_nearest_even_on_other_scale_types_is_the_elementwise_formula():
    x = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(8))
    for scale in ("dim1", "group", "rank1"):
        c = Codec(bits=4, map="linear", scale=scale, group_size=7, rounding="nearest-even")
        levels, scales = c.encode_integers(x)
        s = Codec(bits=4, map="linear", scale=scale, group_size=7).encode(x).scales  # same absmax scales
        assert torch.equal(scales, s)
        f = 7.0 / expand_scales(scales, tuple(x.shape), scale, 7)  # torch's 7.0 / s: reciprocal() * 7
        assert torch.equal(levels.float(), (x * f).round().clamp(-7, 7)), scale
        assert _same(c.decode_integers(levels, scales), levels.float() / f)


def test_factor_is_torchs_mrq_over_s_not_a_true_division():
    # BitNet's `127.0 / t` is t.reciprocal() * 127.0 in torch: two roundings. The codec follows it;
    # a correctly rounded 127 / s would differ in the last bit for many scales.
    s = torch.rand(100_000, generator=torch.Generator().manual_seed(9)) * 10 + 1e-3
    assert torch.equal(integer.level_factors(s, 127), 127.0 / s)
    assert (integer.level_factors(s, 127) != torch.div(torch.full_like(s, 127.0), s)).any()
    assert torch.equal(integer.level_factors(s, 1), 1.0 / s)


# ---------------------------------------------------------------------------------------------
# clear errors
@pytest.mark.parametrize("kwargs,needle", [
    ({"map": "ternary", "bits": 4}, "needs bits=2 and signed=True"),
    ({"map": "ternary", "bits": 2, "signed": False}, "needs bits=2 and signed=True"),
    ({"map": "ternary", "bits": 1}, "needs bits=2 and signed=True"),
    ({"rounding": "nearest-even"}, "needs an integer-grid map"),
    ({"map": "linear", "signed": False, "rounding": "nearest-even"}, "needs an integer-grid map"),
    ({"map": "power-1", "bits": 8, "rounding": "nearest-even"}, "needs an integer-grid map"),
    ({"rounding": "even"}, "unknown rounding 'even'; allowed: nearest, stochastic, nearest-even"),
    ({"statistic": "median"}, "unknown statistic 'median'; allowed: absmax, absmean"),
    ({"statistic": "absmean", "scale": "rank1"}, "statistic 'absmean' supports scale tensor, dim0, dim1, group"),
    ({"min_scale": -1e-5}, "min_scale must be 0 or a number in"),
    ({"min_scale": math.nan}, "min_scale must be 0 or a number in"),
    ({"min_scale": math.inf}, "min_scale must be 0 or a number in"),
    ({"min_scale": 1e39}, "min_scale must be 0 or a number in"),
    ({"min_scale": 1e-40}, "min_scale must be 0 or a number in"),
    ({"min_scale": True}, "min_scale must be 0 or a number in"),
    ({"min_scale": "1e-5"}, "min_scale must be 0 or a number in"),
])
def test_invalid_combinations_are_clear_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        Codec(**kwargs)


def test_integer_entry_points_need_nearest_even():
    c = Codec(bits=8, map="linear")
    with pytest.raises(ValueError, match="needs rounding='nearest-even'"):
        c.encode_integers(torch.randn(4))
    with pytest.raises(ValueError, match="needs rounding='nearest-even'"):
        c.decode_integers(torch.zeros(4, dtype=torch.int8), torch.ones(1))
    with pytest.raises(TypeError, match="levels must be an int8 tensor"):
        A.decode_integers(torch.zeros(2, 4, dtype=torch.int32), torch.ones(2))
    with pytest.raises(ValueError, match="scales must be 1-D float32 with 2 values"):
        A.decode_integers(torch.zeros(2, 4, dtype=torch.int8), torch.ones(3))
    with pytest.raises(ValueError, match="rounds x \\* \\(MRQ / s\\), not normalized values"):
        A.quantize(torch.zeros(3))
    with pytest.raises(TypeError, match="can only encode floating tensors"):
        A.encode_integers(torch.arange(4))


@pytest.mark.parametrize("codec", [W, A, Codec(bits=4, scale="tensor", statistic="absmean"), Codec(min_scale=1e-5),
                                   Codec(bits=8, map="linear", rounding="nearest-even")])
def test_native_kernels_refuse_what_they_cannot_run(codec):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="the native kernels cannot run"):
        native.codec_descriptor(codec, (4, 8))
    with pytest.raises(ValueError, match="the native kernels cannot run"):
        native.codec_table(codec)
    q = codec.encode(x)
    for call in (lambda: codec.encode(x, backend="native"), lambda: codec.decode(q, backend="native")):
        with pytest.raises((ValueError, RuntimeError), match="the native kernels cannot run|needs the compiled"):
            call()


def test_native_still_runs_ternary_with_nearest():
    c = Codec(bits=2, map="ternary", scale="group", group_size=16)
    assert native.codec_descriptor(c, (40,)) == native.codec_descriptor(
        Codec(bits=2, map="linear", scale="group", group_size=16), (40,))  # the same 3-level table
    table = native.codec_table(Codec(bits=2, map="linear", scale="group", group_size=16))
    assert torch.equal(native.codec_table(c).view(torch.int32), table.view(torch.int32))  # raw bits: NaN patterns


# ---------------------------------------------------------------------------------------------
# the optimizer-state config: map ternary is reachable (bits 2, signed), the new fields are not
@pytest.mark.parametrize("section,needle", [
    ({"map": "ternary"}, "needs bits: 2 and signed: true, got bits: 4"),
    ({"map": "ternary", "bits": 2, "signed": False}, "needs bits: 2 and signed: true"),
    ({"map": "ternary", "bits": 8}, "for other widths use map 'linear'"),
    ({"statistic": "absmean"}, "unknown key 'statistic'"),
    ({"min_scale": 1e-5}, "unknown key 'min_scale'"),
    ({"rounding": "nearest-even"}, "'nearest-even' is not a valid rounding mode"),
])
def test_config_refuses_what_states_cannot_use(section, needle):
    with pytest.raises(QConfigError, match=needle):
        load_config({"states": {"exp_avg": section}})


def test_config_ternary_state_and_override_combinations():
    cfg = load_config({"states": {"exp_avg": {"map": "ternary", "bits": 2}}})
    assert cfg.states["exp_avg"].codec() == Codec(bits=2, map="ternary", signed=True)
    with pytest.raises(QConfigError, match="overrides\\[0\\].states.exp_avg: map 'ternary'"):
        load_config({"states": {"exp_avg": {"map": "ternary", "bits": 2}},
                     "overrides": [{"match": "x", "states": {"exp_avg": {"bits": 4}}}]})
    with pytest.raises(QConfigError, match="weights.compensation_codec: map 'ternary'"):
        load_config({"weights": {"compensation": "kahan", "compensation_codec": {"map": "ternary"}}})


def test_decode_levels_unpacks_the_packed_levels():
    torch.manual_seed(3)
    for codec, x in [(W, torch.randn(7, 13) * 2), (A, torch.randn(5, 9))]:
        q = codec.encode(x)
        levels, scales = codec.encode_integers(x)
        assert torch.equal(codec.decode_levels(q), levels) and torch.equal(q.scales, scales)
    with pytest.raises(ValueError, match="decode_levels expects a QTensor encoded with"):
        W.decode_levels(A.encode(torch.randn(2, 3)))
    with pytest.raises(ValueError, match="needs rounding='nearest-even'"):
        Codec().decode_levels(Codec().encode(torch.randn(4)))
