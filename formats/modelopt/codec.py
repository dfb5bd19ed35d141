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

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule, fused_group
from ..core.minifloat import E2M1_BOOK, E4M3, E4M3_NAN, e4m3_bytes
from ..core.packing import unpack_nibbles_low_first
from ..fp8.codec import read_e4m3
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import read_array
from .header import NVFP4_GROUP, NVFP4_TARGET, check, nvfp4_leaves

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
    e4m3 NaN code in weight_scale (0x7F / 0xFF), a NaN, infinite or non-positive weight_scale_2; group
    scales times it beyond float32 (reader.read_module)."""
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
    if not global_scale > 0:
        raise CorruptCheckpoint(f"holds {float(global_scale)}, but ModelOpt's weight_scale_2 is absmax / (6 x 448), "
                                f"positive; cannot decode it", file=scale_2.file, tensor=scale_2.name)
    with np.errstate(over="ignore"):                # an overflow is refused by reader.read_module
        scales = group_scales * global_scale        # float32 * float32: ModelOpt's per-group scale
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


# ---------------------------------------------------------------------------------------------
# Target modelopt-nvfp4: ModelOpt's NVFP4 (W4A4), written only where codes, scales and the calibrated
# activation scale can all be kept
#
# ModelOpt NVFP4 quantizes activations too, with a static per-tensor input_scale calibrated on data:
# vLLM's ModelOptNvFp4LinearMethod registers ``input_scale`` for every NVFP4 Linear and forms the kernel's
# activation global scale from it (process_weights_after_loading: input_global_scale =
# input_scale.max(), alpha = input_global_scale * weight_global_scale, input_global_scale_inv =
# 1 / input_global_scale; vllm-project/vllm vllm/model_executor/layers/quantization/modelopt.py at
# 00155cdecca722d98e34234c3d172725b7720b7d). A checkpoint without it would run on an uninitialised
# parameter. No data-free conversion can make that scale, so the only sources are NVFP4 checkpoints that
# carry one: ModelOpt's own (input_scale) and compressed-tensors W4A4 (input_global_scale, a divisor).

_WEIGHT_GLOBAL = {"modelopt": "weight_scale_2", "ct": "weight_global_scale"}
_OTHER_TARGET = "compressed-tensors-nvfp4"


def _nvfp4_spec() -> QuantSpec:
    return QuantSpec("e2m1", 4, NVFP4_GROUP, True, codebook=MODELOPT_E2M1_BOOK, scale_dtype="F8_E4M3",
                     global_scale="multiplier")


def fit_nvfp4(m: QuantModule, src, request, negotiate) -> tuple[QuantSpec, str | None]:
    """The spec of a module in modelopt-nvfp4: e2m1 codes in groups of 16 along each row, an e4m3 scale
    per group, a float32 global multiplier per module. Codes are kept from NVFP4 sources (either
    dialect); for any other source the reason is returned and plan_nvfp4 refuses it, naming the file
    (no path requantizes into this target: it would need a calibrated input_scale). Every option is
    ModelOpt's choice: it takes none (Target.options; core/request.Options refuses them)."""
    if src.scheme == "e2m1" and src.global_scale is not None and src.group_size == NVFP4_GROUP:
        return _nvfp4_spec(), None
    if src.scheme == "float":
        return _nvfp4_spec(), f"{src.name} weights are not NVFP4"
    return _nvfp4_spec(), f"{src.name} codes are not NVFP4"


def _source_scalar(tensors: Mapping[str, TensorInfo], name: str, kind: str) -> np.float32:
    """A per-tensor scale of the source as the multiplier ModelOpt stores: kept (a multiplier), or
    float32(1 / divisor) (compressed-tensors). Refused: a multiplier that is not finite and positive."""
    value = _scalar(tensors[name])
    info = tensors[name]
    if kind == "multiplier":
        out = value
    elif value == 0:
        raise CorruptCheckpoint("is 0, a global scale compressed-tensors divides by; cannot decode it",
                                file=info.file, tensor=info.name)
    else:
        with np.errstate(over="ignore"):
            out = np.float32(1) / value
    if not (np.isfinite(out) and out > 0):
        raise CorruptCheckpoint(f"holds {float(value)}, which is no positive finite ModelOpt multiplier "
                                f"({'as stored' if kind == 'multiplier' else '1 / it'}: {float(out)}); cannot "
                                f"convert it", file=info.file, tensor=info.name)
    return out


