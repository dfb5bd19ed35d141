"""`qconv dequantize model.gguf DST`: a llama.cpp GGUF file as a Hugging Face folder that plain
transformers loads: config.json rebuilt from the metadata (formats/gguf/arch.py, the inverse of what
llama.cpp's converter writes), every tensor decoded by llama.cpp's own reference decoder (gguf-py's
``quants.dequantize``: every ggml type it knows, K-quants and IQ types included), llama's q / k rows put
back in Hugging Face order, and the tokenizer files rebuilt where the metadata carries a byte-level BPE.

The header is read and checked first with qconv's bounded reader (formats/gguf/header.py: offsets,
sizes, types, overlaps), and each tensor's bytes are then read on their own, so a hostile file is refused
before anything is decoded, and memory is bounded by the largest tensor. A split GGUF is given by its
first file (formats/gguf/split.py checks the whole set first); each tensor is read from its own file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import CorruptCheckpoint
from ..formats.gguf import arch as garch
from ..formats.gguf import codec
from ..formats.gguf.source import open_checked
from ..formats.storage.safetensors_header import open_regular
from ..formats.storage.tensor_io import FLOAT_CODES, encode_float
from .engine import DEFAULT_MAX_SHARD, OutTensor, write_component
from .staging import staged_output

def _decoded(t, hf_name: str, config: dict, code: str, permute: bool) -> list[OutTensor]:
    """The tensor's Hugging Face tensors: itself, or for llama.cpp's stacked experts [E, out, in] one
    ``experts.N.proj`` tensor per expert, each decoded from its own rows."""
    shape = tuple(reversed(t.shape))                  # numpy order: [out, in] (experts: [E, out, in])
    if len(shape) == 3 and ".experts." in hf_name:
        return [_rows(t, hf_name.replace(".experts.", f".experts.{e}."), config, code, permute, shape[1:],
                      e * t.nbytes // shape[0], t.nbytes // shape[0]) for e in range(shape[0])]
    return [_rows(t, hf_name, config, code, permute, shape, 0, t.nbytes)]


def _rows(t, hf_name: str, config: dict, code: str, permute: bool, shape: tuple, start: int,
          nbytes: int) -> OutTensor:
    import gguf

    heads = garch.heads_of(config, hf_name) if permute else None

    def chunks():
        with open_regular(t.file) as f:
            f.seek(t.offset + start)
            raw = f.read(nbytes)
        if len(raw) != nbytes:
            raise CorruptCheckpoint("file ended while reading the tensor: truncated", file=t.file, tensor=t.name)
        data = np.frombuffer(raw, np.uint8)
        qtype = gguf.GGMLQuantizationType(t.type)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16):
            w = np.asarray(gguf.quants.dequantize(data.view({0: np.float32, 1: np.float16, 30: np.uint8}[t.type])
                                                  if t.type != 30 else data, qtype), np.float32).reshape(shape)
            if not np.all(np.isfinite(w)):
                raise CorruptCheckpoint("decodes to non-finite weights (NaN or infinity)", file=t.file, tensor=t.name)
        else:                                         # every block type, as convert reads them (codec.decode_float)
            w = codec.decode_float(data.reshape(-1, nbytes // max(1, int(np.prod(shape[:-1])))), t.type_name,
                                   t).reshape(shape)
        if heads:
            w = codec.unpermute_rows(w, heads)
        yield encode_float(np.ascontiguousarray(w), code)

    return OutTensor(hf_name, code, shape, chunks)


def _warnings(g) -> list[str]:
    own = g.meta.get("general.architecture")
    note = garch.tokenizer_warning(g.meta)
    notes = [note] if note else []
    if own == g.arch.name:
        return notes
    return [f"a {own} file holds a VL model's text decoder: written as the text model it computes on text "
            f"({g.arch.hf_class}); its vision tower is llama.cpp's mmproj file, not this one"] + notes


def dequantize_gguf(src: Path, dst: Path, *, dtype: str | None = None, overwrite: bool = False,
                    max_shard_size: int = DEFAULT_MAX_SHARD) -> dict:
    import time

    src, dst = Path(src), Path(dst)
    t0 = time.monotonic()
    g = open_checked(src)
    config = g.config
    types = {t.type_name for t in g.header.tensors}
    target = dtype or config["dtype"]
    code = FLOAT_CODES[target]
    tensors = [o for t in g.header.tensors if t.name in g.names       # rope_freqs: in the config
               for o in _decoded(t, g.names[t.name], config, code, g.arch.permute_qk)]
    config["dtype"] = target
    files = garch.tokenizer_files(g.meta, src)
    with staged_output(src, dst, overwrite=overwrite) as tmp:
        written = write_component(None, tmp, tensors, config, max_shard_size, f"dequantizing {src.name}", base="model")
        for name, doc in files.items():
            (tmp / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    report = {"component": src.name, "method": "GGUF", "dtype": target, "dequantized_modules":
              sum(1 for t in g.header.tensors if t.type_name not in ("F32", "F16", "BF16")), **written,
              "copied": sorted(files), "ggml_types": sorted(types), "warnings": _warnings(g)}
    return {"source": str(src), "destination": str(dst), "seconds": round(time.monotonic() - t0, 3),
            "components": [report]}
