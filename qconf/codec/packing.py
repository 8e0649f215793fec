"""Dense bit packing of b-bit codes (b = 1..8) into bytes.

Layout: the codes form one little-endian bit stream. Code ``i`` occupies stream bits
``[i*b, (i+1)*b)`` and stream bit ``k`` is bit ``k % 8`` of byte ``k // 8``. So at 4 bits element
``2k`` sits in the low nibble of byte ``k``; at 5 bits eight codes fill exactly five bytes. A
tensor of ``n`` codes costs ``ceil(n * b / 8)`` bytes -- nothing is padded in storage.

Both directions work on groups of 8 codes (= ``b`` bytes), assembled into one int64 word, so the
only temporaries are ``n / 8`` words. Unpacking a width that divides 8 (1, 2, 4 bits) shifts each
byte directly, in uint8.
"""
from __future__ import annotations

import torch


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed to store ``numel`` codes of ``bits`` bits each."""
    return (numel * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` (any int dtype, any shape, read flat) into uint8.

    Returns a 1-D uint8 tensor of ``packed_nbytes(codes.numel(), bits)`` bytes on codes' device.
    """
    _check_bits(bits)
    flat = codes.reshape(-1)
    n = flat.numel()
    if bits == 8:
        return flat.to(torch.uint8)
    pad = (-n) % 8
    words = torch.nn.functional.pad(flat.to(torch.int64), (0, pad)).view(-1, 8)
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    word = (words << shifts).sum(dim=1)  # bits*8 <= 56 bits: fits in int64
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    out = ((word.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(n, bits)]


def unpack(packed: torch.Tensor, bits: int, numel: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack`: return the first ``numel`` codes as a 1-D tensor of ``dtype``
    (int64 by default; any dtype that holds ``2**bits - 1``)."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed codes must be a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    need = packed_nbytes(numel, bits)
    if packed.numel() != need:
        raise ValueError(f"{numel} codes of {bits} bits need {need} bytes, got {packed.numel()}")
    if 8 % bits == 0:  # whole codes in each byte: code j of a byte is bits [j*bits, (j+1)*bits)
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(-1)[:numel].to(dtype)
    pad = (-packed.numel()) % bits
    groups = torch.nn.functional.pad(packed.to(torch.int64), (0, pad)).view(-1, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (groups << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel].to(dtype)


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 2-D tensor of codes ``[rows, inner]`` row by row: uint8 ``[rows, packed_nbytes(inner,
    bits)]``, each row in :func:`pack`'s layout starting on a byte of its own (its last byte
    zero-padded). The rows of the result are the packed rows of the input, so slicing rows of one
    slices rows of the other (how quantized states reshard along dim 0)."""
    _check_bits(bits)
    rows, inner = codes.shape
    nbytes = packed_nbytes(inner, bits)
    if rows * inner == 0:
        return torch.zeros(rows, nbytes, dtype=torch.uint8, device=codes.device)
    inner8 = -(-inner // 8) * 8  # whole groups of 8 codes: every row then packs to whole bytes
    padded = torch.nn.functional.pad(codes.to(torch.int64), (0, inner8 - inner))
    return pack(padded, bits).view(rows, inner8 * bits // 8)[:, :nbytes].contiguous()


def unpack_rows(packed: torch.Tensor, bits: int, inner: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: uint8 ``[rows, packed_nbytes(inner, bits)]`` -> codes
    ``[rows, inner]`` of ``dtype``."""
    _check_bits(bits)
    nbytes = packed_nbytes(inner, bits)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != nbytes:
        raise ValueError(f"row-packed codes must be 2-D uint8 with {nbytes} bytes per row ({inner} codes of {bits} "
                         f"bits), got {packed.dtype} of shape {tuple(packed.shape)}")
    rows = packed.shape[0]
    if rows * inner == 0:
        return torch.zeros(rows, inner, dtype=dtype, device=packed.device)
    inner8 = -(-inner // 8) * 8
    padded = torch.nn.functional.pad(packed, (0, inner8 * bits // 8 - nbytes))
    return unpack(padded.reshape(-1), bits, rows * inner8, dtype).view(rows, inner8)[:, :inner]
