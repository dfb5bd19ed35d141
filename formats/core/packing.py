"""Bit packing as pure, vectorised numpy. Two layouts cover every supported format.

LSB-first bitstream of ``b``-bit codes in 32-bit words (GPTQ qweight along in, qzeros along out;
auto-round; docs/formats.md, GPTQ). Code ``i`` of a run of 32 codes sits at bit ``i*b`` of the run's ``b``
words; a code that crosses a word edge keeps its low bits in the earlier word::

    b = 4:  word k = | c7 | c6 | c5 | c4 | c3 | c2 | c1 | c0 |      (c0 in bits 0-3)
    b = 3:  word 0 = |c10.lo2| c9 | ... | c1 | c0 |                 (c0 in bits 0-2, c10's low 2 bits at 30-31)
            word 1 = | c21.lo1 | c20 | ... | c11 | c10.hi1 |
            word 2 = | c31 | ... | c22 | c21.hi2 |

For b in {2, 4, 8} a word holds 32/b whole codes; otherwise 32 codes fill exactly b words, so the
packed axis must hold a multiple of 32 codes.

bitsandbytes 4-bit: two codes a byte over the row-major flattened weight, element 2k in the HIGH
nibble, 2k+1 in the LOW nibble; an odd count is padded with one zero code (docs/formats.md, bitsandbytes 4-bit)::

    byte k = | c(2k) : 4 | c(2k+1) : 4 |
"""

from __future__ import annotations

import numpy as np

from ...errors import NotStorable


def _bit_positions(bits: int):
    """(word, offset) of each code of a 32-code run."""
    pos = np.arange(32) * bits
    return pos // 32, pos % 32


def packed_length(n_codes: int, bits: int) -> int:
    """Words needed for n_codes along the packed axis (raises if the layout cannot hold them)."""
    if 32 % bits == 0:
        per_word = 32 // bits
        if n_codes % per_word:
            raise NotStorable(f"{n_codes} codes of {bits} bits do not fill whole 32-bit words")
        return n_codes // per_word
    if n_codes % 32:
        raise NotStorable(f"{bits}-bit packing needs a multiple of 32 codes, got {n_codes}")
    return n_codes // 32 * bits


