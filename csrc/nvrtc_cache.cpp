// NVRTC compilation to a cubin through an on-disk cache (the API and the cache's design are in
// csrc/include/qconf/nvrtc_cache.h), and the ops that expose it to tools and tests:
//
//   nvrtc_compile(name, source, header_names, header_texts, arch, options, cache_dir, nvrtc_library)
//       -> (Tensor cubin, str log, bool cache_hit, str path)     cubin: 1-D uint8 on the CPU
//   nvrtc_default_cache_dir() -> str
//
// Nothing here needs CUDA: NVRTC is a host library, loaded with dlopen, and a cubin can be built
// for any sm_ architecture without a GPU.
#include "qconf/nvrtc_cache.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <climits>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace qconf {
namespace jit {
namespace {

// -- SHA-256 (FIPS 180-4): the cache key and the payload checksum ---------------------------------
// A cryptographic hash rather than FNV: a key collision would silently load another program's
// cubin, and SHA-256 makes that impossible in practice for any input, structured or not.

constexpr uint32_t kSha256Rounds[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

class Sha256 {
 public:
  void update(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    total_bytes_ += size;
    while (size > 0) {
      const size_t take = std::min(size, sizeof(block_) - used_);
      std::memcpy(block_ + used_, p, take);
      used_ += take;
      p += take;
      size -= take;
      if (used_ == sizeof(block_)) {
        compress();
        used_ = 0;
      }
    }
  }

  std::array<uint8_t, 32> finish() {
    const uint64_t bits = total_bytes_ * 8;  // before the padding below adds to total_bytes_
    const uint8_t one = 0x80, zero = 0;
    update(&one, 1);
    while (used_ != 56) update(&zero, 1);
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    update(length, 8);
    std::array<uint8_t, 32> digest;
    for (int i = 0; i < 32; ++i) digest[i] = static_cast<uint8_t>(state_[i / 4] >> (24 - 8 * (i % 4)));
    return digest;
  }

 private:
  void compress() {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t{block_[4 * i]} << 24 | uint32_t{block_[4 * i + 1]} << 16 | uint32_t{block_[4 * i + 2]} << 8 |
             uint32_t{block_[4 * i + 3]};
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t v[8];  // a b c d e f g h
    std::copy(state_, state_ + 8, v);
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = v[7] + (rotr(v[4], 6) ^ rotr(v[4], 11) ^ rotr(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) +
                          kSha256Rounds[i] + w[i];
      const uint32_t t2 =
          (rotr(v[0], 2) ^ rotr(v[0], 13) ^ rotr(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
      std::copy_backward(v, v + 7, v + 8);
      v[4] += t1;
      v[0] = t1 + t2;
    }
    for (int i = 0; i < 8; ++i) state_[i] += v[i];
  }

  uint32_t state_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  uint8_t block_[64] = {};
  size_t used_ = 0;
  uint64_t total_bytes_ = 0;
};

// -- the cache key and the cache file ------------------------------------------------------------

using Digest = std::array<uint8_t, 16>;  // the first 128 bits of a SHA-256

// Part of the key and of the file's magic: bump it when the key's inputs or the file layout change,
// so files of an older format are never read as this one.
constexpr const char kFormatVersion[] = "qconf.nvrtc_cache.v1";
// File layout: magic (16 bytes) | key (16) | payload length (8, little-endian) | payload checksum (16) | payload
constexpr char kMagic[16] = "qconf-cubin-v1\n";
constexpr size_t kHeaderSize = sizeof(kMagic) + 16 + 8 + 16;

Digest truncate(const std::array<uint8_t, 32>& full) {
  Digest d;
  std::copy(full.begin(), full.begin() + d.size(), d.begin());
  return d;
}

Digest checksum(const std::string& payload) {
  Sha256 h;
  h.update(payload.data(), payload.size());
  return truncate(h.finish());
}

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

// Every field is length-prefixed so that no two different inputs hash the same byte stream (e.g.
// name "ab" + text "c" against name "a" + text "bc", or an option moving into a header).
void hash_field(Sha256& h, const std::string& field) {
  std::string length;
  put_u64(length, field.size());
  h.update(length.data(), length.size());
  h.update(field.data(), field.size());
}

Digest cache_key(const Source& src, int arch, const std::vector<std::string>& options, int nvrtc_major,
                 int nvrtc_minor) {
  Sha256 h;
  hash_field(h, kFormatVersion);
  hash_field(h, src.name);
  hash_field(h, src.text);
  hash_field(h, std::to_string(src.headers.size()));
  for (const auto& header : src.headers) {
    hash_field(h, header.first);
    hash_field(h, header.second);
  }
  hash_field(h, std::to_string(options.size()));
  for (const std::string& option : options) hash_field(h, option);
  hash_field(h, std::to_string(arch));
  hash_field(h, std::to_string(nvrtc_major) + "." + std::to_string(nvrtc_minor));
  return truncate(h.finish());
}

std::string to_hex(const Digest& d) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (uint8_t byte : d) {
    out.push_back(digits[byte >> 4]);
    out.push_back(digits[byte & 15]);
  }
  return out;
}

std::string encode_cache_file(const Digest& key, const std::string& cubin) {
  std::string out(kMagic, sizeof(kMagic));
  out.append(reinterpret_cast<const char*>(key.data()), key.size());
  put_u64(out, cubin.size());
  const Digest sum = checksum(cubin);
  out.append(reinterpret_cast<const char*>(sum.data()), sum.size());
  return out + cubin;
}

// The payload of a cache file, or nothing if any part of the header disagrees with the file
// (another format, another key, truncated, corrupted).
std::optional<std::string> decode_cache_file(const std::string& file, const Digest& key) {
  if (file.size() < kHeaderSize || std::memcmp(file.data(), kMagic, sizeof(kMagic)) != 0) return std::nullopt;
  const char* p = file.data() + sizeof(kMagic);
  if (std::memcmp(p, key.data(), key.size()) != 0) return std::nullopt;
  if (get_u64(p + key.size()) != file.size() - kHeaderSize) return std::nullopt;
  std::string payload = file.substr(kHeaderSize);
  const Digest sum = checksum(payload);
  if (std::memcmp(p + key.size() + 8, sum.data(), sum.size()) != 0) return std::nullopt;
  return payload;
}

// Letters, digits, '.', '_' and '-' of the program's name (others become '_'; no leading '.'),
// at most 64 characters: the name is only there to make the cache directory readable.
std::string sanitize_name(const std::string& name) {
  std::string out;
  for (char c : name.substr(0, 64)) {
    const bool plain = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
    out.push_back(plain ? c : '_');
  }
  if (out.empty()) return "program";
  if (out[0] == '.') out[0] = '_';
  return out;
}

std::string cache_file_path(const std::string& dir, const std::string& name, int arch, const Digest& key) {
  return dir + "/" + sanitize_name(name) + "-sm" + std::to_string(arch) + "-" + to_hex(key) + ".cubin";
}

// -- files -------------------------------------------------------------------------------------------

// mkdir -p with mode 0755; true when `dir` is a directory afterwards. Errors on the way are
// ignored (an existing parent may well refuse mkdir); only the result counts.
bool make_dirs(const std::string& dir) {
  for (size_t slash = dir.find('/', 1); slash != std::string::npos; slash = dir.find('/', slash + 1))
    ::mkdir(dir.substr(0, slash).c_str(), 0755);
  ::mkdir(dir.c_str(), 0755);
  struct stat st;
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Reads to the end of the file (`expected` is only the first guess of its size: a concurrent writer
// never changes a file in place, but a hand-edited one may grow).
std::optional<std::string> read_all(int fd, size_t expected) {
  std::string bytes(expected + 1, '\0');
  size_t done = 0;
  for (;;) {
    if (done == bytes.size()) bytes.resize(2 * bytes.size());
    const ssize_t n = ::read(fd, &bytes[done], bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::nullopt;
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  bytes.resize(done);
  return bytes;
}

bool write_all(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// The whole of a regular file; nothing if it is missing, not a regular file (a directory in the
// way) or unreadable. POSIX calls, not ifstream, whose reads throw on some of these.
std::optional<std::string> read_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO in the way must not hang (it is then refused as not regular)
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat st;
  std::optional<std::string> bytes;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) bytes = read_all(fd, static_cast<size_t>(st.st_size));
  ::close(fd);
  return bytes;
}

// 64 random bits for a temporary file's name; the clock if the system offers no entropy source
// (the pid in the name and O_EXCL keep it unique either way).
uint64_t random_bits() {
  try {
    std::random_device entropy;
    return (uint64_t{entropy()} << 32) | entropy();
  } catch (const std::exception&) {
    return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
}

// A fresh file beside `path` (same directory, so rename() stays on one file system and is atomic),
// named after it with the pid and a random number, created exclusively; -1 if none could be made.
int create_temporary(const std::string& path, std::string& temporary) {
  const size_t slash = path.rfind('/');
  for (int attempt = 0; attempt < 8; ++attempt) {
    std::ostringstream name;
    name << path.substr(0, slash + 1) << '.' << path.substr(slash + 1) << ".tmp-" << ::getpid() << '-' << std::hex
         << random_bits();
    temporary = name.str();
    const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;
}

// Writes `bytes` to `path` so that no reader ever sees a partial file: a temporary file, closed,
// then renamed over `path`. Concurrent writers of the same key write the same bytes, so whichever
// rename lands last is as good as the others. No fsync: a file torn by a crash fails the header's
// checks on the next load and is recompiled. False (and no temporary left) on any failure.
bool write_file_atomically(const std::string& path, const std::string& bytes) {
  std::string temporary;
  const int fd = create_temporary(path, temporary);
  if (fd < 0) return false;
  const bool written = write_all(fd, bytes);
  const bool closed = ::close(fd) == 0;
  if (written && closed && ::rename(temporary.c_str(), path.c_str()) == 0) return true;
  ::unlink(temporary.c_str());
  return false;
}

std::optional<std::string> load_cached(const std::string& path, const Digest& key) {
  const std::optional<std::string> file = read_file(path);
  return file ? decode_cache_file(*file, key) : std::nullopt;
}

bool store_cached(const std::string& dir, const std::string& path, const Digest& key, const std::string& cubin) {
  return make_dirs(dir) && write_file_atomically(path, encode_cache_file(key, cubin));
}

// -- NVRTC ------------------------------------------------------------------------------------------

std::string error_string(const NvrtcApi& api, int result) {
  const char* text = api.get_error_string ? api.get_error_string(result) : nullptr;
  return text ? std::string(text) : "NVRTC error " + std::to_string(result);
}

// The program handle, destroyed on every path out of compile_with_nvrtc (exceptions included).
class Program {
 public:
  Program(const NvrtcApi& api, const Source& src) : api_(api) {
    std::vector<const char*> texts, names;
    for (const auto& header : src.headers) {
      names.push_back(header.first.c_str());
      texts.push_back(header.second.c_str());
    }
    const int result = api.create_program(&handle_, src.text.c_str(), src.name.c_str(), static_cast<int>(texts.size()),
                                          texts.data(), names.data());
    if (result != 0)
      throw std::runtime_error("qconf: nvrtcCreateProgram failed for '" + src.name + "': " + error_string(api, result));
  }
  ~Program() {
    if (handle_) api_.destroy_program(&handle_);
  }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  void* get() const { return handle_; }

 private:
  const NvrtcApi& api_;
  void* handle_ = nullptr;
};

// Reads one of NVRTC's outputs (log, cubin) through its size + copy pair of calls.
std::string read_output(const NvrtcApi& api, void* program, int (*get_size)(void*, size_t*),
                        int (*get)(void*, char*), const char* what) {
  size_t size = 0;
  int result = get_size(program, &size);
  std::string out(size, '\0');
  if (result == 0 && size > 0) result = get(program, &out[0]);
  if (result != 0) throw std::runtime_error(std::string("qconf: NVRTC could not return the ") + what + ": " +
                                            error_string(api, result));
  return out;
}

std::string program_log(const NvrtcApi& api, void* program) {
  std::string log = read_output(api, program, api.get_program_log_size, api.get_program_log, "program log");
  while (!log.empty() && log.back() == '\0') log.pop_back();  // the size counts the terminator
  return log;
}

Compiled compile_with_nvrtc(const NvrtcApi& api, const Source& src, int arch, const std::vector<std::string>& options) {
  Program program(api, src);
  const std::string arch_option = "--gpu-architecture=sm_" + std::to_string(arch);
  std::vector<const char*> argv;
  for (const std::string& option : options) argv.push_back(option.c_str());
  argv.push_back(arch_option.c_str());
  const int result = api.compile_program(program.get(), static_cast<int>(argv.size()), argv.data());
  Compiled out;
  out.log = program_log(api, program.get());  // also on success: warnings
  if (result != 0)
    throw std::runtime_error("qconf: NVRTC could not compile '" + src.name + "' for sm_" + std::to_string(arch) +
                             ": " + error_string(api, result) + "\nprogram log:\n" + out.log);
  out.cubin = read_output(api, program.get(), api.get_cubin_size, api.get_cubin, "cubin");
  return out;
}

void check_arguments(const NvrtcApi& api, int arch, const std::vector<std::string>& options) {
  if (!api.version || !api.create_program || !api.compile_program || !api.get_program_log_size ||
      !api.get_program_log || !api.get_cubin_size || !api.get_cubin || !api.destroy_program)
    throw std::invalid_argument("qconf: the NVRTC function table is incomplete");
  if (arch <= 0) throw std::invalid_argument("qconf: arch must be positive (sm_<arch>), got " + std::to_string(arch));
  for (const std::string& option : options)
    if (option.rfind("--gpu-architecture", 0) == 0 || option.rfind("-arch", 0) == 0)
      throw std::invalid_argument("qconf: options must not name the architecture (it comes from arch): " + option);
}

std::pair<int, int> nvrtc_version(const NvrtcApi& api) {
  int major = 0, minor = 0;
  const int result = api.version(&major, &minor);
  if (result != 0) throw std::runtime_error("qconf: nvrtcVersion failed: " + error_string(api, result));
  return {major, minor};
}

template <typename Fn>
void bind_symbol(void* library, const std::string& path, const char* symbol, Fn*& fn) {
  fn = reinterpret_cast<Fn*>(::dlsym(library, symbol));
  if (!fn) throw std::runtime_error("qconf: " + path + " has no symbol " + symbol);
}

// NVRTC dlopens its builtins library (libnvrtc-builtins.so.<major>.<minor>) by bare name, and the
// pip wheels do not put their lib/ folder on the search path. An already-loaded library of that
// soname satisfies such a dlopen, so load the one beside libnvrtc first (torch preloads it the same
// way for its CUDA wheels). Best effort: without one, NVRTC searches as usual and says in its log
// that the builtins are missing.
void preload_builtins(void* library, const NvrtcApi& api) {
  char origin[PATH_MAX] = {};
  int major = 0, minor = 0;
  if (::dlinfo(library, RTLD_DI_ORIGIN, origin) != 0 || api.version(&major, &minor) != 0) return;
  const std::string builtins =
      std::string(origin) + "/libnvrtc-builtins.so." + std::to_string(major) + "." + std::to_string(minor);
  if (::access(builtins.c_str(), R_OK) == 0 && !::dlopen(builtins.c_str(), RTLD_NOW | RTLD_LOCAL))
    ::dlerror();  // clear the failure: NVRTC reports a missing builtins library itself
}

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::string(value) : std::string();
}

}  // namespace

NvrtcApi load_nvrtc(const std::string& path) {
  if (path.empty()) throw std::runtime_error("qconf: no NVRTC library given (empty path)");
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    const char* why = ::dlerror();
    throw std::runtime_error("qconf: cannot load the NVRTC library " + path + ": " + (why ? why : "unknown error"));
  }
  // Never dlclosed: the table's pointers point into the library. dlopen counts references, so
  // loading the same path again costs nothing and returns the same handle.
  NvrtcApi api;
  bind_symbol(library, path, "nvrtcVersion", api.version);
  bind_symbol(library, path, "nvrtcCreateProgram", api.create_program);
  bind_symbol(library, path, "nvrtcCompileProgram", api.compile_program);
  bind_symbol(library, path, "nvrtcGetProgramLogSize", api.get_program_log_size);
  bind_symbol(library, path, "nvrtcGetProgramLog", api.get_program_log);
  bind_symbol(library, path, "nvrtcGetCUBINSize", api.get_cubin_size);
  bind_symbol(library, path, "nvrtcGetCUBIN", api.get_cubin);
  bind_symbol(library, path, "nvrtcDestroyProgram", api.destroy_program);
  bind_symbol(library, path, "nvrtcGetErrorString", api.get_error_string);
  preload_builtins(library, api);
  return api;
}

std::string default_cache_dir() {
  const std::string explicit_dir = env_or_empty("QCONF_CACHE_DIR");
  if (!explicit_dir.empty()) return explicit_dir;
  const std::string xdg = env_or_empty("XDG_CACHE_HOME");
  if (!xdg.empty()) return xdg + "/qconf/cuda";
  const std::string home = env_or_empty("HOME");
  return home.empty() ? std::string() : home + "/.cache/qconf/cuda";
}

Compiled compile(const NvrtcApi& api, const Source& src, int arch, const std::vector<std::string>& options,
                 const std::string& dir) {
  check_arguments(api, arch, options);
  const auto version = nvrtc_version(api);
  const Digest key = cache_key(src, arch, options, version.first, version.second);
  const std::string path = dir.empty() ? std::string() : cache_file_path(dir, src.name, arch, key);
  if (!path.empty()) {
    if (std::optional<std::string> cubin = load_cached(path, key)) return Compiled{std::move(*cubin), "", true, path};
  }
  Compiled out = compile_with_nvrtc(api, src, arch, options);
  if (!path.empty() && store_cached(dir, path, key, out.cubin)) out.path = path;
  return out;
}

}  // namespace jit
}  // namespace qconf

// -- the ops --------------------------------------------------------------------------------------

namespace {

std::tuple<at::Tensor, std::string, bool, std::string> nvrtc_compile_op(
    const std::string& name, const std::string& source, const std::vector<std::string>& header_names,
    const std::vector<std::string>& header_texts, int64_t arch, const std::vector<std::string>& options,
    const std::string& cache_dir, const std::string& nvrtc_library) {
  TORCH_CHECK(header_names.size() == header_texts.size(), "qconf nvrtc_compile: header_names has ",
              header_names.size(), " entries but header_texts has ", header_texts.size());
  TORCH_CHECK(arch > 0 && arch <= std::numeric_limits<int>::max(),
              "qconf nvrtc_compile: arch must be a positive sm number (90 for sm_90), got ", arch);
  TORCH_CHECK(!nvrtc_library.empty(), "qconf nvrtc_compile: nvrtc_library is empty (give the path of libnvrtc)");
  qconf::jit::Source src{name, source, {}};
  for (size_t i = 0; i < header_names.size(); ++i) src.headers.emplace_back(header_names[i], header_texts[i]);
  const qconf::jit::NvrtcApi api = qconf::jit::load_nvrtc(nvrtc_library);
  qconf::jit::Compiled out = qconf::jit::compile(api, src, static_cast<int>(arch), options, cache_dir);
  at::Tensor cubin = at::empty({static_cast<int64_t>(out.cubin.size())}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(cubin.data_ptr<uint8_t>(), out.cubin.data(), out.cubin.size());
  return {cubin, out.log, out.cache_hit, out.path};
}

std::string nvrtc_default_cache_dir_op() { return qconf::jit::default_cache_dir(); }

}  // namespace

// Registered with the function itself (a catch-all kernel, like layout() in bindings.cpp): the ops
// take no tensor, so there is no dispatch key to pick a backend kernel by.
TORCH_LIBRARY_FRAGMENT(qconf, m) {
  m.def("nvrtc_compile(str name, str source, str[] header_names, str[] header_texts, int arch, str[] options, "
        "str cache_dir, str nvrtc_library) -> (Tensor cubin, str log, bool cache_hit, str path)",
        &nvrtc_compile_op);
  m.def("nvrtc_default_cache_dir() -> str", &nvrtc_default_cache_dir_op);
}
