"""``BitLinear``: BitNet b1.58 training of an ``nn.Linear`` through qconf's codecs.

Forward, for an input ``x [..., K]`` (flattened to ``[M, K]`` rows), latent weights ``W [N, K]``
and an optional bias ``b [N]``, with the two codecs of :class:`~qconf.config.BitNetConfig`:

1. ``Xk, sx = activation_codec.encode_integers(x)``: int8 levels ``[M, K]`` in ``-MRQ..MRQ``
   (``MRQ = 127`` at 8 bits), one scale per row ``sx = max(max|x_row|, activation_eps)``;
   ``Wk, sw = weight_codec.encode_integers(W)``: int8 levels ``[N, K]`` in ``{-1, 0, +1}``, one
   scale ``sw = max(mean|W|, weight_eps)``. Both round ``x * f`` half to even with the codec's
   factor ``f = fp32(1 / s) * MRQ`` (torch's ``MRQ / s``, BitNet's ``scale``). The layer calls
   :func:`encode_activations` and :func:`encode_weight`: the codecs' bits in fewer passes.
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
   dtype when autocast is on for x's device, else x's dtype. On the ``torch._int_mm`` path the
   int32 product is read and the output dtype written in one pass (the same bits).

Backward, straight-through (the rounding and the clamps count as the identity), with ``g`` the
output gradient as ``[M, N]``, ``fx [M]`` and ``fw`` the factors above (``Xq = Xk / fx`` and
``Wq = Wk / fw`` are the values the forward multiplied):

* autocast off in the forward (recorded in ``ctx``; autograd runs the backward without autocast):
  fp32, exactly as before: ``grad_x = g @ Wq``, ``grad_W = g^T @ Xq`` with ``Wq, Xq`` decoded by
  the codecs (``decode_integers``), ``grad_b = g.sum(0)``; each cast to its input's dtype.
* autocast on in the forward with dtype ``L`` (bf16 or fp16; ``g`` then arrives in ``L``, the
  output's dtype): the two products take the levels, exact in ``L`` (``|k| <= 127``), and the
  fp32 factors apart -- ``grad_x = fp32(g @ Wk) / fw`` and ``grad_W = fp32(L(g / fx[:, None])^T
  @ Xk)``. Rounding: ``g / fx`` is computed in fp32 and rounded once to ``L`` (the one rounding
  an autocast matmul's operand gets; ``g`` itself is already in ``L``); every product of an
  ``L`` value and a level is exact in fp32 and the sums are fp32 (:func:`lowp_products`: the ``L`` GEMM with
  fp32 output on CUDA, an fp32 GEMM of the same values elsewhere); ``/ fw`` is an fp32 division;
  then one cast to the input's / weight's dtype. ``grad_b = g.sum(0)`` accumulated in fp32.
  Against the exact (float64) straight-through gradients, elementwise, ``u_L`` = 2^-8 for bf16
  and 2^-11 for fp16 (the rounding of ``g / fx``), ``e = 2^-24``: ``|d grad_W| <= (u_L + 2 M e) *
  (|g|^T @ |Xq|)`` (fp16: ``+ 2^-25 * sum_m |Xk|``, below its normal range), ``|d grad_x| <= 2 N e
  * (|g| @ |Wq|)``, ``|d grad_b| <= 2 M e * sum|g|``, plus the final cast's rounding where the
  input / weight / bias is not fp32 (docs/bitnet.md).

Saved for backward: ``Xk`` (int8), ``sx`` (fp32 per row), ``sw`` and the latent weight by
reference (``Wk`` is rounded from it and ``sw`` again in backward -- the same levels, as the
weight has not changed; autograd's version check refuses an in-place change in between) -- 1 byte
per input element instead of fp32's 4, never the fp32 input.

The encodes (:func:`encode_activations`, :func:`encode_weight`) give the codecs' bits in fewer
passes for the two codecs of :class:`~qconf.config.BitNetConfig`: one reduction for the row absmax
(``vector_norm(ord=inf)`` of the input with its non-finite elements zeroed), no fp32 copy of a
bf16/fp16 input, no clamp where the row's own absmax bounds the levels, ternary levels as
``sign(round(w * f))``, a single clamp for a scale; any other codec goes through
``Codec.encode_integers``. On a CPU the codecs' native one-pass row kernels run as before.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..codec import Codec
from .._native import row_kernels
from ..codec.integer import level_factors, round_to_levels
from ..codec.scales import FLT_MAX, FLT_MIN
from ..codec.qmap import integer_grid_mrq
from ..config import BitNetConfig
from ..ops import ternary_mm, ternary_mm_available

__all__ = ["BitLinear", "bit_linear", "bit_linear_product", "quantized_forward", "output_dtype", "integer_matmul",
           "rescale_", "autocast_dtype", "encode_activations", "encode_weight", "lowp_products"]

#: torch's CPU ``_int_mm`` calls oneDNN only with AVX-512 VNNI (and mkldnn on); otherwise it is a
#: scalar loop (aten/src/ATen/native/LinearAlgebra.cpp, ``_int_mm_out_cpu``). Read once, at import.
_CPU_INT_MM_FAST = bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)()) and \
    torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
#: qconf's int8 x ternary kernel runs here (AVX2; QCONF_CPU_ISA read once, at import, so that the
#: choice is a constant to torch.compile).
_TERNARY_MM = ternary_mm_available()
_FP32_EXACT = 1 << 24  # every integer of magnitude <= 2**24 is an fp32 number
_TERNARY_MM_MAX_K = 1 << 22
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what the codecs encode
#: ``torch.mm(..., out_dtype=)`` (aten::mm.dtype, CUDA) exists in this torch (setup.py allows older ones)
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


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
    return _rescale_into(acc, _factors(x_scales, w_scales, activation_codec, weight_codec), bias, acc)


def _factors(x_scales: torch.Tensor, w_scales: torch.Tensor, activation_codec: Codec,
             weight_codec: Codec) -> torch.Tensor:
    """fp32 ``[M, 1]``: ``fx * fw`` per row, rounded once (step 3)."""
    fx, fw = level_factors(x_scales, _mrq(activation_codec)), level_factors(w_scales, _mrq(weight_codec))
    return fx.unsqueeze(1) * fw


def _uses_fused_int_mm(x_levels: torch.Tensor, w_levels: torch.Tensor, weight_codec: Codec) -> bool:
    """The product is ``torch._int_mm``'s (CUDA, or a CPU with VNNI and no qconf kernel): step 3 then
    reads its int32 result directly."""
    return not _uses_ternary_mm(x_levels, _mrq(weight_codec)) and _uses_int_mm(x_levels, w_levels)


def _rescale_into(acc: torch.Tensor, factors: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor) -> torch.Tensor:
    """Step 3 in one pass into ``out [M, N]``: ``fp32(A) / f (+ b)`` in fp32 from the product ``acc
    [M, N]`` (fp32, or ``torch._int_mm``'s int32: converted to fp32 first, as step 2 converts it),
    then rounded once to out's
    dtype -- the same bits as the fp32 result cast. ``out`` may be ``acc`` itself (fp32: in place)."""
    if bias is None:
        return torch.div(acc, factors, out=out)
    # b + A / f: the same two roundings, one pass
    return torch.addcdiv(bias.to(torch.float32), acc, factors, out=out)


def quantized_forward(x: torch.Tensor, w_levels: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None,
                      weight_codec: Codec, activation_codec: Codec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward from quantized weights (int8 ``w_levels [N, K]``, fp32 ``w_scales [1]``):
    ``(y, x_levels, x_scales)`` with ``y`` in :func:`output_dtype` and x's leading dimensions
    (``[..., N]``), and x's int8 levels ``[M, K]`` and fp32 row scales ``[M]``. Autocast is off
    inside: every step is the fp32 of the module docstring."""
    dtype, n = output_dtype(x), w_levels.shape[0]
    with torch.autocast(x.device.type, enabled=False):
        x_levels, x_scales = encode_activations(activation_codec, x.reshape(-1, x.shape[-1]))
        # the result is written into a tensor of the output's shape, so the layer never returns a
        # view (FSDP2 warns that an in-place op on a module's view output skips its backward hook)
        if _uses_fused_int_mm(x_levels, w_levels, weight_codec):
            y = torch.empty(*x.shape[:-1], n, dtype=dtype, device=x.device)
            factors = _factors(x_scales, w_scales, activation_codec, weight_codec)
            _rescale_into(torch._int_mm(x_levels, w_levels.t()), factors, bias, y.view(-1, n))
            return y, x_levels, x_scales
        y = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device=x.device)
        bit_linear_product(x_levels, x_scales, w_levels, w_scales, bias, activation_codec, weight_codec,
                           y.view(-1, n))
    return (y if dtype == torch.float32 else y.to(dtype)), x_levels, x_scales


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a BitLinear returns for input ``x``: autocast's when it is on for x's device,
    else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The low-precision dtype (bf16 or fp16) autocast computes in on ``device_type`` now, or None
    when autocast is off there (or set to another dtype): what the forward records for the backward."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


