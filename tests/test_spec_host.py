"""The specialized CUDA step (csrc/include/qconf/spec*.h) run on the host, bit for bit against the CPU kernel.

No GPU here, so the specialized kernels' per-thread code -- everything a GPU thread computes
(spec_octet.h: loads, dequantization, the rule, the weights policy, group maxima of its octet,
scales, codes, stores) -- is compiled for the host and run by spec_emulate.h, a model of the
kernels' blocks: each of a block's 256 threads in turn, with the exchanges between threads done
as the device does them (a group's maximum over its aligned threads before any stores; rank-1
row and column maxima; the finalize and copy kernels; the driver's order of launches). The plans
are the CUDA driver's own (spec_plan.h: launches, units, scratch). Every optimizer step of every
case below runs the specialized tensors through that model and the rest through the CPU kernel
(as the CUDA driver hands them to the generic kernel), and must equal the CPU fused step exactly:
parameters, codes, scales and fp32 states. A GPU run can then only find what the model does not
share with the kernels: the shuffles, atomics and barriers themselves.

Muon's two calls per matrix (rules muon_momentum: a bf16 scratch "parameter", the gradient in the
parameter's dtype; muon_update: the orthogonalized bf16 matrix as the "gradient", the weights
policy) go through qconf.optim.fused.run_one; the MUON_CASES redirect its op call to the model.

The emulator extension instantiates every spec the cases produce (named by
torch.ops.qconf.cuda_specs, typed by cuda_spec_source), compiled once per session.
"""
from __future__ import annotations

import contextlib
import re
import types

import pytest
import torch

from qconf import _native
from qconf.codec import QTensor
from qconf.optim import SGD, Adam, AdamW, Lion, Muon
from qconf.optim import fused
from qconf.optim.fused import _signed64

from helpers import CONFIGS, ROOT, host_extension, host_extension_job, module_literal, prebuilt_extension

if not _native.fused_available():  # pragma: no cover - the CI build always has the extension
    pytest.skip(f"fused kernels unavailable: {_native.native_error()}", allow_module_level=True)


def _state(bits=4, map="nonlinear", signed=True, scale="group", group_size=128, rounding="nearest"):
    return {"enable": True, "bits": bits, "map": map, "signed": signed, "scale": scale, "group_size": group_size,
            "rounding": rounding}


# Beyond the shipped configs: stochastic rounding, the other scale kinds (dim0 rows are groups of
# the row length; tensor and dim1 scales take the generic kernel), every code width, small groups
EXTRA = {
    "stochastic": {"min_numel": 64, "states": {
        "exp_avg": _state(rounding="stochastic", group_size=64),
        "exp_avg_sq": _state(map="power-1", signed=False, scale="rank1", rounding="stochastic")}},
    "tensor_dim0": {"min_numel": 64, "states": {
        "exp_avg": _state(bits=3, scale="tensor"),
        "exp_avg_sq": _state(bits=5, map="power-2", signed=False, scale="dim0")}},
    "dim1_widths": {"min_numel": 64, "states": {
        "exp_avg": _state(bits=7, scale="dim1", rounding="stochastic"),
        "exp_avg_sq": _state(bits=6, map="power-1", signed=False, group_size=512)}},
    "narrow": {"min_numel": 0, "states": {
        "exp_avg": _state(bits=2, map="linear", signed=False, group_size=8),
        "exp_avg_sq": _state(bits=1, map="power-1", signed=False, group_size=2048)}},
    "odd_widths": {"min_numel": 64, "states": {  # 3-bit octets straddle 4-byte words, 7-bit ones two
        "exp_avg": _state(bits=3, group_size=32),
        "exp_avg_sq": _state(bits=7, map="power-2", signed=False, group_size=64)}},
    "wide_sr8": {"min_numel": 64, "states": {
        "exp_avg": _state(bits=8, rounding="stochastic", group_size=1024),
        "exp_avg_sq": _state(bits=8, map="power-2", signed=False, group_size=32)}},
}

# rank-1 rows of one strip and of several (two of 2048 columns and one of 768), a partial last
# octet, rows of 16 threads, a 1-D tensor, one too small to quantize, and rows of 640 columns (80
# threads: rank-1 states there take the generic kernel)
SHAPES = [(96, 256), (8, 4864), (4099,), (33, 128), (4, 4096), (7,), (10, 640)]

OPTIMIZERS = {
    "adamw": lambda ps, cfg: AdamW(ps, lr=3e-3, weight_decay=0.05, qconfig=cfg, fused=True, seed=3),
    "adam": lambda ps, cfg: Adam(ps, lr=2e-3, weight_decay=0.01, qconfig=cfg, fused=True, seed=3),
    "sgd": lambda ps, cfg: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, qconfig=cfg, fused=True,
                               seed=3),
    "lion": lambda ps, cfg: Lion(ps, lr=1e-3, weight_decay=0.1, qconfig=cfg, fused=True, seed=3),
    "adamw_max": lambda ps, cfg: AdamW(ps, lr=3e-3, weight_decay=0.0, maximize=True, qconfig=cfg, fused=True, seed=3),
}

SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yml") if "bitnet" not in p.name)
WEIGHTS = {"sr": {"rounding": "stochastic"}, "kahan": {"compensation": "kahan"},
           "sr_kahan": {"rounding": "stochastic", "compensation": "kahan"},
           "kahan_q8": {"compensation": "kahan", "compensation_codec": {"bits": 8, "group_size": 128}},
           "sr_kahan_q4": {"rounding": "stochastic", "compensation": "kahan",
                           "compensation_codec": {"bits": 4, "group_size": 64, "rounding": "stochastic"}}}

# (config, optimizer, dtype)
CASES = ([(c, o, torch.float32) for c in SHIPPED + sorted(EXTRA) for o in ("adamw", "sgd", "lion")]
         + [(c, "adam", torch.float32) for c in ("default.yml", "8bit.yml", "stochastic")]
         + [(c, "adamw_max", torch.float32) for c in ("default.yml", "2nd_moment_group_128.yml")]
         + [(c, o, torch.bfloat16) for c in ("default.yml", "2nd_moment_group_128.yml", "8bit.yml", "fp32.yml",
                                             "stochastic") for o in ("adamw", "sgd")]
         + [(f"weights_{w}", o, d) for w in sorted(WEIGHTS) for o in ("adamw", "lion")
            for d in (torch.bfloat16, torch.float16)]
         + [("weights_sr", "sgd", torch.bfloat16)])
STEPS = 4

# Muon (qconf.optim.Muon): matrices only -- rank-1 rows of one strip and of several, rows of 16
# and 8 threads, a tall one (Newton-Schulz transposes it; the kernels do not), rows of 640 columns
# (a rank-1 momentum there takes the generic kernel)
MUON_SHAPES = [(96, 256), (8, 4864), (33, 128), (4, 4096), (200, 64), (10, 640)]
MUON_EXTRA = {
    "muon_rank1_sr": {"min_numel": 64, "states": {"exp_avg": _state(bits=8, map="linear", scale="rank1",
                                                                     rounding="stochastic")}},
    "muon_g32_sr": {"min_numel": 0, "states": {"exp_avg": _state(bits=4, group_size=32, rounding="stochastic")}},
}
MUON_OPTIMIZERS = {  # (torch.lerp's two forms: |w| < 0.5 or not, for the buffer's 1 - momentum and Nesterov's momentum)
    "nesterov": dict(lr=0.02, weight_decay=0.1),
    "heavy_ball": dict(lr=0.02, weight_decay=0.1, nesterov=False, adjust_lr_fn="match_rms_adamw"),
    "m03": dict(lr=0.01, weight_decay=0.0, momentum=0.3, adjust_lr_fn="original"),
}
# (config, Muon variant, dtype): the momentum call with fp32 / bf16 / fp16 gradients into the bf16
# scratch, the update call with fp32 / bf16 / fp16 parameters under every weights policy
MUON_CASES = [("default.yml", "nesterov", torch.float32), ("muon_8bit.yml", "nesterov", torch.bfloat16),
              ("fp32.yml", "heavy_ball", torch.float32), ("muon_rank1_sr", "m03", torch.float32),
              ("muon_rank1_sr", "nesterov", torch.bfloat16), ("muon_g32_sr", "heavy_ball", torch.float16),
              ("weights_sr", "nesterov", torch.bfloat16), ("weights_kahan", "m03", torch.bfloat16),
              ("weights_sr_kahan_q4", "nesterov", torch.bfloat16), ("weights_kahan_q8", "heavy_ball", torch.float16)]
MUON_SPECIAL_CASES = [("default.yml", "nesterov", torch.float32), ("weights_sr", "nesterov", torch.bfloat16),
                      ("weights_kahan", "m03", torch.bfloat16)]  # (cases of MUON_CASES: the emulator has their specs)


def _config(name):
    if name.endswith(".yml"):
        return CONFIGS / name
    if name.startswith("weights_"):
        return {"base": str(CONFIGS / "default.yml"), "min_numel": 100, "weights": WEIGHTS[name[len("weights_"):]]}
    return EXTRA[name] if name in EXTRA else MUON_EXTRA[name]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in SHAPES]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 10.0 ** (step % 3 - 2)).to(dtype) for s in SHAPES]


def _group_call(opt, group):
    """The fused op's arguments of ``group`` at this step, as the eager step would build them."""
    source = opt._plan_source(group)
    if source is None:
        return None
    plan = opt._kernel._eager_plan(id(group), *source)
    hyper = opt._kernel.hyper_values(opt._hyper(group))
    return plan, [p.grad for p in plan.params], hyper, _signed64(opt._seed)


def _emulate(emu, rule, params, grads, steps, states, meta, tables, hyper, seed):
    """One fused call through the emulated specialized kernels; the tensors they leave to the
    generic kernel go through the CPU kernel (as the CUDA driver hands them to the generic one)."""
    generic = emu.step(rule, params, grads, steps, states, meta, tables, hyper, seed)
    if generic:
        slot = _native.layout()["slot.len"]
        torch.ops.qconf.fused_step(rule, [params[i] for i in generic], [grads[i] for i in generic],
                                   [steps[i] for i in generic],
                                   [s for i in generic for s in states[i * slot:(i + 1) * slot]],
                                   meta[generic].contiguous(), tables, hyper, seed)


