"""A GGUF file's header-only report for `qconv inspect` (storage's container hooks: describe and render),
without numpy or torch: the summary header.py makes, its hyperparameters against its tensors (structure.py)."""

from __future__ import annotations

from pathlib import Path

from ..core.layout import human_bytes, human_count, indent
from .arch import BY_GGUF_NAME, structure_warnings
from .header import count, read_header, summary
from .clip_keys import PROJECTORS, clip_disagreements
from .mmproj import beside
from .split import read_gguf


def describe(path) -> dict:
    header = read_gguf(path)
    g = summary(header)
    warnings = structure_warnings_of(header)
    arch = BY_GGUF_NAME.get(header.metadata.get("general.architecture"))
    if arch is not None and arch.text_of:             # a VL text model: its mmproj file, read back with it
        pair = beside(Path(path))
        g["mmproj_beside"] = pair.name if pair else None
        g["mmproj_read_back"] = pair is not None                     # source.open_gguf reads the pair whole
        if pair is not None:
            warnings += mmproj_warnings(pair)
    elif header.metadata.get("general.architecture") == "clip":
        warnings += clip_warnings(header)
    return {"kind": "gguf", "gguf": g, "warnings": warnings}


def mmproj_warnings(pair: Path) -> list[str]:
    """The mmproj file beside a VL text GGUF, from its header: what every other verb refuses it for."""
    from ...errors import QconvError

    try:
        header = read_header(pair)
    except QconvError as exc:
        return [f"{pair.name} cannot be read: {exc.problem}"]
    return clip_warnings(header)


def clip_warnings(header) -> list[str]:
    """An mmproj file's clip keys against its tensors (clip_keys.clip_disagreements), from the header alone."""
    if header.metadata.get("clip.projector_type") not in PROJECTORS:
        return []
    shapes = {t.name: tuple(reversed(t.shape)) for t in header.tensors}
    return [f"{Path(header.path).name}: clip keys and tensors disagree: {d.message()}"
            for d in clip_disagreements(header.metadata, shapes)]


def structure_warnings_of(header) -> list[str]:
    """A GGUF's hyperparameters against its tensors (structure.py), from the header alone."""
    return [f"metadata and tensors disagree: {w}" for w in
            structure_warnings(header.metadata, [(t.name, t.shape) for t in header.tensors], count)]


def render(result: dict) -> str:
    """A GGUF file's report (inspect_path's "gguf" summary) as text: the model line, the totals, bytes by
    ggml type, the tokenizer, the architecture's hyperparameters."""
    from tabulate import tabulate

    g = result["gguf"]
    model = " ".join(str(v) for v in (g["architecture"], repr(g["name"]) if g["name"] else None) if v)
    lines = [f"{Path(result['path']).name}: GGUF v{g['version']}" + (f", {model}" if model else "")
             + (f", file type {g['file_type']}" if g["file_type"] else ""),
             f"  {human_bytes(g['file_size'])} on disk, {g['tensors']} tensors, "
             f"{human_count(g['parameters'])} parameters"
             + (f", {g['bits_per_weight']} bits/weight overall, {g['quantized_share']:.1%} of parameters in "
                f"quantized blocks" if g["parameters"] else "")
             + f", {g['metadata_keys']} metadata keys"]
    if "mmproj" in g:
        v = g["mmproj"]
        lines.append(f"  mmproj (a vision tower for llama.cpp's libmtmd): projector {v['projector']}, "
                     f"{v['vision_blocks']} vision blocks, {v['projector_tensors']} projector tensors"
                     + (f", deepstack after {v['deepstack_layers']} layers" if v["deepstack_layers"] else ""))
    if "mmproj_beside" in g:
        lines.append(f"  a VL model's text decoder: its vision tower, {g['mmproj_beside']}, lies beside it ("
                     + "read back together)"
                     if g["mmproj_beside"] else "  a VL model's text decoder: no mmproj file "
                     f"beside it (llama.cpp's mmproj-{Path(result['path']).name}); read back as the text model")
    if "split" in g:
        s = g["split"]
        no = s["no"] + 1 if isinstance(s["no"], int) else s["no"]          # split.no counts from 0
        if s.get("files"):                                                 # the whole set, from its first file
            lines.append(f"  {s['count']} split files, read as one: {s['files'][0]} to {s['files'][-1]}")
        else:
            lines.append(f"  split {no} of {s['count']}"
                         + (f" ({s['tensors']} tensors in all)" if s["tensors"] else ""))
    if g["types"]:
        rows = [(t, r["tensors"], f"{r['parameters']:,}", f"{r['bytes']:,}", r["bits_per_weight"])
                for t, r in g["types"].items()]
        lines += ["", indent(tabulate(rows, headers=["ggml type", "tensors", "parameters", "bytes", "bits/weight"],
                                       colalign=("left", "right", "right", "right", "right")))]
    tok = g.get("tokenizer")
    if tok:
        parts = [f"{tok['tokens']:,} tokens" if tok["tokens"] is not None else None,
                 f"{tok['merges']:,} merges" if tok["merges"] is not None else None,
                 f"bos {tok['bos_token_id']}" if tok["bos_token_id"] is not None else None,
                 f"eos {tok['eos_token_id']}" if tok["eos_token_id"] is not None else None,
                 "chat template" if tok["chat_template"] else "no chat template"]
        lines += ["", f"  tokenizer: {tok['model']}" + (f" (pre {tok['pre']})" if tok["pre"] else "")
                  + ", " + ", ".join(p for p in parts if p)]
    if g.get("hparams"):
        rows = [(k, _gguf_value(v)) for k, v in g["hparams"].items()]
        lines += ["", indent(tabulate(rows, headers=["hyperparameter", "value"], disable_numparse=True))]
    if result.get("warnings"):
        lines += ["", f"  warnings ({len(result['warnings'])}):"] + [f"  ! {w}" for w in result["warnings"]]
    return "\n".join(lines)


def _gguf_value(value) -> str:
    """A metadata value for the table: arrays comma-joined, an elided one as its type, count and head."""
    if isinstance(value, dict) and "count" in value:
        return f"{value['type']} of {value['count']:,}: {', '.join(map(str, value['head']))}, ..."
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)
