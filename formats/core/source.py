"""A source as the conversions read it: the modules to convert (the source's quantized ones, per-expert
views of fused experts, or an unquantized model's Linears to quantize data-free), each module's spec from
headers and config, and its exact float32 weight read a window of rows at a time. Shared by every writer
(convert/'s target_spec.py and module_writer.py, gguf/writer.py); nothing here writes."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from ..storage.checkpoint import Component
from ..storage.safetensors_header import DTYPES, FLOAT_DTYPES
from ..storage.tensor_io import FLOAT_NAMES
from .detect import METHOD_NAMES, Detection
from .experts import is_fused_name, split_module, why_not_split
from .ir import FloatSpec, FloatWeight, QuantSpec
from .layout import UNQUANTIZED, QuantModule, block_prefix, natural_key
from .minifloat import BOOKS
from .options import FLOAT_TARGETS
from .request import Options
from .registry import family as registered_family, target as registered_target
from .requantize import ExactRows
from .threads import on_cores


def where_of(comp: Component, m: QuantModule) -> dict:
    first = comp.tensors.get(m.weight_tensors[0]) if m.weight_tensors else None
    return {"file": first.file if first else None, "tensor": m.name}


def finite_rows(comp: Component, m: QuantModule, qt, r0: int, r1: int) -> np.ndarray:
    """Rows r0:r1 of a module's exact float32 weight, refused (not computed on with numpy's overflow
    warnings) when codes times scales are not finite in float32: a source whose finite scales are
    absurd (a bf16 scale of 3e38), which no float folder and no requantization can hold."""
    with np.errstate(over="ignore", invalid="ignore"):
        w = qt.dequantize_rows(r0, r1)
    if not np.isfinite(w).all():
        raise CorruptCheckpoint(f"its codes times its scales are not finite in float32 (largest scale "
                                f"{float(np.abs(qt.scales).max()):.3g}): no float folder or requantization can hold it", **where_of(comp, m))
    return w


_ROUTERS = ("gate", "router", "shared_expert_gate")


_VISION = re.compile(r"(^|\.)(visual|vision[a-z_]*)(\.|$)")


def data_free_modules(comp: Component, opts: Options) -> list[QuantModule]:
    """The Linears of an unquantized component that quantizers quantize: 2-D float16/bfloat16/float32
    `.weight` tensors inside the numbered decoder stacks (model.layers.N...), as auto-round does by
    default. Embeddings, lm_head and norms sit outside the stacks or are not 2-D; vision towers
    (`visual`, `vision*` in the name) stay float, as auto-round leaves them for multimodal models, and
    so do MoE routers (`mlp.gate`, `router`, `shared_expert_gate`: [experts, hidden], which every
    quantizer of MoE models leaves in float: llm-compressor's and transformers' FP8, GPTQModel)."""
    modules = []
    for name in linear_modules(comp):
        info = comp.tensors[name + ".weight"]
        leaf = name.rsplit(".", 1)[-1]
        if info.dtype in FLOAT_NAMES and min(info.shape) > 0 and block_prefix(name) \
                and not _VISION.search(name) and "embed" not in leaf and leaf not in _ROUTERS:
            out, inp = info.shape
            modules.append(QuantModule(name, UNQUANTIZED, FLOAT_NAMES[info.dtype], DTYPES[info.dtype][0], out, inp,
                                       (info.name,), (), details={"dtype": FLOAT_NAMES[info.dtype]}))
    for name, info in comp.tensors.items():      # fused experts [E, R, in]: one Linear per expert
        if len(info.shape) == 3 and info.dtype in FLOAT_NAMES and is_fused_name(name) and block_prefix(name) \
                and not _VISION.search(name) and min(info.shape) > 0:
            modules.extend(split_experts(comp, float_fused(info), opts))
    return sorted(modules, key=lambda m: natural_key(m.name))


def float_fused(info) -> QuantModule:
    """A float fused experts tensor [E, R, in] as one module of E * R rows (split_experts' parent)."""
    experts, rows, inp = info.shape
    return QuantModule(info.name, UNQUANTIZED, FLOAT_NAMES[info.dtype], DTYPES[info.dtype][0], experts * rows,
                       inp, (info.name,), (), details={"dtype": FLOAT_NAMES[info.dtype]}, experts=experts)


def whole(source):
    """A source read lazily (a float module's rows, core/requantize.ExactRows) as one float32 array: what
    the paths that re-express a whole module take. Any other source is returned as it is."""
    if isinstance(source, FloatWeight) and not isinstance(source.values, np.ndarray):
        return replace(source, values=np.asarray(source.values))
    return source


def parallel_rows(read, shape):
    """read(r0, r1) for a large window as reads of blocks of rows on every core, into one array."""
    from .requantize import BLOCK_ELEMENTS

    def rows(r0: int, r1: int) -> np.ndarray:
        step = max(1, BLOCK_ELEMENTS // max(1, shape[1]))
        if r1 - r0 <= step:
            return read(r0, r1)
        out = np.empty((r1 - r0, shape[1]), np.float32)

        def part(a: int) -> None:
            b = min(r1, a + step)
            out[a - r0:b - r0] = read(a, b)
        on_cores(part, range(r0, r1, step))
        return out
    return rows


def exact_rows(comp: Component, m: QuantModule, source):
    """The source module's exact float32 weight as ExactRows (read a window at a time): what the lossy
    paths requantize; refused where a window is not finite."""
    if isinstance(source, FloatWeight):
        return source.values
    shape = tuple(source.shape)
    return ExactRows(shape, parallel_rows(lambda r0, r1: finite_rows(comp, m, source, r0, r1), shape))


def refuse(m: QuantModule, comp: Component, why: str) -> UnsupportedFormat:
    first = comp.tensors.get(m.weight_tensors[0]) if m.weight_tensors else None
    return UnsupportedFormat(why, file=first.file if first else None, tensor=m.name)


def exact_weights(comp: Component, m: QuantModule, source) -> np.ndarray:
    """The source module's exact float32 weight, which a lossy path requantizes: refused where it is not
    finite (a float source's NaN was refused when read; a quantized one's here, dequantize.finite_rows)."""
    if isinstance(source, FloatWeight):
        return np.asarray(source.values)
    return finite_rows(comp, m, source, 0, m.out_features)


def linear_modules(comp: Component) -> list[str]:
    return [n[: -len(".weight")] for n, i in comp.tensors.items()
            if n.endswith(".weight") and len(i.shape) == 2 and i.dtype in FLOAT_DTYPES]


def check_source(comp: Component, det: Detection, opts: Options) -> list[QuantModule]:
    """The modules to convert: the source's quantized ones, or for an unquantized source, the Linears
    to quantize data-free. Refused: a source of another method than the verb names (bnb8-to-gptq of a
    GPTQ folder), and an unquantized one with no Linear in a decoder stack."""
    where = comp.files[0] if comp.files else comp.path
    if opts.source is not None and {m.family for m in det.modules} != {opts.source}:
        raise UnsupportedFormat(f"is {det.method}, not {METHOD_NAMES[opts.source]}; this verb converts "
                                f"only {METHOD_NAMES[opts.source]} checkpoints (use `qconv convert --to "
                                f"{opts.to}` for other sources)", file=where)
    if det.modules or opts.to in FLOAT_TARGETS:
        if opts.to in FLOAT_TARGETS or registered_target(opts.to).caps.fused_experts:
            return list(det.modules)
        return [v for m in det.modules for v in (split_experts(comp, m, opts) if m.experts else [m])]
    modules = data_free_modules(comp, opts)
    if not modules:
        raise UnsupportedFormat(f"has no quantized modules ({det.method}) and no float Linear weight in a "
                                f"numbered decoder stack (model.layers.N...) to quantize", file=where)
    return modules


def split_experts(comp: Component, m: QuantModule, opts: Options) -> list[QuantModule]:
    """A fused experts module as one module per expert (formats/core/experts.py), the layout the target's
    loaders read; refused where the model type's fused layout is not the one qconv splits, or the rows
    do not split."""
    why = why_not_split(comp.config, m)
    step = registered_family(m.family).row_step(m)
    views = []
    if why is None:
        try:
            views = split_module(m, comp.config)
        except NotStorable as exc:
            why = f"{exc}"
    if why is None and any(v.details["rows_of"][1] % step or v.out_features % step for v in views):
        why = f"its experts do not start on its format's {step}-row windows"
    if why is not None:
        rows = m.out_features // m.experts
        raise UnsupportedFormat(f"holds fused MoE experts ({m.experts} experts in one [{m.experts}, {rows}, "
                                f"{m.in_features}] tensor), which cannot be split into the one Linear per expert "
                                f"{opts.to} stores: {why}; `qconv dequantize` keeps the fused layout",
                                file=comp.tensors[m.weight_tensors[0]].file, tensor=m.name)
    return views


def source_spec(comp, det: Detection, m: QuantModule, src_dtype: str) -> QuantSpec:
    """The source module's spec without decoding its data (from headers and config)."""
    own = registered_family(m.family).source_spec(m, comp.tensors, det.qc)
    if own is not None:                         # the family's own rule (MLX: zero points from the data)
        return own
    if m.details.get("float_spec") is not None:   # a stored type with no exact form here (GGUF's K-quants)
        return FloatSpec(**m.details["float_spec"])
    if m.scheme in BOOKS:                       # every FP8 / FP4 dialect (layout.QuantModule details)
        bits, book = BOOKS[m.scheme]
        return QuantSpec(m.scheme, bits, m.group_size or -1, True, codebook=book,
                         scale_dtype=m.details.get("scales_dtype") or "F32", block_rows=m.details.get("block_rows", 1),
                         global_scale=m.details.get("global_scale"))
    offset = m.details.get("offset")            # float offsets w = s * q + b (GGUF's Q4_1, K-quants): no zero points
    sym = False if offset else registered_family(m.family).symmetric(m, det.qc)
    group = -1 if m.details.get("groups") == 1 else (m.group_size or -1)
    return QuantSpec("int", m.bits, group, sym, scale_dtype=m.details.get("scales_dtype") or "F16", offset=offset)
