"""A llama.cpp GGUF file as a source every verb reads: a Component whose tensors carry their Hugging Face
names (formats/gguf/arch.py, the inverse of what llama.cpp's converter writes), whose config.json is
rebuilt from the metadata, and whose quantization_config says which ggml type each block tensor holds
(``{"quant_method": "gguf", "ggml_types": {tensor: type}, "row_order": {tensor: heads}}``), so that the
"gguf" family (header.find_modules, codec.read) decodes them like any other format's modules.

llama.cpp's stacked experts ([experts, out, in]) appear as one tensor per expert, each its own rows of
the file. The header is read and checked by header.read_header first (bounded, hostile-input safe); the
full metadata (a tokenizer's token list) is then read with gguf-py's reader. A split GGUF is read from its
first file as one model (split.read_gguf: every file checked first), each tensor from the file holding it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..core import structure
from ..storage.checkpoint import Component
from ..storage.safetensors_header import TensorInfo, open_regular
from . import arch as garch
from . import mmproj
from .header import GGUFHeader
from .split import read_gguf
from .tokenizer import tokenizer_files, tokenizer_warning

FLOAT_TYPES = ("F32", "F16", "BF16")
ROPE_FREQS = "rope_freqs.weight"                  # llama-3's rope scaling, as llama.cpp's converter writes it
_MODEL_DTYPES = {"BF16": "bfloat16", "F16": "float16"}
_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def full_metadata(path: Path) -> dict:
    """Every metadata value in full (read_header keeps long arrays as a summary), with gguf-py's reader,
    once read_header has checked the file (a split set's metadata is all in its first file)."""
    import gguf

    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()
            if not key.startswith("GGUF.")}


def model_dtype(header: GGUFHeader) -> str:
    """The 16-bit float type its float tensors are in (BF16 before F16), else float16."""
    types = {t.type_name for t in header.tensors}
    return next((_MODEL_DTYPES[t] for t in ("BF16", "F16") if t in types), "float16")


def gguf_names(config: dict, arch, where) -> dict[str, str]:
    """{GGUF tensor name: Hugging Face name} for the architecture's decoder (stacked experts: the
    ``mlp.experts.proj.weight`` stem)."""
    return {garch.gguf_name(hf, arch, config["num_hidden_layers"], where): hf for hf in garch.hf_tensor_names(config, arch)}


@dataclass(frozen=True)
class Opened:
    """A GGUF checked and mapped: its header, full metadata, rebuilt config.json, architecture and
    {GGUF tensor: Hugging Face name} for every tensor it holds."""
    header: GGUFHeader
    meta: dict
    config: dict
    arch: garch.Arch
    names: dict


def open_checked(path: Path) -> Opened:
    """read_gguf's checks (a split set's files included), then the mapping: an architecture qconv does not
    map back, or a tensor with no Hugging Face name is refused by name, before any tensor data is read."""
    header = read_gguf(path)
    meta = full_metadata(path)
    config = garch.config_from(meta, path)
    arch = garch.ARCHS[config["model_type"]]
    # the metadata against the tensors (structure.py), before anything is sized by block_count
    structure.check(config, garch.structural_shapes((t.name, t.shape) for t in header.tensors), file=path,
                    names=garch.config_names(meta), source="its metadata")
    names = gguf_names(config, arch, path)
    factors = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    for t in header.tensors:
        if t.name == ROPE_FREQS:
            continue
        if t.name not in names:
            raise UnsupportedFormat(f"has no Hugging Face name in qconv's {arch.name} mapping; nothing written",
                                    file=t.file, tensor=t.name)
    if factors is not None:                           # llama-3's rope scaling: config.json's, not a tensor
        if not arch.permute_qk or factors.type_name != "F32":
            raise UnsupportedFormat(f"holds {ROPE_FREQS} ({factors.type_name}), which qconv maps back only as "
                                    f"llama's F32 rope factors (llama-3's rope scaling); nothing written",
                                    file=factors.file, tensor=factors.name)
        config["rope_parameters"] = garch.llama3_rope(rope_factors(factors), config, factors.file)
    if "lm_head.weight" not in {names.get(t.name) for t in header.tensors}:
        config["tie_word_embeddings"] = True          # llama.cpp falls back to token_embd, as transformers does
    config["dtype"] = model_dtype(header)
    return Opened(header, meta, config, arch, {t.name: names[t.name] for t in header.tensors if t.name != ROPE_FREQS})


def rope_factors(t):
    """A GGUF's rope_freqs tensor (F32, a few hundred bytes; its size and offset checked by read_header),
    from the file that holds it."""
    import numpy as np

    with open_regular(t.file) as f:
        f.seek(t.offset)
        raw = f.read(t.nbytes)
    if len(raw) != t.nbytes:
        raise CorruptCheckpoint("file ended while reading the tensor: truncated", file=t.file, tensor=t.name)
    return np.frombuffer(raw, "<f4").copy()


