"""The native-kernel tests under AddressSanitizer and UndefinedBehaviorSanitizer.

Builds ``qconf._C`` with ``QCONF_SANITIZE=1`` (setup.py: ``-fsanitize=address,undefined``, every
report fatal, -O1) into ``build/sanitize/`` beside a copy of the Python package, then
runs pytest on the native-kernel tests with that package first on ``PYTHONPATH`` and the ASan
runtime preloaded (the Python interpreter itself is not instrumented). A heap or stack overflow,
a use after free, a misaligned or out-of-range access or signed overflow in the extension aborts
the process with the sanitizer's report, which fails the run; the child processes the tests
start (the shape fuzz's) inherit the same environment. ::

    python tests/sanitize.py           # the focused subset (tests/test_sanitizers.py runs it in CI)
    python tests/sanitize.py --full    # every native-kernel test file, the whole fuzz
    python tests/sanitize.py -- -k fuzz    # extra pytest arguments after --

The build is incremental (ninja, ``build/sanitize-temp``): about 1 minute the first time on 2
cores. On a CPU without AVX-512 it leaves out the AVX-512 kernels, which could not run here.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "sanitize"
TEMP = ROOT / "build" / "sanitize-temp"

#: The native-kernel tests: the fused step, the split step, the codecs, the BitNet ops, the fuzz, Muon.
FULL = ["tests/test_native_fuzz.py", "tests/test_fused.py", "tests/test_fused_split.py",
        "tests/test_codec_native.py", "tests/test_integer_rows.py", "tests/test_ternary_mm.py",
        "tests/test_value_lines.py", "tests/test_non_finite.py", "tests/test_muon.py"]
#: The codecs under the sanitizers: every scale kind, code width and rounding with three maps -- a
#: full table (nonlinear), a padded one (linear: signed, an odd number of values) and ternary. The
#: maps differ only in the table's values, which no buffer's size depends on (the full product runs
#: in the normal suite and with --full).
CODEC_CASES = [f"tests/test_codec_native.py::test_native_equals_reference[{scale}-{map}-{bits}-{rounding}]"
               for scale in ("tensor", "dim0", "dim1", "group", "rank1") for rounding in ("nearest", "stochastic")
               for map, widths in (("nonlinear", (1, 4, 5, 8)), ("linear", (1, 4, 5, 8)), ("ternary", (2,)))
               for bits in widths]
#: What CI runs (about 55 s under the sanitizers on 2 cores): the fuzz's edge cases, its fixed Muon
#: cases (both of Muon's kernel calls on every ISA) and two batches of 12 random cases (every rule,
#: Muon included, scale kind, map, dtype and ISA among them), the split step, the native codecs
#: above, the integer row passes and the BitNet ops, block sizes around the main loop's chunk and
#: non-finite gradients. (--full adds the rest of the fuzz, the shipped-config and codec sweeps and
#: the ISA-override subprocess tests.)
FOCUSED = ["tests/test_native_fuzz.py::test_groups_larger_than_the_tensor_on_every_isa",
           "tests/test_native_fuzz.py::test_muon_cases_on_every_isa",
           *(f"tests/test_native_fuzz.py::test_random_cases_equal_the_reference[{b}]" for b in range(2)),
           "tests/test_fused_split.py", *CODEC_CASES,
           "tests/test_codec_native.py::test_native_non_finite_and_zero_blocks_match",
           "tests/test_codec_native.py::test_native_identical_across_isas_and_threads",
           "tests/test_integer_rows.py", "tests/test_ternary_mm.py",
           "--deselect", "tests/test_ternary_mm.py::test_scalar_isa_is_refused",
           "--deselect", "tests/test_ternary_mm.py::test_an_unusable_isa_override_does_not_break_import",
           "tests/test_fused.py::test_block_sizes_around_the_main_loop_chunk_match_reference",
           "tests/test_fused.py::test_non_finite_gradients_give_the_same_states"]
FOCUSED_FUZZ_CASES = "12"


def runtime(name: str) -> str:
    """The path of a sanitizer runtime (``libasan.so``) of the C++ compiler that builds the extension."""
    cxx = os.environ.get("CXX", "c++")
    path = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SystemExit(f"{cxx} has no {name} (install the compiler's sanitizer runtime, e.g. Debian's libasan8)")
    return path


def build() -> None:
    """The sanitized extension in build/sanitize/qconf, with a fresh copy of the Python package."""
    env = {**os.environ, "QCONF_SANITIZE": "1"}
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(OUT), "--build-temp",
                    str(TEMP)], cwd=ROOT, env=env, check=True)
    pkg = OUT / "qconf"
    for path in pkg.iterdir():  # everything but the extension: copied anew, so no stale module stays
        if path.name.startswith("_C."):
            continue
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    shutil.copytree(ROOT / "qconf", pkg, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (pkg / "configs").symlink_to(ROOT / "configs")  # package data, as an installed wheel has it


def environment(fuzz_cases: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(OUT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           # (no current directory on sys.path: run from the checkout, it would shadow build/sanitize)
           "PYTHONSAFEPATH": "1",
           # libstdc++ beside the ASan runtime: Python loads it only later, and ASan's interceptor of
           # C++ throws (every TORCH_CHECK) must find it when it starts
           "LD_PRELOAD": f"{runtime('libasan.so')} {runtime('libstdc++.so')}",
           # (torch and Python are not instrumented: leaks at exit are theirs; every report is fatal)
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    if fuzz_cases is not None:
        env["QCONF_FUZZ_CASES"] = fuzz_cases
    return env


def check_loaded(env: dict[str, str]) -> None:
    """The child imports the sanitized build, not the installed one."""
    code = "import qconf._native as n; print(n._C.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if where.returncode != 0 or not where.stdout.strip().startswith(str(OUT)):
        raise SystemExit(f"the sanitized extension did not load (got {where.stdout.strip()!r}):\n{where.stderr[-3000:]}")
    binary = Path(where.stdout.strip()).read_bytes()
    if b"__asan_init" not in binary or b"__ubsan_handle" not in binary:
        raise SystemExit(f"{where.stdout.strip()} is not instrumented by both sanitizers")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="every native-kernel test file and the whole fuzz")
    ap.add_argument("--no-build", action="store_true", help="use build/sanitize as it is")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if not args.no_build:
        build()
    print(f"sanitized build ready in {time.monotonic() - t0:.0f} s", flush=True)
    env = environment(None if args.full else FOCUSED_FUZZ_CASES)
    check_loaded(env)
    tests = FULL if args.full else FOCUSED
    # --capture=sys: a sanitizer report goes to the real stderr (fd capture would lose it when the
    # report aborts the process)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", *tests,
           *args.pytest_args]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
