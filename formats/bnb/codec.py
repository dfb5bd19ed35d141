"""bitsandbytes tensor data <-> QuantTensor (the layout, from headers, is header.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from .header import FOUR_BIT_TARGETS, packed_items, quant_state_json
from ..core.ir import DoubleQuant, QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.packing import unpack_nibbles_high_first
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import finite_scales, read_array

# bitsandbytes' 4-bit code books, index -> value (get_4bit_type; docs/formats.md, bitsandbytes 4-bit). Dequantization uses
# these, as bitsandbytes' own kernels do, not the quant_map copy stored beside each weight.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)
# FP4 is in bit-pattern order (bit 3 is the sign). Index 8 is +0.0: bitsandbytes writes it as `-0` in a
# Python list, which is the integer 0, so its table, its kernels and the stored quant_map all hold +0.0.
FP4 = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3],
               dtype=np.float32) / np.float32(12)
CODEBOOKS = {"nf4": NF4, "fp4": FP4}


def _module_error(m: QuantModule, tensors: Mapping[str, TensorInfo]):
    return CorruptCheckpoint(m.problems[0] + "; cannot decode it", file=m.file(tensors), tensor=m.name)


def check_int8(m: QuantModule, tensors: Mapping[str, TensorInfo]) -> None:
    """Refuse, from headers, an LLM.int8 module read_int8 could not decode exactly."""
    fmt = m.details.get("weight_format")
    if fmt not in (None, "row"):
        raise UnsupportedFormat(f"int8 weight_format is {fmt!r}: only row-major int8 weights can be "
                                f"decoded (bitsandbytes >= 0.46 refuses the others too); reload and "
                                f"re-save it with bitsandbytes <= 0.45 on CUDA to untile it",
                                file=m.file(tensors), tensor=m.name)
    if m.problems:
        raise _module_error(m, tensors)


def check_int8_module(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> None:
    check_int8(m, tensors)


def check_4bit_module(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> None:
    check_4bit(m, tensors)


def read_int8_module(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
                     rows: tuple[int, int] | None = None) -> QuantTensor:
    return read_int8(m, tensors, dtype, rows)


def read_4bit_module(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
                     rows: tuple[int, int] | None = None) -> QuantTensor:
    return read_4bit(m, tensors, rows)


def four_bit_row_step(m: QuantModule) -> int:
    """Rows a window of a 4-bit module starts on: whole blocks of the flattened weight (r * in a
    multiple of the blocksize) and whole bytes of the packed codes."""
    bs = m.group_size if m.group_size and m.group_size > 0 else 1
    return math.lcm(bs // math.gcd(m.in_features, bs), 2 // math.gcd(m.in_features, 2))


def read_int8(m: QuantModule, tensors: Mapping[str, TensorInfo], dtype: str,
              rows: tuple[int, int] | None = None) -> QuantTensor:
    """LLM.int8: codes CB + 128 against zero point 128, scale SCB with divisor 127 (bnb's order).
    rows: only output rows r0:r1 (a QuantTensor of r1 - r0 rows)."""
    check_int8(m, tensors)
    weight_info, scb_info = tensors[m.name + ".weight"], tensors[m.name + ".SCB"]
    cb = read_array(weight_info, rows=rows)
    scb = finite_scales(read_array(scb_info, rows=rows), scb_info)
    if np.any(scb < 0):
        raise CorruptCheckpoint("SCB holds negative row scales", file=scb_info.file, tensor=scb_info.name)
    out = cb.shape[0]
    spec = QuantSpec("int", 8, -1, True, scale_divisor=127, scale_dtype=scb_info.dtype)
    return QuantTensor(spec, (out, cb.shape[1]), dtype, codes=(cb.view(np.uint8) ^ 0x80),
                       scales=scb.reshape(out, 1), zeros=np.full((out, 1), 128, dtype=np.uint8))


def check_4bit(m: QuantModule, tensors: Mapping[str, TensorInfo]) -> None:
    """Refuse, from headers, a 4-bit module read_4bit could not decode exactly."""
    if m.problems:
        raise _module_error(m, tensors)
    if m.scheme not in CODEBOOKS:
        raise UnsupportedFormat(f"4-bit quant_type {m.scheme!r} is not nf4 or fp4",
                                file=m.file(tensors), tensor=m.name)


def read_4bit(m: QuantModule, tensors: Mapping[str, TensorInfo],
              rows: tuple[int, int] | None = None) -> QuantTensor:
    """rows: only output rows r0:r1, whose ends are multiples of four_bit_row_step (or the last row):
    their codes and the absmax of their blocks (decoded from the whole double quantization)."""
    check_4bit(m, tensors)
    qs = m.details["quant_state"]
    qtype = m.scheme
    r0, r1 = rows or (0, m.out_features)
    step = four_bit_row_step(m)
    if r0 % step or (r1 % step and r1 != m.out_features) or not 0 <= r0 <= r1 <= m.out_features:
        raise NotStorable(f"rows {r0}:{r1} are not whole blocks of {m.name}")
    n = (r1 - r0) * m.in_features
    weight = tensors[m.name + ".weight"]
    if rows is None:
        codes = unpack_nibbles_high_first(read_array(weight), n)
    else:                        # the stored shape is [bytes / itemsize, 1]: rows of whole items
        item = weight.nbytes // max(weight.shape[0], 1) if weight.shape else 1
        b0, b1 = r0 * m.in_features // 2, -(-r1 * m.in_features // 2)
        i0, i1 = b0 // item, -(-b1 // item)
        raw = read_array(weight, rows=(i0, min(i1, weight.shape[0]))).view(np.uint8).reshape(-1)
        codes = unpack_nibbles_high_first(raw[b0 - i0 * item:b1 - i0 * item], n)
    prefix = m.name + ".weight."
    double = None
    if m.details["double_quant"]:
        nested, nested_map = tensors[prefix + "nested_absmax"], tensors[prefix + "nested_quant_map"]
        double = DoubleQuant(codes=read_array(tensors[prefix + "absmax"]).reshape(-1),
                             nested_absmax=finite_scales(read_array(nested), nested),
                             nested_map=finite_scales(read_array(nested_map), nested_map),
                             offset=np.float32(qs["nested_offset"]),
                             blocksize=qs.get("nested_blocksize", 256))
        absmax = double.decode()
    else:
        info = tensors[prefix + "absmax"]
        absmax = finite_scales(read_array(info), info).reshape(-1)
    dtype = qs["dtype"]
    largest = float(np.abs(absmax).max(initial=0.0))     # |codebook| <= 1: the largest weight's size
    if largest > float(np.finfo(np.float16).max) and dtype == "float16":
        info = tensors[prefix + ("nested_absmax" if double is not None else "absmax")]
        raise CorruptCheckpoint(f"absmax {largest:.3g} makes weights beyond float16's range, the "
                                f"quant_state dtype (they would decode to infinity)", file=info.file,
                                tensor=info.name)
    spec = QuantSpec(qtype, 4, m.group_size, True, codebook=tuple(float(v) for v in CODEBOOKS[qtype]),
                     scale_dtype="F32", storage=weight.dtype)
    if rows is not None:         # the window's blocks (whole: r0 * in is a multiple of the blocksize)
        bs = m.group_size
        return QuantTensor(spec, (r1 - r0, m.in_features), dtype, codes=codes,
                           scales=absmax[r0 * m.in_features // bs:-(-r1 * m.in_features // bs)])
    return QuantTensor(spec, (m.out_features, m.in_features), dtype, codes=codes, scales=absmax,
                       double_quant=double)


# ---------------------------------------------------------------------------------------------
# Writers: QuantTensor -> the tensors bitsandbytes saves (leaf names after "<module>.")

# bitsandbytes' signed dynamic 8-bit map for double quantization (create_dynamic_map(signed=True):
# 256 sorted float32 values in [-0.99297, 1]), as little-endian float32 bytes; tests check it against
# bitsandbytes' own function.
DYNAMIC_MAP = np.frombuffer(bytes.fromhex(
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf"
    "000053bf66664fbfcdcc4bbf333348bf9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbf"
    "cdcc27bf343324bf9a9920bf00001dbf666619bfcdcc15bf343312bf9a990ebf00000bbf666607bfcccc03bf333300bf"
    "3233f9be0000f2becccceabe9a99e3be6666dcbe3333d5be0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabe"
    "cccca2be9a999bbe666694be34338dbe000086be99997dbe33336fbecdcc60be666652be000044be9a9935be333327be"
    "cdcc18be66660abe0000f8bd3433dbbd85ebc9bdf728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd2a5ca7bd9a99a1bd"
    "0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd5d8f72bd3d0a67bd1f855bbd000050bde17a44bdc3f538bd"
    "a3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc"
    "643b1fbc180416bccdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb0d02abbb749398bbdd2486bb8a6c67bb"
    "5c8f42bb2db21dbbfca9f1ba9defa7baff6577ba3ee859ba806a3cbac1ec1eba016f01ba83e2c7b905e78cb90bd723b9"
    "4b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6b7a313b500000000b7a31335941a5a36ff0502370642b237"
    "34803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a806a3c3a3ee8593aff65773a9defa73a"
    "fca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b6abcf43b8195033c"
    "cdcc0c3c1804163c643b1f3c48e13a3cc3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d"
    "6766163d85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d5d8f723d7b147e3dcdcc843d5d8f8a3d"
    "eb51903d7b14963d0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d"
    "0000f83d66660a3ecdcc183e3333273e9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e"
    "6666943e9a999b3ecccca23e0000aa3e3333b13e6666b83e9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33e"
    "ccccea3e0000f23e3233f93e3333003fcccc033f6666073f00000b3f9a990e3f3433123fcdcc153f6666193f00001d3f"
    "9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f3433363fcdcc393f66663d3f0000413f9a99443f3333483f"
    "cdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f0000653f9a99683f33336c3fcdcc6f3f6666733f"
    "0000773f9a997a3f33337e3f0000803f"
), dtype="<f4").astype(np.float32)
NESTED_BLOCKSIZE = 256


def double_quantize(absmax: np.ndarray) -> DoubleQuant:
    """Second-level quantization of the block absmax, as bitsandbytes does it (docs/formats.md, bitsandbytes 4-bit):
    offset = mean(absmax); (absmax - offset) in blocks of 256, each scaled by its absmax and coded as
    the nearest entry of the dynamic map."""
    absmax = np.asarray(absmax, np.float32)
    offset = np.float32(absmax.mean(dtype=np.float32))
    x = (absmax - offset).astype(np.float32)
    n = x.size
    nb = -(-n // NESTED_BLOCKSIZE)
    padded = np.zeros(nb * NESTED_BLOCKSIZE, np.float32)
    padded[:n] = x
    blocks = padded.reshape(nb, NESTED_BLOCKSIZE)
    nested = np.abs(blocks).max(axis=1).astype(np.float32)
    scaled = blocks / np.where(nested > 0, nested, np.float32(1))[:, None]
    bounds = (DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:]) / 2
    codes = np.searchsorted(bounds, scaled).astype(np.uint8).reshape(-1)[:n]
    return DoubleQuant(codes=codes, nested_absmax=nested, nested_map=DYNAMIC_MAP.copy(), offset=offset,
                       blocksize=NESTED_BLOCKSIZE)

_STORAGE_NUMPY = {"U8": np.uint8, "I8": np.int8, "F16": np.float16, "BF16": np.uint16, "F32": np.float32,
                  "F64": np.float64}
STORAGE_CODES = {"uint8": "U8", "int8": "I8", "float16": "F16", "bfloat16": "BF16", "float32": "F32",
                 "float64": "F64"}


def encode_int8(qt: QuantTensor) -> dict[str, tuple[str, np.ndarray]]:
    """LLM.int8 tensors from 8-bit symmetric per-row codes (zero point 128) with SCB scales."""
    return {"weight": ("I8", (qt.codes ^ 0x80).view(np.int8)),
            "SCB": ("F32", np.ascontiguousarray(qt.scales.reshape(-1), dtype=np.float32)),
            "weight_format": ("U8", np.zeros((), np.uint8))}


def encode_4bit(qt: QuantTensor) -> dict[str, tuple[str, np.ndarray]]:
    from ..core.packing import pack_nibbles_high_first

    storage = qt.spec.storage or "U8"
    packed = pack_nibbles_high_first(qt.codes)
    itemsize = np.dtype(_STORAGE_NUMPY[storage]).itemsize
    if packed.size % itemsize:
        raise NotStorable(f"{packed.size} packed bytes cannot be stored as {storage}")
    out = {"weight": (storage, packed.view(_STORAGE_NUMPY[storage]).reshape(-1, 1))}
    dq = qt.double_quant
    if dq is None:
        out["weight.absmax"] = ("F32", np.ascontiguousarray(qt.scales, dtype=np.float32))
    else:
        out["weight.absmax"] = ("U8", np.ascontiguousarray(dq.codes, dtype=np.uint8))
    out["weight.quant_map"] = ("F32", CODEBOOKS[qt.spec.scheme].copy())
    if dq is not None:
        out["weight.nested_absmax"] = ("F32", np.ascontiguousarray(dq.nested_absmax, dtype=np.float32))
        out["weight.nested_quant_map"] = ("F32", np.ascontiguousarray(dq.nested_map, dtype=np.float32))
    blob = quant_state_json(qt.spec.scheme, qt.spec.group_size, qt.dtype, qt.shape,
                            dq.offset if dq is not None else None, dq.blocksize if dq is not None else 256)
    out[f"weight.quant_state.bitsandbytes__{qt.spec.scheme}"] = ("U8", np.frombuffer(blob, dtype=np.uint8).copy())
    return out


def quantize_4bit(w: np.ndarray, quant_type: str, blocksize: int, *, search: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Float weights -> (codes [n], absmax [n_blocks]) over the row-major flattened weight. The block
    scale is searched around the block's absmax (0.60 .. 1.20 of it) for the least squared error;
    search=False is bitsandbytes' own rule (scale = absmax, nearest code)."""
    book = CODEBOOKS[quant_type]
    order = np.argsort(book, kind="stable")
    sorted_book = book[order]
    bounds = (sorted_book[:-1] + sorted_book[1:]) / 2
    flat = np.asarray(w, np.float32).reshape(-1)
    n = flat.size
    nb = -(-n // blocksize)
    padded = np.zeros(nb * blocksize, np.float32)
    padded[:n] = flat
    mask = np.zeros(nb * blocksize, np.float32)
    mask[:n] = 1
    blocks, mask = padded.reshape(nb, blocksize), mask.reshape(nb, blocksize)
    amax = np.abs(blocks).max(axis=1)
    best = None
    for f in (np.concatenate([[1.0], np.linspace(0.60, 1.20, 61)]) if search else [1.0]):
        scale = (amax * np.float32(f)).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1))
        x = np.clip(blocks / safe[:, None], -1, 1)
        codes = order[np.searchsorted(bounds, x)].astype(np.uint8)
        err = (((book[codes] * scale[:, None]) - blocks) ** 2 * mask).sum(axis=1)
        if best is None:
            best = [err, scale, codes]
        else:
            better = err < best[0]
            best[0] = np.where(better, err, best[0])
            best[1] = np.where(better, scale, best[1])
            best[2] = np.where(better[:, None], codes, best[2])
    return best[2].reshape(-1)[:n], best[1].astype(np.float32)


