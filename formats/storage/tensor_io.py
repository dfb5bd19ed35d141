"""Tensor bytes <-> numpy, without torch: positioned reads of one tensor (or a slab of its rows) and the
float conversions safetensors dtypes need. numpy has no bfloat16, so BF16 travels as its raw uint16
bits and is widened / rounded here exactly as torch does (round to nearest even, NaN kept)."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import numpy as np

from ...errors import CorruptCheckpoint
from .safetensors_header import FLOAT_DTYPES, TensorInfo

# safetensors dtype -> numpy dtype of the stored bits (BF16 as raw uint16).
NUMPY = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
         "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "I32": np.int32, "F32": np.float32,
         "U64": np.uint64, "I64": np.int64, "F64": np.float64,
         "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}          # FP8 as raw bytes (core/minifloat.py decodes)
FLOAT_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
FLOAT_NAMES = {code: name for name, code in FLOAT_CODES.items()}


def read_array(info: TensorInfo, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor's stored values, freshly read, never mapped: all of it, or rows r0:r1 of its first
    dimension (one read), and/or columns c0:c1 of a 2-D tensor (one positioned read a row, so a
    window of a column-major layout such as GPTQ's [in, out] words costs only its own bytes). A tensor
    a container stores in its own encoding (TensorInfo.decode) is decoded, rows alike."""
    if info.decode is not None:
        if cols is not None:
            raise ValueError("a column window of a decoded tensor")
        return info.decode(info, rows)
    if info.dtype not in NUMPY:
        raise CorruptCheckpoint(f"dtype {info.dtype} cannot be read by qconv", file=info.file,
                                tensor=info.name)
    dtype = np.dtype(NUMPY[info.dtype])
    shape = tuple(info.shape)
    if cols is not None and len(shape) != 2:
        raise ValueError(f"a column window of a {len(shape)}-D tensor")
    if cols is not None and tuple(cols) == (0, shape[1]):
        cols = None                         # every column: one plain read
    offset, nbytes = info.offset, info.nbytes
    if rows is not None:
        row_bytes = (info.nbytes // shape[0]) if shape and shape[0] else 0
        offset += rows[0] * row_bytes
        nbytes = (rows[1] - rows[0]) * row_bytes
        shape = (rows[1] - rows[0],) + tuple(shape[1:])
    if cols is not None:
        return _read_columns(info, dtype, offset, shape, cols)
    out = np.empty(nbytes // dtype.itemsize, dtype=dtype)
    try:
        with open(info.file, "rb", buffering=0) as f:
            f.seek(offset)
            got = f.readinto(memoryview(out).cast("B"))
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read: {exc.strerror or exc}", file=info.file,
                                tensor=info.name) from None
    if got != nbytes:
        raise CorruptCheckpoint("file ended while reading the tensor: truncated", file=info.file,
                                tensor=info.name)
    return out.reshape(shape)


def _read_columns(info: TensorInfo, dtype: np.dtype, offset: int, shape: tuple, cols: tuple[int, int]):
    n_rows, width = shape
    c0, c1 = cols
    if not 0 <= c0 <= c1 <= width:
        raise ValueError(f"columns {c0}:{c1} of a tensor {width} wide")
    out = np.empty((n_rows, c1 - c0), dtype=dtype)
    row_bytes, want = width * dtype.itemsize, (c1 - c0) * dtype.itemsize
    start = offset + c0 * dtype.itemsize
    try:
        fd = os.open(info.file, os.O_RDONLY)
        try:
            for r in range(n_rows):
                if want and os.preadv(fd, [out[r]], start + r * row_bytes) != want:
                    raise CorruptCheckpoint("file ended while reading the tensor: truncated",
                                            file=info.file, tensor=info.name)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read: {exc.strerror or exc}", file=info.file,
                                tensor=info.name) from None
    return out


