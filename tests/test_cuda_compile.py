"""The CUDA sources compile: nvcc builds every csrc/cuda/*.cu for compute_80 and compute_90.

No GPU is needed (and this machine's torch may be a CPU build, so setup.py does not build the CUDA
extension here); this catches compile errors and warnings in our CUDA code. The flags mirror
setup.py's CUDA branch. Both architectures are compiled in one nvcc call per file, to PTX: the
whole front end (host and device C++, templates, intrinsics per architecture) runs, but not ptxas,
whose machine-code generation took 2/3 of the time (200 s against 75 s per file on two loaded
cores); setup.py's real build on a GPU machine (tests/gpu/) runs ptxas.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import include_paths

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
NVCC = shutil.which("nvcc")
ARCHS = ("80", "90")


def nvcc_command(source: Path, output: Path) -> list[str]:
    torch_include = [Path(p) for p in include_paths()]
    api_include = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "api" / "include"
    if api_include not in torch_include:
        torch_include.append(api_include)
    cmd = [NVCC, "-O3", "-std=c++17", "--fmad=false", "-DQCONF_WITH_CUDA",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           "--threads", str(len(ARCHS)), "-Xcompiler", "-ffp-contract=off", "-Xcompiler", "-fPIC"]
    for arch in ARCHS:
        cmd += ["-gencode", f"arch=compute_{arch},code=compute_{arch}"]  # PTX: no ptxas
    # A CPU build of torch ships the c10/cuda headers without the generated cuda_cmake_macros.h
    # (it only defines the Windows DLL export switch); tell CUDAMacros.h not to include it.
    if not any((p / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists() for p in torch_include):
        cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    for inc in [ROOT / "csrc" / "include", *torch_include, Path(sysconfig.get_paths()["include"])]:
        cmd += ["-I", str(inc)]
    return cmd + ["-c", str(source), "-o", str(output)]


def test_cuda_sources_exist():
    assert CUDA_SOURCES, "csrc/cuda/*.cu: no CUDA sources found"


def _job(source: Path):
    return lambda workdir: nvcc_command(source, workdir / f"{source.stem}.o")


# each compile starts when collection ends and runs in the background (conftest.py)
BACKGROUND_JOBS = {} if NVCC is None else {
    f"test_cuda_source_compiles_for_compute80_and_compute90[{source.name}]": _job(source) for source in CUDA_SOURCES}
BACKGROUND_CPU_S = 123  # step.cu 65, cuda_step.cu 40, spec_aot.cu 18 (39, 30 and 12 s on 2 idle cores)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_for_compute80_and_compute90(source, background_job):
    returncode, out, err = background_job.result()
    log = out + err
    assert returncode == 0, f"nvcc failed ({returncode}):\n{' '.join(background_job.argv)}\n\n{log[-30000:]}"
    # warnings in our own sources (torch's headers warn about C++20 bit-field initializers under
    # -std=c++17; those are not ours)
    ours = [line for line in log.splitlines() if "warning" in line.lower() and str(ROOT / "csrc") in line]
    assert not ours, "nvcc warnings in csrc/:\n" + "\n".join(ours)
    assert (background_job.workdir / f"{source.stem}.o").stat().st_size > 0
