// The qconf._C extension: a plain Python module (no pybind11) whose import registers the qconf::*
// operators with torch.library; Python reaches them as torch.ops.qconf.<name>.
//
//   fused_step   one optimizer step for all parameters of a param group (functional form, usable
//                under torch.compile; fake impl in qconf/ops/__init__.py)
//   StepPlan     the same step with the per-parameter tensors kept on the C++ side, so an eager
//                step only passes the gradients (per-tensor argument overhead matters at 1000s
//                of small parameters); reduce() + apply() split it around the combination
//                of the two-pass scales' maxima across ranks (CPU; CUDA with the specialized
//                kernels)
//   layout       the positions and codes of the ops' arguments (qconf/layout.h), which Python
//                reads instead of repeating them
#include <Python.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "qconf/isa.h"
#include "qconf/layout.h"
#include "qconf/step_driver.h"
#include "qconf/step_host.h"

namespace {

std::string cpu_isa() { return qconf::isa_name(qconf::selected_isa()); }
std::string cpu_isa_best() { return qconf::isa_name(qconf::detect_isa()); }

c10::Dict<std::string, int64_t> layout() {
  c10::Dict<std::string, int64_t> out;
  for (const qconf::LayoutEntry& e : qconf::kLayout) out.insert(e.name, e.value);
  return out;
}

struct StepPlan : torch::CustomClassHolder {
  int64_t rule;
  std::vector<at::Tensor> params, steps, states;
  at::Tensor meta, tables;
  std::shared_ptr<qconf::CpuWorkspace> workspace = qconf::make_cpu_workspace();
#ifdef QCONF_WITH_CUDA
  std::shared_ptr<qconf::CudaWorkspace> cuda_workspace;  // made at the first CUDA step
#endif
  StepPlan(int64_t rule_, std::vector<at::Tensor> params_, std::vector<at::Tensor> steps_,
           std::vector<at::Tensor> states_, at::Tensor meta_, at::Tensor tables_)
      : rule(rule_), params(std::move(params_)), steps(std::move(steps_)), states(std::move(states_)),
        meta(std::move(meta_)), tables(std::move(tables_)) {}
  std::vector<at::Tensor> grads;  // the parameters' .grad, gathered here rather than passed in:
                                  // converting a Python list of 1000s of tensors costs ~1 KB each
  void run(const std::vector<double>& hyper, int64_t seed) {
    struct Release {  // do not keep gradients alive between steps
      std::vector<at::Tensor>& g;
      ~Release() { g.clear(); }
    } release{grads};
    const size_t n = params.size();
    for (size_t i = 0; i < n; ++i) {
      // .grad() reads the parameter's TensorImpl, then its autograd metadata: start both early
      // (see qconf::host::prefetch_meta)
      if (i + 4 < n) qconf::host::prefetch_meta(params[i + 4], false);
      if (i + 2 < n) __builtin_prefetch(params[i + 2].unsafeGetTensorImpl()->autograd_meta());
      grads.push_back(params[i].grad());
      TORCH_CHECK(grads.back().defined(), "qconf fused_step: parameter ", i, " of the plan has no gradient");
    }
#ifdef QCONF_WITH_CUDA
    if (!params.empty() && params[0].is_cuda()) {
      qconf::fused_step_cuda_reusing(cuda(), rule, params, grads, steps, states, meta, tables, hyper, seed);
      return;
    }
#endif
    qconf::fused_step_cpu_reusing(*workspace, rule, params, grads, steps, states, meta, tables, hyper, seed);
  }
  // The step of run() in two calls (qconf/step_driver.h: fused_step_cpu_reduce / _apply, and the
  // CUDA forms), with the gradients given (FSDP: the plan's parameters are local shards, whose
  // .grad is not set). The workspace holds the gradients and descriptions from reduce() to apply().
  std::tuple<at::Tensor, at::Tensor> reduce(const std::vector<double>& hyper, int64_t seed,
                                            const std::vector<at::Tensor>& grads_) {
#ifdef QCONF_WITH_CUDA
    if (on_cuda())
      return qconf::fused_step_cuda_reduce(cuda(), rule, params, grads_, steps, states, meta, tables, hyper, seed);
#endif
    check_cpu("reduce");
    return qconf::fused_step_cpu_reduce(*workspace, rule, params, grads_, steps, states, meta, tables, hyper, seed);
  }
  void apply(const at::Tensor& maxima) {
#ifdef QCONF_WITH_CUDA
    if (on_cuda()) {
      qconf::fused_step_cuda_apply(cuda(), steps, maxima);
      return;
    }
#endif
    check_cpu("apply");
    qconf::fused_step_cpu_apply(*workspace, steps, maxima);
  }
  bool on_cuda() const { return !params.empty() && params[0].is_cuda(); }
  void check_cpu(const char* what) const {
    TORCH_CHECK(!on_cuda(), "qconf StepPlan.", what,
                ": this build of qconf has no CUDA kernels; the split step of CUDA parameters needs them");
  }
#ifdef QCONF_WITH_CUDA
  qconf::CudaWorkspace& cuda() {
    if (!cuda_workspace) cuda_workspace = qconf::make_cuda_workspace();
    return *cuda_workspace;
  }
#endif
};

}  // namespace

TORCH_LIBRARY(qconf, m) {
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("cpu_isa_best() -> str", &cpu_isa_best);
  m.def("layout() -> Dict(str, int)", &layout);
  m.def("fused_step(int rule, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] steps, Tensor(c!)[] states, "
        "Tensor meta, Tensor tables, float[] hyper, int seed) -> ()");
  m.class_<StepPlan>("StepPlan")
      .def(torch::init<int64_t, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor,
                       at::Tensor>())
      .def("run", &StepPlan::run)
      .def("reduce", &StepPlan::reduce)
      .def("apply", &StepPlan::apply);
}

TORCH_LIBRARY_IMPL(qconf, CPU, m) { m.impl("fused_step", &qconf::fused_step_cpu); }

#ifdef QCONF_WITH_CUDA
TORCH_LIBRARY_IMPL(qconf, CUDA, m) { m.impl("fused_step", &qconf::fused_step_cuda); }
#endif

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "qconf native kernels", -1, nullptr};
  return PyModule_Create(&module);
}
