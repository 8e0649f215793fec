"""``nearest-even`` rounding on an integer grid: BitNet b1.58's quantizer, bit for bit.

The integer-grid maps (signed ``linear``, ``ternary``: levels ``k / MRQ``, ``k = -MRQ..MRQ``, see
:func:`qconf.codec.qmap.integer_grid_mrq`) can round the way BitNet's reference code does. For a
stored scale ``s`` (fp32; one per block, see :mod:`qconf.codec.scales`):

* factor  ``f = fp32(fp32(1 / s) * MRQ)``. This is what torch computes for ``MRQ / s`` with a
  Python number ``MRQ`` and an fp32 tensor ``s`` (``Tensor.__rtruediv__`` is
  ``s.reciprocal() * MRQ``), i.e. BitNet's ``scale = 127.0 / x.abs().max(...)`` and
  ``scale = 1.0 / w.abs().mean()``. It is *not* the correctly rounded division ``MRQ / s``, which
  differs in the last bit for about a quarter of all scales at MRQ = 127; for MRQ = 1 it is
  the correctly rounded ``1 / s``. ``s = 0`` gives ``f = inf``.
* level   ``k = clamp(round_half_even(fp32(x * f)), -MRQ, MRQ)``, an int8. NaN products -- a NaN
  element, or ``0 * inf`` in a block whose scale is 0 -- give ``k = 0``; ``+-Inf`` elements give
  ``+-MRQ``.
* decode  ``y = fp32(k / f)`` (an fp32 division), BitNet's ``q / scale``: bit for bit equal as
  values (a level has no sign of zero, so BitNet's ``-0.0`` comes back as ``+0.0``). A zero
  scale decodes to zeros (``k / inf``).

All of it is elementwise torch on ``x``'s device, with no packing and no table lookup. On a 2-D
CPU tensor with one factor per row (or one for all) the two passes run natively instead, one pass
each and no temporaries (``torch.ops.qconf.round_levels`` / ``divide_levels``), with the same bits.
"""
from __future__ import annotations

import torch

from .._native import row_kernels

__all__ = ["level_factors", "round_to_levels", "levels_to_values"]


def level_factors(scales: torch.Tensor, mrq: int) -> torch.Tensor:
    """``f = fp32(1 / s) * MRQ`` per stored scale: fp32 ``scales`` (any shape) -> fp32, same shape
    (``inf`` where ``s = 0``)."""
    return torch.reciprocal(scales) * float(mrq)  # the two roundings of torch's ``MRQ / s``


def round_to_levels(x32: torch.Tensor, factors: torch.Tensor, mrq: int) -> torch.Tensor:
    """int8 levels ``clamp(round_half_even(x32 * factors), -MRQ, MRQ)`` of fp32 ``x32``;
    ``factors`` is fp32 and broadcasts to ``x32`` (one factor per element, e.g. a broadcast view).
    NaN products become 0; the result has ``x32``'s shape."""
    rows = _row_factors(x32, factors) if x32.dtype == torch.float32 and 1 <= mrq <= 127 else None
    if rows is not None:
        return torch.ops.qconf.round_levels(x32, rows, mrq)
    t = x32 * factors
    t.round_().clamp_(-mrq, mrq)  # torch.round is half-to-even; clamp maps +-inf to +-MRQ, keeps NaN
    t.nan_to_num_(nan=0.0)
    return t.to(torch.int8)


def levels_to_values(levels: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """fp32 ``levels / factors`` (the fp32 division of BitNet's ``q / scale``); ``levels`` any
    integer dtype, ``factors`` fp32 broadcasting to it. Returns fp32 in ``levels``' shape."""
    rows = _row_factors(levels, factors) if levels.dtype == torch.int8 else None
    if rows is not None:
        return torch.ops.qconf.divide_levels(levels, rows)
    return levels.to(torch.float32, copy=True).div_(factors)


def _row_factors(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor | None:
    """The 1-D factors (one per row, or one for all) of a 2-D ``x`` whose ``factors`` are constant
    along each row (a broadcast view, as ``expand_factors`` gives for ``dim0`` and ``tensor``), when
    the native row passes apply; else None."""
    if factors.dtype != torch.float32 or factors.shape != x.shape or x.numel() == 0 or not row_kernels(x, factors):
        return None
    if factors.stride(1) != 0 and x.shape[1] > 1:
        return None
    return (factors[:1, 0] if factors.stride(0) == 0 else factors[:, 0]).contiguous()
