"""`qconv convert` and `qconv bnb8-to-gptq`: rewrite a checkpoint in another format through the
canonical representation (read with the source's codec, write with the target's), keeping codes
exactly wherever the arithmetic allows.

Lossless paths (each module's codes carried over unchanged):

* bitsandbytes int8 -> GPTQ / auto-round 8-bit, one group per output row, symmetric:
  q = CB + 128, z = 128, s = SCB / 127 stored in --scale-dtype (the only rounding; reported per run);
* GPTQ 8-bit, one group per row, symmetric -> bitsandbytes int8: CB = q - 128, SCB recovered exactly
  (bnb_codec.scb_from_scales), so both round trips are byte-identical;
* GPTQ v1 <-> v2 <-> auto-round (auto_round:auto_gptq): codes, scales and zero points repacked, zero
  points re-encoded one field at a time; bitsandbytes 4-bit repacks (storage dtype, double quant).

Every other path requantizes each module from the source's exact weights (requantize.py for integers,
bnb_codec.quantize_4bit for nf4/fp4) and reports the error it adds next to round-to-nearest's. An
unquantized source is quantized the same way, data-free, from its float weights (_data_free_modules).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import CorruptCheckpoint, UnsupportedFormat, UsageError
from ..formats.storage.checkpoint import Component
from ..formats.core.registry import ModuleContext, WriteContext, family as registered_family, target as registered_target, targets as registered_targets
from ..formats.core.detect import METHOD_NAMES, Detection, without_quantization
from ..formats.core.ir import FloatSpec, FloatWeight, QuantSpec, QuantTensor, stack_rows
from ..formats.core.activation import activation_report, static_activation
from ..formats.core.minifloat import BOOKS
from ..formats.core.layout import QuantModule, block_prefix, examples, natural_key
from ..formats.core.experts import is_fused_name, split_module, why_not_split
from ..formats.core.reader import model_dtype, read_float_rows, read_module, require_decodable
from ..formats.storage.safetensors_header import DTYPES, FLOAT_DTYPES
from ..formats.storage.tensor_io import FLOAT_NAMES, encode_float, finite_scales, read_array, to_float32
from .dequantize import dequantize_component, finite_rows
from .engine import DEFAULT_MAX_SHARD, OutTensor, made_warnings, passthrough, run, write_component
from .parallel import Replan, on_cores
from .requantize import ExactRows, combined, error_sums, layer_error_of, requantize, unmeasurable, unrepresentable

# The quantized targets are the format registry's (formats/core/registry.py: caps or fit, plan, leaves,
# requantize / retarget, encoder, config); the float targets dequantize (dequantize.py).
PACKED_TARGETS = tuple(t.name for t in registered_targets())
FLOAT_TARGETS = ("float16", "bfloat16", "float32")
TARGETS = PACKED_TARGETS + FLOAT_TARGETS
SCALE_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


@dataclass(frozen=True)
class Options:
    to: str
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None
    scale_dtype: str | None = None      # None: the source's (bnb int8 sources: float16)
    # Options of the targets that take them (their Target.fit / plan: bitsandbytes 4-bit)
    blocksize: int | None = None        # None: the source's, else 64
    double_quant: bool | None = None    # None: the source's, else off
    quant_storage: str | None = None    # None: the source's, else uint8
    block_size: tuple[int, int] | None = None   # FP8 targets' 2-D block (None: the source's, else 128 x 128)
    source: str | None = None           # the only source method accepted (bnb8-to-gptq: "bnb8")
    search: bool = True                 # False: integer requantization is plain round-to-nearest (--no-search)
    gguf_asym: str = "Q5_0"             # --to gguf: the block type of 4-bit asymmetric modules (Q5_0 or Q4_1)
    gguf_float: bool = False            # --to gguf: modules whose codes cannot be kept stored as float
    gguf_float_type: str = "auto"       # --to gguf: embeddings, lm_head, --gguf-float modules (auto|f32|f16|bf16|q8_0)


@dataclass
class Stats:
    """What writing one module changed, for the summary: scale rounding is the only loss it allows."""
    modules: int = 0
    scales: int = 0
    scales_rounded: int = 0
    max_scale_rel_error: float = 0.0
    layers: list[dict] = field(default_factory=list)       # requantized modules and their error
    v1_zero: list[str] = field(default_factory=list)        # modules with a zero point of 0 written as v1
    scale_dtype: str | None = None   # the dtype its scales were stored in (a target may pick it per module: MLX)

    def requantized(self, module: str, reason: str, source: str, target: str, err) -> None:
        self.layers.append({"module": module, "reason": reason, "from": source, "to": target,
                            "rel_frobenius": round(float(err.rel_frobenius), 6),
                            "max_abs": float(err.max_abs), "sq_error": float(err.sq_error),
                            "rtn_rel_frobenius": round(float(err.rtn_rel_frobenius), 6),
                            "rtn_sq_error": float(err.rtn_sq_error)})

    def scale_rounding(self, exact: np.ndarray, stored: np.ndarray) -> None:
        rel = np.abs(stored.astype(np.float64) - exact.astype(np.float64)) / np.maximum(
            np.abs(exact.astype(np.float64)), np.finfo(np.float64).tiny)
        self.scales += exact.size
        self.scales_rounded += int((rel > 0).sum())
        self.max_scale_rel_error = max(self.max_scale_rel_error, float(rel.max(initial=0.0)))


@dataclass
class Tally:
    """Every written module's Stats, by module. A module whose tensors fall in two shards that two worker
    processes write (--jobs) is encoded by both: it counts once, so the summary is the same whatever N."""
    of: dict[str, Stats] = field(default_factory=dict)

    def add(self, module: str, stats: Stats) -> None:
        self.of[module] = stats

    def merge(self, other: "Tally") -> None:          # a worker's (parallel.write_shards)
        self.of.update(other.of)

    def summary(self) -> dict:
        layers = sorted((r for st in self.of.values() for r in st.layers), key=lambda r: natural_key(r["module"]))
        sq, rtn = sum(r["sq_error"] for r in layers), sum(r["rtn_sq_error"] for r in layers)
        modules = sum(st.modules for st in self.of.values())
        return {"modules": modules, "codes_kept": modules - len(layers), "requantized": len(layers),
                "scales": sum(st.scales for st in self.of.values()),
                "scales_rounded": sum(st.scales_rounded for st in self.of.values()),
                "max_scale_rel_error": max((st.max_scale_rel_error for st in self.of.values()), default=0.0),
                "max_rel_frobenius": max((r["rel_frobenius"] for r in layers), default=0.0),
                "sq_error_vs_rtn": round(sq / rtn, 4) if rtn else None, "layers": layers,
                "v1_zero_points": sorted((n for st in self.of.values() for n in st.v1_zero), key=natural_key),
                "scale_dtypes": dict(sorted(Counter(st.scale_dtype for st in self.of.values() if st.scale_dtype).items()))}


_ROUTERS = ("gate", "router", "shared_expert_gate")
_VISION = re.compile(r"(^|\.)(visual|vision[a-z_]*)(\.|$)")


def _data_free_modules(comp: Component, opts: Options) -> list[QuantModule]:
    """The Linears of an unquantized component that quantizers quantize: 2-D float16/bfloat16/float32
    `.weight` tensors inside the numbered decoder stacks (model.layers.N...), as auto-round does by
    default. Embeddings, lm_head and norms sit outside the stacks or are not 2-D; vision towers
    (`visual`, `vision*` in the name) stay float, as auto-round leaves them for multimodal models, and
    so do MoE routers (`mlp.gate`, `router`, `shared_expert_gate`: [experts, hidden], which every
    quantizer of MoE models leaves in float: llm-compressor's and transformers' FP8, GPTQModel)."""
    modules = []
    for name in _linear_modules(comp):
        info = comp.tensors[name + ".weight"]
        leaf = name.rsplit(".", 1)[-1]
        if info.dtype in FLOAT_NAMES and min(info.shape) > 0 and block_prefix(name) \
                and not _VISION.search(name) and "embed" not in leaf and leaf not in _ROUTERS:
            out, inp = info.shape
            modules.append(QuantModule(name, "float", FLOAT_NAMES[info.dtype], DTYPES[info.dtype][0], out, inp,
                                       (info.name,), (), details={"dtype": FLOAT_NAMES[info.dtype]}))
    for name, info in comp.tensors.items():      # fused experts [E, R, in]: one Linear per expert
        if len(info.shape) == 3 and info.dtype in FLOAT_NAMES and is_fused_name(name) and block_prefix(name) \
                and not _VISION.search(name) and min(info.shape) > 0:
            experts, rows, inp = info.shape
            fused = QuantModule(name, "float", FLOAT_NAMES[info.dtype], DTYPES[info.dtype][0], experts * rows,
                                inp, (info.name,), (), details={"dtype": FLOAT_NAMES[info.dtype]}, experts=experts)
            modules.extend(_split_experts(comp, fused, opts))
    return sorted(modules, key=lambda m: natural_key(m.name))


def _read_float(comp: Component, m: QuantModule) -> FloatWeight:
    """An unquantized module's whole float32 weight (refused where it holds a NaN or infinity)."""
    lazy = _float_rows(comp, m)
    return replace(lazy, values=np.asarray(lazy.values))


