// The specialized CUDA step's compile-time spec and its run-time descriptors.
//
// A spec fixes everything the generic CUDA kernel (csrc/cuda/step.cu) reads from descriptors per
// octet: the update rule, the parameter and gradient dtypes, how a bf16/fp16 parameter is written
// (weights policy), and each state's codec -- its StateKind, bits, scale kind, group size, how
// nearest rounding finds a code (Near) and whether it rounds stochastically. The words are the
// CPU kernel's: StateKind / ScaleKind / DType / RuleId (layout.h), Near (element.h). At run time a
// launch carries only pointers, shapes, the codec tables, the Scalars and the RNG seed.
//
// Geometry: a block of kThreads threads, each owning one octet (kElems consecutive elements of
// one row: whole bytes of packed codes, two 16-byte fp32 loads) per iteration. A tensor is seen
// as rows x cols: a rank-1 state's own 2-D shape, or rows of kStrip elements for every other
// tensor. A unit of work is a strip of up to kStrip columns over a range of rows; its threads keep
// their columns for the whole unit (rank1 column scales and maxima stay per thread) and step down
// the rows, kThreads / tpr rows per iteration. Group scales are powers of two from kElems to
// kStrip that never straddle a row (spec_key.h checks it), so a group is tpg = GROUP / kElems
// consecutive, aligned threads: its maximum is a warp-shuffle reduction (and, above a warp, one
// exchange through shared memory), in the same pass that quantizes.
//
// Everything here is plain data and __host__ __device__ arithmetic, compiled by nvcc (ahead of
// time), NVRTC (at first use) and the host compiler (tests/test_spec_host.py runs the per-thread
// code of spec_octet.h on the host).
#pragma once

#include "qconf/element.h"
#include "qconf/fixed_int.h"
#include "qconf/layout.h"

