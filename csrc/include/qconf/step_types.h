// Plain descriptors of one fused optimizer step, filled by the host drivers (qconf/step_host.h)
// and read by the per-ISA tile kernels (csrc/include/qconf/step_pipeline.h) and the CUDA kernels.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>  // (std::conditional_t in the per-ISA step template)

#include "qconf/element.h"
#include "qconf/layout.h"

namespace qconf {

struct CodecDesc {
  int32_t bits = 0;
  int32_t levels = 0;
  int32_t scale_kind = kBlock;
  int32_t stochastic = 0;
  int64_t block = 0;           // kBlock
  int64_t d1 = 0, inner = 0;   // kDim1
  // the codec's [kTableRows, kTableSize] table that the pointers below point into (point_tables)
  const float* base = nullptr;
  const float* qmap = nullptr;     // kTableSize entries: the map (codes < levels)
  const float* mids = nullptr;     // kTableSize entries: levels-1 midpoints, then +inf
  const float* qsearch = nullptr;  // kTableSize entries: the map, then +inf
  const float* coarse_mids = nullptr;     // 16 entries: mids[16k + 15] (first 4 search levels)
  const float* coarse_qsearch = nullptr;  // 16 entries: qsearch[16k + 15]
  const float* coarse32_mids = nullptr;   // 32 entries: mids[8k + 7]
  const float* coarse32_qsearch = nullptr;
  const float* cols_mids = nullptr;       // 7 x 32: [j*32 + k] = mids[8k + j]
  const float* cols_qsearch = nullptr;
  // the search tables shifted by the binary-search steps (t[min(j + s, n - 1)]), so each probe is
  // a plain permute: [s=3 (16), s=1 (16)] of mids[:16], qsearch[:16], coarse_mids, coarse_qsearch;
  // [s=7, 3, 1 (32 each)] of coarse32_mids, coarse32_qsearch
  const float* shifted16_mids = nullptr;
  const float* shifted16_qsearch = nullptr;
  const float* shifted16_coarse_mids = nullptr;
  const float* shifted16_coarse_qsearch = nullptr;
  const float* shifted32_mids = nullptr;
  const float* shifted32_qsearch = nullptr;
  // 2 entries (L, c): nonzero L means the midpoints are exactly (k + c) / L with L a power of two
  // and c - 1/2 a non-negative integer, so the nearest code is clamp(ceil(n * L - c), 0, levels-1)
  // computed exactly in fp32 (qconf/codec/native.py:midpoint_grid)
  const float* grid = nullptr;
  // octave lines (qconf/codec/octave_lines.py): per octave of |n| slopes S1, offsets A1, S2, A2
  // (the estimate is the smaller line), the mirror K and the form (layout.h kLines*)
  const float* lines = nullptr;
  // qmap and midpoints (+inf padded) as planes for Isa::lookup256n: 16-bit halves [low 256 |
  // high 256], and bytes [byte 0 of 256 | byte 1 | byte 2 | byte 3] (1 KB each)
  const uint8_t* qmap_words = nullptr;
  const uint8_t* mids_words = nullptr;
  const uint8_t* qmap_bytes = nullptr;
  const uint8_t* mids_bytes = nullptr;
};

// Points a codec at its lookup tables: `base` is one [kTableRows, kTableSize] table of
// qconf/codec/native.py:codec_table (host or device memory).
inline void point_tables(CodecDesc& c, const float* base) {
  const auto row = [base](int r) { return base + r * kTableSize; };
  const auto planes = [&row](int r) { return reinterpret_cast<const uint8_t*>(row(r)); };
  c.base = base;
  c.qmap = row(kRowQmap);
  c.mids = row(kRowMids);
  c.qsearch = row(kRowQsearch);
  c.coarse_mids = row(kRowCoarse16) + kCoarse16Mids;
  c.coarse_qsearch = row(kRowCoarse16) + kCoarse16Qsearch;
  c.coarse32_mids = row(kRowCoarse32) + kCoarse32Mids;
  c.coarse32_qsearch = row(kRowCoarse32) + kCoarse32Qsearch;
  c.cols_mids = row(kRowColsMids);
  c.cols_qsearch = row(kRowColsQsearch);
  c.grid = row(kRowCoarse16) + kCoarse16Grid;
  const float* shifted16 = row(kRowCoarse16) + kCoarse16Shifted;
  c.shifted16_mids = shifted16;
  c.shifted16_qsearch = shifted16 + kShifted16Len;
  c.shifted16_coarse_mids = shifted16 + 2 * kShifted16Len;
  c.shifted16_coarse_qsearch = shifted16 + 3 * kShifted16Len;
  const float* shifted32 = row(kRowCoarse32) + kCoarse32Shifted;
  c.shifted32_mids = shifted32;
  c.shifted32_qsearch = shifted32 + kShifted32Len;
  c.lines = row(kRowLines);
  c.qmap_words = planes(kRowQmapWords);
  c.mids_words = planes(kRowMidsWords);
  c.qmap_bytes = planes(kRowQmapBytes);
  c.mids_bytes = planes(kRowMidsBytes);
}

// Re-points every table pointer of a codec described against the tables at `old_base` at the
// same table in a copy of those tables at `new_base` (the CUDA driver's device copy).
inline void rebase_tables(CodecDesc& c, const float* old_base, const float* new_base) {
  point_tables(c, new_base + (c.base - old_base));
}

// A codec's layout from its kCodecLen int64 fields (layout.h kCodec*), as the `meta` columns of a
// state or the codec list of encode / decode hold them.
inline void read_codec(CodecDesc& c, const int64_t* fields) {
  c.bits = static_cast<int32_t>(fields[kCodecBits]);
  c.levels = static_cast<int32_t>(fields[kCodecLevels]);
  c.scale_kind = static_cast<int32_t>(fields[kCodecScaleKind]);
  c.block = fields[kCodecBlock];
  c.d1 = fields[kCodecD1];
  c.inner = fields[kCodecInner];
  c.stochastic = static_cast<int32_t>(fields[kCodecStochastic]);
}

// Whether a codec description from Python is one the kernels can run on an `ndim`-D tensor.
inline bool codec_valid(const CodecDesc& c, int32_t ndim) {
  return c.bits >= 1 && c.bits <= 8 && c.levels >= 2 && c.levels <= (1 << c.bits) && c.scale_kind >= kBlock &&
         c.scale_kind <= kRank1 && (c.scale_kind != kBlock || c.block >= 1) &&
         (c.scale_kind != kDim1 || (c.d1 >= 1 && c.inner >= 1)) && (c.scale_kind != kRank1 || ndim >= 2);
}

struct StateDesc {
  int32_t kind = kNone;
  int32_t two_pass = 0;  // the new scales need the whole tensor first (two passes)
  float* values = nullptr;  // kFp32: numel floats
  uint16_t* values16 = nullptr;  // kParamDtype: numel bf16/fp16 values
  uint8_t* codes = nullptr; // kQuant: packed codes
  float* scales = nullptr;  // kQuant: stored scales (old during the step)
  int64_t num_scales = 0;
  CodecDesc codec;
  StreamKey key{0, 0, 0};   // stochastic rounding stream of this state at this step
  const float* noise = nullptr;  // if set: the uniforms for stochastic rounding, one per element
  // two-pass scratch (driver-owned)
  uint32_t* partial = nullptr;  // per-thread absmax bits, `num_scales` per thread
  float* new_recip = nullptr;   // 1 / new scale, `num_scales`
};

struct TensorDesc {
  uint64_t index = 0;  // the parameter's index (meta kMetaIndex): its random streams
  uint64_t step = 0;   // the step being taken (the counter + 1)
  int64_t numel = 0;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {0};
  void* param = nullptr;
  int32_t pdtype = kF32;
  const void* grad = nullptr;
  int32_t gdtype = kF32;
  StateDesc st[2];
  Scalars h{};
  // how the new fp32 parameter is written to a bf16/fp16 parameter (qconf/optim/weights.py)
  int32_t w_stochastic = 0;  // stochastic rounding, random bits from `pkey`
  int32_t w_kahan = 0;       // Kahan compensation with the buffer `comp`
  StreamKey pkey{0, 0, 0};
  StateDesc comp;            // kParamDtype or kQuant (group blocks within a tile)
  int64_t tile = 0;      // elements per work item (a multiple of 64, or whole rows when factored)
  int32_t two_pass = 0;  // some state needs pass 1
  // factored second moment (AdamRule only): fp32 statistics, updated between the passes
  int32_t factored = 0;
  float* row = nullptr;          // shape[:-1]
  float* col = nullptr;          // shape[:-2] + shape[-1:]
  float* row_factor = nullptr;   // scratch: row / mean(row), shape[:-1]
  float* col_partial = nullptr;  // scratch: per row-chunk column sums of g^2
  float* row_sum = nullptr;      // scratch: sum of g^2 per row
  int64_t rows = 0, cols = 0;    // factored view: rows = prod(shape[:-1]), cols = shape[-1]
  int64_t rows_per_chunk = 0;    // fixed row chunking of pass 1 (independent of thread count)
};

// rebase_tables of every quantized state of a tensor: its two states and the Kahan buffer.
inline void rebase_tables(TensorDesc& t, const float* old_base, const float* new_base) {
  for (StateDesc* st : {&t.st[0], &t.st[1], &t.comp})
    if (st->kind == kQuant) rebase_tables(st->codec, old_base, new_base);
}

// A unit of parallel work: elements [start, start + len) of one tensor, or (pass 1 of a factored
// tensor) rows chunk `start`.
struct WorkItem {
  int32_t tensor;
  int64_t start;
  int64_t len;
};

// What a tile kernel call does.
enum Phase : int32_t {
  kPassReduce = 0,  // pass 1: compute the new states, reduce the absmax of two-pass states; no stores
  kPassFactor = 1,  // pass 1 of factored tensors: row/column sums of g^2 per row chunk
  kPassApply = 2,   // the (final) pass: compute, quantize, store
};

struct StepContext {
  int32_t rule = kRuleAdam;
  TensorDesc* tensors = nullptr;
  int64_t max_tile = 0;  // elements of the largest tile or factored row: the tile buffers' length
};

// Per-ISA entry point: run items [begin, end) of `items` in `phase` on thread `tid`.
using RunItemsFn = void (*)(const StepContext& ctx, const WorkItem* items, int64_t begin, int64_t end,
                            int32_t phase, int32_t tid);

// Standalone codec encode/decode (Codec(..., backend="native")): one tensor, one state.
enum CodecOp : int32_t { kCodecReduce = 0, kCodecQuantize = 1, kCodecDequantize = 2 };
struct CodecJob {
  TensorDesc* t = nullptr;
  StateDesc* st = nullptr;
  const float* x = nullptr;  // encode input, fp32 contiguous
  float* out = nullptr;      // decode output, fp32 contiguous
  int64_t tile = 0;
};
using RunCodecFn = void (*)(const CodecJob& job, const WorkItem* items, int64_t begin, int64_t end, int32_t op,
                            int32_t tid);

namespace isa_scalar { void run_codec_items(const CodecJob&, const WorkItem*, int64_t, int64_t, int32_t, int32_t); }
namespace isa_avx2 { void run_codec_items(const CodecJob&, const WorkItem*, int64_t, int64_t, int32_t, int32_t); }
namespace isa_avx512 { void run_codec_items(const CodecJob&, const WorkItem*, int64_t, int64_t, int32_t, int32_t); }
namespace isa_avx512vbmi { void run_codec_items(const CodecJob&, const WorkItem*, int64_t, int64_t, int32_t, int32_t); }

namespace isa_scalar { void run_items(const StepContext&, const WorkItem*, int64_t, int64_t, int32_t, int32_t); }
namespace isa_avx2 { void run_items(const StepContext&, const WorkItem*, int64_t, int64_t, int32_t, int32_t); }
namespace isa_avx512 { void run_items(const StepContext&, const WorkItem*, int64_t, int64_t, int32_t, int32_t); }
namespace isa_avx512vbmi { void run_items(const StepContext&, const WorkItem*, int64_t, int64_t, int32_t, int32_t); }

}  // namespace qconf
