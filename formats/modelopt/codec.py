"""ModelOpt tensor data -> QuantTensor (header.py beside it): FP8 through the e4m3 reader every FP8
dialect shares (one scale per tensor), NVFP4 as e2m1 codes with its two scale levels kept.

NVFP4 is decoded exactly as ModelOpt's own ``NVFP4QTensor.dequantize`` computes it in float32: the
per-group scale first, float32(weight_scale) * weight_scale_2, then the code times it. Multiplying the
code by the e4m3 scale first and by weight_scale_2 after rounds differently. ModelOpt's e2m1 table
decodes the nibble 0x8 (e2m1's -0) as +0.0, not -0.0: every code-8 weight of the fixture oracle is +0.0,
so the code book here is E2M1 with that one entry unsigned (equal as values, so to every comparison of
code books; only the bits of a zero differ).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.minifloat import E2M1_BOOK, E4M3, E4M3_NAN
from ..core.packing import unpack_nibbles_low_first
from ..fp8.codec import read_e4m3
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import read_array
from .header import check

MODELOPT_E2M1_BOOK = tuple(0.0 if v == 0 else v for v in E2M1_BOOK)   # nibble 0x8 -> +0.0, as ModelOpt


def _scalar(info: TensorInfo) -> np.float32:
    """A one-element float32 scale, refused when NaN or infinite."""
    value = read_array(info).reshape(-1).astype(np.float32)
    if value.size != 1 or not np.isfinite(value[0]):
        raise CorruptCheckpoint(f"holds {value.tolist()!r}, not one finite scale; cannot decode it",
                                file=info.file, tensor=info.name)
    return value[0]


def read_nvfp4(m: QuantModule, tensors: Mapping[str, TensorInfo], dtype: str,
               rows: tuple[int, int] | None = None) -> QuantTensor:
    """Rows r0:r1 (any rows) of an NVFP4 module: codes unpacked low nibble first, group_scales the
    decoded e4m3 weight_scale, global_scale weight_scale_2, scales their float32 product. Refused: an
    e4m3 NaN code in weight_scale (0x7F / 0xFF), a NaN or infinite weight_scale_2."""
    weight = tensors[m.weight_tensors[0]]
    scale, scale_2 = tensors[m.name + ".weight_scale"], tensors[m.name + ".weight_scale_2"]
    r0, r1 = rows or (0, m.out_features)
    window = None if rows is None else (r0, r1)
    codes = unpack_nibbles_low_first(read_array(weight, rows=window))
    stored = read_array(scale, rows=window)
    nan = np.isin(stored, E4M3_NAN)
    if nan.any():
        o, g = (int(v[0]) for v in np.nonzero(nan))
        raise CorruptCheckpoint(f"holds {int(nan.sum())} e4m3 NaN codes (0x7F / 0xFF), the first at [{r0 + o}, "
                                f"{g}]: no weight of that group decodes", file=scale.file, tensor=scale.name)
    group_scales = E4M3[stored]
    global_scale = _scalar(scale_2)
    scales = group_scales * global_scale            # float32 * float32: ModelOpt's per-group scale
    spec = QuantSpec("e2m1", 4, m.group_size, True, codebook=MODELOPT_E2M1_BOOK, scale_dtype=scale.dtype,
                     global_scale="multiplier")
    return QuantTensor(spec, (r1 - r0, m.in_features), dtype, codes=codes, scales=scales,
                       group_scales=group_scales, global_scale=global_scale)


def read(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None) -> QuantTensor:
    """A ModelOpt module (or its output rows r0:r1) as a QuantTensor, in ModelOpt's float32 order:
    FP8 float32(e4m3) * weight_scale, NVFP4 e2m1 * (float32(weight_scale) * weight_scale_2)."""
    check(m, tensors, qc)
    if m.scheme == "e4m3":
        return read_e4m3(tensors[m.weight_tensors[0]], tensors[m.name + ".weight_scale"], 0, -1, dtype, rows)
    return read_nvfp4(m, tensors, dtype, rows)
