// The factored second moment (Adafactor-style row / column statistics, lpmm's "4-bit Factor"):
// the statistics update after the factor pass has summed the finite g_eff^2 (finite_square,
// element.h) per row and per column (per fixed row chunk), and the row factors the apply pass
// reads, v_ij = row_factor_i * col_j.
// One copy for the CPU driver (csrc/cpu/step.cpp) and the CUDA kernels (csrc/cuda/step.cu): fp32
// operations in the reference's order, so both give the same bits.
//
// t: a factored TensorDesc (rows = prod(shape[:-1]) rows of cols = shape[-1]; R = shape[-2] rows
// per batch, batches = rows / R) with its statistics and the factor pass's sums.
#pragma once

#include <cstdint>

#include "qconf/element.h"
#include "qconf/step_types.h"

namespace qconf {

// row r: row = row * b2 + (sum_c g^2 / C) * (1 - b2)
QCONF_HD void factored_update_row(const TensorDesc& t, int64_t r) {
  const float fC = static_cast<float>(t.cols);
  t.row[r] = t.row[r] * t.h.b2 + qdiv(t.row_sum[r], fC) * t.h.omb2;
}

// column entry bc = batch * C + c: the row chunks' partial sums added in chunk order, then
// col = col * b2 + (sum_r g^2 / R) * (1 - b2)
QCONF_HD void factored_update_col(const TensorDesc& t, int64_t bc, int64_t R, int64_t batches, int64_t chunks) {
  const int64_t n = batches * t.cols;
  float s = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) s = s + t.col_partial[c * n + bc];
  t.col[bc] = t.col[bc] * t.h.b2 + qdiv(s, static_cast<float>(R)) * t.h.omb2;
}

// the row factors of batch b: row / mean(row) over its R rows (summed in order), 0 for a batch
// whose mean is not positive
QCONF_HD void factored_row_factors(const TensorDesc& t, int64_t b, int64_t R) {
  const float* row = t.row + b * R;
  float s = 0.0f;
  for (int64_t r = 0; r < R; ++r) s = s + row[r];
  const float mean = qdiv(s, static_cast<float>(R));
  for (int64_t r = 0; r < R; ++r) t.row_factor[b * R + r] = mean > 0.0f ? qdiv(row[r], mean) : 0.0f;
}

}  // namespace qconf
