"""compressed-tensors tensor data -> QuantTensor: the family's reader (the layouts, from headers, and
the config are header.py and its parts beside it; writing is codec.py), and compressed-tensors' dense
bitstream both ways.

In a QuantTensor the codes are unsigned: the stored value q + 2^(b-1) (what pack-quantized writes,
and int-quantized's signed I8 plus 2^(b-1)), against zero points zp + 2^(b-1) (2^(b-1) everywhere for
a symmetric scheme). ``(codes - zeros) * scales`` is then exactly compressed-tensors'
``(q - zp) * scale``, and a symmetric 4-bit code is GPTQ's uint4b8 code. Scales are widened to float32;
``spec.scale_dtype`` keeps the stored dtype so that codec.encode writes the same bytes back.

The floating-point formats are read (read_float): float-quantized FP8 through the e4m3 reader every
FP8 dialect shares (fp8/codec.read_e4m3), nvfp4- and mxfp4-pack-quantized FP4 here (float_modules.py
gives their layouts and compressed-tensors' arithmetic).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.minifloat import E2M1_BOOK, e8m0
from ..core.packing import pack_int32, unpack_int32, unpack_nibbles_low_first
from ..fp8.codec import read_e4m3
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import finite_scales, read_array, to_float32
from .config import NVFP4
from .header import check
from .int_modules import _PADDED_BITS, _padded_range, padded_layout_message


# ---------------------------------------------------------------------------------------------
# compressed-tensors' dense bitstream over any length (pack_to_int32 / unpack_from_int32)

def unpack_dense(words: np.ndarray, bits: int, n: int, axis: int) -> np.ndarray:
    """int32 words -> n uint8 codes along ``axis``: the LSB-first bitstream of packing.py, for any n
    (compressed-tensors pads a row to whole 32-code runs and keeps only ceil(n*b/32) words)."""
    w = np.asarray(words)
    have = w.shape[axis]
    if have != math.ceil(n * bits / 32):
        raise NotStorable(f"{have} words along axis {axis} do not hold {n} {bits}-bit codes")
    if 32 % bits and have % bits:                     # whole runs of b words for unpack_int32
        pad = [(0, 0)] * w.ndim
        pad[axis] = (0, bits - have % bits)
        w = np.pad(w, pad)
    codes = unpack_int32(w, bits, axis=axis)
    if codes.shape[axis] != n:
        codes = np.take(codes, np.arange(n), axis=axis)
    return np.ascontiguousarray(codes)


def pack_dense(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint8 codes (< 2^bits) -> int32 words along ``axis``, ceil(n*b/32) of them; codes past the
    end are zero, as compressed-tensors pads them."""
    c = np.asarray(codes, dtype=np.uint8)
    n = c.shape[axis]
    if n % 32:
        pad = [(0, 0)] * c.ndim
        pad[axis] = (0, 32 - n % 32)
        c = np.pad(c, pad)
    words = pack_int32(c, bits, axis=axis)
    keep = math.ceil(n * bits / 32)
    if words.shape[axis] != keep:
        words = np.take(words, np.arange(keep), axis=axis)
    return np.ascontiguousarray(words)


def _unsigned(q: np.ndarray, bits: int, info: TensorInfo, what: str) -> np.ndarray:
    """Signed stored values (int-quantized) -> uint8 q + 2^(b-1), refusing values outside b bits."""
    offset = 1 << (bits - 1)
    if q.dtype == np.int8 and bits == 8:
        return q.view(np.uint8) ^ np.uint8(0x80)          # q + 128 (mod 256), bit for bit
    wide = q.astype(np.int64)
    if wide.size and (wide.min() < -offset or wide.max() >= offset):
        raise CorruptCheckpoint(f"holds {what} outside the {bits}-bit range {-offset}..{offset - 1}",
                                file=info.file, tensor=info.name)
    return (wide + offset).astype(np.uint8)


