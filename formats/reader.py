"""Decode a component's quantized modules into QuantTensors, one module at a time (callers ask for
the module they are about to write, so only one is decoded at once)."""

from __future__ import annotations

from . import bnb_codec, gptq_codec
from .checkpoint import Component
from .detect import Detection
from .ir import QuantTensor
from .layout import QuantModule

FLOAT_NAMES = ("float16", "bfloat16", "float32")


def model_dtype(comp: Component, det: Detection) -> str:
    """The dtype the weights had before quantization: config dtype, else bitsandbytes' quant_state
    dtype, else float16."""
    cfg = comp.config or {}
    for key in ("dtype", "torch_dtype"):
        value = str(cfg.get(key, "")).replace("torch.", "")
        if value in FLOAT_NAMES:
            return value
    for m in det.modules:
        if m.family == "bnb4" and m.details.get("dtype") in FLOAT_NAMES:
            return m.details["dtype"]
    return "float16"


def read_module(comp: Component, det: Detection, m: QuantModule, dtype: str, *,
                contiguous: bool = True) -> QuantTensor:
    """contiguous=False: codes may be a transposed view (GPTQ), for consumers that slice and
    transpose on their own device."""
    if m.family == "bnb8":
        return bnb_codec.read_int8(m, comp.tensors, dtype)
    if m.family == "bnb4":
        return bnb_codec.read_4bit(m, comp.tensors)
    return gptq_codec.read(m, comp.tensors, det.qc, dtype, contiguous=contiguous)