def finite_scales(values: np.ndarray, info: TensorInfo) -> np.ndarray:
    """Scales as read, refused when one is NaN or infinite: every weight it scales would decode to
    garbage, and a comparison against a bound would not notice."""
    if not np.all(np.isfinite(values)):
        raise CorruptCheckpoint("holds non-finite scales (NaN or infinity)", file=info.file, tensor=info.name)
    return values


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values (as read_array gives them) as float32, exactly: every dtype a scale is stored in."""
    if dtype == "BF16":
        return bf16_to_f32(values)
    if dtype in ("F8_E4M3", "F8_E8M0"):
        from .float8 import E4M3, e8m0
        return E4M3[values] if dtype == "F8_E4M3" else e8m0(values)
    return values.astype(np.float32, copy=False)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even as torch's .to(torch.bfloat16) rounds
    (c10::BFloat16: (u + 0x7FFF + ((u >> 16) & 1)) >> 16, beyond the largest finite value infinity), NaN
    as 0xFFFF, what ATen's vectorized conversion writes for every NaN. In numpy, so writing bfloat16 needs
    no torch (its import is 1-2 s of a dequantize), and the bits are the same on every CPU."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    t = u >> 16
    t &= 1
    t += 0x7FFF
    t += u                                   # wraps only for NaN / inf bit patterns above 0xFF800000 - 0x8000
    t >>= 16
    out = t.astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        out[nan] = 0xFFFF
    return out.reshape(np.shape(values))


_TORCH = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def convert_float(values: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Cast stored float values between safetensors float dtypes, exactly as torch's .to() does
    (round to nearest even, NaN and inf kept): torch does the cast, on the CPU's conversion
    instructions, which numpy's float16 cast does not use (10x slower)."""
    if src == dst:
        return values
    if src == "F32" and dst == "BF16":
        return f32_to_bf16(values)
    if values.size <= 1 << 16 and src in ("F16", "F32", "F64") and dst in ("F16", "F32"):
        with np.errstate(over="ignore"):     # beyond float16's range is inf, as torch makes it
            return values.astype(np.float16 if dst == "F16" else np.float32)   # small: skip torch's import
    import torch

    raw = np.ascontiguousarray(values)
    with warnings.catch_warnings():          # a read-only buffer (a file's bytes) is only read here
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        t = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16) if src == "BF16" else torch.from_numpy(raw)
    out = t.to(getattr(torch, _TORCH[dst]))
    return out.view(torch.int16).numpy().view(np.uint16) if dst == "BF16" else out.numpy()


def encode_float(x32: np.ndarray, code: str) -> np.ndarray:
    """float32 values -> the stored representation of ``code`` (F16, BF16 bits, or F32)."""
    return convert_float(np.ascontiguousarray(x32, dtype=np.float32), "F32", code)


def all_finite(stored: np.ndarray, code: str) -> bool:
    """Whether every value of a stored float array (F16, F32, or BF16 as uint16 bits) is finite."""
    if code == "BF16":
        return not bool(((stored.view(np.uint16) & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(stored).all())


SLAB_BYTES = 4 << 20            # bytes of one slab of rows of a plain tensor


def plain_chunks(info: TensorInfo, dtype: str):
    """A stored tensor, slab by slab, cast to ``dtype`` when both are floating point (a decoded one,
    TensorInfo.decode, decoded straight into it: one rounding)."""
    if info.decode is not None and info.dtype in FLOAT_DTYPES and dtype in FLOAT_DTYPES:
        info = replace(info, dtype=dtype)

    def cast(data):
        return convert_float(data, info.dtype, dtype) if info.dtype in FLOAT_DTYPES and dtype != info.dtype else data

    if len(info.shape) < 2 or info.shape[0] == 0:
        yield cast(read_array(info))
        return
    rows = max(1, SLAB_BYTES // max(1, info.nbytes // info.shape[0]))
    for r0 in range(0, info.shape[0], rows):
        yield cast(read_array(info, rows=(r0, min(r0 + rows, info.shape[0]))))
