"""Scale (normalization) types: how the scales of a tensor are computed and broadcast.

For a tensor ``x`` of shape ``(d0, d1, ...)`` every element gets a scale ``s`` and is stored as
``n = x / s`` in the map's range. ``R_d(x)[i]`` below is the absmax of ``x`` over every index
whose coordinate ``d`` equals ``i``.

* ``tensor``: one scale, ``s = max|x|``. Stored shape ``(1,)``.
* ``dim0``:   ``s[i, ...] = R_0(x)[i]`` (one per row). Stored ``(d0,)``.
* ``dim1``:   ``s[:, j, ...] = R_1(x)[j]`` (one per column). Stored ``(d1,)``.
* ``group``:  flatten row-major into blocks of ``group_size`` (the last block may be short);
  one absmax per block. Stored ``(ceil(numel / group_size),)``.
* ``rank1``:  ``s[i0, i1, ...] = min_d R_d(x)[i_d]`` (SM3 style: for 2-D the smaller of the row
  and column absmax). Stored as the concatenated vectors ``R_0, R_1, ...`` (``sum(shape)`` floats).

Statistic: each ``R`` above is an absmax (``statistic="absmax"``, the default). With
``statistic="absmean"`` it is the mean of ``|x|`` over the same elements instead -- ``tensor``,
``dim0``, ``dim1`` and ``group`` (a short last group averages its own elements only); not
``rank1``, whose min over per-dimension statistics bounds ``|x|`` only for absmax. The mean is
``torch.mean`` of ``|x|`` (summation order as torch reduces; for a contiguous tensor with no
non-finite element it is bit for bit ``x.abs().mean()``), except that a mean whose fp32 sum
overflows (``sum |x| > FLT_MAX``, where ``x.abs().mean()`` is inf) is stored as ``FLT_MAX``.

Floor: with ``min_scale > 0`` every stored scale is ``max(statistic, fp32(min_scale))`` (a
``torch.clamp``), so an all-zero block stores ``min_scale`` (BitNet b1.58 uses 1e-5). With
``min_scale = 0`` (the default) a zero statistic stays 0.

Fallbacks by rank (``effective_scale``): ``rank1`` on 0-D/1-D is ``group``; ``dim0``/``dim1`` on
1-D are ``tensor``; ``dim0``/``dim1`` on 0-D are an error; ``dim1`` needs rank >= 2.

Normalization multiplies by reciprocals: ``r = 1 / s`` once per stored scale (fp32, correctly
rounded), ``n = x * r`` per element. For ``rank1`` the per-element reciprocal is ``max_d r_d[i_d]``,
which equals ``1 / min_d s_d[i_d]`` exactly (fp32 reciprocal rounding is monotonic). This keeps
divisions out of the per-element work of the fused kernels and makes their arithmetic identical to
this reference. A nonzero statistic below ``FLT_MIN`` (a subnormal block) is stored as ``FLT_MIN`` so
that ``r`` is always finite; such blocks are quantized on the ``FLT_MIN`` grid.

Non-finite input: every absmax above is taken over the *finite* elements only (NaN and +-Inf count
as 0; a set with no finite element has absmax 0); an absmean counts them as zeros too (they stay in
the element count, so a NaN weighs exactly as a 0 element would). So a stored scale is always finite
and one NaN/Inf element leaves the scale -- and so the codes and decoded values -- of every other
element of its block (row, column, tensor) exactly as if it were 0. The non-finite element itself is
encoded at the map's end for +-Inf and as 0 for NaN (:meth:`qconf.codec.Codec.normalize`); it
decodes to a finite value. A scale of 0 means the block's finite elements are all zero; it decodes
to exact zeros. (``rank1`` still combines with NaN-ignoring ``fmin``/``fmax``, which only matters
for scales loaded from elsewhere.)
"""
from __future__ import annotations

import math

import torch

from .._native import row_kernels

SCALE_TYPES = ("tensor", "dim0", "dim1", "group", "rank1")
STATISTICS = ("absmax", "absmean")
#: Scale types that take ``absmean`` (rank1's min over per-dim statistics is a bound only for absmax).
ABSMEAN_SCALE_TYPES = ("tensor", "dim0", "dim1", "group")
FLT_MIN = 2.0**-126  # smallest normal fp32: floor of a nonzero scale
FLT_MAX = float(torch.finfo(torch.float32).max)


