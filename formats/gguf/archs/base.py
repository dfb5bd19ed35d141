"""What a GGUF architecture declares (Arch: the text model; Vision: a VL model's vision tower as llama.cpp's
mmproj file; Unwritten: one llama.cpp has that qconv refuses to write, saying why), the registries of
those declared (register, register_unwritten: one declaration a model_type or class, a duplicate
refused), and what the vision towers declared so far share (the clip keys every tower writes and reads
back, the tensors every merger graph needs). Stdlib; each module of this package declares one family of
architectures, and the package's __init__ imports every one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ....errors import CorruptCheckpoint, UnsupportedFormat
from ...core.structure import declare_attention_types


@dataclass(frozen=True)
class Vision:
    """A VL model's vision tower as llama.cpp's mmproj file (general.architecture "clip"), both ways."""
    projector: str                   # clip.projector_type (mmproj.plan writes it, read_back expects it)
    names: Callable                  # (rest of the HF name after visual., config) -> [(gguf name, part)] or None
    keys: Callable                   # (config, vision, preprocessor, where) -> its other [(key, kind, value)]
    required: Callable               # (vision) -> the GGUF tensors llama.cpp's graph needs
    hf_names: Callable               # (vision config) -> the tower's Hugging Face tensors (after model.visual.)
    vision_config: Callable          # (clip metadata, GGUF shapes, where) -> the vision_config read back
    text_model_type: str             # the VL config's text_config model_type, read back
    processor: Mapping               # what read back's preprocessor_config.json holds besides the clip keys'
    tokens: Mapping = field(default_factory=dict)   # config.json's token ids: key -> (token, the released id),
                                     # the tokenizer's own id where the GGUF has that token
    prefixes: tuple = ("model.visual.", "visual.")   # where its tensors lie in the VL checkpoint
    # what clip_keys.py checks of its mmproj file's keys against its tensors
    activation: str = "clip.use_silu"  # the key saying its MLP's activation (set; the other, clip.use_gelu, not)
    windowed: bool = False           # windowed attention: clip.vision.n_wa_pattern, required
    fused_qkv: bool = False          # v.blk.N.attn_qkv: q, k and v rows in one tensor
    deepstack: bool = False          # v.deepstack.L mergers, flagged by clip.vision.is_deepstack_layers


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
                                   # gguf architecture does; the vision tower is llama.cpp's mmproj file
    deepstack: bool = False        # n_deepstack_layers, the vision tower's layers added to the first ones (qwen3vl)
    vision: Vision | None = None   # a VL model's tower, written as (and read back from) the mmproj file
    attention: bool = True         # its attention and MLP shapes follow the config (core/structure.py checks them)


@dataclass(frozen=True)
class Unwritten:
    """An architecture llama.cpp has but cannot compute as the checkpoint holds it: refused, saying why."""
    hf_class: str                  # the Hugging Face architecture (config.json "architectures")
    label: str                     # the model's name, as the refusal says it
    why: Callable                  # (the checkpoint's tensor names) -> the reasons, each a clause


ARCHS: dict[str, Arch] = {}          # Hugging Face model_type -> its declaration, in the order declared
BY_GGUF_NAME: dict[str, Arch] = {}   # gguf's architecture name -> the same
VISION: dict[str, Vision] = {}       # a VL model_type -> its tower (mmproj.py's towers)
UNWRITTEN: dict[str, Unwritten] = {}  # Hugging Face class -> why qconv does not write it (arch.refuse_unwritten)


def register(arch: Arch) -> Arch:
    """Declare an architecture; a model_type or gguf name already declared is refused (two modules
    claiming one model would make which one wins depend on the import order)."""
    if arch.model_type in ARCHS or arch.name in BY_GGUF_NAME:
        raise ValueError(f"GGUF architecture {arch.name!r} ({arch.model_type}) is declared twice")
    ARCHS[arch.model_type] = arch
    BY_GGUF_NAME[arch.name] = arch
    if arch.vision is not None:
        VISION[arch.model_type] = arch.vision
    if arch.attention:
        declare_attention_types(arch.model_type, *((arch.vision.text_model_type,) if arch.vision else ()))
    return arch


def register_unwritten(refused: Unwritten) -> Unwritten:
    """Declare an architecture qconv refuses to write as GGUF; a class declared twice is refused."""
    if refused.hf_class in UNWRITTEN:
        raise ValueError(f"{refused.hf_class} is declared unwritten twice")
    UNWRITTEN[refused.hf_class] = refused
    return refused


def vision_prefixes() -> tuple[str, ...]:
    """Where every declared vision tower's tensors lie (a tensor there is not the text model's)."""
    return tuple(dict.fromkeys(p for v in VISION.values() for p in v.prefixes))


# --- what the vision towers declared share ----------------------------------------------------------

TIME = [("v.patch_embd.weight", ("time", 0)), ("v.patch_embd.weight.1", ("time", 1))]   # Conv3d: two Conv2d


def blocks(rest: str):
    """(vision layer, the rest of its name) of a tower tensor in blocks.N., else (None, None)."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", rest)
    return (int(m.group(1)), m.group(2)) if m else (None, None)