def _spec_names(opt):
    names = []
    for group in opt.param_groups:
        call = _group_call(opt, group)
        if call is not None:
            plan, grads, hyper, seed = call
            names += torch.ops.qconf.cuda_specs(plan.rule, plan.params, grads, plan.steps, plan.states, plan.meta,
                                                plan.tables, hyper, seed)
    return names


# Values that take the kernels' rare paths, a parameter and the gradient it sees at step 1 at the
# same element: NaN (two payloads), infinities, the largest bf16 pushed past it (stochastic rounding
# saturates there), beyond the fp16 range, subnormals, -0
SPECIAL_PARAMS = [float("nan"), -float("nan"), float("inf"), -float("inf"), 3.3895313892515355e38, -3.0e38, 7.0e4,
                  1e-40, -0.0]
SPECIAL_GRADS = [1.0, float("nan"), float("inf"), -float("inf"), -3.0e38, 1e30, -1e-42, 3.0e38, 0.0]


def _poison(tensors, values, stride):
    """Writes `values` into every tensor at elements 1, 1 + stride, ... (as far as it reaches)."""
    with torch.no_grad():
        for t in tensors:
            flat = t.view(-1)
            for k, v in enumerate(values):
                if 1 + k * stride < flat.numel():
                    flat[1 + k * stride] = v


def _run(case, emu=None, steps=STEPS, special=False):
    """STEPS steps of the case: the CPU fused step, or (emu) the emulated specialized step;
    special: with the SPECIAL values in the parameters, and in the gradients of step 1."""
    config, opt_name, dtype = case
    params = _params(dtype)
    if special:
        _poison(params, SPECIAL_PARAMS, 37)
    opt = OPTIMIZERS[opt_name](params, _config(config))
    if emu is not None:
        opt._fused_step = lambda group: _emulated_step(emu, opt, group)
    _steps(opt, params, steps, lambda step: _grads(step, dtype), special)
    return params, opt


def _steps(opt, params, steps, grads_of, special):
    """``steps`` optimizer steps on the gradients ``grads_of(step)`` (a list, one per parameter);
    special: with the SPECIAL values in those of step 1."""
    for step in range(steps):
        grads = grads_of(step)
        if special and step == 1:
            _poison(grads, SPECIAL_GRADS, 37)
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()


def _case_id(case):
    """A case's test id: config-optimizer-dtype."""
    return f"{case[0]}-{case[1]}-{str(case[2])[6:]}"


def _emulated_step(emu, opt, group):
    call = _group_call(opt, group)
    if call is None:
        return
    plan, grads, hyper, seed = call
    _emulate(emu, plan.rule, plan.params, grads, plan.steps, plan.states, plan.meta, plan.tables, hyper, seed)


def _state_tensors(opt):
    out = {}
    for i, (_, p, _) in enumerate(opt._named_params()):
        for k, v in opt.state[p].items():
            if isinstance(v, QTensor):
                out[(i, k, "codes")] = v.codes
                out[(i, k, "scales")] = v.scales
            elif isinstance(v, torch.Tensor):
                out[(i, k)] = v
    return out


def _spec_type(name: str) -> str:
    text = torch.ops.qconf.cuda_spec_source(name)
    return re.search(r"using QconfSpec = (.*);", text).group(1)


def _names_of_cases():
    names = set()
    for case in CASES:
        _, opt = _run(case, steps=1)
        names.update(n for n in _spec_names(opt) if not n.startswith("generic"))
    for case in MUON_CASES:
        calls = []
        _run_muon(case, steps=1, calls=calls)
        names.update(n for _, n in calls if not n.startswith("generic"))
    # bf16 stochastic rounding with a hash per element (shards at odd offsets, PAIR_OFFSETS)
    names.update(n.replace("-sr-", "-sr.each-") for n in list(names) if "bf16.bf16-sr-" in n)
    return sorted(names)


