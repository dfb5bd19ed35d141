"""GGUF's legacy 32-weight blocks <-> qconv's canonical representation (numpy).

The blocks (ggml/src/ggml-common.h; gguf-py's ``quants.py`` is the reference decoder), one row of the
weight after another, each row ``in / 32`` blocks::

    Q8_0   d: f16, qs: int8[32]                          w = d * qs
    Q4_0   d: f16, qs: u8[16] (j: low nibble, j+16: high) w = d * (nibble - 8)
    Q4_1   d: f16, m: f16, qs: u8[16]                    w = d * nibble + m
    Q5_0   d: f16, qh: u32 (bit j: 5th bit of j), qs: u8[16]   w = d * (q5 - 16)
    Q5_1   d: f16, m: f16, qh: u32, qs: u8[16]           w = d * q5 + m
    MXFP4  e: e8m0, qs: u8[16]                           w = kvalues[nibble] * 2^(e - 128)

and, read only (a GGUF -> GGUF copy keeps their bytes), the K-quants with float minimums, 256 weights a
super-block of eight 32-weight sub-blocks, 6-bit sub-block scales sc and minimums m (Q4_K.get_scale_min)::

    Q4_K   d, dmin: f16, scales: u8[12], qs: u8[128]     w = (d * sc) * nibble - (dmin * m)
    Q5_K   d, dmin: f16, scales: u8[12], qh: u8[32], qs: u8[128]   w = (d * sc) * q5 - (dmin * m)

Q4_1 / Q5_1 / Q4_K / Q5_K are read as codes with float offsets (QuantSpec.offset "float", formats/core/ir.py):
scales d (K: the float32 d * sc, exact) and biases m (K: -(dmin * m), exact), groups of 32, so that
fl(fl(s * q) + b) is ggml's own float32 arithmetic bit for bit; MLX keeps them as they are.

An integer module w = s * (q - z) (GPTQ, AWQ, compressed-tensors, LLM.int8 with s = SCB / 127) whose every
32-block lies in one group keeps its codes exactly (the issue's table, measured in
tests/formats/gguf/test_gguf_writer.py):

* 8-bit symmetric (z = 128): Q8_0, qs = q - 128, d = s;
* 4-bit symmetric (z = 8): Q4_0, nibble = q, d = s;
* 4-bit asymmetric: Q5_0, q5 = q - z + 16 (always 1..31), d = s; or Q4_1, nibble = q, m = -s * z;
* 2- and 3-bit, any zero point: Q4_0, nibble = q - z + 8 (always 1..15), d = s;
* 5-bit symmetric (z = 16: a GGUF source's own Q5_0): Q5_0, q5 = q, d = s;
* float offsets (w = s * q + b: MLX's min / max biases, a GGUF source's Q4_1 / Q5_1 / K-quants), 2- to 4-bit:
  Q4_1, nibble = q, d = s, m = b; 5-bit: Q5_1, q5 = q, d = s, m = b;
* MXFP4 (e2m1 codes, power-of-two scales per 32): MXFP4, the same nibbles, e = log2(s) + 127.

The only rounding is d (and Q4_1 / Q5_1's m) to float16; every float32 product d * (q - z) then equals the
source's (q - z) * s exactly when d == s. ``gguf_type`` says which type a module gets and why its codes
cannot be kept where they cannot; ``encode`` makes the blocks; ``decode`` reads them back as a QuantTensor.
A float tensor is stored in the type chosen through ``Rounding`` (the model's writer.py and the mmproj's
mmproj.py), which reports what that rounded and refuses what it would make infinite.
"""

from __future__ import annotations

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from ..core.ir import FloatSpec, FloatWeight, QuantSpec, QuantTensor
from ..storage.tensor_io import encode_float, read_array, to_float32
from .header import GGML_TYPES

