#!/usr/bin/env python
"""Cycles per vector of 8 fp32 elements of the AVX2 step's stages, on L1-resident data (one thread).

    python benchmarks/avx2_stages.py [--reps 5]

Compiles a small C++ program (g++ -O3 -mavx2 -mfma -ffp-contract=off) whose loops repeat the
operations of each stage of the fused AVX2 step over 2048 elements held in L1, and prints the
cycles per vector of each: the ``vsqrtps`` + ``vdivps`` of the AdamW denominator alone; the AdamW
update with fp32 states (the per-element work of torch's fused AdamW, without its memory
traffic); the same with both moments decoded from 4-bit codes (the group-128 main loop); the
signed 4-bit nearest search (the split 16-entry count of ``Probe16``); the 4-bit midpoint grid;
those three in one loop, the searches on another block's values (whether interleaving the
quantize work with the divider-bound main loop hides it: the row is about their sum); and the
signed 8-bit nearest code by segment lines (``FastQuantizer::segment_code``). These are
stand-ins written for the measurement (same instructions, synthetic tables), not the kernels:
they show where the floor of each stage is on the machine, which no instruction count
shows (callgrind counts a ``vdivps`` as one instruction). Cycles assume the clock that makes 8
independent chains of ``vaddps`` run at two per cycle (Zen 2-4, Skylake and later); the table
also gives nanoseconds. The median of ``--reps`` runs; a VM's neighbours move single runs.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
constexpr int n = 2048;
constexpr long R = 20000;
alignas(64) static float p[n], g[n], m[n], v[n], mo[n], vo[n], rcp[n / 8];
alignas(64) static float qm[n], qv[n];  // the fused row's quantize inputs (another block's new states)
alignas(64) static uint8_t cm[n / 2], cv[n / 2], om[n / 2], om2[n / 2], o8[n];
static const __m256i kShift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
// a 16-entry table lookup straight from 8 packed nibbles (Isa::lookup16_packed4 on AVX2)
static inline __m256 lut16(__m256 lo, __m256 hi, const uint8_t* c) {
  uint32_t w;
  std::memcpy(&w, c, 4);
  const __m256i i = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), kShift);
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, i), _mm256_permutevar8x32_ps(hi, i),
                          _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}
static inline __m256 s(float x) { return _mm256_set1_ps(x); }
// AdamRule::apply_plain: p *= decay; m = m b1 + g (1 - b1); v = v b2 + g^2 (1 - b2);
// p -= m / (sqrt(v) ibc + eps) * step; and the two states' |bits| maxima (block scales)
static inline void adam(int i, __m256 A, __m256 B, __m256i& mx) {
  const __m256 G = _mm256_load_ps(g + i);
  __m256 P = _mm256_mul_ps(_mm256_load_ps(p + i), s(0.99999f));
  A = _mm256_add_ps(_mm256_mul_ps(A, s(0.9f)), _mm256_mul_ps(G, s(0.1f)));
  B = _mm256_add_ps(_mm256_mul_ps(B, s(0.999f)), _mm256_mul_ps(_mm256_mul_ps(G, G), s(0.001f)));
  const __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(B), s(1.3f)), s(1e-8f));
  P = _mm256_sub_ps(P, _mm256_mul_ps(_mm256_div_ps(A, d), s(1e-3f)));
  const __m256i abs = _mm256_set1_epi32(0x7fffffff);
  mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(A), abs));
  mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(B), abs));
  _mm256_store_ps(p + i, P);
  _mm256_store_ps(mo + i, A);
  _mm256_store_ps(vo + i, B);
}
// cycles per vector of 8: body(i) does elements i .. i + step - 1
template <int Step = 8, class Body>
static double cycles(Body body, double ns_per_cycle) {
  auto t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < R; ++r) {
    for (int i = 0; i < n; i += Step) body(i);
    asm volatile("" ::: "memory");
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (R * (n / 8.0)) / ns_per_cycle;
}
int main() {
  for (int i = 0; i < n; ++i) {
    p[i] = 0.1f + i * 1e-5f;
    g[i] = 1e-3f * static_cast<float>((i % 7) - 3);
    m[i] = 1e-4f * static_cast<float>((i % 5) - 2);
    v[i] = 1e-7f * static_cast<float>(1 + i % 5);
  }
  for (int i = 0; i < n / 2; ++i) cm[i] = static_cast<uint8_t>(i * 37), cv[i] = static_cast<uint8_t>(i * 91);
  for (int i = 0; i < n / 8; ++i) rcp[i] = 1000.0f;
  // the clock: 8 independent chains of vaddps, two per cycle
  __m256 a0 = s(1), a1 = s(2), a2 = s(3), a3 = s(4), a4 = s(5), a5 = s(6), a6 = s(7), a7 = s(8);
  const long N = 50000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < N; ++k) {
    a0 = _mm256_add_ps(a0, s(1e-9f)), a1 = _mm256_add_ps(a1, s(1e-9f)), a2 = _mm256_add_ps(a2, s(1e-9f));
    a3 = _mm256_add_ps(a3, s(1e-9f)), a4 = _mm256_add_ps(a4, s(1e-9f)), a5 = _mm256_add_ps(a5, s(1e-9f));
    a6 = _mm256_add_ps(a6, s(1e-9f)), a7 = _mm256_add_ps(a7, s(1e-9f));
    asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7));
  }
  auto t1 = std::chrono::steady_clock::now();
  const double ns_per_cycle = std::chrono::duration<double, std::nano>(t1 - t0).count() / (N * 4.0);
  const __m256 mlo = _mm256_setr_ps(-.8875f, -.6625f, -.4375f, -.2125f, -.0775f, -.0325f, -.0055f, 0.f);
  const __m256 mhi = _mm256_setr_ps(.0055f, .0325f, .0775f, .2125f, .4375f, .6625f, .8875f, 1.f);
  const __m256 vlo = _mm256_mul_ps(_mm256_setr_ps(1, 2, 3, 4, 5, 6, 7, 8), s(1e-7f));
  const __m256 vhi = _mm256_mul_ps(_mm256_setr_ps(9, 10, 11, 12, 13, 14, 15, 16), s(1e-7f));
  __m256i mx = _mm256_setzero_si256();
  const double c_dv = cycles([&](int i) {
    _mm256_store_ps(mo + i, _mm256_div_ps(_mm256_load_ps(m + i), _mm256_sqrt_ps(_mm256_load_ps(v + i))));
  }, ns_per_cycle);
  const double c_f32 = cycles([&](int i) { adam(i, _mm256_load_ps(m + i), _mm256_load_ps(v + i), mx); }, ns_per_cycle);
  const double c_q4 = cycles([&](int i) { adam(i, lut16(mlo, mhi, cm + i / 2), lut16(vlo, vhi, cv + i / 2), mx); },
                             ns_per_cycle);
  // Probe16's split count over 15 sorted midpoints (signed 4-bit map), four vectors per packed store
  const __m256 odd = _mm256_setr_ps(-.775f, -.325f, -.055f, -.00275f, .019f, .145f, .55f, .94375f);
  const __m256 even = _mm256_setr_ps(-.9f, -.55f, -.145f, -.019f, .00275f, .055f, .325f, .775f);
  // (the quantize stand-ins read new states from src and write nibbles to dst)
  auto count = [&](const float* src, int i) {
    const __m256 x = _mm256_mul_ps(_mm256_load_ps(src + i), _mm256_broadcast_ss(rcp + i / 8));
    const __m256 m8 = _mm256_cmp_ps(s(0.0f), x, _CMP_LT_OQ);
    const __m256 m4 = _mm256_cmp_ps(_mm256_blendv_ps(s(-.145f), s(.145f), m8), x, _CMP_LT_OQ);
    __m256i k = _mm256_add_epi32(_mm256_and_si256(_mm256_castps_si256(m8), _mm256_set1_epi32(4)),
                                 _mm256_and_si256(_mm256_castps_si256(m4), _mm256_set1_epi32(2)));
    k = _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_cmp_ps(_mm256_permutevar8x32_ps(odd, k), x, _CMP_LT_OQ)));
    return _mm256_sub_epi32(_mm256_add_epi32(k, k),
                            _mm256_castps_si256(_mm256_cmp_ps(_mm256_permutevar8x32_ps(even, k), x, _CMP_LT_OQ)));
  };
  auto grid = [&](const float* src, int i) {
    const __m256 x = _mm256_mul_ps(_mm256_load_ps(src + i), _mm256_broadcast_ss(rcp + i / 8));
    const __m256 y = _mm256_min_ps(s(16.0f), _mm256_sub_ps(_mm256_mul_ps(x, s(16.0f)), s(1.5f)));
    return _mm256_cvttps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
  };
  auto pack = [&](uint8_t* dst, int i, __m256i c0, __m256i c1) {  // 16 codes of 0..15 -> 8 bytes of nibbles
    const __m256i w = _mm256_packus_epi32(c0, c1);
    const __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i / 2), _mm_or_si128(b, _mm_srli_epi64(b, 28)));
  };
  const double c_count = cycles<16>([&](int i) { pack(om, i, count(mo, i), count(mo, i + 8)); }, ns_per_cycle);
  const double c_grid = cycles<16>([&](int i) { pack(om, i, grid(vo, i), grid(vo, i + 8)); }, ns_per_cycle);
  // the three group-128 stages in one loop: the main loop of these 16 elements, and the search and
  // the grid of 16 elements of another block (independent of this turn's main loop), stored apart
  for (int i = 0; i < n; ++i) qm[i] = mo[i], qv[i] = vo[i];
  const double c_fused = cycles<16>([&](int i) {
    adam(i, lut16(mlo, mhi, cm + i / 2), lut16(vlo, vhi, cv + i / 2), mx);
    adam(i + 8, lut16(mlo, mhi, cm + i / 2 + 4), lut16(vlo, vhi, cv + i / 2 + 4), mx);
    pack(om, i, count(qm, i), count(qm, i + 8));
    pack(om2, i, grid(qv, i), grid(qv, i + 8));
  }, ns_per_cycle);
  // FastQuantizer::segment_code of a signed 8-bit map (8bit.yml's exp_avg): the segment by a
  // 3-level search of 8-entry tables, its line capped (the junction code + 1/2), mirrored for
  // negative values, ceil, and a fix-up for values within eps of an integer (the kernel probes
  // the midpoints there): rare in the kernel, and here too, as the caps are half-integers
  const __m256 seg_b2 = _mm256_setr_ps(1e-5f, 1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f, 2.f, 2.f);
  const __m256 seg_b1 = _mm256_setr_ps(1e-6f, 1e-5f, 1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f, 2.f);
  const __m256 seg_cap = _mm256_setr_ps(128.5f, 130.5f, 134.5f, 142.5f, 158.5f, 190.5f, 254.5f, 255.5f);
  const __m256 seg_top = _mm256_setr_ps(1e-6f, 1e-5f, 1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f, 2.f);
  const __m256 seg_slope = _mm256_setr_ps(1e6f, 2e5f, 4e4f, 8e3f, 1.6e3f, 320.f, 64.f, 0.f);
  const __m256 seg_offset = _mm256_setr_ps(127.3f, 128.1f, 130.2f, 134.3f, 142.4f, 158.5f, 190.6f, 255.f);
  auto segment = [&](int i) {
    const __m256 x = _mm256_mul_ps(_mm256_load_ps(qm + i), _mm256_broadcast_ss(rcp + i / 8));
    const __m256 a = _mm256_min_ps(s(1.99999988f), _mm256_andnot_ps(s(-0.0f), x));
    __m256i d = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(s(1e-3f), a, _CMP_LE_OQ)), _mm256_set1_epi32(4));
    d = _mm256_add_epi32(d, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(_mm256_permutevar8x32_ps(seg_b2, d), a,
                                                                                 _CMP_LE_OQ)), _mm256_set1_epi32(2)));
    d = _mm256_sub_epi32(d, _mm256_castps_si256(_mm256_cmp_ps(_mm256_permutevar8x32_ps(seg_b1, d), a, _CMP_LE_OQ)));
    __m256 cap = _mm256_permutevar8x32_ps(seg_cap, d);
    cap = _mm256_add_ps(cap, _mm256_and_ps(_mm256_cmp_ps(a, _mm256_permutevar8x32_ps(seg_top, d), _CMP_EQ_OQ), s(0.5f)));
    __m256 j = _mm256_min_ps(cap, _mm256_fmadd_ps(a, _mm256_permutevar8x32_ps(seg_slope, d),
                                                  _mm256_permutevar8x32_ps(seg_offset, d)));
    j = _mm256_blendv_ps(j, _mm256_sub_ps(s(254.f), j), _mm256_cmp_ps(x, s(0.0f), _CMP_LT_OQ));
    const __m256 jr = _mm256_round_ps(j, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 near = _mm256_cmp_ps(_mm256_andnot_ps(s(-0.0f), _mm256_sub_ps(j, jr)), s(1e-9f), _CMP_LE_OQ);
    __m256i c = _mm256_cvttps_epi32(_mm256_round_ps(j, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
    if (__builtin_expect(_mm256_movemask_ps(near), 0))
      c = _mm256_blendv_epi8(c, _mm256_cvttps_epi32(jr), _mm256_castps_si256(near));
    return c;
  };
  const double c_seg8 = cycles<32>([&](int i) {
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(segment(i), segment(i + 8)),
                                          _mm256_packus_epi32(segment(i + 16), segment(i + 24)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o8 + i),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }, ns_per_cycle);
  std::printf("%.4f %.3f %.3f %.3f %.3f %.3f %.3f %.3f %d\n", ns_per_cycle, c_dv, c_f32, c_q4, c_count, c_grid,
              c_fused, c_seg8, _mm256_extract_epi32(mx, 0) + om[3] + om2[5] + o8[7]);
}
"""

