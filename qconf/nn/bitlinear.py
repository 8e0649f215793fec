"""``BitLinear``: BitNet b1.58 training of an ``nn.Linear`` through qconf's codecs.

Forward, for an input ``x [..., K]`` (flattened to ``[M, K]`` rows), latent weights ``W [N, K]``
and an optional bias ``b [N]``, with the two codecs of :class:`~qconf.config.BitNetConfig`:

1. ``Xk, sx = activation_codec.encode_integers(x)``: int8 levels ``[M, K]`` in ``-MRQ..MRQ``
   (``MRQ = 127`` at 8 bits), one scale per row ``sx = max(max|x_row|, activation_eps)``;
   ``Wk, sw = weight_codec.encode_integers(W)``: int8 levels ``[N, K]`` in ``{-1, 0, +1}``, one
   scale ``sw = max(mean|W|, weight_eps)``. Both round ``x * f`` half to even with the codec's
   factor ``f = fp32(1 / s) * MRQ`` (torch's ``MRQ / s``, BitNet's ``scale``).
2. ``A = Xk @ Wk^T``, the exact integer product (int32 range: ``|A| <= MRQ * K``), converted to
   fp32 (exact while ``MRQ * K <= 2**24``; rounded to nearest even beyond). :func:`integer_matmul`
   computes it on a CPU with AVX2 by qconf's own kernel (:func:`qconf.ops.ternary_mm`: vpmaddubsw
   on the bytes, int16 then int32 sums, ~2.5x faster than an fp32 GEMM here); on CUDA (``M > 16``,
   ``K`` and ``N`` multiples of 8) by ``torch._int_mm``; elsewhere as an fp32 matmul of the
   levels, which is exact because every partial sum is an integer of magnitude
   ``<= MRQ * K <= 2**24``, or a float64 matmul beyond that bound (``K > 132104`` at 8 bits).
3. ``y = A / (fx * fw) (+ b)``, all fp32: ``fx [M, 1]`` and ``fw`` are the two codecs' factors,
   their product is rounded once, then one fp32 division per element, then the bias add (in
   fp32, the bias converted exactly). The result is cast to the output dtype: the autocast
   dtype when autocast is on for x's device, else x's dtype.

Backward, straight-through (the rounding and the clamps count as the identity), in fp32:
``grad_x = g @ Wq`` with ``Wq = weight_codec.decode_integers(Wk, sw)`` (``Wk / fw``, the ternary
weights the forward used), ``grad_W = g^T @ Xq`` with ``Xq = activation_codec.decode_integers(Xk,
sx)``, ``grad_b = g.sum(0)``; each cast to its input's dtype. Saved for backward: ``Xk`` (int8),
``sx`` (fp32 per row), ``sw`` and the latent weight by reference (``Wk`` is rounded from it and
``sw`` again in backward -- the same levels, as the weight has not changed; autograd's version
check refuses an in-place change in between) -- 1 byte per input element instead of fp32's 4, never the fp32 input.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..codec import Codec
from ..codec.integer import level_factors
from ..codec.qmap import integer_grid_mrq
from ..config import BitNetConfig
from ..ops import ternary_mm, ternary_mm_available

__all__ = ["BitLinear", "bit_linear", "bit_linear_product", "quantized_forward", "output_dtype", "integer_matmul",
           "rescale_"]

#: torch's CPU ``_int_mm`` calls oneDNN only with AVX-512 VNNI (and mkldnn on); otherwise it is a
#: scalar loop (aten/src/ATen/native/LinearAlgebra.cpp, ``_int_mm_out_cpu``). Read once, at import.
_CPU_INT_MM_FAST = bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)()) and \
    torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
#: qconf's int8 x ternary kernel runs here (AVX2; QCONF_CPU_ISA read once, at import, so that the
#: choice is a constant to torch.compile).
_TERNARY_MM = ternary_mm_available()
_FP32_EXACT = 1 << 24  # every integer of magnitude <= 2**24 is an fp32 number
_TERNARY_MM_MAX_K = 1 << 22


def _mrq(codec: Codec) -> int:
    mrq = integer_grid_mrq(codec.map, codec.bits, codec.signed)
    if mrq is None or codec.rounding != "nearest-even":
        raise ValueError(f"a BitLinear codec needs an integer grid with rounding 'nearest-even', got {codec!r}")
    return mrq


def _uses_int_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    m, k = a.shape
    if a.device.type == "cuda":
        return m > 16 and k % 8 == 0 and b.shape[0] % 8 == 0
    return a.device.type == "cpu" and _CPU_INT_MM_FAST


def _uses_ternary_mm(a: torch.Tensor, b_bound: int) -> bool:
    return _TERNARY_MM and b_bound <= 1 and a.device.type == "cpu" and a.shape[1] <= _TERNARY_MM_MAX_K


def integer_matmul(a: torch.Tensor, b: torch.Tensor, a_bound: int, b_bound: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[M, N]`` of the exact integer product ``a @ b.T`` of int8 ``a [M, K]`` and int8
    ``b [N, K]`` whose entries are at most ``a_bound`` and ``b_bound`` in magnitude, each sum
    rounded once to fp32; written into ``out`` (contiguous fp32 ``[M, N]``) when given. The path
    (module docstring, step 2) never changes the result."""
    k = a.shape[1]
    if out is None:
        out = torch.empty(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    if _uses_ternary_mm(a, b_bound):
        return ternary_mm(a, b, out)
    if _uses_int_mm(a, b):
        return out.copy_(torch._int_mm(a, b.t()))
    if a_bound * b_bound * k <= _FP32_EXACT:  # every partial sum is an integer fp32 holds exactly
        return torch.mm(a.to(torch.float32), b.to(torch.float32).t(), out=out)
    return out.copy_(a.to(torch.float64) @ b.to(torch.float64).t())


def bit_linear_product(x_levels: torch.Tensor, x_scales: torch.Tensor, w_levels: torch.Tensor,
                       w_scales: torch.Tensor, bias: torch.Tensor | None, activation_codec: Codec,
                       weight_codec: Codec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 2-3 of the forward (module docstring): fp32 ``[M, N]`` ``A / (fx * fw) (+ b)`` from
    int8 ``x_levels [M, K]`` with fp32 ``x_scales [M]`` and int8 ``w_levels [N, K]`` with fp32
    ``w_scales [1]``, written into ``out`` (fp32 ``[M, N]``) when given. Shared by training
    (:class:`BitLinear`) and inference (:class:`qconf.nn.BitLinearInference`), so that both give
    the same bits."""
    acc = integer_matmul(x_levels, w_levels, _mrq(activation_codec), _mrq(weight_codec), out)
    return rescale_(acc, x_scales, w_scales, bias, activation_codec, weight_codec)


def rescale_(acc: torch.Tensor, x_scales: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None,
             activation_codec: Codec, weight_codec: Codec) -> torch.Tensor:
    """Step 3 of the forward, in place: fp32 ``acc [M, N]`` (the integer product) becomes
    ``acc / fp32(fx * fw) (+ b)`` (no new buffer: a fresh [M, N] one costs its page faults)."""
    fx, fw = level_factors(x_scales, _mrq(activation_codec)), level_factors(w_scales, _mrq(weight_codec))
    factors = fx.unsqueeze(1) * fw
    if bias is None:
        return acc.div_(factors)
    # b + A / f: the same two roundings, one pass
    return torch.addcdiv(bias.to(torch.float32), acc, factors, out=acc)


def quantized_forward(x: torch.Tensor, w_levels: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None,
                      weight_codec: Codec, activation_codec: Codec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward from quantized weights (int8 ``w_levels [N, K]``, fp32 ``w_scales [1]``):
    ``(y, x_levels, x_scales)`` with ``y`` in :func:`output_dtype` and x's leading dimensions
    (``[..., N]``), and x's int8 levels ``[M, K]`` and fp32 row scales ``[M]``. Autocast is off
    inside: every step is the fp32 of the module docstring."""
    with torch.autocast(x.device.type, enabled=False):
        x_levels, x_scales = activation_codec.encode_integers(x.reshape(-1, x.shape[-1]))
        # the result is written into a tensor of the output's shape, so the layer never returns a
        # view (FSDP2 warns that an in-place op on a module's view output skips its backward hook)
        y = torch.empty(*x.shape[:-1], w_levels.shape[0], dtype=torch.float32, device=x.device)
        bit_linear_product(x_levels, x_scales, w_levels, w_scales, bias, activation_codec, weight_codec,
                           y.view(-1, w_levels.shape[0]))
    dtype = output_dtype(x)
    return (y if dtype == torch.float32 else y.to(dtype)), x_levels, x_scales


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a BitLinear returns for input ``x``: autocast's when it is on for x's device,
    else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _BitLinearFunction(torch.autograd.Function):
    """Quantized forward and straight-through backward (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_codec: Codec, activation_codec: Codec) -> torch.Tensor:
        w_levels, w_scales = weight_codec.encode_integers(weight)
        y, x_levels, x_scales = quantized_forward(x, w_levels, w_scales, bias, weight_codec, activation_codec)
        # the weight is saved by reference (no memory: it is the Parameter) with its scale and
        # rounded again in backward, which costs one more pass over it but keeps only int8
        # activations alive
        ctx.save_for_backward(x_levels, x_scales, weight, w_scales)
        ctx.codecs = (weight_codec, activation_codec)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_levels, x_scales, weight, w_scales = ctx.saved_tensors
        weight_codec, activation_codec = ctx.codecs
        # the forward's levels: the weight is unchanged (autograd's version check), so is its scale
        w_levels, _ = weight_codec.encode_integers(weight, scales=w_scales)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            g = grad_out.reshape(-1, grad_out.shape[-1]).to(torch.float32)
            if need_x:
                grad_x = (g @ weight_codec.decode_integers(w_levels, w_scales)).to(x_dtype).reshape(ctx.x_shape)
            if need_w:
                grad_w = (g.t() @ activation_codec.decode_integers(x_levels, x_scales)).to(w_dtype)
            if need_b:
                grad_b = g.sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None


def bit_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_codec: Codec,
               activation_codec: Codec) -> torch.Tensor:
    """BitNet b1.58 ``F.linear``: ``x [..., K]`` (fp32/bf16/fp16), latent ``weight [N, K]``,
    ``bias [N]`` or None -> ``[..., N]`` in :func:`output_dtype`; differentiable in all three
    (straight-through estimator). Formulas: module docstring."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features in its last dimension, the weight expects "
                         f"{weight.shape[1]}")
    return _BitLinearFunction.apply(x, weight, bias, weight_codec, activation_codec)


class BitLinear(nn.Linear):
    """A drop-in ``nn.Linear`` trained as BitNet b1.58: ternary absmean weights and per-row int8
    absmax activations in the forward, full-precision latent ``weight``/``bias`` Parameters (the
    same names, shapes and state-dict keys as ``nn.Linear``) updated through a straight-through
    estimator.

    Args: those of ``nn.Linear``, plus ``config``, the :class:`~qconf.config.BitNetConfig` whose
    codecs it uses (default ``BitNetConfig()``; ``enable``/``modules``/``exclude`` play no part
    here). Input ``[..., in_features]`` fp32/bf16/fp16 -> ``[..., out_features]`` (see
    :func:`output_dtype`). Attributes ``weight_codec``, ``activation_codec``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None, *, config: BitNetConfig | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._set_codecs(config if config is not None else BitNetConfig())

    def _set_codecs(self, config: BitNetConfig) -> None:
        self.weight_codec: Codec = config.weight_codec()
        self.activation_codec: Codec = config.activation_codec()

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: BitNetConfig | None = None) -> "BitLinear":
        """A BitLinear that takes over ``linear``: the same Parameter objects (an optimizer built
        on them keeps working), buffers, hooks and training flag; ``linear`` is not modified."""
        new = cls.__new__(cls)
        for key, value in vars(linear).items():
            new.__dict__[key] = value.copy() if isinstance(value, dict) else value  # own dicts, same tensors
        new._set_codecs(config if config is not None else BitNetConfig())
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bit_linear(x, self.weight, self.bias, self.weight_codec, self.activation_codec)

    def extra_repr(self) -> str:
        mrq = _mrq(self.activation_codec)
        return (f"{super().extra_repr()}, weights=ternary absmean (eps={self.weight_codec.min_scale:g}), "
                f"activations={self.activation_codec.bits}-bit absmax per row (levels +-{mrq}, "
                f"eps={self.activation_codec.min_scale:g})")
