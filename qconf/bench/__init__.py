"""Optimizer-step benchmark: qconf vs torch.optim.AdamW, torchao and bitsandbytes low-bit AdamW.

    python benchmarks/bench_step.py [--size big|many|both] [--rounds N] [--threads T] [--json out.json]
    qconf bench ...                                   (same options)
    qconf bench --device cuda                         (on the GPU: 64 x 4096x2048, a device copy in the same rounds)
    qconf bench --muon                                (qconf Muon 8-bit / 4-bit momentum vs torch.optim.Muon)

Every contender gets its own copy of the same parameters and the same fixed gradients. After a
warm-up (which also absorbs torch.compile time for torchao), the benchmark runs *rounds*: in each
round it times one ``step()`` of every contender, in a shuffled order, and divides each time by the
time of torch's fused AdamW (fp32) in the same round. A contender's ratio is the median of those
per-round ratios, so slow drifts of the machine (this is a noisy 2-core VM) cancel out; ns/param is
the median of its own step times. Contenders whose step is much slower than the baseline (the
qconf reference path, torchao and bitsandbytes on CPU) are timed in fewer, evenly spread rounds;
the ``rounds`` column says how many.

State bytes/param count the tensors the optimizer actually holds after warm-up. Peak extra RSS is
measured in a fresh subprocess per contender (:mod:`qconf.bench.rss`).

Modules, each importing only those listed before it:

    roster    Contender, contenders() (the AdamW roster; muon=True: the Muon one), the benchmarked configs,
              select() for --contenders
    tensors   the run's parameters and gradients, state bytes of an optimizer
    rss       the peak-RSS child process and its launcher
    device    Backend (sync, clock, memory probes) for --device cpu/cuda, the copy baseline, bytes moved
    measure   sizes, warm-up, interleaved timing rounds, ratios, CPU contention, machine info
    tables    the printed report (header, size tables, per-tensor overhead, footer)
    sass      a kernel's cost from its machine code: cuobjdump SASS, the main loop's count, ptxas
    cuda_static  the specialized CUDA kernels compiled for sm_90 and measured without a GPU
              (``--cuda-static``, benchmarks/cuda_static.py)
    cli       options, run(), execute(), main()
"""
from .cli import add_arguments, execute, main, run
from .measure import SIZE_GROUPS, SIZES  # SIZE_GROUPS, format_many_vs_one: read by tests/test_bench.py
from .roster import Contender, contenders
from .tables import format_many_vs_one, format_report

__all__ = ["SIZES", "Contender", "contenders", "add_arguments", "run", "format_report", "execute", "main"]
