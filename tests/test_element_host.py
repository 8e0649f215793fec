"""The per-element math of csrc/include/qconf/element.h -- the functions the CUDA kernels call for
every element -- run on the host and compared bit for bit with the Python reference.

The CUDA kernels (csrc/cuda/step.cu) do no element arithmetic of their own: they call these
__host__ __device__ functions (conversions, RNG, absmax bits and scales, normalize, nearest and
stochastic rounding, the Adam/SGD/Lion rules), compiled with --fmad=false so that every operation
is rounded as written. Without a GPU this is how the device math is exercised: the same source
is compiled for the host (-ffp-contract=off) through a tiny extension and checked against
qconf.codec (quantize, rng, scales), torch's bf16/fp16 conversions and the reference rules of
qconf.optim. The scalars come from qconf/step_host.h's make_scalars, which both drivers use.
"""
from __future__ import annotations

import math

import pytest
import torch

from qconf.codec import Codec, packing, rng
from qconf.codec.qmap import MAP_NAMES
from qconf.codec.scales import compute_scales
from qconf.optim import SGD, Adam, AdamW, Lion
from qconf.optim.fused import hyper_values

from helpers import host_extension, host_extension_job, prebuilt_extension


SOURCE = r"""
#include <vector>
#include "qconf/element.h"
#include "qconf/step_host.h"

using namespace qconf;

static torch::Tensor f32(const torch::Tensor& t) { return t.contiguous().to(torch::kFloat); }

torch::Tensor nearest(torch::Tensor n, torch::Tensor mids, int64_t bits) {
  n = f32(n); mids = f32(mids);
  auto out = torch::empty({n.numel()}, torch::kLong);
  const float* x = n.data_ptr<float>(); const float* m = mids.data_ptr<float>(); int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n.numel(); ++i) o[i] = quantize_nearest(x[i], m, static_cast<int>(bits));
  return out;
}

torch::Tensor stochastic(torch::Tensor n, torch::Tensor u, torch::Tensor qmap, torch::Tensor qsearch, int64_t levels,
                         int64_t bits) {
  n = f32(n); u = f32(u); qmap = f32(qmap); qsearch = f32(qsearch);
  auto out = torch::empty({n.numel()}, torch::kLong);
  const float *x = n.data_ptr<float>(), *uu = u.data_ptr<float>();
  for (int64_t i = 0; i < n.numel(); ++i)
    out.data_ptr<int64_t>()[i] = quantize_stochastic(x[i], uu[i], qmap.data_ptr<float>(), qsearch.data_ptr<float>(),
                                                     static_cast<int>(levels), static_cast<int>(bits));
  return out;
}

// bf16 / fp16 bit patterns as int32 (0..65535)
torch::Tensor to_bf16(torch::Tensor x) {
  x = f32(x);
  auto out = torch::empty({x.numel()}, torch::kInt);
  for (int64_t i = 0; i < x.numel(); ++i) out.data_ptr<int32_t>()[i] = f32_to_bf16_rne(x.data_ptr<float>()[i]);
  return out;
}
torch::Tensor to_f16(torch::Tensor x) {
  x = f32(x);
  auto out = torch::empty({x.numel()}, torch::kInt);
  for (int64_t i = 0; i < x.numel(); ++i) out.data_ptr<int32_t>()[i] = f32_to_f16_rne(x.data_ptr<float>()[i]);
  return out;
}
torch::Tensor from_half_bits(torch::Tensor h, bool bf16) {
  h = h.contiguous().to(torch::kInt);
  auto out = torch::empty({h.numel()}, torch::kFloat);
  for (int64_t i = 0; i < h.numel(); ++i) {
    const uint16_t b = static_cast<uint16_t>(h.data_ptr<int32_t>()[i]);
    out.data_ptr<float>()[i] = bf16 ? bf16_to_f32(b) : f16_to_f32(b);
  }
  return out;
}

std::vector<int64_t> key(int64_t seed, int64_t step, int64_t tensor, int64_t stream) {
  const StreamKey k = stream_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(step),
                                 static_cast<uint64_t>(tensor), static_cast<uint64_t>(stream));
  return {static_cast<int64_t>(k.k0), static_cast<int64_t>(k.k1)};
}

// 32 random bits (as int64), the uniforms and the half_bits (bf16's 16 per element) of elements
// offset .. offset + n - 1
std::vector<torch::Tensor> random_bits(int64_t k0, int64_t k1, int64_t offset, int64_t n) {
  const StreamKey k{static_cast<uint32_t>(k0), static_cast<uint32_t>(k1)};
  auto bits = torch::empty({n}, torch::kLong);
  auto u = torch::empty({n}, torch::kFloat);
  auto half = torch::empty({n}, torch::kLong);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = hash_bits(k, static_cast<uint64_t>(offset + i));
    bits.data_ptr<int64_t>()[i] = h;
    u.data_ptr<float>()[i] = uniform01(h);
    half.data_ptr<int64_t>()[i] = half_bits(k, static_cast<uint64_t>(offset + i));
  }
  return {bits, u, half};
}

// group absmax scales (abs_bits -> scale_from_absmax_bits) and nearest codes of normalize(x, 1/s)
std::vector<torch::Tensor> encode_group(torch::Tensor x, int64_t block, torch::Tensor mids, int64_t bits) {
  x = f32(x); mids = f32(mids);
  const int64_t n = x.numel(), nb = (n + block - 1) / block;
  auto scales = torch::empty({nb}, torch::kFloat);
  auto codes = torch::empty({n}, torch::kLong);
  const float* v = x.data_ptr<float>();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t e = std::min(n, (b + 1) * block);
    uint32_t m = 0;
    for (int64_t i = b * block; i < e; ++i) m = finite_abs_bits(v[i]) > m ? finite_abs_bits(v[i]) : m;
    const float s = scale_from_absmax_bits(m);
    scales.data_ptr<float>()[b] = s;
    const float r = 1.0f / s;
    for (int64_t i = b * block; i < e; ++i)
      codes.data_ptr<int64_t>()[i] = quantize_nearest(normalize(v[i], r), mids.data_ptr<float>(), static_cast<int>(bits));
  }
  return {scales, codes};
}

// one step of a rule on fp32 tensors, in place (scalars as the drivers compute them)
void rule_step(int64_t rule, torch::Tensor p, torch::Tensor g, torch::Tensor s0, torch::Tensor s1,
               std::vector<double> hyper, double step, bool first) {
  const Scalars h = host::make_scalars(rule, hyper, step, first);
  float *P = p.data_ptr<float>(), *G = g.data_ptr<float>(), *A = s0.data_ptr<float>(), *B = s1.data_ptr<float>();
  for (int64_t i = 0; i < p.numel(); ++i) {
    if (rule == kRuleAdam) AdamRule::apply<float>(P[i], G[i], A[i], B[i], h);
    else if (rule == kRuleSgd) SgdRule::apply<float>(P[i], G[i], A[i], B[i], h);
    else LionRule::apply<float>(P[i], G[i], A[i], B[i], h);
  }
}
"""

