// Which specialized CUDA kernel (spec.h) a tensor takes: its spec as plain data (SpecKey), the
// spec's name and its C++ type, and why a tensor is outside every spec (then the generic kernel
// of csrc/cuda/step.cu runs it). Host code without CUDA headers: the CUDA driver, the tools'
// ops (torch.ops.qconf.cuda_specs, cuda_spec_source) and the host tests all call it.
//
// A name spells the spec in six fields joined by '-':
//   rule[.flags]-pdtype.gdtype-weights-state0-state1-comp
//   rule:    adam | sgd | lion | muon_momentum | muon_update; flags: m (maximize), w (weight
//            decay), d (decoupled), p (momentum), n (Nesterov), in this order
//   dtypes:  f32 | bf16 | f16
//   weights: plain | sr | kahan | sr+kahan | sr.each (bf16 SR with a hash per element, not per
//            pair: spec.h kWeightsEachElement)
//   state:   none | fp32 | half (the Kahan buffer in the parameter's dtype) |
//            q<bits>.<scale>.<search>: scale g<group> | r1; search: search | grid | lines_u |
//            lines_s (nearest rounding) or sr (stochastic rounding)
// e.g. "adam.wd-f32.f32-plain-q4.g128.search-q4.r1.grid-none" (AdamW, configs/default.yml).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "qconf/layout.h"
#include "qconf/spec.h"
#include "qconf/step_types.h"

