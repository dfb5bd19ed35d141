"""What llama.cpp needs besides the weights: the architecture's hyperparameters, the tensor names and the
rotary row order of q / k, each as llama.cpp's own converter writes them (convert_hf_to_gguf.py:
TextModel.set_gguf_parameters, LlamaModel), and read back (config_from); the tokenizer's part is
tokenizer.py's.

What each architecture is lies in its declaration (archs/: one module a family of them); this file is
generic over their flags. A model type not declared is refused by name, never written half right.
Everything here reads configs only (no tensor data).
"""

from __future__ import annotations

import functools
import re
from typing import Mapping

from ...errors import CorruptCheckpoint, UnsupportedFormat
from .archs import ARCHS, BY_GGUF_NAME, UNWRITTEN, Arch, vision_prefixes
from .tokenizer import special_id

_TEXT_PREFIX = "model.language_model."


def text_config(config: Mapping | None) -> dict:
    """The decoder's config: a VL config's text_config over its top level (as llama.cpp's converter reads
    it), a text model's config as it is."""
    config = dict(config or {})
    if isinstance(config.get("text_config"), Mapping):
        config = {**config, **config["text_config"]}
    return config


def is_vision(hf_name: str) -> bool:
    """A VL model's vision-tower tensor: llama.cpp reads these from the mmproj file, not the model's."""
    return hf_name.startswith(vision_prefixes())


def refuse_unwritten(config: Mapping | None, names, where) -> None:
    """An architecture llama.cpp has but cannot compute as the checkpoint holds it (declared unwritten:
    archs.register_unwritten) is refused naming why, before anything is written."""
    for cls in (config or {}).get("architectures") or ():
        if cls in UNWRITTEN:
            refused = UNWRITTEN[cls]
            raise UnsupportedFormat(f"is {refused.label} ({cls}), which qconv does not write as GGUF: "
                                    f"{'; '.join(refused.why(list(names)))}; nothing written", file=where)


def arch_of(config: Mapping | None, where) -> Arch:
    """The architecture of a Hugging Face config; refused by name where qconv does not map it, or where
    the config asks for what llama.cpp's implementation of it does not do."""
    config = config or {}
    mt = config.get("model_type")
    if mt not in ARCHS:
        raise UnsupportedFormat(f"model_type {mt!r} has no GGUF mapping in qconv (mapped: {', '.join(sorted(ARCHS))}); "
                                f"nothing written", file=where)
    arch = ARCHS[mt]
    config = text_config(config)
    if arch.moe:
        why = None
        if config.get("mlp_only_layers"):
            why = f"dense layers among the MoE ones (mlp_only_layers {config['mlp_only_layers']})"
        elif int(config.get("decoder_sparse_step", 1)) != 1:
            why = f"decoder_sparse_step {config['decoder_sparse_step']}"
        elif config.get("norm_topk_prob") is False:
            why = "norm_topk_prob false (llama.cpp's qwen3moe normalises the top-k weights)"
        if why:
            raise UnsupportedFormat(f"{mt} with {why} is not what llama.cpp's {arch.name} computes; nothing written",
                                    file=where)
    if config.get("use_sliding_window") or (config.get("sliding_window") and config.get("layer_types")
                                            and "sliding_attention" in config["layer_types"]):
        raise UnsupportedFormat("uses sliding-window attention, which qconv does not map to GGUF; nothing written",
                                file=where)
    if config.get("attention_bias") and not arch.qkv_bias:
        raise UnsupportedFormat(f"attention_bias is set, which llama.cpp's {arch.name} does not load; nothing written",
                                file=where)
    return arch


