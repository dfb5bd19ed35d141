"""`qconv convert` and `qconv bnb8-to-gptq`: rewrite a checkpoint in another format through the
canonical representation (read with the source's codec, write with the target's), keeping codes
exactly wherever the arithmetic allows.

Lossless paths (each module's codes carried over unchanged):

* bitsandbytes int8 -> GPTQ / auto-round 8-bit, one group per output row, symmetric:
  q = CB + 128, z = 128, s = SCB / 127 stored in --scale-dtype (the only rounding; reported per run);
* GPTQ 8-bit, one group per row, symmetric -> bitsandbytes int8: CB = q - 128, SCB recovered exactly
  (bnb.codec.scb_from_scales), so both round trips are byte-identical;
* GPTQ v1 <-> v2 <-> auto-round (auto_round:auto_gptq): codes, scales and zero points repacked, zero
  points re-encoded one field at a time; bitsandbytes 4-bit repacks (storage dtype, double quant).

Every other path requantizes each module from the source's exact weights (formats/core/requantize.py for integers,
bnb.codec.quantize_4bit for nf4/fp4) and reports the error it adds next to round-to-nearest's. An
unquantized source is quantized the same way, data-free, from its float weights (data_free_modules).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import NotStorable, UnsupportedFormat, UsageError
from ..formats.core.activation import activation_report, static_activation
from ..formats.core.detect import Detection, without_quantization
from ..formats.core.ir import QuantSpec, QuantTensor, stack_rows
from ..formats.core.layout import QuantModule, examples, natural_key
from ..formats.core.reader import model_dtype, read_module, require_decodable
from ..formats.core.registry import ModuleContext, WriteContext, file_target, family as registered_family, target as registered_target, targets as registered_targets
from ..formats.storage.checkpoint import Component
from ..formats.storage.tensor_io import FLOAT_NAMES, encode_float, finite_scales, read_array, to_float32
from .dequantize import dequantize_component
from .engine import DEFAULT_MAX_SHARD, OutTensor, made_warnings, passthrough, run, write_component
from ..formats.core.options import FLOAT_TARGETS
from ..formats.core.request import Options
from .parallel import Replan
from ..formats.core.requantize import combined, error_sums, layer_error_of, requantize, unmeasurable, unrepresentable
from ..formats.core.source import (check_source, exact_rows, exact_weights, linear_modules, refuse,
                     source_spec, whole)
from ..formats.core.tally import Stats, Tally

# The quantized targets are the format registry's (formats/core/registry.py: caps or fit, plan, leaves,
# requantize / retarget, encoder, config); the float targets dequantize (dequantize.py).
PACKED_TARGETS = tuple(t.name for t in registered_targets())
TARGETS = PACKED_TARGETS + FLOAT_TARGETS
SCALE_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


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
        raise refuse(m, comp, f"{int(bad.sum())} scales do not fit {stored} (they would be stored as infinity"
                               f"{largest}){way_out}")
    if not lossy and getattr(source, "scales", None) is not None and source.scales.shape == scales.shape:
        flushed = (scales == 0) & (np.asarray(source.scales) != 0)
        if flushed.any():
            smallest = float(np.abs(np.asarray(source.scales, np.float64)[flushed]).min())
            raise refuse(m, comp, f"{int(flushed.sum())} non-zero scales (the smallest {smallest:.3g}) become 0 "
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
    except NotStorable as exc:
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
    scale_tensor = registered_family(m.family).scale_tensor
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
            out[m.name] = (src_spec, act_order, *_target_spec(m, src_spec, opts.replace(group_size=group), comp,
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
    opts = opts.replace(to=written.name)
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
    from ..formats.core.requantize import layer_error

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
    step = math.lcm(step, registered_family(m.family).row_step(m))
    per = max(step, STREAM_WINDOW // inp // step * step)
    if per >= out:
        return None                            # one window: the module as a whole
    whole = tgt.module_leaves(spec, (out, inp), g_idx, settings)
    try:
        part = tgt.module_leaves(spec, (step, inp), g_idx, settings)
    except NotStorable:                         # no layout for so few rows (codes packed along the output)
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
                return _requantize_by_rows(tgt, source, exact_rows(comp, m, source), spec, settings)
        if tgt.requantize is not None:                  # the target's own quantizer (code books)
            w = exact_weights(comp, m, source)
            qt, rtn = tgt.requantize(source, w, spec, settings)
            with np.errstate(over="ignore", invalid="ignore"):
                return qt, _layer_error(w, qt, rtn)
        qt, err = requantize(exact_rows(comp, m, source), spec.bits, spec.group_size, spec.symmetric,
                             spec.scale_dtype, source.dtype, search=opts.search)
        return (replace(qt, spec=spec) if tgt.retarget is None else tgt.retarget(qt, spec, settings)[0]), err

    def checked_leaves(source, qt: QuantTensor, err, st: Stats) -> dict:
        """The checks every module (or window of one) passes before its bytes are written, and its
        encoded tensors: scales that the stored dtype holds, finite weights (and error, where given), a
        g_idx only where the target stores one."""
        _check_scales(m, comp, source, qt, spec, opts, lossy)
        why = unrepresentable(qt, err, FLOAT_NAMES.get(spec.scale_dtype, ""))
        if why:
            raise refuse(m, comp, f"cannot be written as {opts.to}: {why}")
        st.scale_dtype = qt.spec.scale_dtype
        if spec.zero_encoding == "v1" and qt.zeros is not None and bool((qt.zeros == 0).any()) \
                and m.name not in st.v1_zero:
            st.v1_zero.append(m.name)
        if qt.g_idx is not None and not with_g_idx:
            raise refuse(m, comp, f"act-order g_idx cannot be stored in {opts.to}")  # planned as lossy
        try:
            return tgt.encode(qt, spec, write_g_idx)
        except NotStorable as exc:             # data the header-level plan could not see (zero points)
            raise refuse(m, comp, f"cannot be stored as {opts.to}: {exc}") from None

    def encoded(settings: dict, into: Tally | None = None):
        st = Stats()
        source = read_module(comp, det, m, src_dtype)      # a float module's rows: read as they are needed
        if not lossy:
            source = whole(source)
        qt, err = requantized(source, settings) if lossy else (_retarget(source, spec, st, tgt, settings), None)
        leaves = checked_leaves(source, qt, err, st)
        if lossy:
            st.requantized(m.name, lossy, source.spec.name, spec.name, err)
        st.modules += 1
        if into is not None:
            into.add(m.name, st)
        return leaves

    def weights():                            # ExactRows: a plan reads them a window at a time
        return exact_rows(comp, m, read_module(comp, det, m, src_dtype))

    settings = {}
    if tgt.plan is not None:                  # settings the header needs first (a nested double-quant offset)
        settings = tgt.plan(ModuleContext(m, spec, lossy, opts, m.details.get("dtype") or src_dtype,
                                          lambda trial: encoded(trial), weights, comp.tensors, src_spec,
                                          static_activation(m, comp.tensors)))

    def stream(settings: dict, windows: list) -> _Stream:
        st, errors, source_name = Stats(), [], []

        def window(r0: int, r1: int) -> dict:
            source = read_module(comp, det, m, src_dtype, (r0, r1))
            source_name.append(source.spec.name)
            qt, err = requantized(source, settings)
            errors.append(err)
            return checked_leaves(source, qt, None, st)      # the error is checked whole, in finish

        def finish() -> None:
            err = combined(errors)
            why = unmeasurable(err)
            if why:
                raise refuse(m, comp, f"cannot be written as {opts.to}: {why}")
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


def _quant_config(comp: Component, opts: Options, specs: dict[str, QuantSpec], desc_act: bool,
                  settings: dict[str, dict] | None = None, requantized: frozenset = frozenset()) -> dict:
    src_qc = comp.config.get("quantization_config") if comp.config else None
    unquantized = tuple(n for n in linear_modules(comp) if n not in specs)
    try:
        return registered_target(opts.to).config(WriteContext(specs, unquantized, desc_act, src_qc,
                                                              settings or {}, requantized))
    except NotStorable as exc:
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


def _check_block_size(comp: Component, modules: list[QuantModule], opts: Options) -> None:
    """A 2-D --block-size (fp8, compressed-tensors-fp8) larger than every module it would write, in rows or
    in input columns, is refused (exit 2) before anything is written: a block no module has is a typo, and
    the config's weight_block_size would describe blocks the checkpoint does not hold (transformers'
    kernels and its dequantization are sized by it). One larger than some modules only is a partial
    block, as the producers allow: one block over those modules' rows or columns."""
    block = opts.block_size
    if not isinstance(block, tuple) or len(block) != 2 or not modules:
        return
    rows = max(m.out_features // m.experts if m.experts else m.out_features for m in modules)
    cols = max(m.in_features for m in modules)
    over = ([f"{block[0]} rows (the most any module has: {rows})"] if block[0] > rows else []) \
        + ([f"{block[1]} columns (the most input columns any module has: {cols})"] if block[1] > cols else [])
    if over:
        raise UsageError(f"--block-size {block[0]}x{block[1]}: a block of {' and '.join(over)} is larger than "
                         f"every module --to {opts.to} would write; use at most {rows}x{cols} (a module smaller "
                         f"than the block is one block over its rows or columns)", file=comp.path)


def _plan(comp: Component, opts: Options) -> _Planned:
    det = require_decodable(comp)
    modules = check_source(comp, det, opts)
    _check_block_size(comp, modules, opts)
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
        src_spec = source_spec(comp, det, m, src_dtype)
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
        except NotStorable as exc:
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
        except NotStorable as exc:
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
        check_source(comp, require_decodable(comp), opts)
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
    if views:           # fused experts written as one Linear per expert (split_experts)
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


def convert(src: Path, dst: Path, opts: Options, *, overwrite: bool = False,
            max_shard_size: int = DEFAULT_MAX_SHARD, validate: bool = False, jobs: int = 1) -> dict:
    own = file_target(opts.to)
    if own is not None:                         # one file, not a folder: its family's writer (gguf/writer.py)
        return own.convert(src, dst, opts, overwrite=overwrite, max_shard_size=max_shard_size, validate=validate,
                           jobs=jobs)
    if opts.to not in TARGETS:
        raise ValueError(opts.to)
    return run(src, dst, lambda comp, out: convert_component(comp, out, opts, max_shard_size, jobs),
               overwrite=overwrite, check=check_results if validate else None)
