"""Qwen3 (Qwen3ForCausalLM: q / k norms), Qwen3-MoE (stacked experts) and Qwen3-VL / Qwen3-VL-MoE: their
text decoders, llama.cpp's "qwen3vl" / "qwen3vlmoe" (deepstack), and their vision tower, llama.cpp's
qwen3vl_merger mmproj file (convert_hf_to_gguf's conversion/qwen3vl.py Qwen3VLVisionModel;
tools/mtmd/models/qwen3vl.cpp): fused attn_qkv, a GELU MLP, LayerNorms, a learned position embedding, a
patch bias and the deepstack mergers (v.deepstack.L.*, L the vision layer they follow)."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Mapping

from ....errors import CorruptCheckpoint, UnsupportedFormat
from .base import TIME, Arch, Vision, blocks, common_keys, common_vision, positive, register, required
from .qwen2 import QWEN_VL_TOKENS


def _names(rest: str, config: Mapping):
    vision = config.get("vision_config") or {}
    if rest == "patch_embed.proj.weight":
        return TIME
    fixed = {"patch_embed.proj.bias": "v.patch_embd.bias", "pos_embed.weight": "v.position_embd.weight"}
    if rest in fixed:
        return [(fixed[rest], None)]
    sub = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    m = re.fullmatch(r"merger\.(norm|linear_fc1|linear_fc2)\.(weight|bias)", rest)
    if m:
        merger = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[m.group(1)]
        return [(f"{merger}.{m.group(2)}", None)]
    m = re.fullmatch(r"deepstack_merger_list\.(\d+)\.(norm|linear_fc1|linear_fc2)\.(weight|bias)", rest)
    if m:
        indexes = vision.get("deepstack_visual_indexes") or []
        k = int(m.group(1))
        if k >= len(indexes):
            return None
        return [(f"v.deepstack.{indexes[k]}.{sub[m.group(2)]}.{m.group(3)}", None)]
    n, tail = blocks(rest)
    if n is None:
        return None
    leaf = tail.rsplit(".", 1)
    own = {"attn.qkv": "attn_qkv", "attn.proj": "attn_out", "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down",
           "norm1": "ln1", "norm2": "ln2"}.get(leaf[0])
    return [(f"v.blk.{n}.{own}.{leaf[1]}", None)] if own and len(leaf) == 2 else None


def _keys(config: Mapping, vision: Mapping, pre: Mapping, where) -> list:
    positions = positive(vision, "num_position_embeddings", where)
    side = math.isqrt(positions)
    if side * side != positions:
        raise UnsupportedFormat(f"vision_config.num_position_embeddings {positions} is not a square grid, which "
                                f"llama.cpp's qwen3vl graph interpolates its position embedding as", file=where)
    depth = positive(vision, "depth", where)
    indexes = vision.get("deepstack_visual_indexes") or []
    if not all(isinstance(i, int) and 0 <= i < depth for i in indexes) or len(set(indexes)) != len(indexes):
        raise CorruptCheckpoint(f"vision_config.deepstack_visual_indexes {indexes!r} are not distinct layers of "
                                f"its {depth} vision layers", file=where)
    text = config.get("text_config") or {}
    keys = common_keys(config, vision, pre, where)
    image_size = vision.get("image_size") or side * positive(vision, "patch_size", where)
    keys += [("clip.vision.image_size", "u32", int(image_size)), ("clip.use_gelu", "bool", True)]
    if "spatial_merge_size" in vision:
        keys.append(("clip.vision.spatial_merge_size", "u32", positive(vision, "spatial_merge_size", where)))
    return keys + [("clip.vision.attention.layer_norm_epsilon", "f32", float(text.get("rms_norm_eps", 1e-6))),
                   ("clip.vision.is_deepstack_layers", "bool[]", [i in indexes for i in range(depth)])]


def _required(vision: Mapping) -> list[str]:
    return required(vision, ("attn_qkv.weight", "attn_qkv.bias", "attn_out.weight", "ffn_up.weight", "ffn_down.weight",
                             "ln1.weight", "ln2.weight"), ("v.patch_embd.bias", "v.position_embd.weight")) \
        + [f"v.deepstack.{i}.{t}" for i in vision.get("deepstack_visual_indexes") or []
           for t in ("norm.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]


def _hf_names(vision: Mapping) -> list[str]:
    merger = [f"{m}.{leaf}" for m in ("norm", "linear_fc1", "linear_fc2") for leaf in ("weight", "bias")]
    names = ["patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight"] + [f"merger.{m}" for m in merger]
    names += [f"deepstack_merger_list.{k}.{m}" for k in range(len(vision["deepstack_visual_indexes"])) for m in merger]
    for n in range(vision["depth"]):
        names += [f"blocks.{n}.{m}.{leaf}" for m in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2",
                                                     "norm1", "norm2") for leaf in ("weight", "bias")]
    return names


def _vision_config(meta: Mapping, shapes: Mapping, where) -> dict:
    vision = common_vision(meta, where)
    flags = meta.get("clip.vision.is_deepstack_layers") or []
    if not isinstance(flags, list) or len(flags) != vision["depth"]:
        raise CorruptCheckpoint(f"its clip.vision.is_deepstack_layers is not one flag per vision layer "
                                f"({vision['depth']})", file=where)
    positions = shapes.get("v.position_embd.weight")
    if positions is None:
        raise CorruptCheckpoint("has no v.position_embd.weight, which the qwen3vl_merger graph needs", file=where)
    return {**vision, "hidden_act": "gelu_pytorch_tanh", "model_type": "qwen3_vl_vision",
            "num_position_embeddings": positions[0],
            "deepstack_visual_indexes": [i for i, f in enumerate(flags) if f]}


QWEN3_VISION = Vision(
    "qwen3vl_merger", _names, _keys, _required, _hf_names, _vision_config, "qwen3_vl_text",
    {"size": {"longest_edge": 16777216, "shortest_edge": 65536},
     "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"},
    QWEN_VL_TOKENS, activation="clip.use_gelu", fused_qkv=True, deepstack=True)

register(Arch("qwen3", "qwen3", "Qwen3ForCausalLM", qk_norm=True))
register(Arch("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True))
register(Arch("qwen3vl", "qwen3_vl", "Qwen3VLForConditionalGeneration", qk_norm=True, text_of="qwen3", deepstack=True,
              vision=QWEN3_VISION))
# Qwen3-VL's tower under a MoE text decoder
register(Arch("qwen3vlmoe", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", qk_norm=True, moe=True,
              text_of="qwen3moe", deepstack=True, vision=replace(QWEN3_VISION, text_model_type="qwen3_vl_moe_text")))
