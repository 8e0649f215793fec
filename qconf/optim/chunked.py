"""Flat element ranges of parameters and states: what the reference step needs to run one
parameter in bounded chunks (:mod:`qconf.optim.reference`).

The reference step of a parameter walks its elements in row-major (logical) order, in chunks
``[a, b)`` whose starts are multiples of :func:`chunk_unit` -- 8 (whole bytes of packed codes at
any width) and every group size of its group-scaled states (whole blocks). Per chunk it reads the
parameter, gradient and dense states (:func:`read` / :func:`write`, views where the tensor is
contiguous), decodes the chunk of each quantized state (:meth:`RangeCodec.decode`), runs the rule,
and encodes the chunk's codes into the state's codes in place (:meth:`RangeCodec.encode`).

Every step of it is the arithmetic of :class:`~qconf.codec.Codec` on the chunk's elements: the
per-element scale (reciprocal) of element ``i`` comes from the same stored values, combined in the
same order, as the whole tensor's broadcast; a scale is a maximum over its elements, which does not
depend on how they are grouped (:meth:`RangeCodec.accumulate` collects it over chunks). So the
codes, scales and parameters are those of the whole-tensor step bit for bit.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..codec import Codec, QTensor, packing
from ..codec.codec import normalize_values
from ..codec.scales import _finite_abs, apply_min_scale, compute_scales, floor_scales

__all__ = ["RangeCodec", "chunk_unit", "chunk_bounds", "read", "write", "chunkable_codec"]


def chunkable_codec(codec: Codec) -> bool:
    """Whether a state under ``codec`` can be encoded chunk by chunk bit for bit: absmax scales
    (a maximum is independent of the order it is taken in; an absmean's sum is not) and table
    rounding (``nearest`` / ``stochastic``). Optimizer-state codecs always are."""
    return codec.statistic == "absmax" and codec.rounding in ("nearest", "stochastic")


def chunk_unit(codecs: list[tuple[Codec, tuple[int, ...]]]) -> int:
    """The multiple every chunk start must be: 8 (byte-aligned codes at any width) and the block
    of every group-scaled state (``(codec, state shape)`` pairs)."""
    unit = 8
    for codec, shape in codecs:
        if codec.effective_scale(shape) == "group":
            unit = math.lcm(unit, codec.group_size)
    return unit


def chunk_bounds(numel: int, unit: int, chunk: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges covering ``0 .. numel``, each ``max(unit, chunk rounded down to unit)``
    elements long (the last one shorter)."""
    size = max(unit, chunk // unit * unit)
    return [(a, min(a + size, numel)) for a in range(0, numel, size)]


# -- parameters, gradients and dense states: flat ranges of tensors of any strides -------------------
def _pieces(t: torch.Tensor, a: int, b: int) -> list[torch.Tensor]:
    """Views of ``t`` whose row-major elements, one after the other, are the flat elements
    ``a .. b-1`` of ``t`` (one view when ``t`` is contiguous; at most ``2 * t.dim() - 1`` else)."""
    if a >= b:
        return []
    if t.is_contiguous():
        return [t.view(-1)[a:b]]
    if t.dim() == 1:
        return [t[a:b]]
    row = math.prod(t.shape[1:])
    first, last = a // row, (b - 1) // row
    if first == last:
        return _pieces(t[first], a - first * row, b - first * row)
    out = []
    lo, hi = -(-a // row), b // row
    if a % row:
        out += _pieces(t[first], a % row, row)
    if lo < hi:
        out.append(t[lo:hi])
    if b % row:
        out += _pieces(t[hi], 0, b % row)
    return out


def read(t: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, bool]:
    """Flat elements ``a .. b-1`` of ``t`` as a 1-D tensor, and whether it is a view of ``t``
    (contiguous ``t``: writing it writes ``t``); else a copy of those elements only."""
    pieces = _pieces(t, a, b)
    if len(pieces) == 1 and pieces[0].is_contiguous():
        return pieces[0].view(-1), True
    return torch.cat([x.reshape(-1) for x in pieces]), False


def write(t: torch.Tensor, a: int, b: int, values: torch.Tensor) -> None:
    """Copy 1-D ``values`` (``b - a`` elements) into flat elements ``a .. b-1`` of ``t``."""
    start = 0
    for x in _pieces(t, a, b):
        x.copy_(values[start:start + x.numel()].view(x.shape))
        start += x.numel()


# -- quantized states: decode, scales and encode of a flat range --------------------------------------
def _block_index(a: int, b: int, stride: int, size: int, device: torch.device) -> torch.Tensor:
    """int64 ``(i // stride) % size`` for ``i = a .. b-1``, built from runs rather than divided
    element by element (an int64 division per element is slow)."""
    if stride == 1:
        start, n = a % size, b - a
        if start + n <= size:
            return torch.arange(start, start + n, device=device)
        parts = [torch.arange(start, size, device=device)]
        full, rest = divmod(n - (size - start), size)
        if full:
            parts.append(torch.arange(size, device=device).repeat(full))
        if rest:
            parts.append(torch.arange(rest, device=device))
        return torch.cat(parts)
    q0, q1 = a // stride, (b - 1) // stride
    values = torch.arange(q0, q1 + 1, device=device).remainder_(size)
    counts = torch.full((q1 - q0 + 1,), stride, dtype=torch.int64, device=device)
    counts[0] -= a - q0 * stride
    counts[-1] -= (q1 + 1) * stride - b
    return torch.repeat_interleave(values, counts, output_size=b - a)


class RangeCodec:
    """The codec of one quantized state of ``shape`` applied to flat ranges of its elements.

    The stored scales a flat range uses: for ``group`` the range's own blocks (``a // g ..``, a
    range starting on a block boundary), one pass; for ``tensor``, ``dim0``, ``dim1`` and ``rank1``
    scales of the whole tensor, which need the maxima of all its elements first
    (:attr:`two_pass`). Their per-element values are the stored values broadcast as
    :func:`qconf.codec.scales.expand_scales` does (``rank1``: combined over the dims in order) --
    over the range's rows when it holds whole rows (``where`` is ``(first row, end row)``), else
    gathered through per-element indexes (``where`` is a list of int64 tensors, one per combined
    vector).
    """

    def __init__(self, codec: Codec, shape: tuple[int, ...]):
        self.codec = codec
        self.shape = tuple(shape)
        self.numel = math.prod(self.shape)
        self.eff = codec.effective_scale(self.shape)
        self.two_pass = self.eff != "group"
        self.num_scales = codec.num_scales(self.shape)
        strides, acc = [], 1
        for size in reversed(self.shape):
            strides.append(acc)
            acc *= size
        self.strides = tuple(reversed(strides))
        #: elements per row (dim 0 index): a range of whole rows broadcasts instead of gathering
        self.row = self.strides[0] if self.eff in ("dim0", "dim1", "rank1") else 1

    def where(self, a: int, b: int, device: torch.device) -> Any:
        """How elements ``a .. b-1`` find their stored scales (see the class docstring); None for
        ``tensor`` and ``group``."""
        if self.eff in ("tensor", "group"):
            return None
        if a % self.row == 0 and b % self.row == 0:
            return (a // self.row, b // self.row)
        if self.eff == "dim0":
            return [_block_index(a, b, self.strides[0], self.shape[0], device)]
        if self.eff == "dim1":
            return [_block_index(a, b, self.strides[1], self.shape[1], device)]
        out, offset = [], 0
        for d, size in enumerate(self.shape):
            out.append(_block_index(a, b, self.strides[d], size, device).add_(offset))
            offset += size
        return out

    def _vectors(self, values: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(dim, stored vector) of each combined per-dim vector: one for dim0/dim1, all for rank1."""
        if self.eff == "dim0":
            return [(0, values)]
        if self.eff == "dim1":
            return [(1, values)]
        out, offset = [], 0
        for d, size in enumerate(self.shape):
            out.append((d, values[offset:offset + size]))
            offset += size
        return out

    def expand(self, values: torch.Tensor, a: int, b: int, where: Any, combine) -> torch.Tensor:
        """One value per element of ``a .. b-1`` (1-D) from ``values`` (one per stored scale, or for
        ``group`` those of the range's blocks only); ``rank1`` combines the dims' values in order
        with ``combine`` (``torch.fmin`` for scales, ``torch.fmax`` for reciprocals)."""
        n = b - a
        if self.eff == "tensor":
            return values.reshape(()).expand(n)
        if self.eff == "group":  # (a range shorter than a group lies in one group: its value, n times)
            return values.repeat_interleave(min(self.codec.group_size, max(n, 1)))[:n]
        if isinstance(where, tuple):
            r0, r1 = where
            shape = (r1 - r0,) + self.shape[1:]
            out = None
            for d, v in self._vectors(values):
                if d == 0:
                    v = v[r0:r1]
                view = [1] * len(shape)
                view[d] = v.numel()
                v = v.reshape(view)
                out = v if out is None else combine(out, v)
            return out.expand(shape).reshape(-1)
        out = None
        for j in where:
            out = values[j] if out is None else combine(out, values[j])
        return out

    def group_slice(self, a: int, b: int) -> slice:
        """The stored group scales of the blocks of ``a .. b-1`` (``a`` on a block boundary)."""
        g = self.codec.group_size
        return slice(a // g, -(-b // g))

    def decode(self, q: QTensor, a: int, b: int, where: Any) -> torch.Tensor:
        """fp32 values of elements ``a .. b-1`` (``a`` a multiple of 8) of ``q``: ``qmap[code] * s``
        as :meth:`Codec.decode` computes them."""
        bits = self.codec.bits
        codes = packing.unpack(q.codes[a * bits // 8:packing.packed_nbytes(b, bits)], bits, b - a)
        scales = q.scales[self.group_slice(a, b)] if self.eff == "group" else q.scales
        qmap = self.codec._tables(codes.device)[0]
        return qmap[codes] * self.expand(scales, a, b, where, torch.fmin)

    # the new scales
    def accumulate(self, maxima: torch.Tensor, x: torch.Tensor, where: Any) -> None:
        """Fold the finite ``|x|`` of elements ``a .. b-1`` into ``maxima`` (one per stored scale,
        starting at 0) for a two-pass layout."""
        ax = _finite_abs(x.float() if x.dtype != torch.float32 else x)
        if self.eff == "tensor":
            torch.maximum(maxima, ax.amax().reshape(1), out=maxima)
            return
        if isinstance(where, tuple):
            r0, r1 = where
            ax = ax.view((r1 - r0,) + self.shape[1:])
            for d, seg in self._vectors(maxima):
                if d == 0:
                    seg = seg[r0:r1]
                other = tuple(k for k in range(ax.dim()) if k != d)
                m = ax.amax(dim=other) if other else ax
                torch.maximum(seg, m, out=seg)
            return
        for j in where:
            maxima.scatter_reduce_(0, j, ax, "amax")

    def finish(self, maxima: torch.Tensor) -> torch.Tensor:
        """Stored scales from the maxima of :meth:`accumulate` (as
        :func:`~qconf.codec.scales.compute_scales`: the FLT_MIN floor, then ``min_scale``)."""
        return apply_min_scale(floor_scales(maxima), self.codec.min_scale)

    def group_scales(self, x: torch.Tensor) -> torch.Tensor:
        """The stored scales of the blocks of a range (``x``, starting on a block boundary)."""
        flat = x.float() if x.dtype != torch.float32 else x
        return compute_scales(flat, "group", self.codec.group_size, "absmax", self.codec.min_scale)

    def encode(self, q: QTensor, x: torch.Tensor, a: int, b: int, scales: torch.Tensor, where: Any,
               noise: torch.Tensor | None) -> None:
        """Encode the new values ``x`` of elements ``a .. b-1`` with ``scales`` (the whole tensor's,
        or for ``group`` those of the range's blocks) into ``q.codes`` in place, as
        :meth:`Codec.encode` does (``n = x * r``, a zero scale or NaN giving 0, then the table
        rounding)."""
        n = normalize_values(x.to(torch.float32), self.expand(1.0 / scales, a, b, where, torch.fmax))
        codes = self.codec.quantize(n, noise)
        bits = self.codec.bits
        q.codes[a * bits // 8:packing.packed_nbytes(b, bits)] = packing.pack(codes, bits)