ROWS = [
    ("vsqrtps + vdivps alone (the AdamW denominator and quotient)", 1),
    ("AdamW update, fp32 states (torch fused AdamW's arithmetic)", 2),
    ("AdamW update, both moments decoded from 4-bit codes (group-128 main loop)", 3),
    ("signed 4-bit nearest search (Probe16 split count) + pack", 4),
    ("4-bit midpoint grid + pack", 5),
    ("the three group-128 stages above in one loop (quantizing another block)", 6),
    ("signed 8-bit segment-lines nearest code + pack (8bit.yml exp_avg)", 7),
]


def measure(reps: int) -> tuple[float, list[float]]:
    """Compile and run the stages ``reps`` times: (ns per cycle, median cycles per vector of each row)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("avx2_stages: no C++ compiler (g++) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "stages.cpp", Path(tmp) / "stages"
        src.write_text(SOURCE)
        build = subprocess.run([cxx, "-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-o", str(exe), str(src)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            raise SystemExit(f"avx2_stages: {cxx} could not build the AVX2 program (an x86-64 compiler is "
                             f"needed):\n{build.stderr[-1000:]}")
        runs = []
        for _ in range(reps):
            run = subprocess.run([str(exe)], capture_output=True, text=True)
            if run.returncode != 0:
                raise SystemExit(f"avx2_stages: the program failed (exit status {run.returncode}; "
                                 f"a CPU without AVX2 and FMA stops it with SIGILL)")
            runs.append([float(x) for x in run.stdout.split()])
    ns_per_cycle = statistics.median(r[0] for r in runs)
    return ns_per_cycle, [statistics.median(r[k] for r in runs) for _, k in ROWS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="runs of the program; medians are shown (default 5)")
    args = ap.parse_args(argv)
    ns_per_cycle, cyc = measure(max(1, args.reps))
    print(f"clock: {1 / ns_per_cycle:.2f} GHz (vaddps at two per cycle); L1-resident, one thread, "
          f"median of {args.reps} runs")
    width = max(len(name) for name, _ in ROWS)
    print(f"{'stage':<{width}}  cycles/8 elem  ns/elem")
    print("-" * width + "  -------------  -------")
    for (name, _), c in zip(ROWS, cyc):
        print(f"{name:<{width}}  {c:13.1f}  {c * ns_per_cycle / 8:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
