#!/usr/bin/env python
"""Training-memory benchmark: peak bytes/param of training a 105M-parameter GPT-style transformer
with torch AdamW, qconf 4-bit / 8-bit (with and without gradient release), torchao, bitsandbytes
and flashoptim, split into params, grads, optimizer states and other.

    python benchmarks/bench_memory.py [--device cpu|cuda] [--memory-steps N] [--contenders GLOB,...] [--json out.json]
    python benchmarks/bench_memory.py --muon --device cpu    (the Muon rows, on the 0.93M-parameter `small` model)

A thin wrapper around ``qconf bench --memory`` (:mod:`qconf.bench.memory`, where the method and
the attribution are described).
"""
import sys

from qconf.bench.cli import main
from qconf.bench.memory_cli import MEMORY_DESCRIPTION

if __name__ == "__main__":
    sys.exit(main(["--memory", *sys.argv[1:]], prog="python benchmarks/bench_memory.py",
                  description=MEMORY_DESCRIPTION))
