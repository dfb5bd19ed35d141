"""An unquantized Linear's weight as the canonical representation: a FloatWeight whose rows are read from
the file as they are needed (core/requantize.ExactRows), each window refused when it holds a NaN or an
infinity (no quantizer can hold one), so a lossy path holds one window of a layer, never all of it."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint
from ..core.ir import FloatSpec, FloatWeight
from ..core.layout import QuantModule
from ..core.requantize import ExactRows
from ..core.source import parallel_rows
from ..storage.tensor_io import read_array, to_float32


def spec(m: QuantModule, tensors: Mapping, qc: Mapping | None) -> FloatSpec:
    return FloatSpec(m.scheme)


def read(m: QuantModule, tensors: Mapping, qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None) -> FloatWeight:
    """Rows r0:r1 (all: None) of the module's weight; a fused experts tensor [E, R, in] (split into one
    module per expert by reader.read_module, which asks for the expert's rows) is read as [E * R, in]."""
    info = tensors[m.weight_tensors[0]]
    if len(info.shape) == 3:
        info = replace(info, shape=(info.shape[0] * info.shape[1], info.shape[2]))
    first, last = rows or (0, m.out_features)

    def window(r0: int, r1: int) -> np.ndarray:
        values = to_float32(read_array(info, rows=(first + r0, first + r1)), info.dtype)
        if not np.isfinite(values).all():
            raise CorruptCheckpoint("holds non-finite weights (NaN or infinity); they cannot be quantized",
                                    file=info.file, tensor=info.name)
        return values

    shape = (last - first, m.in_features)
    return FloatWeight(FloatSpec(m.scheme), shape, m.scheme, ExactRows(shape, parallel_rows(window, shape)))
