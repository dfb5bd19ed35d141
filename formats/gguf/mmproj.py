"""A VL model's vision tower as llama.cpp's mmproj file (general.architecture "clip"), written beside the
text model by `qconv convert SRC out.gguf --to gguf` as `mmproj-out.gguf` (llama.cpp's own naming), so
llama.cpp's libmtmd runs the model whole: the text GGUF and this one.

What is written is what llama.cpp's converter writes for the model (`convert_hf_to_gguf.py --mmproj`:
conversion/qwenvl.py Qwen2VLVisionModel, conversion/qwen3vl.py Qwen3VLVisionModel, MmprojModel in
conversion/base.py) and what its loader reads (tools/mtmd/clip.cpp, models/qwen2vl.cpp, qwen3vl.cpp):

* Qwen2.5-VL (`qwen2.5vl_merger`): the fused q / k / v rows split into attn_q / attn_k / attn_v, a gated
  SiLU MLP (ffn_gate / ffn_up / ffn_down), RMSNorms, windowed attention (`n_wa_pattern`), no position
  embedding and no patch bias;
* Qwen3-VL (`qwen3vl_merger`): fused attn_qkv, a GELU MLP, LayerNorms, a learned position embedding, a
  patch bias and the deepstack mergers (`v.deepstack.L.*`, L the vision layer they follow);
* both: the Conv3d patch embedding [hidden, 3, 2, p, p] as two Conv2d kernels, one per temporal slice
  (`v.patch_embd.weight`, `.weight.1`), and the merger as `v.post_ln` + `mm.0` / `mm.2`.

Types, as the converter's: 1-D tensors (norms, biases) and the position embedding F32, the patch kernels
F16 when the type is f16 else F32, the 2-D weights in --mmproj-type (auto: each tensor's own dtype; a
quantized Linear of the tower, dequantized exactly, F32). A conversion that rounds is reported per tensor.

The plan is made from headers and configs (config.json, preprocessor_config.json's image_mean / std)
before anything is written; what llama.cpp cannot represent, or a source that disagrees with itself, is
refused naming the file and the key or tensor. Tensors are then read and written one at a time.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat, ValidationFailed
from ..storage.checkpoint import Component
from ..storage.safetensors_header import TensorInfo
from .arch import VISION_PREFIXES, add_key, is_vision
from .clip_keys import checked
from .header import read_header
from .split import _NAME as SPLIT_SUFFIX

PREPROCESSOR = "preprocessor_config.json"
_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
QK = 32                                  # Q8_0's block: 32 weights of one row, one float16 scale


@dataclass(frozen=True)
class VisionModel:
    model_type: str                  # the Hugging Face model_type
    projector: str                   # clip.projector_type (plan writes it)
    names: Callable                  # (rest of the HF name after visual., config) -> [(gguf name, part)] or None
    keys: Callable                   # (config, vision, preprocessor, where) -> its other [(key, kind, value)]
    required: Callable               # (vision) -> the GGUF tensors llama.cpp's graph needs


@dataclass(frozen=True)
class Planned:
    name: str                        # GGUF tensor name
    source: str                      # the Hugging Face tensor (or quantized module's weight) it comes from
    part: tuple | None               # ("rows", i, n): i-th of n row blocks; ("time", t): the t-th temporal kernel
    shape: tuple                     # numpy shape of the values written
    type_name: str                   # F32, F16, BF16 or Q8_0
    module: object = None            # the quantized module (QuantModule) whose weight this is, else None


def _blocks(rest: str):
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", rest)
    return (int(m.group(1)), m.group(2)) if m else (None, None)


_TIME = [("v.patch_embd.weight", ("time", 0)), ("v.patch_embd.weight.1", ("time", 1))]


def _qwen25_names(rest: str, config: Mapping):
    if rest == "patch_embed.proj.weight":
        return _TIME
    if rest == "merger.ln_q.weight":
        return [("v.post_ln.weight", None)]
    m = re.fullmatch(r"merger\.mlp\.([02])\.(weight|bias)", rest)
    if m:
        return [(f"mm.{m.group(1)}.{m.group(2)}", None)]
    n, tail = _blocks(rest)
    if n is None:
        return None
    leaf = tail.rsplit(".", 1)
    if tail in ("attn.qkv.weight", "attn.qkv.bias"):
        return [(f"v.blk.{n}.attn_{x}.{leaf[1]}", ("rows", i, 3)) for i, x in enumerate("qkv")]
    own = {"attn.proj": "attn_out", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
           "norm1": "ln1", "norm2": "ln2"}.get(leaf[0])
    return [(f"v.blk.{n}.{own}.{leaf[1]}", None)] if own and len(leaf) == 2 else None


def _qwen3_names(rest: str, config: Mapping):
    vision = config.get("vision_config") or {}
    if rest == "patch_embed.proj.weight":
        return _TIME
    fixed = {"patch_embed.proj.bias": "v.patch_embd.bias", "pos_embed.weight": "v.position_embd.weight"}
    if rest in fixed:
        return [(fixed[rest], None)]
    sub = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    m = re.fullmatch(r"merger\.(norm|linear_fc1|linear_fc2)\.(weight|bias)", rest)
    if m:
        return [({"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[m.group(1)] + f".{m.group(2)}", None)]
    m = re.fullmatch(r"deepstack_merger_list\.(\d+)\.(norm|linear_fc1|linear_fc2)\.(weight|bias)", rest)
    if m:
        indexes = vision.get("deepstack_visual_indexes") or []
        k = int(m.group(1))
        if k >= len(indexes):
            return None
        return [(f"v.deepstack.{indexes[k]}.{sub[m.group(2)]}.{m.group(3)}", None)]
    n, tail = _blocks(rest)
    if n is None:
        return None
    leaf = tail.rsplit(".", 1)
    own = {"attn.qkv": "attn_qkv", "attn.proj": "attn_out", "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down",
           "norm1": "ln1", "norm2": "ln2"}.get(leaf[0])
    return [(f"v.blk.{n}.{own}.{leaf[1]}", None)] if own and len(leaf) == 2 else None


def _common_keys(config: Mapping, vision: Mapping, pre: Mapping, where) -> list:
    text = config.get("text_config") or config
    keys = [("clip.has_vision_encoder", "bool", True),
            ("clip.vision.projection_dim", "u32", _int(text, "hidden_size", where)),
            ("clip.vision.patch_size", "u32", _int(vision, "patch_size", where)),
            ("clip.vision.embedding_length", "u32", _int(vision, "hidden_size", where)),
            ("clip.vision.feed_forward_length", "u32", _int(vision, "intermediate_size", where)),
            ("clip.vision.block_count", "u32", _int(vision, "depth", where)),
            ("clip.vision.attention.head_count", "u32", _int(vision, "num_heads", where)),
            ("clip.vision.image_mean", "f32[]", pre["image_mean"]),
            ("clip.vision.image_std", "f32[]", pre["image_std"])]
    out = vision.get("out_hidden_size")
    if out is not None and out != text.get("hidden_size"):
        raise UnsupportedFormat(f"vision_config.out_hidden_size {out} is not the text model's hidden_size "
                                f"{text.get('hidden_size')}: llama.cpp feeds the merger's output to the text model "
                                f"as its embeddings", file=where)
    return keys


def _qwen25_keys(config: Mapping, vision: Mapping, pre: Mapping, where) -> list:
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
    return _common_keys(config, vision, pre, where) + [
        ("clip.vision.image_size", "u32", int(vision.get("image_size", 560))),
        ("clip.use_silu", "bool", True),
        ("clip.vision.n_wa_pattern", "u32", full[0] + 1),
        ("clip.vision.attention.layer_norm_epsilon", "f32", float(config.get("rms_norm_eps", 1e-6))),
    ]


def _qwen3_keys(config: Mapping, vision: Mapping, pre: Mapping, where) -> list:
    positions = _int(vision, "num_position_embeddings", where)
    side = math.isqrt(positions)
    if side * side != positions:
        raise UnsupportedFormat(f"vision_config.num_position_embeddings {positions} is not a square grid, which "
                                f"llama.cpp's qwen3vl graph interpolates its position embedding as", file=where)
    depth = _int(vision, "depth", where)
    indexes = vision.get("deepstack_visual_indexes") or []
    if not all(isinstance(i, int) and 0 <= i < depth for i in indexes) or len(set(indexes)) != len(indexes):
        raise CorruptCheckpoint(f"vision_config.deepstack_visual_indexes {indexes!r} are not distinct layers of "
                                f"its {depth} vision layers", file=where)
    text = config.get("text_config") or {}
    keys = _common_keys(config, vision, pre, where) + [
        ("clip.vision.image_size", "u32", int(vision.get("image_size") or side * _int(vision, "patch_size", where))),
        ("clip.use_gelu", "bool", True)]
    if "spatial_merge_size" in vision:
        keys.append(("clip.vision.spatial_merge_size", "u32", _int(vision, "spatial_merge_size", where)))
    return keys + [("clip.vision.attention.layer_norm_epsilon", "f32", float(text.get("rms_norm_eps", 1e-6))),
                   ("clip.vision.is_deepstack_layers", "bool[]", [i in indexes for i in range(depth)])]


def _required(vision: Mapping, per_layer: tuple, extra: tuple) -> list[str]:
    names = ["mm.0.weight", "mm.0.bias", "mm.2.weight", "mm.2.bias", "v.patch_embd.weight", "v.patch_embd.weight.1",
             "v.post_ln.weight", *extra]
    for n in range(int(vision.get("depth") or 0)):
        names += [f"v.blk.{n}.{t}" for t in per_layer]
    return names


MODELS = {v.model_type: v for v in (
    VisionModel("qwen2_5_vl", "qwen2.5vl_merger", _qwen25_names, _qwen25_keys,
                lambda vision: _required(vision, ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_out.weight",
                                                  "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
                                                  "ln1.weight", "ln2.weight"), ())),
    VisionModel("qwen3_vl", "qwen3vl_merger", _qwen3_names, _qwen3_keys,
                lambda vision: _required(vision, ("attn_qkv.weight", "attn_qkv.bias", "attn_out.weight",
                                                  "ffn_up.weight", "ffn_down.weight", "ln1.weight", "ln2.weight"),
                                         ("v.patch_embd.bias", "v.position_embd.weight"))
                + [f"v.deepstack.{i}.{t}" for i in vision.get("deepstack_visual_indexes") or []
                   for t in ("norm.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]),
)}
MODELS["qwen3_vl_moe"] = replace(MODELS["qwen3_vl"], model_type="qwen3_vl_moe")     # Qwen3-VL's tower, MoE text


def _int(section: Mapping, key: str, where) -> int:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CorruptCheckpoint(f"vision_config.{key} {value!r} is not a positive integer", file=where)
    return value


def mmproj_name(dst: Path) -> str:
    """llama.cpp's naming: mmproj-<the text model's file name>."""
    return f"mmproj-{dst.name}"


def preprocessor(comp: Component) -> tuple[dict | None, Path]:
    """The image processor's config (preprocessor_config.json, or processor_config.json's image_processor,
    as the converter reads them; a GGUF pair's as read back), None where the folder has neither."""
    made = comp.made_files() if comp.made_files is not None else {}
    if isinstance(made.get(PREPROCESSOR), dict):      # a GGUF pair's, from its mmproj file (read_back)
        return made[PREPROCESSOR], comp.path
    folder = comp.path if comp.path.is_dir() else comp.path.parent
    for name, inner in ((PREPROCESSOR, None), ("processor_config.json", "image_processor")):
        path = folder / name
        if path.is_file():
            try:
                doc = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CorruptCheckpoint(f"is not valid JSON: {exc}", file=path) from None
            doc = doc.get(inner) if inner and isinstance(doc, dict) else doc
            if isinstance(doc, dict):
                return doc, path
    return None, folder / PREPROCESSOR


