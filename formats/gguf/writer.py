"""`qconv convert SRC out.gguf --to gguf`: a Hugging Face folder as one llama.cpp GGUF file (or its
split files past --max-shard-size), keeping each quantized module's codes in GGUF's legacy blocks where
the arithmetic allows (formats/gguf/codec.py has the table) and requantizing the rest from their exact
weights, with the error reported per layer as every convert does.

What is GGUF's own is here: the plan, made from headers and configs alone (every tensor's name, GGUF type
and size, and the metadata: GGUF's header comes first), each module's blocks encoded as it is read (one at
a time, so memory is bounded by one module; float tensors slab by slab), the component's report, and
--validate's read-back of what was written (check). The rest is every target's: convert's engine
(convert/engine.py run) opens, stages, writes and publishes the file through the GGUF sink (sink.py).

Float tensors are stored as llama.cpp's converter stores them by default: 1-D (norms) as F32, 2-D
(embeddings, lm_head) in the model's own 16-bit dtype, so nothing outside the quantized Linears changes.
--gguf-float-type (as the converter's --outtype) stores the 2-D ones, and the modules --gguf-float keeps
float, as F32, F16, BF16 or Q8_0 instead; what a conversion rounds is reported per tensor, and a value
it would make infinite is refused.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat, ValidationFailed
from ..core.activation import activation_report
from ..core.experts import split_interleaved
from ..core.layout import QuantModule, natural_key
from ..core.request import Options
from ..core.reader import model_dtype, read_module, require_decodable
from ..core.requantize import requantize, unrepresentable
from ..core.source import check_source, exact_rows, exact_weights, source_spec, split_experts, whole
from ..core.tally import Stats, Tally
from ..storage.checkpoint import Component
from ..storage.tensor_io import FLOAT_CODES, FLOAT_NAMES, encode_float, plain_chunks, read_array, to_float32
from . import arch as garch
from . import codec, mmproj
from .tokenizer import tokenizer
from .codec import Rounding
from .header import GGUF_BITS, looks_like_gguf
from .source import ROPE_FREQS as ROPE_FREQS_TENSOR, rope_factors
from .split import read_gguf

ROPE_FREQS = "rope_parameters (llama3)"         # the source of rope_freqs: computed from config.json
_FLOAT_GGML = {"F16": (np.float16, "F16"), "F32": (np.float32, "F32"), "BF16": (np.uint16, "BF16")}
# what llama.cpp does to activations (a quantized weight's dot product rounds them to its q8 blocks at run time)
GGUF_ACTIVATIONS = "q8 blocks of 32 (llama.cpp's dot products), dynamic"
_FLOAT_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}     # --gguf-float-type


def _float_type(opts: Options, model_code: str) -> str:
    """The GGML type of a 2-D float tensor or a --gguf-float module: --gguf-float-type, else (auto) the
    model's own dtype."""
    return _FLOAT_TYPES.get(opts.gguf_float_type, model_code)


@dataclass
class _Out:
    name: str                        # GGUF tensor name
    type_name: str                   # GGML type
    shape: tuple                     # numpy shape of what is written (quantized: [rows, row bytes])
    dtype: type
    nbytes: int
    chunks: Callable                 # () -> arrays, in order
    source: str                      # the Hugging Face tensor or module ("...experts.{}.proj": stacked experts)
    kept: bool | None = None         # quantized modules: codes kept (None: a float tensor)
    stored_float: bool = False       # a module stored as float (--gguf-float)
    experts: int = 0                 # stacked experts (llama.cpp's *_exps): one module per expert, in order
    rounded: tuple = ()              # float conversions (Rounding), filled as the tensor is written


