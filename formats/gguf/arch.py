"""What llama.cpp needs besides the weights: the architecture's hyperparameters, the tensor names, the
rotary row order of q / k, and the tokenizer, each as llama.cpp's own converter writes them
(convert_hf_to_gguf.py: TextModel.set_gguf_parameters, LlamaModel, get_vocab_base, gguf.SpecialVocab).

An architecture is one entry of ARCHS; a model type not there is refused by name, never written half
right. Everything here reads configs and the tokenizer's JSON only (no tensor data).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..storage.checkpoint import load_json

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class Arch:
    name: str                      # gguf's architecture name (general.architecture)
    model_type: str                # the Hugging Face model_type it maps
    hf_class: str                  # the Hugging Face architecture (config.json "architectures")
    permute_qk: bool = False       # llama's q / k rows reordered for llama.cpp's rotary layout (LlamaModel.permute)
    qk_norm: bool = False          # q_norm / k_norm per layer (qwen3)
    qkv_bias: bool = False         # q / k / v biases (qwen2)
    moe: bool = False              # experts stacked per layer (qwen3-moe: ffn_{gate,up,down}_exps, ffn_gate_inp)
    text_of: str | None = None     # a VL model's text decoder (its text_config, model.language_model.* tensors,
                                   # mrope sections and deepstack count), computing on text what this
                                   # model_type does; the vision tower is llama.cpp's mmproj file, not this one
    deepstack: bool = False        # n_deepstack_layers, the vision tower's layers added to the first ones (qwen3vl)


ARCHS = {a.model_type: a for a in (
    Arch("llama", "llama", "LlamaForCausalLM", permute_qk=True),
    Arch("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    Arch("qwen3", "qwen3", "Qwen3ForCausalLM", qk_norm=True),
    Arch("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True),
    Arch("qwen2vl", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", qkv_bias=True, text_of="qwen2"),
    Arch("qwen3vl", "qwen3_vl", "Qwen3VLForConditionalGeneration", qk_norm=True, text_of="qwen3", deepstack=True),
    Arch("qwen3vlmoe", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", qk_norm=True, moe=True,
         text_of="qwen3moe", deepstack=True),
)}
BY_GGUF_NAME = {a.name: a for a in ARCHS.values()}

VISION_PREFIXES = ("model.visual.", "visual.")
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
    return hf_name.startswith(VISION_PREFIXES)

# tokenizer.json pre-tokenizer regexes -> llama.cpp's pre-tokenizer names (llama-vocab.cpp), for the
# tokenizers whose regex says which it is; ByteLevel's own regex is GPT-2's.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_PRE_BY_REGEX = {
    _GPT2_REGEX: "gpt-2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}


def _cogvlm(names) -> list[str]:
    """Why llama.cpp (llama-cpp-python 0.3.36's build) cannot compute a CogVLM checkpoint, from its tensors."""
    why = []
    if any(n.startswith("model.vision.conv.") for n in names):
        why.append("its vision tower's 2x2 convolution after the transformer (model.vision.conv, CogVLM2's) has no "
                   "place in llama.cpp's cogvlm clip graph (tools/mtmd/models/cogvlm.cpp)")
    if any(n.endswith(".vision_expert_query_key_value.bias") for n in names):
        why.append("llama.cpp's cogvlm text model loads no bias for the vision expert's query_key_value "
                   "(vis_attn_qkv, src/models/cogvlm.cpp), which this checkpoint has")
    return why or ["qconv has no CogVLM checkpoint made by CogVLM's own code to prove one against"]


# architectures llama.cpp has and qconv refuses, with the reason (from the config and tensor names)
UNWRITTEN = {"CogVLMForCausalLM": ("CogVLM", _cogvlm)}


def refuse_unwritten(config: Mapping | None, names, where) -> None:
    """An architecture llama.cpp has but cannot compute as the checkpoint holds it (UNWRITTEN) is refused
    naming why, before anything is written."""
    for cls in (config or {}).get("architectures") or ():
        if cls in UNWRITTEN:
            label, why = UNWRITTEN[cls]
            raise UnsupportedFormat(f"is {label} ({cls}), which qconv does not write as GGUF: "
                                    f"{'; '.join(why(list(names)))}; nothing written", file=where)


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


def _pre_name(tok: Mapping, where) -> str:
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
            if regex in _PRE_BY_REGEX:
                return _PRE_BY_REGEX[regex]
            raise UnsupportedFormat(f"its pre-tokenizer regex is not one qconv maps to a llama.cpp pre-tokenizer "
                                    f"({str(regex)[:60]!r}...); nothing written", file=where)
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            return "gpt-2"
    raise UnsupportedFormat("its pre-tokenizer is not one qconv maps to a llama.cpp pre-tokenizer; nothing written",
                            file=where)


def sentencepiece_style(tok: Mapping) -> bool:
    """A tokenizer.json converted from a SentencePiece model (transformers' LlamaTokenizerFast: Metaspace,
    a "▁" normalizer, byte fallback, or a Unigram model): llama.cpp's "llama" vocab, from tokenizer.model."""
    model = tok.get("model") if isinstance(tok.get("model"), dict) else {}
    steps = []
    for part in ("pre_tokenizer", "normalizer"):
        step = tok.get(part) if isinstance(tok.get(part), dict) else {}
        steps += [step] + [s for s in step.get("pretokenizers", step.get("normalizers", [])) if isinstance(s, dict)]
    return (model.get("type") == "Unigram" or model.get("byte_fallback") is True
            or any(s.get("type") == "Metaspace" or (s.get("type") in ("Prepend", "Replace") and "\u2581" in
                                                       json.dumps(s, ensure_ascii=False)) for s in steps))


def tokenizer(folder: Path, config: Mapping, root) -> list[tuple[str, str, object]]:
    """The tokenizer metadata llama.cpp reads, as llama.cpp's converter writes it: a byte-level BPE
    tokenizer.json as llama.cpp's "gpt2" model (_gpt2_tokenizer); a SentencePiece tokenizer.model (with no
    tokenizer.json, or beside one converted from it) as its "llama" model (_sentencepiece_tokenizer)."""
    path, model_path = folder / "tokenizer.json", folder / "tokenizer.model"
    tok = load_json(path, what="tokenizer.json") if root.check(path, "tokenizer") == "file" else None
    if isinstance(tok, dict) and sentencepiece_style(tok) or tok is None:
        if root.check(model_path, "tokenizer.model") == "file":
            return _sentencepiece_tokenizer(folder, config, root, tok)
        if tok is not None:
            raise UnsupportedFormat("tokenizer.json is a SentencePiece-style tokenizer (Metaspace, byte fallback: "
                                    "llama.cpp's 'llama' vocab), which qconv writes from the model's tokenizer.model; "
                                    "put tokenizer.model beside it; nothing written", file=path)
        raise UnsupportedFormat("has no tokenizer.json or tokenizer.model, which llama.cpp's GGUF needs (qconv maps "
                                "byte-level BPE tokenizer.json and SentencePiece BPE tokenizer.model); nothing written",
                                file=folder)
    return _gpt2_tokenizer(folder, config, root, tok, path)


def _gpt2_tokenizer(folder: Path, config: Mapping, root, tok, path: Path) -> list[tuple[str, str, object]]:
    """tokenizer.json (a byte-level BPE: llama.cpp's "gpt2" model) and tokenizer_config.json, as
    convert_hf_to_gguf's get_vocab_base and gguf.SpecialVocab write them: tokens padded to the model's
    vocab_size with [PADn] (UNUSED), added special tokens CONTROL, other added tokens USER_DEFINED, merges
    as "a b", bos / eos / unk / pad ids, add_bos, the chat template."""
    model = tok.get("model") if isinstance(tok, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UnsupportedFormat("tokenizer.json is not a BPE tokenizer, the only kind qconv maps to GGUF; "
                                "nothing written", file=path)
    pre = _pre_name(tok, path)
    config = text_config(config)
    vocab = {}
    for t, i in model["vocab"].items():
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise CorruptCheckpoint(f"tokenizer.json gives token {t!r} the id {i!r}, not a token id; nothing written",
                                    file=path)
        if i in vocab:
            raise CorruptCheckpoint(f"tokenizer.json gives tokens {vocab[i]!r} and {t!r} the same id {i}; nothing "
                                    f"written", file=path)
        vocab[i] = t
    added = {}
    for a in tok.get("added_tokens") or []:
        i = a.get("id") if isinstance(a, dict) else None
        if isinstance(i, bool) or not isinstance(i, int) or i < 0 or not isinstance(a.get("content"), str):
            raise CorruptCheckpoint(f"tokenizer.json's added token {a!r} has no token id and content; nothing "
                                    f"written", file=path)
        if i in added:
            raise CorruptCheckpoint(f"tokenizer.json gives added tokens {added[i]['content']!r} and "
                                    f"{a['content']!r} the same id {i}; nothing written", file=path)
        added[i] = a
    for i, a in added.items():
        vocab[i] = a["content"]
    size = int(config.get("vocab_size") or (max(vocab) + 1))
    if max(vocab, default=-1) >= size:
        raise UnsupportedFormat(f"tokenizer.json has token ids up to {max(vocab)}, beyond vocab_size {size}; "
                                f"nothing written", file=path)
    tokens, types = [], []
    for i in range(size):
        if i not in vocab:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(vocab[i])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            tokens.append(vocab[i])
            types.append(NORMAL)
    known = set(model["vocab"])
    for m in model.get("merges") or []:               # tokenizers' BPE refuses these too ("out of vocabulary")
        parts = m.split(" ") if isinstance(m, str) else m
        if not isinstance(parts, list) or len(parts) != 2 or not all(isinstance(p, str) for p in parts) \
                or not all(p in known for p in parts + ["".join(parts)]):
            raise CorruptCheckpoint(f"tokenizer.json's merge {m!r} is not two tokens of its vocabulary merging "
                                    f"into a third; nothing written", file=path)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    steps = [tok.get("pre_tokenizer") or {}]
    steps += steps[0].get("pretokenizers", []) if steps[0].get("type") == "Sequence" else []
    prefix = any(st.get("type") == "ByteLevel" and st.get("add_prefix_space") for st in steps)
    kv = [("tokenizer.ggml.model", "str", "gpt2"), ("tokenizer.ggml.pre", "str", pre),
          ("tokenizer.ggml.add_space_prefix", "bool", prefix),
          ("tokenizer.ggml.tokens", "str[]", tokens), ("tokenizer.ggml.token_type", "i32[]", types),
          ("tokenizer.ggml.merges", "str[]", merges)]
    tc = _tokenizer_config(folder, root)
    return kv + _special_tokens(tc, {t: i for i, t in vocab.items()}, config) + _add_and_template(tc, folder, root)


def _tokenizer_config(folder: Path, root) -> dict:
    tc_path = folder / "tokenizer_config.json"
    tc = load_json(tc_path, what="tokenizer_config.json") if root.check(tc_path) == "file" else {}
    return tc if isinstance(tc, dict) else {}


def _special_tokens(tc: Mapping, ids: Mapping[str, int], config: Mapping,
                    fallback: Mapping[str, int] | None = None) -> list[tuple[str, str, object]]:
    """bos / eos / unk / pad ids as gguf.SpecialVocab finds them: tokenizer_config.json's token by its
    content, else config.json's *_token_id (else ``fallback``'s)."""
    kv = []
    for kind in ("bos", "eos", "unk", "pad"):
        value = tc.get(f"{kind}_token")
        value = value.get("content") if isinstance(value, dict) else value
        tid = ids.get(value) if isinstance(value, str) else None
        if tid is None and isinstance(config.get(f"{kind}_token_id"), int):
            tid = config[f"{kind}_token_id"]
        if tid is None and fallback:
            tid = fallback.get(kind)
        if tid is not None:
            kv.append((ID_KEYS[kind], "u32", int(tid)))
    return kv


# llama.cpp's keys for the special ids (gguf-py's Keys.Tokenizer); qconv before 2026-12-05 wrote the pad id
# as tokenizer.ggml.pad_token_id, which llama.cpp does not read, and still reads it back
ID_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
           "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


def special_id(meta: Mapping, kind: str):
    """A GGUF's bos / eos / unk / pad id (None where it has none)."""
    tid = meta.get(ID_KEYS[kind])
    return meta.get("tokenizer.ggml.pad_token_id") if tid is None and kind == "pad" else tid


def _add_and_template(tc: Mapping, folder: Path, root, add: Mapping[str, bool] | None = None) -> list:
    """add_bos / add_eos (``add``'s, else tokenizer_config.json's) and the chat template
    (tokenizer_config.json's, else chat_template.jinja), as gguf.SpecialVocab writes them."""
    kv = []
    for kind in ("bos", "eos"):
        value = (add or {}).get(kind, tc.get(f"add_{kind}_token"))
        if isinstance(value, bool):
            kv.append((f"tokenizer.ggml.add_{kind}_token", "bool", value))
    template = tc.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if template is None and root.check(jinja) == "file":
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        kv.append(("tokenizer.chat_template", "str", template))
    return kv


def _sentencepiece_tokenizer(folder: Path, config: Mapping, root, tok) -> list[tuple[str, str, object]]:
    """tokenizer.model as llama.cpp's "llama" model, as convert_hf_to_gguf's _create_vocab_sentencepiece,
    _set_vocab_sentencepiece and LlamaModel.set_vocab write it: each piece, its score and its type (the
    piece types are llama.cpp's token types), padded to the model's vocab_size with [PADn] (score -10000,
    UNUSED); added_tokens.json's tokens USER_DEFINED, tokenizer_config.json's added_tokens_decoder's
    CONTROL where special (or looking special: <|...|>) and USER_DEFINED otherwise ("▁" as a space), each
    with score -1000; pre "default"; bos / eos / unk / pad ids, add_bos / add_eos, the chat template.

    Where the converter and sentencepiece disagree, this follows what makes llama.cpp tokenize as
    sentencepiece does:
    - a USER_DEFINED piece stays USER_DEFINED (the converter writes NORMAL, and llama.cpp would then break
      it up instead of matching it whole, as sentencepiece does);
    - add_space_prefix is the model's add_dummy_prefix (the converter writes none, so llama.cpp always
      prepends a space), or tokenizer_config.json's add_prefix_space where it has one (as the converter);
    - pieces past vocab_size are refused (the converter drops them with a warning: ids the model has no
      embedding row for); models llama.cpp cannot tokenize alike (Unigram, text normalization, collapsed
      whitespace) are refused (spm.check_llama_cpp_can_tokenize);
    - where tokenizer_config.json names no bos / eos / unk / pad token by a content the vocab has, nor
      config.json by id, the model's own ids (trainer_spec) are written (the converter writes none, and
      llama.cpp then assumes Llama's 1 / 2 / 0); the converter finds names only among tokenizer.json's
      added tokens, which are pieces here too, so real folders get the same ids;
    - a transformers-5 folder keeps its added tokens only in tokenizer.json: where tokenizer_config.json
      has no added_tokens_decoder, tokenizer.json's added_tokens stand for it (the converter would leave
      those ids [PADn])."""
    from . import spm

    model_path = folder / "tokenizer.model"
    model = spm.read_model(model_path)
    spm.check_llama_cpp_can_tokenize(model, model_path)
    config = text_config(config)
    n = len(model.pieces)
    size = int(config.get("vocab_size") or n)
    if n > size:
        raise UnsupportedFormat(f"SentencePiece model has {n} pieces, more than the model's vocab_size {size}; "
                                f"nothing written", file=model_path)
    tokens = list(model.pieces) + [f"[PAD{i}]" for i in range(n, size)]
    scores = list(model.scores) + [-10000.0] * (size - n)
    types = list(model.types) + [UNUSED] * (size - n)
    added_path = folder / "added_tokens.json"
    if root.check(added_path, "added_tokens.json") == "file":
        added = load_json(added_path, what="added_tokens.json")
        if not isinstance(added, dict) or not all(isinstance(i, int) and i >= 0 for i in added.values()):
            raise CorruptCheckpoint("added_tokens.json must map each token to its id", file=added_path)
        for content, i in added.items():
            if i < size:                              # the converter skips ids past vocab_size with a warning
                tokens[i], scores[i], types[i] = content, -1000.0, USER_DEFINED
    tc = _tokenizer_config(folder, root)
    decoder = tc.get("added_tokens_decoder")
    if decoder is None:
        decoder = {a.get("id"): a for a in tok.get("added_tokens") or [] if isinstance(a, dict)} \
            if isinstance(tok, dict) else {}
    where = folder / ("tokenizer_config.json" if "added_tokens_decoder" in tc else "tokenizer.json")
    if not isinstance(decoder, dict):
        raise CorruptCheckpoint("added_tokens_decoder must map ids to tokens", file=where)
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not str(key).isdigit():
            raise CorruptCheckpoint(f"added token {key!r} has no id and content", file=where)
        i = int(key)
        if i >= size:
            continue
        if entry.get("special") or _looks_special(content):
            types[i] = CONTROL
        else:
            content, types[i] = content.replace("\u2581", " "), USER_DEFINED     # pre-normalized user-defined spaces
        tokens[i], scores[i] = content, -1000.0
    prefix = tc.get("add_prefix_space")
    kv = [("tokenizer.ggml.model", "str", "llama"), ("tokenizer.ggml.pre", "str", "default"),
          ("tokenizer.ggml.add_space_prefix", "bool", prefix if isinstance(prefix, bool) else model.add_dummy_prefix),
          ("tokenizer.ggml.tokens", "str[]", tokens), ("tokenizer.ggml.scores", "f32[]", scores),
          ("tokenizer.ggml.token_type", "i32[]", types)]
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    own = {k: i for k, i in model.special_ids if 0 <= i < size}
    return kv + _special_tokens(tc, ids, config, own) + _add_and_template(tc, folder, root, _post_processor(tok, tc))


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf's does_token_look_special: added tokens some models leave unmarked."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _post_processor(tok, tc: Mapping) -> dict[str, bool]:
    """add_bos / add_eos from tokenizer.json's TemplateProcessing, which gguf.SpecialVocab prefers to
    tokenizer_config.json's add_*_token: whether its single-sequence template starts with the bos token
    and ends with the eos token (where it has a special token there)."""
    post = tok.get("post_processor") if isinstance(tok, dict) else None
    if not isinstance(post, dict):
        return {}
    add = {}
    for proc in post.get("processors", [post]) if isinstance(post.get("processors", [post]), list) else []:
        single = proc.get("single") if isinstance(proc, dict) and proc.get("type") == "TemplateProcessing" else None
        if not isinstance(single, list) or len(single) < 2:
            continue
        names = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in tc.items() if k in ("bos_token", "eos_token")}
        first, last = (x.get("SpecialToken", {}).get("id") if isinstance(x, dict) else None for x in (single[0], single[-1]))
        if first:
            add["bos"] = first == names.get("bos_token")
        if last:
            add["eos"] = last == names.get("eos_token")
    return add


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


_PRE_SPLIT = {v: k for k, v in _PRE_BY_REGEX.items() if v != "gpt-2"}


def tokenizer_warning(meta: Mapping) -> str | None:
    """What a folder read back from a GGUF lacks: a tokenizer qconv does not rebuild (a model other than
    llama.cpp's "gpt2" and "llama"); None where tokenizer_files() rebuilds it or the file has none."""
    model = meta.get("tokenizer.ggml.model")
    if model in (None, "gpt2", "llama"):
        return None
    return (f"its tokenizer model {model!r} is not one qconv rebuilds into tokenizer files: the folder has no "
            f"tokenizer; copy the original model's tokenizer files into it")


def tokenizer_files(meta: Mapping, where) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json rebuilt from a GGUF's byte-level BPE tokenizer (llama.cpp's
    "gpt2" model): the inverse of tokenizer(): [PADn] padding (UNUSED) left out, CONTROL tokens as special
    added tokens, USER_DEFINED as plain added tokens; a "llama" (SentencePiece) one: _llama_tokenizer_json.
    {} where the file has no tokenizer of those kinds (tokenizer_warning says so)."""
    if meta.get("tokenizer.ggml.model") == "llama":
        return {"tokenizer.json": _llama_tokenizer_json(meta), "tokenizer_config.json": _tokenizer_config_of(meta)}
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return {}
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    merges = meta.get("tokenizer.ggml.merges") or []
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre != "gpt-2" and pre not in _PRE_SPLIT:
        raise UnsupportedFormat(f"its tokenizer's pre-tokenizer {pre!r} is not one qconv maps back to "
                                f"tokenizer.json; nothing written", file=where)
    vocab, added = {}, []
    for i, t in enumerate(tokens):
        kind = types[i] if i < len(types) else NORMAL
        if kind == UNUSED:
            continue
        vocab[t] = i
        if kind in (CONTROL, USER_DEFINED):
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": kind == USER_DEFINED, "special": kind == CONTROL})
    byte_level = {"type": "ByteLevel", "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
                  "trim_offsets": True, "use_regex": pre == "gpt-2"}
    unk = special_id(meta, "unk")
    unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    if pre == "gpt-2":
        pre_tok = byte_level
    else:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _PRE_SPLIT[pre]}, "behavior": "Isolated", "invert": False},
            byte_level]}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": pre_tok, "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": [m.split(" ", 1) for m in merges]}}
    return {"tokenizer.json": tok, "tokenizer_config.json": _tokenizer_config_of(meta)}


def _tokenizer_config_of(meta: Mapping) -> dict:
    """tokenizer_config.json from a GGUF's special ids, add_bos / add_eos and chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    tc = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for kind in ("bos", "eos", "unk", "pad"):
        tid = special_id(meta, kind)
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            tc[f"{kind}_token"] = tokens[tid]
    for kind in ("bos", "eos"):
        if isinstance(meta.get(f"tokenizer.ggml.add_{kind}_token"), bool):
            tc[f"add_{kind}_token"] = meta[f"tokenizer.ggml.add_{kind}_token"]
    if isinstance(meta.get("tokenizer.chat_template"), str):
        tc["chat_template"] = meta["tokenizer.chat_template"]
    return tc


