// The specialized kernels compiled ahead of time, with the extension (the list and why:
// qconf/spec_aot.h), and their lookup by spec.
#include <vector>

#include "cuda_driver.h"
#include "qconf/spec_aot.h"
#include "qconf/spec_kernel.cuh"

namespace qconf {
namespace {

struct Entry {
  spec::SpecKey key;
  AotKernels kernels;
};

template <class S>
Entry entry() {
  return {spec::key_of<S>(), {reinterpret_cast<const void*>(&spec::spec_apply_kernel<S>),
                              reinterpret_cast<const void*>(&spec::spec_reduce_kernel<S>)}};
}

const std::vector<Entry>& entries() {
#define QCONF_AOT_ENTRY(S) entry<S>(),
  static const std::vector<Entry> all = {QCONF_AOT_SPECS(QCONF_AOT_ENTRY)};
#undef QCONF_AOT_ENTRY
  return all;
}

}  // namespace

AotKernels aot_kernels(const spec::SpecKey& key) {
  for (const Entry& e : entries())
    if (e.key == key) return e.kernels;
  return {};
}

}  // namespace qconf
