"""bitsandbytes tensor data <-> QuantTensor (the layout, from headers, is bnb.py)."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..errors import CorruptCheckpoint, UnsupportedFormat
from .ir import DoubleQuant, QuantSpec, QuantTensor
from .layout import QuantModule
from .packing import unpack_nibbles_high_first
from .safetensors_header import TensorInfo
from .tensor_io import read_array

# bitsandbytes' 4-bit code books, index -> value (get_4bit_type; FORMATS.md §2.3). Dequantization uses
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
    first = tensors.get(m.weight_tensors[0]) if m.weight_tensors else None
    return CorruptCheckpoint(m.problems[0] + "; cannot decode it",
                             file=first.file if first else None, tensor=m.name)


def read_int8(m: QuantModule, tensors: Mapping[str, TensorInfo], dtype: str) -> QuantTensor:
    """LLM.int8: codes CB + 128 against zero point 128, scale SCB with divisor 127 (bnb's order)."""
    fmt = m.details.get("weight_format")
    weight_info = tensors.get(m.name + ".weight")
    if fmt not in (None, "row"):
        raise UnsupportedFormat(f"int8 weight_format is {fmt!r}: only row-major int8 weights can be "
                                f"decoded (bitsandbytes >= 0.46 refuses the others too); reload and "
                                f"re-save it with bitsandbytes <= 0.45 on CUDA to untile it",
                                file=weight_info.file if weight_info else None, tensor=m.name)
    if m.problems:
        raise _module_error(m, tensors)
    scb_info = tensors[m.name + ".SCB"]
    cb = read_array(weight_info)
    scb = read_array(scb_info).astype(np.float32, copy=False)
    if not np.all(np.isfinite(scb)) or np.any(scb < 0):
        raise CorruptCheckpoint("SCB holds negative or non-finite row scales", file=scb_info.file,
                                tensor=scb_info.name)
    out = cb.shape[0]
    spec = QuantSpec("int", 8, -1, True, scale_divisor=127, scale_dtype=scb_info.dtype)
    return QuantTensor(spec, (out, cb.shape[1]), dtype, codes=(cb.view(np.uint8) ^ 0x80),
                       scales=scb.reshape(out, 1), zeros=np.full((out, 1), 128, dtype=np.uint8))


def read_4bit(m: QuantModule, tensors: Mapping[str, TensorInfo]) -> QuantTensor:
    if m.problems:
        raise _module_error(m, tensors)
    qs = m.details["quant_state"]
    qtype = m.scheme
    if qtype not in CODEBOOKS:
        raise UnsupportedFormat(f"4-bit quant_type {qtype!r} is not nf4 or fp4",
                                file=tensors[m.name + ".weight"].file, tensor=m.name)
    n = m.out_features * m.in_features
    weight = tensors[m.name + ".weight"]
    codes = unpack_nibbles_high_first(read_array(weight), n)
    prefix = m.name + ".weight."
    double = None
    if m.details["double_quant"]:
        double = DoubleQuant(codes=read_array(tensors[prefix + "absmax"]).reshape(-1),
                             nested_absmax=read_array(tensors[prefix + "nested_absmax"]).astype(np.float32),
                             nested_map=read_array(tensors[prefix + "nested_quant_map"]).astype(np.float32),
                             offset=np.float32(qs["nested_offset"]),
                             blocksize=int(qs.get("nested_blocksize", 256)))
        absmax = double.decode()
    else:
        absmax = read_array(tensors[prefix + "absmax"]).astype(np.float32).reshape(-1)
    spec = QuantSpec(qtype, 4, m.group_size, True, codebook=tuple(float(v) for v in CODEBOOKS[qtype]),
                     scale_dtype="F32", storage=weight.dtype)
    dtype = qs.get("dtype", "float16")
    return QuantTensor(spec, (m.out_features, m.in_features), dtype, codes=codes, scales=absmax,
                       double_quant=double)


# ---------------------------------------------------------------------------------------------
# Writers: QuantTensor -> the tensors bitsandbytes saves (leaf names after "<module>.")

_STORAGE_NUMPY = {"U8": np.uint8, "I8": np.int8, "F16": np.float16, "BF16": np.uint16, "F32": np.float32,
                  "F64": np.float64}
STORAGE_CODES = {"uint8": "U8", "int8": "I8", "float16": "F16", "bfloat16": "BF16", "float32": "F32",
                 "float64": "F64"}


def quant_state_json(quant_type: str, blocksize: int, dtype: str, shape, nested_offset=None,
                     nested_blocksize: int = 256) -> bytes:
    """The packed quant_state exactly as bitsandbytes writes it: json.dumps of QuantState.as_dict's
    non-tensor items, in that order (FORMATS.md §2.1). Known before any data is read, so a writer can
    plan its header (the nested offset of a double-quantized source comes from the source's JSON)."""
    import json

    state = {"quant_type": quant_type, "blocksize": blocksize, "dtype": dtype, "shape": list(shape)}
    if nested_offset is not None:
        state.update({"nested_blocksize": nested_blocksize, "nested_dtype": "float32",
                      "nested_offset": float(nested_offset)})
    return json.dumps(state).encode("utf-8")


def encode_4bit(qt: QuantTensor) -> dict[str, tuple[str, np.ndarray]]:
    from .packing import pack_nibbles_high_first

    storage = qt.spec.storage or "U8"
    packed = pack_nibbles_high_first(qt.codes)
    itemsize = np.dtype(_STORAGE_NUMPY[storage]).itemsize
    if packed.size % itemsize:
        raise ValueError(f"{packed.size} packed bytes cannot be stored as {storage}")
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