def plan_nvfp4(ctx) -> dict:
    """{"weight_scale_2", "input_scale"}: the module's two per-tensor multipliers, read from the source
    (ModelOpt: as stored; compressed-tensors: float32(1 / weight_global_scale) and float32(1 /
    input_global_scale)). A source whose codes are not NVFP4, or that stores no static activation scale
    (float models, NVFP4A16, integer formats, FP8), is refused here, before anything is written."""
    from ..core.registry import family

    m, tensors = ctx.module, ctx.tensors
    weight = tensors[m.weight_tensors[0]]
    act = ctx.activation if ctx.activation is not None and ctx.activation.scheme == "nvfp4" else None
    if ctx.reason or act is None or m.family not in _WEIGHT_GLOBAL:
        method = family(m.family).method
        what = (f"an unquantized {m.scheme} model" if not family(m.family).quantized else
                f"{method} {m.scheme}, not NVFP4" if ctx.reason else
                f"{method} NVFP4 with no static activation scale (weights only: no input scale)")
        raise UnsupportedFormat(f"is {what}: {NVFP4_TARGET} is ModelOpt's W4A4 NVFP4, whose loaders (vLLM's "
                                f"ModelOptNvFp4LinearMethod) quantize activations with a calibrated static "
                                f"input_scale, which a data-free conversion cannot make; use --to {_OTHER_TARGET} "
                                f"(NVFP4A16, weights only)", file=weight.file)
    kind = m.details.get("global_scale", "multiplier")          # layout.QuantModule: the two-level convention
    return {"weight_scale_2": float(_source_scalar(tensors, f"{m.name}.{_WEIGHT_GLOBAL[m.family]}", kind)),
            "input_scale": float(act.as_kind("multiplier"))}


def share_nvfp4(settings: Mapping[str, dict]) -> dict[str, dict]:
    """The modules vLLM fuses (q/k/v, gate/up, ...: layout.fused_group) hold one weight_scale_2 and one
    input_scale, as ModelOpt exports them. input_scale: the group's largest, which is what vLLM computes
    for the fused layer anyway (input_scale.max()), so no run changes. weight_scale_2 is what the kept
    codes decode with: members that differ are refused (ValueError), since one shared scale would mean
    new codes for kept ones (vLLM would otherwise apply the largest to all of them, misreading the
    others), and neither ModelOpt nor llm-compressor (update_fused_layer_weight_global_scales) writes
    such a group."""
    groups: dict[str, list[str]] = {}
    for name in settings:
        groups.setdefault(fused_group(name), []).append(name)
    out = {name: dict(s) for name, s in settings.items()}
    for members in groups.values():
        if len(members) < 2:
            continue
        scales = {settings[n]["weight_scale_2"] for n in members}
        if len(scales) > 1:
            listed = ", ".join(f"{n} {np.float32(settings[n]['weight_scale_2'])!s}" for n in members)
            raise NotStorable(f"the fused modules {listed} have different weight global scales (as weight_scale_2); "
                             f"ModelOpt NVFP4 holds one for them (vLLM applies one to the fused layer) and their "
                             f"kept codes decode only under their own; --to {_OTHER_TARGET} keeps them as they are")
        joint = max(settings[n]["input_scale"] for n in members)
        for n in members:
            out[n]["input_scale"] = joint
    return out


def retarget_nvfp4(qt: QuantTensor, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, np.ndarray | None]:
    """Kept NVFP4 codes and e4m3 group scales under the module's weight_scale_2 (plan_nvfp4), with its
    input_scale. The effective scales are ModelOpt's float32(weight_scale) * weight_scale_2; where they
    differ from the source's (compressed-tensors: float32(weight_scale) / global, against e4m3 *
    float32(1 / global)), the source's are returned as exact, for the report (None: nothing rounds)."""
    s2 = np.float32(settings["weight_scale_2"])
    group_scales = np.asarray(qt.group_scales, dtype=np.float32)
    kept = QuantTensor(spec, qt.shape, qt.dtype, codes=np.asarray(qt.codes), scales=group_scales * s2,
                       group_scales=group_scales, global_scale=s2, input_scale=np.float32(settings["input_scale"]))
    exact = np.asarray(qt.scales, dtype=np.float32)
    return kept, (None if np.array_equal(kept.scales, exact) else exact)


def encode_nvfp4(qt: QuantTensor, spec: QuantSpec) -> dict[str, tuple[str, np.ndarray]]:
    """weight (two e2m1 codes a byte, the even element in the low nibble), weight_scale (e4m3 bytes),
    weight_scale_2 and input_scale (float32, shape []): what header.nvfp4_leaves predicts."""
    codes = np.ascontiguousarray(qt.codes, dtype=np.uint8)
    if codes.size and int(codes.max()) > 0xF:
        raise NotStorable("e2m1 codes do not fit in 4 bits")
    if qt.input_scale is None:
        raise NotStorable("no input_scale to store")
    res = {"weight": ("U8", np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))),
           "weight_scale": ("F8_E4M3", e4m3_bytes(qt.group_scales)),
           "weight_scale_2": ("F32", np.array(qt.global_scale, dtype=np.float32)),
           "input_scale": ("F32", np.array(qt.input_scale, dtype=np.float32))}
    planned = nvfp4_leaves(spec, qt.shape)
    stored = {leaf: (d, tuple(a.shape)) for leaf, (d, a) in res.items()}
    if stored != planned:
        raise NotStorable(f"stores {stored}, but {planned} were planned")
    return res


def encode_for(target: str, qt: QuantTensor, spec: QuantSpec, g_idx: bool) -> dict:
    """The registry's encoder of the ModelOpt targets."""
    if target != NVFP4_TARGET:
        raise NotStorable(f"no ModelOpt encoder for {target!r}")
    return encode_nvfp4(qt, spec)
