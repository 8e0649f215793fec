"""``Codec`` and ``QTensor``: the reference (pure torch) quantization path -- the specification.

Encode, for a tensor ``x`` (fp32/bf16/fp16/fp64, any shape, contiguous or not; computed in fp32:
a bf16/fp16 input is exactly its fp32 value):

1. scales ``s`` by the scale type and statistic (absmax, or absmean), over the finite elements
   only, floored at ``min_scale`` when it is > 0 (see :mod:`qconf.codec.scales`);
2. normalize ``n = x * r`` with the fp32 reciprocal ``r = 1 / s`` of each stored scale (for
   ``rank1`` the element's ``r`` is the max of its per-dim reciprocals); a zero scale gives ``n = 0``;
   NaN elements normalize to 0, so they take the code nearest 0;
3. round to a code:

   * ``nearest``: the code whose map value is closest, ties to the lower code. Computed as
     ``code = #{k : mid[k] < n}`` with fp32 midpoints ``mid[k] = (qmap[k] + qmap[k+1]) * 0.5`` --
     exactly lpmm's ``real-nearest``. Values beyond the map clamp to its ends (+-Inf elements
     saturate to the last / first code).
   * ``stochastic``: clamp ``n`` into the map's range, take the bracketing codes
     ``lo = #{k : qmap[k] <= n} - 1`` (clamped to ``[0, L-2]``) and ``hi = lo + 1`` and round up iff
     ``u < (n - qmap[lo]) / (qmap[hi] - qmap[lo])`` for a uniform ``u`` in [0, 1); unbiased inside
     the range. ``u`` comes from ``generator`` (``torch.rand``) or is passed as ``noise``.
   * ``nearest-even`` (integer-grid maps only: signed ``linear``, ``ternary``): steps 2-3 are
     BitNet's ``k = clamp(round_half_even(x * (MRQ / s)), -MRQ, MRQ)`` with torch's fp32
     ``MRQ / s`` (:mod:`qconf.codec.integer` has the exact operations and the NaN/Inf rules); the
     code is ``k + MRQ``. :meth:`Codec.encode_integers` returns ``k`` as int8 without packing.

4. pack the codes densely (:mod:`qconf.codec.packing`).

Decode: ``x_hat = qmap[code] * s``, fp32, in x's shape; for ``nearest-even`` codecs
``x_hat = k / (MRQ / s)`` (BitNet's ``q / scale``; :meth:`Codec.decode_integers`).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from . import integer, native, packing
from .qmap import MAP_NAMES, create_qmap, integer_grid_mrq
from .scales import (ABSMEAN_SCALE_TYPES, FLT_MAX, FLT_MIN, SCALE_TYPES, STATISTICS, compute_scales, effective_scale,
                     expand_factors, expand_reciprocals, expand_scales, num_scales)

#: Rounding modes of every map (and of the optimizer-state config schema).
ROUNDING_MODES = ("nearest", "stochastic")
#: Rounding modes of the integer-grid maps only (signed ``linear``, ``ternary``).
INTEGER_ROUNDING_MODES = ("nearest-even",)
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class Codec:
    """An immutable description of how one tensor is quantized, with its encode/decode.

    Args:
        bits: code width, 1..8.
        map: quantization map name (see :data:`qconf.codec.qmap.MAP_NAMES`).
        signed: signed map (values in [-1, 1]) or unsigned ([0, 1]).
        scale: ``tensor`` | ``dim0`` | ``dim1`` | ``group`` | ``rank1``.
        group_size: block length for ``group`` (and for ``rank1`` on 1-D tensors), >= 1.
        rounding: ``nearest`` | ``stochastic`` | ``nearest-even`` (BitNet's rounding; only for the
            integer-grid maps signed ``linear`` and ``ternary``).
        statistic: what a scale measures, ``absmax`` | ``absmean`` (``absmean``: scale ``tensor``,
            ``dim0``, ``dim1`` or ``group``).
        min_scale: floor of every stored scale, ``max(statistic, min_scale)``; 0 (no floor) or a
            normal fp32 number (``FLT_MIN``..``FLT_MAX``). BitNet uses 1e-5.

    BitNet b1.58 (docs/bitnet.md): weights ``Codec(bits=2, map="ternary", scale="tensor",
    statistic="absmean", rounding="nearest-even", min_scale=1e-5)``, activations (rows of a 2-D
    ``[tokens, features]`` tensor) ``Codec(bits=8, map="linear", scale="dim0",
    rounding="nearest-even", min_scale=1e-5)``.
    """

    bits: int = 4
    map: str = "nonlinear"
    signed: bool = True
    scale: str = "group"
    group_size: int = 128
    rounding: str = "nearest"
    statistic: str = "absmax"
    min_scale: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"Codec: bits must be an integer in 1..8, got {self.bits!r}")
        if self.map not in MAP_NAMES:
            raise ValueError(f"Codec: unknown map {self.map!r}; allowed: {', '.join(MAP_NAMES)}")
        if not isinstance(self.signed, bool):
            raise ValueError(f"Codec: signed must be True or False, got {self.signed!r}")
        if self.scale not in SCALE_TYPES:
            raise ValueError(f"Codec: unknown scale {self.scale!r}; allowed: {', '.join(SCALE_TYPES)}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"Codec: group_size must be a positive integer, got {self.group_size!r}")
        self._check_rounding_statistic_floor()
        qmap = create_qmap(self.map, self.bits, self.signed)  # raises for signed 1-bit linear, ternary not 2-bit
        object.__setattr__(self, "_qmap", qmap)
        object.__setattr__(self, "_midpoints", (qmap[:-1] + qmap[1:]) * 0.5)
        object.__setattr__(self, "_mrq", integer_grid_mrq(self.map, self.bits, self.signed))
        if self.rounding in INTEGER_ROUNDING_MODES and self._mrq is None:
            raise ValueError(f"Codec: rounding {self.rounding!r} needs an integer-grid map -- map 'ternary' (bits=2, "
                             f"signed=True) or map 'linear' with signed=True -- got map={self.map!r}, "
                             f"signed={self.signed}")

    def _check_rounding_statistic_floor(self) -> None:
        """Validate rounding, statistic and min_scale (min_scale is stored as a float)."""
        allowed = ROUNDING_MODES + INTEGER_ROUNDING_MODES
        if self.rounding not in allowed:
            raise ValueError(f"Codec: unknown rounding {self.rounding!r}; allowed: {', '.join(allowed)}")
        if self.statistic not in STATISTICS:
            raise ValueError(f"Codec: unknown statistic {self.statistic!r}; allowed: {', '.join(STATISTICS)}")
        if self.statistic == "absmean" and self.scale not in ABSMEAN_SCALE_TYPES:
            raise ValueError(f"Codec: statistic 'absmean' supports scale {', '.join(ABSMEAN_SCALE_TYPES)}, not "
                             f"{self.scale!r} (rank1's min over per-dimension statistics bounds |x| only for absmax)")
        m = self.min_scale
        if isinstance(m, bool) or not isinstance(m, numbers.Real) or not (m == 0 or FLT_MIN <= m <= FLT_MAX):
            raise ValueError(f"Codec: min_scale must be 0 or a number in [{FLT_MIN!r}, {FLT_MAX!r}] (a normal fp32 "
                             f"value), got {m!r}")
        object.__setattr__(self, "min_scale", float(m))

    # -- description -------------------------------------------------------------------------
    @property
    def qmap(self) -> torch.Tensor:
        """The sorted fp32 map (``2**bits`` values; ``2**bits - 1`` for signed ``linear``, 3 for ``ternary``)."""
        return self._qmap.clone()

    @property
    def midpoints(self) -> torch.Tensor:
        """fp32 decision thresholds for nearest rounding, ``(qmap[k] + qmap[k+1]) * 0.5``."""
        return self._midpoints.clone()

    def to_dict(self) -> dict[str, Any]:
        """Plain-data description (for checkpoints); ``Codec(**d)`` rebuilds it. ``statistic`` and
        ``min_scale`` appear only when not at their defaults, so that optimizer checkpoints stay
        readable by qconf versions without them."""
        d = dataclasses.asdict(self)
        for name in ("statistic", "min_scale"):
            if d[name] == _FIELD_DEFAULTS[name]:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Codec":
        """Rebuild from :meth:`to_dict` (a checkpoint's codec record). The record must name every
        field of :data:`RECORD_FIELDS`; a dict without ``statistic``/``min_scale`` (written before
        they existed, or at their defaults) gets absmax and 0. ValueError naming a missing or an
        unknown field: a default in place of a lost field would decode the state wrongly, silently."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a codec record must be a dict, got {type(d).__name__}")
        missing = [f for f in RECORD_FIELDS if f not in d]
        unknown = [k for k in d if k not in RECORD_FIELDS and k not in OPTIONAL_RECORD_FIELDS]
        if missing or unknown:
            what = "; ".join(part for part in (f"missing field(s) {', '.join(map(repr, missing))}" if missing else "",
                                               f"unknown field(s) {', '.join(map(repr, unknown))}" if unknown else "")
                             if part)
            raise ValueError(f"codec record: {what} (a record names {', '.join(RECORD_FIELDS)}, and optionally "
                             f"{', '.join(OPTIONAL_RECORD_FIELDS)})")
        return cls(**dict(d))

    def __repr__(self) -> str:
        return (f"Codec(bits={self.bits}, map={self.map!r}, signed={self.signed}, scale={self.scale!r}, "
                f"group_size={self.group_size}, rounding={self.rounding!r}, statistic={self.statistic!r}, "
                f"min_scale={self.min_scale!r})")

    def num_scales(self, shape: tuple[int, ...] | torch.Size) -> int:
        """Number of fp32 scales stored for a tensor of ``shape``."""
        return num_scales(self.scale, tuple(shape), self.group_size)

    def nbytes(self, shape: tuple[int, ...] | torch.Size) -> int:
        """Exact storage of an encoded tensor of ``shape``: packed codes + fp32 scales."""
        shape = tuple(shape)
        return packing.packed_nbytes(math.prod(shape), self.bits) + 4 * self.num_scales(shape)

    def effective_scale(self, shape: tuple[int, ...] | torch.Size) -> str:
        """Scale type used for ``shape`` after the rank fallbacks."""
        return effective_scale(self.scale, tuple(shape))

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(qmap, midpoints) on ``device`` (no copy on the CPU)."""
        return self._qmap.to(device), self._midpoints.to(device)

    # -- encode / decode ---------------------------------------------------------------------
    def normalize(self, x: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(n, scales)``: fp32 normalized values in x's shape and the stored scales. NaN
        elements (and Inf ones in a zero block) normalize to 0, so they take the code nearest 0.
        ``scales`` (1-D fp32, ``num_scales(x.shape)`` values) are used instead of x's own absmax
        when given: a shard of a larger tensor is encoded with the scales of the whole
        (:mod:`qconf.optim.sharded`)."""
        x32 = _as_fp32(x)
        scales = self._scales(x32, scales)
        return normalize_values(x32, expand_reciprocals(scales, tuple(x32.shape), self.scale, self.group_size)), scales

    def _scales(self, x32: torch.Tensor, scales: torch.Tensor | None, native_rows: bool = False) -> torch.Tensor:
        """x32's own stored scales, or the given ``scales`` after checking their dtype and count;
        ``native_rows``: see :func:`compute_scales`."""
        if scales is None:
            return compute_scales(x32, self.scale, self.group_size, self.statistic, self.min_scale, native_rows)
        if scales.dtype != torch.float32 or scales.shape != (self.num_scales(x32.shape),):
            raise ValueError(f"scales must be 1-D float32 with {self.num_scales(x32.shape)} values for shape "
                             f"{tuple(x32.shape)}, got {scales.dtype} {tuple(scales.shape)}")
        return scales

    def quantize(self, n: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Round normalized fp32 values to int64 codes (same shape); NaN gives code 0 (``normalize``
        never returns NaN). ``noise`` is required for stochastic rounding: uniform [0, 1) values,
        one per element. Not for ``nearest-even``, which rounds ``x * (MRQ / s)``, not ``n``."""
        qmap, mids = self._tables(n.device)
        if self.rounding == "nearest-even":
            raise ValueError("rounding 'nearest-even' rounds x * (MRQ / s), not normalized values: use "
                             "Codec.encode or Codec.encode_integers")
        if self.rounding == "nearest":
            codes = torch.searchsorted(mids, n.contiguous(), right=False)  # #{mid < n}: ties go low
        else:
            if noise is None:
                raise ValueError("stochastic rounding needs uniform noise (pass generator= or noise=)")
            nc = n.clamp(qmap[0], qmap[-1])  # clamp keeps NaN as NaN
            lo = (torch.searchsorted(qmap, nc.contiguous(), right=True) - 1).clamp(0, qmap.numel() - 2)
            q_lo, q_hi = qmap[lo], qmap[lo + 1]
            p_up = (nc - q_lo) / (q_hi - q_lo)  # a zero-width interval gives NaN: never rounds up
            codes = lo + (noise.reshape(n.shape) < p_up).to(torch.int64)
        return torch.where(torch.isnan(n), torch.zeros_like(codes), codes)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None, *,
               noise: torch.Tensor | None = None, backend: str = "reference",
               scales: torch.Tensor | None = None) -> "QTensor":
        """Quantize ``x`` (any shape; fp32/bf16/fp16/fp64; any strides) into a :class:`QTensor`.

        For stochastic rounding the uniforms come from ``noise`` (fp32, ``x.numel()`` values in
        [0, 1)) if given, else ``torch.rand`` with ``generator`` (the global RNG when None).
        ``backend="native"`` runs the compiled kernel (CPU tensors, up to 8 dims); it gives the
        same codes and scales as the reference for the same noise. ``scales``: encode with these
        stored scales instead of x's own (reference backend; see :meth:`normalize`).
        """
        x32 = _as_fp32(x)
        if self.rounding == "stochastic" and noise is None:
            noise = torch.rand(x32.shape, generator=generator, device=x32.device, dtype=torch.float32)
        elif noise is not None and noise.numel() != x32.numel():
            raise ValueError(f"noise has {noise.numel()} values, expected one per element ({x32.numel()})")
        if _check_backend(backend) == "native" and x32.numel() > 0 and scales is None:
            codes, scales = native.encode(self, x32, noise)
            return QTensor(codes, scales, torch.Size(x32.shape), self)
        if self.rounding == "nearest-even":
            levels, scales = self.encode_integers(x32, scales=scales)
            codes = levels.reshape(-1).to(torch.int16) + self._mrq  # code of level k is k + MRQ (< 256)
            return QTensor(packing.pack(codes, self.bits), scales, torch.Size(x.shape), self)
        n, scales = self.normalize(x32, scales)
        codes = self.quantize(n, noise)
        return QTensor(packing.pack(codes, self.bits), scales, torch.Size(x.shape), self)

    def decode(self, q: "QTensor", *, backend: str = "reference") -> torch.Tensor:
        """Dequantize ``q`` (encoded by this codec) to an fp32 tensor of the original shape
        (``backend="native"``: the compiled kernel, same values)."""
        if not isinstance(q, QTensor):
            raise TypeError(f"Codec.decode expects a QTensor, got {type(q).__name__}")
        if q.codec != self:
            raise ValueError(f"QTensor was encoded with {q.codec!r} and cannot be decoded with {self!r}; "
                             "use q.decode() or the encoding codec")
        if _check_backend(backend) == "native" and q.numel() > 0:
            return native.decode(self, q.codes, q.scales, tuple(q.shape))
        if self.rounding == "nearest-even":
            return self.decode_integers(self.decode_levels(q), q.scales)
        qmap, _ = self._tables(q.codes.device)
        codes = packing.unpack(q.codes, self.bits, math.prod(q.shape))
        s = expand_scales(q.scales, tuple(q.shape), self.scale, self.group_size)
        return qmap[codes].reshape(q.shape) * s

    # -- integer levels (nearest-even) ---------------------------------------------------------
    def _check_integer(self, what: str) -> int:
        if self.rounding != "nearest-even":
            raise ValueError(f"Codec.{what} needs rounding='nearest-even' on an integer-grid map (signed 'linear' or "
                             f"'ternary'), got {self!r}")
        return self._mrq

    def encode_integers(self, x: torch.Tensor, *, scales: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """BitNet's quantizer: ``(levels, scales)`` of ``x`` without packing (the hot path).

        ``x``: any shape, fp32/bf16/fp16/fp64 (computed on its fp32 value), any device and strides.
        Returns ``levels``, int8 in ``x``'s shape, ``k = clamp(round_half_even(x * f), -MRQ, MRQ)``
        with ``f = fp32(1 / s) * MRQ`` (torch's ``MRQ / s``; NaN -> 0, +-Inf -> +-MRQ), and
        ``scales``, 1-D fp32 with :meth:`num_scales` values (``dim0`` on ``[rows, cols]``: one per
        row). ``scales`` given: use them instead of x's own. Needs ``rounding='nearest-even'``.
        """
        mrq = self._check_integer("encode_integers")
        x32 = _as_fp32(x)
        scales = self._scales(x32, scales, native_rows=True)
        f = expand_factors(integer.level_factors(scales, mrq), tuple(x32.shape), self.scale, self.group_size)
        return integer.round_to_levels(x32, f, mrq), scales

    def decode_levels(self, q: "QTensor") -> torch.Tensor:
        """The int8 levels ``k = code - MRQ`` of a packed :class:`QTensor` this codec encoded, in its
        shape (with ``q.scales``, what :meth:`encode_integers` returned). Needs ``nearest-even``."""
        mrq = self._check_integer("decode_levels")
        if not isinstance(q, QTensor) or q.codec != self:
            raise ValueError(f"decode_levels expects a QTensor encoded with {self!r}, got "
                             f"{q.codec if isinstance(q, QTensor) else type(q).__name__!r}")
        codes = packing.unpack(q.codes, self.bits, math.prod(q.shape), torch.int16)  # codes <= 2 * MRQ = 254
        return (codes - mrq).to(torch.int8).reshape(q.shape)

    def decode_integers(self, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """fp32 ``levels / f`` with ``f = fp32(1 / s) * MRQ`` broadcast per the scale type: BitNet's
        ``q / scale``. ``levels``: int8, any shape; ``scales``: 1-D fp32, :meth:`num_scales` values
        for that shape, on the same device. Returns an fp32 tensor of ``levels``' shape."""
        mrq = self._check_integer("decode_integers")
        if not isinstance(levels, torch.Tensor) or levels.dtype != torch.int8:
            raise TypeError(f"levels must be an int8 tensor, got {getattr(levels, 'dtype', type(levels).__name__)}")
        shape = tuple(levels.shape)
        if scales.dtype != torch.float32 or scales.shape != (self.num_scales(shape),):
            raise ValueError(f"scales must be 1-D float32 with {self.num_scales(shape)} values for shape {shape}, "
                             f"got {scales.dtype} {tuple(scales.shape)}")
        f = expand_factors(integer.level_factors(scales, mrq), shape, self.scale, self.group_size)
        return integer.levels_to_values(levels, f)


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Codec)}
#: The fields a codec record (:meth:`Codec.to_dict`) always has; the optional ones came later and
#: are left out at their defaults, so that older qconf versions read the checkpoints.
OPTIONAL_RECORD_FIELDS = ("statistic", "min_scale")
RECORD_FIELDS = tuple(name for name in _FIELD_DEFAULTS if name not in OPTIONAL_RECORD_FIELDS)
BACKENDS = ("reference", "native")


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    return backend