EMULATOR = r"""
#include <map>
#include <stdexcept>
#include <string>
#include <vector>
#include "qconf/spec_emulate.h"
#include "qconf/spec_aot.h"
#include "qconf/step_host.h"

using namespace qconf;
namespace sp = qconf::spec;

template <class S>
static sp::emulate::Kernels kernels_of() { return {&sp::emulate::reduce<S>, &sp::emulate::apply<S>}; }

static const std::map<std::string, sp::emulate::Kernels>& table() {
  static const std::map<std::string, sp::emulate::Kernels> t = {
@ENTRIES@
  };
  return t;
}

// One step of the specialized tensors of a call through the emulated kernels; returns the indices
// the generic kernel takes (their steps are not advanced here).
std::vector<int64_t> step(int64_t rule, std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                          std::vector<at::Tensor> steps, std::vector<at::Tensor> states, at::Tensor meta,
                          at::Tensor tables, std::vector<double> hyper, int64_t seed) {
  host::check_call(rule, params, grads, steps, states, meta, tables, hyper);
  if (params.empty()) return {};
  host::CallDescs call;
  const float* tab = tables.data_ptr<float>();
  host::describe_tensors(rule, params, grads, steps, states, meta, tab, tables.size(0), hyper, seed,
                         at::Device(at::kCPU), "CUDA", call, /*advance_steps=*/false);
  sp::SpecPlan plan = sp::plan_specs(static_cast<int32_t>(rule), call.descs, tab, tab, int64_t{1} << 20);
  TORCH_CHECK(sp::refresh_plan(plan, call.descs, static_cast<uint64_t>(seed)), "refresh_plan refused a fresh plan");
  std::vector<float> scratch(std::max<int64_t>(plan.scratch_floats(), 1));
  sp::assign_scratch(plan, scratch.data());
  sp::emulate::run_plan(plan, scratch.data(), [](const std::string& name) {
    const auto it = table().find(name);
    if (it == table().end()) throw std::runtime_error("spec not instantiated in the test: " + name);
    return it->second;
  });
  for (const sp::Launch& L : plan.launches)
    for (int32_t i : L.tensors) host::advance_step(steps[i], i);
  return std::vector<int64_t>(plan.generic.begin(), plan.generic.end());
}

// The names of the ahead-of-time specs (qconf/spec_aot.h).
std::vector<std::string> aot_names() {
  std::vector<std::string> out;
#define QCONF_NAME(S) out.push_back(sp::spec_name(sp::key_of<S>()));
  QCONF_AOT_SPECS(QCONF_NAME)
#undef QCONF_NAME
  return out;
}

// Every launch of a call's plan: (spec, tensor indices, per tensor (rows, cols, unit_rows, units,
// rank1_at[0], rank1_at[1])), the generic indices with their reasons, the rank-1 entries.
py::dict plan(int64_t rule, std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
              std::vector<at::Tensor> steps, std::vector<at::Tensor> states, at::Tensor meta, at::Tensor tables,
              std::vector<double> hyper, int64_t seed, int64_t l2_budget) {
  host::CallDescs call;
  const float* tab = tables.data_ptr<float>();
  host::describe_tensors(rule, params, grads, steps, states, meta, tab, tables.size(0), hyper, seed,
                         at::Device(at::kCPU), "CUDA", call, false);
  const sp::SpecPlan p = sp::plan_specs(static_cast<int32_t>(rule), call.descs, tab, tab, l2_budget);
  py::list launches;
  for (const sp::Launch& L : p.launches) {
    py::list tensors;
    for (int32_t j = 0; j < L.args.ntensors; ++j) {
      const sp::SpecTensor& g = L.args.t[j];
      tensors.append(py::make_tuple(L.tensors[j], g.numel, g.rows, g.cols, g.unit_rows, g.units, g.rank1_at[0],
                                    g.rank1_at[1]));
    }
    py::list ranges;
    for (const sp::Rank1Range& r : L.rank1) ranges.append(py::make_tuple(r.first, r.n));
    launches.append(py::make_tuple(sp::spec_name(L.key), tensors, L.args.nunits, L.two_pass, ranges, L.args.step));
  }
  py::list reasons;
  for (const auto& r : p.reasons) reasons.append(r);
  py::dict out;
  out["launches"] = launches;
  out["reasons"] = reasons;
  out["rank1_entries"] = p.rank1_entries;
  return out;
}

// Units of one tensor as unit_at gives them: (col0, tpr, rpi, row0, nrows) for each of its units.
std::vector<std::vector<int64_t>> units_of(int64_t rows, int64_t cols, int64_t unit_rows, int64_t units) {
  sp::SpecArgs a;
  a.ntensors = 1;
  a.t[0].rows = rows;
  a.t[0].cols = static_cast<int32_t>(cols);
  a.t[0].unit_rows = static_cast<int32_t>(unit_rows);
  a.t[0].units = static_cast<int32_t>(units);
  a.nunits = a.t[0].units;
  std::vector<std::vector<int64_t>> out;
  for (int32_t u = 0; u < a.nunits; ++u) {
    const sp::Unit x = sp::unit_at(a, u);
    out.push_back({x.col0, x.tpr, x.rpi, x.row0, x.nrows});
  }
  return out;
}
"""


def build_emulator(build_directory):
    entries = "\n".join(f'    {{"{n}", kernels_of<{_spec_type(n)}>()}},' for n in _names_of_cases())
    source = EMULATOR.replace("@ENTRIES@", entries)
    return host_extension("qconf_spec_emulator", source, ["step", "aot_names", "plan", "units_of"], build_directory)


# compiled in the background from when collection ends (conftest.py)
BACKGROUND_JOBS = {"emu": host_extension_job(__file__, "build_emulator")}
BACKGROUND_CPU_S = 100  # one core


@pytest.fixture(scope="module")
def emu(request, background_jobs):
    return prebuilt_extension(request, background_jobs, "emu", build_emulator)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_emulated_specialized_step_equals_cpu_fused(case, emu):
    _assert_same_bits(_run(case, emu), _run(case))


# ---------------------------------------------------------------------------------------------
# Muon: two kernel calls per matrix through qconf.optim.fused.run_one