QK = 32
# type name -> (ggml type id, bytes per 32-block): the block types written here, from header.GGML_TYPES
TYPES = {name: (tid, size) for tid, (name, block, size) in GGML_TYPES.items()
         if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")}
# the block types read as codes with float offsets, and the bytes of one block of each
OFFSET_TYPES = {name: size for tid, (name, block, size) in GGML_TYPES.items() if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")}
# llama_ftype (llama.h) of the type most of a file's weight bytes are in; a GGUF source's other block types,
# copied as they are, by the name llama.cpp's quantizer gives such a mix (Q4_K: Q4_K_M); else GUESSED
FTYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 12,
         "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25,
         "IQ3_S": 26, "IQ2_S": 28, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36, "TQ2_0": 37, "MXFP4": 38}
FTYPE_GUESSED = 1024


def row_bytes(type_name: str, inp: int) -> int:
    return inp // QK * TYPES[type_name][1]


def _blocks_in_one_group(spec: QuantSpec, g_idx, inp: int) -> bool:
    if g_idx is not None:
        g = np.asarray(g_idx).reshape(-1, QK)
        return bool((g == g[:, :1]).all())
    return spec.group_size <= 0 or spec.group_size % QK == 0


def gguf_type(spec, inp: int, asym: str = "Q5_0", g_idx=None) -> tuple[str | None, str | None]:
    """(type, reason): the block type whose codes are this module's, and None; or the type it is
    requantized to and why its codes cannot be kept; (None, reason): no block type holds its shape."""
    if inp % QK:
        return None, f"{inp} input features are not a multiple of GGUF's 32-weight blocks"
    if spec.scheme == "e2m1" and spec.global_scale is None and spec.group_size == QK:
        return "MXFP4", None                               # MXFP4: power-of-two scales per 32
    fallback = "Q8_0" if spec.bits == 8 else "Q4_0"
    if spec.scheme != "int":
        return fallback, f"{spec.name} codes are not integers"
    if getattr(spec, "offset", None):             # float offsets: Q4_1 / Q5_1 hold them, else requantized
        fallback = "Q4_1" if spec.bits <= 4 else "Q5_1" if spec.bits == 5 else "Q8_0"
    if not _blocks_in_one_group(spec, g_idx, inp):
        why = "act-order groups split a 32-weight block" if g_idx is not None \
            else f"group size {spec.group_size} is not a multiple of 32"
        return fallback, why
    if getattr(spec, "offset", None):
        return fallback, None if spec.bits <= 5 else f"{spec.bits}-bit codes with float offsets become 8-bit"
    if spec.bits == 8:
        return ("Q8_0", None) if spec.symmetric else ("Q8_0", "asymmetric 8-bit zero points become symmetric")
    if spec.bits == 4:
        return ("Q4_0", None) if spec.symmetric else (asym, None)
    if spec.bits < 4:
        return "Q4_0", None
    if spec.bits == 5 and spec.symmetric:                 # a GGUF source's Q5_0, GPTQ 5-bit sym: q5 = q
        return "Q5_0", None
    return "Q8_0", f"{spec.bits}-bit codes become 8-bit"


def requant_settings(type_name: str) -> tuple[int, bool]:
    """(bits, symmetric) of the integer requantization a block type holds (groups of 32)."""
    return {"Q8_0": (8, True), "Q4_0": (4, True), "Q5_0": (4, False), "Q4_1": (4, False), "Q5_1": (5, False)}[type_name]


def _f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16)


def block_scales(qt: QuantTensor) -> np.ndarray:
    """float32 [out, in / 32]: each block's exact scale s (stored / divisor, as the source computes it)."""
    first = qt.groups[::QK]
    s = qt.scales[:, first]
    if qt.spec.scale_divisor != 1:
        s = s * np.float32(1.0 / qt.spec.scale_divisor)
    return s.astype(np.float32)


