"""The small float formats of FP8 / FP4 quantization as exact tables (numpy has none; docs/formats.md, e4m3, e2m1, e8m0):
e4m3 (float8_e4m3fn: bias 7, no infinities, 0x7F / 0xFF NaN), e2m1 (FP4: 16 values) and e8m0 (MX
scales: a byte b is 2^(b - 127), 255 NaN)."""

from __future__ import annotations

import numpy as np

from ..storage.float8 import E4M3, e8m0  # noqa: F401 (the stored dtypes' exact decodings, re-exported)


E4M3_BOOK = tuple(float(v) for v in E4M3)   # the code book of every e4m3 QuantSpec (one object)
E4M3_MAX = 448.0
E4M3_NAN = (0x7F, 0xFF)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
E2M1_BOOK = tuple(float(v) for v in E2M1)   # the code book of every e2m1 QuantSpec (one object)
BOOKS = {"e4m3": (8, E4M3_BOOK), "e2m1": (4, E2M1_BOOK)}   # scheme -> (bits, code book)


def e4m3_bytes(values: np.ndarray) -> np.ndarray:
    """float32 values that are e4m3 values exactly (decoded scales) -> their e4m3 bytes (+0.0 -> 0x00,
    -0.0 -> 0x80). Raises ValueError on a value e4m3 does not hold (NaN, beyond 448, between codes)."""
    v = np.asarray(values, dtype=np.float32)
    mag = np.abs(v)
    codes = np.searchsorted(E4M3[:0x7F], mag).astype(np.uint8)     # E4M3[0:0x7F]: 0 .. 448, ascending
    np.minimum(codes, 0x7E, out=codes)
    if not np.array_equal(E4M3[codes], mag):
        raise ValueError("values that are not e4m3 values cannot be stored as e4m3 bytes")
    return codes | (np.signbit(v).astype(np.uint8) << 7)
