"""MLX affine data (header.py describes the layout): the code streams, the reader, and the writer's hooks.

Reading. MLX stores ``w = s * q + b``; the canonical representation stores ``(q - z) * s``. A module whose
every group has ``b == -s * z`` exactly for an integer ``z`` in [0, 2^bits) (what qconv writes from GPTQ,
AWQ, bitsandbytes int8 and GGUF codes, and what a symmetric quantizer makes), and whose scales times any
code are exact in float32, is read as integer codes with those zero points: ``fl(fl(s*q) + b)``, MLX's
float32 arithmetic, is then ``fl(s * (q - z))`` bit for bit, and its codes can be kept by every integer
target. Any other module (``mx.quantize``'s min/max biases) is read as integer codes with float offsets
(``QuantSpec.offset == "float"``, formats/core/ir.py): its codes, scales and biases as stored, which MLX
keeps byte for byte and GGUF's Q4_1 / Q5_1 hold; the other targets requantize it, with the error reported.

Writing (``--to mlx``). Codes, scales and zero points kept; ``b = -s * z`` (float offsets: b as it is). The scales and biases are
stored in the model's 16-bit dtype (else the source scales') where both are exactly values of it, else in
float32, so that the written module decodes to the source's weights (plan); ``--scale-dtype`` forces one
dtype, and what it rounds is reported as scale rounding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.minifloat import E2M1_BOOK, e8m0
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import FLOAT_CODES, FLOAT_NAMES, all_finite, encode_float, finite_scales, read_array, to_float32
from .header import check

# ---------------------------------------------------------------------------------------------
# Code streams


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [R, W] -> uint8 codes [R, W * 32 / bits]: each row one little-endian stream, low bits first."""
    rows, width = words.shape
    raw = np.ascontiguousarray(words, dtype="<u4").view(np.uint8).reshape(rows, width * 4)
    if bits == 8:
        return raw.copy()
    if bits in (1, 2, 4):
        per = 8 // bits
        shifts = np.arange(per, dtype=np.uint8) * np.uint8(bits)
        return ((raw[:, :, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(rows, width * 4 * per)
    stream = np.unpackbits(raw, axis=1, bitorder="little").reshape(rows, width * 32 // bits, bits)
    return np.packbits(stream, axis=2, bitorder="little").reshape(rows, width * 32 // bits)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [R, N] (N * bits a multiple of 32) -> uint32 [R, N * bits / 32], the inverse of unpack."""
    rows, n = codes.shape
    if (n * bits) % 32:
        raise NotStorable(f"{n} {bits}-bit codes do not fill whole 32-bit words")
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    if bits == 8:
        raw = codes
    elif bits in (1, 2, 4):
        per = 8 // bits
        raw = codes[:, 0::per].copy()
        for k in range(1, per):                 # code k of each byte at bit k * bits
            raw |= codes[:, k::per] << np.uint8(k * bits)
    else:
        stream = np.unpackbits(codes[:, :, None], axis=2, count=bits, bitorder="little").reshape(rows, n * bits)
        raw = np.packbits(stream, axis=1, bitorder="little")
    return np.ascontiguousarray(raw).view("<u4").astype(np.uint32, copy=False).reshape(rows, n * bits // 32)


def decode(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, group: int) -> np.ndarray:
    """MLX's float32 dequantization, fl(fl(s * q) + b), of codes [R, N] with scales / biases [R, N / group]."""
    rows, n = codes.shape
    w = codes.astype(np.float32).reshape(rows, n // group, group)
    w *= scales[:, :, None]
    w += biases[:, :, None]
    return w.reshape(rows, n)


def zero_points(scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray | None:
    """The integer zero points z (uint8) with b == -s * z exactly in every group, where s times every code
    is exact in float32 too; None where some group has none (its weights are then read as MLX decodes
    them). A group with s == 0 and b == 0 is all zeros (z = 0). (q - z) * s then equals fl(fl(s*q) + b)
    for every code, but for the sign of a zero: where a negative scale (auto-round writes some) meets its
    zero point, MLX computes +0 and (q - z) * s -0, the same number.)"""
    s = scales.astype(np.float64)
    b = biases.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.rint(np.where(s != 0, -b / np.where(s != 0, s, 1.0), 0.0))
    ok = (z >= 0) & (z <= (1 << bits) - 1) & (-(s * z) == b) & ((s != 0) | (b == 0))
    # s * q exact in float32 for every q < 2^bits: the low `bits` bits of s's significand are zero
    ok &= (np.ascontiguousarray(scales, dtype=np.float32).view(np.uint32) & np.uint32((1 << bits) - 1)) == 0
    return z.astype(np.uint8) if bool(ok.all()) else None


# ---------------------------------------------------------------------------------------------
# Reading


def _flat(info: TensorInfo) -> TensorInfo:
    """A stacked [E, R, C] tensor (SwitchLinear experts) as [E * R, C]: its rows are the module's."""
    if len(info.shape) == 3:
        return replace(info, shape=(info.shape[0] * info.shape[1], info.shape[2]))
    return info


def _scales_biases(m: QuantModule, tensors: Mapping[str, TensorInfo], r0: int, r1: int):
    out = []
    for leaf in ("scales", "biases"):
        info = tensors[f"{m.name}.{leaf}"]
        out.append(finite_scales(to_float32(read_array(_flat(info), rows=(r0, r1)), info.dtype), info))
    return out


_DECIDED: dict = {}          # (the module's scales and biases, as stored) -> whether it has integer zero points


def integral(m: QuantModule, tensors: Mapping[str, TensorInfo]) -> bool:
    """Whether the stored module m (a stacked SwitchLinear whole) has integer zero points in every group:
    decided once for all of it (every row window and every expert of it is read the same way), from its
    scales and biases only, and remembered for the files as they are (path, size, mtime, offsets)."""
    import os

    s_info, b_info = tensors[m.name + ".scales"], tensors[m.name + ".biases"]
    stat = os.stat(s_info.file)
    key = (str(s_info.file), stat.st_size, stat.st_mtime_ns, s_info.offset, str(b_info.file), b_info.offset, m.bits)
    if key not in _DECIDED:
        s, b = _scales_biases(m, tensors, 0, m.out_features)
        _DECIDED[key] = zero_points(s, b, m.bits) is not None
    return _DECIDED[key]


def source_spec(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None):
    """The module's spec, from its scales and biases (not its codes): integer codes with zero points
    where every group has one (zero_points), else integer codes with float offsets (mlx-lm's min / max
    biases); None for mode mxfp4 (an e2m1 module: convert's rule for code books)."""
    if m.scheme == "e2m1":
        return None
    view = m.details.get("rows_of")
    parent, first = view if view is not None else (m, 0)
    code = tensors[f"{parent.name}.scales"].dtype
    if not integral(parent, tensors):
        return QuantSpec("int", m.bits, m.group_size, False, scale_dtype=code, offset="float")
    s, b = _scales_biases(parent, tensors, first, first + m.out_features)
    z = zero_points(s, b, m.bits)
    return QuantSpec("int", m.bits, m.group_size, bool((z == 1 << (m.bits - 1)).all()), scale_dtype=code)


def read(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None):
    """Output rows r0:r1 (all: None) as a QuantTensor: integer zero points where every group of the module
    has one, else the float offsets as stored (w = fl(fl(s * q) + b), MLX's float32 arithmetic)."""
    check(m, tensors, qc)
    weight = tensors[m.name + ".weight"]
    r0, r1 = rows or (0, m.out_features)
    codes = unpack(read_array(_flat(weight), rows=(r0, r1)), m.bits)
    if codes.shape != (r1 - r0, m.in_features):
        raise CorruptCheckpoint(f"decoded codes {list(codes.shape)} do not match [{r1 - r0}, {m.in_features}]",
                                file=weight.file, tensor=weight.name)
    if m.scheme == "e2m1":                      # mode mxfp4: e8m0 exponents, no biases
        info = tensors[m.name + ".scales"]
        spec = QuantSpec("e2m1", 4, m.group_size, True, codebook=E2M1_BOOK, scale_dtype="U8")
        return QuantTensor(spec, (r1 - r0, m.in_features), dtype, codes=codes,
                           scales=e8m0(read_array(_flat(info), rows=(r0, r1))))
    s, b = _scales_biases(m, tensors, r0, r1)
    code = tensors[m.name + ".scales"].dtype
    z = zero_points(s, b, m.bits) if integral(m, tensors) else None
    if z is None:
        spec = QuantSpec("int", m.bits, m.group_size, False, scale_dtype=code, offset="float")
        return QuantTensor(spec, (r1 - r0, m.in_features), dtype, codes=codes, scales=np.ascontiguousarray(s),
                           biases=np.ascontiguousarray(b))
    sym = bool((z == 1 << (m.bits - 1)).all())
    spec = QuantSpec("int", m.bits, m.group_size, sym, scale_dtype=code)
    return QuantTensor(spec, (r1 - r0, m.in_features), dtype, codes=codes, scales=np.ascontiguousarray(s), zeros=z)


# ---------------------------------------------------------------------------------------------
# Writing (the registry's target mlx)


def _biases(scales: np.ndarray, zeros: np.ndarray | None, bits: int) -> np.ndarray:
    """-s * z in float64 (exact: s at most 24 significant bits, z at most 8)."""
    z = np.full(scales.shape, 1 << (bits - 1), np.float64) if zeros is None else zeros.astype(np.float64)
    return -(scales.astype(np.float64) * z)


def _stored(values: np.ndarray, code: str) -> np.ndarray:
    return to_float32(encode_float(np.asarray(values, np.float64).astype(np.float32), code), code)


def plan(ctx) -> dict:
    """The module's scale dtype: --scale-dtype where given; else the first 16-bit dtype of the model's, the
    planned scales' (a requantization's) and the source scales' in which the scales and biases (-s * z) are
    all exactly values; else F32. A requantized module is decided without running the requantizer: its
    scales are in the planned 16-bit dtype, and -s * 2^(b-1) is exact there for symmetric codes (encode_for
    refuses the overflow that would not be), any other zero point rarely: F32."""
    if ctx.spec.scheme == "e2m1":               # mode mxfp4: e8m0 exponents
        return {"scale_dtype": "U8"}
    forced = getattr(ctx.request, "scale_dtype", None)
    if forced:
        return {"scale_dtype": FLOAT_CODES[forced]}
    if ctx.reason:                              # requantized: known from the plan alone
        symmetric16 = ctx.spec.symmetric and ctx.spec.scale_dtype in ("F16", "BF16")
        return {"scale_dtype": ctx.spec.scale_dtype if symmetric16 else "F32"}
    exact = ctx.encode({"scale_dtype": "F32"})
    s, b = exact["scales"][1], exact["biases"][1]
    if getattr(ctx.source_spec, "scale_divisor", 1) != 1:
        # s = SCB / 127 (bitsandbytes int8) is exact in no dtype: stored as --to gptq stores it (the
        # target's divisor dtype, float16), the rounding reported, where b = -s * z is exact in it
        code = ctx.spec.scale_dtype
        s64 = s.astype(np.float64)
        z = np.rint(np.divide(-b.astype(np.float64), s64, out=np.zeros_like(s64), where=s64 != 0))
        b_code = -(_stored(s, code).astype(np.float64) * z)
        if np.array_equal(_stored(b_code, code), b_code):
            return {"scale_dtype": code}
    for code in dict.fromkeys((FLOAT_CODES.get(ctx.dtype), ctx.spec.scale_dtype, ctx.module.details.get("scales_dtype"))):
        if code in ("F16", "BF16") and np.array_equal(_stored(s, code), s) and np.array_equal(_stored(b, code), b):
            return {"scale_dtype": code}
    return {"scale_dtype": "F32"}


def retarget(qt: QuantTensor, spec: QuantSpec, settings: Mapping):
    """Codes and zero points kept; s = scales / divisor (bitsandbytes' SCB / 127) and b = -s * z stored
    in the planned dtype. Returns (qt, (exact, stored)) over scales and biases, for the report."""
    if spec.scheme == "e2m1":                   # mode mxfp4: codes and power-of-two scales kept
        return replace(qt, spec=spec, product_dtype=None), None
    code = settings.get("scale_dtype") or spec.scale_dtype
    if qt.biases is not None:                   # float offsets: scales and biases as they are, stored in code
        if qt.scales.shape[1] * spec.group_size != qt.shape[1]:     # a group size MLX does not store (fit)
            raise NotStorable(f"float offsets in groups of {qt.spec.group_size}, not {spec.group_size}")
        exact_s, exact_b = qt.scales.astype(np.float64), qt.biases.astype(np.float64)
        s, b = _stored(exact_s, code), _stored(exact_b, code)
        out = replace(qt, spec=replace(spec, scale_dtype=code, offset="float"), scales=s, biases=b)
        return out, (np.concatenate([exact_s.ravel(), exact_b.ravel()]), np.concatenate([s.ravel(), b.ravel()]))
    if qt.scales.shape[1] == 1 and spec.group_size > 0 and qt.shape[1] > spec.group_size:
        groups = qt.shape[1] // spec.group_size     # one scale per row (bnb int8, per-channel): one per group
        qt = replace(qt, scales=np.repeat(qt.scales, groups, axis=1),
                     zeros=None if qt.zeros is None else np.repeat(qt.zeros, groups, axis=1))
    exact_s = qt.scales.astype(np.float64) / qt.spec.scale_divisor
    s = _stored(exact_s, code)
    exact_b = _biases(s, qt.zeros, qt.spec.bits)
    b = _stored(exact_b, code)
    out = replace(qt, spec=replace(spec, scale_dtype=code, scale_divisor=1), scales=s)
    return out, (np.concatenate([exact_s.ravel(), exact_b.ravel()]), np.concatenate([s.ravel(), b.ravel()]))


def encode_for(target: str, qt: QuantTensor, spec: QuantSpec, g_idx: bool) -> dict[str, tuple[str, np.ndarray]]:
    """The module's weight, scales and biases (qt as retarget made it: scales already stored values)."""
    if qt.g_idx is not None or g_idx:
        raise NotStorable("MLX stores no g_idx")
    if qt.spec.scheme == "e2m1":                # mode mxfp4: e8m0 exponent bytes
        mantissa, exponent = np.frexp(np.asarray(qt.scales, np.float32))
        if qt.scales.size and not (np.all(mantissa == 0.5) and np.all((exponent >= -126) & (exponent <= 128))):
            raise NotStorable("scales that are not powers of two from 2^-127 to 2^127 (e8m0)")
        return {"weight": ("U32", pack(qt.codes, 4)), "scales": ("U8", (exponent + 126).astype(np.uint8))}
    code = qt.spec.scale_dtype
    offsets = qt.biases if qt.biases is not None else _biases(qt.scales, qt.zeros, qt.spec.bits)
    biases = encode_float(np.asarray(offsets, np.float64).astype(np.float32), code)
    if not all_finite(biases, code):
        raise NotStorable(f"biases -s * z beyond {FLOAT_NAMES[code]}'s range")
    return {"weight": ("U32", pack(qt.codes, qt.spec.bits)), "scales": (code, encode_float(qt.scales, code)),
            "biases": (code, biases)}
