"""compressed-tensors tensor data <-> QuantTensor (the layout, from headers, and the config are
header.py beside it).

In a QuantTensor the codes are unsigned: the stored value q + 2^(b-1) (what pack-quantized writes,
and int-quantized's signed I8 plus 2^(b-1)), against zero points zp + 2^(b-1) (2^(b-1) everywhere for
a symmetric scheme). ``(codes - zeros) * scales`` is then exactly compressed-tensors'
``(q - zp) * scale``, and a symmetric 4-bit code is GPTQ's uint4b8 code. Scales are widened to float32;
``spec.scale_dtype`` keeps the stored dtype so that encode writes the same bytes back.

The floating-point formats are read (read_float): float-quantized FP8 through the e4m3 reader every
FP8 dialect shares (fp8/codec.read_e4m3), nvfp4- and mxfp4-pack-quantized FP4 here (header.py gives
their layouts and compressed-tensors' arithmetic). float-quantized FP8 is also written (target
compressed-tensors-fp8: fit_fp8, plan_fp8, requantize_fp8 with llm-compressor's arithmetic, retarget_fp8,
encode_fp8).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from .header import (FP8_TARGET, INT, input_scale_dtype, MXFP4_GROUP, MXFP4_TARGET, NAIVE, NVFP4, NVFP4_GROUP, NVFP4_TARGET, PACKED,
                     READABLE_FORMATS, mxfp4_leaves,
                     _PADDED_BITS, _SCALE_DTYPES, _padded_range, check, float_leaves, fused_group, leaves,
                     nvfp4_leaves, padded_layout_message)
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.minifloat import E2M1, E2M1_BOOK, E4M3_BOOK, E4M3_MAX, e4m3_bytes, e8m0
from ..core.packing import pack_int32, unpack_int32, unpack_nibbles_low_first
from ..fp8.codec import read_e4m3
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import encode_float, finite_scales, read_array, to_float32

__all__ = ["read", "encode", "leaves", "pack_dense", "unpack_dense"]


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


# ---------------------------------------------------------------------------------------------
# Encode

def encode(qt: QuantTensor, fmt: str = PACKED, scale_dtype: str | None = None
           ) -> dict[str, tuple[str, np.ndarray]]:
    """QuantTensor -> the tensors of a compressed-tensors module, leaf name -> (safetensors dtype,
    stored values); the inverse of read, and exactly what ``leaves()`` predicts. ``fmt``
    "pack-quantized" packs codes (and asymmetric zero points, along out) into int32 words;
    "int-quantized" / "naive-quantized" store signed I8 codes. A non-trivial g_idx is written as
    weight_g_idx, as compressed-tensors up to 0.18 did (0.19 and later refuse it)."""
    spec = qt.spec
    if fmt not in READABLE_FORMATS:
        raise NotStorable(f"compressed-tensors format {fmt!r} is not one qconv writes "
                         f"({', '.join(READABLE_FORMATS)})")
    if spec.scheme != "int" or spec.scale_divisor != 1:
        raise NotStorable("compressed-tensors encodes integer codes with plain scales (scale_divisor 1)")
    bits = spec.bits
    if not 1 <= bits <= 8:
        raise NotStorable(f"compressed-tensors stores 1- to 8-bit codes, not {bits}-bit ones")
    sdt = scale_dtype or spec.scale_dtype
    if sdt not in _SCALE_DTYPES:
        raise NotStorable(f"scale dtype {sdt!r}: compressed-tensors scales are {', '.join(_SCALE_DTYPES)}")
    offset = 1 << (bits - 1)
    out, inp = qt.shape
    codes, zeros = np.asarray(qt.codes), qt.zeros
    if codes.shape != (out, inp):
        raise NotStorable(f"codes have shape {codes.shape}, expected {(out, inp)}")
    if codes.size and int(codes.max()) >> bits:
        raise NotStorable(f"codes do not fit in {bits} bits")
    if spec.symmetric:
        if zeros is not None and np.any(zeros != offset):
            raise NotStorable(f"a symmetric compressed-tensors module stores no zero point, so every "
                             f"zero must be {offset} (2^(b-1)); write it as asymmetric instead")
    elif zeros is None or (zeros.size and int(np.max(zeros)) >> bits):
        raise NotStorable(f"asymmetric zero points must be given and fit in {bits} bits")
    scales = encode_float(np.ascontiguousarray(qt.scales), sdt)
    res: dict[str, tuple[str, np.ndarray]] = {}
    if fmt == PACKED:
        res["weight_packed"] = ("I32", pack_dense(codes, bits, axis=1))
        res["weight_scale"] = (sdt, scales)
        res["weight_shape"] = ("I64", np.array([out, inp], dtype=np.int64))
        if not spec.symmetric:
            res["weight_zero_point"] = ("I32", pack_dense(zeros, bits, axis=0))
    else:
        assert fmt in (INT, NAIVE)
        res["weight"] = ("I8", np.ascontiguousarray(_signed(codes, bits)))
        res["weight_scale"] = (sdt, scales)
        if not spec.symmetric:
            res["weight_zero_point"] = ("I8", np.ascontiguousarray(_signed(zeros, bits)))
    if qt.g_idx is not None:
        res["weight_g_idx"] = ("I32", np.asarray(qt.g_idx).astype(np.int32))
    planned = leaves(spec, qt.shape, fmt, scale_dtype=sdt, g_idx=qt.g_idx is not None)
    stored = {leaf: (d, tuple(a.shape)) for leaf, (d, a) in res.items()}
    assert stored == planned, (stored, planned)
    return res


def encode_for(target: str, qt: QuantTensor, spec: QuantSpec, g_idx: bool) -> dict[str, tuple[str, np.ndarray]]:
    """The registry's encoder of the compressed-tensors targets."""
    if target == FP8_TARGET:
        return encode_fp8(qt, spec)
    if target == NVFP4_TARGET:
        return encode_nvfp4(qt, spec)
    if target == MXFP4_TARGET:
        return encode_mxfp4(qt, spec)
    return encode(qt, INT if target == "compressed-tensors-w8a8" else PACKED, spec.scale_dtype)


