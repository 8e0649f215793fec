// The layout of the native ops' arguments, written once: the `hyper` float list, the `meta` int64
// table, the flat `states` tensor list of torch.ops.qconf.fused_step (built by
// qconf/optim/fused.py), the codec int list of qconf::encode / qconf::decode (built by
// qconf/codec/native.py), and the codec lookup tables (qconf/codec/native.py:codec_table).
//
// Python reads these values from torch.ops.qconf.layout() (kLayout below), so a position changes
// here and nowhere else. Plain constants: included by the CPU kernels, the CUDA kernels and the
// host drivers alike.
#pragma once

#include "qconf/fixed_int.h"

namespace qconf {

// ---------------------------------------------------------------------------------------------
// hyper: the param group's hyperparameters, as doubles
constexpr int kHyperLr = 0;
constexpr int kHyperBeta1 = 1;
constexpr int kHyperBeta2 = 2;
constexpr int kHyperEps = 3;
constexpr int kHyperWeightDecay = 4;
constexpr int kHyperMomentum = 5;
constexpr int kHyperDampening = 6;
constexpr int kHyperMaximize = 7;   // nonzero: maximize
constexpr int kHyperNesterov = 8;   // nonzero: Nesterov momentum
constexpr int kHyperDecoupled = 9;  // nonzero: decoupled weight decay (AdamW)
constexpr int kHyperAdjustedLr = 10;  // Muon's shape-adjusted lr (the step size of kRuleMuonUpdate)
constexpr int kHyperLen = 11;

// ---------------------------------------------------------------------------------------------
// codec: a quantized state's codec as ints (read_codec in step_types.h)
constexpr int kCodecBits = 0;
constexpr int kCodecLevels = 1;     // map entries (codes < levels)
constexpr int kCodecScaleKind = 2;  // ScaleKind, after the rank fallbacks
constexpr int kCodecBlock = 3;      // kBlock: elements per scale
constexpr int kCodecD1 = 4;         // kDim1: scale ((i / inner) % d1)
constexpr int kCodecInner = 5;
constexpr int kCodecStochastic = 6;  // nonzero: stochastic rounding
constexpr int kCodecLen = 7;

// encode / decode: the codec ints, then the number of stored scales
constexpr int kEncodeNumScales = kCodecLen;
constexpr int kEncodeLen = kCodecLen + 1;

// ---------------------------------------------------------------------------------------------
// meta: int64 [T, kMetaCols], one row per parameter
constexpr int kMaxDims = 8;
constexpr int kMetaIndex = 0;     // parameter index in the optimizer (RNG stream)
constexpr int kMetaFirst = 1;     // 1 on the first step of a lazily created state (SGD buffer = grad)
constexpr int kMetaFactored = 2;  // 1: factored second moment (row/col statistics in kSlotRow, kSlotCol)
constexpr int kMetaNdim = 3;
constexpr int kMetaShape = 4;     // kMaxDims columns
// a state's block of columns: kind (StateKind), codec table index, the codec ints
constexpr int kStateColKind = 0;
constexpr int kStateColTable = 1;
constexpr int kStateColCodec = 2;
constexpr int kStateCols = kStateColCodec + kCodecLen;
constexpr int kMetaState0 = kMetaShape + kMaxDims;   // exp_avg (SGD: momentum_buffer)
constexpr int kMetaState1 = kMetaState0 + kStateCols;  // exp_avg_sq
constexpr int kMetaWeights = kMetaState1 + kStateCols;  // kWeights* bits: how bf16/fp16 params are written
constexpr int kMetaComp = kMetaWeights + 1;  // the Kahan buffer, a state block: kParamDtype or kQuant
constexpr int kMetaRngOffset = kMetaComp + kStateCols;  // element 0's index in the random streams (>= 0)
constexpr int kMetaCols = kMetaRngOffset + 1;

// bits of the kMetaWeights column
constexpr int kWeightsStochastic = 1;  // stochastic rounding into the parameter
constexpr int kWeightsKahan = 2;       // Kahan compensation with the buffer of kMetaComp

// ---------------------------------------------------------------------------------------------
// states: kSlotLen tensors per parameter, parameter i's at i * kSlotLen + slot (undefined /
// empty where unused)
constexpr int kSlotState0 = 0;        // exp_avg values (fp32) or packed codes
constexpr int kSlotState0Scales = 1;  // its scales (quantized)
constexpr int kSlotState1 = 2;
constexpr int kSlotState1Scales = 3;
constexpr int kSlotRow = 4;           // factored second moment: row statistics, shape[:-1]
constexpr int kSlotCol = 5;           // column statistics, shape[:-2] + shape[-1:]
constexpr int kSlotComp = 6;          // the Kahan buffer: values in the parameter's dtype, or codes
constexpr int kSlotCompScales = 7;
constexpr int kSlotLen = 8;

// The meta column block and the state slots of state k (0 or 1).
constexpr int meta_state(int k) { return k == 0 ? kMetaState0 : kMetaState1; }
constexpr int slot_state(int k) { return k == 0 ? kSlotState0 : kSlotState1; }
constexpr int slot_scales(int k) { return k == 0 ? kSlotState0Scales : kSlotState1Scales; }

// ---------------------------------------------------------------------------------------------
// enumerations
// kParamDtype: stored as 16-bit values in the parameter's dtype (the Kahan buffer by default)
enum StateKind : int32_t { kNone = 0, kFp32 = 1, kQuant = 2, kParamDtype = 3 };
// How a quantized state's elements map to stored scales (after the rank fallbacks):
//   kBlock: contiguous blocks of `block` elements (group, dim0 = rows, tensor = one block)
//   kDim1:  element i uses scale ((i / inner) % d1)
//   kRank1: element uses min over dims of that dim's vector (concatenated, sum(shape) values)
enum ScaleKind : int32_t { kBlock = 0, kDim1 = 1, kRank1 = 2 };
// the dtype of a parameter, gradient or 16-bit state
enum DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };
// the update rule of a call (AdamRule, SgdRule, LionRule, MuonMomentumRule, MuonUpdateRule in
// element.h); Muon's step is two calls around Newton-Schulz (qconf/optim/muon.py)
enum RuleId : int32_t { kRuleAdam = 0, kRuleSgd = 1, kRuleLion = 2, kRuleMuonMomentum = 3, kRuleMuonUpdate = 4 };
constexpr int32_t kRuleLast = kRuleMuonUpdate;

