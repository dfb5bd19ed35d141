"""compressed-tensors' writers on the data side, the registry's codec of every compressed-tensors target
(encode_for): QuantTensor -> the tensors of a module, and the target hooks that decide and compute them.
The integer targets (compressed-tensors, compressed-tensors-w8a8) store codes as they are (encode);
the floating-point ones follow llm-compressor: compressed-tensors-fp8 (float-quantized FP8: fit_fp8,
plan_fp8, requantize_fp8, retarget_fp8, encode_fp8), compressed-tensors-nvfp4 (NVFP4A16 / NVFP4: fit,
plan, share, requantize, retarget, encode_nvfp4) and compressed-tensors-mxfp4 (MXFP4A16), their
quantizers llm-compressor's arithmetic (quantize.py). What each stores is predicted before any data by
writer.py and float_writer.py; reading is decode.py (its read, unpack_dense and pack_dense named here too,
where tests and benchmarks have always found them).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

import numpy as np

from ...errors import NotStorable, UnsupportedFormat
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import NVFP4_GROUP, QuantModule, fused_group
from ..core.minifloat import E2M1_BOOK, E4M3_BOOK, e4m3_bytes, e8m0
from ..storage.tensor_io import encode_float, to_float32
from .config import INT, NAIVE, PACKED, READABLE_FORMATS, _SCALE_DTYPES
from .decode import _signed, pack_dense, read, unpack_dense
from .float_writer import (FP8_TARGET, MXFP4_GROUP, MXFP4_TARGET, NVFP4_TARGET, float_leaves, input_scale_dtype,
                           mxfp4_leaves, nvfp4_leaves)
from .quantize import _TORCH_DTYPES, global_scale, quantize_fp8, quantize_mxfp4, quantize_nvfp4
from .writer import leaves

__all__ = ["read", "encode", "leaves", "pack_dense", "unpack_dense"]


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


def share_nvfp4(settings: Mapping[str, dict]) -> dict[str, dict]:
    """One global scale for the requantized modules vLLM fuses (q/k/v, gate/up, ...: layout.fused_group),
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
