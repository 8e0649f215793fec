"""``torch.ops.qconf.nvrtc_compile``: CUDA C++ -> cubin with NVRTC through the on-disk cache
(csrc/nvrtc_cache.cpp, API in csrc/include/qconf/nvrtc_cache.h).

No GPU is needed: NVRTC is a host library and compiles for any sm_ architecture. It is found through
$QCONF_NVRTC_LIBRARY, else the ``nvidia-cuda-nvrtc`` pip package (CUDA 13 or 12 layout); the module
is skipped only when neither exists.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import re
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from qconf import _native

if not _native.native_available():  # pragma: no cover
    pytest.skip(f"extension unavailable: {_native.native_error()}", allow_module_level=True)


def find_nvrtc() -> str | None:
    """$QCONF_NVRTC_LIBRARY (used as given, even if wrong: then the tests say so), else libnvrtc
    from the ``nvidia`` pip namespace package."""
    if os.environ.get("QCONF_NVRTC_LIBRARY"):
        return os.environ["QCONF_NVRTC_LIBRARY"]
    try:
        import nvidia
    except ImportError:
        return None
    for base in nvidia.__path__:
        for rel in ("cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12"):
            if (Path(base) / rel).is_file():
                return str(Path(base) / rel)
    return None


NVRTC = find_nvrtc()
if NVRTC is None:  # pragma: no cover
    pytest.skip("no libnvrtc: set QCONF_NVRTC_LIBRARY or pip install nvidia-cuda-nvrtc", allow_module_level=True)

KERNEL = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n'
MAGIC = b"qconf-cubin-v1\n\0"
HEADER_SIZE = 16 + 16 + 8 + 16  # magic, key, payload length, payload checksum
FILE_NAME = re.compile(r"^(?P<name>.+)-sm(?P<arch>\d+)-(?P<key>[0-9a-f]{32})\.cubin$")
EM_CUDA = 190  # ELF e_machine of a cubin


class Result(NamedTuple):
    cubin: bytes
    log: str
    cache_hit: bool
    path: str


def compile_cuda(source: str = KERNEL, cache_dir: str | Path = "", *, arch: int = 90, options=(), headers=(),
                 name: str = "k.cu", library: str | None = None) -> Result:
    cubin, log, hit, path = torch.ops.qconf.nvrtc_compile(
        name, source, [h for h, _ in headers], [t for _, t in headers], arch, list(options), str(cache_dir),
        library or NVRTC)
    assert cubin.dtype == torch.uint8 and cubin.dim() == 1 and cubin.device.type == "cpu"
    return Result(cubin.numpy().tobytes(), log, hit, path)


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def assert_cubin(data: bytes) -> None:
    assert data[:4] == b"\x7fELF", data[:16]
    assert int.from_bytes(data[18:20], "little") == EM_CUDA


# -- compiling and caching ----------------------------------------------------------------------------

def test_compile_writes_one_cache_file_then_hits(tmp_path):
    cache = tmp_path / "a" / "b" / "cuda"  # missing parents are created
    first = compile_cuda(cache_dir=cache)
    assert_cubin(first.cubin)
    assert not first.cache_hit
    assert files(cache) == [Path(first.path).name]
    assert Path(first.path).parent == cache
    assert FILE_NAME.match(Path(first.path).name)["arch"] == "90"
    umask = os.umask(0)
    os.umask(umask)
    assert cache.stat().st_mode & 0o777 == 0o755 & ~umask

    second = compile_cuda(cache_dir=cache)
    assert second.cache_hit and second.path == first.path and second.cubin == first.cubin
    assert second.log == ""  # nothing was compiled
    assert files(cache) == [Path(first.path).name]


def test_cache_file_layout(tmp_path):
    r = compile_cuda(cache_dir=tmp_path, name="my kernel/v1.cu")
    name = Path(r.path).name
    assert FILE_NAME.match(name)["name"] == "my_kernel_v1.cu"  # sanitized: no '/' or ' '
    data = Path(r.path).read_bytes()
    assert data[:16] == MAGIC
    assert data[16:32].hex() == FILE_NAME.match(name)["key"]
    assert int.from_bytes(data[32:40], "little") == len(r.cubin) == len(data) - HEADER_SIZE
    assert data[40:56] == hashlib.sha256(r.cubin).digest()[:16]
    assert data[HEADER_SIZE:] == r.cubin


BASE = dict(options=("--std=c++17", "-DEXTRA=0"), headers=(("unused.h", "#define UNUSED 1\n"),), arch=90,
            name="k.cu", source=KERNEL)
VARIANTS = {
    "option": dict(options=("--std=c++17", "-DEXTRA=1")),
    "option-order": dict(options=("-DEXTRA=0", "--std=c++17")),
    "extra-option": dict(options=("--std=c++17", "-DEXTRA=0", "-DMORE")),
    "arch": dict(arch=80),
    "source": dict(source=KERNEL + "// changed\n"),
    "header-text": dict(headers=(("unused.h", "#define UNUSED 2\n"),)),
    "header-name": dict(headers=(("other.h", "#define UNUSED 1\n"),)),
    "extra-header": dict(headers=(("unused.h", "#define UNUSED 1\n"), ("more.h", ""))),
    "name": dict(name="k2.cu"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_key_part_changes_the_key(tmp_path, variant):
    base = compile_cuda(cache_dir=tmp_path, **BASE)
    changed = {**BASE, **VARIANTS[variant]}
    other = compile_cuda(cache_dir=tmp_path, **changed)
    assert not other.cache_hit and other.path != base.path
    assert len(files(tmp_path)) == 2
    assert_cubin(other.cubin)
    if variant == "arch":
        assert FILE_NAME.match(Path(other.path).name)["arch"] == "80" and other.cubin != base.cubin
    again = compile_cuda(cache_dir=tmp_path, **changed)  # and the changed key is stable
    assert again.cache_hit and again.path == other.path and again.cubin == other.cubin


def test_header_given_in_memory_is_used(tmp_path):
    source = '#include "my.h"\nextern "C" __global__ void k(float* x) { x[0] = MY_VALUE; }\n'
    three = compile_cuda(source, tmp_path, headers=[("my.h", "#define MY_VALUE 3.0f\n")])
    five = compile_cuda(source, tmp_path, headers=[("my.h", "#define MY_VALUE 5.0f\n")])
    assert_cubin(three.cubin)
    assert three.cubin != five.cubin  # the header's text reached the code
    with pytest.raises(RuntimeError, match=r'(?s)program log:.*my\.h'):
        compile_cuda(source, tmp_path)


CORRUPTIONS = {
    "payload-byte": lambda d: d[:-100] + bytes([d[-100] ^ 0x01]) + d[-99:],
    "checksum-byte": lambda d: d[:40] + bytes([d[40] ^ 0x80]) + d[41:],
    "key-byte": lambda d: d[:20] + bytes([d[20] ^ 0x01]) + d[21:],
    "magic": lambda d: b"qconf-cubin-v0\n\0" + d[16:],
    "length": lambda d: d[:32] + (len(d) - HEADER_SIZE + 1).to_bytes(8, "little") + d[40:],
    "truncated": lambda d: d[:-10],
    "header-only": lambda d: d[:HEADER_SIZE],
    "inside-header": lambda d: d[:10],
    "empty": lambda d: b"",
    "appended": lambda d: d + b"\0",
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupted_cache_file_is_recompiled_and_rewritten(tmp_path, corruption):
    good = compile_cuda(cache_dir=tmp_path)
    path = Path(good.path)
    intact = path.read_bytes()
    path.write_bytes(CORRUPTIONS[corruption](intact))
    again = compile_cuda(cache_dir=tmp_path)
    assert not again.cache_hit and again.cubin == good.cubin and again.path == good.path
    assert path.read_bytes() == intact
    assert files(tmp_path) == [path.name]
    assert compile_cuda(cache_dir=tmp_path).cache_hit


def test_no_cache_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QCONF_CACHE_DIR", str(tmp_path / "default"))  # "" means no cache, not the default
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for _ in range(2):
        r = compile_cuda(cache_dir="")
        assert_cubin(r.cubin)
        assert not r.cache_hit and r.path == ""
    assert files(tmp_path) == []


def _unwritable_dir(tmp_path: Path, how: str) -> Path:
    if how == "below-a-file":  # mkdir fails for every user, root included
        (tmp_path / "file").write_text("")
        return tmp_path / "file" / "cuda"
    if how == "target-is-a-directory":  # the temporary file is written, the rename fails (root too)
        name = Path(compile_cuda(cache_dir=tmp_path / "probe").path).name  # the key does not depend on the dir
        (tmp_path / "cuda" / name).mkdir(parents=True)
        return tmp_path / "cuda"
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o500)
    try:
        (cache / "probe").touch()
    except PermissionError:
        return cache
    (cache / "probe").unlink()
    cache.chmod(0o700)
    pytest.skip("chmod 0o500 does not stop this user from writing (root); "
                "'below-a-file' and 'target-is-a-directory' cover the case")


@pytest.mark.parametrize("how", ["read-only", "below-a-file", "target-is-a-directory"])
def test_unwritable_cache_dir_still_compiles(tmp_path, how):
    cache = _unwritable_dir(tmp_path, how)
    before = files(cache) if cache.is_dir() else None
    try:
        for _ in range(2):
            r = compile_cuda(cache_dir=cache)
            assert_cubin(r.cubin)
            assert not r.cache_hit and r.path == ""
        if before is not None:
            assert files(cache) == before  # no temporary file left behind
    finally:
        if how == "read-only":
            cache.chmod(0o700)


# -- concurrent processes -------------------------------------------------------------------------------

def _compile_in_child(cache_dir: str, library: str, barrier, queue) -> None:
    """One of the concurrent compilers (module level: the spawn start method imports this module)."""
    try:
        barrier.wait(timeout=120)  # all start compiling together, after their slow imports
        r = compile_cuda(cache_dir=cache_dir, library=library)
        queue.put((os.getpid(), True, r.cubin))
    except BaseException:  # noqa: BLE001 -- report anything, the parent fails the test
        queue.put((os.getpid(), False, traceback.format_exc()))


def _collect(procs, queue, timeout: float) -> list[bytes]:
    """The children's cubins; fails on a child's error, a child dead without a report, or the timeout."""
    results, deadline = [], time.monotonic() + timeout
    while len(results) < len(procs):
        assert time.monotonic() < deadline, f"{len(procs) - len(results)} compiler(s) did not finish in {timeout} s"
        if queue.empty():
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(1.0)  # its report may still be on the way
                assert not queue.empty(), f"a compiler died without reporting: {[p.exitcode for p in procs]}"
            time.sleep(0.05)
            continue
        pid, ok, value = queue.get()
        assert ok, f"compiler {pid} failed:\n{value}"
        results.append(value)
    return results


def test_concurrent_processes_share_one_cache_file(tmp_path):
    n = 4
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.SimpleQueue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(tmp_path), NVRTC, barrier, queue), daemon=True)
             for _ in range(n)]
    for p in procs:
        p.start()
    try:
        results = _collect(procs, queue, timeout=240.0)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert_cubin(results[0])
    assert all(r == results[0] for r in results)
    assert len(files(tmp_path)) == 1 and files(tmp_path)[0].endswith(".cubin"), files(tmp_path)
    assert compile_cuda(cache_dir=tmp_path).cubin == results[0]


# -- errors and the default directory ----------------------------------------------------------------------

def test_compile_error_carries_the_log(tmp_path):
    source = 'extern "C" __global__ void k(float* x) { x[0] = qconf_undeclared_value; }\n'
    with pytest.raises(RuntimeError, match=r"(?s)NVRTC_ERROR_COMPILATION.*program log:.*qconf_undeclared_value"):
        compile_cuda(source, tmp_path)
    assert files(tmp_path) == []  # nothing cached


def test_missing_or_wrong_library_is_named(tmp_path):
    missing = str(tmp_path / "libnvrtc-missing.so")
    with pytest.raises(RuntimeError, match=re.escape(missing)):
        compile_cuda(library=missing)
    with pytest.raises(RuntimeError, match="nvrtc_library is empty"):
        torch.ops.qconf.nvrtc_compile("k.cu", KERNEL, [], [], 90, [], "", "")
    with pytest.raises(RuntimeError, match="libm.so.6 has no symbol nvrtcVersion"):
        compile_cuda(library="libm.so.6")


@pytest.mark.parametrize("call,error,message", [
    (lambda: torch.ops.qconf.nvrtc_compile("k.cu", KERNEL, ["a.h"], [], 90, [], "", NVRTC), RuntimeError,
     "header_names has 1 entries but header_texts has 0"),
    (lambda: compile_cuda(arch=0), RuntimeError, "arch must be a positive sm number"),
    (lambda: compile_cuda(arch=-90), RuntimeError, "arch must be a positive sm number"),
    # std::invalid_argument from qconf::jit::compile arrives as ValueError
    (lambda: compile_cuda(options=["--gpu-architecture=sm_80"]), ValueError, "must not name the architecture"),
    (lambda: compile_cuda(options=["-arch=sm_80"]), ValueError, "must not name the architecture"),
], ids=["header-lists", "arch-0", "arch-negative", "arch-option", "arch-short-option"])
def test_bad_arguments_are_refused(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_default_cache_dir(monkeypatch):
    monkeypatch.setenv("QCONF_CACHE_DIR", "/somewhere/qconf")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    monkeypatch.setenv("HOME", "/home/user")
    assert torch.ops.qconf.nvrtc_default_cache_dir() == "/somewhere/qconf"
    monkeypatch.setenv("QCONF_CACHE_DIR", "")
    assert torch.ops.qconf.nvrtc_default_cache_dir() == "/xdg/qconf/cuda"
    monkeypatch.delenv("QCONF_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert torch.ops.qconf.nvrtc_default_cache_dir() == "/home/user/.cache/qconf/cuda"
    monkeypatch.delenv("HOME")
    assert torch.ops.qconf.nvrtc_default_cache_dir() == ""