// ---------------------------------------------------------------------------------------------
// codec tables: float32 [N, kTableRows, kTableSize], one [kTableRows, kTableSize] table per codec
constexpr int kTableSize = 256;
constexpr int kTableRows = 12;
// rows
constexpr int kRowQmap = 0;         // the map, padded with its last value
constexpr int kRowMids = 1;         // the levels-1 midpoints, then +inf
constexpr int kRowQsearch = 2;      // the map, then +inf
constexpr int kRowCoarse16 = 3;     // see kCoarse16*
constexpr int kRowCoarse32 = 4;     // see kCoarse32*
constexpr int kRowColsMids = 5;     // 7 x 32: [j*32 + k] = mids[8k + j]
constexpr int kRowColsQsearch = 6;  // 7 x 32: [j*32 + k] = qsearch[8k + j]
constexpr int kRowLines = 7;        // octave lines (8-bit maps), see kLines*
constexpr int kRowQmapWords = 8;    // kRowQmap as 16-bit planes [low 256 | high 256]
constexpr int kRowMidsWords = 9;    // kRowMids as 16-bit planes
constexpr int kRowQmapBytes = 10;   // kRowQmap as byte planes [byte 0 of 256 | byte 1 | 2 | 3]
constexpr int kRowMidsBytes = 11;   // kRowMids as byte planes
// inside kRowCoarse16: mids[16k + 15], qsearch[16k + 15] (16 each: the first 4 search levels);
// the midpoint grid (L, c); from kCoarse16Shifted the 16-entry search tables shifted by 3 and by 1
// (t[min(j + s, 15)], 32 entries per table): mids[:16], qsearch[:16], the coarse mids, qsearch
constexpr int kCoarse16Mids = 0;
constexpr int kCoarse16Qsearch = 16;
constexpr int kCoarse16Grid = 32;
constexpr int kGridL = 0;  // the grid (L, c): midpoints (k + c) / L, or L = 0 (no grid)
constexpr int kGridC = 1;
constexpr int kCoarse16Shifted = 64;
constexpr int kShifted16Len = 32;  // one table shifted by 3, then by 1
// inside kRowCoarse32: mids[8k + 7], qsearch[8k + 7] (32 each), then from kCoarse32Shifted both
// shifted by 7, 3 and 1 (t[min(j + s, 31)], 96 entries per table)
constexpr int kCoarse32Mids = 0;
constexpr int kCoarse32Qsearch = 32;
constexpr int kCoarse32Shifted = 64;
constexpr int kShifted32Len = 96;  // one table shifted by 7, 3, then 1
// inside kRowLines: per octave of |n| slopes S1, offsets A1, S2, A2 (32 entries each), the
// mirror K of signed maps, and the form: 0 none (search), 1 unsigned, 2 signed
constexpr int kLinesSlope1 = 0;
constexpr int kLinesOffset1 = 32;
constexpr int kLinesSlope2 = 64;
constexpr int kLinesOffset2 = 96;
constexpr int kLinesMirror = 160;
constexpr int kLinesForm = 161;
// also inside kRowLines, for 8-bit maps whose positive midpoints lie on at most 8 lines
// (qconf/codec/segment_lines.py, which has the same offsets): the bounds B[1..7] (+inf padded, 9
// entries), per segment the slope, offset, cap and junction point (8 each), the probe window
// eps, and 1.0 when present (the AVX2 kernels' 8-bit nearest rounding, quantizer.h)
constexpr int kSegBounds = 162;
constexpr int kSegSlope = 171;
constexpr int kSegOffset = 179;
constexpr int kSegCap = 187;
constexpr int kSegTop = 195;
constexpr int kSegEps = 203;
constexpr int kSegPresent = 204;
// also inside kRowLines, for 8-bit maps whose values lie on at most 8 lines over power-of-two runs
// of codes (qconf/codec/value_lines.py, which has the same offsets): the code shift s and centre
// C, per run the slope, offset and bias B (floats), 16 correction words (raw uint32 bits), and
// 1.0 when present (the AVX2 kernels' 8-bit decode, tile_codec.h decode8)
constexpr int kValShift = 205;
constexpr int kValCenter = 206;
constexpr int kValSlope = 207;
constexpr int kValOffset = 215;
constexpr int kValBias = 223;
constexpr int kValWords = 231;
constexpr int kValPresent = 247;