def scb_from_scales(s: np.ndarray) -> np.ndarray:
    """SCB for GPTQ-style scales s, inverting s = float32(SCB / 127). bitsandbytes computes SCB on the
    weight cast to float16, so an SCB is a float16 value: where one maps to s, it is the SCB that
    produced s (so bnb8 -> GPTQ with float32 scales -> bnb8 gives back the same bytes). Otherwise
    s * 127 rounded once (exact for float16 or bfloat16 scales, so GPTQ -> bnb8 -> GPTQ is identical)."""
    product = s.astype(np.float64) * 127
    scb = product.astype(np.float32)
    with np.errstate(over="ignore"):
        half = product.astype(np.float16).astype(np.float32)
    hit = np.isfinite(half) & ((half / np.float32(127)).astype(np.float32) == s)
    return np.where(hit, half, scb).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The registry targets' hooks (formats/core/registry.py, Target): bnb8 and bnb4-nf4 / bnb4-fp4

def encode_for(target: str, qt: QuantTensor, spec: QuantSpec, g_idx: bool) -> dict[str, tuple[str, np.ndarray]]:
    """The tensors of one module, as bnb.int8_leaves / bnb.four_bit_leaves predict them (bitsandbytes
    stores no g_idx; qt is already in the target's terms: retarget_int8 / retarget_4bit / requantize_4bit)."""
    return encode_4bit(qt) if target in FOUR_BIT_TARGETS else encode_int8(qt)


