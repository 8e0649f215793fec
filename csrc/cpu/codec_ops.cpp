// Native Codec.encode / Codec.decode (qconf::encode, qconf::decode): the kernel's tile functions
// applied to one tensor, in parallel over tiles. Same results as the reference codec.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

#include "qconf/isa.h"
#include "qconf/parallel.h"
#include "qconf/step_driver.h"
#include "qconf/step_host.h"
#include "qconf/step_types.h"

namespace qconf {
namespace {

using host::kMaxUnit;
constexpr int64_t kTile = host::kTileTarget;

RunCodecFn codec_function() {
  switch (selected_isa()) {
#ifndef QCONF_NO_AVX512  // (detect_isa never gives them then)
    case Isa::avx512vbmi: return &isa_avx512vbmi::run_codec_items;
    case Isa::avx512: return &isa_avx512::run_codec_items;
#endif
    case Isa::avx2: return &isa_avx2::run_codec_items;
    default: return &isa_scalar::run_codec_items;
  }
}

void describe(TensorDesc& t, StateDesc& st, c10::IntArrayRef shape, const at::Tensor& table, c10::IntArrayRef codec) {
  // the codec ints (layout.h kCodec*), then the number of stored scales
  TORCH_CHECK(codec.size() == static_cast<size_t>(kEncodeLen), "qconf encode/decode: codec description must have ",
              kEncodeLen, " ints");
  TORCH_CHECK(static_cast<int64_t>(shape.size()) <= kMaxDims, "qconf encode/decode: at most ", kMaxDims, " dims");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.numel() == kTableRows * kTableSize,
              "qconf encode/decode: table must be a contiguous float32 tensor of ", kTableRows, "x", kTableSize);
  t.ndim = static_cast<int32_t>(shape.size());
  t.numel = 1;
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = shape[d];
    t.numel *= shape[d];
  }
  CodecDesc& c = st.codec;
  read_codec(c, codec.data());
  st.num_scales = codec[kEncodeNumScales];
  TORCH_CHECK(codec_valid(c, t.ndim),
              "qconf encode/decode: invalid codec description");
  TORCH_CHECK(st.num_scales == host::num_scales_of(c, t), "qconf encode/decode: the codec description says ",
              st.num_scales, " scales, its scale layout has ", host::num_scales_of(c, t));
  point_tables(c, table.data_ptr<float>());
  st.kind = kQuant;
  // a block kept inside one tile is finished in one pass; everything else takes the two-pass route
  const bool one_tile = t.numel <= kMaxUnit;
  st.two_pass = !(c.scale_kind == kBlock && (one_tile || c.block <= kMaxUnit));
  const int64_t unit = st.two_pass ? 64 : std::lcm<int64_t>(64, c.block);
  t.tile = one_tile ? std::max<int64_t>(t.numel, 1) : (unit > kMaxUnit ? unit : ((kTile + unit - 1) / unit) * unit);
  if (!one_tile && unit > kMaxUnit) {  // lcm too large: two passes with small tiles instead
    st.two_pass = 1;
    t.tile = kTile;
  }
}

std::vector<WorkItem> tiles_of(const TensorDesc& t) {
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < t.numel; s += t.tile) items.push_back({0, s, std::min(t.tile, t.numel - s)});
  return items;
}

void run(RunCodecFn fn, const CodecJob& job, const std::vector<WorkItem>& items, int32_t op) {
  if (items.empty()) return;
  parallel_chunks(static_cast<int64_t>(items.size()), [&](int64_t b, int64_t e, int32_t tid) {
    fn(job, items.data(), b, e, op, tid);
  });
}

std::tuple<at::Tensor, at::Tensor> encode_cpu(const at::Tensor& x, const at::Tensor& table, c10::IntArrayRef codec,
                                              const c10::optional<at::Tensor>& noise) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "qconf encode: x must be a contiguous float32 CPU tensor");
  TensorDesc t;
  StateDesc st;
  describe(t, st, x.sizes(), table, codec);
  at::Tensor codes = at::zeros({(t.numel * st.codec.bits + 7) / 8}, x.options().dtype(at::kByte));
  at::Tensor scales = at::zeros({st.num_scales}, x.options());
  if (st.codec.stochastic) {
    TORCH_CHECK(noise.has_value() && noise->scalar_type() == at::kFloat && noise->is_contiguous() &&
                    noise->numel() == t.numel,
                "qconf encode: stochastic rounding needs `noise`, one float32 uniform per element");
    st.noise = noise->data_ptr<float>();
  }
  st.codes = codes.data_ptr<uint8_t>();
  st.scales = scales.data_ptr<float>();
  CodecJob job;
  job.t = &t;
  job.st = &st;
  job.x = x.data_ptr<float>();
  job.tile = t.tile;
  const RunCodecFn fn = codec_function();
  const std::vector<WorkItem> items = tiles_of(t);
  std::vector<uint32_t> partial;
  std::vector<float> recip;
  if (st.two_pass) {
    const int nthreads = at::get_num_threads();
    partial.assign(static_cast<size_t>(nthreads) * st.num_scales, 0u);
    recip.assign(static_cast<size_t>(st.num_scales), 0.0f);
    st.partial = partial.data();
    st.new_recip = recip.data();
    run(fn, job, items, kCodecReduce);
    for (int64_t j = 0; j < st.num_scales; ++j)
      finalize_scale(partial.data(), st.num_scales, nthreads, j, recip.data(), st.scales);
  }
  run(fn, job, items, kCodecQuantize);
  return {codes, scales};
}

at::Tensor decode_cpu(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& table,
                      c10::IntArrayRef codec, c10::IntArrayRef shape) {
  TensorDesc t;
  StateDesc st;
  describe(t, st, shape, table, codec);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == (t.numel * st.codec.bits + 7) / 8,
              "qconf decode: codes must be ", (t.numel * st.codec.bits + 7) / 8, " contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == st.num_scales,
              "qconf decode: scales must be ", st.num_scales, " contiguous float32");
  at::Tensor out = at::empty(shape, scales.options());
  st.codes = const_cast<uint8_t*>(codes.data_ptr<uint8_t>());
  st.scales = const_cast<float*>(scales.data_ptr<float>());
  CodecJob job;
  job.t = &t;
  job.st = &st;
  job.out = out.data_ptr<float>();
  job.tile = t.tile;
  run(codec_function(), job, tiles_of(t), kCodecDequantize);
  return out;
}

}  // namespace
}  // namespace qconf

TORCH_LIBRARY_FRAGMENT(qconf, m) {
  m.def("encode(Tensor x, Tensor table, int[] codec, Tensor? noise) -> (Tensor, Tensor)");
  m.def("decode(Tensor codes, Tensor scales, Tensor table, int[] codec, int[] shape) -> Tensor");
}

TORCH_LIBRARY_IMPL(qconf, CPU, m) {
  m.impl("encode", &qconf::encode_cpu);
  m.impl("decode", &qconf::decode_cpu);
}
