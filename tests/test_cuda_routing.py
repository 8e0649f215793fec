"""Which CUDA parameters take the fused step, by the CUDA kernel choice (QCONF_CUDA_KERNELS), decided
on the host: no GPU needed (the parameters are stand-ins that report a CUDA device).

The generic CUDA kernel (the default) has no quantized Kahan buffer and no split step; the
specialized kernels have both, so with them a CUDA parameter fuses wherever a CPU one does.
"""
from __future__ import annotations

import types

import pytest
import torch

import qconf.optim.fused
from qconf import _native
from qconf.optim import AdamW

if not _native.fused_available():  # pragma: no cover - the CI build always has the extension
    pytest.skip(f"fused kernels unavailable: {_native.native_error()}", allow_module_level=True)

QUANTIZED_KAHAN = {"min_numel": 0, "weights": {"compensation": "kahan", "compensation_codec": {"bits": 8}}}


def _on_cuda(p: torch.Tensor):
    """A stand-in for ``p`` on a GPU: what the routing reads (device, dtype, shape, contiguity)."""
    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=p.dtype, shape=p.shape, dim=p.dim,
                                 is_contiguous=p.is_contiguous, numel=p.numel)


def test_the_choice_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("QCONF_CUDA_KERNELS", raising=False)
    assert _native.cuda_kernels() == "generic"
    monkeypatch.setenv("QCONF_CUDA_KERNELS", "specialized")
    assert _native.cuda_kernels() == "specialized"
    monkeypatch.setenv("QCONF_CUDA_KERNELS", "generic")
    assert _native.cuda_kernels() == "generic"
    monkeypatch.setenv("QCONF_CUDA_KERNELS", "fast")
    with pytest.raises(RuntimeError, match="'fast' is not a CUDA kernel choice; use 'generic'.*or 'specialized'"):
        _native.cuda_kernels()


def test_a_quantized_kahan_buffer_fuses_on_cuda_with_the_specialized_kernels(monkeypatch):
    p = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.bfloat16))
    opt = AdamW([p], qconfig=QUANTIZED_KAHAN)
    monkeypatch.delenv("QCONF_CUDA_KERNELS", raising=False)
    reason = opt._cuda_unfused(_on_cuda(p), 0)
    assert reason is not None and "QCONF_CUDA_KERNELS=specialized" in reason and "compensation_codec" in reason
    assert opt._cuda_unfused(p, 0) is None  # (the CPU kernel has it)
    monkeypatch.setenv("QCONF_CUDA_KERNELS", "specialized")
    assert opt._cuda_unfused(_on_cuda(p), 0) is None


def test_cuda_shards_take_the_split_step_with_the_specialized_kernels(monkeypatch):
    monkeypatch.setattr(qconf.optim.fused, "has_cuda_kernels", lambda: True)  # (as a CUDA build)
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = AdamW([p])
    monkeypatch.delenv("QCONF_CUDA_KERNELS", raising=False)
    reason = opt._shard_unfusable(_on_cuda(p), 0)
    assert reason is not None and "QCONF_CUDA_KERNELS=specialized" in reason
    monkeypatch.setenv("QCONF_CUDA_KERNELS", "specialized")
    assert opt._shard_unfusable(_on_cuda(p), 0) is None
    assert opt._shard_unfusable(p, 0) is None