def _llama_tokenizer_json(meta: Mapping) -> dict:
    """tokenizer.json for llama.cpp's "llama" vocabulary, as transformers' LlamaConverter makes one from a
    SentencePiece BPE model (Llama-2's tokenizer.json): a BPE model with byte fallback over every piece
    but the [PADn] padding (UNUSED), its merges every split of a NORMAL piece into two pieces, in the
    order of the merged piece's score (SentencePieceExtractor); a "▁" prepended (add_space_prefix) and
    spaces as "▁" by the normalizer; CONTROL, UNKNOWN and USER_DEFINED tokens added (the first two
    special); bos (and eos) added as add_bos / add_eos say (llama.cpp's defaults: bos yes, eos no).
    Tested: the same ids as sentencepiece on the fixture's strings, but text that spells a special token
    (<s>), which transformers matches as the token."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    scores = meta.get("tokenizer.ggml.scores") or []
    kind = [types[i] if i < len(types) else NORMAL for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if kind[i] != UNUSED:
            vocab.setdefault(t, i)
    ranked = []
    for i, t in enumerate(tokens):
        if kind[i] != NORMAL or vocab.get(t) != i:
            continue
        splits = sorted(((t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab),
                        key=lambda p: (vocab[p[0]], vocab[p[1]]))
        score = float(scores[i]) if i < len(scores) else 0.0
        ranked += [(-score, i, n, list(p)) for n, p in enumerate(splits)]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": kind[i] == USER_DEFINED, "special": kind[i] != USER_DEFINED}
             for i, t in enumerate(tokens) if kind[i] in (CONTROL, UNKNOWN, USER_DEFINED)]
    unk = special_id(meta, "unk")
    unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    norm = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if meta.get("tokenizer.ggml.add_space_prefix", True):   # llama.cpp's default for "llama"
        norm.insert(0, {"type": "Prepend", "prepend": "\u2581"})
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    ends, special = {}, {}
    for kind_, default in (("bos", True), ("eos", False)):
        tid = special_id(meta, kind_)
        if meta.get(f"tokenizer.ggml.add_{kind_}_token", default) and isinstance(tid, int) and 0 <= tid < len(tokens):
            ends[kind_] = tokens[tid]
            special[tokens[tid]] = {"id": tokens[tid], "ids": [tid], "tokens": [tokens[tid]]}

    def template(seq: str, type_id: int) -> list:
        return ([{"SpecialToken": {"id": ends["bos"], "type_id": type_id}}] if "bos" in ends else []) + \
            [{"Sequence": {"id": seq, "type_id": type_id}}] + \
            ([{"SpecialToken": {"id": ends["eos"], "type_id": type_id}}] if "eos" in ends else [])

    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": norm}, "pre_tokenizer": None,
            "post_processor": {"type": "TemplateProcessing", "single": template("A", 0),
                               "pair": template("A", 0) + template("B", 1), "special_tokens": special},
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": [p for *_, p in sorted(ranked)]}}


# The tensors structure.disagreements compares with, llama.cpp's names to Hugging Face's (stdlib: inspect)
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