@contextlib.contextmanager
def _muon_kernel_calls(emu=None, calls=None):
    """Redirects run_one's op call (qconf.optim.fused's ``ops.fused_step``): through the emulated
    specialized kernels (emu; the generic tensors through the CPU kernel, as the CUDA driver hands
    them to the generic kernel) or the CPU kernel; ``calls`` collects (rule name, spec name) of each
    call before it runs."""
    words = {_native.layout()[f"rule.{w}"]: w for w in ("muon_momentum", "muon_update")}

    def fused_step(rule, params, grads, steps, states, meta, tables, hyper, seed):
        if calls is not None:
            for name in torch.ops.qconf.cuda_specs(rule, params, grads, steps, states, meta, tables, hyper, seed):
                calls.append((words.get(rule, rule), name))
        if emu is None:
            torch.ops.qconf.fused_step(rule, params, grads, steps, states, meta, tables, hyper, seed)
        else:
            _emulate(emu, rule, params, grads, steps, states, meta, tables, hyper, seed)

    real = fused.ops
    fused.ops = types.SimpleNamespace(fused_step=fused_step)
    try:
        yield
    finally:
        fused.ops = real


def _run_muon(case, emu=None, steps=STEPS, special=False, calls=None):
    """STEPS Muon steps of the case, every matrix's two calls on the CPU kernel or (emu) the
    emulated specialized kernels; special: with the SPECIAL values in the parameters and in the
    gradients of step 1."""
    config, variant, dtype = case
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in MUON_SHAPES]
    if special:
        _poison(params, SPECIAL_PARAMS, 37)
    opt = Muon([{"params": params, "use_muon": True}], qconfig=_config(config), fused=True, seed=3,
               **MUON_OPTIMIZERS[variant])
    with _muon_kernel_calls(emu, calls):
        _steps(opt, params, steps, lambda step: _muon_grads(step, dtype), special)
    return params, opt


