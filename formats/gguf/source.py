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
from dataclasses import dataclass
from pathlib import Path

from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..core import structure
from ..storage.checkpoint import Component
from ..storage.safetensors_header import TensorInfo
from . import arch as garch
from .header import GGUFHeader
from .split import read_gguf

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

    from ..storage.safetensors_header import open_regular

    with open_regular(t.file) as f:
        f.seek(t.offset)
        raw = f.read(t.nbytes)
    if len(raw) != t.nbytes:
        raise CorruptCheckpoint("file ended while reading the tensor: truncated", file=t.file, tensor=t.name)
    return np.frombuffer(raw, "<f4").copy()


def tokenizer_docs(path: Path) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json rebuilt from a GGUF's metadata, as `qconv dequantize`
    writes them: what a folder converted from the GGUF gets (Component.made_files)."""
    return garch.tokenizer_files(full_metadata(path), path)


def open_gguf(path: Path) -> Component:
    path = Path(path)
    g = open_checked(path)
    header, config, arch = g.header, g.config, g.arch
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
            tensors[hf] = _decoded_tensor(t, hf, shape, _CODES[config["dtype"]])
            decoded[hf] = t.type_name
            continue
        for name, shp, offset, nbytes in parts:
            if t.type_name in FLOAT_TYPES:            # llama's float q / k: rows put back when read
                tensors[name] = TensorInfo(name, t.type_name, shp, t.file, offset, nbytes,
                                           decode=functools.partial(unpermuted_rows, heads, t.type_name) if heads else None)
                continue
            rows = shp[0] if len(shp) > 1 else 1
            tensors[name] = TensorInfo(name, "U8", (rows, nbytes // max(rows, 1)), t.file, offset, nbytes)
            types[name] = t.type_name
            if heads:
                order[name] = heads
    config["quantization_config"] = {"quant_method": "gguf", "ggml_types": types, "row_order": order,
                                     "decoded": decoded}
    warnings = [w for w in [garch.tokenizer_warning(g.meta)] if w]
    own = g.meta.get("general.architecture")
    if own != g.arch.name:
        warnings.insert(0, f"a {own} file holds a VL model's text decoder: written as the text model it computes on "
                           f"text ({g.arch.hf_class}); its vision tower is llama.cpp's mmproj file, not this one")
    if decoded:
        warnings.append(f"{len(decoded)} block-typed tensors outside the decoder layers "
                        f"({', '.join(f'{n}: {k}' for n, k in decoded.items())}) are read as {config['dtype']}, "
                        f"decoded as `qconv dequantize` decodes them (the folder formats keep them float)")
    return Component(name=path.name, path=path, files=header.files or (path,), headers={}, tensors=tensors,
                     made_files=functools.partial(tokenizer_docs, path), warnings=tuple(warnings),
                     config=config, config_names=garch.config_names(g.meta))


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
    from dataclasses import replace

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
    from dataclasses import replace

    from ..storage.tensor_io import convert_float, read_array
    from . import codec

    n = info.shape[0]
    r0, r1 = rows or (0, n)
    per = n // heads
    h0, h1 = r0 // per, -(-r1 // per)
    part = read_array(replace(info, dtype=code, decode=None), rows=(h0 * per, h1 * per))
    out = codec.unpermute_rows(part, h1 - h0)[r0 - h0 * per:r1 - h0 * per]
    return out if info.dtype == code else convert_float(out, code, info.dtype)