def _signed(u: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:                                          # u - 128 as int8, bit for bit, in one pass
        return (np.asarray(u, np.uint8) ^ np.uint8(0x80)).view(np.int8)
    return (np.asarray(u).astype(np.int16) - (1 << (bits - 1))).astype(np.int8)

# ---------------------------------------------------------------------------------------------
# Read

def _in_features(m: QuantModule, tensors: Mapping[str, TensorInfo]) -> int:
    """weight_shape's value (out, in), checked against what the headers allow."""
    info = tensors[m.name + ".weight_shape"]
    packed = tensors[m.name + ".weight_packed"]
    value = read_array(info).reshape(-1)
    got = tuple(int(v) for v in value)
    lo, hi = m.details["in_range"]
    if len(got) == 2 and got[0] == m.out_features and lo <= got[1] <= hi:
        return got[1]
    cols = packed.shape[1]
    if (len(got) == 2 and got[0] == m.out_features and m.bits in _PADDED_BITS
            and _padded_range(cols, m.bits)[0] <= got[1] <= _padded_range(cols, m.bits)[1]):
        raise UnsupportedFormat(padded_layout_message(
            m.bits, m.details.get("version"), f"weight_shape says in={got[1]}, which packs to {cols} "
                                              f"words a row only that way"), file=packed.file,
            tensor=packed.name)
    span = f"{lo}" if lo == hi else f"{lo}..{hi}"
    raise CorruptCheckpoint(f"weight_shape holds {list(got)}, but weight_packed {list(packed.shape)} and "
                            f"weight_scale hold a [{m.out_features}, {span}] weight; cannot decode it",
                            file=info.file, tensor=info.name)


def read(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None) -> QuantTensor:
    """The module as a QuantTensor, exactly: ``dequantize()`` rounded to float16 is what
    compressed-tensors decompresses for a float16 model. rows: only output rows r0:r1 (multiples of
    32, or the last row: packed zero points hold 32 rows in whole words)."""
    check(m, tensors, qc)
    name, bits, out = m.name, m.bits, m.out_features
    r0, r1 = rows or (0, out)
    if (r0 % 32 or (r1 % 32 and r1 != out)) or not 0 <= r0 <= r1 <= out:
        raise NotStorable(f"rows {r0}:{r1} of {name} are not whole runs of 32 output channels")
    window = None if rows is None else (r0, r1)
    if m.details.get("layout") in ("fp8", "fp4"):
        return read_float(m, tensors, dtype, rows)
    offset = 1 << (bits - 1)
    scale_info = tensors[name + ".weight_scale"]
    groups = scale_info.shape[1]
    if m.details["layout"] == "pack":
        inp = _in_features(m, tensors)
        codes = unpack_dense(read_array(tensors[name + ".weight_packed"], rows=window), bits, inp, axis=1)
    else:
        info = tensors[name + ".weight"]
        inp = info.shape[1]
        codes = np.ascontiguousarray(_unsigned(read_array(info, rows=window), bits, info, "codes"))
    scales = finite_scales(to_float32(read_array(scale_info, rows=window), scale_info.dtype), scale_info)
    out = r1 - r0
    if m.details["symmetric"]:
        zeros = np.full((out, groups), offset, dtype=np.uint8)
    else:
        info = tensors[name + ".weight_zero_point"]
        if m.details["layout"] == "pack":
            w1 = info.shape[0] if r1 == m.out_features else r1 * bits // 32
            zeros = unpack_dense(read_array(info, rows=None if rows is None else (r0 * bits // 32, w1)),
                                 bits, out, axis=0)
        else:
            zeros = np.ascontiguousarray(_unsigned(read_array(info, rows=window), bits, info, "zero points"))
    group_size = m.group_size
    if group_size > 0 and -(-inp // group_size) != groups:
        raise CorruptCheckpoint(f"holds {groups} groups, but {inp} input channels in groups of "
                                f"{group_size} make {-(-inp // group_size)}; cannot decode it",
                                file=scale_info.file, tensor=scale_info.name)
    g_idx = None
    if name + ".weight_g_idx" in tensors:
        info = tensors[name + ".weight_g_idx"]
        g_idx = read_array(info).astype(np.int64)
        if g_idx.shape != (inp,):
            raise CorruptCheckpoint(f"has shape {list(g_idx.shape)}, expected [{inp}]", file=info.file,
                                    tensor=info.name)
        if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise CorruptCheckpoint(f"holds groups outside 0..{groups - 1}", file=info.file, tensor=info.name)
        trivial = np.zeros(inp, np.int64) if group_size <= 0 else np.arange(inp) // group_size
        if np.array_equal(g_idx, trivial):
            g_idx = None
    spec = QuantSpec("int", bits, group_size, bool(m.details["symmetric"]), scale_dtype=scale_info.dtype)
    return QuantTensor(spec, (out, inp), dtype, codes=codes, scales=np.ascontiguousarray(scales),
                       zeros=zeros, g_idx=g_idx)


def read_float(m: QuantModule, tensors: Mapping[str, TensorInfo], dtype: str,
               rows: tuple[int, int] | None = None) -> QuantTensor:
    """A floating-point module (checked by read) as a QuantTensor whose dequantization, rounded to the
    model dtype, is compressed-tensors' own decompression bit for bit:

    * float-quantized: e4m3 codes times the scale of their row / block / tensor, exact in float32 and
      rounded once to the model dtype, as compressed-tensors' product in the scale's dtype;
    * nvfp4-pack-quantized: scales float32(e4m3 scale) / global (compressed-tensors divides the bfloat16
      scale by the float32 global scale in float32), the product rounded to bfloat16 (product_dtype),
      as its decompression into the bfloat16 FP4 values leaves it, before the model dtype;
    * mxfp4-pack-quantized: scales 2^(b - 127); its bfloat16 product is exact (a 2-bit e2m1 significand
      times a power of two), so nothing is rounded before the model dtype.

    Refused: e4m3 NaN codes and non-finite scales (read_e4m3), an e4m3 NaN group scale, a zero or
    non-finite global scale, an e8m0 scale of 255 (NaN)."""
    name = m.name
    scale = tensors[name + ".weight_scale"]
    if m.scheme == "e4m3":
        return read_e4m3(tensors[name + ".weight"], scale, m.details["block_rows"], m.group_size, dtype, rows)
    r0, r1 = rows or (0, m.out_features)
    window = None if rows is None else (r0, r1)
    codes = unpack_nibbles_low_first(read_array(tensors[name + ".weight_packed"], rows=window))
    stored = read_array(scale, rows=window)
    if m.details["format"] == NVFP4:
        group_scales = finite_scales(to_float32(stored, scale.dtype), scale)
        info = tensors[name + ".weight_global_scale"]
        g = np.float32(read_array(info).reshape(-1)[0])
        if not np.isfinite(g) or g == 0:
            raise CorruptCheckpoint(f"holds {float(g)}: every scale of the module is divided by it; cannot "
                                    f"decode it", file=info.file, tensor=info.name)
        if g < 0:
            raise CorruptCheckpoint(f"holds {float(g)}, but compressed-tensors' global scale is 448 x 6 / absmax, "
                                    f"positive; cannot decode it", file=info.file, tensor=info.name)
        with np.errstate(over="ignore"):
            scales = group_scales / g
        if not np.all(np.isfinite(scales)):
            raise CorruptCheckpoint(f"holds {float(g):.3g}, which makes scales of {scale.name} infinite; cannot "
                                    f"decode it", file=info.file, tensor=info.name)
        spec = QuantSpec("e2m1", 4, m.group_size, True, codebook=E2M1_BOOK, scale_dtype=scale.dtype,
                         global_scale="divisor")
        return QuantTensor(spec, (r1 - r0, m.in_features), dtype, codes=codes, scales=scales,
                           group_scales=group_scales, global_scale=g, product_dtype="bfloat16")
    nan = stored == 255
    if nan.any():
        o, i = (int(v[0]) for v in np.nonzero(nan))
        raise CorruptCheckpoint(f"holds {int(nan.sum())} e8m0 scales of 255 (NaN), the first at [{r0 + o}, {i}]: "
                                f"no weight of their groups decodes", file=scale.file, tensor=scale.name)
    spec = QuantSpec("e2m1", 4, m.group_size, True, codebook=E2M1_BOOK, scale_dtype=scale.dtype)
    return QuantTensor(spec, (r1 - r0, m.in_features), dtype, codes=codes, scales=e8m0(stored))