def normalize_values(x32: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 ``x32 * r`` (``r``: the reciprocals of the scales, broadcasting to ``x32``), with 0 where
    the scale is 0 (``r = inf``) or the product is NaN: what :meth:`Codec.normalize` returns."""
    n = x32 * r
    return torch.where(torch.isinf(r) | torch.isnan(n), torch.zeros_like(n), n)


def _as_fp32(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"can only encode floating tensors (float32, bfloat16, float16, float64), got {x.dtype}")
    return x.to(torch.float32)


@dataclasses.dataclass
class QTensor:
    """An encoded tensor.

    Attributes:
        codes: 1-D uint8, densely packed codes (``ceil(numel * bits / 8)`` bytes).
        scales: 1-D fp32 scales (the codec's statistic; layout per scale type, see
            :mod:`qconf.codec.scales`).
        shape: the original tensor's shape.
        codec: the :class:`Codec` that produced it.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    codec: Codec

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)
        numel = math.prod(self.shape)
        want_codes = packing.packed_nbytes(numel, self.codec.bits)
        want_scales = self.codec.num_scales(self.shape)
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 1 or self.codes.numel() != want_codes:
            raise ValueError(f"QTensor codes must be 1-D uint8 with {want_codes} bytes for shape {tuple(self.shape)} "
                             f"at {self.codec.bits} bits, got {self.codes.dtype} {tuple(self.codes.shape)}")
        if self.scales.dtype != torch.float32 or self.scales.dim() != 1 or self.scales.numel() != want_scales:
            raise ValueError(f"QTensor scales must be 1-D float32 with {want_scales} values for shape "
                             f"{tuple(self.shape)} under scale {self.codec.scale!r}, got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")

    @classmethod
    def zeros(cls, shape: tuple[int, ...] | torch.Size, codec: Codec, device: torch.device | str = "cpu") -> "QTensor":
        """An encoded all-zero tensor (zero scales decode to exact zeros) without an fp32 temporary."""
        shape = torch.Size(shape)
        codes = torch.zeros(packing.packed_nbytes(math.prod(shape), codec.bits), dtype=torch.uint8, device=device)
        scales = torch.zeros(codec.num_scales(shape), dtype=torch.float32, device=device)
        return cls(codes, scales, shape, codec)

    @property
    def nbytes(self) -> int:
        """Bytes actually held: packed codes plus scales."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        return math.prod(self.shape)

    def decode(self) -> torch.Tensor:
        """Dequantize with the encoding codec; fp32, original shape."""
        return self.codec.decode(self)

    def to(self, device: torch.device | str) -> "QTensor":
        return QTensor(self.codes.to(device), self.scales.to(device), self.shape, self.codec)

    def clone(self) -> "QTensor":
        return QTensor(self.codes.clone(), self.scales.clone(), self.shape, self.codec)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (tensors, ints, strings) for ``state_dict``; see :meth:`from_dict`."""
        return {"codes": self.codes, "scales": self.scales, "shape": list(self.shape), "codec": self.codec.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QTensor":
        return cls(d["codes"], d["scales"], torch.Size(d["shape"]), Codec.from_dict(d["codec"]))

    def __repr__(self) -> str:
        return f"QTensor(shape={tuple(self.shape)}, {self.codec!r}, nbytes={self.nbytes})"