def _float_rows(comp: Component, m: QuantModule, rows: tuple[int, int] | None = None) -> FloatWeight:
    """An unquantized module to requantize (its output rows r0:r1 where given), its rows read from the
    file as they are needed (ExactRows), each window refused when it holds a NaN or infinity, as
    _read_float refuses the whole."""
    info = comp.tensors[m.weight_tensors[0]]
    first, last = rows or (0, m.out_features)

    def read(r0: int, r1: int) -> np.ndarray:
        values = read_float_rows(comp, m, (first + r0, first + r1))
        if not np.isfinite(values).all():
            raise CorruptCheckpoint("holds non-finite weights (NaN or infinity); they cannot be quantized",
                                    file=info.file, tensor=info.name)
        return values

    shape = (last - first, m.in_features)
    return FloatWeight(FloatSpec(m.scheme), shape, m.scheme, ExactRows(shape, _parallel_rows(read, shape)))


def _parallel_rows(read, shape):
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


def _exact_rows(comp: Component, m: QuantModule, source):
    """The source module's exact float32 weight as ExactRows (read a window at a time): what the lossy
    paths requantize; refused where a window is not finite."""
    if isinstance(source, FloatWeight):
        return source.values
    shape = tuple(source.shape)
    return ExactRows(shape, _parallel_rows(lambda r0, r1: finite_rows(comp, m, source, r0, r1), shape))


REQUANTIZE_WINDOW = 1 << 22     # weights of a row-separable target requantizer's window (16 MiB of float32)


