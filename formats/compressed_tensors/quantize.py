"""llm-compressor's quantizers, with the same torch operations in the same dtypes as its oneshot
(memoryless_minmax observer, compressed-tensors 0.19 calculate_qparams and compressors), so that the same
float model gives the same bytes: FP8 per channel or block (quantize_fp8), NVFP4 under a global scale
(global_scale, quantize_nvfp4) and MXFP4 (quantize_mxfp4). codec.py's target hooks call them; torch is
imported on a quantizer's first call.
"""

from __future__ import annotations

import numpy as np

from ..core.layout import NVFP4_GROUP
from ..core.minifloat import E4M3_MAX
from .float_writer import MXFP4_GROUP

E2M1_MAX = 6.0
_TORCH_DTYPES = ("float16", "bfloat16")


def quantize_fp8(w: np.ndarray, dtype: str, block_rows: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [out, in], scales float32 [out, 1] or [ceil(out/B0), ceil(in/B1)]) of a weight, as
    llm-compressor's oneshot with the FP8_DYNAMIC / FP8_BLOCK presets computes them (its
    memoryless_minmax observer, compressed-tensors' calculate_qparams and the float-quantized compressor,
    compressed-tensors 0.19), with the same torch operations in the same dtypes, so the same float model
    gives the same bytes:

    * the weight in the model dtype (``dtype``; a quantized source's exact weights rounded to it, which
      is the model llm-compressor would load); blocks: padded with zeros to whole blocks (which do not
      change a block's range: min and max are taken with 0);
    * per channel / block: min(amin, 0) and max(amax, 0), scale = max(|min|, |max|) / (896 / 2) in the
      model dtype (calculate_range's float32 -448..448, its span cast to the model dtype), a zero scale
      replaced by the model dtype's eps;
    * codes = e4m3(clamp(x / scale + 0, -448, 448)): the division in the model dtype (a float32 division
      differs in thousands of codes of the fixtures), the zero point (force-initialised zeros) added as
      compressed-tensors adds it, torch's cast rounding to nearest even."""
    import torch

    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    x = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(tdtype)
    out, inp = x.shape
    q_min, q_max = torch.tensor(-E4M3_MAX), torch.tensor(E4M3_MAX)    # calculate_range: float32 0-dim
    block = group_size > 0
    if block:
        b0, b1 = max(1, min(block_rows, out)), max(1, min(group_size, inp))   # a block larger than the
        rt, ct = -(-out // b0), -(-inp // b1)          # weight: one block over it, padding sized by the weight
        x = torch.nn.functional.pad(x, (0, ct * b1 - inp, 0, rt * b0 - out), mode="constant", value=0)
        x = x.reshape(rt, b0, ct, b1).transpose(1, 2)                   # [rt, ct, b0, b1]
        lo, hi = x.amin(dim=(-2, -1)), x.amax(dim=(-2, -1))
    elif inp == 0:                                                     # no inputs: a range of [0, 0]
        lo = hi = torch.zeros((out, 1), dtype=tdtype)
    else:
        lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    lo = torch.min(lo, torch.zeros_like(lo))
    hi = torch.max(hi, torch.zeros_like(hi))
    amax = torch.max(torch.abs(lo), torch.abs(hi))
    scale = amax / ((q_max - q_min).to(amax.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype), scale)
    s = scale.unsqueeze(-1).unsqueeze(-1) if block else scale
    scaled = x / s
    scaled.add_(0.0)                             # + zero point: -0 + 0 = +0 (a tiny negative stays one: e4m3 -0)
    scaled.clamp_(-E4M3_MAX, E4M3_MAX)           # clamp(x, q_min, q_max): +-448 are bfloat16 / float16 values
    codes = scaled.to(torch.float8_e4m3fn)
    if block:
        codes = codes.transpose(1, 2).reshape(rt * b0, ct * b1)[:out, :inp]
    return codes.contiguous().view(torch.uint8).numpy(), scale.to(torch.float32).numpy().astype(np.float32, copy=False)


def global_scale(absmax: float, dtype: str) -> float:
    """compressed-tensors' generate_gparam: 448 * 6 / absmax in the model dtype (the observer's
    statistics are in it), absmax at least the dtype's smallest normal, NaN and inf replaced by 1, then
    float32."""
    import torch

    tdtype = getattr(torch, dtype) if dtype in _TORCH_DTYPES else torch.float32
    a = torch.clamp(torch.tensor([absmax], dtype=tdtype), min=torch.finfo(tdtype).tiny)
    g = torch.nan_to_num(E4M3_MAX * E2M1_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)
    return float(g.to(torch.float32)[0])


def _groups(w: np.ndarray, dtype: str, group: int):
    """The weight in the model dtype (a torch tensor [out, in]), the same in groups of ``group`` along each
    row ([out, in/group, group]), and each group's absolute maximum as the memoryless_minmax observer takes
    it, in the model dtype: max(|min(lo, 0)|, max(hi, 0))."""
    import torch

    tdtype = getattr(torch, dtype) if dtype in _TORCH_DTYPES else torch.float32
    x = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(tdtype)
    out, inp = x.shape
    xg = x.reshape(out, inp // group, group)
    zero = torch.zeros(1, dtype=tdtype)
    lo, hi = torch.min(xg.amin(-1), zero), torch.max(xg.amax(-1), zero)
    return x, xg, torch.max(lo.abs(), hi.abs())


def quantize_nvfp4(w: np.ndarray, dtype: str, g: float) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [out, in] e2m1 nibbles, group scales float32 [out, in/16] e4m3 values) of a weight
    under global scale g, as llm-compressor's NVFP4 oneshot computes them (memoryless_minmax observer,
    compressed-tensors 0.19 calculate_qparams and the nvfp4 compressor), with the same torch operations:

    * per group of 16 in the model dtype: amax = max(|min(lo, 0)|, max(hi, 0)), amax / 6 in the model
      dtype, times g in float32, clamped to +-448 and rounded to e4m3 (a zero scale becomes 0.125);
    * codes: x / (scale / g) in float32, plus the zero point (so -0.0 becomes +0.0), clamped to +-6 and
      rounded to e2m1 by cast_to_fp4's intervals (ties to even), the sign kept for a value rounded to 0."""
    import torch

    x, xg, amax = _groups(w, dtype, NVFP4_GROUP)
    tdtype, (out, inp) = x.dtype, x.shape
    q_min, q_max = torch.tensor(-E2M1_MAX), torch.tensor(E2M1_MAX)
    scale = amax / ((q_max - q_min).to(tdtype) / 2)
    gs = torch.tensor([g], dtype=torch.float32)
    scale = gs * scale
    fi = torch.finfo(torch.float8_e4m3fn)
    scale = torch.clamp(scale, fi.min, fi.max).to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.tensor(0.125, dtype=torch.float32), scale)
    scaled = xg / (scale / gs).unsqueeze(-1)
    scaled += torch.zeros((), dtype=tdtype)
    return _e2m1_codes(scaled.reshape(out, inp)), scale.numpy()


def _e2m1_codes(scaled) -> np.ndarray:
    """e2m1 nibbles (sign in bit 3) of values already divided by their scale, as compressed-tensors
    rounds them: clamped to +-6, then cast_to_fp4's intervals (ties to even), the sign kept for a value
    rounded to 0."""
    import torch

    t = torch.clamp(scaled, -E2M1_MAX, E2M1_MAX)
    sign = torch.sign(t)
    t = torch.abs(t)
    rounded = torch.zeros_like(t)
    for lo_, hi_, value, closed in ((0.25, 0.75, 0.5, False), (0.75, 1.25, 1.0, True), (1.25, 1.75, 1.5, False),
                                    (1.75, 2.5, 2.0, True), (2.5, 3.5, 3.0, False), (3.5, 5.0, 4.0, True)):
        inside = (t >= lo_) & (t <= hi_) if closed else (t > lo_) & (t < hi_)
        rounded[inside] = value
    rounded[t > 5.0] = 6.0
    q = rounded * sign
    codes = torch.zeros(q.shape, dtype=torch.uint8)
    magnitude = (q * 2).to(torch.int8).abs()
    for i, v in enumerate((0, 1, 2, 3, 4, 6, 8, 12)):
        codes[magnitude == v] = i
    codes |= torch.signbit(q).to(torch.uint8) << 3
    return codes.numpy()


def _round_to_power_2(x):
    """compressed-tensors' round_to_power_2 (mxfp_utils.py) on a float16 / bfloat16 / float32 tensor: add
    half of the significand's second bit and keep sign and exponent (a power of two, rounded up from a
    significand of 1.75 on)."""
    import torch

    mantissa = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}[x.dtype]
    exponent = {torch.float16: 5, torch.bfloat16: 8, torch.float32: 8}[x.dtype]
    bits = x.view(torch.int16 if x.dtype != torch.float32 else torch.int32).to(torch.int32)
    if x.dtype != torch.float32:
        bits = bits & 0xFFFF
    mask = ((1 << (exponent + 1)) - 1) << mantissa
    out = torch.bitwise_and(bits + (1 << (mantissa - 2)), mask)
    return out.view(torch.float32) if x.dtype == torch.float32 else out.to(torch.uint16).view(x.dtype)