# -- the encodes: the codecs' bits in fewer passes --------------------------------------------------
def _bounded_scale(codec: Codec, scale: str, statistic: str) -> bool:
    """``codec`` rounds ``nearest-even`` on an integer grid of int8 levels, with this scale type and
    statistic and a ``min_scale`` in [FLT_MIN, FLT_MAX]: then ``clamp(min_scale)`` alone is the
    codec's floor (its FLT_MIN floor never acts). Any other codec encodes itself (and raises its
    own errors)."""
    mrq = integer_grid_mrq(codec.map, codec.bits, codec.signed)
    return (codec.rounding == "nearest-even" and mrq is not None and 1 <= mrq <= 127 and codec.scale == scale
            and codec.statistic == statistic and FLT_MIN <= codec.min_scale <= FLT_MAX)


def encode_activations(codec: Codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``codec.encode_integers(x)`` for a 2-D ``x [M, K]`` (fp32/bf16/fp16/fp64), bit for bit:
    int8 levels ``[M, K]`` and fp32 row scales ``[M]``. For a ``dim0`` absmax codec (BitNet's) in
    fewer passes: on a CPU the native row passes (one each), elsewhere one reduction and four
    elementwise passes, with no fp32 copy of a bf16/fp16 input."""
    if x.dim() != 2 or x.numel() == 0 or x.dtype not in _FLOATS or not _bounded_scale(codec, "dim0", "absmax"):
        return codec.encode_integers(x)
    mrq = _mrq(codec)
    if row_kernels(x):
        x32 = x.to(torch.float32)
        scales = torch.ops.qconf.absmax_rows(x32).clamp_(min=codec.min_scale)
        return torch.ops.qconf.round_levels(x32, level_factors(scales, mrq), mrq), scales
    xs = x if x.dtype != torch.float64 else x.to(torch.float32)  # the codec rounds fp64 to fp32 first
    # max |x| over the row's finite elements (NaN and +-Inf count as 0): one reduction
    finite = torch.nan_to_num(xs, nan=0.0, posinf=0.0, neginf=0.0)
    scales = torch.linalg.vector_norm(finite, ord=math.inf, dim=1).to(torch.float32).clamp_(min=codec.min_scale)
    t = xs * level_factors(scales, mrq).unsqueeze(1)  # fp32: bf16/fp16 values promote exactly
    # s >= |x| for every finite x and f = MRQ / s within two fp32 roundings, so |round(x * f)| <= MRQ:
    # only the +-Inf products need the clamp, which nan_to_num gives them (NaN -> 0, as the codec)
    t.round_().nan_to_num_(nan=0.0, posinf=float(mrq), neginf=-float(mrq))
    return t.to(torch.int8), scales


def encode_weight(codec: Codec, w: torch.Tensor, scales: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``codec.encode_integers(w, scales=scales)`` bit for bit: int8 levels in w's shape and fp32
    scales ``[1]``. For a ``tensor`` absmean codec (BitNet's ternary weights) the scale takes one
    clamp instead of the codec's generic floor and cap (six small kernels fewer), and off the
    native CPU pass the ternary levels take one elementwise pass fewer (:func:`_ternary_levels`)."""
    if (w.numel() == 0 or w.dtype not in _FLOATS or not _bounded_scale(codec, "tensor", "absmean")
            or (scales is not None and (scales.dtype != torch.float32 or scales.shape != (1,)))):
        return codec.encode_integers(w, scales=scales)
    w32 = w.to(torch.float32)
    if scales is None:
        # mean |W| with NaN and +-Inf counted as 0 (torch.mean, as the codec); an overflowed (inf)
        # mean capped at FLT_MAX; min(max(m, min_scale), FLT_MAX) is the codec's cap, floor and clamp
        finite = w32.abs().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        scales = finite.mean().clamp_(min=codec.min_scale, max=FLT_MAX).reshape(1)
    mrq = _mrq(codec)
    factors = level_factors(scales, mrq).reshape(()).expand(w32.shape)
    if mrq == 1 and not row_kernels(w32):
        return _ternary_levels(w32, factors), scales
    return round_to_levels(w32, factors, mrq), scales


def _ternary_levels(w32: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """int8 ``clamp(round_half_even(w * f), -1, 1)``, NaN -> 0, of fp32 ``w32`` (round_to_levels at
    MRQ = 1) in three passes instead of four: ``sign(round(w * f))`` -- a rounded value is an integer,
    so its sign is its clamp to [-1, 1], and torch's sign is ``(0 < t) - (t < 0)``: +-1 for +-Inf,
    0 for NaN (c10::signum on CUDA, the same comparisons on the CPU)."""
    t = w32 * factors
    return t.round_().sign_().to(torch.int8)


# -- the backward ---------------------------------------------------------------------------------
def lowp_products(a: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M, N] = a @ levels`` for ``a [M, K]`` holding bf16/fp16 values and int8 ``levels
    [K, N]`` (``|k| <= 127``, exact in bf16/fp16): every product is exact in fp32 and the sums are
    fp32, in the GEMM's order. A bf16/fp16 ``a`` on CUDA: a GEMM in a's dtype with fp32 output
    (cuBLAS, fp32 accumulation; a torch without mm's ``out_dtype`` takes the fp32 GEMM, the same
    sums); otherwise an fp32 GEMM of the same values (``a`` may then be given
    in fp32 already; a CPU's bf16 GEMM returns bf16, which would round once more)."""
    if a.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16) and _MM_OUT_DTYPE:
        return torch.mm(a, levels.to(a.dtype), out_dtype=torch.float32)
    return torch.mm(a.to(torch.float32), levels.to(torch.float32))


def _divide_into(p: torch.Tensor, divisor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``p / divisor`` rounded once to ``dtype`` (in place when dtype is fp32)."""
    if dtype == torch.float32:
        return p.div_(divisor)
    return torch.div(p, divisor, out=torch.empty(p.shape, dtype=dtype, device=p.device))


def _fp32_grads(ctx: Any, g: torch.Tensor, x_levels: torch.Tensor, x_scales: torch.Tensor,
                w_levels: torch.Tensor, w_scales: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Autocast off: fp32 ``g @ Wq``, ``g^T @ Xq``, ``g.sum(0)`` (``g [M, N]`` any float dtype)."""
    weight_codec, activation_codec = ctx.codecs
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    g = g.to(torch.float32)
    grad_x = grad_w = grad_b = None
    if need_x:
        grad_x = (g @ weight_codec.decode_integers(w_levels, w_scales)).to(x_dtype).reshape(ctx.x_shape)
    if need_w:
        grad_w = (g.t() @ activation_codec.decode_integers(x_levels, x_scales)).to(w_dtype)
    if need_b:
        grad_b = g.sum(0).to(b_dtype)
    return grad_x, grad_w, grad_b


def _over_row_factors(g: torch.Tensor, gm: torch.Tensor, fx: torch.Tensor, lowp: torch.dtype) -> torch.Tensor:
    """``L(fp32(g / fx))``, ``g [M, N]`` in L, ``fx [M, 1]``: the fp32 quotient rounded once to L.
    On CUDA (``gm is g``) a new L tensor, one kernel; elsewhere in place in ``gm``, g's fp32 copy,
    which then holds those L values in fp32 (no new fp32 buffer: the CPU pays page faults for one)."""
    if gm is g:
        return torch.div(g, fx, out=torch.empty(g.shape, dtype=lowp, device=g.device))
    gm.div_(fx)
    return gm.copy_(gm.to(lowp))


def _lowp_grads(ctx: Any, g: torch.Tensor, x_levels: torch.Tensor, x_scales: torch.Tensor,
                w_levels: torch.Tensor, w_scales: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Autocast on in the forward (dtype ``L = ctx.lowp``): ``grad_x = fp32(g @ Wk) / fw``,
    ``grad_W = fp32(L(g / fx)^T @ Xk)``, ``grad_b = sum g`` in fp32 (``g [M, N]`` in L)."""
    weight_codec, activation_codec = ctx.codecs
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    g = g.to(ctx.lowp)  # a no-op: g has the output's dtype, L
    # the GEMMs' operand, exactly g: L on CUDA, else a fresh fp32 copy (the fp32 GEMMs of lowp_products)
    gm = g if g.device.type == "cuda" else g.to(torch.float32, copy=True)
    grad_x = grad_w = grad_b = None
    if need_b:
        grad_b = gm.sum(0, dtype=torch.float32).to(b_dtype)
    if need_x:  # sum_n g[m, n] Wk[n, k] / fw: the factor is one scalar, applied after the sums
        fw = level_factors(w_scales, _mrq(weight_codec))
        grad_x = _divide_into(lowp_products(gm, w_levels), fw, x_dtype).reshape(ctx.x_shape)
    if need_w:  # sum_m (g[m, n] / fx[m]) Xk[m, k]: fx is on the summed index, so it goes into g (last: gm changes)
        fx = level_factors(x_scales, _mrq(activation_codec)).unsqueeze(1)
        grad_w = lowp_products(_over_row_factors(g, gm, fx, ctx.lowp).t(), x_levels).to(w_dtype)
    return grad_x, grad_w, grad_b


class _BitLinearFunction(torch.autograd.Function):
    """Quantized forward and straight-through backward (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_codec: Codec, activation_codec: Codec) -> torch.Tensor:
        w_levels, w_scales = encode_weight(weight_codec, weight)
        y, x_levels, x_scales = quantized_forward(x, w_levels, w_scales, bias, weight_codec, activation_codec)
        # the weight is saved by reference (no memory: it is the Parameter) with its scale and
        # rounded again in backward, which costs one more pass over it but keeps only int8
        # activations alive
        ctx.save_for_backward(x_levels, x_scales, weight, w_scales)
        ctx.codecs = (weight_codec, activation_codec)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.x_shape = x.shape
        # autograd runs backward without autocast: the forward's state decides the backward's dtype
        ctx.lowp = autocast_dtype(x.device.type)
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_levels, x_scales, weight, w_scales = ctx.saved_tensors
        # the forward's levels: the weight is unchanged (autograd's version check), so is its scale
        w_levels, _ = encode_weight(ctx.codecs[0], weight, w_scales)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grads = _fp32_grads if ctx.lowp is None else _lowp_grads
        with torch.autocast(grad_out.device.type, enabled=False):
            grad_x, grad_w, grad_b = grads(ctx, g, x_levels, x_scales, w_levels, w_scales)
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