def tokenizer_docs(path: Path) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json rebuilt from a GGUF's metadata, as `qconv dequantize`
    writes them: what a folder converted from the GGUF gets (Component.made_files)."""
    return tokenizer_files(full_metadata(path), path)


def open_gguf(path: Path) -> Component:
    """The GGUF as a Component. A VL model's text decoder (qwen2vl, qwen3vl) with llama.cpp's mmproj file
    beside it (mmproj-<name>) is read back as the VL model whole: the text model's tensors under
    model.language_model, the tower's (mmproj.read_back) under model.visual, the VL config.json and the
    image processor's preprocessor_config.json; without one, as the text model it computes on text."""
    path = Path(path)
    g = open_checked(path)
    header, config, arch = g.header, g.config, g.arch
    own = g.meta.get("general.architecture")
    pair = mmproj.beside(path) if own != arch.name else None
    # a MoE pair's experts (Qwen3-VL-MoE) are read one per expert; a float folder gets them fused, as its
    # loaders read them (convert/fused_experts.py)
    back = mmproj.read_back(pair, garch.BY_GGUF_NAME[own].model_type) if pair else None
    renamed = _in_vl_model if back else (lambda hf: hf)
    tensors, types, order, decoded = {}, {}, {}, {}
    for t in header.tensors:
        if t.name not in g.names:                     # rope_freqs: in the config
            continue
        hf, shape = g.names[t.name], tuple(reversed(t.shape))
        if len(shape) == 3 and ".experts." in hf:      # stacked experts: one tensor per expert, its own rows
            per = t.nbytes // shape[0]
            parts = [(hf.replace(".experts.", f".experts.{e}."), shape[1:], t.offset + e * per, per)
                     for e in range(shape[0])]
        else:
            parts = [(hf, shape, t.offset, t.nbytes)]
        heads = garch.heads_of(config, hf) if arch.permute_qk else None
        if t.type_name not in FLOAT_TYPES and not garch.in_decoder_layers(hf):
            tensors[renamed(hf)] = _decoded_tensor(t, renamed(hf), shape, _CODES[config["dtype"]])
            decoded[renamed(hf)] = t.type_name
            continue
        for name, shp, offset, nbytes in parts:
            name = renamed(name)
            if t.type_name in FLOAT_TYPES:            # llama's float q / k: rows put back when read
                tensors[name] = TensorInfo(name, t.type_name, shp, t.file, offset, nbytes,
                                           decode=functools.partial(unpermuted_rows, heads, t.type_name) if heads else None)
                continue
            rows = shp[0] if len(shp) > 1 else 1
            tensors[name] = TensorInfo(name, "U8", (rows, nbytes // max(rows, 1)), t.file, offset, nbytes)
            types[name] = t.type_name
            if heads:
                order[name] = heads
    warnings = [w for w in [tokenizer_warning(g.meta)] if w]
    if back:                                          # the VL model whole: its vision tower from the pair
        tensors.update(back.tensors)
        types.update(back.ggml_types)
        config = vl_config(config, g.meta, back, path)
    elif own != g.arch.name:
        warnings.insert(0, f"a {own} file holds a VL model's text decoder, and no {mmproj.mmproj_name(path)} "
                           f"(llama.cpp's mmproj file) lies beside it: written as the text model it computes on "
                           f"text ({g.arch.hf_class}), without the vision tower")
    config["quantization_config"] = {"quant_method": "gguf", "ggml_types": types, "row_order": order,
                                     "decoded": decoded}
    if decoded:
        warnings.append(f"{len(decoded)} block-typed tensors outside the decoder layers "
                        f"({', '.join(f'{n}: {k}' for n, k in decoded.items())}) are read as {config['dtype']}, "
                        f"decoded as `qconv dequantize` decodes them (the folder formats keep them float)")
    files = tuple(header.files or (path,)) + ((back.path,) if back else ())
    return Component(name=path.name, path=path, files=files, headers={}, tensors=tensors,
                     made_files=functools.partial(made_files, path, back.preprocessor if back else None),
                     warnings=tuple(warnings), config=config, config_names=garch.config_names(g.meta))


def _in_vl_model(hf: str) -> str:
    """A text decoder's tensor as a VL model names it (transformers 5: model.language_model.*)."""
    return "model.language_model." + hf[len("model."):] if hf.startswith("model.") else hf


def vl_config(text: dict, meta: dict, back, where) -> dict:
    """config.json of the VL model a text GGUF and its mmproj file hold together: the text model's config
    (config_from) as its text_config, with llama.cpp's M-RoPE sections, and the tower's (read_back);
    refused where the two files disagree."""
    own = meta.get("general.architecture")
    vl = garch.BY_GGUF_NAME[own]
    dtype = text["dtype"]
    text = {k: v for k, v in text.items() if k not in ("architectures", "dtype")}
    sections = meta.get(f"{own}.rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) < 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sections):
        raise CorruptCheckpoint(f"its {own}.rope.dimension_sections is {sections!r}, not M-RoPE's sections", file=where)
    text["model_type"] = back.text_model_type
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(sections[:3])}
    vision = back.vision_config
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise CorruptCheckpoint(f"its clip.vision.projection_dim {vision['out_hidden_size']} is not "
                                f"{Path(where).name}'s {own}.embedding_length {text['hidden_size']} (llama.cpp feeds "
                                f"the projector's output to the text model as its embeddings): not one model",
                                file=back.path)
    if vl.deepstack and meta.get(f"{own}.n_deepstack_layers") != len(vision["deepstack_visual_indexes"]):
        raise CorruptCheckpoint(f"its {own}.n_deepstack_layers {meta.get(f'{own}.n_deepstack_layers')!r} is not the "
                                f"{len(vision['deepstack_visual_indexes'])} deepstack layers of {back.path.name}: "
                                f"not one model", file=where)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    declared = vl.vision.tokens                       # its token ids: the tokenizer's, else the released model's
    where_is = {t: i for i, t in enumerate(tokens) if t in {tok for tok, _ in declared.values()}}
    ids = {key: where_is.get(tok, default) for key, (tok, default) in declared.items()}
    return {"architectures": [vl.hf_class], "model_type": vl.model_type, "dtype": dtype, "text_config": text,
            "vision_config": vision,
            "tie_word_embeddings": text["tie_word_embeddings"], **ids}


def made_files(path: Path, preprocessor: dict | None) -> dict[str, dict]:
    """The files a folder converted from the GGUF gets besides config.json (Component.made_files): the
    tokenizer rebuilt from its metadata, and a VL pair's preprocessor_config.json."""
    files = tokenizer_docs(path)
    if preprocessor is not None:
        files["preprocessor_config.json"] = preprocessor
    return files


def _decoded_tensor(t, hf: str, shape: tuple, code: str) -> TensorInfo:
    """A block-typed tensor outside the decoder layers (llama.cpp's Q4_K / Q6_K / Q8_0 token_embd and
    output) as the float tensor the folder formats keep: its stored bytes, decoded when read."""
    if len(shape) != 2:
        raise UnsupportedFormat(f"is {t.type_name} with shape {list(shape)}: qconv reads block-typed tensors outside "
                                f"the decoder layers only as 2-D weights", file=t.file, tensor=t.name)
    return TensorInfo(hf, code, shape, t.file, t.offset, t.nbytes,
                      decode=functools.partial(decoded_rows, t.type_name, t.name))


def decoded_rows(type_name: str, gguf_name: str, info: TensorInfo, rows: tuple[int, int] | None) -> "np.ndarray":
    """Rows r0:r1 (None: all) of a decoded tensor (_decoded_tensor), in its dtype: gguf-py's decoding
    (codec.decode_float), refused where it is not finite or exceeds the dtype's range."""
    from ..storage.tensor_io import FLOAT_NAMES, all_finite, encode_float, read_array
    from . import codec

    n = info.shape[0]
    r0, r1 = rows or (0, n)
    stored = replace(info, name=gguf_name, dtype="U8", shape=(n, info.nbytes // max(n, 1)), decode=None)
    w = codec.decode_float(read_array(stored, rows=(r0, r1)), type_name, stored)
    out = encode_float(w, info.dtype)
    if not all_finite(out, info.dtype):
        raise UnsupportedFormat(f"its {type_name} weights exceed {FLOAT_NAMES[info.dtype]}'s range (largest "
                                f"{float(abs(w).max()):.3g}); `qconv dequantize --dtype float32` decodes it",
                                file=info.file, tensor=gguf_name)
    return out.reshape((r1 - r0,) + tuple(info.shape[1:]))


def unpermuted_rows(heads: int, code: str, info: TensorInfo, rows: tuple[int, int] | None) -> "np.ndarray":
    """Rows r0:r1 (None: all) of llama's float q / k (stored as ``code``) in Hugging Face order, as
    info.dtype: its rows interleave within each head in llama.cpp's rotary order, so the heads the window
    touches are read (only their bytes) and put back (codec.unpermute_rows)."""
    from ..storage.tensor_io import convert_float, read_array
    from . import codec

    n = info.shape[0]
    r0, r1 = rows or (0, n)
    per = n // heads
    h0, h1 = r0 // per, -(-r1 // per)
    part = read_array(replace(info, dtype=code, decode=None), rows=(h0 * per, h1 * per))
    out = codec.unpermute_rows(part, h1 - h0)[r0 - h0 * per:r1 - h0 * per]
    return out if info.dtype == code else convert_float(out, code, info.dtype)
