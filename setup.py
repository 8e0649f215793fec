"""Build script: packages ``qconf`` and compiles the native extension ``qconf._C`` from csrc/.

The package data are ``qconf/py.typed`` and the shipped configs (``configs/`` -> ``qconf/configs/``).
The CPU extension is always built (set QCONF_NO_EXT=1 to skip it; the package then runs on the
reference path). The CUDA kernels are added only when torch itself is a CUDA build and nvcc is
available. Install with ``pip install --no-build-isolation .`` so the build uses the installed torch.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup


def _extensions():
    if os.environ.get("QCONF_NO_EXT") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # -ffp-contract=off: no fused multiply-add, so kernels round exactly like the reference path
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-fvisibility=hidden", "-ffp-contract=off"]
    include = [os.path.join(here, "csrc", "include")]
    with_cuda = (torch.version.cuda is not None and CUDA_HOME is not None and shutil.which("nvcc") is not None
                 and os.environ.get("QCONF_NO_CUDA") != "1")
    if with_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        # --fmad=false: no contraction on the GPU either (bit-identical to the CPU kernels and the
        # reference), and none in the host code of the .cu files (the shared Scalars setup);
        # sm_80 and sm_90 binaries (torch adds no arch flags when -gencode is given)
        nvcc = ["-O3", "-std=c++17", "--fmad=false", "-DQCONF_WITH_CUDA", "-Xcompiler", "-ffp-contract=off",
                "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
        ext = CUDAExtension("qconf._C", sources, include_dirs=include, libraries=["gomp"],
                            extra_compile_args={"cxx": cxx + ["-DQCONF_WITH_CUDA"], "nvcc": nvcc})
    else:
        ext = CppExtension("qconf._C", sources, include_dirs=include, libraries=["gomp"],
                           extra_compile_args={"cxx": cxx})
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


ext_modules, cmdclass = _extensions()
# The shipped configs (configs/ in the repository) become package data at qconf/configs/, so an installed
# wheel finds them by name (qconf.config.builtin: the top-level files); the study configs come along.
setup(packages=find_packages(include=["qconf", "qconf.*"]) + ["qconf.configs"],
      package_dir={"qconf.configs": "configs"},
      package_data={"qconf": ["py.typed"], "qconf.configs": ["*.yml", "studies/*/*.yml"]},
      ext_modules=ext_modules, cmdclass=cmdclass)
