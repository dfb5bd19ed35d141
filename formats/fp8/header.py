"""transformers' fine-grained FP8 (``quant_method: "fp8"``: DeepSeek-V3/R1, Qwen3-*-FP8, MiniMax, ...),
described from headers and config. Stdlib only, so `inspect` stays light; the data is codec.py.

Per quantized Linear ``P`` (docs/formats.md, fine-grained FP8)::

    P.weight             F8_E4M3               [out, in]
    P.weight_scale_inv   F32 | BF16 | F16      [ceil(out/B0), ceil(in/B1)]   (F8_E8M0 with scale_fmt ue8m0)
    P.activation_scale   static activations only (activation_scheme "static"; also spelled input_scale)

    w[o, i] = e4m3(q[o, i]) * s[o // B0, i // B1]

Despite its name ``weight_scale_inv`` is a multiplier (amax / 448 of the block). B = the config's
``weight_block_size``, never the shapes divided (transformers' own ``_dequantize_one`` derives it as
rows // scale_rows, which raises on DeepSeek's 576-row kv_a_proj_with_mqa and silently picks a wrong
block elsewhere); a dimension that is not a multiple of the block has a last, partial block. No
``weight_block_size``: one scale per tensor. ``modules_to_not_convert`` (MiniMax: ``ignored_layers``)
names Linears left in float.

MoE experts, as transformers 5 saves them (docs/formats.md, fine-grained FP8):

* per-expert e4m3 weights ``experts.N.{gate,up,down}_proj.weight`` (Mixtral: ``w1``, ``w3``, ``w2``) with
  the scales left FUSED per layer: ``experts.gate_up_proj_scale_inv`` [E, ceil(2I/B0), ceil(H/B1)] over
  the gate and up rows concatenated (gate's row r is fused row r, up's is I + r: a block can straddle
  the two when I is not a multiple of B0) and ``experts.down_proj_scale_inv`` [E, ceil(H/B0), ...];
  details["fused_scale"] = (tensor, expert, row offset);
* fused e4m3 experts (``save_original_format=False``): ``experts.gate_up_proj`` [E, 2I, H] and
  ``experts.down_proj`` [E, H, I] with ``<name>_scale_inv`` [E, ., .], blocks within each expert: one
  module per stored tensor (QuantModule.experts = E), dequantized in the same layout.

An e4m3 tensor no module claims (another fused layout) is refused by every writing verb
(detect.unaccounted_tensors), never copied as if its bytes were floats.
"""

from __future__ import annotations

import math
from typing import Mapping

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from ..core.layout import QuantModule, common, not_converted_by, not_converted_list, refuse_problems
from ..storage.safetensors_header import DTYPES, TensorInfo

WEIGHT_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
ACTIVATION_LEAVES = ("activation_scale", "input_scale")
# per-expert projection -> (fused tensor it belongs to, 0 for the first half of gate_up / down, 1 for up)
EXPERT_PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", 0), "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                      "w2": ("down_proj", 0)}
METHOD = "fp8"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def parse_config(qc: Mapping | None) -> dict:
    """{"block": [B0, B1] | None, "scale_fmt", "activation_scheme", "modules_to_not_convert": [str],
    "unsupported": [str], "problems": [str]} of a ``quant_method: fp8`` config."""
    qc = qc or {}
    unsupported, problems = [], []
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        problems.append(f"weight_block_size is {block!r}, expected two positive integers")
        block = None
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        unsupported.append(f"fmt {fmt!r}: qconv decodes e4m3 FP8 only")
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        unsupported.append(f"scale_fmt {scale_fmt!r} is not float or ue8m0")
    activation = qc.get("activation_scheme", "dynamic")
    if not isinstance(activation, str) or activation.lower() not in ("dynamic", "static"):
        problems.append(f"activation_scheme is {activation!r}, not dynamic or static (transformers and vLLM "
                        f"refuse it)")
        activation = "dynamic"
    activation = activation.lower()
    convert = qc.get("modules_to_convert")
    if convert not in (None, []):
        unsupported.append(f"modules_to_convert is {convert!r}: FP8 embeddings (transformers' FP8Embedding) "
                           f"are not a layout qconv reads")
    skip = qc.get("modules_to_not_convert")
    skip = not_converted_list(qc.get("ignored_layers") if skip is None else skip, problems)
    return {"block": block, "scale_fmt": scale_fmt, "activation_scheme": activation,
            "modules_to_not_convert": skip, "unsupported": unsupported, "problems": problems}