def _checked_preprocessor(pre: Mapping, vision: Mapping, path: Path) -> dict:
    for key in ("image_mean", "image_std"):
        value = pre.get(key)
        if not isinstance(value, list) or len(value) != 3 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value) \
                or (key == "image_std" and not all(v > 0 for v in value)):
            raise CorruptCheckpoint(f"{key} {value!r} is not three finite numbers (one per RGB channel"
                                    f"{', positive' if key == 'image_std' else ''})", file=path)
    for key, config_key in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                            ("merge_size", "spatial_merge_size")):
        if key in pre and config_key in vision and pre[key] != vision[config_key]:
            raise CorruptCheckpoint(f"{key} {pre[key]!r} disagrees with config.json's vision_config.{config_key} "
                                    f"{vision[config_key]!r}", file=path)
    return {"image_mean": [float(v) for v in pre["image_mean"]], "image_std": [float(v) for v in pre["image_std"]]}


def plan(comp: Component, modules, mmproj_type: str) -> tuple[VisionModel, list, list[Planned]] | str:
    """(model, keys, tensors) of the mmproj file, from headers and configs; or, where the model has no vision
    tower qconv writes, why not (a sentence for the report). Refusals name the file and the key or tensor."""
    config = comp.config or {}
    vision_names = [n for n in comp.tensors if is_vision(n)]
    if not vision_names:
        return "no vision tower"
    where = comp.path / "config.json"
    model = MODELS.get(config.get("model_type"))
    if model is None:
        raise UnsupportedFormat(f"is a {config.get('model_type')!r} model with a vision tower, which qconv does not "
                                f"write as a llama.cpp mmproj file (it writes {', '.join(MODELS)}); pass --no-mmproj "
                                f"for the text model alone", file=where)
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise CorruptCheckpoint("has vision tensors but no vision_config", file=where)
    pre, pre_path = preprocessor(comp)
    if pre is None:
        raise UnsupportedFormat(f"is missing: llama.cpp's mmproj file needs the image processor's image_mean and "
                                f"image_std; add the model's {PREPROCESSOR}, or pass --no-mmproj for the text model "
                                f"alone", file=pre_path)
    pre = _checked_preprocessor(pre, vision, pre_path)
    if vision.get("temporal_patch_size", 2) != 2:
        raise UnsupportedFormat(f"vision_config.temporal_patch_size {vision['temporal_patch_size']}: llama.cpp's "
                                f"graph adds two temporal kernels (v.patch_embd.weight and .weight.1)", file=where)
    keys = [("clip.projector_type", "str", model.projector)] + model.keys(config, vision, pre, where)
    owner = {t: m for m in modules if is_vision(m.name) for t in (*m.weight_tensors, *m.state_tensors)}
    planned: dict[str, Planned] = {}
    for name in vision_names:
        info = comp.tensors[name]
        m = owner.get(name)
        if m is not None and name not in m.weight_tensors[:1]:
            continue                                   # a quantized module's other leaves: its weight stands for them
        hf = m.name + ".weight" if m is not None else name
        rest = hf[len(next(p for p in VISION_PREFIXES if hf.startswith(p))):]
        targets = model.names(rest, config)
        if targets is None:
            raise UnsupportedFormat(f"is a vision-tower tensor llama.cpp's {model.projector} mmproj has no place for",
                                    file=info.file, tensor=name)
        shape = (m.out_features, m.in_features) if m is not None else tuple(info.shape)
        source_code = "F32" if m is not None else info.dtype
        if m is None and source_code not in ("F32", "F16", "BF16"):
            raise UnsupportedFormat(f"is {info.dtype}, which qconv does not write to an mmproj file", file=info.file,
                                    tensor=name)
        for gguf_name, part in targets:
            out = _part_shape(shape, part, info, name)
            planned[gguf_name] = Planned(gguf_name, hf, part, out,
                                         _type(gguf_name, out, source_code, mmproj_type), m)
    missing = [t for t in model.required(vision) if t not in planned]
    if missing:
        raise CorruptCheckpoint(f"has no vision-tower tensor for {missing[0]}, which llama.cpp's {model.projector} "
                                f"graph needs" + (f", nor for {len(missing) - 1} more" if len(missing) > 1 else ""),
                                file=comp.path)
    return model, keys, sorted(planned.values(), key=lambda p: _order(p.name))