def encode(qt: QuantTensor, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8 [out, row_bytes], the exact scales d rounds: [out, in / 32]; Q4_1 / Q5_1: the exact
    d then m of every block, [out, 2 * in / 32], as stored_scales) of a module in the type gguf_type gave it. Raises ValueError where a code does not fit (a zero point the spec
    called symmetric and is not)."""
    out, inp = qt.shape
    nb = inp // QK
    if type_name == "MXFP4":
        s = qt.scales[:, qt.groups[::QK]].astype(np.float32)
        mant, exp = np.frexp(s)
        if not np.all(mant == 0.5):
            raise NotStorable("MXFP4 scales are not powers of two")
        e = exp.astype(np.int32) - 1 + 127          # s = 2^(e - 127); e8m0 holds 0 .. 254 (255: NaN)
        if e.min(initial=0) < 0 or e.max(initial=0) > 254:
            raise NotStorable("MXFP4 scales are outside e8m0's range")
        codes = qt.codes.reshape(out, nb, QK).astype(np.uint8)
        # ggml decodes kvalues[n] * 2^(e - 128) with kvalues doubled, so the same byte e gives e2m1 * s
        qs = (codes[:, :, :16] & 0xF) | ((codes[:, :, 16:] & 0xF) << 4)
        blocks = np.concatenate([e.astype(np.uint8)[:, :, None], qs], axis=2)
        return blocks.reshape(out, nb * 17), s
    s = block_scales(qt)
    q = qt.codes.astype(np.int16).reshape(out, nb, QK)
    first = qt.groups[::QK]
    offsets = type_name in ("Q4_1", "Q5_1")
    if qt.biases is not None:                       # float offsets: only Q4_1 / Q5_1 hold them, m = b
        if not offsets:
            raise NotStorable(f"{type_name} holds no float offsets")
        z = np.zeros((out, nb, 1), np.int16)
        b = qt.biases[:, first].astype(np.float64)
    else:
        z = qt.zeros[:, first].astype(np.int16)[:, :, None]
        b = -(s.astype(np.float64) * z[:, :, 0]) if offsets else None   # exact: s 24 bits, z at most 8
    d = _f16(s).reshape(out, nb, 1).view(np.uint8).reshape(out, nb, 2)
    if offsets:                                     # m, and the exact d then m that encode returns
        m = _f16(b).reshape(out, nb, 1).view(np.uint8).reshape(out, nb, 2)
        s = np.concatenate([s.astype(np.float64), b], axis=1)
    if type_name == "Q8_0":
        v = q - z
        if v.min(initial=0) < -128 or v.max(initial=0) > 127:
            raise NotStorable("8-bit codes minus their zero points do not fit int8")
        body = v.astype(np.int8).view(np.uint8)
        parts = [d, body]
    elif type_name in ("Q4_0", "Q4_1"):
        n = q - z + 8 if type_name == "Q4_0" else q
        if n.min(initial=0) < 0 or n.max(initial=0) > 15:
            raise NotStorable("codes do not fit Q4 nibbles")
        n = n.astype(np.uint8)
        qs = n[:, :, :16] | (n[:, :, 16:] << 4)
        parts = [d, qs] if type_name == "Q4_0" else [d, m, qs]
    elif type_name in ("Q5_0", "Q5_1"):
        v = q - z + 16 if type_name == "Q5_0" else q
        if v.min(initial=0) < 0 or v.max(initial=0) > 31:
            raise NotStorable(f"codes do not fit {type_name}")
        v = v.astype(np.uint32)
        qh = ((v >> 4) << np.arange(QK, dtype=np.uint32)).sum(axis=2, dtype=np.uint32)
        low = (v & 0xF).astype(np.uint8)
        qs = low[:, :, :16] | (low[:, :, 16:] << 4)
        parts = [d] + ([m] if offsets else []) + [qh.astype("<u4").reshape(out, nb, 1).view(np.uint8), qs]
    else:
        raise NotStorable(f"no encoder for {type_name}")
    return np.concatenate(parts, axis=2).reshape(out, nb * TYPES[type_name][1]), s


def stored_scales(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [out, in / 32]: the scale each block stores (d, or 2^(e - 127) for MXFP4's e2m1 units);
    Q4_1 / Q5_1: [out, 2 * in / 32], the d of every block, then the m of every block (what encode's exact
    values are for them)."""
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, TYPES[type_name][1])
    if type_name == "MXFP4":
        return np.ldexp(np.float32(1.0), b[:, :, 0].astype(np.int32) - 127).astype(np.float32)
    d = b[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if type_name in ("Q4_1", "Q5_1"):
        return np.concatenate([d, b[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)], axis=1)
    return d


def permute_rows(blocks: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for llama's q / k (convert_hf_to_gguf LlamaModel.permute): within each
    head, the rows of the two rotary halves interleaved. A permutation of output rows, so of codes,
    scales and zero points alike; applies to block rows and float rows the same way."""
    rows = blocks.shape[0]
    return np.ascontiguousarray(blocks.reshape(n_head, 2, rows // n_head // 2, *blocks.shape[1:])
                                .swapaxes(1, 2).reshape(blocks.shape))


def unpermute_rows(blocks: np.ndarray, n_head: int) -> np.ndarray:
    rows = blocks.shape[0]
    return np.ascontiguousarray(blocks.reshape(n_head, rows // n_head // 2, 2, *blocks.shape[1:])
                                .swapaxes(1, 2).reshape(blocks.shape))


# ---------------------------------------------------------------------------------------------
# Reading: a GGUF source's block tensors (source.py, header.find_modules) as QuantTensors

def decode(blocks: np.ndarray, type_name: str, dtype: str) -> QuantTensor:
    """uint8 [rows, row bytes] of one block type -> the QuantTensor whose dequantization is ggml's (and
    gguf-py's quants.dequantize) exactly: Q8_0 as 8-bit codes qs + 128 about 128, Q4_0 as 4-bit about 8,
    Q5_0 as 5-bit about 16 (each d * (q - z)), MXFP4 as e2m1 codes with scales 2^(e - 127); groups of 32."""
    from ..core.minifloat import BOOKS

    rows = blocks.shape[0]
    if type_name in OFFSET_TYPES:
        return _decode_offsets(blocks, type_name, dtype)
    size = TYPES[type_name][1]
    b = blocks.reshape(rows, -1, size)
    nb = b.shape[1]
    if type_name == "MXFP4":
        qs = b[:, :, 1:17]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(rows, nb * QK)
        scales = np.ldexp(np.float32(1.0), b[:, :, 0].astype(np.int32) - 127).astype(np.float32)
        spec = QuantSpec("e2m1", 4, QK, True, codebook=tuple(map(float, BOOKS["e2m1"][1])), scale_dtype="U8")
        return QuantTensor(spec, (rows, nb * QK), dtype, codes=codes, scales=scales)
    d = b[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if type_name == "Q8_0":
        codes = (b[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bits, zero = 8, 128
    elif type_name == "Q4_0":
        qs = b[:, :, 2:18]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=2)
        bits, zero = 4, 8
    elif type_name == "Q5_0":
        qh = b[:, :, 2:6].copy().view("<u4")[:, :, 0]
        qs = b[:, :, 6:22]
        high = ((qh[:, :, None] >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=2) | (high << 4)
        bits, zero = 5, 16
    else:
        raise NotStorable(f"{type_name} has no exact form in qconv's representation")
    spec = QuantSpec("int", bits, QK, True, scale_dtype="F16")
    return QuantTensor(spec, (rows, nb * QK), dtype, codes=codes.reshape(rows, nb * QK).astype(np.uint8), scales=d,
                       zeros=np.full((rows, nb), zero, np.uint8))


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """u8 [..., k, width] -> codes [..., k, 2 * width]: low nibbles, then high nibbles, of each run."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u8 [..., 12] -> (sc, m) u8 [..., 8]: the 6-bit sub-block scales and minimums of Q4_K / Q5_K
    (ggml's get_scale_min_k4; gguf-py's Q4_K.get_scale_min)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _decode_offsets(blocks: np.ndarray, type_name: str, dtype: str) -> QuantTensor:
    """Q4_1 / Q5_1 / Q4_K / Q5_K blocks as codes with float offsets in groups of 32 (the module docstring)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, OFFSET_TYPES[type_name])
    nb = b.shape[1]
    f16 = (lambda lo: b[:, :, lo:lo + 2].copy().view(np.float16)[:, :, 0].astype(np.float32))
    if type_name in ("Q4_1", "Q5_1"):
        scales, biases = f16(0), f16(2)
        if type_name == "Q4_1":
            codes = _nibbles(b[:, :, 4:20], 16)
        else:
            qh = b[:, :, 4:8].copy().view("<u4")[:, :, 0]
            high = ((qh[:, :, None] >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)
            codes = _nibbles(b[:, :, 8:24], 16) | (high << 4)
        bits, groups = (4 if type_name == "Q4_1" else 5), nb
    else:                                           # 256-weight super-blocks of eight 32-weight sub-blocks
        d, dmin = f16(0)[:, :, None], f16(2)[:, :, None]
        sc, mn = k_scale_min(b[:, :, 4:16])
        scales = d * sc.astype(np.float32)                  # [rows, nb, 8], exact: 11 x 6 significant bits
        biases = -(dmin * mn.astype(np.float32))
        if type_name == "Q4_K":
            codes = _nibbles(b[:, :, 16:144].reshape(rows, nb, 4, 32), 32)        # [rows, nb, 4, 64]
        else:
            qh = b[:, :, 16:48]                                                   # bit j: sub-block j
            high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1   # [rows, nb, 8, 32]
            codes = _nibbles(b[:, :, 48:176].reshape(rows, nb, 4, 32), 32).reshape(rows, nb, 8, 32) | (high << 4)
        bits, groups = (4 if type_name == "Q4_K" else 5), nb * 8
    spec = QuantSpec("int", bits, QK, False, scale_dtype="F16" if type_name in ("Q4_1", "Q5_1") else "F32",
                     offset="float")
    inp = groups * QK
    return QuantTensor(spec, (rows, inp), dtype, codes=np.ascontiguousarray(codes.reshape(rows, inp), np.uint8),
                       scales=np.ascontiguousarray(scales.reshape(rows, groups), np.float32),
                       biases=np.ascontiguousarray(biases.reshape(rows, groups), np.float32))


_WIDER = {"F16": "bf16 or f32", "BF16": "f32"}


class Rounding:
    """A float tensor converted to the type chosen, and what the conversion changed, for the summary:
    how many values are not exactly representable and the largest relative error among them. A finite
    value the type would make infinite (float16's 65504) is refused, never written as inf."""

    def __init__(self, code: str, tensor: str, file, hint: str | None = None):
        self.code, self.tensor, self.file = code, tensor, file
        self.hint = hint or f"--gguf-float-type {_WIDER.get(code, 'f32')}"
        self.values, self.max_rel_error = 0, 0.0

    def encode(self, x32: np.ndarray) -> np.ndarray:
        x32 = np.ascontiguousarray(x32, np.float32)
        stored = encode_float(x32, self.code)
        back = to_float32(stored, self.code)
        same = (back == x32) | (np.isnan(back) & np.isnan(x32))
        if not same.all():
            over = np.isfinite(x32) & ~np.isfinite(back)
            if over.any():
                raise UnsupportedFormat(f"holds {float(x32[over][0]):.6g}, beyond {self.code}'s range (it would be "
                                        f"infinite): use {self.hint}", file=self.file,
                                        tensor=self.tensor)
            x = x32[~same].astype(np.float64)
            self.values += x.size
            self.max_rel_error = max(self.max_rel_error, float((np.abs(back[~same] - x) / np.abs(x)).max()))
        return stored


def row_step(m) -> int:
    """A row window's ends: any row, but a permuted llama q / k is read whole (its rows interleave)."""
    return m.out_features if m.details.get("heads") else 1


def decode_float(blocks: np.ndarray, type_name: str, info) -> np.ndarray:
    """uint8 [rows, row bytes] of any ggml block type -> float32 [rows, in], decoded by llama.cpp's own
    reference decoder (gguf-py's quants.dequantize: K-quants, IQ types, Q4_1, ...); a weight that decodes
    to NaN or infinity is refused, naming the tensor."""
    import gguf

    with np.errstate(over="ignore", invalid="ignore"):
        w = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]), np.float32)
    if not np.all(np.isfinite(w)):
        raise CorruptCheckpoint("decodes to non-finite weights (NaN or infinity)", file=info.file, tensor=info.name)
    return w.reshape(blocks.shape[0], -1)


def read(m, tensors, qc, dtype: str, rows: tuple[int, int] | None = None):
    """A GGUF source's module (or rows r0:r1 of it) as a QuantTensor, llama's q / k rows back in Hugging
    Face order; a type with no exact form here (header.float_spec) as its decoded weights (a FloatWeight)."""
    info = tensors[m.weight_tensors[0]]
    heads = m.details.get("heads")
    r0, r1 = rows or (0, m.out_features)
    if heads:
        blocks = unpermute_rows(read_array(info), heads)[r0:r1]
    else:
        blocks = read_array(info, rows=None if rows is None else (r0, r1))
    spec = m.details.get("float_spec")
    if spec is not None:
        return FloatWeight(FloatSpec(**spec), (r1 - r0, m.in_features), dtype,
                           decode_float(blocks, m.details["ggml_type"], info))
    return decode(blocks, m.details["ggml_type"], dtype)