def fit_int8(m: QuantModule, src, request, negotiate) -> tuple[QuantSpec, str | None]:
    """bnb8's spec for a module: 8-bit symmetric codes with one scale per row (SCB: divisor 127, float32),
    whatever the request. The request and the source's settings are negotiated unfitted (its refusals,
    and the reason a change of bits or groups gives); codes are kept only where the source's are 8-bit
    symmetric per row."""
    bits, group, sym, reason = negotiate()
    if reason is None and (bits != 8 or src.group_size > 0 or not src.symmetric):
        reason = (f"bitsandbytes int8 holds 8-bit symmetric codes with one scale per row; this module "
                  f"has {src.bits}-bit {'sym' if src.symmetric else 'asym'} codes in groups of "
                  f"{src.group_size}")
    return QuantSpec("int", 8, -1, True, scale_divisor=127, scale_dtype="F32"), reason


def fit_4bit(quant_type: str, m: QuantModule, src, request, negotiate) -> tuple[QuantSpec, str | None]:
    """A bnb4 target's spec for a module: its code book; blocksize, quant storage and double quant as
    requested (request.block_size, .quant_storage, .double_quant), else the source's where it has the same
    code book, else 64, uint8, none. Codes are kept where code book and blocksize are the source's and no
    double quantization is added (dropping or keeping it, or another storage dtype, keeps every value)."""
    same_book = src.scheme == quant_type
    blocksize = request.block_size or (src.group_size if same_book else 64)
    storage = (STORAGE_CODES[request.quant_storage] if request.quant_storage
               else (src.storage if same_book else "U8"))
    source_dq = same_book and m.details.get("double_quant", False)
    double = source_dq if request.double_quant is None else request.double_quant
    spec = QuantSpec(quant_type, 4, blocksize, True, codebook=tuple(map(float, CODEBOOKS[quant_type])),
                     scale_dtype="F32", storage=storage)
    if src.scheme == "float":
        return spec, src.requantized()
    if not same_book:
        return spec, f"{src.name} codes become {quant_type}"
    if blocksize != src.group_size:
        return spec, f"blocksize {src.group_size} becomes {blocksize}"
    if double and not source_dq:
        return spec, "block absmax gets double-quantized"
    return spec, None


