"""AWQ GEMM tensor data <-> QuantTensor (the layout, from headers, and the config are awq.py).

qweight [in, out/8] and qzeros [G, out/8] hold 4-bit fields in int32 words, nibble i (bits 4i..4i+3)
of word c holding column 8c + AWQ_ORDER[i] (AutoAWQ ``WQLinear_GEMM.from_linear``; undone by
``unpack_awq`` + ``reverse_awq_order`` in ``awq/utils/packing_utils.py``). Decoding transposes the
[in, out/8] words first (8 codes moved at once) and scatters nibble i of word row c into output row
8c + AWQ_ORDER[i], which gives nn.Linear's [out, in] codes contiguous without a uint8 transpose.

Zero points are decoded as stored, whatever ``zero_point`` says: that is what AutoAWQ's
``dequantize_gemm``, GPTQModel's AWQ kernels and vLLM's ``awq_dequantize`` / ``awq_gemm`` compute, and
what every producer stores for symmetric files (8 = 2^(bits-1): GPTQModel ``awq_processor``
``pseudo_quantize_tensor``, auto-round ``export_to_awq.pack_layer``). The QuantSpec is symmetric when the
config says ``zero_point: false`` *and* every stored zero point is 8; a file saying zero_point false
whose qzeros hold other values is decoded by those zeros (as its loaders do) and reported asymmetric,
so that no writer drops them.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable
from .header import AWQ_ORDER, BITS, PACK, SCALE_DTYPES, check, parse_config
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import encode_float, finite_scales, read_array, to_float32

_SYM_ZERO = 1 << (BITS - 1)


def unpack_interleaved(words: np.ndarray) -> np.ndarray:
    """AWQ words [rows, n/8] (int32 or uint32) -> uint8 codes [n, rows] in natural column order, i.e.
    the transpose of the unpacked [rows, n] matrix."""
    wt = np.ascontiguousarray(np.asarray(words).view(np.uint32).T)            # [n/8, rows]
    codes = np.empty((wt.shape[0], PACK, wt.shape[1]), dtype=np.uint8)
    mask = np.uint32((1 << BITS) - 1)
    for i, col in enumerate(AWQ_ORDER):
        np.bitwise_and(wt >> np.uint32(BITS * i), mask, out=codes[:, col, :], casting="unsafe")
    return codes.reshape(wt.shape[0] * PACK, wt.shape[1])


def pack_interleaved(codes_t: np.ndarray) -> np.ndarray:
    """Inverse of unpack_interleaved: uint codes [n, rows] (< 16) -> AWQ int32 words [rows, n/8]."""
    c = np.asarray(codes_t)
    n, rows = c.shape
    if n % PACK:
        raise NotStorable(f"{n} output channels are not a multiple of {PACK}")
    if c.dtype == np.uint8:
        if c.size and int(c.max()) >> BITS:
            raise NotStorable(f"codes do not fit in {BITS} bits")
    elif c.size and (int(c.min()) < 0 or int(c.max()) >> BITS):
        raise NotStorable(f"codes do not fit in {BITS} bits")
    c3 = c.reshape(n // PACK, PACK, rows)
    wt = np.zeros((n // PACK, rows), dtype=np.uint32)
    for i, col in enumerate(AWQ_ORDER):          # one eighth of the codes widened at a time
        wt |= c3[:, col, :].astype(np.uint32) << np.uint32(BITS * i)
    return np.ascontiguousarray(wt.T).view(np.int32)


def read(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None) -> QuantTensor:
    """The module as a QuantTensor: codes uint8 [out, in], true zero points uint8 [out, G], float32
    scales [out, G] (exactly the stored F16/BF16 values), spec.scale_dtype the stored code. rows: only
    output rows r0:r1 (multiples of 8, or the last row), read as column windows of the words."""
    check(m, tensors, qc)
    qweight = tensors[m.name + ".qweight"]
    zeros_info, scales_info = tensors[m.name + ".qzeros"], tensors[m.name + ".scales"]
    out, inp = m.out_features, m.in_features
    r0, r1 = rows or (0, out)
    if r0 % PACK or r1 % PACK or not 0 <= r0 <= r1 <= out:
        raise NotStorable(f"rows {r0}:{r1} of {m.name} are not whole words of {PACK} output channels")
    words = (r0 // PACK, r1 // PACK)
    codes = unpack_interleaved(read_array(qweight, cols=words))                       # [rows, in]
    zeros = unpack_interleaved(read_array(zeros_info, cols=words))                    # [rows, G]
    scales = finite_scales(to_float32(read_array(scales_info, cols=(r0, r1)), scales_info.dtype), scales_info)
    out = r1 - r0
    if codes.shape != (out, inp) or zeros.shape[0] != out:
        raise CorruptCheckpoint(f"decoded codes {list(codes.shape)} do not match [{out}, {inp}]",
                                file=qweight.file, tensor=qweight.name)
    zero_point = parse_config(qc)["zero_point"]
    symmetric = not zero_point and bool(np.all(zeros == _SYM_ZERO))
    spec = QuantSpec("int", BITS, m.group_size, symmetric, scale_dtype=scales_info.dtype, zero_encoding=None)
    return QuantTensor(spec, (out, inp), dtype, codes=codes, scales=np.ascontiguousarray(scales.T),
                       zeros=zeros)


def _groups(spec: QuantSpec, inp: int) -> int:
    gs = spec.group_size
    if gs is None or gs == 0 or gs < -1:
        raise NotStorable(f"group_size {gs!r} is not a positive integer or -1")
    if gs == -1:
        return 1
    if inp % gs:
        raise NotStorable(f"{inp} input channels are not a whole number of groups of {gs} (AWQ GEMM "
                         f"needs in % group_size == 0)")
    return inp // gs


def _scale_code(spec: QuantSpec, scale_dtype: str | None) -> str:
    code = scale_dtype or spec.scale_dtype
    if code not in SCALE_DTYPES:
        raise NotStorable(f"AWQ GEMM stores {' or '.join(SCALE_DTYPES)} scales, not {code!r}; pass "
                         f"scale_dtype='F16' (AutoAWQ) or 'BF16' (GPTQModel) to choose the rounding")
    return code


def _refuse_spec(spec: QuantSpec) -> None:
    if spec.scheme != "int" or spec.bits != BITS:
        raise NotStorable(f"AWQ GEMM stores 4-bit integer codes, not {spec.name}")
    if spec.scale_divisor != 1:
        raise NotStorable("AWQ GEMM stores plain scales (no scale divisor)")


def leaves(spec: QuantSpec, shape: tuple[int, int], scale_dtype: str | None = None
           ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """leaf -> (safetensors dtype, shape) of an AWQ GEMM module of logical [out, in] ``shape``."""
    _refuse_spec(spec)
    out, inp = shape
    if out % PACK:
        raise NotStorable(f"{out} output channels are not a multiple of {PACK}")
    groups = _groups(spec, inp)
    return {"qweight": ("I32", (inp, out // PACK)),
            "qzeros": ("I32", (groups, out // PACK)),
            "scales": (_scale_code(spec, scale_dtype), (groups, out))}


def encode(qt: QuantTensor, scale_dtype: str | None = None) -> dict[str, tuple[str, np.ndarray]]:
    """QuantTensor -> the tensors of an AWQ GEMM module, leaf -> (safetensors dtype, stored values):
    qweight, qzeros, scales in AWQ's orientation. The exact inverse of read. Refuses (ValueError) what
    AWQ cannot hold: non-4-bit or non-integer codes, act-order g_idx, groups that do not tile ``in``."""
    spec = qt.spec
    _refuse_spec(spec)
    out, inp = qt.shape
    groups = _groups(spec, inp)
    if qt.g_idx is not None and not np.array_equal(np.asarray(qt.g_idx), _trivial_groups(spec, inp)):
        raise NotStorable("AWQ GEMM has no g_idx: act-order (permuted groups) cannot be stored")
    if qt.zeros is None:
        raise NotStorable("AWQ GEMM stores zero points; this QuantTensor has none")
    if qt.codes.shape != (out, inp) or qt.zeros.shape != (out, groups) or qt.scales.shape != (out, groups):
        raise NotStorable(f"codes {list(qt.codes.shape)}, zeros {list(qt.zeros.shape)}, scales "
                         f"{list(qt.scales.shape)} do not fit [{out}, {inp}] in {groups} groups")
    code = _scale_code(spec, scale_dtype)
    return {"qweight": ("I32", pack_interleaved(qt.codes)),
            "qzeros": ("I32", pack_interleaved(qt.zeros)),
            "scales": (code, encode_float(np.ascontiguousarray(qt.scales.T), code))}


def _trivial_groups(spec: QuantSpec, inp: int) -> np.ndarray:
    """g_idx of contiguous groups (i // group_size), the only arrangement AWQ stores."""
    return np.zeros(inp, np.int64) if spec.group_size <= 0 else np.arange(inp) // spec.group_size


def encode_for(target: str, qt: QuantTensor, spec: QuantSpec, g_idx: bool) -> dict[str, tuple[str, np.ndarray]]:
    """The registry's encoder of the awq target."""
    return encode(qt, spec.scale_dtype)
