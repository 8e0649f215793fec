"""The extension keeps a statically linked C++ runtime to itself (setup.py ``LINK_ARGS``).

Some toolchains link libstdc++ statically into a shared object (the GPU machine's /opt/gcc did).
If that copy's locale and stream symbols are exported, the dynamic linker binds them to the
process's shared libstdc++, loaded first by Python and torch, which numbers the locale facets
differently: formatting an integer into a stream then printed nothing or crashed the process --
on the GPU machine, every qconf error message with an index or a count (a segfault instead of
"gradient 0 is not on the cuda:0"), and every NVRTC compilation (its cache file names).

setup.py links with ``--exclude-libs,ALL``, which keeps whatever comes from an archive local. Here
a small library that formats integers is linked with ``-static-libstdc++`` the same way and loaded
into a process that imported torch first; without the flags it fails on this toolchain, with them
it prints the numbers. The built extension itself must not export libstdc++'s own symbols.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, module_literal

GXX = shutil.which("g++")

SOURCE = r"""
#include <cstring>
#include <sstream>
#include <string>
extern "C" int format_numbers(char* out, int n) {
  std::ostringstream s;
  s << "n=" << static_cast<long>(n) << "," << static_cast<unsigned long>(n);
  const std::string r = s.str();
  std::strcpy(out, r.c_str());
  return static_cast<int>(r.size());
}
"""

LOADER = r"""
import ctypes, sys
import torch  # the process's shared libstdc++ first, as when qconf._C is imported
buf = ctypes.create_string_buffer(64)
ctypes.CDLL(sys.argv[1]).format_numbers(buf, 4099)
print(buf.value.decode())
"""

# libstdc++'s own definitions (locale, ios_base, the ostream inserters), mangled
LIBSTDCXX_OWN = ("_ZNSt6locale", "_ZNSt8ios_base", "_ZNSo9_M_insert")


def static_libstdcxx() -> bool:
    if GXX is None:
        return False
    out = subprocess.run([GXX, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    return Path(out).is_absolute() and Path(out).exists()


def build_and_load(tmp_path: Path, link_args: list[str], name: str) -> subprocess.CompletedProcess:
    src = tmp_path / "numbers.cpp"
    src.write_text(SOURCE)
    lib = tmp_path / f"lib{name}.so"
    # -Bsymbolic-functions: as Debian/Ubuntu Pythons' LDSHARED adds it (the GPU machine's did)
    subprocess.run([GXX, "-O2", "-fPIC", "-shared", "-static-libstdc++", "-Wl,-Bsymbolic-functions", *link_args,
                    str(src), "-o", str(lib)], check=True, capture_output=True, timeout=120)
    return subprocess.run([sys.executable, "-c", LOADER, str(lib)], capture_output=True, text=True, timeout=120)


def exported_libstdcxx(lib: Path) -> list[str]:
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return [line for line in nm.stdout.splitlines() if any(s in line for s in LIBSTDCXX_OWN)]


@pytest.mark.skipif(not static_libstdcxx(), reason="no g++ with a static libstdc++ to link against")
def test_link_args_keep_a_static_libstdcxx_consistent(tmp_path):
    plain = build_and_load(tmp_path, [], "plain")
    # the hazard, reproduced: the integers go missing (or the process dies)
    assert plain.returncode != 0 or plain.stdout.strip() != "n=4099,4099", plain.stdout
    kept = build_and_load(tmp_path, list(module_literal(ROOT / "setup.py", "LINK_ARGS")), "kept")
    assert kept.returncode == 0, kept.stderr[-2000:]
    assert kept.stdout.strip() == "n=4099,4099"
    assert exported_libstdcxx(tmp_path / "libkept.so") == []


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_the_extension_exports_no_libstdcxx_symbols():
    from qconf import _native

    if not _native.fused_available():
        pytest.skip(f"no native extension: {_native.native_error()}")
    import qconf._C as ext

    assert exported_libstdcxx(Path(ext.__file__)) == []
