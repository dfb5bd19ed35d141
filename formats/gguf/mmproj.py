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

Each tower's tensor names, clip keys, required tensors and read-back config are its architecture's
declaration (archs/qwen2.py, archs/qwen3.py: archs.Vision); this file is generic over them.

Types, as the converter's: 1-D tensors (norms, biases) and the position embedding F32, the patch kernels
F16 when the type is f16 else F32, the 2-D weights in --mmproj-type (auto: each tensor's own dtype; a
quantized Linear of the tower, dequantized exactly, F32). A conversion that rounds is reported per tensor.

The plan is made from headers and configs (config.json, preprocessor_config.json's image_mean / std)
before anything is written; what llama.cpp cannot represent, or a source that disagrees with itself, is
refused naming the file and the key or tensor. Tensors are then read and encoded one at a time (encoded),
and written by the GGUF sink (sink.py) as the second file of a `--to gguf` conversion, beside the text model.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat, ValidationFailed
from ..storage.checkpoint import Component
from ..storage.safetensors_header import TensorInfo
from .arch import is_vision
from .archs import VISION as MODELS  # each VL model_type's tower, as its architecture declares it
from .archs import Vision as VisionModel
from .archs import vision_prefixes
from .clip_keys import checked
from .header import read_header
from .split import _NAME as SPLIT_SUFFIX

PREPROCESSOR = "preprocessor_config.json"
_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
QK = 32                                  # Q8_0's block: 32 weights of one row, one float16 scale


@dataclass(frozen=True)
class Planned:
    name: str                        # GGUF tensor name
    source: str                      # the Hugging Face tensor (or quantized module's weight) it comes from
    part: tuple | None               # ("rows", i, n): i-th of n row blocks; ("time", t): the t-th temporal kernel
    shape: tuple                     # numpy shape of the values written
    type_name: str                   # F32, F16, BF16 or Q8_0
    module: object = None            # the quantized module (QuantModule) whose weight this is, else None


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
        rest = hf[len(next(p for p in vision_prefixes() if hf.startswith(p))):]
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


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the mmproj file as the GGUF sink writes it: its stored shape ([rows, row bytes] for Q8_0)."""
    name: str
    type_name: str
    shape: tuple
    nbytes: int


def header(comp: Component, planned) -> tuple[list, list[FileTensor]]:
    """The mmproj file's metadata (key, type, value), in the order written, and its tensors."""
    import gguf

    model, keys, tensors = planned
    weights = [t.type_name for t in tensors if len(t.shape) == 2]      # general.file_type: most 2-D weights'
    file_type = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}[max(sorted(set(weights)), key=weights.count)]
    meta = [("general.type", "str", "mmproj"), ("general.name", "str", comp.path.name), *keys,
            ("general.file_type", "u32", file_type),
            ("general.quantization_version", "u32", gguf.GGML_QUANT_VERSION), ("general.quantized_by", "str", "qconv")]
    return meta, [FileTensor(t.name, t.type_name, (t.shape[0], _nbytes(t) // t.shape[0]) if t.type_name == "Q8_0"
                             else t.shape, _nbytes(t)) for t in tensors]


@dataclass
class Encoded:
    """What encoding the tower found, for the report: float tensors rounded, Q8_0 ones, and the quantized
    Linears whose codes were kept or which were dequantized."""
    rounded: list = field(default_factory=list)
    quantized: list = field(default_factory=list)
    dequantized: set = field(default_factory=set)
    kept: set = field(default_factory=set)


def encoded(comp: Component, det, planned, found: Encoded):
    """Each planned tensor's stored bytes, in order, one source tensor read at a time (a split source encoded
    once); what was rounded or quantized goes into found."""
    import numpy as np

    from .codec import Rounding

    _, _, tensors = planned
    blocks = (None, None)                              # (source, its Q8_0 blocks): a split source encoded once
    for t, whole, values, info, qt in _values(comp, det, tensors):
        how = None
        if t.type_name == "Q8_0":
            if blocks[0] != t.source:
                blocks = (t.source, _q8_0(whole, qt, info, t.source))
            stored, how = _rows_of(blocks[1], t.part)
            found.quantized.append({"tensor": t.name, "source": t.source, **how, **_q8_0_error(stored, values)})
        else:
            rounding = Rounding(t.type_name, t.source, info.file, hint="--mmproj-type f32")
            stored = rounding.encode(values)
            if rounding.values:
                found.rounded.append({"tensor": t.name, "source": t.source, "to": t.type_name,
                                      "values": rounding.values, "max_rel_error": rounding.max_rel_error})
        if t.module is not None:                       # a quantized Linear: its codes kept, or dequantized
            (found.kept if how is not None and how["codes"] == "kept" else found.dequantized).add(t.module.name)
        yield [np.ascontiguousarray(stored)]


def report(path: Path, planned, found: Encoded) -> dict:
    """The report's "mmproj" entry, once the file is written at path."""
    model, _, tensors = planned
    types: dict[str, int] = {}
    for t in tensors:
        types[t.type_name] = types.get(t.type_name, 0) + 1
    return {"file": path.name, "projector": model.projector, "tensors": len(tensors),
            "gguf_types": dict(sorted(types.items())), "dequantized_modules": len(found.dequantized - found.kept),
            "codes_kept_modules": len(found.kept),
            "float_rounded": found.rounded, **({"q8_0": found.quantized} if found.quantized else {})}


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
    hf_names, vision_of, text_type, processor = model.hf_names, model.vision_config, model.text_model_type, \
        model.processor
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