namespace qconf {
namespace spec {

struct StateKey {
  int32_t kind = kNone, bits = 0, scale = kBlock, group = 0, near = kNearSearch, sr = 0;
  bool operator==(const StateKey& o) const {
    return kind == o.kind && bits == o.bits && scale == o.scale && group == o.group && near == o.near && sr == o.sr;
  }
};

struct SpecKey {
  int32_t rule = kRuleAdam, flags = 0, pdtype = kF32, gdtype = kF32, weights = 0;
  StateKey st[3];
  bool operator==(const SpecKey& o) const {
    return rule == o.rule && flags == o.flags && pdtype == o.pdtype && gdtype == o.gdtype && weights == o.weights &&
           st[0] == o.st[0] && st[1] == o.st[1] && st[2] == o.st[2];
  }
  bool operator!=(const SpecKey& o) const { return !(*this == o); }
};

// The key of a Spec type (the ahead-of-time kernels are listed by type).
template <class St>
StateKey state_key_of() {
  return StateKey{St::kKind, St::kBits, St::kScale, St::kGroup, St::kNearKind, St::kStochastic ? 1 : 0};
}

template <class S>
SpecKey key_of() {
  SpecKey k;
  k.rule = S::kRule;
  k.flags = S::kFlags;
  k.pdtype = S::kPDtype;
  k.gdtype = S::kGDtype;
  k.weights = S::kWeights;
  k.st[0] = state_key_of<typename S::St0>();
  k.st[1] = state_key_of<typename S::St1>();
  k.st[2] = state_key_of<typename S::Comp>();
  return k;
}

// ---------------------------------------------------------------------------------------------
// from a tensor's description

inline bool power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// A strip `width` columns wide (a multiple of kElems) runs tpr = width / kElems threads per row:
// the row exchanges need a power of two up to a warp, or whole warps.
inline bool strip_ok(int64_t width) {
  const int64_t tpr = width / kElems;
  return width % kElems == 0 && ((tpr <= kWarp && power_of_two(tpr)) || tpr % kWarp == 0);
}

// The codec of a quantized state as a StateKey, or a reason it has none. `cols`: the tile's row
// length (rank-1 tensors: shape[1]; otherwise kStrip), which single-pass groups must divide.
inline std::string state_key(const StateDesc& st, int64_t cols, StateKey& k) {
  k = StateKey{};
  k.kind = st.kind;
  if (st.kind != kQuant) return "";
  const CodecDesc& c = st.codec;
  k.bits = c.bits;
  k.sr = c.stochastic != 0;
  k.near = k.sr ? kNearSearch
                : (c.grid[kGridL] != 0.0f ? kNearGrid
                                          : (c.lines[kLinesForm] == 1.0f ? kNearLinesUnsigned
                                                                         : (c.lines[kLinesForm] == 2.0f ? kNearLinesSigned
                                                                                                        : kNearSearch)));
  if (c.scale_kind == kRank1) {
    k.scale = kRank1;
    return "";
  }
  if (c.scale_kind != kBlock) return "dim1 scales";
  if (!(power_of_two(c.block) && c.block >= kElems && c.block <= kStrip))
    return "blocks of " + std::to_string(c.block) + " (powers of two from 8 to 2048 are specialized)";
  if (cols % c.block != 0) return "blocks of " + std::to_string(c.block) + " across rows of " + std::to_string(cols);
  k.scale = kBlock;
  k.group = static_cast<int32_t>(c.block);
  return "";
}

// The tile's row length of tensor t (rank-1 states need the 2-D shape's rows; the others rows of
// kStrip), or -1 with a reason.
inline int64_t tile_cols(const TensorDesc& t, std::string& why) {
  const bool rank1 = (t.st[0].kind == kQuant && t.st[0].codec.scale_kind == kRank1) ||
                     (t.st[1].kind == kQuant && t.st[1].codec.scale_kind == kRank1);
  if (!rank1) return kStrip;
  const int64_t cols = t.shape[1];
  if (t.ndim != 2) why = "a rank-1 scale on " + std::to_string(t.ndim) + "-D parameter";
  else if (cols % kStrip != 0 && !strip_ok(cols % kStrip))
    why = "a rank-1 scale on rows of " + std::to_string(cols) + " elements";
  else if (cols >= (int64_t{1} << 30)) why = "rows of 2^30 elements or more";
  return why.empty() ? cols : -1;
}

// Whether t's bf16 stochastic-rounding bits can be drawn one hash per pair of elements
// (spec_octet.h PairStream): its stream starts on an even element and its pair indexes lie in one
// 2^32 window.
inline bool pairs_aligned(const TensorDesc& t) {
  const uint64_t first = t.pkey.offset, last = first + static_cast<uint64_t>(t.numel) - 1;
  return first % 2 == 0 && (first >> 33) == (last >> 33);
}

// t's SpecKey under `rule`, or the reason the generic kernel runs it. Addresses are checked per
// call by the driver (spec_plan.h: aligned16).
inline std::string spec_key(int32_t rule, const TensorDesc& t, SpecKey& key) {
  key = SpecKey{};
  if (t.numel == 0) return "an empty tensor";
  if (t.factored) return "a factored second moment";
  std::string why;
  const int64_t cols = tile_cols(t, why);
  if (cols < 0) return why;
  key.rule = rule;
  key.flags = rule_flags(t.h);
  key.pdtype = t.pdtype;
  key.gdtype = t.gdtype;
  key.weights = (t.w_stochastic ? kWeightsStochastic : 0) | (t.w_kahan ? kWeightsKahan : 0);
  if (key.pdtype == kBF16 && key.weights == kWeightsStochastic && !pairs_aligned(t)) key.weights |= kWeightsEachElement;
  for (int k = 0; k < 2; ++k) {
    why = state_key(t.st[k], cols, key.st[k]);
    if (!why.empty()) return (k == 0 ? "exp_avg: " : "exp_avg_sq: ") + why;
  }
  why = state_key(t.comp, cols, key.st[2]);
  if (!why.empty()) return "the Kahan buffer: " + why;
  return "";
}

// ---------------------------------------------------------------------------------------------
// names

constexpr const char* kRuleWords[] = {"adam", "sgd", "lion", "muon_momentum", "muon_update"};  // by RuleId
inline const char* rule_word(int32_t rule) { return kRuleWords[rule]; }
inline const char* dtype_word(int32_t d) { return d == kBF16 ? "bf16" : d == kF16 ? "f16" : "f32"; }
inline const char* near_word(int32_t n) {
  return n == kNearGrid ? "grid" : n == kNearLinesUnsigned ? "lines_u" : n == kNearLinesSigned ? "lines_s" : "search";
}

inline const char* weights_word(int32_t w) {
  static const char* const kWords[] = {"plain", "sr", "kahan", "sr+kahan"};
  return w == (kWeightsStochastic | kWeightsEachElement) ? "sr.each" : kWords[w & 3];
}

inline std::string state_name(const StateKey& k) {
  if (k.kind == kNone) return "none";
  if (k.kind == kFp32) return "fp32";
  if (k.kind == kParamDtype) return "half";
  std::string s = "q" + std::to_string(k.bits) + "." + (k.scale == kRank1 ? "r1" : "g" + std::to_string(k.group));
  return s + "." + (k.sr ? "sr" : near_word(k.near));
}

inline std::string spec_name(const SpecKey& k) {
  static const char kFlagLetters[] = {'m', 'w', 'd', 'p', 'n'};  // kFlagMaximize ... kFlagNesterov
  std::string rule = rule_word(k.rule);
  if (k.flags != 0) {
    rule += ".";
    for (int b = 0; b < 5; ++b)
      if (k.flags & (1 << b)) rule += kFlagLetters[b];
  }
  return rule + "-" + dtype_word(k.pdtype) + "." + dtype_word(k.gdtype) + "-" + weights_word(k.weights) + "-" +
         state_name(k.st[0]) + "-" + state_name(k.st[1]) + "-" + state_name(k.st[2]);
}

// The C++ type of the spec (the template arguments of spec.h's Spec and State).
inline std::string state_type(const StateKey& k) {
  return "qconf::spec::State<" + std::to_string(k.kind) + ", " + std::to_string(k.bits) + ", " + std::to_string(k.scale) +
         ", " + std::to_string(k.group) + ", " + std::to_string(k.near) + ", " + std::to_string(k.sr) + ">";
}

inline std::string spec_type(const SpecKey& k) {
  return "qconf::spec::Spec<" + std::to_string(k.rule) + ", " + std::to_string(k.flags) + ", " + std::to_string(k.pdtype) +
         ", " + std::to_string(k.gdtype) + ", " + std::to_string(k.weights) + ", " + state_type(k.st[0]) + ", " +
         state_type(k.st[1]) + ", " + state_type(k.st[2]) + ">";
}

// ---------------------------------------------------------------------------------------------
// parsing a name back (the tools name specs; the parse is checked against spec_name)

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep) out.emplace_back();
    else out.back() += c;
  }
  return out;
}