def _fused_scale(tensors: Mapping[str, TensorInfo], prefix: str, out: int):
    """(scale tensor, expert, row offset) of a per-expert weight whose scales transformers left fused
    (``<p>.experts.N.up_proj`` -> ``<p>.experts.gate_up_proj_scale_inv``[N], rows from I), else None."""
    parts = prefix.split(".")
    if len(parts) < 3 or parts[-3] != "experts" or not parts[-2].isdigit() or parts[-1] not in EXPERT_PROJECTIONS:
        return None
    fused, half = EXPERT_PROJECTIONS[parts[-1]]
    scale = tensors.get(".".join(parts[:-2] + [fused + "_scale_inv"]))
    return None if scale is None else (scale, int(parts[-2]), half * out)


def _scale_problems(scale: TensorInfo, cfg: dict, block, rows: int, inp: int, lead: list[int]) -> tuple[list, list]:
    """(unsupported, problems) of a scale tensor for a weight of ``rows`` x ``inp`` per expert."""
    unsupported, problems = [], []
    name = scale.name.rsplit(".", 1)[-1]
    if scale.dtype not in SCALE_DTYPES:
        unsupported.append(f"{name} is {scale.dtype}; fine-grained FP8 stores {', '.join(SCALE_DTYPES)} scales")
    elif scale.dtype == "F8_E8M0" and cfg["scale_fmt"] != "ue8m0":
        problems.append(f"{name} is F8_E8M0 but the config's scale_fmt is not ue8m0")
    shape = list(scale.shape)
    if block:
        want = lead + [_ceil(rows, block[0]), _ceil(inp, block[1])]
        if shape != want:
            problems.append(f"{name} has shape {shape}; weight_block_size {block} over "
                            f"{' x '.join(map(str, lead + [rows, inp]))} weights gives {want}")
    elif math.prod(shape) != max(1, math.prod(lead)) or (lead and shape[:1] != lead):
        problems.append(f"{name} has shape {shape} but the config has no weight_block_size (one scale per "
                        f"tensor{' per expert' if lead else ''})")
    return unsupported, problems


def refuse(qc: Mapping) -> tuple[type, str] | None:
    """The config's own first problem (a weight_block_size that is not two positive integers, a
    modules_to_not_convert that is not a list, an fmt or scale_fmt qconv does not decode), refused
    naming the config file (reader.require_decodable), before any module is looked at."""
    cfg = parse_config(qc)
    if cfg["unsupported"]:
        return UnsupportedFormat, cfg["unsupported"][0]
    if cfg["problems"]:
        return CorruptCheckpoint, cfg["problems"][0]
    return None


