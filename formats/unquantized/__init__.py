"""Unquantized Linears (family "unquantized"): the 2-D (or fused 3-D MoE) float16 / bfloat16 / float32 weights
of a float model that data-free conversion quantizes. No config names them and inspect never finds
them (core/source.data_free_modules picks them out); they are declared like every family so that
generic code reads, windows and specs them through the registry, never by comparing a family's name."""

from ..core.layout import UNQUANTIZED
from ..core.registry import Family


class Unquantized(Family):
    name = UNQUANTIZED
    method = "unquantized"
    codec = "unquantized.codec"
    needs_config = False
    row_multiple = 1
    quantized = False

    def source_spec(self, m, tensors, qc):
        return self.codec_module().spec(m, tensors, qc)
