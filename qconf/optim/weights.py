"""How low-precision (bf16/fp16) parameters receive an update computed in fp32 (the reference;
``csrc/include/qconf/element.h`` does the same bit for bit).

* ``nearest``: round to nearest even (what ``p.copy_(p32)`` does for finite values).
* ``stochastic``: bf16 -- add a random 16-bit integer to the fp32 bit pattern and truncate to the
  upper 16 bits, so ``x`` rounds away from zero with probability (dropped bits) / 2^16; fp16 --
  round to the neighbour away from zero with probability (distance to the lower neighbour) / ulp.
  Both are unbiased. NaN and +-Inf pass through unchanged; a finite value never becomes infinite
  (results past the largest finite value saturate to it); signed zeros and subnormals are handled
  like any other value.
* ``kahan``: a compensation buffer ``c`` carries what rounding dropped into the next step::

      u  = p_new - p_old          (the fp32 update)
      c1 = c + u
      t  = p_old + c1
      p  = round(t)               (nearest, or stochastic when both are configured)
      c  = c1 + (p_old - p)       (the part of the update that rounding lost)

  ``c`` is stored in the parameter's dtype, or quantized with ``weights.compensation_codec``.

Random bits come from the counter-based stream ``(seed, step, parameter index, STREAM_PARAM)``:
bf16 uses 16 bits per element, half of a 32-bit hash (element ``i`` the top half of hash ``i >> 1``
for even ``i``, the low half for odd ``i``: one hash per two elements), fp16 the uniform
``(h >> 8) * 2^-24`` of a hash per element.
"""
from __future__ import annotations

import torch

from ..codec import rng

LOW_PRECISION = (torch.bfloat16, torch.float16)
_U32 = 0xFFFFFFFF


def _bits32(x: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns as non-negative int64."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _U32


def _from_bits16(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bf16/fp16 tensor from int64 16-bit patterns."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return signed.to(torch.int16).view(dtype)


def bf16_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest even; NaN keeps its sign and becomes quiet."""
    u = _bits32(x)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return _from_bits16(torch.where(nan, (u >> 16) | 0x40, rounded), torch.bfloat16).reshape(x.shape)


def bf16_stochastic(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 with stochastic rounding; ``r16`` holds random integers in [0, 2^16)."""
    u = _bits32(x)
    nonfinite = (u & 0x7F800000) == 0x7F800000
    v = (u + r16.reshape(u.shape)) & 0xFFFF0000  # carries into the exponent exactly as rounding up should
    v = torch.where((v & 0x7F800000) == 0x7F800000, (u & 0x80000000) | 0x7F7F0000, v)  # never round to Inf
    nan_quiet = torch.where((u & 0x7FFFFFFF) > 0x7F800000, 0x40, 0)
    out = torch.where(nonfinite, (u >> 16) | nan_quiet, v >> 16)
    return _from_bits16(out, torch.bfloat16).reshape(x.shape)


def _f16_from_magnitude(mag: torch.Tensor) -> torch.Tensor:
    return _from_bits16(mag, torch.float16).float()


def f16_stochastic(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16 with stochastic rounding; ``u`` holds uniforms in [0, 1)."""
    x = x.contiguous()
    h = x.half()
    hb = h.view(torch.int16).to(torch.int64) & 0xFFFF
    sign, mag = hb & 0x8000, hb & 0x7FFF
    ax = x.abs()
    lo = torch.where(_f16_from_magnitude(mag) > ax, mag - 1, mag)  # toward zero
    lo_v = _f16_from_magnitude(lo)
    hi = lo + 1
    hi_v = _f16_from_magnitude(torch.where(hi >= 0x7C00, lo, hi))
    p_up = (ax - lo_v) / (hi_v - lo_v)  # exact: a difference of neighbours and a power-of-two ulp
    up = (u.reshape(x.shape) < p_up) & (lo_v != ax) & (hi < 0x7C00)  # saturate below Inf
    out = torch.where(torch.isfinite(x), sign | torch.where(up, hi, lo), hb)
    return _from_bits16(out, torch.float16)


def param_bits(seed: int, step: int, index: int, dtype: torch.dtype, numel: int, device: torch.device,
               offset: int = 0) -> torch.Tensor:
    """The random bits per element of a ``dtype`` parameter's stream at ``step``, an int64 tensor
    of ``numel`` uint32 values (element indexes ``offset ..``: a shard starting at global element
    ``offset`` gets the whole tensor's bits). bf16 uses 16 bits per element, the top half of each
    value (``rng.pair_halves``: one hash per two elements); fp16 uses a 32-bit hash per element."""
    key = rng.stream_key(seed, step, index, rng.STREAM_PARAM)
    if dtype == torch.bfloat16:
        return rng.pair_halves(key, numel, device, offset)
    return rng.hash_bits(key, numel, device, offset)


def round_param(x: torch.Tensor, dtype: torch.dtype, stochastic: bool, bits: torch.Tensor | None) -> torch.Tensor:
    """Round fp32 values ``x`` to ``dtype`` (bf16/fp16) by nearest or stochastic rounding."""
    if dtype == torch.bfloat16:
        return bf16_stochastic(x, bits >> 16) if stochastic else bf16_nearest(x)
    if stochastic:
        return f16_stochastic(x, (bits >> 8).to(torch.float32) * 2.0**-24)
    return x.half()


def kahan_update(p_old: torch.Tensor, p_new: torch.Tensor, comp: torch.Tensor, dtype: torch.dtype,
                 stochastic: bool, bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One compensated write (fp32 ``p_old``/``p_new``/``comp``); returns (param in ``dtype``, new fp32 comp)."""
    c1 = comp + (p_new - p_old)
    t = p_old + c1
    p = round_param(t, dtype, stochastic, bits)
    return p, c1 + (p_old - p.float())