def _g_idx(comp: Component, m: QuantModule):
    """The module's g_idx where it stores one (GPTQ, compressed-tensors' act-order): which 32-blocks lie in
    one group depends on it. Small ([in] integers), read at plan time."""
    for leaf in (".g_idx", ".weight_g_idx"):
        info = comp.tensors.get(m.name + leaf)
        if info is not None:
            g = np.asarray(read_array(info)).astype(np.int64).reshape(-1)
            if g.size != m.in_features:
                raise CorruptCheckpoint(f"holds {g.size} entries for {m.in_features} input features", file=info.file,
                                        tensor=info.name)
            group = m.group_size if m.group_size and m.group_size > 0 else m.in_features
            return None if np.array_equal(g, np.arange(g.size) // group) else g     # trivial: no act-order
    return None


def _natural_type(comp, det, m: QuantModule, opts: Options, src_dtype: str) -> tuple[str | None, str | None]:
    """(GGUF type, reason its codes are not kept) of one module (codec.gguf_type, then --bits)."""
    where = comp.tensors[m.weight_tensors[0]].file if m.weight_tensors else comp.path
    src_spec = source_spec(comp, det, m, src_dtype)
    if _own_blocks(m, opts):                          # a GGUF source's K-quant / IQ type: copied as it is
        return m.details["ggml_type"], None
    if src_spec.scheme == "float":
        if m.in_features % codec.QK:
            reason = f"{m.in_features} input features are not a multiple of GGUF's 32-weight blocks"
            if opts.gguf_float:                       # stored as float (--gguf-float-type), as asked
                return None, reason
            raise UnsupportedFormat(f"{reason}; use --gguf-float to keep it float", file=where, tensor=m.name)
        # data-free: Q8_0 (llama.cpp's converter's q8_0); decoded GGUF blocks: their FloatSpec's bits
        type_name = "Q4_0" if (opts.bits or (src_spec.bits if src_spec.origin else 8)) == 4 else "Q8_0"
        reason = src_spec.requantized()
    else:
        type_name, reason = codec.gguf_type(src_spec, m.in_features, opts.gguf_asym, _g_idx(comp, m))
        if type_name is None and not opts.gguf_float:
            raise UnsupportedFormat(f"{reason}: no GGUF block type holds it; use --gguf-float to store it as "
                                    f"float", file=where, tensor=m.name)
        if type_name not in (None, "MXFP4") and opts.bits is not None and codec.requant_settings(type_name)[0] != opts.bits:
            type_name = GGUF_BITS[opts.bits]
            reason = reason or f"{src_spec.bits}-bit codes become {opts.bits}-bit (--bits {opts.bits})"
    return type_name, reason


def _module_out(comp, det, m: QuantModule, opts: Options, arch, name: str, src_dtype: str, tally: Tally,
                typed: tuple[str | None, str | None], as_float: bool = False) -> _Out:
    """One module's output tensor: its blocks in the type planned (typed: (type, reason its codes are not
    kept)), or with as_float its exact weights as float (--gguf-float), in --gguf-float-type's type."""
    type_name, reason = typed
    heads = garch.heads_of(comp.config, m.name + ".weight") if arch.permute_qk else None
    if as_float and opts.gguf_float_type == "q8_0":   # "float" is Q8_0: requantized, its error reported
        if m.in_features % codec.QK:
            raise UnsupportedFormat(f"{m.in_features} input features are not a multiple of Q8_0's 32-weight "
                                    f"blocks; use --gguf-float-type f16, bf16 or f32", tensor=m.name,
                                    file=comp.tensors[m.weight_tensors[0]].file if m.weight_tensors else comp.path)
        as_float = False
        if typed != ("Q8_0", None):
            type_name, reason = "Q8_0", f"{reason or f'its type {type_name}'}, stored as Q8_0 (--gguf-float-type q8_0)"
    if as_float:                                      # stored as float
        return _dequantized_out(comp, det, m, name, src_dtype, heads, opts)
    if _own_blocks(m, opts) and type_name == m.details["ggml_type"]:
        return _raw_out(comp.tensors[m.weight_tensors[0]], name, type_name, m.name, tally)
    out, inp = m.out_features, m.in_features
    row = codec.row_bytes(type_name, inp)

    def chunks():
        st = Stats(modules=1)
        source = whole(read_module(comp, det, m, src_dtype))
        qt, lossy = source, reason
        blocks = None
        if not lossy:
            try:
                blocks, exact = codec.encode(source, type_name)
                stored = codec.stored_scales(blocks, type_name)
                if not np.all(np.isfinite(stored)) or np.any((stored == 0) & (exact != 0)):
                    lossy = "scales do not fit float16 (they would be infinite or 0)"
                else:
                    st.scale_rounding(exact, stored)
            except NotStorable as exc:
                lossy = f"its codes do not fit {type_name} ({exc})"
        if lossy and type_name == "MXFP4":             # planned from e8m0 scales, which always fit
            raise UnsupportedFormat(f"cannot be written as MXFP4: {lossy}", tensor=m.name,
                                    file=comp.tensors[m.weight_tensors[0]].file)
        if lossy:
            w = exact_rows(comp, m, source)
            bits, sym = codec.requant_settings(type_name)
            qt, err = requantize(w, bits, codec.QK, sym, "F16", source.dtype, search=opts.search)
            _refuse_unrepresentable(qt, err, type_name, m.name, comp.tensors[m.weight_tensors[0]].file)
            st.requantized(m.name, lossy, source.spec.name, type_name, err)
            blocks, _ = codec.encode(qt, type_name)
        if heads:
            blocks = codec.permute_rows(blocks, heads)
        tally.add(m.name, st)
        yield blocks

    return _Out(name, type_name, (out, row), np.uint8, out * row, chunks, m.name, kept=not reason)


def _refuse_unrepresentable(qt, err, type_name: str, tensor: str, file) -> None:
    """A requantized block tensor whose float16 block scales cannot hold its weights (requantize's
    search leaves such a group's scale infinite) or whose error is not finite is refused, never written
    with infinite scales, which decode to NaN."""
    why = unrepresentable(qt, err, "float16")
    if why:
        raise UnsupportedFormat(f"cannot be written as {type_name}, whose block scales are float16: {why}; keep "
                                f"it float: --gguf-float --gguf-float-type f32", file=file, tensor=tensor)


def _own_blocks(m: QuantModule, opts: Options) -> bool:
    """A GGUF source's block tensor of a type qconv does not write (K-quants, IQ types), which GGUF -> GGUF
    copies byte for byte (its rows are already in llama.cpp's order), unless --bits or --gguf-float asks
    for another type."""
    return m.family == "gguf" and m.details["ggml_type"] not in codec.TYPES and opts.bits is None \
        and not opts.gguf_float


def _raw_out(info, name: str, type_name: str, source: str, tally: Tally | None) -> _Out:
    """A GGUF source's block tensor as its stored bytes, in its own type (a module's: counted as one whose
    codes are kept)."""
    rows = info.shape[0]
    stored = replace(info, dtype="U8", shape=(rows, info.nbytes // max(rows, 1)), decode=None)

    def chunks():
        if tally is not None:
            tally.add(source, Stats(modules=1))
        yield from plain_chunks(stored, "U8")

    return _Out(name, type_name, stored.shape, np.uint8, info.nbytes, chunks, source, kept=True)


def _dequantized_out(comp, det, m: QuantModule, name: str, src_dtype: str, heads: int | None,
                     opts: Options) -> _Out:
    """A module whose codes cannot be kept, stored (--gguf-float) as its exact weights in the model's
    dtype (the float model qconv dequantize writes, one module at a time) or --gguf-float-type's."""
    code = _float_type(opts, FLOAT_CODES[src_dtype])
    np_dtype, type_name = _FLOAT_GGML[code]
    rounding = Rounding(code, m.name, comp.tensors[m.weight_tensors[0]].file if m.weight_tensors else comp.path)

    def chunks():
        source = whole(read_module(comp, det, m, src_dtype))
        rows = rounding.encode(exact_weights(comp, m, source))
        yield codec.permute_rows(rows, heads) if heads else rows

    n = m.out_features * m.in_features
    return _Out(name, type_name, (m.out_features, m.in_features), np_dtype, n * np.dtype(np_dtype).itemsize, chunks,
                m.name, kept=None, stored_float=True, rounded=(rounding,))


def _float_q8_0(info, name: str, heads: int | None, opts: Options, tally: Tally) -> _Out:
    """A 2-D float tensor (embeddings, lm_head) quantized to Q8_0 (--gguf-float-type q8_0), as a
    requantized module is: groups of 32 with the per-group search, its error reported."""
    if len(info.shape) != 2 or info.shape[1] % codec.QK:
        raise UnsupportedFormat(f"shape {list(info.shape)} is not rows of whole 32-weight Q8_0 blocks; use "
                                f"--gguf-float-type f16, bf16 or f32", file=info.file, tensor=info.name)
    out, inp = info.shape
    row = codec.row_bytes("Q8_0", inp)

    def chunks():
        st = Stats(modules=1)
        w = to_float32(read_array(info), info.dtype)
        if not np.all(np.isfinite(w)):
            raise CorruptCheckpoint("holds non-finite values (NaN or infinity); they cannot be quantized to Q8_0",
                                    file=info.file, tensor=info.name)
        qt, err = requantize(w, 8, codec.QK, True, "F16", FLOAT_NAMES[info.dtype], search=opts.search)
        _refuse_unrepresentable(qt, err, "Q8_0", info.name, info.file)
        st.requantized(info.name, "float tensor quantized (--gguf-float-type q8_0)", FLOAT_NAMES[info.dtype],
                       "Q8_0", err)
        blocks, _ = codec.encode(qt, "Q8_0")
        tally.add(info.name, st)
        yield codec.permute_rows(blocks, heads) if heads else blocks

    return _Out(name, "Q8_0", (out, row), np.uint8, out * row, chunks, info.name, kept=False)


def _float_out(comp: Component, info, arch, n_blocks: int, where, opts: Options, tally: Tally,
               decoded: Mapping) -> _Out | None:
    name = garch.gguf_name(info.name, arch, n_blocks, where)
    if name is None:
        return None
    if info.name in decoded:                          # a GGUF source's block-typed embeddings: as they are,
        if opts.gguf_float_type == "auto":
            return _raw_out(info, name, decoded[info.name], info.name, None)
        info = replace(info, dtype="F32")             # or their exact decoding, rounded once to the type asked
    if info.dtype not in _FLOAT_GGML:
        raise UnsupportedFormat(f"is {info.dtype}, which qconv does not write to GGUF as it is", file=info.file,
                                tensor=info.name)
    # as convert_hf_to_gguf stores them: 1-D tensors, norms, the MoE router and biases as F32
    f32 = len(info.shape) == 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name \
        or not name.endswith(".weight")
    # the 2-D ones (embeddings, lm_head) in the model's dtype, or --gguf-float-type's
    code = "F32" if f32 else _float_type(opts, info.dtype)
    heads = garch.heads_of(comp.config, info.name) if arch.permute_qk else None
    if code == "Q8_0":
        return _float_q8_0(info, name, heads, opts, tally)
    np_dtype, type_name = _FLOAT_GGML[code]
    n = int(np.prod(info.shape, dtype=np.int64))
    rounding = Rounding(code, info.name, info.file)

    def converted():
        if code in (info.dtype, "F32"):               # exact: the values as they are
            yield from plain_chunks(info, code)
        else:
            for c in plain_chunks(info, info.dtype):
                yield rounding.encode(to_float32(c, info.dtype))

    def chunks():
        if heads:                                     # a float q / k: its rows permuted as a whole
            data = np.concatenate([c.reshape(-1, info.shape[-1]) for c in converted()])
            yield codec.permute_rows(data, heads).view(np_dtype)
            return
        for c in converted():
            yield np.ascontiguousarray(c).view(np_dtype)

    return _Out(name, type_name, tuple(info.shape), np_dtype, n * np.dtype(np_dtype).itemsize, chunks, info.name,
                rounded=(rounding,))


def modules_of(comp: Component, det, opts: Options) -> list[QuantModule]:
    """The Linears written as blocks: the source's quantized modules (fused MoE experts split into one
    module per expert, as convert splits them), or an unquantized source's decoder Linears (data-free)."""
    if not det.modules:
        return check_source(comp, det, opts)
    return [v for m in det.modules for v in (_experts_of(comp, m, opts) if m.experts else [m])]


def _experts_of(comp: Component, m: QuantModule, opts: Options) -> list[QuantModule]:
    """A fused experts module as one module per expert. gpt-oss' interleaved gate_up (MXFP4) splits here
    too, where the model is one llama.cpp stacks experts for (qwen3moe): llama.cpp's *_exps take gate and
    up apart, as its own converter splits gpt-oss (conversion/gpt_oss.py: rows ``::2`` and ``1::2``), and a
    row's 32-blocks run along the input, so each expert's gate / up rows keep their codes and scales
    (experts.split_interleaved). Every other target keeps convert's refusal (split_experts)."""
    arch = garch.ARCHS.get((comp.config or {}).get("model_type"))
    if m.details.get("interleaved") and arch is not None and arch.moe:
        try:
            return split_interleaved(m)
        except NotStorable as exc:
            raise UnsupportedFormat(f"holds fused MoE experts that cannot be split into llama.cpp's gate and up "
                                    f"experts: {exc}", file=comp.tensors[m.weight_tensors[0]].file,
                                    tensor=m.name) from None
    return split_experts(comp, m, opts)


def _expert_bias(comp: Component, info, fused: set[str]) -> bool:
    """Whether a tensor is a fused experts module's bias (gpt-oss' ``experts.gate_up_proj_bias`` /
    ``down_proj_bias``), left out of the GGUF: llama.cpp's qwen3moe has no expert biases, so only an
    all-zero one (the same model) is; any other is refused, never dropped."""
    if not info.name.endswith("_bias") or info.name[: -len("_bias")] not in fused:
        return False
    if np.any(to_float32(read_array(info), info.dtype) != 0):
        raise UnsupportedFormat("holds nonzero expert biases, which llama.cpp's qwen3moe does not load; "
                                "nothing written", file=info.file, tensor=info.name)
    return True


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.([a-z_]+)$")


def _stacked(comp, det, group: list[QuantModule], opts: Options, arch, name: str, src_dtype: str,
             tally: Tally) -> _Out:
    """One llama.cpp *_exps tensor [experts, out, in]: the experts' modules one after another, in one
    type. Where their own types differ, the minority is requantized to the majority's type."""
    typed = [_natural_type(comp, det, m, opts, src_dtype) for m in group]
    as_float = opts.gguf_float and any(reason for _, reason in typed)
    kinds = [t for t, _ in typed]
    common = max(sorted(set(kinds), key=str), key=kinds.count)
    outs = []
    for m, (t, reason) in zip(group, typed):
        if t != common and not as_float:
            t, reason = common, f"the experts stacked in {name} share one type ({common})"
        outs.append(_module_out(comp, det, m, opts, arch, name, src_dtype, tally, (t, reason), as_float))
    first = outs[0]

    def chunks():
        for o in outs:
            yield from o.chunks()

    kept = None if first.stored_float else all(o.kept for o in outs)
    pattern = _EXPERT.sub(r"\1.{}.\3", group[0].name)
    return _Out(name, first.type_name, (len(outs), *first.shape), first.dtype, sum(o.nbytes for o in outs), chunks,
                pattern, kept=kept, stored_float=first.stored_float, experts=len(outs),
                rounded=tuple(r for o in outs for r in o.rounded))


def _source_fields(comp: Component) -> list | None:
    """A GGUF source's own metadata as (key, (value type, array item type), value), types as they are
    in the file; None for a folder."""
    if not (comp.path.is_file() and looks_like_gguf(comp.path)):
        return None
    st = comp.path.stat()
    return _fields(str(comp.path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _fields(path: str, size: int, mtime: int) -> list:
    import gguf

    out = []
    for key, f in gguf.GGUFReader(path).fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, (vtype, sub), f.contents()))
    return out


def arch_of(comp: Component):
    """The architecture written: a GGUF source's own (a VL model's text decoder stays one, though its
    config is the text model's), else the Hugging Face config's."""
    fields = _source_fields(comp)
    own = next((v for k, _, v in fields if k == "general.architecture"), None) if fields else None
    if own in garch.BY_GGUF_NAME:
        return garch.BY_GGUF_NAME[own]
    garch.refuse_unwritten(comp.config, comp.tensors, comp.path / "config.json")
    return garch.arch_of(comp.config, comp.path)


def _source_rope_factors(comp: Component):
    """A GGUF source's own rope_freqs, as they are (its config holds the llama-3 rope they were read as)."""
    t = next((t for t in read_gguf(comp.path).tensors if t.name == ROPE_FREQS_TENSOR), None)
    return None if t is None else rope_factors(t)


def _metadata(comp: Component, arch) -> list:
    """The architecture's hyperparameters and the tokenizer: a GGUF source's own, as they are (types
    included), else from the Hugging Face config and tokenizer.json."""
    fields = _source_fields(comp)
    if fields is not None:
        return [kv for kv in fields if kv[0].startswith((f"{arch.name}.", "tokenizer."))]
    return garch.hparams(comp.config, arch, comp.path) + tokenizer(comp.path, comp.config, comp.root)


def plan(comp: Component, opts: Options, tally: Tally) -> tuple[object, list[_Out], list]:
    det = require_decodable(comp)
    arch = arch_of(comp)
    modules = modules_of(comp, det, opts)
    n_blocks = int(garch.text_config(comp.config)["num_hidden_layers"])
    src_dtype = model_dtype(comp, det)
    outs, claimed, stacks = [], set(det.claimed_tensors), {}
    for m in modules:
        claimed.update(m.weight_tensors)
        where = comp.tensors[m.weight_tensors[0]].file if m.weight_tensors else comp.path
        expert = _EXPERT.match(m.name)
        if expert and arch.moe:
            stacks.setdefault(f"{expert[1]}.{expert[3]}", {})[int(expert[2])] = m
            continue
        name = garch.gguf_name(m.name + ".weight", arch, n_blocks, where)
        if name is None:                              # a VL model's vision tower: the mmproj file's
            continue
        typed = _natural_type(comp, det, m, opts, src_dtype)
        outs.append(_module_out(comp, det, m, opts, arch, name, src_dtype, tally, typed,
                                as_float=bool(opts.gguf_float and typed[1])))
    for stem, by_index in stacks.items():
        group = [by_index[i] for i in sorted(by_index)]
        if sorted(by_index) != list(range(len(group))) or len(group) != garch.experts(comp.config):
            raise UnsupportedFormat(f"holds experts {sorted(by_index)[:8]}... of {stem}, not 0..{garch.experts(comp.config) - 1} "
                                    f"as llama.cpp stacks them", file=comp.path, tensor=stem)
        name = garch.gguf_name(stem + ".weight", arch, n_blocks, comp.path)
        outs.append(_stacked(comp, det, group, opts, arch, name, src_dtype, tally))
    fused = {m.details["rows_of"][0].name for m in modules if "rows_of" in m.details}
    for name, info in sorted(comp.tensors.items(), key=lambda kv: natural_key(kv[0])):
        if name not in claimed and not _expert_bias(comp, info, fused):
            o = _float_out(comp, info, arch, n_blocks, info.file, opts, tally, (det.qc or {}).get("decoded") or {})
            if o is not None:
                outs.append(o)
    outs.sort(key=lambda o: natural_key(o.source))
    factors = _source_rope_factors(comp) if _source_fields(comp) is not None else garch.rope_freqs(comp.config)
    if factors is not None:                           # llama-3's rope scaling, as llama.cpp's converter writes it
        outs.insert(0, _Out("rope_freqs.weight", "F32", factors.shape, np.float32, factors.nbytes,
                            lambda: iter([factors]), ROPE_FREQS))
    meta = _metadata(comp, arch)
    _check_metadata(meta, comp.path / "config.json" if comp.path.is_dir() else comp.path)
    return det, outs, meta


_F32_MAX = 3.4028234663852886e38
_FITS = {"u32": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 32,
         "i32": lambda v: isinstance(v, int) and not isinstance(v, bool) and -(1 << 31) <= v < 1 << 31,
         "f32": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= _F32_MAX,
         "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str)}


def _check_metadata(meta: list, where) -> None:
    """Every value read from the config fits the GGUF type it is written as (a context length of 2^62 is
    no u32, an rms epsilon of 1e300 no float32): refused by key before anything is written."""
    for key, kind, value in meta:
        if isinstance(kind, tuple):                   # a GGUF source's own field: read in its own type
            continue
        element = kind[:-2] if kind.endswith("[]") else kind
        values = value if kind.endswith("[]") else [value]
        fits = _FITS.get(element, lambda v: True)
        bad = [v for v in values if not fits(v)]      # NaN too: abs(nan) <= _F32_MAX is False
        if bad:
            raise CorruptCheckpoint(f"gives GGUF's {key} the value {bad[0]!r}, which its {element} cannot hold; "
                                    f"nothing written", file=where)


def _source_name(comp: Component) -> str:
    """general.name: a GGUF source's own, else the source folder's name."""
    name = next((v for k, _, v in _source_fields(comp) or [] if k == "general.name"), None)
    return name if isinstance(name, str) else comp.path.name


def _file_type(outs: list[_Out]) -> int:
    """general.file_type: the type holding most of the modules' bytes (block-typed or stored float), else
    of the 2-D tensors' (a model of float tensors only), as llama.cpp's converter names its --outtype."""
    weights: dict[str, int] = {}
    for group in ([o for o in outs if o.kept is not None or o.stored_float], [o for o in outs if len(o.shape) == 2]):
        for o in group:
            weights[o.type_name] = weights.get(o.type_name, 0) + o.nbytes
        if weights:
            break
    top = max(sorted(weights), key=weights.get) if weights else "F16"
    return codec.FTYPE.get(top, codec.FTYPE_GUESSED)


def header_keys(comp: Component, kv: list, outs: list[_Out]) -> list:
    """Every (key, type, value) of the text GGUF's metadata, in the order written: the planned ones (plan's
    third part), then general.*."""
    import gguf

    return kv + [("general.name", "str", _source_name(comp)), ("general.file_type", "u32", _file_type(outs)),
                 ("general.quantization_version", "u32", gguf.GGML_QUANT_VERSION),
                 ("general.quantized_by", "str", "qconv")]


def vision_of(comp: Component, det, opts: Options):
    """The mmproj file's plan (mmproj.plan) where the text model's vision tower is written beside it, why not
    (a sentence), or None (--no-mmproj, or a model with no vision tower)."""
    return mmproj.plan(comp, det.modules, opts.mmproj_type) if opts.mmproj and arch_of(comp).text_of else None


def _codes(o: _Out, requantized: set) -> str | None:
    if o.stored_float:
        return "float"
    if o.kept is None:
        return None
    parts = [o.source.format(i) for i in range(o.experts)] if o.experts else [o.source]
    return "requantized" if any(p in requantized for p in parts) else "kept"


def _rounded(o: _Out) -> dict:
    values = sum(r.values for r in o.rounded)
    return {"rounded": {"to": o.type_name, "values": values,
                        "max_rel_error": max(r.max_rel_error for r in o.rounded)}} if values else {}


def report(comp: Component, det, opts: Options, outs: list[_Out], summary: dict, vision, files: list[Path],
           written: int) -> dict:
    """The component's report, once its file is written (files: the text GGUF's, split or not; written: its
    tensors' bytes) and summary holds the tally's summary and, where written, the mmproj file's."""
    text_of = arch_of(comp).text_of
    left = sum(1 for n in comp.tensors if text_of and garch.is_vision(n))
    warnings = list(det.warnings)
    if not isinstance(vision, tuple) and left:
        warnings.append(f"{left} vision-tower tensors not written (--no-mmproj): llama.cpp reads a VL model's "
                        f"vision tower from an mmproj file")
    activations, lost = activation_report(det.modules, {}, "gguf", GGUF_ACTIVATIONS)
    if activations["dropped"]:
        summary["static_activation_scales"] = activations
    warnings += lost
    requantized = {r["module"] for r in summary["layers"]}
    tensors = [{"tensor": o.name, "source": o.source, "type": o.type_name, "codes": _codes(o, requantized),
                **({"experts": o.experts} if o.experts else {}), **_rounded(o)} for o in outs]
    by_type: dict[str, int] = {}
    for o in outs:
        by_type[o.type_name] = by_type.get(o.type_name, 0) + 1
    bits = sorted({4 if t == "MXFP4" else int(t[1]) for t in by_type if t == "MXFP4" or t[:1] == "Q"})
    return {"component": comp.name, "from": det.method, "to": "gguf", "search": opts.search, "bits": bits,
            **summary, "gguf_types": dict(sorted(by_type.items())), "gguf_tensors": tensors,
            "float_rounded": [{"tensor": t["tensor"], "source": t["source"], **t["rounded"]} for t in tensors
                              if "rounded" in t],
            "shards": [f.name for f in files], "tensors": len(outs), "bytes_written": written,
            "warnings": warnings}


def check(comp: Component, files: list[Path], report: dict, shown: Path) -> dict:
    """convert --validate for GGUF: every tensor read back with llama.cpp's own reader and decoder
    (gguf-py's GGUFReader and quants.dequantize), q / k rows put back in Hugging Face order, against the
    source: a module whose codes were kept must equal the source's dequantization up to the float16
    rounding of its scales (|W_gguf - W| <= max_scale_rel_error |W| per weight, as reported); a
    requantized one (Q8_0 embeddings too) must have the error convert reported; a float tensor must equal
    the source's values converted to the type written (F32, F16 or BF16, rounded to nearest even), and
    every tensor must have the type the summary names. Raises ValidationFailed, naming the first tensor
    that does not."""
    import gguf

    det = require_decodable(comp)
    src_dtype = model_dtype(comp, det)
    modules = {m.name: m for m in modules_of(comp, det, Options("gguf"))}
    permute = arch_of(comp).permute_qk
    stored = {}
    for f in files:
        for t in gguf.GGUFReader(f).tensors:
            stored[t.name] = t
    errors = {r["module"]: r["rel_frobenius"] for r in report["layers"]}
    bound = report["max_scale_rel_error"]
    checked = 0
    for entry in report["gguf_tensors"]:
        t = stored.get(entry["tensor"])
        if t is None:
            raise ValidationFailed(f"validation failed, nothing written: tensor {entry['tensor']!r} is missing",
                                   file=shown)
        if t.tensor_type.name != entry["type"]:
            raise ValidationFailed(f"validation failed, nothing written: {entry['tensor']} is {t.tensor_type.name}, "
                                   f"not {entry['type']}", file=shown)
        got = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        if entry["source"] == ROPE_FREQS:
            if not np.allclose(got, garch.rope_freqs(comp.config), rtol=1e-5, atol=0):
                raise ValidationFailed(f"validation failed, nothing written: {entry['tensor']} is not llama-3's rope "
                                       f"factors of config.json", file=shown)
            checked += 1
            continue
        n = entry.get("experts", 0)
        parts = [entry["source"].format(i) for i in range(n)] if n else [entry["source"]]
        got = got.reshape(max(n, 1), -1, got.shape[-1])
        for part, w in zip(parts, got):
            why = _mismatch(comp, det, modules, part, w, entry, errors, bound, src_dtype, permute)
            if why:
                raise ValidationFailed(f"validation failed, nothing written: {entry['tensor']} ({part}) does not "
                                       f"read back as the source: {why}", file=shown)
            checked += 1
    return {"ok": True, "layers": checked, "device": "cpu", "reader": "gguf-py (GGUFReader, quants.dequantize)"}


def _mismatch(comp, det, modules, part: str, got: np.ndarray, entry: dict, errors: dict, bound: float,
              src_dtype: str, permute: bool) -> str | None:
    """Why one module's (or float tensor's) weights as read back from the GGUF are not what was written
    from the source; None where they are (check)."""
    m = modules.get(part)
    if m is not None:
        source = whole(read_module(comp, det, m, src_dtype))
        ref = exact_weights(comp, m, source)
        heads = garch.heads_of(comp.config, part + ".weight") if permute else None
    else:
        info = comp.tensors[part]
        if info.decode is not None:                   # a GGUF source's block-typed tensor: its exact decoding
            info = replace(info, dtype="F32")
        ref = to_float32(read_array(info), info.dtype)
        heads = garch.heads_of(comp.config, part) if permute else None
    got = got.reshape(ref.shape)
    if heads:
        got = codec.unpermute_rows(got, heads)
    if entry["type"] in _FLOAT_GGML:                  # a float tensor: its values in the type written
        code = entry["type"]
        ref = to_float32(encode_float(np.ascontiguousarray(ref, np.float32), code), code)
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    if part in errors:                                # requantized: the error convert reported
        norm = float(np.linalg.norm(ref.astype(np.float64)))
        rel = float(np.linalg.norm(diff)) / norm if norm else 0.0
        if not rel <= errors[part] * (1 + 1e-5) + 1e-6:  # the report rounds to 6 places; NaN fails
            return f"relative error {rel:.3g}, convert reported {errors[part]:.3g}"
        return None
    tol = (bound + 2.0 ** -21) * np.abs(ref.astype(np.float64)) + 2.0 ** -25 if entry["codes"] == "kept" else 0
    if not np.all(diff <= tol):
        return f"largest difference {float(diff.max(initial=0)):.3g}"
    return None
