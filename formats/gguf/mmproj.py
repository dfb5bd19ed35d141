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

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..storage.checkpoint import Component
from .arch import VISION_PREFIXES, is_vision

PREPROCESSOR = "preprocessor_config.json"
_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


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
    shape: tuple                     # numpy shape written
    type_name: str                   # F32, F16 or BF16
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
    as the converter reads them), None where the folder has neither."""
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
    """The converter's rules (conversion/base.py prepare_tensors, MmprojModel.tensor_force_quant)."""
    if ".patch_embd.weight" in name:
        return "F16" if mmproj_type == "f16" or (mmproj_type == "auto" and source_code == "F16") else "F32"
    if len(shape) <= 1 or name == "v.position_embd.weight" or not name.endswith(".weight"):
        return "F32"
    return source_code if mmproj_type == "auto" else _TYPES[mmproj_type]


def _order(name: str):
    parts = re.split(r"(\d+)", name)
    return [int(p) if p.isdigit() else p for p in parts]


def write(comp: Component, det, path: Path, mmproj_type: str, planned) -> dict:
    """Write the planned mmproj file at path, one tensor at a time; the report's "mmproj" entry."""
    import gguf
    import numpy as np

    from .writer import Rounding, add_key

    model, keys, tensors = planned
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_string("general.name", comp.path.name)
    for key, kind, value in keys:
        add_key(writer, key, kind, value)
    weights = [t.type_name for t in tensors if len(t.shape) == 2]      # general.file_type: most 2-D weights'
    writer.add_uint32("general.file_type", {"F32": 0, "F16": 1, "BF16": 32}[max(sorted(set(weights)),
                                                                             key=weights.count)])
    writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    writer.add_string("general.quantized_by", "qconv")
    raw = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.uint16, gguf.GGMLQuantizationType.BF16)}
    sizes = {}
    for t in tensors:
        dtype, raw_dtype = raw[t.type_name]
        sizes[t.name] = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(t.name, t.shape, np.dtype(dtype), sizes[t.name], raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    rounded, dequantized = [], set()
    for t, values, info in _values(comp, det, tensors):
        if t.module is not None:
            dequantized.add(t.module.name)
        rounding = Rounding(t.type_name, t.source, info.file, hint="--mmproj-type f32")
        stored = np.ascontiguousarray(rounding.encode(values))
        if stored.nbytes != sizes[t.name]:
            raise AssertionError(f"{t.name}: {stored.nbytes} bytes encoded, {sizes[t.name]} planned")
        writer.write_padding(fout, fout.tell())
        fout.write(memoryview(stored).cast("B"))
        writer.write_padding(fout, stored.nbytes)
        if rounding.values:
            rounded.append({"tensor": t.name, "source": t.source, "to": t.type_name, "values": rounding.values,
                            "max_rel_error": rounding.max_rel_error})
    writer.close()
    types: dict[str, int] = {}
    for t in tensors:
        types[t.type_name] = types.get(t.type_name, 0) + 1
    return {"file": path.name, "projector": model.projector, "tensors": len(tensors),
            "gguf_types": dict(sorted(types.items())), "dequantized_modules": len(dequantized),
            "float_rounded": rounded}


def _values(comp: Component, det, tensors: list[Planned]):
    """(planned tensor, its float32 values, the source TensorInfo) in order, one source read at a time: a
    quantized module's weight dequantized exactly, a float tensor widened; a split source read once."""
    import numpy as np

    from ..core.reader import model_dtype, read_module
    from ..storage.tensor_io import read_array, to_float32

    dtype = model_dtype(comp, det)
    source, whole = None, None
    for t in tensors:
        info = comp.tensors[t.module.weight_tensors[0]] if t.module is not None else comp.tensors[t.source]
        if t.source != source:
            source = t.source
            whole = (np.asarray(read_module(comp, det, t.module, dtype).dequantize(), np.float32) if t.module is not None
                     else to_float32(read_array(info), info.dtype))
            if not np.isfinite(whole).all():
                raise CorruptCheckpoint("holds non-finite values (NaN or infinity)", file=info.file, tensor=t.source)
        values = whole
        if t.part is not None and t.part[0] == "rows":
            n = whole.shape[0] // t.part[2]
            values = whole[t.part[1] * n:(t.part[1] + 1) * n]
        elif t.part is not None:
            values = whole[:, :, t.part[1]]
        yield t, values, info


def check(comp: Component, det, path: Path, planned, shown) -> dict:
    """convert --validate for the mmproj file: every tensor read back with llama.cpp's own reader (gguf-py's
    GGUFReader and quants.dequantize) equals its source (the tower's weight, split as planned; a quantized
    one's exact dequantization) in the type written, rounded to nearest even, with its name, shape and type.
    Raises ValidationFailed naming the first that does not."""
    import gguf
    import numpy as np

    from ...errors import ValidationFailed
    from ..storage.tensor_io import encode_float, to_float32

    _, _, tensors = planned
    try:
        stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    except (ValueError, OSError) as exc:
        raise ValidationFailed(f"validation failed, nothing written: {path.name} cannot be read back: {exc}",
                               file=shown) from None
    for t, values, _ in _values(comp, det, tensors):
        got = stored.get(t.name)
        why = ("missing" if got is None else
               f"is {got.tensor_type.name}, not {t.type_name}" if got.tensor_type.name != t.type_name else None)
        if why is None:
            back = np.asarray(gguf.quants.dequantize(got.data, got.tensor_type), np.float32).reshape(t.shape)
            want = to_float32(encode_float(np.ascontiguousarray(values, np.float32), t.type_name), t.type_name)
            if not np.array_equal(back, want.reshape(t.shape)):
                why = f"does not read back as {t.source}"
        if why:
            raise ValidationFailed(f"validation failed, nothing written: {path.name}: {t.name} {why}", file=shown)
    if len(stored) != len(tensors):
        raise ValidationFailed(f"validation failed, nothing written: {path.name} holds {len(stored)} tensors, "
                               f"{len(tensors)} planned", file=shown)
    return {"ok": True, "tensors": len(tensors), "reader": "gguf-py (GGUFReader, quants.dequantize)"}
