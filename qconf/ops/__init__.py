"""The native operators' torch.library registrations beyond what ``qconf._C`` registers itself.

Importing ``qconf._C`` (:mod:`qconf._native`) defines the ``torch.ops.qconf`` operators and their
CPU (and CUDA) kernels: ``fused_step``, ``encode``, ``decode``, ``layout`` and the ``StepPlan``
class. This module adds their fake (meta) implementations, which ``torch.compile`` needs to trace
a step or an encode without running it, and :func:`fused_step`, the op as the fused stepper calls
it under compilation (importing it is what makes the fake implementations present). Nothing else
lives here: the codecs' native form is in :mod:`qconf.codec.native`, the fused stepper in
:mod:`qconf.optim.fused`.
"""
from __future__ import annotations

import torch

from .._native import fused_available, layout

__all__ = ["fused_step"]


def fused_step(rule: int, params: list[torch.Tensor], grads: list[torch.Tensor], steps: list[torch.Tensor],
               states: list[torch.Tensor], meta: torch.Tensor, tables: torch.Tensor, hyper: list[float],
               seed: int) -> None:
    """``torch.ops.qconf.fused_step``: one optimizer step of a param group, in place on ``params``,
    ``steps`` and ``states``; traceable by torch.compile through the fake implementation below."""
    torch.ops.qconf.fused_step(rule, params, grads, steps, states, meta, tables, hyper, seed)


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
