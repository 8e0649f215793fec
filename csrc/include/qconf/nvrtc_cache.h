// Run-time compilation of CUDA C++ to a cubin with NVRTC, through an on-disk cache that concurrent
// processes can share (csrc/nvrtc_cache.cpp; the op torch.ops.qconf.nvrtc_compile exposes it).
//
// Plain C++17 on purpose: no CUDA, NVRTC or torch header, so the CPU-only build compiles it and a
// machine without the CUDA toolkit can still compile (and test) kernels. NVRTC is reached through
// a table of function pointers, filled either by load_nvrtc (dlopen) or, in the CUDA driver, from
// torch's own NVRTC stub (at::globalContext().getNVRTC()). The caller owns the table: there is no
// global state here.
//
// Cache: one file per program, <dir>/<name>-sm<arch>-<key>.cubin, where <key> is 128 bits of
// SHA-256 over everything that decides the output (format version, name, source, headers,
// options, arch, NVRTC version). The file starts with a header (magic, key, payload length,
// payload checksum) that is verified on every load; anything wrong is a miss and the file is
// rewritten. Files are written to a temporary name in the same directory and renamed into place,
// so a reader never sees a partial file and concurrent writers of the same key are harmless (the
// same bytes win). A cache that cannot be written is not an error: the result is returned with
// path "".
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace qconf {
namespace jit {

// The NVRTC entry points used, with nvrtc.h's signatures (nvrtcProgram as void*, nvrtcResult as
// int; both are ABI-identical). A result of 0 is NVRTC_SUCCESS.
struct NvrtcApi {
  int (*version)(int* major, int* minor) = nullptr;
  int (*create_program)(void** prog, const char* src, const char* name, int num_headers, const char* const* headers,
                        const char* const* include_names) = nullptr;
  int (*compile_program)(void* prog, int num_options, const char* const* options) = nullptr;
  int (*get_program_log_size)(void* prog, size_t* size) = nullptr;
  int (*get_program_log)(void* prog, char* log) = nullptr;
  int (*get_cubin_size)(void* prog, size_t* size) = nullptr;
  int (*get_cubin)(void* prog, char* cubin) = nullptr;
  int (*destroy_program)(void** prog) = nullptr;
  const char* (*get_error_string)(int result) = nullptr;  // optional: a number is printed without it
};

// dlopen(path, RTLD_NOW | RTLD_LOCAL) and look up the functions above (nvrtcVersion,
// nvrtcCreateProgram, ..., nvrtcGetCUBINSize, nvrtcGetCUBIN, nvrtcDestroyProgram,
// nvrtcGetErrorString), then the libnvrtc-builtins.so.<major>.<minor> beside it if there is one
// (NVRTC looks for it by bare name, which misses the pip wheels' folder). The libraries stay loaded
// for the life of the process (the returned pointers point into them). Throws std::runtime_error naming the path and dlerror() or the missing
// symbol; an empty path is refused (dlopen("") would return the main program).
NvrtcApi load_nvrtc(const std::string& path);

// A program: its name (NVRTC's file name for messages; also the cache file's prefix), its text,
// and the headers it may #include, as include name -> text, given in memory.
struct Source {
  std::string name;
  std::string text;
  std::vector<std::pair<std::string, std::string>> headers;
};

// cubin: the ELF image. log: NVRTC's program log ("" on a cache hit: nothing was compiled).
// path: the cache file read or written ("" without a cache, or when it could not be written).
struct Compiled {
  std::string cubin;
  std::string log;
  bool cache_hit = false;
  std::string path;
};

// $QCONF_CACHE_DIR if set and non-empty, else $XDG_CACHE_HOME/qconf/cuda, else
// $HOME/.cache/qconf/cuda; "" (no cache) when none of them is set.
std::string default_cache_dir();

// Compiles `src` for sm_<arch> (the option --gpu-architecture=sm_<arch> is added here; `options`
// must not name an architecture) through the cache in `dir` ("" = no cache; created with its
// parents if missing). Throws std::invalid_argument for arch <= 0, an architecture option or an
// incomplete `api`, and std::runtime_error with NVRTC's error string and the full program log when
// compilation fails.
Compiled compile(const NvrtcApi& api, const Source& src, int arch, const std::vector<std::string>& options,
                 const std::string& dir);

}  // namespace jit
}  // namespace qconf
