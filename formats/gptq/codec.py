"""GPTQ tensor data <-> QuantTensor (the layout, from headers, and the config are gptq.py)."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from .header import AUTO_ROUND_READABLE, GPTQ_FORMATS, parse_config, per_module_settings
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.packing import pack_int32, unpack_int32, unpack_int32_transposed
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import encode_float, finite_scales, read_array, to_float32

def zero_decoding(qc: Mapping | None) -> tuple[str, bool]:
    """(zero encoding, word_carry) for a checkpoint's qzeros.

    v1 stores z - 1. Readers add 1 field by field (AutoGPTQ, vLLM, exllama), except GPTQModel, which
    adds 0x11111111 / 0x01010101 / 0x55555555 to whole int32 words (carrying across fields) and wrote
    its v1 files by the matching word-wise subtraction. A GPTQModel v1 file is therefore decoded the
    way GPTQModel reads it, so a zero point of 0 and its neighbour both come back as quantized.
    """
    if not qc:
        return "v1", False
    settings = parse_config(qc)
    encoding = "v2" if settings["zero_point"] == "stored z (v2)" else "v1"
    meta = qc.get("meta") if isinstance(qc.get("meta"), dict) else {}
    quantizer = " ".join(map(str, meta.get("quantizer") or []))
    word_carry = encoding == "v1" and "gptqmodel" in quantizer
    return encoding, word_carry


def _decode_zeros(words: np.ndarray, bits: int, encoding: str, word_carry: bool) -> np.ndarray:
    mask = (1 << bits) - 1
    if encoding == "v2":
        return unpack_int32(words, bits, axis=1)
    if word_carry and 32 % bits == 0:
        one_per_field = sum(1 << (bits * j) for j in range(32 // bits))
        carried = (words.view(np.uint32).astype(np.uint64) + one_per_field) & 0xFFFFFFFF
        return unpack_int32(carried.astype(np.uint32), bits, axis=1)
    return ((unpack_int32(words, bits, axis=1).astype(np.int16) + 1) & mask).astype(np.uint8)


def check_readable(qc: Mapping | None, where: TensorInfo) -> None:
    """Refuse layouts that share GPTQ's tensor names but not its packing (AWQ, Marlin repacks, ...)."""
    if not qc:
        return
    settings = parse_config(qc)
    fmt = settings.get("packing_format") or settings.get("checkpoint_format")
    if fmt not in AUTO_ROUND_READABLE + GPTQ_FORMATS:
        raise UnsupportedFormat(f"{'packing_format' if 'packing_format' in settings else 'checkpoint_format'} "
                                f"{fmt!r} is not a layout qconv decodes (it reads "
                                f"{', '.join(GPTQ_FORMATS + AUTO_ROUND_READABLE)})",
                                file=where.file, tensor=where.name)
    if settings.get("data_type", "int") != "int":
        raise UnsupportedFormat(f"data_type {settings['data_type']!r}: qconv decodes integer codes only",
                                file=where.file, tensor=where.name)


