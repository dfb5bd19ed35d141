"""Qwen2 (Qwen2ForCausalLM: q / k / v biases) and Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): its
text decoder, llama.cpp's "qwen2vl", and its vision tower, llama.cpp's qwen2.5vl_merger mmproj file
(convert_hf_to_gguf's conversion/qwenvl.py Qwen2VLVisionModel; tools/mtmd/models/qwen2vl.cpp): the fused
q / k / v rows split into attn_q / attn_k / attn_v, a gated SiLU MLP (ffn_gate / ffn_up / ffn_down),
RMSNorms, windowed attention (n_wa_pattern), no position embedding and no patch bias."""

from __future__ import annotations

import re
from typing import Mapping

from ....errors import CorruptCheckpoint, UnsupportedFormat
from .base import TIME, Arch, Vision, blocks, common_keys, common_vision, register, required

# the Qwen VL token ids (the released models'): config.json's where the GGUF's tokenizer has no such token
QWEN_VL_TOKENS = {"image_token_id": ("<|image_pad|>", 151655), "video_token_id": ("<|video_pad|>", 151656),
                  "vision_start_token_id": ("<|vision_start|>", 151652),
                  "vision_end_token_id": ("<|vision_end|>", 151653)}


def _names(rest: str, config: Mapping):
    if rest == "patch_embed.proj.weight":
        return TIME
    if rest == "merger.ln_q.weight":
        return [("v.post_ln.weight", None)]
    m = re.fullmatch(r"merger\.mlp\.([02])\.(weight|bias)", rest)
    if m:
        return [(f"mm.{m.group(1)}.{m.group(2)}", None)]
    n, tail = blocks(rest)
    if n is None:
        return None
    leaf = tail.rsplit(".", 1)
    if tail in ("attn.qkv.weight", "attn.qkv.bias"):
        return [(f"v.blk.{n}.attn_{x}.{leaf[1]}", ("rows", i, 3)) for i, x in enumerate("qkv")]
    own = {"attn.proj": "attn_out", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
           "norm1": "ln1", "norm2": "ln2"}.get(leaf[0])
    return [(f"v.blk.{n}.{own}.{leaf[1]}", None)] if own and len(leaf) == 2 else None


def _keys(config: Mapping, vision: Mapping, pre: Mapping, where) -> list:
    full = vision.get("fullatt_block_indexes")
    if not isinstance(full, list) or not full or not all(isinstance(i, int) for i in full) \
            or any(b - a != full[0] + 1 for a, b in zip(full, full[1:])):
        raise UnsupportedFormat(f"vision_config.fullatt_block_indexes {full!r} is not evenly spaced full-attention "
                                f"layers, the only windowed-attention pattern llama.cpp's qwen2.5vl graph computes "
                                f"(clip.vision.n_wa_pattern)", file=where)
    if vision.get("intermediate_size") == vision.get("hidden_size"):
        raise UnsupportedFormat("vision_config.intermediate_size equals hidden_size: llama.cpp's loader then takes "
                                "ffn_down for ffn_up (a legacy heuristic) and would compute a different model",
                                file=where)
    if vision.get("window_size", 112) != 112:
        raise UnsupportedFormat(f"vision_config.window_size {vision['window_size']}: llama.cpp's qwen2.5vl graph "
                                f"attends in windows of 112 pixels only", file=where)
    return common_keys(config, vision, pre, where) + [
        ("clip.vision.image_size", "u32", int(vision.get("image_size", 560))),
        ("clip.use_silu", "bool", True),
        ("clip.vision.n_wa_pattern", "u32", full[0] + 1),
        ("clip.vision.attention.layer_norm_epsilon", "f32", float(config.get("rms_norm_eps", 1e-6))),
    ]


def _required(vision: Mapping) -> list[str]:
    return required(vision, ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_out.weight", "ffn_gate.weight",
                             "ffn_up.weight", "ffn_down.weight", "ln1.weight", "ln2.weight"), ())


def _hf_names(vision: Mapping) -> list[str]:
    names = ["patch_embed.proj.weight", "merger.ln_q.weight"] + [f"merger.mlp.{i}.{leaf}" for i in (0, 2)
                                                                  for leaf in ("weight", "bias")]
    for n in range(vision["depth"]):
        names += [f"blocks.{n}.{m}.{leaf}" for m in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj") for leaf in ("weight", "bias")]
        names += [f"blocks.{n}.norm1.weight", f"blocks.{n}.norm2.weight"]
    return names


def _vision_config(meta: Mapping, shapes: Mapping, where) -> dict:
    vision = common_vision(meta, where)
    pattern = meta.get("clip.vision.n_wa_pattern")
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise CorruptCheckpoint(f"its clip.vision.n_wa_pattern is {pattern!r}, not a positive integer", file=where)
    return {**vision, "hidden_act": "silu", "model_type": "qwen2_5_vl_vision", "window_size": 112,
            "fullatt_block_indexes": list(range(pattern - 1, vision["depth"], pattern))}


QWEN25_VISION = Vision(
    "qwen2.5vl_merger", _names, _keys, _required, _hf_names, _vision_config, "qwen2_5_vl_text",
    {"min_pixels": 3136, "max_pixels": 12845056, "image_processor_type": "Qwen2VLImageProcessor",
     "processor_class": "Qwen2_5_VLProcessor"},
    QWEN_VL_TOKENS, activation="clip.use_silu", windowed=True)

register(Arch("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True))
register(Arch("qwen2vl", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", qkv_bias=True, text_of="qwen2",
              vision=QWEN25_VISION))
