"""Quantization maps (``qmap``): the sorted fp32 value tables that codes index into.

Every map is built exactly as lpmm's ``create_general_qmap(quant_type, bits, signed)`` builds it,
down to the fp32 operation order, so the values match lpmm bit for bit (the golden values are
checked in ``tests/test_qmap.py`` against ``reference/lpmm_qmaps.json``).

Maps (``n`` is a normalized value in [-1, 1] or [0, 1]):

* ``nonlinear`` -- dynamic exponent (DE): ``10**-e * fraction`` with the fraction at midpoints of
  ``linspace(0.1, 1, 2**F + 1)``; contains 0 and 1 (and, signed, lacks -1).
* ``nonlinear-nozero`` -- DE-0: unsigned DE with entry 0 replaced by entry 1, so 0 is not
  representable (the paper's fix for the second-moment zero-point problem). Signed is plain DE.
* ``power-p`` (p = 1, 2, 3) -- signed ``sign(t)|t|**p`` over ``linspace(-1, 1, 2**b)``; unsigned
  ``((i + 1) / 2**b)**p``. Unsigned ``power-1`` is the paper's "Linear" map.
* ``float-point`` -- a minifloat grid with ``e`` exponent bits, divided by its maximum.
* ``linear`` -- symmetric integer grid ``k / MRQ``: signed ``MRQ = 2**(b-1) - 1`` (2**b - 1 levels
  including 0), unsigned ``MRQ = 2**b - 1`` (2**b levels). lpmm stores these unpacked as int32;
  here they are ordinary codes, packed like every other map.
* ``ternary`` -- BitNet b1.58's levels ``-1, 0, +1`` (three levels, 2-bit codes packed four to a
  byte). Only ``bits=2, signed=True``: the same values as signed 2-bit ``linear`` (MRQ = 1), under
  its own name so that a codec says what it stores.

``linear`` (signed) and ``ternary`` are the *integer grids* ``k / MRQ``, ``k = -MRQ..MRQ``
(:func:`integer_grid_mrq`); only they take the ``nearest-even`` rounding of :class:`qconf.codec.Codec`.
"""
from __future__ import annotations

import functools
import itertools

import torch

MAP_NAMES = ("nonlinear", "nonlinear-nozero", "power-1", "power-2", "power-3", "linear", "float-point", "ternary")

# Exponent bits of lpmm's float-point map per total width (lpmm.functional.create_general_qmap).
_FP_EXPONENT_BITS = {2: 1, 3: 2, 4: 2, 5: 3, 6: 3, 7: 4, 8: 4}


def _dynamic_map(signed: bool, max_exponent_bits: int, total_bits: int) -> torch.Tensor:
    """Dynamic-exponent map (bitsandbytes/lpmm ``create_dynamic_map``), in lpmm's fp32 op order."""
    data: list[float] = []
    non_sign_bits = total_bits - (1 if signed else 0)
    for i in range(max_exponent_bits):
        shift = i + non_sign_bits - max_exponent_bits
        fraction_items = 2**shift + 1 if signed else 2 ** (shift + 1) + 1
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        # ``10**k * means`` multiplies an fp32 tensor by a Python scalar: fp32 arithmetic.
        exponent = 10 ** (-(max_exponent_bits - 1) + i)
        data += (exponent * means).tolist()
        if signed:
            data += (-exponent * means).tolist()
    data.append(0.0)
    data.append(1.0)
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def _power_map(p: int, bits: int, signed: bool) -> torch.Tensor:
    if signed:
        q = torch.linspace(-1, 1, 2**bits, dtype=torch.float32)
    else:
        q = torch.linspace(0, 1, 2**bits + 1, dtype=torch.float32)[1:]
    if p != 1:
        q = q.sign() * q.abs().pow(p)
    return q


def _float_point_map(bits: int, signed: bool) -> torch.Tensor:
    exponent_bits = _FP_EXPONENT_BITS[bits]
    precision_bits = bits - (1 if signed else 0) - exponent_bits
    bias = 2 ** (exponent_bits - 1)
    values: list[float] = []
    for evalue in range(2**exponent_bits):
        for pattern in itertools.product([0, 1], repeat=precision_bits):
            value = 1.0 if evalue != 0 else 0.0
            for k, bit in enumerate(pattern):
                value += bit * 2 ** -(k + 1)
            # subnormals for exponent code 0, normals otherwise
            value *= 2.0**-bias if evalue == 0 else 2.0 ** -(evalue - bias - 1)
            values.append(value)
            if signed:
                values.append(-value)
    values.sort()  # stable: +0 stays before -0, as in lpmm
    q = torch.tensor(values, dtype=torch.float32)
    return q / q.max()


def _linear_map(bits: int, signed: bool) -> torch.Tensor:
    mrq = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
    lo = -mrq if signed else 0
    return torch.arange(lo, mrq + 1, dtype=torch.float32) / mrq


def ternary_problem(bits: int, signed: bool) -> str | None:
    """Why ``map="ternary"`` cannot have these ``bits``/``signed``, or None when it can."""
    if bits == 2 and signed:
        return None
    return (f"map 'ternary' (levels -1, 0, +1 in 2-bit codes) needs bits=2 and signed=True, got bits={bits}, "
            f"signed={signed}; for other widths use map 'linear'")


def integer_grid_mrq(map: str, bits: int, signed: bool) -> int | None:
    """MRQ of an integer-grid map (levels ``k / MRQ`` for ``k = -MRQ..MRQ``): ``2**(bits-1) - 1``
    for signed ``linear``, 1 for ``ternary``; None for every other map (and unsigned ``linear``)."""
    if map == "ternary":
        return 1
    if map == "linear" and signed and bits >= 2:
        return 2 ** (bits - 1) - 1
    return None


@functools.lru_cache(maxsize=None)
def _create_qmap_cached(map: str, bits: int, signed: bool) -> torch.Tensor:
    if map == "ternary":
        problem = ternary_problem(bits, signed)
        if problem:
            raise ValueError(problem)
        return torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float32)
    if map == "linear":
        if signed and bits < 2:
            raise ValueError("map 'linear' with signed=True needs bits >= 2 (1 bit leaves only the level 0)")
        return _linear_map(bits, signed)
    if bits == 1:
        return torch.tensor([-1.0, 1.0] if signed else [0.0, 1.0], dtype=torch.float32)
    if map in ("nonlinear", "nonlinear-nozero"):
        q = _dynamic_map(signed, bits - 1, bits if signed else bits - 1)
        if map == "nonlinear-nozero" and not signed:
            q[0] = q[1]
        return q
    if map.startswith("power-"):
        return _power_map(int(map[len("power-"):]), bits, signed)
    if map == "float-point":
        return _float_point_map(bits, signed)
    raise AssertionError(map)  # validated by create_qmap


def create_qmap(map: str, bits: int, signed: bool) -> torch.Tensor:
    """Return the quantization map ``map`` at ``bits`` bits as a new sorted 1-D fp32 CPU tensor.

    Length is ``2**bits`` except for signed ``linear`` (``2**bits - 1`` levels) and ``ternary`` (3).
    Raises ``ValueError`` for an unknown map, bits outside 1..8, signed 1-bit ``linear`` or a
    ``ternary`` map other than ``bits=2, signed=True``.
    """
    if map not in MAP_NAMES:
        raise ValueError(f"unknown map {map!r}; allowed: {', '.join(MAP_NAMES)}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    return _create_qmap_cached(map, bits, bool(signed)).clone()
