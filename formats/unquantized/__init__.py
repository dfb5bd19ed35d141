"""Unquantized Linears (family "unquantized"): the 2-D (or fused 3-D MoE) float16 / bfloat16 / float32 weights
of a float model that data-free conversion quantizes. No config names them and inspect never finds
them (core/source.data_free_modules picks them out); they are declared like every family so that
generic code reads, windows and specs them through the registry, never by comparing a family's name."""

from ..core.layout import UNQUANTIZED
from ..core.registry import Family, register

register(Family(UNQUANTIZED, "unquantized", frozenset(), lambda method, qc: False, lambda tensors, qc: [],
                lambda m, tensors, qc: None, "unquantized.codec", needs_config=False, rows=1, source_spec="spec",
                quantized=False))