# ---------------------------------------------------------------------------------------------
# Target compressed-tensors-fp8: llm-compressor's float-quantized FP8 (FP8_DYNAMIC, FP8_BLOCK)

_MODEL_SCALE = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def _structure(block_rows: int, group_size: int) -> str:
    if block_rows == 0:
        return "per tensor"
    if block_rows == 1 and group_size <= 0:
        return "per channel"
    return f"in {block_rows} x {group_size} blocks"


def fit_fp8(m: QuantModule, src, request, negotiate) -> tuple[QuantSpec, str | None]:
    """The spec of a module in compressed-tensors-fp8: e4m3 codes per output channel (FP8_DYNAMIC), or in
    blocks of --block-size (FP8_BLOCK); without --block-size an e4m3 source in 2-D blocks keeps its
    blocks. Codes are kept where the source is e4m3 in the same structure (fine-grained FP8 and
    compressed-tensors FP8_BLOCK in the same blocks, per-channel FP8 into channels) and where it has one
    scale per tensor (the scale repeated per channel or block: the same weights); everything else is
    quantized from its exact weights as llm-compressor does (requantize_fp8). The scale dtype here is
    provisional: plan_fp8 settles it once the model dtype is known. --bits / --group-size / --sym are
    integer settings and --scale-dtype is llm-compressor's choice (the model dtype): refused (Target.options)."""
    e4m3 = src.scheme == "e4m3"
    src_group = src.group_size if (src.group_size or 0) > 0 else -1
    if request.block_size:
        block_rows, group = request.block_size
    elif e4m3 and src.block_rows > 0 and src_group > 0:
        block_rows, group = src.block_rows, src_group
    elif e4m3 and src.block_rows == 0:                 # llm-compressor's FP8 preset: one scale per tensor
        block_rows, group = 0, -1
    else:
        block_rows, group = 1, -1
    if e4m3:
        scale_dtype = src.scale_dtype if src.scale_dtype in _SCALE_DTYPES else "F32"
    else:
        scale_dtype = _MODEL_SCALE.get(m.details.get("dtype"), "F16")
    spec = QuantSpec("e4m3", 8, group, True, codebook=E4M3_BOOK, scale_dtype=scale_dtype, block_rows=block_rows)
    if src.scheme == "float":
        return spec, src.requantized(" to e4m3")
    if not e4m3:
        return spec, f"{src.name} codes become e4m3"
    if src.block_rows == 0 or (src.block_rows, src_group) == (block_rows, group):
        return spec, None          # the same structure, or one scale per tensor repeated per channel / block
    return spec, f"e4m3 {_structure(src.block_rows, src_group)} become e4m3 {_structure(block_rows, group)}"


