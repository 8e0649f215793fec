// The specialized kernels' NVRTC programs and their compilation (qconf/spec_source.h).
#include "qconf/spec_source.h"

#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>

namespace qconf {
namespace spec {

namespace {

// The directory of the library holding torch's c10 (site-packages/torch/lib in a pip install).
std::string torch_lib_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&c10::GetCPUAllocator), &info) == 0 || info.dli_fname == nullptr)
    return "";
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

}  // namespace

std::string nvrtc_library() {
  if (const char* env = std::getenv("QCONF_NVRTC_LIBRARY"); env != nullptr && *env != '\0') return env;
  const std::string lib = torch_lib_dir();  // .../site-packages/torch/lib
  if (!lib.empty()) {
    const std::string site = lib + "/../..";
    for (const char* rel : {"/nvidia/cu13/lib/libnvrtc.so.13", "/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"}) {
      const std::string candidate = site + rel;
      if (access(candidate.c_str(), R_OK) == 0) return candidate;
    }
  }
  for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) {
    void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) {
      dlclose(h);
      return name;
    }
  }
  return "libnvrtc.so";
}

const std::vector<std::pair<std::string, std::string>>& kernel_headers() {
  // build/generated/qconf_kernel_sources.inc: {"qconf/<name>", R"qconf_src(<text>)qconf_src"},
  // for each header of spec_kernel.cuh (setup.py writes it from csrc/include/qconf)
  static const std::vector<std::pair<std::string, std::string>> headers = {
#include "qconf_kernel_sources.inc"
  };
  return headers;
}

jit::Source spec_program(const SpecKey& key) {
  jit::Source src;
  src.name = spec_name(key);
  src.text = "#include \"qconf/spec_kernel.cuh\"\nusing QconfSpec = " + spec_type(key) +
             ";\nQCONF_SPEC_KERNELS(QconfSpec)\n";
  src.headers = kernel_headers();
  return src;
}

std::vector<std::string> spec_options(const std::vector<std::string>& extra) {
  // -default-device: layout.h's constexpr helpers carry no __device__ annotation
  std::vector<std::string> opts = {"--std=c++17", "--fmad=false", "-default-device"};
  opts.insert(opts.end(), extra.begin(), extra.end());
  return opts;
}

jit::Compiled compile_spec(const jit::NvrtcApi& api, const SpecKey& key, int arch, const std::string& dir,
                           const std::vector<std::string>& extra) {
  return jit::compile(api, spec_program(key), arch, spec_options(extra), dir);
}

}  // namespace spec
}  // namespace qconf
