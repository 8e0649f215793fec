#!/usr/bin/env python
"""The specialized CUDA kernels measured without a GPU: registers, stack, spills and SASS per
element of each shipped config's spec compiled for sm_90, and the H100 time they predict.

    python benchmarks/cuda_static.py [--arch 90] [--configs a.yml ...] [--json out.json]

A thin wrapper around :mod:`qconf.bench.cuda_static` (also ``qconf bench --cuda-static``); see
docs/kernels.md for the table and how it is counted.
"""
import sys

from qconf.bench.cuda_static import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