FUNCTIONS = ["nearest", "stochastic", "to_bf16", "to_f16", "from_half_bits", "key", "random_bits", "encode_group",
             "rule_step"]


def build_extension(build_directory):
    return host_extension("qconf_element_host", SOURCE, FUNCTIONS, build_directory)


# compiled in the background from when collection ends (conftest.py)
BACKGROUND_JOBS = {"ext": host_extension_job(__file__, "build_extension")}
BACKGROUND_CPU_S = 27  # one core


@pytest.fixture(scope="module")
def ext(request, background_jobs):
    return prebuilt_extension(request, background_jobs, "ext", build_extension)


def _tables(codec: Codec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' first three table rows (qconf/codec/native.py codec_table): the map padded with
    its last value, the midpoints then +inf, the map then +inf; 256 entries each."""
    qmap, levels = codec.qmap, codec.qmap.numel()
    padded = torch.cat([qmap, qmap[-1].repeat(256 - levels)])
    mids = torch.cat([codec.midpoints, torch.full((257 - levels,), math.inf)])
    qsearch = torch.cat([qmap, torch.full((256 - levels,), math.inf)])
    return padded, mids, qsearch


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _assert_same_floats(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical, except that any NaN matches any NaN."""
    a, e = actual.reshape(-1), expected.reshape(-1)
    nan = torch.isnan(e)
    assert torch.equal(torch.isnan(a), nan)
    bad = (_bits(a) != _bits(e)) & ~nan
    assert not bad.any(), f"{int(bad.sum())} values differ, e.g. {a[bad][:4].tolist()} vs {e[bad][:4].tolist()}"


def _codecs(rounding):
    for bits in range(1, 9):
        for name in MAP_NAMES:
            for signed in (True, False):
                try:
                    yield Codec(bits=bits, map=name, signed=signed, rounding=rounding)
                except ValueError:  # e.g. signed 1-bit linear
                    continue


def _normalized_inputs(codec: Codec) -> torch.Tensor:
    g = torch.Generator().manual_seed(codec.bits)
    qmap, mids = codec.qmap, codec.midpoints
    lo, hi = qmap[0].item(), qmap[-1].item()
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 1e-30, -1e-30, math.inf, -math.inf, math.nan])
    return torch.cat([torch.rand(1024, generator=g) * (hi - lo) + lo, torch.randn(256, generator=g),
                      qmap, mids, torch.nextafter(mids, torch.full_like(mids, math.inf)),
                      torch.nextafter(mids, torch.full_like(mids, -math.inf)), special])


