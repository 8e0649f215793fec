// qconf::ternary_mm(x, w, out): out = fp32(x @ w.T), exact, for int8 x [M, K] and int8 ternary
// w [N, K] (BitLinear's forward on the CPU, where torch's _int_mm is a scalar loop without AVX-512
// VNNI). Checks, packs the weight (csrc/include/qconf/ternary_mm.h), sums x's rows and runs the AVX2
// kernel in parallel over blocks of rows and panels. Needs AVX2 (QCONF_CPU_ISA is honoured).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "qconf/isa.h"
#include "qconf/parallel.h"
#include "qconf/ternary_mm.h"

namespace qconf {
namespace {

constexpr int64_t kRowBlock = 64;  // rows per task: 64 x 1 KiB of x (a k block) stays in L2 across the panels

// Packs panels [p0, p1) of u = w + 1 (layout in ternary_mm.h); false when an entry of w is not
// -1, 0 or +1 (u > 2 as a byte). Padding bytes start as 0xFF, which + 1 makes 0.
bool pack_panels(const int8_t* w, int64_t N, int64_t K, int64_t groups, uint8_t* packed, int64_t p0, int64_t p1) {
  const int64_t panel_bytes = groups * kTernaryPanelGroupBytes;
  uint8_t bad = 0;
  for (int64_t p = p0; p < p1; ++p) {
    uint8_t* dst = packed + p * panel_bytes;
    std::memset(dst, 0xFF, panel_bytes);
    for (int64_t c = 0; c < kTernaryPanel && p * kTernaryPanel + c < N; ++c) {
      const int8_t* src = w + (p * kTernaryPanel + c) * K;
      for (int64_t g = 0; g < groups; ++g)
        std::memcpy(dst + g * kTernaryPanelGroupBytes + c * kTernaryGroup, src + g * kTernaryGroup,
                    std::min<int64_t>(kTernaryGroup, K - g * kTernaryGroup));
    }
    for (int64_t i = 0; i < panel_bytes; ++i) {
      const uint8_t u = static_cast<uint8_t>(dst[i] + 1);
      bad |= static_cast<uint8_t>(u > 2);
      dst[i] = u;
    }
  }
  return bad == 0;
}

void check_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(),
              "qconf::ternary_mm: x, w and out must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "qconf::ternary_mm: x must be [M, K] and w ",
              "[N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kChar && w.scalar_type() == at::kChar, "qconf::ternary_mm: x and w must be ",
              "int8, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == w.size(0) && out.is_contiguous(),
              "qconf::ternary_mm: out must be a contiguous float32 [", x.size(0), ", ", w.size(0), "] tensor, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(x.size(1) <= kTernaryMaxK, "qconf::ternary_mm: K = ", x.size(1), " is over the supported ",
              kTernaryMaxK);
  TORCH_CHECK(static_cast<int>(selected_isa()) >= static_cast<int>(Isa::avx2), "qconf::ternary_mm needs AVX2; ",
              "this CPU (or QCONF_CPU_ISA) gives ", isa_name(selected_isa()));
}

void ternary_mm_cpu(const at::Tensor& x_, const at::Tensor& w_, at::Tensor out) {
  check_args(x_, w_, out);
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum
    out.zero_();
    return;
  }
  const int64_t groups = (K + kTernaryGroup - 1) / kTernaryGroup, panels = (N + kTernaryPanel - 1) / kTernaryPanel;
  at::Tensor packed = at::empty({panels * groups * kTernaryPanelGroupBytes}, x.options().dtype(at::kByte));
  at::Tensor row_sums = at::empty({M}, x.options().dtype(at::kInt));
  std::atomic<bool> ternary{true};
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    if (!pack_panels(w.data_ptr<int8_t>(), N, K, groups, packed.data_ptr<uint8_t>(), p0, p1)) ternary = false;
  });
  TORCH_CHECK(ternary.load(), "qconf::ternary_mm: w must hold only -1, 0 and +1");
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int8_t* row = x.data_ptr<int8_t>() + m * K;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += row[k];
      row_sums.data_ptr<int32_t>()[m] = sum;
    }
  });
  const TernaryMmArgs args{x.data_ptr<int8_t>(), packed.data_ptr<uint8_t>(), row_sums.data_ptr<int32_t>(),
                           out.data_ptr<float>(), M, K, N, groups, panels};
  // tasks: row blocks, each split into panel chunks when there are too few blocks for the threads
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t chunks = std::min(panels, std::max<int64_t>(1, 4 * at::get_num_threads() / row_blocks));
  const int64_t per_chunk = (panels + chunks - 1) / chunks;
  parallel_chunks(row_blocks * chunks, [&](int64_t t0, int64_t t1, int32_t) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, c = t % chunks;
      isa_avx2::ternary_mm_block(args, b * kRowBlock, std::min(M, (b + 1) * kRowBlock), c * per_chunk,
                                 std::min(panels, (c + 1) * per_chunk));
    }
  });
}

}  // namespace
}  // namespace qconf

TORCH_LIBRARY_FRAGMENT(qconf, m) { m.def("ternary_mm(Tensor x, Tensor w, Tensor(a!) out) -> ()"); }

TORCH_LIBRARY_IMPL(qconf, CPU, m) { m.impl("ternary_mm", &qconf::ternary_mm_cpu); }