def plan_fp8(ctx) -> dict:
    """{"scale_dtype": ...}: the model dtype, where llm-compressor stores its scales (and computes them:
    requantized modules); for kept codes the model dtype where every kept scale is exactly a value of it
    (compressed-tensors FP8 -> fp8 -> here gives back the same bytes), else float32, which
    compressed-tensors reads too and which holds every F16 / BF16 / E8M0 / F32 scale: nothing rounds
    (fine-grained FP8's float32 amax / 448 is rarely a 16-bit value)."""
    model = _MODEL_SCALE.get(ctx.dtype, "F32")
    if ctx.reason or ctx.spec.scale_dtype == model:
        return {"scale_dtype": model, **_static_input(ctx)}
    dtype, stored = ctx.encode({"scale_dtype": "F32"})["weight_scale"]
    kept = to_float32(stored, dtype)
    exact = np.array_equal(to_float32(encode_float(kept, model), model), kept)
    return {"scale_dtype": model if exact else "F32", **_static_input(ctx)}


def _static_input(ctx) -> dict:
    """{"input_scale": multiplier} where the module keeps a static FP8 activation scale
    (core/activation.py): the source has one, its codes are kept, and its weights are per tensor or per
    channel (llm-compressor's FP8 scheme; vLLM's block-FP8 kernels quantize activations dynamically per
    group, so a block module's activations become dynamic and the scale is not written). {}: dynamic."""
    act = ctx.activation
    if act is None or act.scheme != "fp8" or ctx.reason or ctx.spec.group_size > 0:
        return {}
    return {"input_scale": float(act.as_kind("multiplier"))}


