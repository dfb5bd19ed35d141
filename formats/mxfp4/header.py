"""gpt-oss's MXFP4 (``quant_method: "mxfp4"``, OpenAI gpt-oss-20b / -120b as published), described from
headers and config. Stdlib only, so `inspect` stays light; the data is codec.py.

Only the MoE experts are quantized, fused per layer (docs/formats.md, MXFP4)::

    <p>.experts.gate_up_proj_blocks   U8 [E, 2I, H/32, 16]   two e2m1 codes a byte, element 2j LOW nibble
    <p>.experts.gate_up_proj_scales   U8 [E, 2I, H/32]       e8m0: 2^(b - 127), one per 32 inputs (255: NaN)
    <p>.experts.down_proj_blocks      U8 [E, H, I/32, 16]
    <p>.experts.down_proj_scales      U8 [E, H, I/32]
    <p>.experts.gate_up_proj_bias     BF16 [E, 2I]           plain tensors, carried as they are
    <p>.experts.down_proj_bias        BF16 [E, H]

    w[e, o, 32 g + k] = e2m1(nibble k of blocks[e, o, g]) * 2^(scales[e, o, g] - 127)

so [..., G, 16 bytes] unpacks to [..., G * 32] and each tensor is [E, out, in], nn.Linear orientation per
expert. One QuantModule per fused tensor (QuantModule.experts = E), named as the tensor without
``_blocks`` (``model.layers.0.mlp.experts.gate_up_proj``): its E experts' rows stacked, dequantized in the
stored layout. gate_up's rows are INTERLEAVED (even rows gate, odd rows up: GptOssExperts._apply_gate reads
``gate_up[..., ::2]`` and ``[..., 1::2]``); the module keeps the stored row order. transformers' own bf16
GptOssExperts hold ``gate_up_proj`` as [E, H, 2I] and ``down_proj`` as [E, I, H] ([E, in, out]: its
``convert_moe_packed_tensors`` transposes after decoding); qconv does not transpose (docs/formats.md).

``modules_to_not_convert`` (gpt-oss: ``model.layers.*.self_attn``, ``model.layers.*.mlp.router``,
``model.embed_tokens``, ``lm_head``; fnmatch wildcards, or a prefix) names what stays in float.

Refused from headers (check): blocks that are not U8 [E, rows, G, 16] (16 bytes per 32 values), a missing
scale tensor or one whose shape is not the blocks' [E, rows, G], a scale dtype other than U8 / F8_E8M0, a
fused expert count that disagrees with the other fused tensors of the layer (with the model config's
``num_local_experts``: reader.require_decodable, for every fused family); from the data (codec.read): an
e8m0 scale of 255.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping

from ...errors import CorruptCheckpoint
from ..core.layout import QuantModule, common, not_converted_list, refuse_problems
from ..storage.safetensors_header import DTYPES, TensorInfo

METHOD = "mxfp4"
BLOCKS, SCALES, BIAS = "_blocks", "_scales", "_bias"
PROJECTIONS = ("gate_up_proj", "down_proj")
GROUP = 32                           # values per e8m0 scale
BLOCK_BYTES = GROUP // 2             # bytes of one group: two e2m1 codes a byte
SCALE_DTYPES = ("U8", "F8_E8M0")


def parse_config(qc: Mapping | None) -> dict:
    """{"modules_to_not_convert": [str], "problems": [str]} of a ``quant_method: mxfp4`` config."""
    qc = qc or {}
    problems = []
    skip = not_converted_list(qc.get("modules_to_not_convert"), problems)
    return {"modules_to_not_convert": skip, "problems": problems}


def refuse(qc: Mapping) -> tuple[type, str] | None:
    """The config's own first problem (a modules_to_not_convert that is not a list of names), refused
    naming the config file (reader.require_decodable), before any module is looked at."""
    problems = parse_config(qc)["problems"]
    return (CorruptCheckpoint, problems[0]) if problems else None


def matches(name: str, entry: str) -> bool:
    """Whether a modules_to_not_convert entry covers a module: the name itself, a prefix of it, or an
    fnmatch pattern (gpt-oss writes ``model.layers.*.self_attn``) of it or of a prefix."""
    return (name == entry or name.startswith(entry + ".") or fnmatch.fnmatchcase(name, entry)
            or fnmatch.fnmatchcase(name, entry + ".*"))


def find_modules(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """One QuantModule per ``*_proj_blocks`` tensor (every one, so that a malformed tensor is refused,
    never copied as a plain weight), from headers and the config alone; ``problems`` lists what stops an
    exact decode (``details["unsupported"]`` the part qconv does not decode)."""
    cfg = parse_config(qc)
    found = [(n, i) for n, i in tensors.items() if n.endswith(BLOCKS)
             and n[: -len(BLOCKS)].rsplit(".", 1)[-1] in PROJECTIONS]
    modules = []
    for name, info in found:
        prefix = name[: -len(BLOCKS)]
        unsupported, problems = [], list(cfg["problems"])
        shape = list(info.shape)
        if info.dtype != "U8" or len(shape) != 4 or shape[3] != BLOCK_BYTES:
            unsupported.append(f"{name.rsplit('.', 1)[-1]} is {info.dtype} {shape}; gpt-oss MXFP4 stores U8 "
                               f"[experts, rows, in/{GROUP}, {BLOCK_BYTES}] ({BLOCK_BYTES} bytes per {GROUP} values)")
        experts, rows, groups = (shape + [0, 0, 0])[:3] if len(shape) >= 3 else (0, 0, 0)
        scale = tensors.get(prefix + SCALES)
        if scale is None:
            problems.append(f"blocks without their e8m0 scales ({prefix.rsplit('.', 1)[-1]}{SCALES})")
        else:
            if scale.dtype not in SCALE_DTYPES:
                unsupported.append(f"{scale.name.rsplit('.', 1)[-1]} is {scale.dtype}; gpt-oss MXFP4 stores "
                                   f"U8 e8m0 scales")
            if list(scale.shape) != shape[:3] or len(shape) != 4:
                problems.append(f"{scale.name.rsplit('.', 1)[-1]} has shape {list(scale.shape)}, but the blocks "
                                f"{shape} need one scale per {GROUP}-value block: {shape[:3]}")
        layer = prefix.rsplit(".", 1)[0]
        for other in PROJECTIONS:
            sibling = tensors.get(f"{layer}.{other}{BLOCKS}")
            if sibling is not None and sibling.shape and sibling.shape[0] != experts:
                problems.append(f"{experts} experts, but {sibling.name.rsplit('.', 1)[-1]} holds "
                                f"{sibling.shape[0]}")
        key = next((e for e in cfg["modules_to_not_convert"] if matches(prefix, e)), None)
        if key is not None:
            problems.append(f"modules_to_not_convert lists {key!r}, but the experts are stored as MXFP4 "
                            f"blocks: loaders build them in float and read the bytes as weights")
        details = {"scales_dtype": scale.dtype if scale is not None else None, "block_rows": 1,
                   "interleaved": prefix.endswith("gate_up_proj"), "unsupported": tuple(unsupported)}
        state = (scale.name,) if scale is not None else ()
        modules.append(QuantModule(prefix, "mxfp4", "e2m1", 4, max(experts, 1) * rows, groups * GROUP, (name,),
                                   state, group_size=GROUP, details=details,
                                   problems=tuple(unsupported + problems), experts=experts))
    return modules


check = refuse_problems      # the first problem find listed, naming the file and the weight


def settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of a gpt-oss MXFP4 checkpoint."""
    cfg = parse_config(qc) if qc else {}
    return {"group_size": common(m.group_size for m in modules),
            "modules_to_not_convert": cfg.get("modules_to_not_convert"),
            "scales_dtype": common(DTYPES[m.details["scales_dtype"]][1] for m in modules
                                   if m.details.get("scales_dtype") in DTYPES)}


def lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str], comp, warnings: list[str]) -> None:
    """modules_to_not_convert entries that name nothing."""
    for entry in parse_config(qc)["modules_to_not_convert"]:
        if not any(matches(name, entry) for name in all_modules):
            warnings.append(f"modules_to_not_convert entry {entry!r} matches no module of this checkpoint")