inline int32_t word_index(const std::string& w, std::initializer_list<const char*> words) {
  int32_t i = 0;
  for (const char* x : words) {
    if (w == x) return i;
    ++i;
  }
  return -1;
}

inline bool parse_state(const std::string& s, StateKey& k) {
  k = StateKey{};
  if (s == "none" || s == "fp32" || s == "half") {
    k.kind = s == "none" ? kNone : s == "fp32" ? kFp32 : kParamDtype;
    return true;
  }
  const std::vector<std::string> f = split(s, '.');
  if (f.size() != 3 || f[0].size() < 2 || f[0][0] != 'q') return false;
  k.kind = kQuant;
  k.bits = std::atoi(f[0].c_str() + 1);
  if (f[1] == "r1") k.scale = kRank1;
  else if (f[1].size() > 1 && f[1][0] == 'g') k.group = std::atoi(f[1].c_str() + 1);
  else return false;
  if (f[2] == "sr") k.sr = 1;
  else if ((k.near = word_index(f[2], {"search", "grid", "lines_u", "lines_s"})) < 0) return false;
  return true;
}

// The key of a spec name, or false if `name` is not one (a round trip through spec_name must give
// the name back, so every accepted name is canonical).
inline bool parse_spec(const std::string& name, SpecKey& k) {
  const std::vector<std::string> f = split(name, '-');
  if (f.size() != 6) return false;
  const std::vector<std::string> rule = split(f[0], '.');
  k.rule = word_index(rule[0], {kRuleWords[0], kRuleWords[1], kRuleWords[2], kRuleWords[3], kRuleWords[4]});
  if (rule.size() > 2 || k.rule < 0) return false;
  k.flags = 0;
  if (rule.size() == 2)
    for (char c : rule[1]) {
      static const char kLetters[] = "mwdpn";
      const char* at = std::strchr(kLetters, c);
      if (at == nullptr || *at == '\0') return false;
      k.flags |= 1 << (at - kLetters);
    }
  const std::vector<std::string> dt = split(f[1], '.');
  if (dt.size() != 2 || (k.pdtype = word_index(dt[0], {"f32", "bf16", "f16"})) < 0 ||
      (k.gdtype = word_index(dt[1], {"f32", "bf16", "f16"})) < 0)
    return false;
  k.weights = f[2] == "sr.each" ? kWeightsStochastic | kWeightsEachElement
                                : word_index(f[2], {"plain", "sr", "kahan", "sr+kahan"});
  if (k.weights < 0) return false;
  for (int i = 0; i < 3; ++i)
    if (!parse_state(f[3 + i], k.st[i])) return false;
  return spec_name(k) == name;
}

// Whether a parsed key is a spec the template accepts (its static_asserts), as a reason.
inline std::string spec_invalid(const SpecKey& k) {
  const int states = k.rule == kRuleAdam ? 2 : 1;
  if (states == 1 && k.st[1].kind != kNone) return "a one-state rule with exp_avg_sq";
  if (((k.weights & kWeightsKahan) != 0) != (k.st[2].kind != kNone)) return "a Kahan buffer without Kahan weights";
  if (k.pdtype == kF32 && k.weights != 0) return "float32 parameters with low-precision weights";
  if ((k.weights & kWeightsEachElement) != 0 && k.pdtype != kBF16)
    return "random bits per element (sr.each) without bf16 parameters";
  for (const StateKey& s : k.st) {
    if (s.kind != kQuant) continue;
    if (s.bits < 1 || s.bits > 8) return "codes of " + std::to_string(s.bits) + " bits";
    if (s.scale == kBlock && !(power_of_two(s.group) && s.group >= kElems && s.group <= kStrip))
      return "groups of " + std::to_string(s.group);
  }
  if (k.st[2].kind == kQuant && k.st[2].scale != kBlock) return "a rank-1 Kahan buffer";
  return "";
}

}  // namespace spec
}  // namespace qconf