namespace qconf {
namespace spec {

constexpr int kElems = 8;                  // elements per thread and iteration (an octet)
constexpr int kThreads = 256;              // threads per block
constexpr int kStrip = kElems * kThreads;  // columns of one block iteration: the largest group
constexpr int kWarp = 32;

// ---------------------------------------------------------------------------------------------
// policies

// A state's storage: KIND (kNone, kFp32, kParamDtype: the Kahan buffer in the parameter's
// dtype, or kQuant) and, for kQuant, its codec: BITS, SCALE (kBlock with GROUP elements per
// scale, or kRank1: min of the row's and the column's scale), NEAR and SR (stochastic rounding).
template <int KIND, int BITS = 0, int SCALE = kBlock, int GROUP = 0, int NEAR = kNearSearch, int SR = 0>
struct State {
  static constexpr int kKind = KIND;
  static constexpr bool kUsed = KIND != kNone;
  static constexpr bool kQuantized = KIND == kQuant;
  static constexpr int kBits = BITS;
  static constexpr int kScale = SCALE;
  static constexpr int kGroup = GROUP;
  static constexpr int kNearKind = NEAR;
  static constexpr bool kStochastic = SR != 0;
  static constexpr bool kRank1Scale = kQuantized && SCALE == kRank1;
  static constexpr bool kGroupScale = kQuantized && SCALE == kBlock;
  static constexpr int kGroupThreads = kGroupScale ? GROUP / kElems : 0;  // threads per group
  static_assert(!kQuantized || (BITS >= 1 && BITS <= 8), "codes of 1 to 8 bits");
  static_assert(!kGroupScale || (GROUP >= kElems && GROUP <= kStrip && (GROUP & (GROUP - 1)) == 0),
                "single-pass groups are powers of two from one octet to one strip");
};

template <int R>
struct RuleOf;
template <>
struct RuleOf<kRuleAdam> {
  using type = AdamRule;
};
template <>
struct RuleOf<kRuleSgd> {
  using type = SgdRule;
};
template <>
struct RuleOf<kRuleLion> {
  using type = LionRule;
};
template <>
struct RuleOf<kRuleMuonMomentum> {
  using type = MuonMomentumRule;
};
template <>
struct RuleOf<kRuleMuonUpdate> {
  using type = MuonUpdateRule;
};

// The rule's flags a spec fixes (the Scalars' run-time flags are overridden with them, so the
// rule's branches fold away): SGD's `first` (a lazily created buffer's first step) stays run-time.
enum RuleFlag : int {
  kFlagMaximize = 1,
  kFlagWeightDecay = 2,  // has_wd
  kFlagDecoupled = 4,    // decoupled weight decay (AdamW)
  kFlagMomentum = 8,     // SGD has_momentum
  kFlagNesterov = 16,    // SGD nesterov
};

QCONF_HD int rule_flags(const Scalars& h) {
  return (h.maximize ? kFlagMaximize : 0) | (h.has_wd ? kFlagWeightDecay : 0) | (h.decoupled ? kFlagDecoupled : 0) |
         (h.has_momentum ? kFlagMomentum : 0) | (h.nesterov ? kFlagNesterov : 0);
}

// A WEIGHTS bit of the specialized kernels only (beside layout.h's kWeights*): bf16 stochastic
// rounding that draws a hash per element, not one per pair (spec_octet.h PairStream), for a
// tensor whose pairs are not aligned in its stream (a shard starting at an odd element).
constexpr int kWeightsEachElement = 4;

// The whole spec: RULE (RuleId) and FLAGS (RuleFlag bits), PDTYPE / GDTYPE (DType), WEIGHTS
// (kWeights* bits: stochastic rounding, Kahan compensation into COMP, bits per element), the
// states S0 (exp_avg / momentum), S1 (exp_avg_sq) and COMP (the Kahan buffer).
template <int RULE, int FLAGS, int PDTYPE, int GDTYPE, int WEIGHTS, class S0, class S1, class COMP>
struct Spec {
  using Rule = typename RuleOf<RULE>::type;
  static constexpr int kRule = RULE;
  static constexpr int kFlags = FLAGS;
  // this step's scalars with the spec's flags
  QCONF_HD static Scalars scalars(const Scalars& run) {
    Scalars h = run;
    h.maximize = (FLAGS & kFlagMaximize) != 0;
    h.has_wd = (FLAGS & kFlagWeightDecay) != 0;
    h.decoupled = (FLAGS & kFlagDecoupled) != 0;
    h.has_momentum = (FLAGS & kFlagMomentum) != 0;
    h.nesterov = (FLAGS & kFlagNesterov) != 0;
    return h;
  }
  static constexpr int kPDtype = PDTYPE;
  static constexpr int kGDtype = GDTYPE;
  static constexpr int kWeights = WEIGHTS;
  static constexpr bool kWeightsSR = (WEIGHTS & kWeightsStochastic) != 0;
  static constexpr bool kKahan = (WEIGHTS & kWeightsKahan) != 0;
  // bf16 stochastic rounding without Kahan draws one hash per pair of elements
  static constexpr bool kPairBits = PDTYPE == kBF16 && WEIGHTS == kWeightsStochastic;
  using St0 = S0;
  using St1 = S1;
  using Comp = COMP;
  // a rank-1 state needs the whole tensor's new values first: the reduce pass, then apply
  static constexpr bool kTwoPass = S0::kRank1Scale || S1::kRank1Scale;
  static_assert(Rule::kStates == 2 || !S1::kUsed, "a one-state rule has no exp_avg_sq");
  static_assert(kKahan == COMP::kUsed, "the Kahan buffer exists iff the weights compensate");
  static_assert(!COMP::kRank1Scale, "the Kahan buffer uses group scales");
  static_assert(PDTYPE != kF32 || WEIGHTS == 0, "fp32 parameters take the fp32 result as is");
  static_assert((WEIGHTS & kWeightsEachElement) == 0 || (PDTYPE == kBF16 && WEIGHTS == (kWeightsStochastic | kWeightsEachElement)),
                "bits per element are an alternative to bf16 stochastic rounding's pairs");
};

// ---------------------------------------------------------------------------------------------
// run-time descriptors: a launch's kernel parameters (by value, so every per-tensor and per-unit
// value below is warp-uniform and lives in the GPU's uniform registers)

constexpr int kLaunchTensors = 30;  // tensors per launch (the parameters stay within 4 KB)

// One tensor of a launch. rows x cols is the tile layout (see the top of the file); its units are
// strips x row chunks of unit_rows rows.
struct SpecTensor {
  void* param = nullptr;
  const void* grad = nullptr;
  void* data[3] = {nullptr, nullptr, nullptr};     // per state: fp32 / 16-bit values or packed codes
  float* scales[3] = {nullptr, nullptr, nullptr};  // quantized states: the stored scales
  // rank-1 states 0 and 1: where their rows + cols entries start in the launch's partial and
  // recip arrays (SpecArgs), -1 for the others
  int32_t rank1_at[2] = {-1, -1};
  int64_t numel = 0;
  int64_t rows = 0;           // rank1: shape[0]; otherwise ceil(numel / kStrip)
  int32_t cols = 0;           // rank1: shape[1]; otherwise kStrip
  int32_t unit_rows = 0;      // rows per unit (unit_rows * cols < 2^31: offsets in a unit are 32-bit)
  int32_t units = 0;          // strips x ceil(rows / unit_rows)
  int32_t pad = 0;
  uint64_t index = 0;         // the parameter's index: its random streams (stream_key)
  uint64_t rng_offset = 0;    // the stream index of element 0 (a shard's start)
};

// The codec of one quantized state of a launch, as the kernels read it: its [kTableRows,
// kTableSize] table (qconf/codec/native.py) in device memory, and the scalars every code needs,
// read from the table on the host so that they reach the kernel as constants: the number of
// levels, the midpoint grid (L, c) and the mirror of signed octave lines.
struct SpecCodec {
  const float* table = nullptr;
  int32_t levels = 0;
  float top = 0.0f;  // levels - 1
  float grid_L = 0.0f, grid_c = 0.0f, mirror = 0.0f;
};

// The codecs of a launch's quantized states (exp_avg, exp_avg_sq, the Kahan buffer); all tensors
// of a launch share them.
struct SpecTables {
  SpecCodec c[3];
};

// The scalars of `table` (a host copy of the codec table: kTableRows x kTableSize floats) for
// SpecCodec.
QCONF_HD void describe_codec(const float* table, int32_t levels, SpecCodec& c) {
  const float* grid = table + kRowCoarse16 * kTableSize + kCoarse16Grid;
  c.levels = levels;
  c.top = static_cast<float>(levels - 1);
  c.grid_L = grid[kGridL];
  c.grid_c = grid[kGridC];
  c.mirror = table[kRowLines * kTableSize + kLinesMirror];
}

// The kernel parameters of one launch: tensors of one spec at one step. Rank-1 states keep their
// scratch in two arrays of the call: the absmax bits of the new values (rows then columns,
// zeroed before the reduce pass) and the reciprocals of the new scales (the finalize kernel's).
struct SpecArgs {
  SpecTables tables;
  Scalars h{};
  uint64_t seed = 0, step = 0;
  uint32_t* partial = nullptr;
  const float* recip = nullptr;
  int32_t ntensors = 0, nunits = 0;
  SpecTensor t[kLaunchTensors];
};
static_assert(sizeof(SpecArgs) <= 4096, "kernel parameters fit the 4 KB of every CUDA version");

// ---------------------------------------------------------------------------------------------
// geometry

// Unit u of a launch (warp-uniform): its tensor, the strip (first column col0, tpr threads per
// row, rpi = kThreads / tpr rows per iteration) and its rows [row0, row0 + nrows).
struct Unit {
  int32_t tensor;
  int32_t col0, tpr, rpi, nrows;
  int64_t row0;
};

QCONF_HD int32_t strips_of(int32_t cols) { return (cols + kStrip - 1) / kStrip; }

QCONF_HD Unit unit_at(const SpecArgs& a, int32_t u) {
  Unit r;
  r.tensor = 0;
  while (u >= a.t[r.tensor].units) u -= a.t[r.tensor++].units;
  const SpecTensor& t = a.t[r.tensor];
  const int32_t strips = strips_of(t.cols);
  const int32_t strip = u % strips;
  const int64_t chunk = u / strips;
  r.col0 = strip * kStrip;
  const int32_t width = t.cols - r.col0 < kStrip ? t.cols - r.col0 : kStrip;
  r.tpr = width / kElems;
  r.rpi = kThreads / r.tpr;
  r.row0 = chunk * t.unit_rows;
  r.nrows = static_cast<int32_t>(t.rows - r.row0 < t.unit_rows ? t.rows - r.row0 : t.unit_rows);
  return r;
}

// A thread's place in its unit: the rows it visits (rg, rg + rpi, ... of the unit) and its column
// offset c8 within the strip; threads past the last whole row group (rg >= rpi) idle.
struct Place {
  int32_t rg, c8;
  bool active;
};

QCONF_HD Place place_of(const Unit& u, int tid) {
  Place p;
  p.rg = tid / u.tpr;
  p.c8 = kElems * (tid - p.rg * u.tpr);
  p.active = p.rg < u.rpi;
  return p;
}

}  // namespace spec
}  // namespace qconf
