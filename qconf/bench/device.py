"""Where the benchmark runs: the :class:`Backend` (device, synchronize, clock, memory probes, the
copy baseline) for ``--device cpu`` and ``--device cuda``, the GPU's description for the header,
and the bytes a step moves.

Everything device-specific the timing code calls is a field of :class:`Backend`, so a test drives
the CUDA path's logic on CPU tensors with a fake clock and ``sync``. On CUDA a timed step is
``sync(); t0 = clock(); step(); sync(); clock() - t0`` (``torch.cuda.synchronize`` on both sides,
so the time includes the host-side work of the step and every kernel it launched).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

#: bytes one step of torch's fused AdamW on fp32 parameters moves per parameter: read p, g, m, v
#: (16) and write p, m, v (12). The device copy moves the same bytes: ``copy_`` of a buffer of half
#: of them (read + write).
COPY_BYTES_PER_PARAM = 28
#: the pseudo-contender key of the device copy in the timing rounds (not a table row)
COPY_KEY = "device-copy"


def _no_sync() -> None:
    """``sync`` of the CPU: nothing is asynchronous."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """How the benchmark runs on one device. ``allocated``/``max_allocated``/``reset_peak`` are the
    device memory probes (None: not measured, the CPU's peak RSS comes from a subprocess instead);
    ``share_grads``: contenders of one dtype share one set of gradient tensors (read-only for every
    optimizer here; checked after the rounds); ``copy_bytes_per_param``: the bytes per parameter the
    copy baseline moves (0: no copy baseline)."""

    device: torch.device
    sync: Callable[[], None] = _no_sync
    clock: Callable[[], int] = time.perf_counter_ns
    allocated: Callable[[], int] | None = None
    max_allocated: Callable[[], int] | None = None
    reset_peak: Callable[[], None] | None = None
    release: Callable[[], None] = _no_sync
    share_grads: bool = False
    copy_bytes_per_param: int = 0
    info: Callable[[], dict[str, Any]] | None = None

    @property
    def measures_memory(self) -> bool:
        """Whether the device memory probes are set."""
        return self.allocated is not None and self.max_allocated is not None and self.reset_peak is not None


def cpu_backend() -> Backend:
    """``--device cpu``: wall clock, no synchronization, peak RSS from subprocesses, no copy row."""
    return Backend(torch.device("cpu"))


def cuda_unavailable_reason() -> str | None:
    """Why ``--device cuda`` cannot run here (one line), or None when it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"--device cuda: this torch ({torch.__version__}) is built without CUDA"
    return f"--device cuda: torch.cuda.is_available() is False (no GPU visible; torch {torch.__version__})"


def cuda_info() -> dict[str, Any]:
    """The current GPU for the header: name, compute capability, memory, torch's CUDA version and
    whether qconf's build has CUDA kernels."""
    from .._native import has_cuda_kernels

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"name": torch.cuda.get_device_name(index), "capability": f"sm_{props.major}{props.minor}",
            "memory_gib": props.total_memory / 2**30, "cuda": torch.version.cuda,
            "qconf_cuda_kernels": has_cuda_kernels()}


def cuda_backend() -> Backend:
    """``--device cuda``: ``torch.cuda.synchronize`` around every timed step, the caching
    allocator's counters as memory probes, shared gradients and the 28 B/param copy baseline.
    ValueError (one line) when CUDA is not available."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise ValueError(reason)
    return Backend(torch.device("cuda", torch.cuda.current_device()), sync=torch.cuda.synchronize,
                   allocated=torch.cuda.memory_allocated, max_allocated=torch.cuda.max_memory_allocated,
                   reset_peak=torch.cuda.reset_peak_memory_stats, release=torch.cuda.empty_cache,
                   share_grads=True, copy_bytes_per_param=COPY_BYTES_PER_PARAM, info=cuda_info)


def make_backend(device: str) -> Backend:
    """The backend of ``--device`` (``cpu`` or ``cuda``)."""
    return cuda_backend() if device == "cuda" else cpu_backend()


def bytes_per_param_moved(dtype: torch.dtype, state_bytes_per_param: float) -> float:
    """The least bytes per parameter a step moves: read p, g and the states, write p and the states
    (``2 P + G + 2 S``; P = G = the parameter dtype's size, S = state bytes/param). 28 for torch's
    fused AdamW on fp32 parameters."""
    size = torch.empty((), dtype=dtype).element_size()
    return 3 * size + 2 * state_bytes_per_param


@contextlib.contextmanager
def env_vars(env: Sequence[tuple[str, str]]) -> Iterator[None]:
    """Set the environment variables ``env`` inside the block, restore them after."""
    saved = {k: os.environ.get(k) for k, _ in env}
    os.environ.update(dict(env))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def with_env(step: Callable[[], Any], env: Sequence[tuple[str, str]]) -> Callable[[], Any]:
    """``step`` itself when ``env`` is empty, else a step that runs inside :func:`env_vars` (qconf's
    CUDA kernel choice, ``QCONF_CUDA_KERNELS``, is read from the environment at every step)."""
    if not env:
        return step

    def run() -> Any:
        with env_vars(env):
            return step()
    return run


def copy_step(numel: int, backend: Backend) -> tuple[Callable[[], Any], int]:
    """The copy baseline: ``(step, bytes moved per step)``; ``dst.copy_(src)`` of two byte buffers of
    ``copy_bytes_per_param * numel / 2`` bytes each (read + write = the bytes per step)."""
    half = backend.copy_bytes_per_param * numel // 2
    src = torch.zeros(half, dtype=torch.uint8, device=backend.device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * half


def grads_checksum(grads: Mapping[torch.dtype, list[torch.Tensor]]) -> list[float]:
    """Float64 sums of every shared gradient (to check no contender wrote to them)."""
    return [float(g.double().sum()) for gs in grads.values() for g in gs]
