"""What compressed-tensors' floating-point targets write (stdlib, predicted before any data): the leaves
and llm-compressor's quantization_config of float-quantized FP8 (compressed-tensors-fp8), NVFP4A16 / NVFP4
(compressed-tensors-nvfp4) and MXFP4A16 (compressed-tensors-mxfp4), the registry's writer hooks of those
targets (codec.py decides and computes the data).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from ...errors import NotStorable
from ..core.layout import NVFP4_GROUP, check_nvfp4_shape, natural_key
from .config import FLOAT, LAYOUT_VERSION, MXFP4, NVFP4, QUANT_METHOD, _SCALE_DTYPES
from .writer import _ignorable

if TYPE_CHECKING:                    # numpy-backed; only read by attribute here
    from ..core.ir import QuantSpec


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks of target compressed-tensors-fp8: llm-compressor's float-quantized FP8
# (codec.fit_fp8 / plan_fp8 / requantize_fp8 / retarget_fp8 decide and compute the data)

FP8_TARGET = "compressed-tensors-fp8"


def float_leaves(spec: "QuantSpec", shape: tuple[int, int], g_idx: bool = False, *,
                 scale_dtype: str | None = None, input_scale: float | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode_fp8 stores for an e4m3 module (stdlib, predicted before any data): the e4m3
    ``weight`` [out, in] and ``weight_scale`` in ``scale_dtype`` (the plan's: the model dtype, as
    llm-compressor stores it, or float32 where kept scales would round): strategy "tensor" [1]
    (block_rows 0), "channel" [out, 1] (block_rows 1, one group per row), "block" [ceil(out/B0),
    ceil(in/B1)] (block_rows B0, group B1; last blocks partial); with a static activation scale (the
    plan's ``input_scale``, a multiplier) ``input_scale`` [1], in the scale dtype where it holds the
    value exactly, else float32 (input_scale_dtype)."""
    out, inp = shape
    sdt = scale_dtype or spec.scale_dtype
    if spec.scheme != "e4m3" or spec.block_rows < 0 or (spec.group_size <= 0 and spec.block_rows > 1) \
            or (spec.group_size > 0 and spec.block_rows < 1):
        raise NotStorable(f"compressed-tensors float-quantized stores e4m3 codes per tensor, per channel or in 2-D "
                         f"blocks, not {spec.name} in blocks of {spec.block_rows} x {spec.group_size}")
    if g_idx:
        raise NotStorable("compressed-tensors float-quantized stores no g_idx")
    if sdt not in _SCALE_DTYPES:
        raise NotStorable(f"scale dtype {sdt!r}: compressed-tensors scales are {', '.join(_SCALE_DTYPES)}")
    scales = ((1,) if spec.block_rows == 0 else (out, 1) if spec.group_size <= 0
              else (-(-out // spec.block_rows), -(-inp // spec.group_size)))
    leaves = {"weight": ("F8_E4M3", (out, inp)), "weight_scale": (sdt, scales)}
    if input_scale is not None:
        leaves["input_scale"] = (input_scale_dtype(input_scale, sdt), (1,))
    return leaves


def input_scale_dtype(value: float, scale_dtype: str) -> str:
    """A static activation scale's dtype: the weight scales' (llm-compressor stores both in the model
    dtype) where that holds the value exactly, else float32 (compressed-tensors and vLLM read either)."""
    f32 = struct.unpack("<f", struct.pack("<f", value))[0]
    if scale_dtype == "F16":
        try:
            exact = struct.unpack("<e", struct.pack("<e", f32))[0] == f32
        except OverflowError:
            exact = False
    elif scale_dtype == "BF16":                       # the float32's low 16 bits are zero
        exact = struct.unpack("<I", struct.pack("<f", f32))[0] & 0xFFFF == 0
    else:
        return "F32"
    return scale_dtype if exact else "F32"


def _float_weights(spec: "QuantSpec") -> dict:
    """The ``weights`` QuantizationArgs of llm-compressor's FP8_DYNAMIC (channel) / FP8_BLOCK presets.
    ``observer`` is null, as qconv's integer writers write it: nothing reads it from a compressed
    checkpoint, and kept codes were not made by llm-compressor's observer."""
    block = spec.group_size > 0
    return {"actorder": None, "block_structure": [int(spec.block_rows), int(spec.group_size)] if block else None,
            "dynamic": False, "group_size": None, "num_bits": 8, "observer": None, "observer_kwargs": {},
            "scale_dtype": None, "strategy": "block" if block else "tensor" if spec.block_rows == 0 else "channel",
            "symmetric": True,
            "type": "float", "zp_dtype": None}


def _float_activations(spec: "QuantSpec", static: bool = False) -> dict:
    """The presets' input activations: quantized to e4m3 at run time (nothing stored), FP8_DYNAMIC per
    token, FP8_BLOCK per group of 128 inputs (here the weights' column block, 128 in the preset); or
    ``static``, the FP8 preset's: one calibrated scale per tensor (the module's ``input_scale``)."""
    block = spec.group_size > 0
    return {"actorder": None, "block_structure": None, "dynamic": not static,
            "group_size": int(spec.group_size) if block and not static else None, "num_bits": 8, "observer": None,
            "observer_kwargs": {}, "scale_dtype": None,
            "strategy": "tensor" if static else "group" if block else "token",
            "symmetric": True, "type": "float", "zp_dtype": None}


def float_config(ctx) -> dict:
    """The quantization_config llm-compressor writes for FP8_DYNAMIC / FP8_BLOCK: one float-quantized
    group targeting the class "Linear" (one group per structure, targeting exact names, where modules
    differ), ``ignore`` the Linears left in float by exact name, in the order transformers lists modules
    (the decoder's first, top-level heads such as lm_head last)."""
    by_structure: dict[tuple, list[str]] = {}
    for name in sorted(ctx.specs, key=natural_key):
        spec = ctx.specs[name]
        if spec.scheme != "e4m3":
            raise NotStorable(f"{name}: compressed-tensors-fp8 stores e4m3 codes, not {spec.name}")
        static = ctx.settings.get(name, {}).get("input_scale") is not None
        key = (int(spec.block_rows), int(spec.group_size) if spec.group_size > 0 else -1, static)
        by_structure.setdefault(key, []).append(name)
    groups = {}
    for i, ((_, _, static), names) in enumerate(by_structure.items()):
        spec = ctx.specs[names[0]]
        groups[f"group_{i}"] = {"format": FLOAT, "input_activations": _float_activations(spec, static),
                                "output_activations": None,
                                "targets": ["Linear"] if len(by_structure) == 1 else list(names),
                                "weights": _float_weights(spec)}
    ignore = sorted((n for n in ctx.unquantized if _ignorable(n)), key=lambda n: ("." not in n, natural_key(n)))
    return {"config_groups": groups, "format": FLOAT, "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": None, "quant_method": QUANT_METHOD, "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": LAYOUT_VERSION}


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks of target compressed-tensors-nvfp4: llm-compressor's NVFP4A16
# (codec.fit_nvfp4 / plan_nvfp4 / share_nvfp4 / requantize_nvfp4 / retarget_nvfp4 compute the data)

NVFP4_TARGET = "compressed-tensors-nvfp4"
# fused_group / FUSED_LAYER_NAMES (core/layout.py): the modules sharing one NVFP4 global scale.


def nvfp4_leaves(spec: "QuantSpec", shape: tuple[int, int], g_idx: bool = False, *,
                 input_global_scale: float | None = None, **settings) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode_nvfp4 stores (stdlib, before any data): e2m1 codes two a byte
    ``weight_packed`` U8 [out, in/2], e4m3 ``weight_scale`` [out, in/16], ``weight_global_scale`` F32 [1];
    where the plan carries a static activation scale (W4A4), ``input_global_scale`` F32 [1]."""
    check_nvfp4_shape(spec, shape, g_idx, "compressed-tensors", "divisor")
    out, inp = shape
    leaves = {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("F8_E4M3", (out, inp // NVFP4_GROUP)),
              "weight_global_scale": ("F32", (1,))}
    if input_global_scale is not None:
        leaves["input_global_scale"] = ("F32", (1,))
    return leaves


def nvfp4_config(ctx) -> dict:
    """The quantization_config llm-compressor writes for NVFP4A16 (one nvfp4-pack-quantized group
    targeting the class "Linear": e2m1, tensor_group of 16, e4m3 scales, weights only), or for NVFP4
    (W4A4) where every module carries a static activation scale (input_activations e2m1 in groups of 16,
    dynamic "local": group scales at run time under the stored input_global_scale); modules that differ
    in this are two groups targeting their names. ``ignore`` the Linears left in float by exact name.
    ``observer`` is null, as qconv's other writers write it."""
    return _fp4_config(ctx, NVFP4_TARGET, NVFP4, "tensor_group", NVFP4_GROUP, "torch.float8_e4m3fn",
                       static=lambda name: ctx.settings.get(name, {}).get("input_global_scale") is not None)


def _fp4_config(ctx, target: str, fmt: str, strategy: str, group_size: int, scale_dtype: str,
                static=lambda name: False) -> dict:
    for name, spec in ctx.specs.items():
        if spec.scheme != "e2m1":
            raise NotStorable(f"{name}: {target} stores e2m1 codes, not {spec.name}")
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group_size,
               "num_bits": 4, "observer": None, "observer_kwargs": {}, "scale_dtype": scale_dtype,
               "strategy": strategy, "symmetric": True, "type": "float", "zp_dtype": None}
    w4a4 = {**weights, "dynamic": "local"}
    by_static: dict[bool, list[str]] = {}
    for name in sorted(ctx.specs, key=natural_key):
        by_static.setdefault(bool(static(name)), []).append(name)
    groups = {}
    for i, (carried, names) in enumerate(sorted(by_static.items(), key=lambda kv: not kv[0]) or [(False, [])]):
        groups[f"group_{i}"] = {"format": fmt, "input_activations": w4a4 if carried else None,
                                "output_activations": None,
                                "targets": ["Linear"] if len(by_static) <= 1 else names, "weights": weights}
    ignore = sorted((n for n in ctx.unquantized if _ignorable(n)), key=lambda n: ("." not in n, natural_key(n)))
    return {"config_groups": groups, "format": fmt, "global_compression_ratio": None,
            "ignore": ignore, "kv_cache_scheme": None, "quant_method": QUANT_METHOD,
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": LAYOUT_VERSION}


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks of target compressed-tensors-mxfp4: llm-compressor's MXFP4A16
# (codec.fit_mxfp4 / requantize_mxfp4 / retarget_mxfp4 compute the data)

MXFP4_TARGET = "compressed-tensors-mxfp4"
MXFP4_GROUP = 32


def mxfp4_leaves(spec: "QuantSpec", shape: tuple[int, int], g_idx: bool = False,
                 **settings) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode_mxfp4 stores (stdlib, before any data): e2m1 codes two a byte ``weight_packed``
    U8 [out, in/2] (the even element in the low nibble) and e8m0 exponents ``weight_scale`` U8 [out, in/32]."""
    out, inp = shape
    if spec.scheme != "e2m1" or spec.group_size != MXFP4_GROUP or g_idx:
        raise NotStorable(f"compressed-tensors MXFP4 stores e2m1 codes in groups of {MXFP4_GROUP}, not {spec.name}")
    if inp % MXFP4_GROUP:
        raise NotStorable(f"{inp} input features are not whole groups of {MXFP4_GROUP}")
    return {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("U8", (out, inp // MXFP4_GROUP))}


def mxfp4_config(ctx) -> dict:
    """The quantization_config llm-compressor writes for MXFP4A16: one mxfp4-pack-quantized group
    targeting "Linear" (e2m1, groups of 32, uint8 e8m0 scales), ``ignore`` the Linears left in float."""
    return _fp4_config(ctx, MXFP4_TARGET, MXFP4, "group", MXFP4_GROUP, "torch.uint8")
