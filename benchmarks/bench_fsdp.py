#!/usr/bin/env python
"""2-rank FSDP2 benchmark: qconf's 4-bit AdamW against torch.optim.AdamW(fused=True) (CPU, gloo).

    python benchmarks/bench_fsdp.py [--dim 512] [--layers 4] [--steps 20] [--warmup 3] [--json out.json]

Two processes on 127.0.0.1 (one thread each) train the same transformer-like stack, every block and
the model wrapped with ``fully_shard``. Each optimizer runs in the same processes, on a fresh copy of
the model, fed the same batches. Printed, per optimizer: the optimizer step time (median over the
timed steps, the slower rank), forward+backward time for reference, the optimizer-state bytes each
rank holds and the ratios against torch. qconf runs its fused kernel on the local shards (one
multi-tensor call per group plus one all-reduce of the shared scales) and, for comparison, its
reference path (``fused=False``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, SEQ, BATCH = 512, 64, 8


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Model(torch.nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _optimizers() -> dict:
    import qconf.optim as qo

    return {
        "torch AdamW fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
        "qconf AdamW 4-bit fused": lambda m: qo.AdamW(m.named_parameters(), lr=1e-3, qconfig="default", fused=True),
        "qconf AdamW 4-bit reference": lambda m: qo.AdamW(m.named_parameters(), lr=1e-3, qconfig="default",
                                                          fused=False),
    }


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (local shards; qconf: codes and scales)."""
    from qconf import memory_report
    from qconf.optim import QOptimizer

    if isinstance(opt, QOptimizer):
        return memory_report(opt).total_bytes
    total = 0
    for entry in opt.state.values():
        for v in entry.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


def _run(opt_name: str, args: argparse.Namespace, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model(args.dim, args.layers)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _optimizers()[opt_name](model)
    fwd_bwd, step = [], []
    for s in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(s)
        tokens = torch.randint(0, VOCAB, (BATCH * world, SEQ + 1), generator=g)[rank::world]
        dist.barrier()
        t0 = time.perf_counter()
        model(tokens).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if s >= args.warmup:
            fwd_bwd.append(t1 - t0)
            step.append(t2 - t1)
    return {"step_ms": 1e3 * statistics.median(step), "fwd_bwd_ms": 1e3 * statistics.median(fwd_bwd),
            "state_bytes": _state_bytes(opt), "params": sum(p.numel() for p in model.parameters())}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        results = {name: _run(name, args, rank, world) for name in _optimizers()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_fsdp.py", description=__doc__.split("\n")[1])
    parser.add_argument("--dim", type=int, default=512, help="model width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    world = 2
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(world, _free_port(), args, out_dir), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world)]
    from qconf._table import format_table

    base = {k: max(r["torch AdamW fused"][k] for r in ranks) for k in ("step_ms", "state_bytes")}
    rows, records = [], []
    for name in ranks[0]:
        step = max(r[name]["step_ms"] for r in ranks)
        nbytes = max(r[name]["state_bytes"] for r in ranks)
        fwd_bwd = max(r[name]["fwd_bwd_ms"] for r in ranks)
        rows.append([name, step, step / base["step_ms"], fwd_bwd, nbytes / 2**20, nbytes / base["state_bytes"]])
        records.append({"optimizer": name, "step_ms": step, "step_vs_torch": step / base["step_ms"],
                        "fwd_bwd_ms": fwd_bwd, "state_bytes_per_rank": nbytes,
                        "state_vs_torch": nbytes / base["state_bytes"]})
    print(f"FSDP2, {world} gloo ranks x 1 thread, {ranks[0]['torch AdamW fused']['params']:,} parameters "
          f"(dim {args.dim}, {args.layers} blocks), median of {args.steps} steps, slower rank")
    print(format_table(["optimizer", "step ms", "x torch", "fwd+bwd ms", "state MiB/rank", "x torch"], rows,
                       float_format=".3g"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dim": args.dim, "layers": args.layers, "world": world, "results": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