def check(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> None:
    """Refuse, from headers and config, a module read could not decode exactly."""
    qweight = tensors[m.name + ".qweight"]
    check_readable(qc, qweight)
    if m.problems:
        raise CorruptCheckpoint(m.problems[0] + "; cannot decode it", file=qweight.file, tensor=m.name)
    if qweight.dtype not in ("I32", "U32"):
        raise UnsupportedFormat(f"qweight packed in {qweight.dtype} words; qconv reads int32 packing",
                                file=qweight.file, tensor=qweight.name)


def read(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None) -> QuantTensor:
    """The module as a QuantTensor (codes [out, in], contiguous: GPTQ's [in, out] words are transposed
    as words, before unpacking, the cheap way round). rows: only output rows r0:r1 (multiples of 32,
    or the last row), read as column windows of qweight, qzeros and scales."""
    check(m, tensors, qc)
    qweight = tensors[m.name + ".qweight"]
    bits, out, inp = m.bits, m.out_features, m.in_features
    r0, r1 = rows or (0, out)
    if (r0 % 32 or (r1 % 32 and r1 != out)) or not 0 <= r0 <= r1 <= out:
        raise NotStorable(f"rows {r0}:{r1} of {m.name} are not whole runs of 32 output channels")
    encoding, word_carry = zero_decoding(qc)
    settings = (per_module_settings(qc, m.name) if qc else None) or {}
    groups = m.details["groups"]
    codes = unpack_int32_transposed(read_array(qweight, cols=(r0, r1)), bits)           # [rows, in]
    zeros_info, scales_info = tensors[m.name + ".qzeros"], tensors[m.name + ".scales"]
    z1 = zeros_info.shape[1] if r1 == out else r1 * bits // 32
    zeros = _decode_zeros(read_array(zeros_info, cols=(r0 * bits // 32, z1)), bits, encoding,
                          word_carry)[:, :r1 - r0]
    scales = finite_scales(to_float32(read_array(scales_info, cols=(r0, r1)), scales_info.dtype), scales_info)
    out = r1 - r0
    g_idx = None
    if m.name + ".g_idx" in tensors:
        info = tensors[m.name + ".g_idx"]
        g_idx = read_array(info).astype(np.int64)
        if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise CorruptCheckpoint(f"g_idx holds groups outside 0..{groups - 1}", file=info.file,
                                    tensor=info.name)
    group_size = settings.get("group_size")
    if not isinstance(group_size, int) or group_size == 0 or (
            -(-inp // group_size) if group_size > 0 else 1) != groups:
        group_size = -1 if groups == 1 else m.group_size
    if group_size is None:
        raise CorruptCheckpoint(f"{inp} input channels in {groups} groups has no whole group size "
                                f"and the config gives none that fits", file=qweight.file, tensor=m.name)
    if g_idx is not None:
        trivial = np.zeros(inp, np.int64) if group_size <= 0 else np.arange(inp) // group_size
        if np.array_equal(g_idx, trivial):
            g_idx = None
    spec = QuantSpec("int", bits, group_size, bool(settings.get("sym", True)),
                     scale_dtype=scales_info.dtype, zero_encoding=encoding)
    return QuantTensor(spec, (out, inp), dtype, codes=codes, scales=np.ascontiguousarray(scales.T),
                       zeros=np.ascontiguousarray(zeros.T), g_idx=g_idx)


def encode(qt: QuantTensor, *, zero_encoding: str = "v1") -> dict[str, tuple[str, np.ndarray]]:
    """QuantTensor -> the tensors of a GPTQ module, leaf name -> (safetensors dtype, stored values):
    qweight, qzeros, scales, g_idx in GPTQ's orientation (docs/formats.md, GPTQ). v1 stores z - 1 one field at a time
    (never whole-word arithmetic)."""
    spec = qt.spec
    if spec.scheme != "int" or spec.scale_divisor != 1:
        raise NotStorable("GPTQ encodes integer codes with plain scales")
    bits = spec.bits
    mask = (1 << bits) - 1
    zeros = qt.zeros.astype(np.int16)
    if zero_encoding == "v1":
        zeros = (zeros - 1) & mask
    return {"qweight": ("I32", pack_int32(qt.codes.T, bits, axis=0)),
            "qzeros": ("I32", pack_int32(np.ascontiguousarray(zeros.T.astype(np.uint8)), bits, axis=1)),
            "scales": (spec.scale_dtype, encode_float(np.ascontiguousarray(qt.scales.T), spec.scale_dtype)),
            "g_idx": ("I32", qt.groups.astype(np.int32))}


def encode_for(target: str, qt: QuantTensor, spec: QuantSpec, g_idx: bool) -> dict[str, tuple[str, np.ndarray]]:
    """The registry's encoder of the GPTQ-family targets (gptq, gptq-v2, auto-round)."""
    tensors = encode(qt, zero_encoding=spec.zero_encoding)
    if not g_idx:
        tensors.pop("g_idx")
    return tensors
