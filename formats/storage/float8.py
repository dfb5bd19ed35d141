"""The 8-bit float dtypes safetensors stores, decoded exactly (numpy has neither): F8_E4M3
(float8_e4m3fn: bias 7, no infinities, 0x7F / 0xFF NaN) and F8_E8M0 (MX scales: a byte b is 2^(b - 127),
255 NaN). core/minifloat.py builds the quantization code books on them."""

from __future__ import annotations

import numpy as np


def _e4m3() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = sign * value
    value[(b & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


E4M3 = _e4m3()                       # code -> value; E4M3[0x7E] = 448, the largest


def e8m0(b: np.ndarray) -> np.ndarray:
    """Bytes as 2^(b - 127), float32 (255 is NaN; 0 is 2^-127, a float32 subnormal, exact)."""
    b = np.asarray(b, dtype=np.uint8)
    nan = b == 255
    out = np.ldexp(np.float32(1), np.where(nan, 0, b.astype(np.int32) - 127)).astype(np.float32)  # 2^128: no warning
    out[nan] = np.nan
    return out