def _muon_grads(step, dtype):
    """Step ``step``'s gradients of MUON_SHAPES, scaled 1e-2, 1e-1, 1 in turn."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 10.0 ** (step % 3 - 2)).to(dtype) for s in MUON_SHAPES]


@pytest.mark.parametrize("case", MUON_CASES, ids=_case_id)
def test_emulated_muon_calls_equal_cpu_fused(case, emu):
    """Both Muon calls of every matrix through the specialized kernels' model, bit for bit against
    the CPU kernel: the momentum (torch.lerp's fused multiply-adds, the codec) and the bf16 scratch
    it writes, then the update with the weights policy; Newton-Schulz in between sees the same
    bits on both sides."""
    _assert_same_bits(_run_muon(case, emu), _run_muon(case))


def _nan_as_one(t):
    """``_bits`` with every NaN as one pattern (its sign and payload left out)."""
    if not t.is_floating_point():
        return t
    return _bits(torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t))


@pytest.mark.parametrize("case", MUON_SPECIAL_CASES, ids=_case_id)
def test_emulated_muon_calls_take_the_same_rare_paths(case, emu, monkeypatch):
    """NaN, infinities, the largest bf16 and subnormals in the parameters and the step-1 gradients
    of Muon's calls (the lerps' fused multiply-adds and the update's on special values; Newton-Schulz
    then spreads a NaN over its matrix): the bits of the CPU kernel's scalar path, NaN signs and
    payloads included. The vector kernels (AVX2, AVX-512) give the same values but not always the
    same NaN: where two NaNs of different signs meet in one operation (an infinite parameter turned
    NaN by Kahan's inf - inf at step 0, then the update's fma with Newton-Schulz's NaN matrix, and
    Kahan's sums after it), which one comes out is IEEE's unspecified choice, and x86 takes it from
    the operand order the compiler emitted (for an fma, its 132/213/231 form), so the vector
    kernels and the scalar path differ in that NaN's sign (12 elements of the Kahan case on AVX2);
    checked here: the same elements NaN, every other bit equal."""
    got_params, got_opt = _run_muon(case, emu, special=True)
    monkeypatch.setenv("QCONF_CPU_ISA", "scalar")
    want_params, want_opt = _run_muon(case, special=True)
    monkeypatch.delenv("QCONF_CPU_ISA")
    best_params, best_opt = _run_muon(case, special=True)
    assert any(torch.isnan(p).any() for p in want_params)
    for i, (a, b, c) in enumerate(zip(got_params, want_params, best_params)):
        assert torch.equal(_bits(a), _bits(b)), f"parameter {i} of shape {tuple(a.shape)}"
        assert torch.equal(_nan_as_one(c), _nan_as_one(b)), f"parameter {i}: the vector kernel's values"
    got, want, best = _state_tensors(got_opt), _state_tensors(want_opt), _state_tensors(best_opt)
    for k in want:
        assert torch.equal(_bits(got[k]), _bits(want[k])), k
        assert torch.equal(_nan_as_one(best[k]), _nan_as_one(want[k])), k


def test_muon_calls_reach_the_specialized_kernels():
    """Every Muon call of the cases is specialized but the rank-1 momentum on rows of 640 columns
    (which AdamW's rank-1 states leave to the generic kernel too), with the spec names the rules,
    dtypes and weights policies should give."""
    calls = []
    for case in MUON_CASES:
        _run_muon(case, steps=1, calls=calls)
    assert len(calls) == 2 * len(MUON_SHAPES) * len(MUON_CASES)
    assert set(MUON_SPECIAL_CASES) <= set(MUON_CASES)
    # the generic ones: the rank-1 momentum (two cases) on rows of 640 columns, as AdamW's rank-1 states
    generic = [c for c in calls if c[1].startswith("generic")]
    assert generic == 2 * [("muon_momentum", "generic: a rank-1 scale on rows of 640 elements")], generic
    for rule, name in calls:
        if name.startswith("generic"):
            continue
        assert name.split("-")[0].split(".")[0] == rule, (rule, name)
        if rule == "muon_momentum":
            assert name.split("-")[1].startswith("bf16."), name  # the scratch is bf16 whatever the parameter
        else:
            assert name.split("-")[1].endswith(".bf16") and name.split("-")[3:5] == ["none", "none"], name
    names = {n for _, n in calls}
    for needed in ("muon_momentum.pn-bf16.f32-plain-q4.g128.search-none-none",
                   "muon_momentum.pn-bf16.bf16-plain-q8.g256.lines_s-none-none",
                   "muon_momentum.p-bf16.f32-plain-fp32-none-none",
                   "muon_momentum.pn-bf16.f32-plain-q8.r1.sr-none-none",
                   "muon_momentum.p-bf16.f16-plain-q4.g32.sr-none-none",
                   "muon_update.w-f32.bf16-plain-none-none-none", "muon_update.w-bf16.bf16-plain-none-none-none",
                   "muon_update.w-bf16.bf16-sr-none-none-none", "muon_update-bf16.bf16-kahan-none-none-half",
                   "muon_update.w-bf16.bf16-sr+kahan-none-none-q4.g64.sr",
                   "muon_update.w-f16.bf16-kahan-none-none-q8.g128.lines_s"):
        assert needed in names, (needed, sorted(names))


def _bits(t):
    """The tensor's raw bits (NaN payloads and signed zeros compare too)."""
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _assert_same_bits(got, want):
    """Two runs' (parameters, optimizer): every parameter and state tensor, bit for bit."""
    (got_params, got_opt), (want_params, want_opt) = got, want
    for i, (a, b) in enumerate(zip(got_params, want_params)):
        assert torch.equal(_bits(a), _bits(b)), f"parameter {i} of shape {tuple(a.shape)}"
    got, want = _state_tensors(got_opt), _state_tensors(want_opt)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(_bits(got[k]), _bits(want[k])), k


SPECIAL_CASES = [("default.yml", "adamw", torch.float32), ("8bit.yml", "adamw", torch.float32),
                 ("default.yml", "adamw", torch.bfloat16), ("2nd_moment_group_128.yml", "adamw", torch.bfloat16),
                 ("weights_sr", "adamw", torch.bfloat16), ("weights_sr", "sgd", torch.bfloat16),
                 ("weights_sr", "lion", torch.float16),
                 ("weights_sr_kahan_q4", "adamw", torch.bfloat16), ("stochastic", "sgd", torch.float32)]


@pytest.mark.parametrize("case", SPECIAL_CASES, ids=_case_id)
def test_special_values_take_the_same_rare_paths(case, emu):
    """NaN, infinities, the largest finite bf16 and subnormals in parameters and gradients: the
    emulated kernels' rare paths (NaN quads, stochastic rounding's range, Inf maxima, IEEE slow
    paths) give the CPU kernel's bits, NaN payloads and signs of zero included."""
    want = _run(case, special=True)
    assert any(torch.isnan(p).any() for p in want[0])  # (the values reached the parameters)
    _assert_same_bits(_run(case, emu, special=True), want)


def test_the_cases_reach_the_specialized_kernels(emu):
    """Most tensors of the sweep are specialized (else the sweep would test the generic path)."""
    total = specialized = 0
    kinds = set()
    for case in CASES:
        _, opt = _run(case, steps=1)
        names = _spec_names(opt)
        total += len(names)
        specialized += sum(not n.startswith("generic") for n in names)
        kinds.update(f for n in names if not n.startswith("generic") for f in re.findall(r"q\d\.[gr]\w*\.\w+", n))
    assert specialized >= 0.7 * total, (specialized, total)
    for needed in ("q4.g128.search", "q4.r1.grid", "q8.g256.lines_s", "q8.g256.lines_u", "q4.g64.sr", "q4.r1.sr",
                   "q2.g8.search", "q1.g2048.search", "q8.g1024.sr", "q8.g32.search", "q8.g128.grid",
                   "q8.g128.lines_s", "q5.g128.lines_s", "q7.g128.lines_s", "q3.g32.search", "q7.g64.lines_u", "q7.r1.grid", "q4.g2048.search"):
        assert needed in kinds, needed


def _call_of(case):
    """The fused op's arguments of the case's one group after a first step (states exist)."""
    _, opt = _run(case, steps=1)
    for p, gr in zip(opt.param_groups[0]["params"], _grads(1, case[2])):
        p.grad = gr
    plan, grads, hyper, seed = _group_call(opt, opt.param_groups[0])
    return plan, (plan.rule, plan.params, grads, plan.steps, plan.states, plan.meta, plan.tables, hyper, seed)


@pytest.mark.parametrize("case", [("default.yml", "adamw", torch.float32), ("stochastic", "sgd", torch.bfloat16),
                                  ("weights_sr_kahan_q4", "lion", torch.bfloat16), ("narrow", "adamw", torch.float32)],
                         ids=lambda c: c[0])
def test_plans_cover_every_element_once(case, emu):
    """Each specialized tensor's units tile its rows x cols exactly once (strips of at most 2048
    columns, rows in units, 32-bit offsets), launches hold one spec and one step, at most 30
    tensors, and the rank-1 scratch is laid out in the CPU split step's order, disjoint."""
    plan, args = _call_of(case)
    out = emu.plan(*args, 1 << 20)
    seen, at = set(), 0
    for name, tensors, nunits, two_pass, ranges, step in out["launches"]:
        assert len(tensors) <= 30 and nunits == sum(t[5] for t in tensors)
        assert two_pass == (".r1." in name)
        for i, numel, rows, cols, unit_rows, units, r0, r1 in tensors:
            assert i not in seen
            seen.add(i)
            assert unit_rows * cols < 2 ** 31
            covered = torch.zeros(rows, cols, dtype=torch.int32)
            for col0, tpr, rpi, row0, nrows in emu.units_of(rows, cols, unit_rows, units):
                width = min(2048, cols - col0)
                assert tpr * 8 == width and rpi == 256 // tpr and 0 < nrows <= unit_rows
                covered[row0:row0 + nrows, col0:col0 + width] += 1
            assert torch.equal(covered, torch.ones_like(covered)), f"tensor {i}"
            assert rows * cols >= numel > (rows - 1) * cols
            for k, r in enumerate((r0, r1)):
                if r >= 0:  # tensors in call order, state 0 then 1, each rows + cols entries
                    assert r == at
                    at += rows + cols
    assert at == out["rank1_entries"]
    assert seen | {i for i, r in enumerate(out["reasons"]) if r} == set(range(len(plan.params)))


def test_two_pass_launches_keep_their_gradients_within_the_l2_budget(emu):
    """A launch with a reduce pass holds gradients of at most l2_budget bytes (its apply pass then
    re-reads them from L2), unless every tensor of it exceeds the budget on its own."""
    _, args = _call_of(("default.yml", "adamw", torch.float32))
    sizes = {i: p.numel() * 4 for i, p in enumerate(args[1])}
    budget = 150_000
    for name, tensors, *_ in emu.plan(*args, budget)["launches"]:
        if ".r1." in name:
            total = sum(sizes[t[0]] for t in tensors)
            assert total <= budget or all(sizes[t[0]] > budget for t in tensors), (name, tensors)


def _offset_meta(meta, offsets):
    """``meta`` with parameter i's random streams starting at element offsets[i] (a shard's)."""
    meta = meta.clone()
    meta[:, _native.layout()["meta.rng_offset"]] = torch.tensor(offsets, dtype=meta.dtype)
    return meta


# rng offsets per parameter of SHAPES: even ones take the specialized kernels' one hash per pair;
# an odd start, or pairs that cross a 2^32 window of pair indexes, the specs with a hash per element
PAIR_OFFSETS = [2, 2**33 - 6000, 2**32 - 1, 10**6, 3 * 2**32, 1, 2**34 + 7]


def test_bf16_stochastic_rounding_follows_the_rng_offset(emu):
    """bf16 stochastic rounding at shard offsets: the emulated specialized kernels draw each pair's
    hash as the CPU kernel draws each element's half, bit for bit, odd offsets and 2^33-element
    boundaries of the stream included."""
    def run(emulated):
        params = _params(torch.bfloat16)
        opt = OPTIMIZERS["adamw"](params, _config("weights_sr"))

        def step(group):
            plan, grads, hyper, seed = _group_call(opt, group)
            meta = _offset_meta(plan.meta, PAIR_OFFSETS)
            args = (plan.rule, plan.params, grads, plan.steps, plan.states, meta, plan.tables, hyper, seed)
            if emulated:
                _emulate(emu, *args)
            else:
                torch.ops.qconf.fused_step(*args)
        opt._fused_step = step
        _steps(opt, params, STEPS, lambda k: _grads(k, torch.bfloat16), False)
        return params, opt

    want = run(False)
    _assert_same_bits(run(True), want)
    want_opt = want[1]
    plan, grads, hyper, seed = _group_call(want_opt, want_opt.param_groups[0])
    names = torch.ops.qconf.cuda_specs(plan.rule, plan.params, grads, plan.steps, plan.states,
                                       _offset_meta(plan.meta, PAIR_OFFSETS), plan.tables, hyper, seed)
    assert all(".bf16-sr-" in names[i] for i in (0, 3, 4)), names
    assert all(".bf16-sr.each-" in names[i] for i in (1, 2, 5)), names  # (6: rows of 640, generic)


def _gpu_test_literal(name):
    """A module-level literal of tests/gpu/test_specialized_cuda.py."""
    return module_literal(ROOT / "tests" / "gpu" / "test_specialized_cuda.py", name)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("weights", ["kahan_q8", "sr_kahan_q4"])
def test_the_gpu_quantized_kahan_cases_take_only_specialized_kernels(weights, opt_name):
    """The GPU test of quantized Kahan buffers (which the generic CUDA kernel refuses) uses shapes
    that every rule's specialized kernels take: on the GPU a (96, 64) parameter beside AdamW's
    rank-1 second moment was refused instead of compared."""
    cases = _gpu_test_literal("WEIGHTS")
    assert cases[weights] == WEIGHTS[weights]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16))
              for s in _gpu_test_literal("WEIGHTS_SHAPES")]
    opt = OPTIMIZERS[opt_name](params, _config(f"weights_{weights}"))
    for p in params:
        p.grad = torch.randn_like(p)
    names = _spec_names(opt)
    assert len(names) == len(params) and not [n for n in names if n.startswith("generic")], names