def quantize_fp8(w: np.ndarray, dtype: str, block_rows: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [out, in], scales float32 [out, 1] or [ceil(out/B0), ceil(in/B1)]) of a weight, as
    llm-compressor's oneshot with the FP8_DYNAMIC / FP8_BLOCK presets computes them (its
    memoryless_minmax observer, compressed-tensors' calculate_qparams and the float-quantized compressor,
    compressed-tensors 0.19), with the same torch operations in the same dtypes, so the same float model
    gives the same bytes:

    * the weight in the model dtype (``dtype``; a quantized source's exact weights rounded to it, which
      is the model llm-compressor would load); blocks: padded with zeros to whole blocks (which do not
      change a block's range: min and max are taken with 0);
    * per channel / block: min(amin, 0) and max(amax, 0), scale = max(|min|, |max|) / (896 / 2) in the
      model dtype (calculate_range's float32 -448..448, its span cast to the model dtype), a zero scale
      replaced by the model dtype's eps;
    * codes = e4m3(clamp(x / scale + 0, -448, 448)): the division in the model dtype (a float32 division
      differs in thousands of codes of the fixtures), the zero point (force-initialised zeros) added as
      compressed-tensors adds it, torch's cast rounding to nearest even."""
    import torch

    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    x = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(tdtype)
    out, inp = x.shape
    q_min, q_max = torch.tensor(-E4M3_MAX), torch.tensor(E4M3_MAX)    # calculate_range: float32 0-dim
    block = group_size > 0
    if block:
        b0, b1 = max(1, min(block_rows, out)), max(1, min(group_size, inp))   # a block larger than the
        rt, ct = -(-out // b0), -(-inp // b1)          # weight: one block over it, padding sized by the weight
        x = torch.nn.functional.pad(x, (0, ct * b1 - inp, 0, rt * b0 - out), mode="constant", value=0)
        x = x.reshape(rt, b0, ct, b1).transpose(1, 2)                   # [rt, ct, b0, b1]
        lo, hi = x.amin(dim=(-2, -1)), x.amax(dim=(-2, -1))
    elif inp == 0:                                                     # no inputs: a range of [0, 0]
        lo = hi = torch.zeros((out, 1), dtype=tdtype)
    else:
        lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    lo = torch.min(lo, torch.zeros_like(lo))
    hi = torch.max(hi, torch.zeros_like(hi))
    amax = torch.max(torch.abs(lo), torch.abs(hi))
    scale = amax / ((q_max - q_min).to(amax.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype), scale)
    s = scale.unsqueeze(-1).unsqueeze(-1) if block else scale
    scaled = x / s
    scaled.add_(0.0)                             # + zero point: -0 + 0 = +0 (a tiny negative stays one: e4m3 -0)
    scaled.clamp_(-E4M3_MAX, E4M3_MAX)           # clamp(x, q_min, q_max): +-448 are bfloat16 / float16 values
    codes = scaled.to(torch.float8_e4m3fn)
    if block:
        codes = codes.transpose(1, 2).reshape(rt * b0, ct * b1)[:out, :inp]
    return codes.contiguous().view(torch.uint8).numpy(), scale.to(torch.float32).numpy().astype(np.float32, copy=False)


def _fp8_tensor(codes: np.ndarray, scales: np.ndarray, spec: QuantSpec, dtype: str) -> QuantTensor:
    """Codes and scales in the target's layout -> a QuantTensor (scales expanded to one row per output
    row, as read_e4m3 gives them)."""
    rows = np.arange(codes.shape[0]) // spec.block_rows
    return QuantTensor(spec, codes.shape, dtype, codes=codes, scales=np.ascontiguousarray(scales[rows]))


def requantize_fp8(source, w: np.ndarray, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, QuantTensor]:
    """A module quantized to e4m3 from its exact weights as llm-compressor quantizes it (quantize_fp8:
    min-max, no search, so the report's two columns are the same), scales in the planned dtype."""
    sdt = settings.get("scale_dtype") or _MODEL_SCALE.get(source.dtype, "F32")
    spec = replace(spec, scale_dtype=sdt)
    codes, scales = quantize_fp8(w, source.dtype, spec.block_rows, spec.group_size)
    qt = _fp8_tensor(codes, scales, spec, source.dtype)
    return qt, qt


def retarget_fp8(qt: QuantTensor, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, np.ndarray]:
    """Kept e4m3 codes with their scales in the planned dtype (plan_fp8 picks one that holds them
    exactly); a per-tensor scale is repeated over every channel / block. exact: the scales as they were,
    for the report."""
    sdt = settings.get("scale_dtype") or spec.scale_dtype
    scales = np.asarray(qt.scales, dtype=np.float32)
    if qt.spec.block_rows == 0 and spec.group_size > 0:
        scales = np.repeat(scales[:, :1], -(-qt.shape[1] // spec.group_size), axis=1)
    stored = to_float32(encode_float(scales, sdt), sdt)
    act = settings.get("input_scale")
    return replace(qt, spec=replace(spec, scale_dtype=sdt), scales=np.ascontiguousarray(stored),
                   input_scale=None if act is None else np.float32(act)), scales


def encode_fp8(qt: QuantTensor, spec: QuantSpec) -> dict[str, tuple[str, np.ndarray]]:
    """weight (e4m3 bytes) and weight_scale in qt's scale dtype: one per row (channel) or per block (the
    first row's of each block of rows, which every row of the block shares); what float_leaves predicts."""
    sdt = qt.spec.scale_dtype
    out = qt.shape[0]
    scales = np.asarray(qt.scales, dtype=np.float32)
    if spec.group_size > 0:
        blocks = scales[:: spec.block_rows]
        if not np.array_equal(blocks[np.arange(out) // spec.block_rows], scales):
            raise NotStorable(f"rows of one {spec.block_rows}-row block hold different scales")
    elif spec.block_rows == 0:                   # per tensor: one scale, [1]
        blocks = scales.reshape(-1)[:1]
        if scales.size and not (scales == blocks[0]).all():
            raise NotStorable("a per-tensor module holds different scales")
    else:
        blocks = scales
    res = {"weight": ("F8_E4M3", np.ascontiguousarray(qt.codes, dtype=np.uint8)),
           "weight_scale": (sdt, encode_float(np.ascontiguousarray(blocks), sdt))}
    input_scale = None if qt.input_scale is None else float(qt.input_scale)
    if input_scale is not None:
        idt = input_scale_dtype(input_scale, sdt)
        res["input_scale"] = (idt, encode_float(np.array([input_scale], dtype=np.float32), idt))
    planned = float_leaves(spec, qt.shape, scale_dtype=sdt, input_scale=input_scale)
    stored = {leaf: (d, tuple(a.shape)) for leaf, (d, a) in res.items()}
    if stored != planned:
        raise NotStorable(f"stores {stored}, but {planned} were planned")
    return res


# ---------------------------------------------------------------------------------------------
# Target compressed-tensors-nvfp4: llm-compressor's NVFP4A16 (nvfp4-pack-quantized, weights only)

E2M1_MAX = 6.0
_TORCH_DTYPES = ("float16", "bfloat16")


def _fp4_settings(m: QuantModule, request, target: str, kind: str, group: int, scales: str) -> None:
    """What an FP4 target written as llm-compressor writes it refuses before any data: inputs that are not
    whole groups (exit 5). Its settings are llm-compressor's: it takes no option (Target.options)."""
    if m.in_features % group:
        raise UnsupportedFormat(f"has {m.in_features} input features, not a whole number of {kind} groups of "
                                f"{group}; {target} cannot hold it", tensor=m.name)


def _nvfp4_spec() -> QuantSpec:
    return QuantSpec("e2m1", 4, NVFP4_GROUP, True, codebook=E2M1_BOOK, scale_dtype="F8_E4M3", global_scale="divisor")


def fit_nvfp4(m: QuantModule, src, request, negotiate) -> tuple[QuantSpec, str | None]:
    """The spec of a module in compressed-tensors-nvfp4: e2m1 codes in groups of 16 along each row, an
    e4m3 scale per group and a float32 global divisor per module. Codes are kept where the source is
    NVFP4 (compressed-tensors, whose global scale is this one; ModelOpt, whose multiplier becomes its
    float32 reciprocal, the rounding reported); everything else is quantized from its exact weights as
    llm-compressor does (requantize_nvfp4). Every option is llm-compressor's choice: refused. A module
    whose inputs are not whole groups of 16 is refused."""
    _fp4_settings(m, request, NVFP4_TARGET, "NVFP4", NVFP4_GROUP, "e4m3 scales, a float32 global scale")
    spec = _nvfp4_spec()
    if src.scheme == "e2m1" and src.global_scale is not None and src.group_size == NVFP4_GROUP:
        return spec, None
    if src.scheme == "float":
        return spec, src.requantized(" to NVFP4")
    return spec, f"{src.name} codes become NVFP4"


ABSMAX_WINDOW = 1 << 22     # weights of rows _absmax reads at a time


def _absmax(w, dtype: str, window: int | None = None):
    """The weight's absolute maximum as llm-compressor's observer takes it: over the weight in the model
    dtype (a torch 0-dim tensor of that dtype). Read a window of about ``window`` weights of rows at a
    time (w: an array or convert's ExactRows): the maximum of the windows' maxima is the same value."""
    import torch

    tdtype = getattr(torch, dtype) if dtype in _TORCH_DTYPES else torch.float32
    best = torch.zeros((), dtype=tdtype)
    out, inp = w.shape
    step = max(1, (window or ABSMAX_WINDOW) // max(1, inp))
    for r0 in range(0, out, step):
        x = torch.from_numpy(np.ascontiguousarray(w[r0:r0 + step], dtype=np.float32)).to(tdtype)
        if x.numel():
            best = torch.maximum(best, x.abs().max())
    return best


def plan_nvfp4(ctx) -> dict:
    """A requantized module's statistic for its global scale, {"absmax": float, "dtype": model dtype},
    which share_nvfp4 turns into the global scale of its fused group; a kept module keeps its own
    ({"global_scale": None}: the source's, in retarget_nvfp4)."""
    if not ctx.reason:
        act = ctx.activation
        carried = act is not None and act.scheme == "nvfp4"
        return {"global_scale": None, **({"input_global_scale": float(act.as_kind("divisor"))} if carried else {})}
    w = ctx.weights()
    absmax = float(_absmax(w, ctx.dtype))
    if not math.isfinite(absmax):           # 448 x 6 / inf: a global scale of 0, every group scale infinite
        info = (ctx.tensors or {}).get(ctx.module.weight_tensors[0]) if ctx.module.weight_tensors else None
        raise UnsupportedFormat(f"its weights (largest {float(np.abs(w).max()):.3g}) exceed {ctx.dtype}, the dtype "
                                f"compressed-tensors computes NVFP4's global scale in: it cannot be quantized to "
                                f"NVFP4", file=info.file if info else None, tensor=ctx.module.name)
    return {"absmax": absmax, "dtype": ctx.dtype}


def global_scale(absmax: float, dtype: str) -> float:
    """compressed-tensors' generate_gparam: 448 * 6 / absmax in the model dtype (the observer's
    statistics are in it), absmax at least the dtype's smallest normal, NaN and inf replaced by 1, then
    float32."""
    import torch

    tdtype = getattr(torch, dtype) if dtype in _TORCH_DTYPES else torch.float32
    a = torch.clamp(torch.tensor([absmax], dtype=tdtype), min=torch.finfo(tdtype).tiny)
    g = torch.nan_to_num(E4M3_MAX * E2M1_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)
    return float(g.to(torch.float32)[0])


def share_nvfp4(settings: Mapping[str, dict]) -> dict[str, dict]:
    """One global scale for the requantized modules vLLM fuses (q/k/v, gate/up, ...: header.fused_group),
    from their joint absolute maximum, as llm-compressor's fused observers compute it; a module in no
    group has its own."""
    joint: dict[str, tuple[float, str]] = {}
    for name, s in settings.items():
        if "absmax" in s:
            key = fused_group(name)
            a, dtype = joint.get(key, (0.0, s["dtype"]))
            joint[key] = (max(a, s["absmax"]), dtype)
    return {name: ({"global_scale": global_scale(*joint[fused_group(name)])} if "absmax" in s else dict(s))
            for name, s in settings.items()}


def quantize_nvfp4(w: np.ndarray, dtype: str, g: float) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [out, in] e2m1 nibbles, group scales float32 [out, in/16] e4m3 values) of a weight
    under global scale g, as llm-compressor's NVFP4 oneshot computes them (memoryless_minmax observer,
    compressed-tensors 0.19 calculate_qparams and the nvfp4 compressor), with the same torch operations:

    * per group of 16 in the model dtype: amax = max(|min(lo, 0)|, max(hi, 0)), amax / 6 in the model
      dtype, times g in float32, clamped to +-448 and rounded to e4m3 (a zero scale becomes 0.125);
    * codes: x / (scale / g) in float32, plus the zero point (so -0.0 becomes +0.0), clamped to +-6 and
      rounded to e2m1 by cast_to_fp4's intervals (ties to even), the sign kept for a value rounded to 0."""
    import torch

    tdtype = getattr(torch, dtype) if dtype in _TORCH_DTYPES else torch.float32
    x = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(tdtype)
    out, inp = x.shape
    xg = x.reshape(out, inp // NVFP4_GROUP, NVFP4_GROUP)
    zero = torch.zeros(1, dtype=tdtype)
    lo, hi = torch.min(xg.amin(-1), zero), torch.max(xg.amax(-1), zero)
    q_min, q_max = torch.tensor(-E2M1_MAX), torch.tensor(E2M1_MAX)
    scale = torch.max(lo.abs(), hi.abs()) / ((q_max - q_min).to(tdtype) / 2)
    gs = torch.tensor([g], dtype=torch.float32)
    scale = gs * scale
    fi = torch.finfo(torch.float8_e4m3fn)
    scale = torch.clamp(scale, fi.min, fi.max).to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.tensor(0.125, dtype=torch.float32), scale)
    scaled = xg / (scale / gs).unsqueeze(-1)
    scaled += torch.zeros((), dtype=tdtype)
    return _e2m1_codes(scaled.reshape(out, inp)), scale.numpy()


def _e2m1_codes(scaled) -> np.ndarray:
    """e2m1 nibbles (sign in bit 3) of values already divided by their scale, as compressed-tensors
    rounds them: clamped to +-6, then cast_to_fp4's intervals (ties to even), the sign kept for a value
    rounded to 0."""
    import torch

    t = torch.clamp(scaled, -E2M1_MAX, E2M1_MAX)
    sign = torch.sign(t)
    t = torch.abs(t)
    rounded = torch.zeros_like(t)
    for lo_, hi_, value, closed in ((0.25, 0.75, 0.5, False), (0.75, 1.25, 1.0, True), (1.25, 1.75, 1.5, False),
                                    (1.75, 2.5, 2.0, True), (2.5, 3.5, 3.0, False), (3.5, 5.0, 4.0, True)):
        inside = (t >= lo_) & (t <= hi_) if closed else (t > lo_) & (t < hi_)
        rounded[inside] = value
    rounded[t > 5.0] = 6.0
    q = rounded * sign
    codes = torch.zeros(q.shape, dtype=torch.uint8)
    magnitude = (q * 2).to(torch.int8).abs()
    for i, v in enumerate((0, 1, 2, 3, 4, 6, 8, 12)):
        codes[magnitude == v] = i
    codes |= torch.signbit(q).to(torch.uint8) << 3
    return codes.numpy()


def _nvfp4_tensor(codes: np.ndarray, group_scales: np.ndarray, g: float, spec: QuantSpec, dtype: str) -> QuantTensor:
    g32 = np.float32(g)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):   # not finite: refused by the caller
        scales = (group_scales / g32).astype(np.float32)
    return QuantTensor(spec, codes.shape, dtype, codes=codes, scales=scales,
                       group_scales=group_scales, global_scale=g32, product_dtype="bfloat16")


def requantize_nvfp4(source, w: np.ndarray, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, QuantTensor]:
    """A module quantized to NVFP4 from its exact weights as llm-compressor quantizes it (quantize_nvfp4:
    min-max, no search, so the report's two columns are the same), under the global scale share_nvfp4
    gave its fused group."""
    g = settings.get("global_scale")           # share_nvfp4's, for every module convert requantizes: so
    if g is None:                                # the rows are quantized on their own (Target.requantize_rows)
        g = global_scale(float(_absmax(w, source.dtype)), source.dtype)
    codes, group_scales = quantize_nvfp4(w, source.dtype, g)
    qt = _nvfp4_tensor(codes, group_scales, g, spec, source.dtype)
    return qt, qt


def retarget_nvfp4(qt: QuantTensor, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, np.ndarray | None]:
    """Kept NVFP4 codes and e4m3 group scales. compressed-tensors' global divisor is kept; ModelOpt's
    multiplier s2 becomes the divisor float32(1 / s2), and the effective scales e4m3 / (1 / s2) are
    reported against ModelOpt's e4m3 * s2 where they differ (exact: None when nothing rounds)."""
    act = settings.get("input_global_scale")
    act = None if act is None else np.float32(act)
    if qt.spec.global_scale == "divisor":
        return replace(qt, spec=spec, product_dtype="bfloat16", input_scale=act), None
    g = np.float32(1) / np.float32(qt.global_scale)
    kept = _nvfp4_tensor(np.asarray(qt.codes), np.asarray(qt.group_scales, dtype=np.float32), g, spec, qt.dtype)
    exact = np.asarray(qt.scales, dtype=np.float32)
    return replace(kept, input_scale=act), (None if np.array_equal(kept.scales, exact) else exact)


def encode_nvfp4(qt: QuantTensor, spec: QuantSpec) -> dict[str, tuple[str, np.ndarray]]:
    """weight_packed (two e2m1 codes a byte, the even element in the low nibble), weight_scale (e4m3
    bytes), weight_global_scale (float32 [1]) and, with a static activation scale (W4A4), its divisor
    input_global_scale (float32 [1]): what nvfp4_leaves predicts."""
    codes = np.ascontiguousarray(qt.codes, dtype=np.uint8)
    if codes.size and int(codes.max()) > 0xF:
        raise NotStorable("e2m1 codes do not fit in 4 bits")
    res = {"weight_packed": ("U8", np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))),
           "weight_scale": ("F8_E4M3", e4m3_bytes(qt.group_scales)),
           "weight_global_scale": ("F32", np.array([qt.global_scale], dtype=np.float32))}
    if qt.input_scale is not None:
        res["input_global_scale"] = ("F32", np.array([qt.input_scale], dtype=np.float32))
    planned = nvfp4_leaves(spec, qt.shape, input_global_scale=qt.input_scale)
    stored = {leaf: (d, tuple(a.shape)) for leaf, (d, a) in res.items()}
    if stored != planned:
        raise NotStorable(f"stores {stored}, but {planned} were planned")
    return res


# ---------------------------------------------------------------------------------------------
# Target compressed-tensors-mxfp4: llm-compressor's MXFP4A16 (mxfp4-pack-quantized)

def _mxfp4_spec() -> QuantSpec:
    return QuantSpec("e2m1", 4, MXFP4_GROUP, True, codebook=E2M1_BOOK, scale_dtype="U8")


def fit_mxfp4(m: QuantModule, src, request, negotiate) -> tuple[QuantSpec, str | None]:
    """The spec of a module in compressed-tensors-mxfp4: e2m1 codes in groups of 32 along each row, one
    e8m0 power-of-two scale per group. Codes are kept where the source is MXFP4 (e2m1 in groups of 32
    under power-of-two scales alone: compressed-tensors' own, gpt-oss'); everything else is quantized
    from its exact weights as llm-compressor does (requantize_mxfp4). Every option is llm-compressor's
    choice: refused. A module whose inputs are not whole groups of 32 is refused."""
    _fp4_settings(m, request, MXFP4_TARGET, "MXFP4", MXFP4_GROUP, "e8m0 scales")
    spec = _mxfp4_spec()
    if src.scheme == "e2m1" and src.group_size == MXFP4_GROUP and src.global_scale is None and src.scale_dtype == "U8":
        return spec, None
    if src.scheme == "float":
        return spec, src.requantized(" to MXFP4")
    return spec, f"{src.name} codes become MXFP4"


def _round_to_power_2(x):
    """compressed-tensors' round_to_power_2 (mxfp_utils.py) on a float16 / bfloat16 / float32 tensor: add
    half of the significand's second bit and keep sign and exponent (a power of two, rounded up from a
    significand of 1.75 on)."""
    import torch

    mantissa = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}[x.dtype]
    exponent = {torch.float16: 5, torch.bfloat16: 8, torch.float32: 8}[x.dtype]
    bits = x.view(torch.int16 if x.dtype != torch.float32 else torch.int32).to(torch.int32)
    if x.dtype != torch.float32:
        bits = bits & 0xFFFF
    mask = ((1 << (exponent + 1)) - 1) << mantissa
    out = torch.bitwise_and(bits + (1 << (mantissa - 2)), mask)
    return out.view(torch.float32) if x.dtype == torch.float32 else out.to(torch.uint16).view(x.dtype)


def quantize_mxfp4(w: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [out, in] e2m1 nibbles, e8m0 exponents uint8 [out, in/32]) of a weight, as
    llm-compressor's MXFP4A16 oneshot computes them (memoryless_minmax observer, compressed-tensors 0.19
    calculate_qparams, generate_mx_scales and the mxfp4 compressor), with the same torch operations, in
    the model dtype:

    * per group of 32: amax = max(|min(lo, 0)|, max(hi, 0)); e = 127 + floor(log2(round_to_power_2(amax)))
      - 2, clamped to 0..255 and rounded; scale = 2^(e - 127) in the model dtype, 1 (uint8's eps) where
      that is 0 (float16 holds no power of two under 2^-24: an all-zero group gets 1 there, 2^-127 in
      bfloat16 and float32);
    * codes: x / scale in the model dtype, plus the zero point (-0.0 becomes +0.0), rounded to e2m1 as
      NVFP4's; stored exponents 127 + floor(log2(scale))."""
    import torch

    tdtype = getattr(torch, dtype) if dtype in _TORCH_DTYPES else torch.float32
    x = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(tdtype)
    out, inp = x.shape
    xg = x.reshape(out, inp // MXFP4_GROUP, MXFP4_GROUP)
    zero = torch.zeros(1, dtype=tdtype)
    lo, hi = torch.min(xg.amin(-1), zero), torch.max(xg.amax(-1), zero)
    amax = torch.max(lo.abs(), hi.abs())
    e = 127 + torch.floor(torch.log2(_round_to_power_2(amax))) - 2
    e = torch.round(torch.clamp(e, 0, 255)).to(torch.uint8).to(tdtype)
    scale = (2.00 ** ((e.to(torch.int32) - 127).to(torch.float))).to(tdtype)
    scale = torch.where(scale == 0, torch.tensor(1, dtype=tdtype), scale)
    scaled = xg / scale.unsqueeze(-1)
    scaled += torch.zeros((), dtype=tdtype)
    stored = (127 + torch.floor(torch.log2(scale)).to(torch.int32)).to(torch.uint8)
    return _e2m1_codes(scaled.reshape(out, inp)), stored.numpy()


def requantize_mxfp4(source, w: np.ndarray, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, QuantTensor]:
    """A module quantized to MXFP4 from its exact weights as llm-compressor quantizes it (quantize_mxfp4:
    min-max, no search, so the report's two columns are the same)."""
    codes, exponents = quantize_mxfp4(w, source.dtype)
    qt = QuantTensor(spec, codes.shape, source.dtype, codes=codes, scales=e8m0(exponents))
    return qt, qt


def retarget_mxfp4(qt: QuantTensor, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, None]:
    """Kept e2m1 codes and e8m0 scales (powers of two: nothing rounds)."""
    return replace(qt, spec=spec, product_dtype=None), None


def encode_mxfp4(qt: QuantTensor, spec: QuantSpec) -> dict[str, tuple[str, np.ndarray]]:
    """weight_packed (two e2m1 codes a byte, the even element in the low nibble) and weight_scale (the
    e8m0 exponent of each group's power-of-two scale): what mxfp4_leaves predicts."""
    codes = np.ascontiguousarray(qt.codes, dtype=np.uint8)
    if codes.size and int(codes.max()) > 0xF:
        raise NotStorable("e2m1 codes do not fit in 4 bits")
    scales = np.asarray(qt.scales, dtype=np.float32)
    mantissa, exponent = np.frexp(scales)
    if scales.size and not (np.all(mantissa == 0.5) and np.all((exponent >= -126) & (exponent <= 128))):
        raise NotStorable("scales that are not powers of two from 2^-127 to 2^127 (e8m0)")
    res = {"weight_packed": ("U8", np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))),
           "weight_scale": ("U8", np.ascontiguousarray((exponent + 126).astype(np.uint8)))}
    planned = mxfp4_leaves(spec, qt.shape)
    stored = {leaf: (d, tuple(a.shape)) for leaf, (d, a) in res.items()}
    if stored != planned:
        raise NotStorable(f"stores {stored}, but {planned} were planned")
    return res