def _rope(config: Mapping) -> Mapping:
    """The rope a loader computes with: a legacy rope_scaling wins over rope_parameters, as transformers
    takes it (convert_rope_params_to_dict: ``rope_scaling or rope_parameters``)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return rope if isinstance(rope, Mapping) else {}


def _rope_theta(config: Mapping, arch: Arch, where) -> float:
    rope = _rope(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "mrope" and arch.text_of:              # older VL configs' name for the multimodal rope
        kind = "default"
    if kind not in (None, "default") and not (kind == "llama3" and arch.permute_qk):
        raise UnsupportedFormat(f"rope type {kind!r} is not mapped to GGUF by qconv for {arch.name} (default rope, "
                                f"and llama-3's for llama); nothing written", file=where)
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


def rope_freqs(config: Mapping):
    """llama-3's rope scaling as llama.cpp takes it: the rope_freqs tensor, one factor per rotary
    frequency pair that llama.cpp divides each frequency by (LlamaModel.generate_extra_tensors, the
    same arithmetic in float32); None where the rope is not llama-3's."""
    import numpy as np

    config = text_config(config)
    rope = _rope(config)
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    base = np.float32(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    freqs = np.float32(1.0) / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for freq in freqs:
        wavelen = np.float32(2 * np.pi) / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def llama3_rope(factors, config: Mapping, where) -> dict:
    """rope_parameters of llama-3's rope scaling from a GGUF's rope_freqs (the inverse of rope_freqs()).
    The factors fix the scaling factor (the largest) and, from two or more factors between 1 and it, the
    smooth ramp s = a / wavelength - b; llama-3's (original context, low, high frequency factors) are
    (a k, b k, (b + 1) k) for any k, the same factors for each, and k = 1 / b makes the low frequency
    factor 1, as every Llama-3.x config has it. Refused where the factors are not of that form."""
    import numpy as np

    f = np.asarray(factors, np.float64)
    theta = float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    if f.shape != (dim // 2,) or not np.all(np.isfinite(f)) or f.min(initial=1) < 1:
        raise UnsupportedFormat(f"its rope_freqs are not {dim // 2} factors of at least 1 (llama-3's rope scaling)",
                                file=where, tensor="rope_freqs.weight")
    if np.all(f == 1):
        return {"rope_theta": theta, "rope_type": "default"}
    factor = float(f.max())
    mid = (f > 1) & (f < factor)
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    if mid.sum() < 2:
        raise UnsupportedFormat("its rope_freqs have fewer than two factors on llama-3's ramp, which do not fix "
                                "its rope scaling; nothing written", file=where, tensor="rope_freqs.weight")
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(1 / wavelen[mid], s, 1) * [1, -1]
    rope = {"rope_theta": theta, "rope_type": "llama3", "factor": float(f"{factor:.6g}"), "low_freq_factor": 1.0,
            "high_freq_factor": float(f"{(b + 1) / b:.6g}"), "original_max_position_embeddings": int(round(a / b))}
    again = rope_freqs({**config, "rope_parameters": rope})
    if not np.allclose(again, f, rtol=1e-5, atol=0):
        raise UnsupportedFormat("its rope_freqs are not llama-3's rope scaling of any original context (the "
                                "factors do not follow its ramp); nothing written", file=where,
                                tensor="rope_freqs.weight")
    return rope


def experts(config: Mapping) -> int:
    config = text_config(config)
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def hparams(config: Mapping, arch: Arch, where) -> list[tuple[str, str, object]]:
    """(gguf key, value type, value) for the architecture's hyperparameters, as TextModel.set_gguf_parameters
    and the architecture's own class write them."""
    vision = (config or {}).get("vision_config") or {}
    config = text_config(config)
    a = arch.name
    rope = _rope(config)
    if rope.get("mrope_section") and not arch.text_of:
        raise UnsupportedFormat(f"has multimodal rope sections (mrope_section), which llama.cpp's {a} does not "
                                f"compute; nothing written", file=where)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv = [
        (f"{a}.context_length", "u32", int(config.get("max_position_embeddings", 2048))),
        (f"{a}.embedding_length", "u32", int(config["hidden_size"])),
        (f"{a}.block_count", "u32", int(config["num_hidden_layers"])),
        (f"{a}.feed_forward_length", "u32", int(config["intermediate_size"])),
        (f"{a}.attention.head_count", "u32", heads),
        (f"{a}.attention.head_count_kv", "u32", int(config.get("num_key_value_heads") or heads)),
        (f"{a}.rope.freq_base", "f32", _rope_theta(config, arch, where)),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", float(config.get("rms_norm_eps", 1e-5))),
    ]
    if config.get("head_dim"):
        kv += [(f"{a}.attention.key_length", "u32", head_dim), (f"{a}.attention.value_length", "u32", head_dim)]
    if arch.moe:
        kv += [(f"{a}.expert_count", "u32", experts(config)),
               (f"{a}.expert_used_count", "u32", int(config["num_experts_per_tok"])),
               (f"{a}.expert_feed_forward_length", "u32", int(config["moe_intermediate_size"]))]
    if arch.text_of:                                  # TextModel's mrope sections; Qwen3VLTextModel's deepstack
        sections = rope.get("mrope_section")
        if not isinstance(sections, list) or not 0 < len(sections) <= 4 or not all(isinstance(x, int) for x in sections):
            raise UnsupportedFormat(f"has no mrope_section of at most 4 integers in its rope parameters, which "
                                    f"llama.cpp's {a} needs; nothing written", file=where)
        kv.append((f"{a}.rope.dimension_sections", "i32[]", (list(sections) + [0, 0, 0])[:4]))
        if arch.deepstack:
            kv.append((f"{a}.n_deepstack_layers", "u32", len(vision.get("deepstack_visual_indexes") or [])))
    if arch.permute_qk:                               # LlamaModel.set_gguf_parameters
        kv += [(f"{a}.vocab_size", "u32", int(config["vocab_size"])), (f"{a}.rope.dimension_count", "u32", head_dim)]
    return kv


def add_key(writer, key: str, kind, value) -> None:
    """One (gguf key, value type, value) of hparams(), the tokenizer's or the mmproj's keys (a GGUF source's
    own field: its (type, sub type) as kind) added to a gguf-py writer."""
    import gguf

    if isinstance(kind, tuple):                        # a GGUF source's own field, in its own types
        writer.add_key_value(key, value, kind[0], sub_type=kind[1])
    elif kind == "str":
        writer.add_string(key, value)
    elif kind == "u32":
        writer.add_uint32(key, value)
    elif kind == "f32":
        writer.add_float32(key, value)
    elif kind == "bool":
        writer.add_bool(key, value)
    elif kind == "str[]":
        writer.add_array(key, value)
    elif kind == "i32[]":
        writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    elif kind == "f32[]":
        writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
    elif kind == "bool[]":
        writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    else:
        raise AssertionError(kind)


def heads_of(config: Mapping, hf_name: str) -> int | None:
    """The head count llama.cpp's permutation of this tensor's rows uses (None: not q / k)."""
    config = text_config(config)
    if hf_name.endswith("self_attn.q_proj.weight"):
        return int(config["num_attention_heads"])
    if hf_name.endswith("self_attn.k_proj.weight"):
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return None


_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


def in_decoder_layers(hf_name: str) -> bool:
    """Whether a Hugging Face tensor is in the numbered decoder layers (not embeddings, lm_head, norm)."""
    return _BLOCK.match(hf_name) is not None


@functools.lru_cache(maxsize=8)
def _name_map(arch_name: str, n_blocks: int):
    """gguf-py's TensorNameMap for an architecture: built once (it enumerates every name of every block)."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    return gguf.get_tensor_name_map(arch_id, n_blocks)


def gguf_name(hf_name: str, arch: Arch, n_blocks: int, where) -> str | None:
    """llama.cpp's name for a Hugging Face tensor (gguf-py's TensorNameMap for the architecture); None
    for tensors llama.cpp does not load (rotary inv_freq buffers, a VL model's vision tower: llama.cpp's
    mmproj file holds that)."""
    if hf_name.endswith("rotary_emb.inv_freq") or (arch.text_of and is_vision(hf_name)):
        return None
    if arch.text_of and hf_name.startswith(_TEXT_PREFIX):
        hf_name = "model." + hf_name[len(_TEXT_PREFIX):]
    name = _name_map(arch.name, n_blocks).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UnsupportedFormat(f"has no llama.cpp name for {arch.name} in gguf-py's tensor map; nothing written",
                                file=where, tensor=hf_name)
    return name


def hf_tensor_names(config: Mapping, arch: Arch) -> list[str]:
    """The Hugging Face tensors of the architecture's decoder (what a GGUF's tensors are named back to);
    MoE experts stacked as llama.cpp stores them (``mlp.experts.gate_proj.weight``, one per layer); a VL
    model's under ``model.language_model.``."""
    config = text_config(config)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        names += [p + s + ".weight" for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "input_layernorm", "post_attention_layernorm")]
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if arch.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if arch.moe:
            names += [p + "mlp.gate.weight"] + [p + f"mlp.experts.{x}_proj.weight" for x in ("gate", "up", "down")]
        else:
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    if arch.text_of:
        names = [n.replace("model.", _TEXT_PREFIX, 1) if n.startswith("model.") else n for n in names]
    return names


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-06, not 9.99999997e-07)."""
    import struct

    v = float(value)
    for digits in range(1, 18):
        short = float(f"{v:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", short))[0] == v:
            return short
    return v


# config.json's structural keys and the metadata keys config_from() reads them from
_GGUF_KEYS = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
              "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
              "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
              "num_local_experts": "expert_count", "moe_intermediate_size": "expert_feed_forward_length",
              "vocab_size": "vocab_size"}


def config_names(meta: Mapping) -> dict[str, str]:
    """config.json's structural keys as a GGUF's metadata names them (what a disagreement names)."""
    a = meta.get("general.architecture")
    names = {k: f"{a}.{v}" for k, v in _GGUF_KEYS.items()}
    if f"{a}.vocab_size" not in meta:
        names["vocab_size"] = "tokenizer.ggml.tokens' count"
    if f"{a}.attention.head_count_kv" not in meta:
        names["num_key_value_heads"] = f"{a}.attention.head_count"
    return names


def config_from(meta: Mapping, where) -> dict:
    """config.json for a GGUF's architecture, from its metadata: the inverse of hparams() (what
    llama.cpp's converter wrote from the Hugging Face config). A VL model's text decoder (qwen3vl) is
    the text model it computes on text (Qwen3ForCausalLM): on text, the three mrope position streams are
    equal, so its rope is the plain one, and deepstack adds only image features; the vision tower is not
    in the file (llama.cpp's mmproj file holds it)."""
    a = meta.get("general.architecture")
    if a not in BY_GGUF_NAME:
        raise UnsupportedFormat(f"GGUF architecture {a!r} has no Hugging Face mapping in qconv (mapped: "
                                f"{', '.join(sorted(BY_GGUF_NAME))}); nothing written", file=where)
    arch = BY_GGUF_NAME[a]
    if arch.text_of:                                  # a VL model's text decoder: the text model it computes
        arch = BY_GGUF_NAME[arch.text_of]

    def need(key):
        if f"{a}.{key}" not in meta:
            raise UnsupportedFormat(f"has no {a}.{key} in its metadata, which a {a} model needs", file=where)
        return whole(key, meta[f"{a}.{key}"])

    def whole(key, value):                            # a size or count: an integer (structure.py checks its range)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CorruptCheckpoint(f"its metadata's {a}.{key} is {value!r}, not an integer", file=where)
        return value

    def real(key, default):                           # a float32 hyperparameter, finite
        value = meta.get(f"{a}.{key}", default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
            raise CorruptCheckpoint(f"its metadata's {a}.{key} is {value!r}, not a finite number", file=where)
        return _f32(value)

    heads = need("attention.head_count")
    hidden = need("embedding_length")
    config = {"architectures": [arch.hf_class], "model_type": arch.model_type, "hidden_size": hidden,
              "intermediate_size": need("feed_forward_length"), "num_hidden_layers": need("block_count"),
              "num_attention_heads": heads,
              "num_key_value_heads": whole("attention.head_count_kv", meta.get(f"{a}.attention.head_count_kv", heads)),
              "max_position_embeddings": whole("context_length", meta.get(f"{a}.context_length", 2048)),
              "rms_norm_eps": real("attention.layer_norm_rms_epsilon", 1e-5),
              "rope_parameters": {"rope_theta": real("rope.freq_base", 10000.0), "rope_type": "default"},
              "hidden_act": "silu", "attention_bias": arch.qkv_bias, "tie_word_embeddings": False}
    if f"{a}.attention.key_length" in meta:          # written where the Hugging Face config has head_dim
        config["head_dim"] = whole("attention.key_length", meta[f"{a}.attention.key_length"])
    if not arch.qkv_bias and not arch.qk_norm:
        config["mlp_bias"] = False
    if arch.moe:
        config.update(num_local_experts=need("expert_count"), num_experts_per_tok=need("expert_used_count"),
                      moe_intermediate_size=need("expert_feed_forward_length"), norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])
    tokens = meta.get("tokenizer.ggml.tokens")
    config["vocab_size"] = whole("vocab_size", meta.get(f"{a}.vocab_size", len(tokens) if isinstance(tokens, list) else 0))
    for kind in ("bos", "eos", "pad"):
        if isinstance(special_id(meta, kind), int):
            config[f"{kind}_token_id"] = special_id(meta, kind)
    return config


_STRUCTURAL = {"token_embd": "model.embed_tokens", "output": "lm_head", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
               "ffn_down_exps": "mlp.experts.{e}.down_proj"}
_GGUF_TENSOR = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.weight$")


def structure_warnings(meta: Mapping, tensors, count) -> list[str]:
    """Header-only (inspect): where a GGUF's hyperparameters disagree with its tensors, as
    structure.disagreements says it of a config.json (the metadata read back as config_from() reads it).
    TENSORS: (name, logical shape) pairs; COUNT: an array value's length (header.py elides long arrays)."""
    from ..core.structure import disagreements, key_namer

    a = meta.get("general.architecture")
    try:
        config = config_from({k: v for k, v in meta.items() if not k.startswith("tokenizer.")}, None)
    except CorruptCheckpoint as exc:                  # a size that is no integer, a NaN epsilon
        return [exc.message]
    except UnsupportedFormat:
        return []                                     # not an architecture qconv maps: nothing to compare
    if f"{a}.vocab_size" not in meta:
        config["vocab_size"] = count(meta.get("tokenizer.ggml.tokens")) or 0
    names = config_names(meta)
    return [d.message(key_namer(config, names)) for d in disagreements(config, structural_shapes(tensors))]


def structural_shapes(tensors) -> dict[str, tuple]:
    """The tensors structure.disagreements compares with, from a GGUF's header: TENSORS as (name, GGUF
    shape) pairs -> {Hugging Face name: logical shape}, stacked experts one per expert (stdlib, and
    bounded by the names alone: nothing sized by the metadata)."""
    shapes = {}
    for name, shape in tensors:
        m = _GGUF_TENSOR.match(name)
        hf = _STRUCTURAL.get(m[2]) if m else None
        if hf is None or (m[1] is None) != (m[2] in ("token_embd", "output")):
            continue
        hf = hf if m[1] is None else f"model.layers.{m[1]}.{hf}"
        shape = tuple(reversed(shape))
        if "{e}" in hf and len(shape) == 3:
            shapes.update({hf.format(e=e) + ".weight": shape[1:] for e in range(min(shape[0], 4096))})
        elif "{e}" not in hf:
            shapes[hf + ".weight"] = shape
    return shapes
