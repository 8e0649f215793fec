// The qconf._C extension: a plain Python module (no pybind11) whose import registers the
// qconf::* operators with torch.library; Python reaches them as torch.ops.qconf.<name>.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "qconf/isa.h"

namespace {

std::string cpu_isa() { return qconf::isa_name(qconf::selected_isa()); }
std::string cpu_isa_best() { return qconf::isa_name(qconf::detect_isa()); }

}  // namespace

TORCH_LIBRARY(qconf, m) {
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("cpu_isa_best() -> str", &cpu_isa_best);
}

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "qconf native kernels", -1, nullptr};
  return PyModule_Create(&module);
}