def plan_4bit(ctx) -> dict:
    """A bnb4 module's write settings (the keyword arguments of bnb.four_bit_leaves), before any tensor
    is written: its dtype; double quant kept from a double-quantized source whose codes are kept (unless
    --no-double-quant), made where asked (or where the source had it, same code book), with the nested
    blocksize and offset that size the quant_state JSON: the source's where kept, else bitsandbytes'
    offset (the mean of the new absmax), so the module is encoded once here to learn it. Refused: packed
    bytes that are not whole items of the storage dtype."""
    m, spec, request = ctx.module, ctx.spec, ctx.request
    try:
        packed_items(m.out_features * m.in_features, spec.storage)
    except ValueError as exc:
        raise UnsupportedFormat(str(exc), tensor=m.name) from None
    source_dq = m.family == "bnb4" and m.details.get("double_quant", False)
    keep = not ctx.reason and source_dq and request.double_quant is not False
    want = (request.double_quant if request.double_quant is not None
            else (source_dq and m.scheme == spec.scheme))
    settings = {"dtype": ctx.dtype, "double_quant": bool(keep or want)}
    if keep:
        qs = m.details["quant_state"]
        settings.update(nested_blocksize=qs.get("nested_blocksize", NESTED_BLOCKSIZE),
                        nested_offset=qs.get("nested_offset"))
    elif want:
        # The JSON's length depends on the new offset's digits, and the header comes first: work the
        # offset out now (one module at a time; the write pass recomputes the same numbers).
        settings["nested_blocksize"] = NESTED_BLOCKSIZE
        blob = next(a for leaf, (_, a) in ctx.encode(settings).items() if leaf.startswith("weight.quant_state."))
        settings["nested_offset"] = json.loads(blob.tobytes())["nested_offset"]
    return settings