def _requantize_by_rows(tgt, source, w, spec: QuantSpec, settings: Mapping):
    """(qt, LayerError) of a row-separable target requantizer (Target.requantize_rows) run on windows of
    rows (multiples of spec.block_rows), each window's error measured while it is in hand."""
    out, inp = w.shape
    step = max(1, spec.block_rows)
    per = max(step, REQUANTIZE_WINDOW // max(1, inp) // step * step)
    parts, sums, rtn_sums = [], [], []
    for r0 in range(0, max(out, 1), per):          # a module of no rows: one empty window
        rows = np.asarray(w[r0:min(out, r0 + per)], np.float32)
        qt, rtn = tgt.requantize(source, rows, spec, settings)
        parts.append(qt)
        sums.append(error_sums(rows, qt))
        rtn_sums.append(sums[-1] if rtn is qt else error_sums(rows, rtn))
    return stack_rows(parts), layer_error_of(sums, rtn_sums)


def _refuse(m: QuantModule, comp: Component, why: str) -> UnsupportedFormat:
    first = comp.tensors.get(m.weight_tensors[0]) if m.weight_tensors else None
    return UnsupportedFormat(why, file=first.file if first else None, tensor=m.name)


def _exact_weights(comp: Component, m: QuantModule, source) -> np.ndarray:
    """The source module's exact float32 weight, which a lossy path requantizes: refused where it is not
    finite (a float source's NaN was refused when read; a quantized one's here, dequantize.finite_rows)."""
    if isinstance(source, FloatWeight):
        return source.values
    return finite_rows(comp, m, source, 0, m.out_features)


def _check_scales(m: QuantModule, comp: Component, source, qt: QuantTensor, spec: QuantSpec, opts: Options,
                  lossy: str | None) -> None:
    """A narrowing of the scales that changes what a module computes is refused before its bytes are
    written (and so before DST exists): a finite scale that becomes infinite in the stored dtype (a bf16
    scale of 3e38 as float16), or, where codes are kept, a non-zero scale flushed to 0 (a bf16 scale of
    3e-9 as float16), which zeroes its whole group. Never an exit 0 with a different model."""
    scales = np.asarray(qt.scales, np.float32)
    stored = FLOAT_NAMES.get(spec.scale_dtype, "the target's dtype")
    way_out = "; " + (registered_target(opts.to).scale_hint or "use --scale-dtype bfloat16 or float32")
    bad = ~np.isfinite(scales)
    if bad.any():
        finite_source = getattr(source, "scales", None)
        largest = (f"; the largest is {float(np.abs(finite_source[np.isfinite(finite_source)]).max(initial=0.0)):.3g}"
                   if finite_source is not None else "")      # a float source has no scales to name
        raise _refuse(m, comp, f"{int(bad.sum())} scales do not fit {stored} (they would be stored as infinity"
                               f"{largest}){way_out}")
    if not lossy and getattr(source, "scales", None) is not None and source.scales.shape == scales.shape:
        flushed = (scales == 0) & (np.asarray(source.scales) != 0)
        if flushed.any():
            smallest = float(np.abs(np.asarray(source.scales, np.float64)[flushed]).min())
            raise _refuse(m, comp, f"{int(flushed.sum())} non-zero scales (the smallest {smallest:.3g}) become 0 "
                                   f"in {stored}, which would zero their groups{way_out}")


def _target_spec(m: QuantModule, src: QuantSpec, opts: Options, comp: Component,
                 act_order: bool, src_dtype: str) -> tuple[QuantSpec, str | None]:
    """The spec a module gets in the target, and why it must be requantized (None: codes are kept).
    Requantized defaults are what vLLM runs: symmetric, no act-order; a code-book source keeps its
    block size as the group size when GPTQ kernels take it (32/64/128), else 128; a float source
    (data-free) gets 4-bit, group 128. A group must divide the module's input features. A target with
    its own fit (Target.fit) fits the module itself."""
    tgt = registered_target(opts.to)
    where = comp.tensors[m.weight_tensors[0]].file if m.weight_tensors else None
    fitted = tgt.fit(m, src, opts, lambda caps=None: _negotiate(m, src, opts, where, caps)) if tgt.fit else None
    if fitted is not None:                      # the target's own fit (None: the caps negotiation below)
        spec, reason = fitted
        _check_leaves(tgt, spec, m, m.in_features, opts, where)
        return spec, reason
    inp = m.in_features
    caps = tgt.caps
    bits, group, sym, reason = _negotiate(m, src, opts, where, caps)
    if reason is None and act_order and not caps.act_order:
        reason = f"act-order groups become contiguous ({opts.to} stores no g_idx)"
    if opts.scale_dtype:
        scale_code = SCALE_CODES[opts.scale_dtype]
        if scale_code not in caps.scale_dtypes:
            raise UsageError(f"--scale-dtype {opts.scale_dtype}: {opts.to} stores scales as "
                             f"{', '.join(sorted(caps.scale_dtypes))}", tensor=m.name, file=where)
    elif not reason and (kept := _kept_scale_dtype(m, comp, src, caps, src_dtype)):
        scale_code = kept
    elif src.scale_divisor != 1:
        scale_code = caps.divisor_scale
    elif reason or src.scale_dtype not in caps.scale_dtypes:
        scale_code = "F16" if "F16" in caps.scale_dtypes else sorted(caps.scale_dtypes)[0]
    else:
        scale_code = src.scale_dtype
    spec = QuantSpec("int", bits, -1 if group <= 0 else group, sym, scale_dtype=scale_code,
                     zero_encoding=tgt.zero_encoding)
    _check_leaves(tgt, spec, m, inp, opts, where)
    return spec, reason


def _check_leaves(tgt, spec: QuantSpec, m: QuantModule, inp: int, opts: Options, where) -> None:
    """The target's predicted leaves: its layout can hold the module's shape (exit 5 where not)."""
    try:
        tgt.leaves(spec, (m.out_features, inp), False)
    except ValueError as exc:
        what = f"{spec.bits}-bit" if spec.scheme == "int" else spec.name
        raise UnsupportedFormat(f"a {m.out_features} x {inp} module cannot be stored as {what} "
                                f"{registered_family(tgt.family).method} ({opts.to}): {exc}", tensor=m.name,
                                file=where) from None


def _kept_scale_dtype(m: QuantModule, comp: Component, src: QuantSpec, caps, src_dtype: str) -> str | None:
    """The model's 16-bit dtype for a module whose codes are kept, where the target stores it and every
    scale s (stored / divisor, in float32) is exactly a value of it: what llm-compressor and AutoAWQ
    write, and what a source had before a hop through a format of fixed scale dtype (bnb8's float32
    SCB, auto_round:auto_awq's float16), so such round trips give back the same bytes. A producer's own
    scales in another dtype (float16 GPTQ scales of a bfloat16 model, SCB absmax / 127) are rarely all
    exact and keep the default. None: the default (the source's dtype, or caps.divisor_scale)."""
    code = SCALE_CODES.get(src_dtype)
    scale_tensor = registered_family(m.family).scale_tensor if m.family != "float" else None
    if code in (None, "F32", src.scale_dtype) or code not in caps.scale_dtypes or scale_tensor is None:
        return None
    info = comp.tensors.get(m.name + scale_tensor)
    if info is None or info.dtype not in FLOAT_NAMES:
        return None
    s = finite_scales(to_float32(read_array(info), info.dtype), info).astype(np.float32)
    if src.scale_divisor != 1:
        s = s / np.float32(src.scale_divisor)
    return code if np.array_equal(to_float32(encode_float(s, code), code), s) else None


def _negotiate(m: QuantModule, src, opts: Options, where, caps) -> tuple[int, int, bool, str | None]:
    """(bits, group, sym, reason) a module gets in an integer target: the request where given, else the
    source's, fitted to the target's caps (None: unfitted, for a target's own fit to check); reason says
    why the codes cannot be kept (None: they are)."""
    codebook = src.scheme != "int"
    inp = m.in_features
    bits = opts.bits or (src.bits if src.scheme in ("int", "float") else 4)
    if caps is not None and bits not in caps.bits:
        if opts.bits or caps.fallback_bits is None:
            raise UsageError(f"{opts.to} stores {', '.join(map(str, sorted(caps.bits)))}-bit codes, not "
                             f"{bits}-bit", tensor=m.name, file=where)
        bits = caps.fallback_bits
    if opts.group_size is not None:
        group = opts.group_size
        if group > inp:
            raise UsageError(f"--group-size {group} is larger than the module's {inp} input features; use "
                             f"--group-size -1 for one group per output row", tensor=m.name, file=where)
        if group > 0 and inp % group:
            raise UsageError(f"--group-size {group} does not divide the module's {inp} input features: "
                             f"GPTQ kernels (vLLM's Marlin, auto-round's) take whole groups only; use a "
                             f"divisor of {inp} or -1", tensor=m.name, file=where)
    elif codebook:
        group = _default_group(src.group_size, inp)
    else:
        group = src.group_size
    if caps is not None and caps.group_sizes and group > 0 and group not in caps.group_sizes:
        if opts.group_size is not None:
            raise UsageError(f"--group-size {group}: {opts.to} stores groups of "
                             f"{', '.join(map(str, sorted(caps.group_sizes)))} only", tensor=m.name, file=where)
        group = _default_group(None, inp)
    tiled = False                               # a per-row source kept in groups (Caps.tiles_rows)
    if caps is not None:
        if group <= 0 and not caps.per_row:
            tiled = caps.tiles_rows and not codebook and src.group_size <= 0 and opts.group_size is None
            if opts.group_size is not None:
                raise UsageError(f"{opts.to} stores groups, not one scale per output row: give --group-size "
                                 f"a divisor of {inp}", tensor=m.name, file=where)
            group = _default_group(None, inp)
            if group <= 0:
                raise UnsupportedFormat(f"{opts.to} stores groups of 32, 64 or 128 inputs; none divides this "
                                        f"module's {inp}", tensor=m.name, file=where)
        elif group > 0 and not caps.grouped:
            if opts.group_size is not None:
                raise UsageError(f"{opts.to} stores one scale per output row: use --group-size -1",
                                 tensor=m.name, file=where)
            group = -1
    sym = (getattr(src, "symmetric", True) if codebook else src.symmetric) if opts.sym is None else opts.sym
    if caps is not None and not sym and not caps.asym:
        if caps.asym_refusal:
            raise UnsupportedFormat(caps.asym_refusal, tensor=m.name, file=where)
        if opts.sym is False:
            raise UsageError(f"{opts.to} stores symmetric codes only: drop --asym", tensor=m.name, file=where)
        sym = True
    reason = None
    if src.scheme == "float":
        reason = src.requantized()
    elif codebook:
        reason = f"{src.name} codes are not integers"
    elif bits != src.bits:
        reason = f"{src.bits}-bit codes become {bits}-bit"
    elif group != src.group_size and not (group <= 0 and src.group_size <= 0) and not tiled:
        reason = f"group size {src.group_size} becomes {group}"
    elif sym and not src.symmetric:
        reason = "asymmetric zero points become symmetric"
    return bits, group, sym, reason


def _one_group_size(comp: Component, modules: list[QuantModule], planned: dict, opts: Options,
                    src_dtype: str) -> dict:
    """For a target whose config holds one group size (AWQ): the group size most modules got, given to
    the others too (requantized, with the reason said). Refused where it does not divide a module."""
    sizes = Counter(spec.group_size for _, _, spec, _ in planned.values())
    if len(sizes) <= 1:
        return planned
    group = sizes.most_common(1)[0][0]
    out = dict(planned)
    for m in modules:
        src_spec, act_order, spec, _ = planned[m.name]
        if spec.group_size != group:
            if m.in_features % group:
                raise UnsupportedFormat(f"{opts.to} stores one group size for the whole checkpoint; {group} (that "
                                        f"of most modules) does not divide this module's {m.in_features} inputs",
                                        tensor=m.name, file=comp.tensors[m.weight_tensors[0]].file)
            out[m.name] = (src_spec, act_order, *_target_spec(m, src_spec, replace(opts, group_size=group), comp,
                                                              act_order, src_dtype))
    return out


def _written_target(comp: Component, modules: list[QuantModule], planned: dict, opts: Options, src_dtype: str):
    """(opts, planned) for the target that writes the planned modules: a target with a packing hook
    (Target.written_by; auto-round) may hand them to another registered target, picked from their
    specs before any data is read; they are then planned again against that target's caps."""
    if opts.to not in PACKED_TARGETS:
        return opts, planned
    written = registered_target(opts.to).written_by(
        {m.name: (planned[m.name][2], (m.out_features, m.in_features)) for m in modules})
    if written.name == opts.to:
        return opts, planned
    opts = replace(opts, to=written.name)
    return opts, {m.name: (src_spec, act_order, *_target_spec(m, src_spec, opts, comp, act_order, src_dtype))
                  for m in modules for src_spec, act_order, _, _ in [planned[m.name]]}


def _default_group(preferred: int | None, inp: int) -> int:
    """The first of the source's block size and 128, 64, 32 that GPTQ kernels take and that divides the
    module's input features; else one group per row."""
    for group in (preferred, 128, 64, 32):
        if group in (32, 64, 128) and inp % group == 0:
            return group
    return -1


def _retarget(qt: QuantTensor, spec: QuantSpec, stats: Stats, tgt, settings: dict) -> QuantTensor:
    """Same codes and zero points, scales re-expressed for the target (its retarget hook where it has
    one: bitsandbytes' SCB = s * 127, its double quantization kept or dropped)."""
    if tgt.retarget is not None:
        qt, exact = tgt.retarget(qt, spec, settings)
        if isinstance(exact, tuple):            # (exact, stored) of every value it stores (MLX: scales, biases)
            stats.scale_rounding(*exact)
        elif exact is not None:
            stats.scale_rounding(exact, qt.scales)
        return qt
    src = qt.spec
    exact = qt.scales.astype(np.float64) / src.scale_divisor
    if src.scale_divisor == 1 and spec.scale_dtype == src.scale_dtype:
        stored = qt.scales
    else:                                       # s = SCB / 127 in float32, then the stored dtype
        s32 = qt.scales / np.float32(src.scale_divisor) if src.scale_divisor != 1 else qt.scales
        stored = to_float32(encode_float(s32.astype(np.float32), spec.scale_dtype), spec.scale_dtype)
    stats.scale_rounding(exact, stored)
    return replace(qt, spec=spec, scales=stored)


class _ModuleCache:
    """The encoded tensors of the module being written: its 3-4 output tensors are adjacent in the
    plan, so one decoded module is alive at a time."""

    def __init__(self):
        self.key, self.value = None, None

    def get(self, key, make, stale=lambda value: False):
        """The value of key, made anew where it is another key's or ``stale(value)``."""
        if key != self.key or stale(self.value):
            self.key, self.value = None, None       # drop the previous module before decoding the next
            self.value, self.key = make(), key
        return self.value


def _layer_error(w: np.ndarray, qt: QuantTensor, rtn: QuantTensor):
    """The error a requantized module adds, next to plain round-to-nearest's (a target's own requantizer)."""
    from .requantize import layer_error

    return layer_error(w, qt, rtn)


STREAM_WINDOW = 1 << 22     # weights of a requantized module's window of rows written at a time


def _stream_windows(tgt, spec: QuantSpec, m: QuantModule, g_idx: bool, settings: dict) -> list | None:
    """The windows of output rows a requantized module is read, requantized, encoded and written in, or
    None where it cannot be: where some leaf of the target is not its rows' leaves stacked (GPTQ's and
    AWQ's transposed qweight, a packed zero point along the output rows, a weight_shape), or its
    requantizer needs the whole weight. A leaf is stacked when planned for a window of `step` rows it
    is [step, ...] (per-row) or [1, ...] (one per block of step rows), and whole [out, ...] or
    [ceil(out / step), ...], its other dimensions the same."""
    out, inp = m.out_features, m.in_features
    if out == 0 or inp == 0 or spec.flat or (tgt.requantize is not None and not tgt.requantize_rows):
        return None
    step = max(1, spec.block_rows)
    if m.family != "float":
        step = math.lcm(step, registered_family(m.family).row_step(m))
    per = max(step, STREAM_WINDOW // inp // step * step)
    if per >= out:
        return None                            # one window: the module as a whole
    whole = tgt.module_leaves(spec, (out, inp), g_idx, settings)
    try:
        part = tgt.module_leaves(spec, (step, inp), g_idx, settings)
    except ValueError:                         # no layout for so few rows (codes packed along the output)
        return None
    block = max(1, spec.block_rows)
    for leaf, (dtype, shape) in whole.items():
        p = part.get(leaf)
        if p is None or p[0] != dtype or len(shape) == 0 or tuple(p[1][1:]) != tuple(shape[1:]):
            return None
        per_row = p[1][0] == step and shape[0] == out
        per_block = block == step and p[1][0] == 1 and shape[0] == -(-out // block)
        if not (per_row or per_block):
            return None
    return [(r0, min(out, r0 + per)) for r0 in range(0, out, per)]


class _Stream:
    """A requantized module written a window of rows at a time (_stream_windows): each window read from
    the source, requantized, checked and encoded, its leaves handed to whichever output tensor asks; a
    leaf asked for first (its module's codes) streams, the others' parts (scales) wait until asked. After
    the last window the module's error is combined and reported, as encoded() reports a whole module."""

    def __init__(self, windows: list, window, finish):
        self.windows, self.window, self.finish = list(windows), window, finish
        self.waiting: dict[str, list] = {}
        self.served: set[str] = set()          # leaves handed out: asked again, the module is read anew

    def leaf(self, name: str):
        self.served.add(name)
        while True:
            parts = self.waiting.pop(name, [])
            yield from parts
            if not self.windows:
                return
            r0, r1 = self.windows.pop(0)
            for leaf, (_, data) in self.window(r0, r1).items():
                self.waiting.setdefault(leaf, []).append(data)
            if not self.windows:
                self.finish()


def _module_writer(comp, det, m: QuantModule, spec: QuantSpec, opts: Options, cache: _ModuleCache,
                   tally: Tally, src_dtype: str, with_g_idx: bool, lossy: str | None, src_spec=None):
    """(settings, outputs) for one module: the write settings its target's plan gives it (Target.plan;
    {} for targets without one), and outputs(settings) -> its output tensors, planned from headers
    (data encoded only when the writer asks). Every module is planned before any is laid out, so that
    a target's share hook can settle what modules hold in common (Target.share)."""
    out, inp = m.out_features, m.in_features
    # GPTQ targets always carry g_idx, as GPTQModel and AutoGPTQ write it (trivial, i // group, without
    # act-order): loaders that expect it get real values, and GPTQ -> v2 -> GPTQ is byte-identical.
    # Others carry none (act-order was planned as a requantization where they cannot store it).
    tgt = registered_target(opts.to)
    write_g_idx = tgt.g_idx == "always" or with_g_idx

    def requantized(source, settings: dict) -> tuple[QuantTensor, object]:
        """(qt, LayerError) of a lossy module, or of a window of its rows: the target's own quantizer (by
        windows of rows where it is row-separable), else convert's integer requantizer."""
        if tgt.requantize is not None and tgt.requantize_rows and not getattr(source.spec, "flat", False):
            with np.errstate(over="ignore", invalid="ignore"):
                return _requantize_by_rows(tgt, source, _exact_rows(comp, m, source), spec, settings)
        if tgt.requantize is not None:                  # the target's own quantizer (code books)
            w = _exact_weights(comp, m, source)
            qt, rtn = tgt.requantize(source, w, spec, settings)
            with np.errstate(over="ignore", invalid="ignore"):
                return qt, _layer_error(w, qt, rtn)
        qt, err = requantize(_exact_rows(comp, m, source), spec.bits, spec.group_size, spec.symmetric,
                             spec.scale_dtype, source.dtype, search=opts.search)
        return (replace(qt, spec=spec) if tgt.retarget is None else tgt.retarget(qt, spec, settings)[0]), err

    def checked_leaves(source, qt: QuantTensor, err, st: Stats) -> dict:
        """The checks every module (or window of one) passes before its bytes are written, and its
        encoded tensors: scales that the stored dtype holds, finite weights (and error, where given), a
        g_idx only where the target stores one."""
        _check_scales(m, comp, source, qt, spec, opts, lossy)
        why = unrepresentable(qt, err, FLOAT_NAMES.get(spec.scale_dtype, ""))
        if why:
            raise _refuse(m, comp, f"cannot be written as {opts.to}: {why}")
        st.scale_dtype = qt.spec.scale_dtype
        if spec.zero_encoding == "v1" and qt.zeros is not None and bool((qt.zeros == 0).any()) \
                and m.name not in st.v1_zero:
            st.v1_zero.append(m.name)
        if qt.g_idx is not None and not with_g_idx:
            raise _refuse(m, comp, f"act-order g_idx cannot be stored in {opts.to}")  # planned as lossy
        try:
            return tgt.encode(qt, spec, write_g_idx)
        except ValueError as exc:             # data the header-level plan could not see (zero points)
            raise _refuse(m, comp, f"cannot be stored as {opts.to}: {exc}") from None

    def encoded(settings: dict, into: Tally | None = None):
        st = Stats()
        if m.family == "float":
            source = _float_rows(comp, m) if lossy else _read_float(comp, m)
        else:
            source = read_module(comp, det, m, src_dtype)
        qt, err = requantized(source, settings) if lossy else (_retarget(source, spec, st, tgt, settings), None)
        leaves = checked_leaves(source, qt, err, st)
        if lossy:
            st.requantized(m.name, lossy, source.spec.name, spec.name, err)
        st.modules += 1
        if into is not None:
            into.add(m.name, st)
        return leaves

    def weights():                            # ExactRows: a plan reads them a window at a time
        source = _float_rows(comp, m) if m.family == "float" else read_module(comp, det, m, src_dtype)
        return _exact_rows(comp, m, source)

    settings = {}
    if tgt.plan is not None:                  # settings the header needs first (a nested double-quant offset)
        settings = tgt.plan(ModuleContext(m, spec, lossy, opts, m.details.get("dtype") or src_dtype,
                                          lambda trial: encoded(trial), weights, comp.tensors, src_spec,
                                          static_activation(m, comp.tensors)))

    def stream(settings: dict, windows: list) -> _Stream:
        st, errors, source_name = Stats(), [], []

        def window(r0: int, r1: int) -> dict:
            if m.family == "float":
                source = _float_rows(comp, m, (r0, r1))
            else:
                source = read_module(comp, det, m, src_dtype, (r0, r1))
            source_name.append(source.spec.name)
            qt, err = requantized(source, settings)
            errors.append(err)
            return checked_leaves(source, qt, None, st)      # the error is checked whole, in finish

        def finish() -> None:
            err = combined(errors)
            why = unmeasurable(err)
            if why:
                raise _refuse(m, comp, f"cannot be written as {opts.to}: {why}")
            st.requantized(m.name, lossy, source_name[0], spec.name, err)
            st.modules += 1
            tally.add(m.name, st)

        return _Stream(windows, window, finish)

    def outputs(settings: dict) -> list[OutTensor]:
        windows = _stream_windows(tgt, spec, m, write_g_idx, settings) if lossy else None

        def tensor(leaf, dtype, shape):
            if windows is not None:
                return OutTensor(f"{m.name}.{leaf}", dtype, shape,
                                 lambda: cache.get(m.name, lambda: stream(settings, windows),
                                                   stale=lambda s: leaf in s.served).leaf(leaf))
            return OutTensor(f"{m.name}.{leaf}", dtype, shape,
                             lambda: [cache.get(m.name, lambda: encoded(settings, tally))[leaf][1]])

        leaves = tgt.module_leaves(spec, (out, inp), write_g_idx, settings)
        return [tensor(leaf, dtype, shape) for leaf, (dtype, shape) in leaves.items()]

    return settings, outputs


def _linear_modules(comp: Component) -> list[str]:
    return [n[: -len(".weight")] for n, i in comp.tensors.items()
            if n.endswith(".weight") and len(i.shape) == 2 and i.dtype in FLOAT_DTYPES]


def _quant_config(comp: Component, opts: Options, specs: dict[str, QuantSpec], desc_act: bool,
                  settings: dict[str, dict] | None = None, requantized: frozenset = frozenset()) -> dict:
    src_qc = comp.config.get("quantization_config") if comp.config else None
    unquantized = tuple(n for n in _linear_modules(comp) if n not in specs)
    try:
        return registered_target(opts.to).config(WriteContext(specs, unquantized, desc_act, src_qc,
                                                              settings or {}, requantized))
    except ValueError as exc:
        raise UnsupportedFormat(f"cannot be written as {opts.to}: {exc}", file=comp.path) from None


@dataclass
class _Planned:
    """A component's conversion planned from headers (and what a target's plan / share hooks read):
    the output tensors in order, the new config, and the Tally that writing them fills."""
    det: Detection
    modules: list[QuantModule]
    opts: Options                                    # the target that writes them (Target.written_by)
    outputs: dict[str, OutTensor]
    config: dict
    tally: Tally

    @property
    def tensors(self) -> list[OutTensor]:
        """The output tensors in the order they are written."""
        return [self.outputs[k] for k in sorted(self.outputs, key=natural_key)]


def _plan(comp: Component, opts: Options) -> _Planned:
    det = require_decodable(comp)
    modules = _check_source(comp, det, opts)
    claimed = det.claimed_tensors | {t for m in modules for t in m.weight_tensors}
    src_dtype = model_dtype(comp, det)
    tally, cache = Tally(), _ModuleCache()
    specs: dict[str, QuantSpec] = {}
    outputs: dict[str, OutTensor] = {}
    # A module is act-order where its g_idx permutes the groups; its family says so from headers and config
    # (details["act_order"]: GPTQ's desc_act, compressed-tensors' weight_g_idx).
    act_orders = {m.name: bool(m.details.get("act_order")) for m in modules}
    desc_act = any(act_orders.values()) and opts.to in PACKED_TARGETS and registered_target(opts.to).caps.act_order
    act_order_kept, lossy_of, settings = [], {}, {}
    planned = {}
    for m in modules:
        src_spec = _source_spec(comp, det, m, src_dtype)
        act_order = act_orders[m.name]
        planned[m.name] = (src_spec, act_order, *_target_spec(m, src_spec, opts, comp, act_order, src_dtype))
    if opts.to in PACKED_TARGETS and registered_target(opts.to).caps.one_group_size:
        planned = _one_group_size(comp, modules, planned, opts, src_dtype)
    opts, planned = _written_target(comp, modules, planned, opts, src_dtype)
    writers = {}
    for m in modules:
        src_spec, act_order, spec, lossy = planned[m.name]
        specs[m.name] = spec
        lossy_of[m.name] = lossy
        with_g_idx = desc_act and act_order and not lossy
        if with_g_idx:
            act_order_kept.append(m.name)
        settings[m.name], writers[m.name] = _module_writer(comp, det, m, spec, opts, cache, tally, src_dtype,
                                                           with_g_idx, lossy, src_spec)
    tgt = registered_target(opts.to)
    if tgt.share is not None:
        try:
            settings = tgt.share(settings)
        except ValueError as exc:
            raise UnsupportedFormat(f"cannot be written as {opts.to}: {exc}", file=comp.path) from None
    for m in modules:
        for t in writers[m.name](settings[m.name]):
            outputs[t.name] = t
    for name, info in comp.tensors.items():
        if name not in claimed:
            outputs[name] = passthrough(info)
    if tgt.arrange is not None:                 # as its loaders name and shape them (MLX: stacked experts)
        try:
            outputs = tgt.arrange(outputs)
        except ValueError as exc:
            raise UnsupportedFormat(f"cannot be written as {opts.to}: {exc}", file=comp.path) from None
    config = without_quantization(comp.config) if comp.config is not None else {}
    config["quantization_config"] = _quant_config(comp, opts, specs, bool(act_order_kept), settings,
                                                  frozenset(n for n, why in lossy_of.items() if why))
    if tgt.model_config is not None:            # the keys its loaders read beyond quantization_config
        config = tgt.model_config(config)
    return _Planned(det, modules, opts, outputs, config, tally)


def _replan(comp: Component, opts: Options):
    """A --jobs worker's plan (parallel.Replan): the same tensors, and the Tally its shards fill."""
    p = _plan(comp, opts)
    return p.tensors, p.tally


def convert_component(comp: Component, out_dir: Path, opts: Options, max_shard: int, jobs: int = 1) -> dict:
    if opts.to in FLOAT_TARGETS:
        _check_source(comp, require_decodable(comp), opts)
        return dequantize_component(comp, out_dir, opts.to, max_shard, jobs)
    p = _plan(comp, opts)
    written = write_component(comp, out_dir, p.tensors, p.config, max_shard, f"converting {comp.name}",
                              jobs=jobs, replan=Replan(_replan, (opts,)), state=p.tally)
    det, modules, opts = p.det, p.modules, p.opts
    if opts.to in PACKED_TARGETS and registered_target(opts.to).activations:
        from ..formats.storage.checkpoint import open_component
        from .activation_cost import activation_cost
        written["activation_cost"] = activation_cost(comp, det, modules, open_component(out_dir, comp.name))
    summary = p.tally.summary()
    views = [m for m in modules if "rows_of" in m.details]
    if views:           # fused experts written as one Linear per expert (_split_experts)
        fused = sorted({m.details["rows_of"][0].name for m in views}, key=natural_key)
        summary["experts_split"] = {"fused_tensors": len(fused), "modules": len(views), "examples": fused[:2]}
    tgt = registered_target(opts.to)
    activations, lost = activation_report(modules, p.outputs, opts.to, tgt.dynamic_activations)
    if any(activations.values()):
        summary["static_activation_scales"] = activations
    return {"component": comp.name, "from": det.method, "to": opts.to, "search": opts.search, **summary, **written,
            "warnings": list(det.warnings) + made_warnings(comp) + _v1_zero_warning(summary["v1_zero_points"])
            + lost}


def _v1_zero_warning(names: list[str]) -> list[str]:
    """GPTQ v1 stores z - 1, so a zero point of 0 is written as 2^b - 1: readers that add 1 field by field
    (AutoGPTQ, vLLM's exllama path, transformers) get 0 back, GPTQModel's word-wise addition carries
    into the next field and does not. Said per module, with the way out."""
    if not names:
        return []
    return [f"{len(names)} modules have zero points of 0, which GPTQ v1 (stored z-1) writes as 2^bits-1: "
            f"field-wise readers get 0 back, GPTQModel's word-wise decoding does not; --to gptq-v2 stores them "
            f"exactly ({examples(names)})"]


def _check_source(comp: Component, det: Detection, opts: Options) -> list[QuantModule]:
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
        return [v for m in det.modules for v in (_split_experts(comp, m, opts) if m.experts else [m])]
    modules = _data_free_modules(comp, opts)
    if not modules:
        raise UnsupportedFormat(f"has no quantized modules ({det.method}) and no float Linear weight in a "
                                f"numbered decoder stack (model.layers.N...) to quantize", file=where)
    return modules


def _split_experts(comp: Component, m: QuantModule, opts: Options) -> list[QuantModule]:
    """A fused experts module as one module per expert (formats/core/experts.py), the layout the target's
    loaders read; refused where the model type's fused layout is not the one qconv splits, or the rows
    do not split."""
    why = why_not_split(comp.config, m)
    step = 1 if m.family == "float" else registered_family(m.family).row_step(m)
    views = []
    if why is None:
        try:
            views = split_module(m)
        except ValueError as exc:
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


def _source_spec(comp, det: Detection, m: QuantModule, src_dtype: str) -> QuantSpec:
    """The source module's spec without decoding its data (from headers and config)."""
    if m.family == "float":
        return FloatSpec(m.scheme)
    own = registered_family(m.family).spec(m, comp.tensors, det.qc)
    if own is not None:                         # the family's own rule (MLX: zero points from the data)
        return own
    if m.details.get("float_spec") is not None:   # a stored type with no exact form here (GGUF's K-quants)
        return FloatSpec(**m.details["float_spec"])
    if m.scheme in BOOKS:                       # every FP8 / FP4 dialect (layout.QuantModule details)
        bits, book = BOOKS[m.scheme]
        return QuantSpec(m.scheme, bits, m.group_size or -1, True, codebook=book,
                         scale_dtype=m.details.get("scales_dtype") or "F32", block_rows=m.details.get("block_rows", 1),
                         global_scale=m.details.get("global_scale"))
    sym = registered_family(m.family).symmetric(m, det.qc)
    group = -1 if m.details.get("groups") == 1 else (m.group_size or -1)
    return QuantSpec("int", m.bits, group, sym, scale_dtype=m.details.get("scales_dtype") or "F16")


def validation_tolerances(report: dict) -> dict[str, tuple]:
    """Requantized layers are held to the weight error convert measured and reported; every other layer
    to the bound its scale rounding implies (validation.py)."""
    return {r["module"]: ("weights", r["rel_frobenius"]) for r in report.get("layers", [])}


def check_results(written, *, samples: int = 32, seed: int = 0) -> list[dict]:
    from ..errors import ValidationFailed
    from ..formats.storage.checkpoint import open_component
    from ..validation import validate_components

    results = []
    for comp, out, report in written:
        if report.get("v1_zero_points"):
            # Stored as 2^b - 1, what GPTQModel and auto-round's kernel (transformers' CPU path) add 1 to
            # word-wise, carrying into the next field: the same file is two models to its readers.
            names = report["v1_zero_points"]
            raise ValidationFailed(f"{len(names)} modules have zero points of 0, which GPTQ v1 (stored z-1) "
                                   f"writes as 2^bits-1: field-wise readers get 0 back, GPTQModel's and "
                                   f"auto-round's word-wise decoding another value, so the result cannot be "
                                   f"vouched for; --to gptq-v2 stores them exactly ({examples(names)})",
                                   file=comp.files[0] if comp.files else comp.path)
        tolerances = validation_tolerances(report)
        if "to" not in report:                           # float target: the dequantized weights
            tolerances = None
        result = validate_components(comp, open_component(out, comp.name), samples=samples, seed=seed,
                                     tolerances=tolerances)
        results.append(result)
        failed = [r for r in result["layers"] if not r["ok"]]
        missing = result["only_in_a"] or result["only_in_b"]
        differ = result["tensors"]["differ"]
        if failed or missing or differ or not result["layers"]:      # nothing compared proves nothing
            if differ:
                detail = f"{len(differ)} other tensors differ (first: {differ[0]['tensor']}, {differ[0]['problem']})"
            elif failed:
                first = failed[0]
                kernel = next((k for k in first.get("kernels", {}).values() if k["ok"] is False), None)
                if "problem" in first:
                    why = first["problem"]
                elif kernel and first["rel_frobenius"] == 0 and not first.get("weights_over_bound"):
                    # qconv's decoding matches; only the producer's kernel reads the result otherwise
                    why = f"{kernel['kernel']}'s own kernel reads it differently: relative error " \
                          f"{kernel['rel_frobenius']:.3g}"
                else:
                    why = f"relative error {first['rel_frobenius']:.3g}"
                detail = f"{len(failed)} layers differ (first: {first['module']}, {why})"
            else:
                detail = (f"modules missing from the result: {', '.join(missing)}" if missing else
                          "no layer of the result could be compared with the source")
            # `out` is the staging folder; staging names it as DST in the message
            raise ValidationFailed(f"validation failed, nothing written: {detail}", file=out)
        report["validation"] = {"ok": True, "layers": len(result["layers"]), "device": result["device"]}
    return results


# Each target option as the command line spells it; the targets that take it say so (Target.options,
# to_gguf.GGUF_OPTIONS; the float dtypes take none): given to any other, it is a usage error (exit 2).
OPTION_FLAGS = {"bits": "--bits", "group_size": "--group-size", "sym": "--sym/--asym",
                "scale_dtype": "--scale-dtype", "blocksize": "--blocksize", "double_quant": "--double-quant",
                "quant_storage": "--quant-storage", "block_size": "--block-size", "gguf_asym": "--gguf-asym",
                "gguf_float": "--gguf-float", "gguf_float_type": "--gguf-float-type"}


def check_options(opts: Options) -> None:
    """Refuse an option the target does not take (it would be ignored, or misread), naming both."""
    from .to_gguf import GGUF_BITS, GGUF_OPTIONS

    takes = GGUF_OPTIONS if opts.to == "gguf" else frozenset() if opts.to in FLOAT_TARGETS \
        else registered_target(opts.to).options
    default = Options(opts.to)
    for field_name, flag in OPTION_FLAGS.items():
        if field_name not in takes and getattr(opts, field_name) != getattr(default, field_name):
            own = [OPTION_FLAGS[f] for f in OPTION_FLAGS if f in takes]
            raise UsageError(f"{flag}: --to {opts.to} takes no such option; "
                             + (f"its options are {', '.join(own)}" if own else "it takes no target options"))
    if opts.to == "gguf" and opts.bits is not None and opts.bits not in GGUF_BITS:
        raise UsageError(f"--bits {opts.bits}: --to gguf requantizes to "
                         f"{' or '.join(f'{t} (--bits {b})' for b, t in GGUF_BITS.items())} only")


def convert(src: Path, dst: Path, opts: Options, *, overwrite: bool = False,
            max_shard_size: int = DEFAULT_MAX_SHARD, validate: bool = False, jobs: int = 1) -> dict:
    check_options(opts)
    if opts.to == "gguf":                       # one file, not a folder: its own writer (to_gguf.py)
        from .to_gguf import convert_to_gguf
        return convert_to_gguf(src, dst, opts, overwrite=overwrite, max_shard_size=max_shard_size, validate=validate,
                               jobs=jobs)
    if opts.to not in TARGETS:
        raise ValueError(opts.to)
    return run(src, dst, lambda comp, out: convert_component(comp, out, opts, max_shard_size, jobs),
               overwrite=overwrite, check=check_results if validate else None)
