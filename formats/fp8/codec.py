"""FP8 (e4m3) tensor data -> QuantTensor: transformers' fine-grained FP8 (header.py beside it), and the
e4m3 reader every FP8 dialect shares (compressed-tensors float-quantized, ModelOpt FP8): one e4m3 weight
[out, in], one scale per block of block_rows x group_size (a partial last block where a dimension is
not a multiple), per row (block_rows 1) or per tensor (block_rows 0)."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable
from ..core.ir import QuantSpec, QuantTensor
from ..core.layout import QuantModule
from ..core.minifloat import E4M3_BOOK, E4M3_MAX
from ..storage.safetensors_header import TensorInfo
from ..storage.tensor_io import read_array, to_float32
from .header import DEFAULT_BLOCK, check


def _any_nan(codes: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether any e4m3 code is NaN (0x7F / 0xFF), a cache-sized chunk at a time (a whole-tensor mask of
    a 132 M-code module costs more in page faults than the test itself)."""
    flat = codes.reshape(-1)
    return any(bool(((flat[i:i + chunk] & 0x7F) == 0x7F).any()) for i in range(0, flat.size, chunk))


def read_e4m3(weight: TensorInfo, scale: TensorInfo, block_rows: int, group_size: int, dtype: str,
              rows: tuple[int, int] | None = None, *, expert_rows: int = 0, expert: int | None = None,
              row_offset: int = 0) -> QuantTensor:
    """The e4m3 weight (rows r0:r1 of it, any rows) and its scales, expanded to one row of block scales
    per output row: scales [rows, ceil(in / group_size)] (group_size -1: one per row), exactly as
    stored. Where the scales live:

    * plain: scale [ceil(out / block_rows), cols] (block_rows 0: one scale for the tensor);
    * fused experts (expert_rows R: the weight is [E, R, in], read as its E * R rows): scale
      [E, ceil(R / block_rows), cols], blocks within each expert;
    * one expert's weight with its scales fused per layer (expert N, its rows from row_offset of the
      fused rows): scale [E, ceil(fused rows / block_rows), cols], slice N.

    Refused: an e4m3 NaN code (0x7F / 0xFF; e4m3 has no infinity), a NaN or infinite scale (an e8m0
    255), a scale tensor whose size does not fit the blocks."""
    if len(weight.shape) == 3:                       # fused experts: the same bytes as [E * R, in]
        weight = replace(weight, shape=(weight.shape[0] * weight.shape[1], weight.shape[2]))
    out, inp = weight.shape
    r0, r1 = rows or (0, out)
    codes = read_array(weight, rows=None if rows is None else (r0, r1))
    if _any_nan(codes):
        nan = (codes & 0x7F) == 0x7F
        o, i = (int(v[0]) for v in np.nonzero(nan))
        raise CorruptCheckpoint(f"holds {int(nan.sum())} e4m3 NaN codes (0x7F / 0xFF), the first at "
                                f"[{r0 + o}, {i}]: no weight decodes from them", file=weight.file,
                                tensor=weight.name)
    cols = 1 if group_size <= 0 else -(-inp // group_size)
    if cols == 0:                                          # no input features: no blocks, nothing to scale
        spec = QuantSpec("e4m3", 8, group_size, True, codebook=E4M3_BOOK, scale_dtype=scale.dtype,
                         block_rows=block_rows)
        return QuantTensor(spec, (r1 - r0, inp), dtype, codes=codes, scales=np.zeros((r1 - r0, 0), np.float32))
    lead = expert_rows > 0 or expert is not None           # the scale has a leading experts dimension
    per_expert = scale.shape[1] if lead and len(scale.shape) == 3 else (1 if lead else None)
    r = np.arange(r0, r1)
    e, local = (r // expert_rows, r % expert_rows) if expert_rows else (expert or 0, r + row_offset)
    within = local // block_rows if block_rows > 0 else np.zeros_like(r)
    index = e * per_expert + within if lead else within
    stored = read_array(scale)
    n_rows = stored.size // cols if cols else 0
    if stored.size != n_rows * cols or (r1 > r0 and int(np.max(index)) >= n_rows):
        raise CorruptCheckpoint(f"holds {stored.size} scales, which do not cover the blocks of "
                                f"{weight.name}; cannot decode it", file=scale.file, tensor=scale.name)
    values = to_float32(stored, scale.dtype).reshape(n_rows, cols)
    used = values[np.unique(index)] if r1 > r0 else values[:0]
    if not np.all(np.isfinite(used)):
        raise CorruptCheckpoint("holds non-finite scales (NaN or infinity, an e8m0 255)", file=scale.file,
                                tensor=scale.name)
    scales = np.ascontiguousarray(values[index], dtype=np.float32)
    spec = QuantSpec("e4m3", 8, group_size, True, codebook=E4M3_BOOK, scale_dtype=scale.dtype,
                     block_rows=block_rows)
    return QuantTensor(spec, (r1 - r0, inp), dtype, codes=codes, scales=scales)


def read(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None, dtype: str,
         rows: tuple[int, int] | None = None) -> QuantTensor:
    """A fine-grained FP8 module (or its output rows r0:r1) as a QuantTensor: float32(e4m3) * scale, the
    product transformers' Fp8Dequantize computes in float32, exactly."""
    check(m, tensors, qc)
    fused = m.details.get("fused_scale")
    if fused:
        name, expert, offset = fused
        scale = tensors[name]
        qt = read_e4m3(tensors[m.weight_tensors[0]], scale, m.details["block_rows"], m.group_size,
                       dtype, rows, expert=expert, row_offset=offset)
    else:
        scale = tensors[m.name + ("_scale_inv" if m.experts else ".weight_scale_inv")]
        qt = read_e4m3(tensors[m.weight_tensors[0]], scale, m.details["block_rows"], m.group_size, dtype, rows,
                       expert_rows=m.out_features // m.experts if m.experts else 0)
    if m.details.get("scale_fmt") == "ue8m0" and scale.dtype != "F8_E8M0":
        mantissa = np.frexp(qt.scales)[0]
        if qt.scales.size and not np.all(mantissa == 0.5):
            value = float(qt.scales[mantissa != 0.5][0])
            raise CorruptCheckpoint(f"the config's scale_fmt is ue8m0 (powers of two), but this {scale.dtype} "
                                    f"scale holds {value:.6g}, which is none: DeepGEMM's UE8M0 kernels would "
                                    f"round it, so no one decoding holds", file=scale.file, tensor=scale.name)
    return qt


# ---------------------------------------------------------------------------------------------
# Writing: the registry target "fp8" (header.writer_leaves / writer_config)

def quantize_e4m3(w: np.ndarray, block_rows: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [out, in], inverse scales float32 [ceil(out/B0), ceil(in/B1)]) of a float32 weight,
    computed as transformers' Fp8Quantize computes them, with the same torch operations (its `448 / amax`
    is torch's reciprocal-then-multiply, which differs from a correctly rounded division in the last
    bit), so the same float model gives the same bytes: per block amax, scale = 448 / amax (1 for an
    all-zero block), inverse = 1 / scale, codes = e4m3(clamp(w * scale, -448, 448)) (torch's cast: round
    to nearest even). A partial last block (a dimension that is not a multiple) takes the amax of what it
    holds, as DeepSeek's own quantizer does; transformers leaves such modules unquantized."""
    import torch

    out, inp = w.shape
    # a block larger than the weight is one block over its rows or columns (the same amax, so the same
    # codes and scales): the padding is sized by the weight, never by the block
    b0, b1 = max(1, min(block_rows, out)), max(1, min(group_size, inp))
    rt, ct = _ceil(out, b0), _ceil(inp, b1)
    padded = torch.zeros((rt * b0, ct * b1), dtype=torch.float32)
    padded[:out, :inp] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    blocks = padded.reshape(rt, b0, ct, b1)
    max_abs = blocks.abs().amax(dim=(-3, -1))
    safe = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = E4M3_MAX / safe
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inverse = (1.0 / scales).to(torch.float32)
    scaled = torch.clamp(blocks * scales.unsqueeze(-1).unsqueeze(-3), min=-E4M3_MAX, max=E4M3_MAX)
    codes = scaled.reshape(rt * b0, ct * b1)[:out, :inp].contiguous().to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).numpy(), inverse.numpy()


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _tensor(codes: np.ndarray, inverse: np.ndarray, spec: QuantSpec, dtype: str) -> QuantTensor:
    rows = np.arange(codes.shape[0]) // spec.block_rows
    return QuantTensor(spec, codes.shape, dtype, codes=codes, scales=np.ascontiguousarray(inverse[rows]))


def fit(m: QuantModule, src, request, negotiate) -> tuple[QuantSpec, str | None]:
    """The fp8 target's spec: e4m3 codes in blocks of --block-size (default: the source's 2-D block
    where it has one, else 128 x 128), float32 inverse scales. Codes are kept where the source is e4m3
    in the same blocks (fine-grained FP8, compressed-tensors FP8_BLOCK); everything else is quantized
    from its exact weights. --bits / --group-size / --sym are integer settings: refused (Target.options)."""
    same_kind = src.scheme == "e4m3" and src.block_rows > 0 and src.group_size > 0
    block = request.block_size or ((src.block_rows, src.group_size) if same_kind else DEFAULT_BLOCK)
    spec = QuantSpec("e4m3", 8, block[1], True, codebook=E4M3_BOOK, scale_dtype="F32", block_rows=block[0])
    if src.scheme == "float":
        return spec, src.requantized(" to e4m3")
    if src.scheme != "e4m3":
        return spec, f"{src.name} codes become e4m3"
    if (src.block_rows, src.group_size) != tuple(block):
        was = "per tensor" if src.block_rows == 0 else ("per channel" if src.block_rows == 1 and src.group_size <= 0
                                                          else f"{src.block_rows} x {src.group_size} blocks")
        return spec, f"e4m3 {was} become {block[0]} x {block[1]} blocks"
    return spec, None


def retarget(qt: QuantTensor, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, None]:
    """Kept e4m3 codes and block scales, widened to float32 (exact from F16 / BF16 / E8M0: nothing
    rounds)."""
    return replace(qt, spec=spec), None


def requantize(source, w: np.ndarray, spec: QuantSpec, settings: Mapping) -> tuple[QuantTensor, QuantTensor]:
    """A module quantized to e4m3 blocks from its exact weights, as transformers quantizes (there is no
    search to beat round-to-nearest here: the report's two columns are the same)."""
    codes, inverse = quantize_e4m3(w, spec.block_rows, spec.group_size)
    qt = _tensor(codes, inverse, spec, source.dtype)
    return qt, qt


def encode_for(target: str, qt: QuantTensor, spec: QuantSpec, g_idx: bool) -> dict[str, tuple[str, np.ndarray]]:
    """weight (e4m3 bytes) and weight_scale_inv (one float32 per block: the first row's of each block
    of rows, which every row of the block shares)."""
    out = qt.codes.shape[0]
    blocks = qt.scales[:: spec.block_rows]
    if not np.array_equal(blocks[np.arange(out) // spec.block_rows], qt.scales):
        raise NotStorable(f"rows of one {spec.block_rows}-row block hold different scales")
    return {"weight": ("F8_E4M3", np.ascontiguousarray(qt.codes, dtype=np.uint8)),
            "weight_scale_inv": ("F32", np.ascontiguousarray(blocks, dtype=np.float32))}