def unpack_int32(words: np.ndarray, bits: int, axis: int = 0) -> np.ndarray:
    """Packed words (any 32-bit integer dtype) -> uint8 codes, unpacked along ``axis``."""
    w = np.moveaxis(np.asarray(words).view(np.uint32), axis, 0)
    mask = np.uint32((1 << bits) - 1)
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = (np.arange(per_word, dtype=np.uint32) * bits).reshape((1, per_word) + (1,) * (w.ndim - 1))
        codes = ((w[:, None] >> shifts) & mask).reshape((w.shape[0] * per_word,) + w.shape[1:])
    else:
        if w.shape[0] % bits:
            raise NotStorable(f"{w.shape[0]} words are not whole runs of {bits} words")
        runs = w.reshape((w.shape[0] // bits, bits) + w.shape[1:])
        word, offset = _bit_positions(bits)
        codes = np.empty((runs.shape[0], 32) + w.shape[1:], dtype=np.uint32)
        for i in range(32):
            value = runs[:, word[i]] >> np.uint32(offset[i])
            if offset[i] + bits > 32:
                value = value | (runs[:, word[i] + 1] << np.uint32(32 - offset[i]))
            codes[:, i] = value & mask
        codes = codes.reshape((runs.shape[0] * 32,) + w.shape[1:])
    return np.moveaxis(codes.astype(np.uint8), 0, axis)


def unpack_int32_transposed(words: np.ndarray, bits: int) -> np.ndarray:
    """Words packed along axis 0, [n_words, m] -> contiguous uint8 codes [m, n_codes]: the transpose of
    unpack_int32(words, bits, axis=0), made by transposing the 32-bit words first (32/b codes moved at
    once, the cheap transposition) and unpacking along the now contiguous last axis. For b in {2, 4, 8}
    a little-endian word's codes are its bytes' fields, low field first, so unpacking is byte arithmetic."""
    wt = np.ascontiguousarray(np.asarray(words).view(np.uint32).T)          # [m, n_words]
    if bits == 8:
        return wt.view(np.uint8)                                            # byte j of word k: code 4k + j
    if bits in (2, 4):
        b = wt.view(np.uint8)                                               # [m, 4 n_words]
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        out = np.empty(b.shape[:-1] + (b.shape[-1] * per,), dtype=np.uint8)
        for j in range(per):
            np.bitwise_and(b >> np.uint8(j * bits) if j else b, mask, out=out[..., j::per])
        return out
    return np.ascontiguousarray(unpack_int32(wt, bits, axis=1))


def _pack_bytes_le(c: np.ndarray, bits: int) -> np.ndarray:
    """bits in {2, 4, 8}: fold codes into bytes LSB-first along axis 0, then read each run of 4 bytes
    as one little-endian word: the LSB-first bitstream, built with byte moves instead of 32-bit shifts."""
    b = c.astype(np.uint8, copy=False)
    width = bits
    while width < 8:
        b = b[0::2] | (b[1::2] << np.uint8(width))
        width *= 2
    nwords = b.shape[0] // 4
    grouped = np.moveaxis(b.reshape((nwords, 4) + b.shape[1:]), 1, -1)
    return np.ascontiguousarray(grouped).view("<u4").reshape(grouped.shape[:-1])


def pack_int32(codes: np.ndarray, bits: int, axis: int = 0) -> np.ndarray:
    """uint codes (< 2**bits) -> int32 words, packed along ``axis``. Inverse of unpack_int32."""
    c = np.moveaxis(np.asarray(codes), axis, 0)
    if bits < 8 or c.dtype != np.uint8:
        if np.any(c.astype(np.uint32) >> np.uint32(bits)):
            raise NotStorable(f"codes do not fit in {bits} bits")
    n = c.shape[0]
    nwords = packed_length(n, bits)
    if bits in (2, 4, 8):
        return np.ascontiguousarray(np.moveaxis(_pack_bytes_le(c, bits).view(np.int32), 0, axis))
    c = c.astype(np.uint32)
    if 32 % bits == 0:
        per_word = 32 // bits
        grouped = c.reshape((nwords, per_word) + c.shape[1:])
        out = np.zeros((nwords,) + c.shape[1:], dtype=np.uint32)
        for j in range(per_word):
            out |= grouped[:, j] << np.uint32(j * bits)
    else:
        runs = c.reshape((n // 32, 32) + c.shape[1:])
        out = np.zeros((n // 32, bits) + c.shape[1:], dtype=np.uint32)
        word, offset = _bit_positions(bits)
        for i in range(32):
            out[:, word[i]] |= runs[:, i] << np.uint32(offset[i])
            if offset[i] + bits > 32:
                out[:, word[i] + 1] |= runs[:, i] >> np.uint32(32 - offset[i])
        out = out.reshape((nwords,) + c.shape[1:])
    return np.moveaxis(out.view(np.int32), 0, axis)


def unpack_nibbles_high_first(packed: np.ndarray, n: int) -> np.ndarray:
    """bitsandbytes 4-bit bytes (any storage dtype: the bytes are what count) -> n uint8 codes."""
    b = np.ascontiguousarray(packed).view(np.uint8).reshape(-1)
    if b.size * 2 < n:
        raise NotStorable(f"{b.size} bytes hold {b.size * 2} codes, fewer than {n}")
    out = np.empty(b.size * 2, dtype=np.uint8)
    out[0::2] = b >> 4
    out[1::2] = b & 0x0F
    return out[:n]


def pack_nibbles_high_first(codes: np.ndarray) -> np.ndarray:
    c = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if c.size % 2:
        c = np.concatenate([c, np.zeros(1, np.uint8)])
    return ((c[0::2] << 4) | c[1::2]).astype(np.uint8)


def unpack_nibbles_low_first(packed: np.ndarray) -> np.ndarray:
    """FP4 bytes [..., n/2] (compressed-tensors NVFP4 / MXFP4, ModelOpt NVFP4, gpt-oss MXFP4: element 2i in
    the LOW nibble, 2i + 1 in the high one) -> uint8 codes [..., n]."""
    b = np.ascontiguousarray(packed).view(np.uint8)
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = b & 0x0F
    out[..., 1::2] = b >> 4
    return out


def pack_nibbles_low_first(codes: np.ndarray) -> np.ndarray:
    """The inverse of unpack_nibbles_low_first: codes [..., n] (n even) -> bytes [..., n/2]."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise NotStorable(f"{c.shape[-1]} FP4 codes a row do not fill whole bytes")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
