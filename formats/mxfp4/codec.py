"""gpt-oss MXFP4 tensor data -> QuantTensor (header.py beside it): fused experts' blocks [E, rows, G, 16]
read as their E * rows output rows of G * 32 e2m1 codes (low nibble first), one e8m0 scale per 32 values.

The product e2m1 * 2^(b - 127) is exact in float32 (a 2-bit significand times a power of two; b = 0 gives
2^-127, a float32 subnormal, still exact for every e2m1 magnitude), and in bfloat16, which has float32's
exponent range: it is transformers' ``convert_moe_packed_tensors`` (a lookup of FP4_VALUES, then
``torch.ldexp(values, b - 127)``) bit for bit in any dtype that holds it, before that function's
transpose to [E, in, out]."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.minifloat import E2M1_BOOK, e8m0
from ..core.packing import unpack_nibbles_low_first
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import read_array
from .header import BLOCK_BYTES, SCALES, check


def read(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None) -> QuantTensor:
    """The fused experts module (or its stacked output rows r0:r1, any rows) as a QuantTensor: codes
    [rows, in] unpacked low nibble first, scales 2^(b - 127) [rows, in / 32], read from only those rows'
    bytes. Refused: an e8m0 scale of 255 (NaN), naming the scale tensor and the first such block as
    [expert, row, group]."""
    check(m, tensors, qc)
    blocks, scale = tensors[m.weight_tensors[0]], tensors[m.name + SCALES]
    experts, per_expert, groups = blocks.shape[:3]
    out = experts * per_expert
    r0, r1 = rows or (0, out)
    window = None if rows is None else (r0, r1)
    # the same bytes as [E * rows, G * 16] and [E * rows, G]: a window of stacked rows is one read
    packed = read_array(replace(blocks, shape=(out, groups * BLOCK_BYTES)), rows=window)
    stored = read_array(replace(scale, shape=(out, groups)), rows=window)
    nan = stored == 255
    if nan.any():
        o, g = (int(v[0]) for v in np.nonzero(nan))
        e, r = divmod(r0 + o, per_expert)
        raise CorruptCheckpoint(f"holds {int(nan.sum())} e8m0 scales of 255 (NaN), the first at [{e}, {r}, {g}]: "
                                f"no weight of their blocks decodes", file=scale.file, tensor=scale.name)
    spec = QuantSpec("e2m1", 4, m.group_size, True, codebook=E2M1_BOOK, scale_dtype=scale.dtype)
    return QuantTensor(spec, (r1 - r0, m.in_features), dtype, codes=unpack_nibbles_low_first(packed),
                       scales=e8m0(stored))
