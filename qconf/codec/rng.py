"""Counter-based uniform random numbers for stochastic rounding inside optimizers.

A random value is a pure function of ``(seed, step, tensor, stream, element index)``, so results do
not depend on thread count, ISA or the order in which blocks are processed, and the reference path
(torch ops below) and the native kernels (``csrc/include/qconf/element.h``) produce the same bits.

    key  = splitmix64(seed, step, tensor, stream)        -> two 32-bit keys (k0, k1), on the host
    h    = mix32(mix32(lo32(i) ^ k0) ^ (hi32(i) + k1))    per element i (uint32 arithmetic)
    u    = (h >> 8) * 2**-24                              in [0, 1), exact in fp32

Consumers of 16 random bits (bf16 stochastic rounding of parameters) take half a hash each:
element i uses the top half of h(i >> 1) for even i, the low half for odd i (``pair_halves``).

``mix32`` is the "lowbias32" integer hash (Wellons), a bijection with strong avalanche.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B

# Streams: independent random sequences for different purposes at the same (step, tensor).
STREAM_EXP_AVG = 0
STREAM_EXP_AVG_SQ = 1
STREAM_PARAM = 2
STREAM_COMPENSATION = 3


def splitmix64(x: int) -> int:
    """One splitmix64 output for state ``x`` (Python ints, exact 64-bit arithmetic)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, step: int, tensor: int, stream: int) -> tuple[int, int]:
    """Derive the two 32-bit keys for one (seed, step, tensor, stream)."""
    h = splitmix64(seed & MASK64)
    for part in (step, tensor, stream):
        h = splitmix64(h ^ (part & MASK64))
    return h & MASK32, h >> 32


def mix32_int(x: int) -> int:
    """Scalar ``mix32`` on a Python int (used by tests as an independent oracle)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 tensors holding uint32 values, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 hash on an int64 tensor of uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def hash_at(key: tuple[int, int], idx: torch.Tensor) -> torch.Tensor:
    """32 random bits for each stream element index in ``idx`` (int64, non-negative), as int64."""
    k0, k1 = key
    h = mix32((idx & MASK32) ^ k0)
    return mix32(h ^ (((idx >> 32) + k1) & MASK32))


def hash_bits(key: tuple[int, int], numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """32 random bits per element index ``offset .. offset+numel-1``, as an int64 tensor."""
    return hash_at(key, torch.arange(offset, offset + numel, device=device, dtype=torch.int64))


def pair_halves(key: tuple[int, int], numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """16 random bits per element index ``i = offset .. offset+numel-1``, in the top half of an
    int64 tensor's low 32 bits (low half zero for odd ``i``): element ``i`` takes the top half of
    the hash of stream element ``i >> 1`` when ``i`` is even, its low half when ``i`` is odd. One
    hash serves two elements; a shard starting at any ``offset`` draws the whole tensor's bits."""
    idx = torch.arange(offset, offset + numel, device=device, dtype=torch.int64)
    h = hash_at(key, idx >> 1)
    return torch.where((idx & 1) == 1, (h << 16) & MASK32, h)


def uniform(key: tuple[int, int], numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """Uniform fp32 values in [0, 1) with 24-bit resolution, one per element index
    ``offset .. offset+numel-1`` (a shard starting at global element ``offset`` draws the values
    the whole tensor would)."""
    return (hash_bits(key, numel, device, offset) >> 8).to(torch.float32) * (2.0**-24)