def effective_scale(scale: str, shape: tuple[int, ...]) -> str:
    """The scale type actually used for a tensor of ``shape`` (see module docstring)."""
    ndim = len(shape)
    if scale == "rank1":
        return "rank1" if ndim >= 2 else "group"
    if scale in ("dim0", "dim1"):
        if ndim == 0:
            raise ValueError(f"scale {scale!r} needs a tensor with at least 1 dimension, got a 0-d tensor; "
                             "use scale 'tensor' or 'group' for scalars")
        return scale if ndim >= 2 else "tensor"
    return scale


def num_scales(scale: str, shape: tuple[int, ...], group_size: int) -> int:
    """Number of fp32 scales stored for a tensor of ``shape`` under ``scale``."""
    eff = effective_scale(scale, shape)
    numel = math.prod(shape)
    if eff == "tensor":
        return 1
    if eff == "dim0":
        return shape[0]
    if eff == "dim1":
        return shape[1]
    if eff == "group":
        return -(-numel // group_size)
    return sum(shape)


def _finite_abs(a: torch.Tensor) -> torch.Tensor:
    """|a| with NaN and +-Inf replaced by 0 (a new tensor, a's strides)."""
    return a.abs().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _absmax(a: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max|a| over the finite elements (NaN and +-Inf count as 0, so the result is finite); a
    nonzero maximum below FLT_MIN is raised to FLT_MIN."""
    a = _finite_abs(a)
    return floor_scales(a.amax() if dim is None else a.amax(dim=dim))


def _absmean(a: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """mean|a| with NaN and +-Inf counted as 0 (they stay in the count), by ``torch.mean``; a
    nonzero mean below FLT_MIN is raised to FLT_MIN, one whose fp32 sum overflowed to FLT_MAX."""
    a = _finite_abs(a)
    m = a.mean() if dim is None else a.mean(dim=dim)
    return floor_scales(m.clamp(max=FLT_MAX))


_STATISTIC_FNS = {"absmax": _absmax, "absmean": _absmean}


def floor_scales(m: torch.Tensor) -> torch.Tensor:
    """fp32 maxima ``m`` (>= 0) as stored scales: a nonzero value below FLT_MIN becomes FLT_MIN
    (so that ``1/scale`` is finite); 0 stays 0. Monotone, so it commutes with a max over ranks."""
    return torch.where((m > 0) & (m < FLT_MIN), torch.full_like(m, FLT_MIN), m)


def apply_min_scale(scales: torch.Tensor, min_scale: float) -> torch.Tensor:
    """``max(scales, fp32(min_scale))`` (a ``torch.clamp``); ``min_scale = 0`` leaves them as they are."""
    return scales.clamp(min=min_scale) if min_scale > 0 else scales


def _per_dim(x: torch.Tensor, d: int, stat=_absmax) -> torch.Tensor:
    """R_d(x): the statistic over every index except dimension ``d``; shape ``(x.shape[d],)``."""
    rows = x.movedim(d, 0).reshape(x.shape[d], -1)
    if rows.shape[1] == 0:
        return torch.zeros(x.shape[d], dtype=x.dtype, device=x.device)
    return stat(rows, dim=1)


def _group_absmean(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """absmean of each block of ``group_size`` elements of 1-D ``flat``; the short last block is
    the mean over its own elements (no padding in the count)."""
    full = flat.numel() - flat.numel() % group_size
    parts = [_absmean(flat[:full].view(-1, group_size), dim=1)] if full else []
    if full < flat.numel():
        parts.append(_absmean(flat[full:]).reshape(1))
    return torch.cat(parts)


def compute_scales(x: torch.Tensor, scale: str, group_size: int, statistic: str = "absmax",
                   min_scale: float = 0.0, native_rows: bool = False) -> torch.Tensor:
    """Scales of fp32 ``x`` (any shape) under ``scale``: a 1-D fp32 tensor of
    ``num_scales(scale, x.shape, group_size)`` values, each ``max(statistic, min_scale)``
    (``min_scale`` rounded to fp32, as ``torch.clamp`` does; 0 leaves the scales as they are).
    ``native_rows``: per-row absmax of a 2-D CPU ``x`` in one native pass with no temporary
    (``torch.ops.qconf.absmax_rows``, the same values; BitLinear's activations), where it applies."""
    if statistic not in _STATISTIC_FNS:
        raise ValueError(f"unknown statistic {statistic!r}; allowed: {', '.join(STATISTICS)}")
    eff = effective_scale(scale, tuple(x.shape))
    if statistic == "absmean" and eff not in ABSMEAN_SCALE_TYPES:
        raise ValueError(f"statistic 'absmean' supports scale {', '.join(ABSMEAN_SCALE_TYPES)}, not {scale!r}")
    stat = _STATISTIC_FNS[statistic]
    if x.numel() == 0:
        out = torch.zeros(num_scales(scale, tuple(x.shape), group_size), dtype=torch.float32, device=x.device)
    elif native_rows and eff == "dim0" and statistic == "absmax" and x.dtype == torch.float32 and row_kernels(x):
        out = floor_scales(torch.ops.qconf.absmax_rows(x))
    elif eff == "tensor":
        out = stat(x).reshape(1)
    elif eff in ("dim0", "dim1"):
        out = _per_dim(x, 0 if eff == "dim0" else 1, stat)
    elif eff == "group" and statistic == "absmean":
        out = _group_absmean(x.reshape(-1), group_size)
    elif eff == "group":
        flat = x.reshape(-1)
        block = min(group_size, flat.numel())  # a group longer than the tensor is one group: no padding to it
        padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % block))  # zeros leave absmax unchanged
        out = _absmax(padded.view(-1, block), dim=1)
    else:
        out = torch.cat([_per_dim(x, d) for d in range(x.dim())])
    return apply_min_scale(out, min_scale)


def expand_scales(scales: torch.Tensor, shape: tuple[int, ...], scale: str, group_size: int) -> torch.Tensor:
    """Broadcast stored ``scales`` to one fp32 scale per element; returns a tensor of ``shape``."""
    return _expand(scales, shape, scale, group_size, torch.fmin)


def expand_reciprocals(scales: torch.Tensor, shape: tuple[int, ...], scale: str, group_size: int) -> torch.Tensor:
    """Per-element ``1 / scale`` from the per-scale reciprocals (``inf`` where the scale is 0)."""
    return _expand(1.0 / scales, shape, scale, group_size, torch.fmax)


def expand_factors(factors: torch.Tensor, shape: tuple[int, ...], scale: str, group_size: int) -> torch.Tensor:
    """Broadcast one fp32 multiplier per stored scale -- a value that falls as its scale grows,
    such as ``1 / s`` or ``MRQ / s`` -- to a tensor of ``shape`` (a broadcast view for ``tensor``,
    ``dim0`` and ``dim1``). ``rank1`` takes the max over the dims' factors, which is the factor of
    the smallest scale exactly (the factor is a monotone function of the scale)."""
    return _expand(factors, shape, scale, group_size, torch.fmax)


def _expand(values: torch.Tensor, shape: tuple[int, ...], scale: str, group_size: int, combine) -> torch.Tensor:
    """Broadcast one value per stored scale to ``shape``; ``rank1`` combines the per-dim vectors
    with ``combine`` (fmin for scales, fmax for reciprocals: a NaN defers to the other dims)."""
    eff = effective_scale(scale, shape)
    numel = math.prod(shape)
    if eff == "tensor":
        return values.reshape(()).expand(shape)
    if eff == "dim0":
        return values.reshape((shape[0],) + (1,) * (len(shape) - 1)).expand(shape)
    if eff == "dim1":
        return values.reshape((1, shape[1]) + (1,) * (len(shape) - 2)).expand(shape)
    if eff == "group":  # (a group longer than the tensor: its one value, numel times)
        return values.repeat_interleave(min(group_size, max(numel, 1)))[:numel].reshape(shape)
    out = None
    offset = 0
    for d, size in enumerate(shape):
        view = [1] * len(shape)
        view[d] = size
        v = values[offset:offset + size].reshape(view)
        offset += size
        out = v if out is None else combine(out, v)
    return out.expand(shape)