def test_quantize_nearest_matches_codec(ext):
    for codec in _codecs("nearest"):
        n = _normalized_inputs(codec)
        _, mids, _ = _tables(codec)
        assert torch.equal(ext.nearest(n, mids, codec.bits), codec.quantize(n)), codec


def test_quantize_stochastic_matches_codec(ext):
    for i, codec in enumerate(_codecs("stochastic")):
        n = _normalized_inputs(codec)
        noise = rng.uniform(rng.stream_key(7, i, 3, 1), n.numel())
        qmap, _, qsearch = _tables(codec)
        got = ext.stochastic(n, noise, qmap, qsearch, codec.qmap.numel(), codec.bits)
        assert torch.equal(got, codec.quantize(n, noise)), codec


def _float_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 2**32, (1 << 16,), generator=g, dtype=torch.int64)
    random_bits = (raw - (raw >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)
    # rounding boundaries: halfway points and their neighbours for bf16 and fp16, fp16 subnormals,
    # the fp16 overflow threshold, fp32 subnormals
    k = torch.arange(-2000, 2000, dtype=torch.int64)
    bf16_half = ((torch.randint(0, 2**15, (4000,), generator=g) << 16) + 0x8000 + k.clamp(-2, 2)).to(torch.int32)
    f16_grid = torch.arange(0, 65536 * 8, 7, dtype=torch.float64) * 2.0**-27
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e-8, -1e-8, 2.0**-24, 2.0**-25,
                            3 * 2.0**-26, 2.0**-14, 1.5e-45, 3.4e38, -3.4e38, math.inf, -math.inf])
    return torch.cat([random_bits, bf16_half.view(torch.float32), f16_grid.float(), -f16_grid.float(), special])


def test_bf16_and_fp16_rounding_match_torch(ext):
    x = _float_inputs()
    finite = torch.isfinite(x)
    x = x[finite]
    assert torch.equal(ext.to_bf16(x), x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
    assert torch.equal(ext.to_f16(x), x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF)
    # infinities and NaN keep their class (and sign)
    s = torch.tensor([math.inf, -math.inf, math.nan])
    for fn, dtype in ((ext.to_bf16, torch.bfloat16), (ext.to_f16, torch.float16)):
        y = fn(s).to(torch.int16).view(dtype).float()  # int32 -> int16 wraps: the same 16 bits
        assert y[0].item() == math.inf and y[1].item() == -math.inf and math.isnan(y[2].item())


def test_bf16_and_fp16_widening_match_torch(ext):
    h = torch.arange(65536, dtype=torch.int32)
    h16 = (h - (h >= 32768).int() * 65536).to(torch.int16)
    _assert_same_floats(ext.from_half_bits(h, False), h16.view(torch.float16).float())
    _assert_same_floats(ext.from_half_bits(h, True), h16.view(torch.bfloat16).float())


def test_rng_matches_reference(ext):
    for seed, step, tensor, stream in [(0, 1, 0, 0), (12345, 7, 3, 1), (2**64 - 1, 2**40, 999, 2), (2**63, 3, 1, 0)]:
        signed = seed - 2**64 if seed >= 2**63 else seed
        key = rng.stream_key(seed, step, tensor, stream)
        assert tuple(ext.key(signed, step, tensor, stream)) == key
        # crossing the 32-bit boundary of the element index, and (pairs) of the pair index
        for offset in (0, 1, 2**32 - 1000, 2**33 - 1001):
            bits, u, half = ext.random_bits(key[0], key[1], offset, 4096)
            assert torch.equal(bits, rng.hash_bits(key, 4096, offset=offset))
            assert torch.equal(half, rng.pair_halves(key, 4096, offset=offset))
            if offset == 0:
                assert torch.equal(u, rng.uniform(key, 4096))


def test_pair_halves_split_one_hash_between_two_elements():
    """bf16's 16 bits per element: element 2q takes the top half of hash q, 2q + 1 its low half,
    whatever offset a shard starts at."""
    key = rng.stream_key(5, 2, 1, rng.STREAM_PARAM)
    h = rng.hash_at(key, torch.arange(100, 150))
    half = rng.pair_halves(key, 100, offset=200)
    assert torch.equal(half[0::2] >> 16, h >> 16) and torch.equal(half[1::2] >> 16, h & 0xFFFF)
    assert torch.equal(half[0::2], h) and not (half[1::2] & 0xFFFF).any()
    assert torch.equal(rng.pair_halves(key, 99, offset=201), half[1:])
    # the 16-bit values are uniform: every top byte appears, and the mean is that of 0 .. 2^16 - 1
    many = rng.pair_halves(key, 1 << 16) >> 16
    assert torch.unique(many >> 8).numel() == 256
    assert abs(many.double().mean().item() / 32767.5 - 1.0) < 0.01


def test_group_scales_and_nearest_codes_match_encode(ext):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128 * 24 + 77, generator=g)
    x[128:256] = 0.0                                  # zero block: scale 0, codes of 0
    x[256:384] = torch.randn(128, generator=g) * 1e-40  # subnormal block: scale FLT_MIN
    x[400] = math.inf                                 # non-finite elements: left out of the scale
    x[600] = math.nan
    x[1280:1408] = math.inf                           # no finite element: scale 0, codes of 0
    x[700:828] *= 1e30
    for bits, name, signed in [(4, "nonlinear", True), (4, "power-1", False), (8, "nonlinear", True),
                               (3, "linear", True), (5, "float-point", True)]:
        codec = Codec(bits=bits, map=name, signed=signed, scale="group", group_size=128)
        scales, codes = ext.encode_group(x, 128, _tables(codec)[1], bits)
        ref = codec.encode(x)
        _assert_same_floats(scales, compute_scales(x, "group", 128))
        assert torch.equal(scales.view(torch.int32), ref.scales.view(torch.int32))
        assert torch.equal(codes, packing.unpack(ref.codes, bits, x.numel()).long()), codec