def requantize_4bit(source, w: np.ndarray, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, QuantTensor]:
    """A module requantized to spec's code book and blocksize from its exact weights w (block scales
    searched, quantize_4bit), double-quantized where its settings say, and bitsandbytes' own
    round-to-nearest for the report. A source with the same code book and blocksize keeps its codes and
    absmax (only double quantization is added)."""
    same_codes = source.spec.scheme == spec.scheme and source.spec.group_size == spec.group_size
    if same_codes:
        codes, absmax = source.codes, source.scales
    else:
        codes, absmax = quantize_4bit(w, spec.scheme, spec.group_size)
    rtn_codes, rtn_absmax = quantize_4bit(w, spec.scheme, spec.group_size, search=False)
    double = settings.get("double_quant", False)
    dq = double_quantize(absmax) if double else None
    qt = QuantTensor(spec, source.shape, source.dtype, codes=codes,
                     scales=dq.decode() if dq is not None else absmax, double_quant=dq)
    rtn_dq = double_quantize(rtn_absmax) if double else None
    rtn = QuantTensor(spec, source.shape, source.dtype, codes=rtn_codes,
                      scales=rtn_dq.decode() if rtn_dq is not None else rtn_absmax)
    return qt, rtn


def retarget_int8(qt: QuantTensor, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, np.ndarray | None]:
    """Kept 8-bit symmetric per-row codes with SCB scales: an LLM.int8 source's as they are, others'
    SCB = s * 127 (scb_from_scales; exact: s * 127, what the stored SCB rounds)."""
    if qt.spec.scale_divisor == 127:
        scales, exact = qt.scales, None
    else:
        scales, exact = scb_from_scales(qt.scales), qt.scales.astype(np.float64) * 127
    if np.any(qt.zeros != 128):
        raise AssertionError("symmetric 8-bit codes must have zero point 128")
    return replace(qt, spec=spec, scales=scales), exact


def retarget_4bit(qt: QuantTensor, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, None]:
    """Kept codes and absmax in the target's storage, the source's double quantization kept or dropped
    as the settings say (no value changes: nothing rounded)."""
    return replace(qt, spec=spec, double_quant=qt.double_quant if settings.get("double_quant", False) else None), None


# ---------------------------------------------------------------------------------------------
# The family's source specs (registry Family.source_spec): what convert negotiates a module from

def int8_spec(m: QuantModule, tensors, qc) -> QuantSpec:
    """LLM.int8: symmetric int8 per row, the scale SCB / 127 (a divisor)."""
    return QuantSpec("int", 8, -1, True, scale_divisor=127)


def four_bit_spec(m: QuantModule, tensors, qc) -> QuantSpec:
    """nf4 / fp4: the flat code book in absmax blocks, stored in its quant_storage dtype."""
    return QuantSpec(m.scheme, 4, m.group_size, True, codebook=tuple(map(float, CODEBOOKS[m.scheme])),
                     storage=STORAGE_CODES.get(m.details.get("quant_storage"), "U8"))
