"""Multi-process tests on CPU: a gloo process group of ``world`` ranks on 127.0.0.1 with a free port,
bounded in time, leaving nothing running.

``spawn(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh processes (the
``spawn`` start method: nothing inherited from pytest) after ``init_process_group("gloo")``;
returns what each rank returned (picklable), or raises with the failing rank's traceback. ``fn``
must be a module-level function of an importable module (tests/ is on sys.path under pytest).
"""
from __future__ import annotations

import io
import os
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

TIMEOUT_S = 240  # per spawn; a hung collective fails the test instead of hanging the suite


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, queue: Any, fn: Callable[..., Any], args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        try:
            buf = io.BytesIO()  # bytes, not tensors: a shared-memory tensor would die with the process
            torch.save(fn(rank, world, *args), buf)
            queue.put((rank, True, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- DCP raises BaseException subclasses
        queue.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float = TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; the ranks' return values."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, queue, fn, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish in {timeout} s (ranks done: {sorted(results)})")
            if queue.empty():
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(1.0)  # its report may still be on the way
                    if queue.empty():
                        raise RuntimeError(f"a rank died without reporting (exit codes {[p.exitcode for p in procs]})")
                time.sleep(0.05)
                continue
            rank, ok, value = queue.get()
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            import torch

            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