def test_generic_reasons_name_what_is_not_specialized():
    shapes = [(96, 256), (10, 256), (3, 4, 64), (5000,), (64, 64), (64, 128)]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    cfg = {"min_numel": 64, "overrides": [
        {"match": "1", "states": {"exp_avg": {"scale": "dim1"}}},
        {"match": "3", "states": {"exp_avg": {"group_size": 100}}}]}
    opt = AdamW([(str(i), p) for i, p in enumerate(params)], qconfig={"base": str(CONFIGS / "default.yml"), **cfg},
                fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    names = _spec_names(opt)
    assert names[0] == "adam.wd-f32.f32-plain-q4.g128.search-q4.r1.grid-none"
    assert names[1] == "generic: exp_avg: dim1 scales"
    assert names[2] == "generic: a rank-1 scale on 3-D parameter"
    assert names[3] == "generic: exp_avg: blocks of 100 (powers of two from 8 to 2048 are specialized)"
    assert names[4] == "generic: exp_avg: blocks of 128 across rows of 64"  # groups must stay within rows
    assert names[5] == names[0]
    # a parameter that is not 16-byte aligned (a view one float into its storage)
    base = torch.zeros(64 * 128 + 1)
    view = torch.nn.Parameter(base[1:].view(64, 128))
    opt2 = AdamW([view], qconfig={"base": str(CONFIGS / "default.yml"), "min_numel": 64}, fused=True)
    view.grad = torch.randn_like(view)
    opt2.step()
    assert _spec_names(opt2) == ["generic: a parameter not 16-byte aligned"]


def test_the_ahead_of_time_specs_are_those_of_the_common_configs(emu):
    """spec_aot.h lists exactly the specs of AdamW under default.yml (2-D and 1-D parameters),
    8bit.yml and fp32 states, for float32 and bfloat16 parameters."""
    want = set()
    for dtype in (torch.float32, torch.bfloat16):
        for config in ("default.yml", "8bit.yml", "fp32.yml"):
            params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in [(96, 256), (5000,)]]
            opt = AdamW(params, weight_decay=0.01, qconfig=CONFIGS / config, fused=True)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            want.update(_spec_names(opt))
    assert sorted(emu.aot_names()) == sorted(want)