def positive(section: Mapping, key: str, where) -> int:
    """vision_config's KEY, a positive integer (refused naming it otherwise)."""
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CorruptCheckpoint(f"vision_config.{key} {value!r} is not a positive integer", file=where)
    return value


def common_keys(config: Mapping, vision: Mapping, pre: Mapping, where) -> list:
    """The clip keys every merger tower writes (MmprojModel.set_gguf_parameters)."""
    text = config.get("text_config") or config
    keys = [("clip.has_vision_encoder", "bool", True),
            ("clip.vision.projection_dim", "u32", positive(text, "hidden_size", where)),
            ("clip.vision.patch_size", "u32", positive(vision, "patch_size", where)),
            ("clip.vision.embedding_length", "u32", positive(vision, "hidden_size", where)),
            ("clip.vision.feed_forward_length", "u32", positive(vision, "intermediate_size", where)),
            ("clip.vision.block_count", "u32", positive(vision, "depth", where)),
            ("clip.vision.attention.head_count", "u32", positive(vision, "num_heads", where)),
            ("clip.vision.image_mean", "f32[]", pre["image_mean"]),
            ("clip.vision.image_std", "f32[]", pre["image_std"])]
    out = vision.get("out_hidden_size")
    if out is not None and out != text.get("hidden_size"):
        raise UnsupportedFormat(f"vision_config.out_hidden_size {out} is not the text model's hidden_size "
                                f"{text.get('hidden_size')}: llama.cpp feeds the merger's output to the text model "
                                f"as its embeddings", file=where)
    return keys


def required(vision: Mapping, per_layer: tuple, extra: tuple) -> list[str]:
    """The tensors a merger graph needs: the merger, the patch kernels, EXTRA, and PER_LAYER in every layer."""
    names = ["mm.0.weight", "mm.0.bias", "mm.2.weight", "mm.2.bias", "v.patch_embd.weight", "v.patch_embd.weight.1",
             "v.post_ln.weight", *extra]
    for n in range(int(vision.get("depth") or 0)):
        names += [f"v.blk.{n}.{t}" for t in per_layer]
    return names


def common_vision(meta: Mapping, where) -> dict:
    """The vision_config every merger tower reads back from its clip keys (the inverse of common_keys)."""
    def u(key):
        value = meta.get(f"clip.vision.{key}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CorruptCheckpoint(f"its clip.vision.{key} is {value!r}, not a positive integer", file=where)
        return value
    return {"depth": u("block_count"), "hidden_size": u("embedding_length"), "intermediate_size":
            u("feed_forward_length"), "num_heads": u("attention.head_count"), "in_channels": 3,
            "out_hidden_size": u("projection_dim"), "patch_size": u("patch_size"),
            "spatial_merge_size": u("spatial_merge_size") if "clip.vision.spatial_merge_size" in meta else 2,
            "temporal_patch_size": 2,
            "initializer_range": 0.02}
