// Which stored scales the elements of a quantized state use, walked over a range of elements
// [start, start + n): one copy of the scale-layout index arithmetic for the CPU tile kernels
// (qconf/tile_codec.h) and the CUDA kernels (csrc/cuda/step.cu).
//
// The walkers are plain index arithmetic with no callbacks: the caller's loop handles each run,
// so the CPU's ISA-specific loops (compiled under `#pragma GCC target`) stay in the ISA code and
// only these generic, always-inlined functions are inlined into them.
#pragma once

#include <cstdint>

#include "qconf/element.h"
#include "qconf/step_types.h"

namespace qconf {

// q = a / b, r = a - q * b (on the GPU in 32 bits when both fit: 64-bit division is slow there)
QCONF_HD void divmod64(int64_t a, int64_t b, int64_t& q, int64_t& r) {
#if defined(__CUDA_ARCH__)
  if ((static_cast<uint64_t>(a) | static_cast<uint64_t>(b)) < (1ull << 32)) {
    const uint32_t qa = static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    q = qa;
    r = static_cast<int64_t>(static_cast<uint32_t>(a) - qa * static_cast<uint32_t>(b));
    return;
  }
#endif
  q = a / b;
  r = a - q * b;
}

// rank1 layout: one value per index of every dim, concatenated (shape[0] values, shape[1], ...).
// Walks the runs of the range inside one row along the last dim: elements [off, off + len) of
// the range, lead[0..nlead) the slots of the row's leading-dim values (last leading dim first),
// col the slot of the run's first column value.
struct Rank1Rows {
  int64_t off = 0, len = 0, col = 0;
  int nlead = 0;
  int64_t lead[kMaxDims];

  QCONF_HD Rank1Rows() {}
  QCONF_HD void begin(const TensorDesc& tensor, int64_t first, int64_t n) {
    t = &tensor;
    start = first;
    end = first + n;
    i = first;
    nlead = tensor.ndim - 1;
    last_off = 0;
    for (int d = 0; d < nlead; ++d) last_off += tensor.shape[d];
  }
  // the next run; false at the end of the range
  QCONF_HD bool next() {
    if (i >= end) return false;
    const int nd = t->ndim;
    const int64_t C = t->shape[nd - 1];
    int64_t r, c0;
    divmod64(i, C, r, c0);
    const int64_t e = i + (C - c0) < end ? i + (C - c0) : end;
    int64_t rem = r, o = last_off;
    for (int d = nd - 2; d >= 0; --d) {
      o -= t->shape[d];
      int64_t q, idx;
      divmod64(rem, t->shape[d], q, idx);
      lead[nd - 2 - d] = o + idx;
      rem = q;
    }
    off = i - start;
    len = e - i;
    col = last_off + c0;
    i = e;
    return true;
  }

 private:
  const TensorDesc* t = nullptr;
  int64_t start = 0, end = 0, i = 0, last_off = 0;
};

// rank1: the value a row contributes, combined over its leading dims' slots lead[0..nlead):
// scales with fmin (dequantize) or reciprocals with fmax (quantize), NaN-ignoring
QCONF_HD float rank1_row_part(const float* vals, const int64_t* lead, int nlead, bool use_min) {
  float part = vals[lead[0]];
  for (int k = 1; k < nlead; ++k) part = use_min ? fmin_nan(part, vals[lead[k]]) : fmax_nan(part, vals[lead[k]]);
  return part;
}

// A run of elements [off, off + len) of the range whose per-element value is `value` (vec ==
// nullptr), vec[j], or (comb, rank1) combine(value, vec[j]) with fmin_nan for scales, fmax_nan
// for reciprocals.
struct ScaleRun {
  int64_t off = 0, len = 0;
  float value = 0.0f;
  const float* vec = nullptr;
  bool comb = false;
};

// The runs of a scale layout, `vals` its per-stored-scale array (scales or reciprocals). One
// division per range; the runs then advance incrementally. next<Mode>() is the walk of one mode
// (the CPU loops are specialized on it); next() dispatches at run time.
struct ScaleRuns {
  enum Mode : int {
    kBlockRuns = 0,   // kBlock: one value per block
    kDim1Vector = 1,  // kDim1 with inner == 1: element i uses vals[i % d1], a vector per row
    kDim1Runs = 2,    // kDim1 with inner > 1: runs of `inner` elements share vals[(i / inner) % d1]
    kRank1Rows = 3,   // kRank1: per row run, the leading dims' part and the column vector
  };
  Mode mode;

  QCONF_HD ScaleRuns(const CodecDesc& c, const TensorDesc& t, const float* values, bool min_combine, int64_t first,
                     int64_t n)
      : vals(values), use_min(min_combine), start(first), end(first + n), i(first) {
    int64_t unused;
    if (c.scale_kind == kBlock) {
      mode = kBlockRuns;
      span = c.block;
      divmod64(first, span, index, unused);
    } else if (c.scale_kind == kDim1 && c.inner == 1) {
      mode = kDim1Vector;
      span = c.d1;
      divmod64(first, span, unused, index);
    } else if (c.scale_kind == kDim1) {
      mode = kDim1Runs;
      span = c.inner;
      d1 = c.d1;
      divmod64(first, span, run, unused);
      divmod64(run, d1, unused, index);
    } else {
      mode = kRank1Rows;
      rows.begin(t, first, n);
    }
  }

  template <int M>
  QCONF_HD bool next_of(ScaleRun& r) {
    if constexpr (M == kRank1Rows) {
      if (!rows.next()) return false;
      r.off = rows.off;
      r.len = rows.len;
      r.value = rank1_row_part(vals, rows.lead, rows.nlead, use_min);
      r.vec = vals + rows.col;
      r.comb = true;
      return true;
    } else {
      if (i >= end) return false;
      int64_t e;
      if constexpr (M == kBlockRuns) e = (index + 1) * span;            // the block's end
      else if constexpr (M == kDim1Vector) e = i + (span - index);     // the row's end
      else e = (run + 1) * span;                                        // the run's end
      e = e < end ? e : end;
      r.off = i - start;
      r.len = e - i;
      r.value = M == kDim1Vector ? 0.0f : vals[index];
      r.vec = M == kDim1Vector ? vals + index : nullptr;
      r.comb = false;
      i = e;
      if constexpr (M == kBlockRuns) {
        ++index;
      } else if constexpr (M == kDim1Vector) {
        index = 0;
      } else {
        ++run;
        index = index + 1 == d1 ? 0 : index + 1;
      }
      return true;
    }
  }

  QCONF_HD bool next(ScaleRun& r) {
    switch (mode) {
      case kBlockRuns: return next_of<kBlockRuns>(r);
      case kDim1Vector: return next_of<kDim1Vector>(r);
      case kDim1Runs: return next_of<kDim1Runs>(r);
      default: return next_of<kRank1Rows>(r);
    }
  }

 private:
  const float* vals;
  bool use_min;
  int64_t start, end, i;
  int64_t span = 1, d1 = 1;  // block, row length (d1) or run length (inner); dim1's d1
  int64_t index = 0;         // block index, column in the row, or scale index of the run
  int64_t run = 0;           // kDim1Runs: run index
  Rank1Rows rows;
};

}  // namespace qconf
