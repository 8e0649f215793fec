#!/usr/bin/env python
"""Optimizer-step benchmark: qconf vs torch.optim.AdamW, torchao and bitsandbytes (CPU).

    python benchmarks/bench_step.py [--size big|many|both] [--rounds N] [--threads T] [--json out.json]
    python benchmarks/bench_step.py --muon          (qconf Muon vs torch.optim.Muon on --size muon)

A thin wrapper around :mod:`qconf.bench` (also available as ``qconf bench``); see
docs/benchmarks.md for what each column means.
"""
import sys

from qconf.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python benchmarks/bench_step.py"))