def _rule_inputs(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(n, generator=g) * 3)  # many orders of magnitude
    p = torch.randn(n, generator=g) * mag
    grad = torch.randn(n, generator=g) * mag * 0.1
    m = torch.randn(n, generator=g) * mag * 0.01
    v = (torch.randn(n, generator=g) * mag * 0.01) ** 2
    grad[:16] = 0.0
    m[8:24] = 0.0
    v[8:24] = 0.0
    return p, grad, m, v


RULE_CASES = [
    ("adamw", lambda ps: AdamW(ps, lr=3e-3, betas=(0.9, 0.999), weight_decay=0.05, fused=False), 0),
    ("adamw_max", lambda ps: AdamW(ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, maximize=True, fused=False), 0),
    ("adam_l2", lambda ps: Adam(ps, lr=2e-3, weight_decay=0.01, fused=False), 0),
    ("adam", lambda ps: Adam(ps, lr=2e-3, fused=False), 0),
    ("sgd", lambda ps: SGD(ps, lr=0.05, momentum=0.9, fused=False), 1),
    ("sgd_nesterov", lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=False), 1),
    ("sgd_damp_max", lambda ps: SGD(ps, lr=0.05, momentum=0.5, dampening=0.3, maximize=True, fused=False), 1),
    ("sgd_plain", lambda ps: SGD(ps, lr=0.05, weight_decay=1e-4, fused=False), 1),
    ("lion", lambda ps: Lion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=False), 2),
    ("lion_max", lambda ps: Lion(ps, lr=1e-4, maximize=True, fused=False), 2),
]


@pytest.mark.parametrize("name,make,rule", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_rules_match_reference(ext, name, make, rule):
    opt = make([torch.zeros(1)])
    group = opt.param_groups[0]
    hyper = hyper_values(opt._hyper(group))
    keys = [s.key for s in opt._state_specs(group, torch.zeros(2))]
    for step, first in [(1, True), (2, False), (1000, False)]:
        p, grad, m, v = _rule_inputs(seed=step)
        states = {k: t.clone() for k, t in zip(keys, (m, v))}
        p_ref = p.clone()
        opt._update(p_ref, grad, states, step, group, frozenset(keys) if first else frozenset())
        s0, s1 = m.clone(), v.clone()
        ext.rule_step(rule, p, grad, s0, s1, hyper, float(step), first)
        _assert_same_floats(p, p_ref)
        for k, got in zip(keys, (s0, s1)):
            _assert_same_floats(got, states[k])