def _part_shape(shape: tuple, part, info, name) -> tuple:
    if part is None:
        return shape
    if part[0] == "rows":
        if shape[0] % part[2]:
            raise CorruptCheckpoint(f"has {shape[0]} rows, not q, k and v of equal size", file=info.file, tensor=name)
        return (shape[0] // part[2],) + tuple(shape[1:])
    if len(shape) != 5 or shape[2] != 2 or shape[1] != 3:
        raise UnsupportedFormat(f"is a patch embedding of shape {list(shape)}, not the [hidden, 3, 2, p, p] Conv3d "
                                f"llama.cpp splits into two Conv2d kernels", file=info.file, tensor=name)
    return (shape[0], shape[1], shape[3], shape[4])


def _type(name: str, shape: tuple, source_code: str, mmproj_type: str) -> str:
    """The converter's rules (conversion/base.py prepare_tensors, MmprojModel.tensor_force_quant): a
    q8_0 weight whose rows are not whole 32-weight blocks is F16, as the converter falls back to."""
    if ".patch_embd.weight" in name:
        return "F16" if mmproj_type == "f16" or (mmproj_type == "auto" and source_code == "F16") else "F32"
    if len(shape) <= 1 or name == "v.position_embd.weight" or not name.endswith(".weight"):
        return "F32"
    if mmproj_type == "q8_0" and shape[-1] % QK:
        return "F16"
    return source_code if mmproj_type == "auto" else _TYPES[mmproj_type]


def _nbytes(t: Planned) -> int:
    import numpy as np

    if t.type_name == "Q8_0":
        return t.shape[0] * (t.shape[1] // QK) * (2 + QK)
    return int(np.prod(t.shape, dtype=np.int64)) * {"F32": 4, "F16": 2, "BF16": 2}[t.type_name]


def _order(name: str):
    parts = re.split(r"(\d+)", name)
    return [int(p) if p.isdigit() else p for p in parts]


def write(comp: Component, det, path: Path, planned) -> dict:
    """Write the planned mmproj file at path, one source tensor at a time; the report's "mmproj" entry."""
    import gguf
    import numpy as np

    from .codec import Rounding

    model, keys, tensors = planned
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_string("general.name", comp.path.name)
    for key, kind, value in keys:
        add_key(writer, key, kind, value)
    weights = [t.type_name for t in tensors if len(t.shape) == 2]      # general.file_type: most 2-D weights'
    writer.add_uint32("general.file_type", {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}[max(sorted(set(weights)),
                                                                                       key=weights.count)])
    writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    writer.add_string("general.quantized_by", "qconv")
    raw = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "Q8_0": np.uint8}
    for t in tensors:
        shape = (t.shape[0], _nbytes(t) // t.shape[0]) if t.type_name == "Q8_0" else t.shape
        writer.add_tensor_info(t.name, shape, np.dtype(raw[t.type_name]), _nbytes(t),
                               raw_dtype=None if t.type_name in ("F32", "F16") else
                               getattr(gguf.GGMLQuantizationType, t.type_name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    rounded, quantized, dequantized, kept = [], [], set(), set()
    encoded = (None, None)                             # (source, its Q8_0 blocks): a split source encoded once
    for t, whole, values, info, qt in _values(comp, det, tensors):
        how = None
        if t.type_name == "Q8_0":
            if encoded[0] != t.source:
                encoded = (t.source, _q8_0(whole, qt, info, t.source))
            stored, how = _rows_of(encoded[1], t.part)
            quantized.append({"tensor": t.name, "source": t.source, **how, **_q8_0_error(stored, values)})
        else:
            rounding = Rounding(t.type_name, t.source, info.file, hint="--mmproj-type f32")
            stored = rounding.encode(values)
            if rounding.values:
                rounded.append({"tensor": t.name, "source": t.source, "to": t.type_name, "values": rounding.values,
                                "max_rel_error": rounding.max_rel_error})
        if t.module is not None:                       # a quantized Linear: its codes kept, or dequantized
            (kept if how is not None and how["codes"] == "kept" else dequantized).add(t.module.name)
        stored = np.ascontiguousarray(stored)
        if stored.nbytes != _nbytes(t):
            raise AssertionError(f"{t.name}: {stored.nbytes} bytes encoded, {_nbytes(t)} planned")
        writer.write_padding(fout, fout.tell())
        fout.write(memoryview(stored).cast("B"))
        writer.write_padding(fout, stored.nbytes)
    writer.close()
    types: dict[str, int] = {}
    for t in tensors:
        types[t.type_name] = types.get(t.type_name, 0) + 1
    return {"file": path.name, "projector": model.projector, "tensors": len(tensors),
            "gguf_types": dict(sorted(types.items())), "dequantized_modules": len(dequantized - kept),
            "codes_kept_modules": len(kept),
            "float_rounded": rounded, **({"q8_0": quantized} if quantized else {})}


def _q8_0(whole, qt, info, source: str) -> tuple:
    """(Q8_0 blocks of a whole source tensor [rows, row bytes], how: its report entry's codes / reason).
    A quantized Linear whose 8-bit codes fit Q8_0 (bitsandbytes int8: one scale a row, each 32-block
    storing it as float16) keeps them; any other is quantized from its exact float weights by llama.cpp's
    own Q8_0 quantizer (gguf-py's quants.quantize, ggml-quants.c's reference), byte for byte what its
    converter writes from the same weights."""
    import gguf
    import numpy as np

    from ..core.tally import Stats
    from . import codec

    reason = "float weights quantized"
    if qt is not None:
        try:
            blocks, exact = codec.encode(qt, "Q8_0")
            stored = codec.stored_scales(blocks, "Q8_0")
            if np.isfinite(stored).all() and not np.any((stored == 0) & (exact != 0)):
                rounding = Stats()
                rounding.scale_rounding(exact, stored)
                return blocks, {"codes": "kept", "max_scale_rel_error": rounding.max_scale_rel_error}
            reason = "its scales do not fit float16"
        except NotStorable as exc:
            reason = f"its codes do not fit Q8_0 ({exc})"
    with np.errstate(over="ignore"):
        blocks = gguf.quants.quantize(np.ascontiguousarray(whole, np.float32), gguf.GGMLQuantizationType.Q8_0)
    if not np.isfinite(codec.stored_scales(blocks, "Q8_0")).all():
        raise UnsupportedFormat("cannot be written as Q8_0: a block's scale (its largest weight / 127) exceeds "
                                "float16's 65504; use --mmproj-type f32", file=info.file, tensor=source)
    return blocks, {"codes": "requantized", "reason": reason}


def _rows_of(encoded: tuple, part) -> tuple:
    blocks, how = encoded
    if part is not None:                               # ("rows", i, n): q / k / v of a fused tensor
        n = blocks.shape[0] // part[2]
        blocks = blocks[part[1] * n:(part[1] + 1) * n]
    return blocks, how


def _q8_0_error(blocks, values) -> dict:
    """The written tensor's error against its source's exact weights: ||W_q - W|| / ||W|| and max |W_q - W|."""
    import gguf
    import numpy as np

    diff = gguf.quants.dequantize(np.ascontiguousarray(blocks), gguf.GGMLQuantizationType.Q8_0)
    diff -= values                                     # float32 (BLAS's scaled norms: no overflow)
    norm = float(np.linalg.norm(values.reshape(-1)))
    return {"rel_frobenius": round(float(np.linalg.norm(diff.reshape(-1))) / norm, 6) if norm else 0.0,
            "max_abs": float(np.abs(diff).max(initial=0.0))}


def _values(comp: Component, det, tensors: list[Planned]):
    """(planned tensor, its whole source's float32 values, its own, the source TensorInfo, the source
    module's QuantTensor or None) in order, one source read at a time: a quantized module's weight
    dequantized exactly, a float tensor widened; a split source read once."""
    import numpy as np

    from ..core.reader import model_dtype, read_module
    from ..core.source import whole as materialised
    from ..storage.tensor_io import read_array, to_float32

    dtype = model_dtype(comp, det)
    source, whole, qt = None, None, None
    for t in tensors:
        info = comp.tensors[t.module.weight_tensors[0]] if t.module is not None else comp.tensors[t.source]
        if t.source != source:
            source = t.source
            qt = materialised(read_module(comp, det, t.module, dtype)) if t.module is not None else None
            whole = (np.asarray(qt.dequantize(), np.float32) if qt is not None
                     else to_float32(read_array(info), info.dtype))
            if not np.isfinite(whole).all():
                raise CorruptCheckpoint("holds non-finite values (NaN or infinity)", file=info.file, tensor=t.source)
        values = whole
        if t.part is not None and t.part[0] == "rows":
            n = whole.shape[0] // t.part[2]
            values = whole[t.part[1] * n:(t.part[1] + 1) * n]
        elif t.part is not None:
            values = whole[:, :, t.part[1]]
        yield t, whole, values, info, qt


def check(comp: Component, det, path: Path, planned, report: Mapping, shown) -> dict:
    """convert --validate for the mmproj file: every tensor read back with llama.cpp's own reader (gguf-py's
    GGUFReader and quants.dequantize) equals its source (the tower's weight, split as planned; a quantized
    one's exact dequantization) in the type written, with its name, shape and type: a float type's values
    rounded to nearest even; Q8_0 with kept codes up to the float16 rounding of their scales (as reported),
    requantized with the error reported. Raises ValidationFailed naming the first that does not."""
    import gguf
    import numpy as np

    _, _, tensors = planned
    try:
        stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    except (ValueError, OSError) as exc:
        raise ValidationFailed(f"validation failed, nothing written: {path.name} cannot be read back: {exc}",
                               file=shown) from None
    quantized = {e["tensor"]: e for e in report.get("q8_0", ())}
    for t, _, values, _, _ in _values(comp, det, tensors):
        got = stored.get(t.name)
        why = ("missing" if got is None else
               f"is {got.tensor_type.name}, not {t.type_name}" if got.tensor_type.name != t.type_name else None)
        if why is None:
            back = np.asarray(gguf.quants.dequantize(got.data, got.tensor_type), np.float32).reshape(t.shape)
            why = _differs(back, np.ascontiguousarray(values, np.float32), t, quantized.get(t.name))
        if why:
            raise ValidationFailed(f"validation failed, nothing written: {path.name}: {t.name} {why}", file=shown)
    if len(stored) != len(tensors):
        raise ValidationFailed(f"validation failed, nothing written: {path.name} holds {len(stored)} tensors, "
                               f"{len(tensors)} planned", file=shown)
    return {"ok": True, "tensors": len(tensors), "reader": "gguf-py (GGUFReader, quants.dequantize)"}


def _differs(back, values, t: Planned, entry: Mapping | None) -> str | None:
    import numpy as np

    from ..storage.tensor_io import encode_float, to_float32

    if t.type_name != "Q8_0":
        want = to_float32(encode_float(values, t.type_name), t.type_name).reshape(t.shape)
        return None if np.array_equal(back, want) else f"does not read back as {t.source}"
    if entry is None:
        return "is Q8_0 but the report has no entry for it"
    diff = np.abs(back.astype(np.float64) - values.astype(np.float64))
    if entry["codes"] == "kept":                       # the source's codes, each block's scale in float16
        tol = (entry["max_scale_rel_error"] + 2.0 ** -21) * np.abs(values.astype(np.float64)) + 2.0 ** -25
        return None if np.all(diff <= tol) else (f"does not read back as {t.source}'s codes: largest difference "
                                                 f"{float(diff.max(initial=0)):.3g}")
    norm = float(np.linalg.norm(values.astype(np.float64)))
    rel = float(np.linalg.norm(diff)) / norm if norm else 0.0
    if not rel <= entry["rel_frobenius"] * (1 + 1e-5) + 1e-6:      # the report rounds to 6 places; NaN fails
        return f"has relative error {rel:.3g} against {t.source}, the report says {entry['rel_frobenius']:.3g}"
    return None


# --- read back: the mmproj file beside a VL text GGUF, as the Hugging Face vision tower -----------------

def _qwen25_hf(vision: Mapping) -> list[str]:
    names = ["patch_embed.proj.weight", "merger.ln_q.weight"] + [f"merger.mlp.{i}.{leaf}" for i in (0, 2)
                                                                  for leaf in ("weight", "bias")]
    for n in range(vision["depth"]):
        names += [f"blocks.{n}.{m}.{leaf}" for m in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj") for leaf in ("weight", "bias")]
        names += [f"blocks.{n}.norm1.weight", f"blocks.{n}.norm2.weight"]
    return names


def _qwen3_hf(vision: Mapping) -> list[str]:
    merger = [f"{m}.{leaf}" for m in ("norm", "linear_fc1", "linear_fc2") for leaf in ("weight", "bias")]
    names = ["patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight"] + [f"merger.{m}" for m in merger]
    names += [f"deepstack_merger_list.{k}.{m}" for k in range(len(vision["deepstack_visual_indexes"])) for m in merger]
    for n in range(vision["depth"]):
        names += [f"blocks.{n}.{m}.{leaf}" for m in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2",
                                                     "norm1", "norm2") for leaf in ("weight", "bias")]
    return names


def _common_vision(meta: Mapping, where) -> dict:
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


def _qwen25_vision(meta: Mapping, shapes: Mapping, where) -> dict:
    vision = _common_vision(meta, where)
    pattern = meta.get("clip.vision.n_wa_pattern")
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise CorruptCheckpoint(f"its clip.vision.n_wa_pattern is {pattern!r}, not a positive integer", file=where)
    return {**vision, "hidden_act": "silu", "model_type": "qwen2_5_vl_vision", "window_size": 112,
            "fullatt_block_indexes": list(range(pattern - 1, vision["depth"], pattern))}


def _qwen3_vision(meta: Mapping, shapes: Mapping, where) -> dict:
    vision = _common_vision(meta, where)
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


# what read_back adds beside the tower: the text config's model_type, the image processor's config
_BACK = {
    "qwen2_5_vl": (_qwen25_hf, _qwen25_vision, "qwen2_5_vl_text",
                   {"min_pixels": 3136, "max_pixels": 12845056, "image_processor_type": "Qwen2VLImageProcessor",
                    "processor_class": "Qwen2_5_VLProcessor"}),
    "qwen3_vl": (_qwen3_hf, _qwen3_vision, "qwen3_vl_text",
                 {"size": {"longest_edge": 16777216, "shortest_edge": 65536},
                  "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"}),
}
_BACK["qwen3_vl_moe"] = _BACK["qwen3_vl"][:2] + ("qwen3_vl_moe_text",) + _BACK["qwen3_vl"][3:]
_BLOCK_TYPES = ("Q8_0",)            # block-typed tower weights read back as the gguf family's modules


@dataclass(frozen=True)
class ReadBack:
    """The vision tower of an mmproj file as a VL folder holds it."""
    path: Path
    vision_config: dict
    text_model_type: str             # the VL text config's model_type
    tensors: dict                    # Hugging Face name (model.visual.*) -> TensorInfo
    ggml_types: dict                 # Hugging Face name -> block type, for the tower's Q8_0 weights
    preprocessor: dict               # preprocessor_config.json


def beside(text: Path) -> Path | None:
    """The mmproj file llama.cpp's naming puts beside a text GGUF (mmproj-<its name>; a split set's: its
    name without the split suffix), or None."""
    names = [mmproj_name(text)]
    m = SPLIT_SUFFIX.search(text.name)
    if m and m.start():
        names.append(f"mmproj-{text.name[:m.start()]}.gguf")
    return next((p for p in (text.with_name(n) for n in names) if p.is_file()), None)


def read_back(path: Path, model_type: str) -> ReadBack:
    """The mmproj file at path as the Hugging Face vision tower of a ``model_type`` model: its config
    from the clip keys, each tensor named as transformers names it and assembled as it holds it (q / k / v
    rows joined, the two temporal kernels stacked into the Conv3d), read when asked. The inverse of
    plan(); refused, naming the file and the key or tensor, where the file is another projector's, its
    clip keys contradict its tensors (clip_keys.checked, before anything is sized by them), it
    lacks a tensor the tower has, or holds one it has no place for."""
    import gguf

    path = Path(path)
    header = read_header(path)
    meta = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    model = MODELS.get(model_type)
    if meta.get("general.architecture") != "clip" or model is None:
        raise UnsupportedFormat(f"is not an mmproj file qconv reads back (general.architecture "
                                f"{meta.get('general.architecture')!r}, for a {model_type} model)", file=path)
    if meta.get("clip.projector_type") != model.projector:
        raise UnsupportedFormat(f"its clip.projector_type {meta.get('clip.projector_type')!r} is not "
                                f"{model.projector!r}, the {model_type} text model's projector", file=path)
    hf_names, vision_of, text_type, processor = _BACK[model_type]
    stored = {t.name: t for t in header.tensors}
    shapes = {name: tuple(reversed(t.shape)) for name, t in stored.items()}
    checked(meta, shapes, model.projector, path)      # the clip keys, before anything is sized by them
    vision = vision_of(meta, shapes, path)
    used, tensors, types = set(), {}, {}
    for rest in hf_names(vision):
        hf = "model.visual." + rest
        targets = model.names(rest, {"vision_config": vision}) or []
        missing = [g for g, _ in targets if g not in stored]
        if not targets or missing:
            raise CorruptCheckpoint(f"has no {missing[0] if missing else rest}, which the {model_type} vision "
                                    f"tower's {hf} is made of", file=path)
        parts = [stored[g] for g, _ in targets]
        used.update(g for g, _ in targets)
        kinds = {t.type_name for t in parts}
        kind = kinds.pop() if len(kinds) == 1 else None
        joined = targets[0][1]
        if kind not in ("F32", "F16", "BF16", *_BLOCK_TYPES) or (
                kind in _BLOCK_TYPES and joined is not None and joined[0] != "rows"):     # blocks: rows joined only
            raise UnsupportedFormat(f"is {'/'.join(sorted(t.type_name for t in parts))}, which qconv does not read "
                                    f"back as {hf}", file=path, tensor=targets[0][0])
        tensors[hf] = _assembled(hf, kind, [(t, shapes[t.name]) for t in parts], targets[0][1], path)
        if kind in _BLOCK_TYPES:
            types[hf] = kind
    extra = sorted(set(stored) - used)
    if extra:
        raise UnsupportedFormat(f"holds a tensor qconv has no place for in the {model_type} vision tower",
                                file=path, tensor=extra[0])
    pre = {"patch_size": vision["patch_size"], "temporal_patch_size": 2, "merge_size": vision["spatial_merge_size"],
           "image_mean": _f32_list(meta, "clip.vision.image_mean", path),
           "image_std": _f32_list(meta, "clip.vision.image_std", path), **processor}
    return ReadBack(path, vision, text_type, tensors, types, pre)


def _f32_list(meta: Mapping, key: str, where) -> list[float]:
    import numpy as np

    value = meta.get(key)
    if not isinstance(value, list) or len(value) != 3 or not all(
            isinstance(v, (int, float)) and math.isfinite(v) for v in value):
        raise CorruptCheckpoint(f"its {key} is {value!r}, not three finite numbers", file=where)
    return [float(np.format_float_positional(np.float32(v))) for v in value]      # float32's shortest digits


def _assembled(hf: str, kind: str, parts: list, part, path: Path):
    """The TensorInfo of a Hugging Face tower tensor made of one or more mmproj tensors (parts: (GGUF
    tensor, numpy shape)): a float one as its values (decoded when read), a Q8_0 one as rows of blocks."""
    shapes = {s for _, s in parts}
    first, shape = parts[0]
    if len(shapes) != 1:
        raise CorruptCheckpoint(f"its parts of {hf} differ in shape ({', '.join(str(list(s)) for s in shapes)})",
                                file=path, tensor=first.name)
    pieces = tuple((t.file or path, t.offset, t.nbytes) for t, _ in parts)
    if part is not None and part[0] == "time":        # two Conv2d kernels [h, 3, p, p] -> Conv3d [h, 3, 2, p, p]
        shape = shape[:2] + (len(parts),) + shape[2:]
    elif part is not None:                             # q / k / v rows joined
        shape = (shape[0] * len(parts),) + shape[1:]
    if kind in _BLOCK_TYPES:                           # rows of blocks: [rows, bytes a row]
        shape = (shape[0], first.nbytes // parts[0][1][0])
    stored = "U8" if kind in _BLOCK_TYPES else kind
    decode = None
    if len(parts) > 1:
        decode = functools.partial(_joined, pieces, stored, part[0] if part else None)
    return TensorInfo(hf, stored, shape, first.file or path, first.offset,
                      sum(n for _, _, n in pieces), decode=decode)


def _joined(pieces: tuple, stored: str, how: str, info, rows):
    """Rows r0:r1 (None: all) of a tower tensor made of several mmproj tensors, as info.dtype: q / k / v
    rows read from the parts they lie in, or the two temporal kernels stacked (TensorInfo.decode)."""
    import numpy as np

    from ..storage.tensor_io import convert_float, read_array

    n = info.shape[0]
    r0, r1 = rows or (0, n)
    if how == "time":
        per = info.shape[:2] + info.shape[3:]
        arrays = [read_array(replace(info, dtype=stored, shape=per, file=f, offset=o, nbytes=b, decode=None))
                  for f, o, b in pieces]
        out = np.stack(arrays, axis=2)[r0:r1]
    else:
        per = n // len(pieces)
        out = []
        for i, (f, o, b) in enumerate(pieces):
            lo, hi = max(r0, i * per), min(r1, (i + 1) * per)
            if lo < hi:
                piece = replace(info, dtype=stored, shape=(per,) + tuple(info.shape[1:]), file=f, offset=o, nbytes=b,
                                decode=None)
                out.append(read_array(piece, rows=(lo - i * per, hi - i * per)))
        out = np.concatenate(out)
    return out if info.dtype == stored else convert_float(out, stored, info.dtype)
