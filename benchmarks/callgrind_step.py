#!/usr/bin/env python
"""Instructions per element of one optimizer step, counted by valgrind's callgrind (CPU).

    python benchmarks/callgrind_step.py [--isa avx2] [--numel 1048576] [--contenders PATTERN ...]

Counts repeat exactly on a loaded machine, unlike times. For each contender of ``qconf bench``
(torch fused AdamW, qconf fused default / group-128 / 8-bit, fp32 parameters by default) a child
process builds the optimizer on one fp32 parameter of ``--numel`` elements (rows of 1024) and
takes 3 steps; callgrind dumps its counts at a marker call (``os.getppid``) after the first step
and after the third, and the table shows the instructions between the two / (2 * numel): what 3
steps cost over 1 step, per element and step, the first step's state allocation and the
interpreter's start left out. One thread (``torch.set_num_threads(1)``), the qconf
kernels forced to ``QCONF_CPU_ISA`` (valgrind runs AVX2 and scalar code, not AVX-512).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

CHILD = r"""
import os, sys, torch
torch.set_num_threads(1)
from qconf.bench.roster import contenders
key, numel = sys.argv[1], int(sys.argv[2])
row = next(c for c in contenders() if c.key == key)
g = torch.Generator().manual_seed(0)
p = torch.nn.Parameter(torch.randn(numel // 1024, 1024, generator=g).to(row.dtype))
p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(row.dtype)
opt = row.build([p])
opt.step()
os.getppid()  # callgrind dumps the counts so far
opt.step()
opt.step()
os.getppid()  # and those of steps 2 and 3
"""
DEFAULT = ["torch-fused", "qconf-fused-group128-fp32", "qconf-fused-default-fp32", "qconf-fused-8bit-fp32"]


def steady_instructions(key: str, numel: int, isa: str) -> int:
    """Instructions callgrind counted for steps 2 and 3 of ``key`` (between the child's markers)."""
    env = dict(os.environ, QCONF_CPU_ISA=isa, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", "--dump-before=getppid",
               sys.executable, "-c", CHILD, key, str(numel)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        dumps = sorted(glob.glob(f"{tmp}/cg.out.*"), key=lambda f: int(f.rsplit(".", 1)[1]))
        totals = []
        for path in dumps:
            with open(path) as f:
                found = re.search(r"^(?:summary|totals):\s*(\d+)", f.read(), re.M)
            totals.append(int(found.group(1)) if found else None)
    if out.returncode != 0 or len(totals) < 2 or totals[1] is None:
        raise RuntimeError(f"{key}: valgrind failed ({out.returncode}, {len(totals)} dumps):\n{out.stderr[-2000:]}")
    return totals[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default="avx2", choices=["scalar", "avx2"], help="QCONF_CPU_ISA of the children")
    ap.add_argument("--numel", type=int, default=1 << 20, help="parameter elements (a multiple of 1024)")
    ap.add_argument("--contenders", nargs="+", default=DEFAULT, help="qconf bench contender keys")
    ap.add_argument("--jobs", type=int, default=2, help="children run at once")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("callgrind_step: valgrind is not installed (apt install valgrind)", file=sys.stderr)
        return 2
    if args.numel <= 0 or args.numel % 1024:
        print("callgrind_step: --numel must be a positive multiple of 1024", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(args.jobs) as pool:
        counts = dict(zip(args.contenders,
                          pool.map(lambda k: steady_instructions(k, args.numel, args.isa), args.contenders)))
    print(f"instructions per element per step (callgrind, 3 steps - 1 step, 1 thread, {args.numel} fp32 "
          f"params as rows of 1024, QCONF_CPU_ISA={args.isa})")
    width = max(len(k) for k in args.contenders)
    print(f"{'contender':<{width}}  instr/elem")
    for k in args.contenders:
        print(f"{k:<{width}}  {counts[k] / (2 * args.numel):10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
