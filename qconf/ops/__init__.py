"""The native operators' torch.library registrations beyond what ``qconf._C`` registers itself.

Importing ``qconf._C`` (:mod:`qconf._native`) defines the ``torch.ops.qconf`` operators and their
CPU (and CUDA) kernels: ``fused_step``, ``encode``, ``decode``, ``ternary_mm``, the integer codec's
row passes (``absmax_rows``, ``round_levels``, ``divide_levels``), ``layout`` and the ``StepPlan``
class. This module adds their fake (meta) implementations, which ``torch.compile``
needs to trace a step, an encode or a product without running it; :func:`fused_step`, the op as
the fused stepper calls it under compilation (importing it is what makes the fake implementations
present); and :func:`ternary_mm`, BitLinear's exact int8 x ternary product on AVX2 CPUs. Nothing else
lives here: the codecs' native form is in :mod:`qconf.codec.native`, the fused stepper in
:mod:`qconf.optim.fused`.
"""
from __future__ import annotations

import torch

from .._native import fused_available, layout

__all__ = ["fused_step", "ternary_mm", "ternary_mm_available"]


def fused_step(rule: int, params: list[torch.Tensor], grads: list[torch.Tensor], steps: list[torch.Tensor],
               states: list[torch.Tensor], meta: torch.Tensor, tables: torch.Tensor, hyper: list[float],
               seed: int) -> None:
    """``torch.ops.qconf.fused_step``: one optimizer step of a param group, in place on ``params``,
    ``steps`` and ``states``; traceable by torch.compile through the fake implementation below."""
    torch.ops.qconf.fused_step(rule, params, grads, steps, states, meta, tables, hyper, seed)


def ternary_mm_available() -> bool:
    """True when :func:`ternary_mm` runs here: the extension has it and the CPU gives AVX2 (read
    now, with ``QCONF_CPU_ISA`` honoured; an unusable QCONF_CPU_ISA reads as False here and is an
    error where a kernel runs)."""
    if not (fused_available() and hasattr(torch.ops.qconf, "ternary_mm")):
        return False
    try:
        return torch.ops.qconf.cpu_isa() != "scalar"
    except (RuntimeError, ValueError):
        return False


def ternary_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = x @ w.T``, exact: int8 ``x [M, K]`` (any values), int8 ``w [N, K]`` holding only
    -1, 0 and +1, fp32 ``out [M, N]`` (contiguous; written in place and returned) -- the integer
    sums, each rounded once to fp32 (exact while ``|sum| <= 2**24``). CPU only, needs AVX2
    (:func:`ternary_mm_available`), ``K <= 2**22``; anything else is a RuntimeError that leaves
    ``out`` as it was. Kernel: csrc/cpu/ternary_mm*.cpp (vpmaddubsw, int16 then int32 sums)."""
    torch.ops.qconf.ternary_mm(x, w, out)
    return out


if fused_available():
    @torch.library.register_fake("qconf::fused_step")
    def _fused_step_fake(rule, params, grads, steps, states, meta, tables, hyper, seed):  # noqa: ANN001
        return None  # updates params, steps and states in place

    @torch.library.register_fake("qconf::encode")
    def _encode_fake(x, table, codec, noise):  # noqa: ANN001
        lay = layout()
        bits, num_scales = codec[lay["codec.bits"]], codec[lay["encode.num_scales"]]
        return (x.new_empty(((x.numel() * bits + 7) // 8,), dtype=torch.uint8),
                x.new_empty((num_scales,), dtype=torch.float32))

    @torch.library.register_fake("qconf::decode")
    def _decode_fake(codes, scales, table, codec, shape):  # noqa: ANN001
        return scales.new_empty(tuple(shape), dtype=torch.float32)

    @torch.library.register_fake("qconf::ternary_mm")
    def _ternary_mm_fake(x, w, out):  # noqa: ANN001
        return None  # writes out in place

    @torch.library.register_fake("qconf::absmax_rows")
    def _absmax_rows_fake(x):  # noqa: ANN001
        return x.new_empty((x.shape[0],), dtype=torch.float32)

    @torch.library.register_fake("qconf::round_levels")
    def _round_levels_fake(x, factors, mrq):  # noqa: ANN001
        return x.new_empty(x.shape, dtype=torch.int8)

    @torch.library.register_fake("qconf::divide_levels")
    def _divide_levels_fake(levels, factors):  # noqa: ANN001
        return levels.new_empty(levels.shape, dtype=torch.float32)