def find_modules(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """One QuantModule per e4m3 weight (2-D ``*.weight``, or a fused 3-D experts tensor), from headers
    and the config alone; ``problems`` lists what stops an exact decode (``details["unsupported"]``
    the part qconv does not decode)."""
    cfg = parse_config(qc)
    block = cfg["block"]
    modules = []
    for name, info in tensors.items():
        if info.dtype != WEIGHT_DTYPE:
            continue
        fused_experts = len(info.shape) == 3 and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")
        if not (fused_experts or (name.endswith(".weight") and len(info.shape) == 2)):
            continue
        prefix = name if fused_experts else name[: -len(".weight")]
        experts, rows, inp = info.shape if fused_experts else (0, *info.shape)
        unsupported, problems = list(cfg["unsupported"]), list(cfg["problems"])
        key = not_converted_by(prefix, cfg["modules_to_not_convert"])
        if key is not None:
            problems.append(f"modules_to_not_convert lists {key!r}, but the module is stored as e4m3: loaders "
                            f"build it as a plain Linear and read the codes as weights")
        if cfg["activation_scheme"] == "static" and not fused_experts and not any(f"{prefix}.{a}" in tensors for a in ACTIVATION_LEAVES):
            problems.append(f"the config's activation_scheme is static, but it has no activation scale "
                            f"({' / '.join(ACTIVATION_LEAVES)}), which static activations are scaled by")
        own = tensors.get(prefix + ("_scale_inv" if fused_experts else ".weight_scale_inv"))
        fused = None if own is not None or fused_experts else _fused_scale(tensors, prefix, rows)
        scale = own if own is not None else (fused[0] if fused else None)
        details = {"block": list(block) if block else None, "block_rows": block[0] if block else 0,
                   "scale_fmt": cfg["scale_fmt"], "activation_scheme": cfg["activation_scheme"],
                   "scales_dtype": scale.dtype if scale is not None else None}
        if scale is None:
            problems.append("e4m3 weight without a scale (weight_scale_inv, or its experts' fused "
                            "*_proj_scale_inv)")
        elif fused:
            _, expert, offset = fused
            details["fused_scale"] = (scale.name, expert, offset)
            fused_rows = (2 if scale.name.endswith("gate_up_proj_scale_inv") else 1) * rows
            u, p = _scale_problems(scale, cfg, block, fused_rows, inp, [scale.shape[0]] if scale.shape else [0])
            unsupported += u
            problems += p
            if scale.shape and expert >= scale.shape[0]:
                problems.append(f"expert {expert}, but {scale.name} holds the scales of {scale.shape[0]}")
        else:
            u, p = _scale_problems(scale, cfg, block, rows, inp, [experts] if fused_experts else [])
            unsupported += u
            problems += p
        details["unsupported"] = tuple(unsupported)
        state = tuple(t for t in (scale.name if scale is not None else None,)
                      + tuple(f"{prefix}.{a}" for a in ACTIVATION_LEAVES) if t in tensors)
        modules.append(QuantModule(prefix, "fp8", "e4m3", 8, max(experts, 1) * rows, inp, (name,), state,
                                   group_size=block[1] if block else -1, details=details,
                                   problems=tuple(unsupported + problems), experts=experts))
    return modules


check = refuse_problems      # the first problem find listed, naming the file and the weight


def settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of a fine-grained FP8 checkpoint."""
    cfg = parse_config(qc) if qc else {}
    block = common(tuple(m.details["block"]) if m.details.get("block") else None for m in modules)
    return {"weight_block_size": list(block) if isinstance(block, tuple) else (block or cfg.get("block")),
            "scale_fmt": cfg.get("scale_fmt"), "activation_scheme": cfg.get("activation_scheme"),
            "modules_to_not_convert": cfg.get("modules_to_not_convert"),
            "scales_dtype": common(DTYPES[m.details["scales_dtype"]][1] for m in modules
                                   if m.details.get("scales_dtype") in DTYPES)}


def lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str], comp, warnings: list[str]) -> None:
    """modules_to_not_convert entries that name nothing (vLLM matches them by substring)."""
    for entry in parse_config(qc)["modules_to_not_convert"]:
        if not any(entry in name for name in all_modules):
            warnings.append(f"modules_to_not_convert entry {entry!r} matches no module of this checkpoint")


# ---------------------------------------------------------------------------------------------
# Writing: the registry target "fp8" (transformers' FineGrainedFP8 / DeepSeek layout)

DEFAULT_BLOCK = (128, 128)


def writer_leaves(spec, shape: tuple[int, int], g_idx: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode_for stores (stdlib, predicted before any data): the e4m3 weight and one float32
    weight_scale_inv per block, a last partial block where a dimension is not a multiple (DeepSeek's
    layout; transformers' own CPU loader derives the block from the shapes and cannot read those)."""
    out, inp = shape
    if spec.scheme != "e4m3" or spec.block_rows <= 0 or spec.group_size <= 0:
        raise NotStorable(f"fine-grained FP8 stores e4m3 codes in 2-D blocks, not {spec.name} in blocks of "
                         f"{spec.block_rows} x {spec.group_size}")
    return {"weight": (WEIGHT_DTYPE, (out, inp)),
            "weight_scale_inv": ("F32", (_ceil(out, spec.block_rows), _ceil(inp, spec.group_size)))}


def writer_config(ctx) -> dict:
    """The quantization_config transformers 5 saves for FineGrainedFP8 (every key it writes), the block
    of the (uniform) specs; Linears left in float other than lm_head in modules_to_not_convert (vLLM and
    transformers both read it; transformers keeps lm_head in float by itself)."""
    blocks = sorted({(s.block_rows, s.group_size) for s in ctx.specs.values()})
    if len(blocks) != 1:
        raise NotStorable(f"fine-grained FP8 stores one weight_block_size per checkpoint; these modules have {blocks}")
    skip = sorted(n for n in ctx.unquantized if n.rsplit(".", 1)[-1] not in ("lm_head", "embed_tokens"))
    return {"activation_scheme": "dynamic", "dequantize": False, "expert_dtype": "fp8",
            "modules_to_convert": None, "modules_to_not_convert": skip or None, "quant_method": METHOD,
            "scale_fmt": "float", "weight_block_size": list(blocks[0])}