// ---------------------------------------------------------------------------------------------
// what torch.ops.qconf.layout() returns (host code only: not in the run-time compiled kernels)
#if !defined(__CUDACC_RTC__)
struct LayoutEntry {
  const char* name;
  int64_t value;
};

constexpr LayoutEntry kLayout[] = {
    {"hyper.lr", kHyperLr},
    {"hyper.beta1", kHyperBeta1},
    {"hyper.beta2", kHyperBeta2},
    {"hyper.eps", kHyperEps},
    {"hyper.weight_decay", kHyperWeightDecay},
    {"hyper.momentum", kHyperMomentum},
    {"hyper.dampening", kHyperDampening},
    {"hyper.maximize", kHyperMaximize},
    {"hyper.nesterov", kHyperNesterov},
    {"hyper.decoupled", kHyperDecoupled},
    {"hyper.adjusted_lr", kHyperAdjustedLr},
    {"hyper.len", kHyperLen},
    {"meta.index", kMetaIndex},
    {"meta.first", kMetaFirst},
    {"meta.factored", kMetaFactored},
    {"meta.ndim", kMetaNdim},
    {"meta.shape", kMetaShape},
    {"meta.state0", kMetaState0},
    {"meta.state1", kMetaState1},
    {"meta.weights", kMetaWeights},
    {"meta.comp", kMetaComp},
    {"meta.rng_offset", kMetaRngOffset},
    {"meta.cols", kMetaCols},
    {"state.kind", kStateColKind},
    {"state.table", kStateColTable},
    {"state.codec", kStateColCodec},
    {"state.cols", kStateCols},
    {"codec.bits", kCodecBits},
    {"codec.levels", kCodecLevels},
    {"codec.scale_kind", kCodecScaleKind},
    {"codec.block", kCodecBlock},
    {"codec.d1", kCodecD1},
    {"codec.inner", kCodecInner},
    {"codec.stochastic", kCodecStochastic},
    {"codec.len", kCodecLen},
    {"encode.num_scales", kEncodeNumScales},
    {"encode.len", kEncodeLen},
    {"slot.state0", kSlotState0},
    {"slot.state0_scales", kSlotState0Scales},
    {"slot.state1", kSlotState1},
    {"slot.state1_scales", kSlotState1Scales},
    {"slot.row", kSlotRow},
    {"slot.col", kSlotCol},
    {"slot.comp", kSlotComp},
    {"slot.comp_scales", kSlotCompScales},
    {"slot.len", kSlotLen},
    {"kind.none", kNone},
    {"kind.fp32", kFp32},
    {"kind.quant", kQuant},
    {"kind.param_dtype", kParamDtype},
    {"scale.block", kBlock},
    {"scale.dim1", kDim1},
    {"scale.rank1", kRank1},
    {"rule.adam", kRuleAdam},
    {"rule.sgd", kRuleSgd},
    {"rule.lion", kRuleLion},
    {"rule.muon_momentum", kRuleMuonMomentum},
    {"rule.muon_update", kRuleMuonUpdate},
    {"weights.stochastic", kWeightsStochastic},
    {"weights.kahan", kWeightsKahan},
    {"lines.seg_bounds", kSegBounds},
    {"lines.seg_slope", kSegSlope},
    {"lines.seg_offset", kSegOffset},
    {"lines.seg_cap", kSegCap},
    {"lines.seg_top", kSegTop},
    {"lines.seg_eps", kSegEps},
    {"lines.seg_present", kSegPresent},
    {"lines.val_shift", kValShift},
    {"lines.val_center", kValCenter},
    {"lines.val_slope", kValSlope},
    {"lines.val_offset", kValOffset},
    {"lines.val_bias", kValBias},
    {"lines.val_words", kValWords},
    {"lines.val_present", kValPresent},
    {"table.rows", kTableRows},
    {"table.size", kTableSize},
    {"max_dims", kMaxDims},
};
#endif

}  // namespace qconf