def test_spec_names_round_trip_and_bad_names_are_refused():
    for name in ["adam.wd-f32.f32-plain-q4.g128.search-q4.r1.grid-none", "sgd.wpn-bf16.f16-sr+kahan-q8.g8.sr-none-half",
                 "lion.mw-f16.f16-kahan-fp32-none-q8.g128.lines_s", "adam-f32.f32-plain-none-none-none",
                 "adam.wd-bf16.bf16-sr.each-q4.g128.search-q4.g128.grid-none",
                 "muon_momentum.pn-bf16.f32-plain-q8.r1.sr-none-none", "muon_momentum-bf16.bf16-plain-fp32-none-none",
                 "muon_update.w-bf16.bf16-sr.each-none-none-none", "muon_update-f16.bf16-kahan-none-none-half"]:
        text = torch.ops.qconf.cuda_spec_source(name)
        assert "QCONF_SPEC_KERNELS(QconfSpec)" in text
        rule = name.split("-")[0].split(".")[0]
        assert f"qconf::spec::Spec<{_native.layout()['rule.' + rule]}, " in text, name
    for bad, why in [("adam-f32", "is not a spec name"), ("adam.x-f32.f32-plain-none-none-none", "is not a spec name"),
                     ("adam.dw-f32.f32-plain-none-none-none", "is not a spec name"),  # flags out of order
                     ("adam-f32.f32-plain-q4.g100.search-none-none", "groups of 100"),
                     ("sgd-f32.f32-plain-fp32-fp32-none", "one-state rule"),
                     ("adam-f32.f32-sr-fp32-fp32-none", "float32 parameters with low-precision weights"),
                     ("adam-bf16.bf16-kahan-fp32-fp32-none", "Kahan buffer without Kahan weights"),
                     ("adam-f16.f16-sr.each-fp32-fp32-none", r"random bits per element \(sr.each\) without bf16"),
                     ("muon-bf16.f32-plain-fp32-none-none", "is not a spec name"),  # the rules are the two calls
                     ("muon_momentum.x-bf16.f32-plain-fp32-none-none", "is not a spec name"),
                     ("muon_momentum-bf16.f32-plain-fp32-fp32-none", "one-state rule"),
                     ("muon_update-f32.bf16-kahan-none-none-half", "float32 parameters with low-precision weights")]:
        with pytest.raises(RuntimeError, match=why):
            torch.ops.qconf.cuda_spec_source(bad)