def quantize_mxfp4(w: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [out, in] e2m1 nibbles, e8m0 exponents uint8 [out, in/32]) of a weight, as
    llm-compressor's MXFP4A16 oneshot computes them (memoryless_minmax observer, compressed-tensors 0.19
    calculate_qparams, generate_mx_scales and the mxfp4 compressor), with the same torch operations, in
    the model dtype:

    * per group of 32: amax = max(|min(lo, 0)|, max(hi, 0)); e = 127 + floor(log2(round_to_power_2(amax)))
      - 2, clamped to 0..255 and rounded; scale = 2^(e - 127) in the model dtype, 1 (uint8's eps) where
      that is 0 (float16 holds no power of two under 2^-24: an all-zero group gets 1 there, 2^-127 in
      bfloat16 and float32);
    * codes: x / scale in the model dtype, plus the zero point (-0.0 becomes +0.0), rounded to e2m1 as
      NVFP4's; stored exponents 127 + floor(log2(scale))."""
    import torch

    x, xg, amax = _groups(w, dtype, MXFP4_GROUP)
    tdtype, (out, inp) = x.dtype, x.shape
    e = 127 + torch.floor(torch.log2(_round_to_power_2(amax))) - 2
    e = torch.round(torch.clamp(e, 0, 255)).to(torch.uint8).to(tdtype)
    scale = (2.00 ** ((e.to(torch.int32) - 127).to(torch.float))).to(tdtype)
    scale = torch.where(scale == 0, torch.tensor(1, dtype=tdtype), scale)
    scaled = xg / scale.unsqueeze(-1)
    scaled += torch.zeros((), dtype=tdtype)
    stored = (127 + torch.floor(torch.log2(scale)).to(torch.int32)).to(torch.uint8)
    return _e2m1_codes(scaled.reshape(out, inp)), stored.numpy()
