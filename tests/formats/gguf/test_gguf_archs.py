"""The GGUF architectures' declarations (formats/gguf/archs/): one module a family, each architecture one
declaration that arch.py, mmproj.py, clip_keys.py, source.py and core/structure.py read. Pinned here as they were
before they moved out of those files' tables, so that a declaration changes only with this test."""

import pytest

from qconv.errors import UnsupportedFormat
from qconv.formats.core import structure
from qconv.formats.gguf import arch, archs, clip_keys, mmproj

# model_type: (gguf name, Hugging Face class, flags set)
PINNED = {
    "llama": ("llama", "LlamaForCausalLM", {"permute_qk"}),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", {"qkv_bias"}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {"qk_norm"}),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM", {"qk_norm", "moe"}),
    "qwen2_5_vl": ("qwen2vl", "Qwen2_5_VLForConditionalGeneration", {"qkv_bias"}),
    "qwen3_vl": ("qwen3vl", "Qwen3VLForConditionalGeneration", {"qk_norm", "deepstack"}),
    "qwen3_vl_moe": ("qwen3vlmoe", "Qwen3VLMoeForConditionalGeneration", {"qk_norm", "moe", "deepstack"}),
}
FLAGS = ("permute_qk", "qk_norm", "qkv_bias", "moe", "deepstack")
TEXT_OF = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3moe"}
# VL model_type: (projector, the VL text config's model_type)
TOWERS = {"qwen2_5_vl": ("qwen2.5vl_merger", "qwen2_5_vl_text"), "qwen3_vl": ("qwen3vl_merger", "qwen3_vl_text"),
          "qwen3_vl_moe": ("qwen3vl_merger", "qwen3_vl_moe_text")}
QWEN_VL_TOKENS = {"image_token_id": ("<|image_pad|>", 151655), "video_token_id": ("<|video_pad|>", 151656),
                  "vision_start_token_id": ("<|vision_start|>", 151652),
                  "vision_end_token_id": ("<|vision_end|>", 151653)}


def test_every_architecture_is_declared_as_before():
    got = {mt: (a.name, a.hf_class, {f for f in FLAGS if getattr(a, f)}) for mt, a in archs.ARCHS.items()}
    assert got == PINNED
    assert {mt: a.text_of for mt, a in archs.ARCHS.items() if a.text_of} == TEXT_OF
    assert archs.BY_GGUF_NAME == {a.name: a for a in archs.ARCHS.values()}
    assert arch.ARCHS is archs.ARCHS and arch.BY_GGUF_NAME is archs.BY_GGUF_NAME


def test_every_text_decoder_and_gguf_name_is_one_llama_cpp_has():
    import gguf

    names = set(gguf.MODEL_ARCH_NAMES.values())
    assert {a.name for a in archs.ARCHS.values()} <= names
    for a in archs.ARCHS.values():
        assert a.text_of is None or a.text_of in archs.BY_GGUF_NAME
        assert (a.vision is not None) == (a.text_of is not None), a.name   # a VL text decoder has its tower


def test_every_vision_tower_is_declared_as_before():
    assert list(mmproj.MODELS) == list(TOWERS)
    assert {mt: (v.projector, v.text_model_type) for mt, v in mmproj.MODELS.items()} == TOWERS
    assert all(v.tokens == QWEN_VL_TOKENS for v in mmproj.MODELS.values())
    assert archs.vision_prefixes() == ("model.visual.", "visual.")
    assert arch.is_vision("model.visual.blocks.0.attn.qkv.weight") and arch.is_vision("visual.merger.ln_q.weight")
    assert not arch.is_vision("model.language_model.layers.0.mlp.up_proj.weight")
    assert mmproj.MODELS["qwen2_5_vl"].processor["processor_class"] == "Qwen2_5_VLProcessor"
    assert mmproj.MODELS["qwen3_vl_moe"].processor == mmproj.MODELS["qwen3_vl"].processor
    # what clip_keys.py checks of each tower's keys
    assert {mt: (v.activation, v.windowed, v.fused_qkv, v.deepstack) for mt, v in mmproj.MODELS.items()} == {
        "qwen2_5_vl": ("clip.use_silu", True, False, False), "qwen3_vl": ("clip.use_gelu", False, True, True),
        "qwen3_vl_moe": ("clip.use_gelu", False, True, True)}
    assert clip_keys.PROJECTORS == ("qwen2.5vl_merger", "qwen3vl_merger")


def test_every_architecture_declares_its_attention_types_to_core():
    for a in archs.ARCHS.values():
        assert structure.attention_follows_config(a.model_type)
        if a.vision is not None:
            assert structure.attention_follows_config(a.vision.text_model_type)
    assert not structure.attention_follows_config("deepseek_v3")        # its MLA: the universal checks only


def test_the_architectures_refused_are_declared_with_why():
    assert {c: u.label for c, u in archs.UNWRITTEN.items()} == {"CogVLMForCausalLM": "CogVLM"}
    with pytest.raises(UnsupportedFormat, match=r"is CogVLM \(CogVLMForCausalLM\), which qconv does not write as "
                                                "GGUF: its vision tower's 2x2 convolution"):
        arch.refuse_unwritten({"architectures": ["CogVLMForCausalLM"]}, ["model.vision.conv.weight"], "config.json")
    with pytest.raises(ValueError, match="declared unwritten twice"):
        archs.register_unwritten(archs.UNWRITTEN["CogVLMForCausalLM"])


def test_a_model_type_or_gguf_name_declared_twice_is_refused():
    llama = archs.ARCHS["llama"]
    with pytest.raises(ValueError, match="declared twice"):
        archs.register(llama)
    from dataclasses import replace

    with pytest.raises(ValueError, match="declared twice"):
        archs.register(replace(llama, model_type="llama_again"))        # the same gguf name
    assert "llama_again" not in archs.ARCHS


def test_a_model_type_not_declared_is_refused_naming_those_declared():
    with pytest.raises(UnsupportedFormat, match="model_type 'gemma' has no GGUF mapping in qconv "
                                                r"\(mapped: llama, qwen2, qwen2_5_vl, qwen3, qwen3_moe"):
        arch.arch_of({"model_type": "gemma"}, "config.json")
    assert arch.arch_of({"model_type": "qwen3_vl"}, "config.json") is archs.ARCHS["qwen3_vl"]
