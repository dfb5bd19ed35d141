"""FP8 (e4m3) tensor data -> QuantTensor: transformers' fine-grained FP8 (header.py beside it), and the
e4m3 reader every FP8 dialect shares (compressed-tensors float-quantized, ModelOpt FP8): one e4m3 weight
[out, in], one scale per block of block_rows x group_size (a partial last block where a dimension is
not a multiple), per row (block_rows 1) or per tensor (block_rows 0)."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.minifloat import E4M3_BOOK
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import read_array, to_float32
from .header import check


def read_e4m3(weight: TensorInfo, scale: TensorInfo, block_rows: int, group_size: int, dtype: str,
              rows: tuple[int, int] | None = None) -> QuantTensor:
    """The e4m3 weight (rows r0:r1 of it, any rows) and its scales, expanded to one row of block scales
    per output row: scales [rows, ceil(in / group_size)] (group_size -1: one per row), exactly as
    stored. Refused: an e4m3 NaN code (0x7F / 0xFF; e4m3 has no infinity), a NaN or infinite scale,
    a scale tensor whose size does not fit the blocks."""
    out, inp = weight.shape
    r0, r1 = rows or (0, out)
    codes = read_array(weight, rows=None if rows is None else (r0, r1))
    nan = (codes & 0x7F) == 0x7F
    if nan.any():
        o, i = (int(v[0]) for v in np.nonzero(nan))
        raise CorruptCheckpoint(f"holds {int(nan.sum())} e4m3 NaN codes (0x7F / 0xFF), the first at "
                                f"[{r0 + o}, {i}]: no weight decodes from them", file=weight.file,
                                tensor=weight.name)
    cols = 1 if group_size <= 0 else -(-inp // group_size)
    if block_rows <= 0:                                  # one scale for the tensor
        s_rows, first = np.zeros(r1 - r0, np.int64), 0
        stored = read_array(scale).reshape(-1)
        want = 1
    else:
        first, last = r0 // block_rows, -(-r1 // block_rows) if r1 > r0 else r0 // block_rows
        s_rows = np.arange(r0, r1) // block_rows - first
        stored = read_array(scale, rows=(first, last)) if len(scale.shape) >= 1 and rows is not None else \
            read_array(scale)
        want = (last - first if rows is not None else -(-out // block_rows)) * cols
    if stored.size != want:
        raise CorruptCheckpoint(f"holds {stored.size} scales where {want} blocks need one each; cannot decode "
                                f"it", file=scale.file, tensor=scale.name)
    values = to_float32(stored, scale.dtype).reshape(-1, cols)
    if not np.all(np.isfinite(values)):
        raise CorruptCheckpoint("holds non-finite scales (NaN or infinity, an e8m0 255)", file=scale.file,
                                tensor=scale.name)
    scales = np.ascontiguousarray(values[s_rows], dtype=np.float32)
    spec = QuantSpec("e4m3", 8, group_size, True, codebook=E4M3_BOOK, scale_dtype=scale.dtype,
                     block_rows=block_rows)
    return QuantTensor(spec, (r1 - r0, inp), dtype, codes=codes, scales=scales)


def read(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None) -> QuantTensor:
    """A fine-grained FP8 module (or its output rows r0:r1) as a QuantTensor: float32(e4m3) * scale, the
    product transformers' Fp8Dequantize computes in float32, exactly."""
    check(m, tensors, qc)
    return read_e4m3(tensors[m.weight_tensors[0]], tensors[m.name + ".weight_scale_inv"], m.details["block_rows"],
                     m.group_size, dtype, rows)
