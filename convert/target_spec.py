"""The spec each module of a `qconv convert` gets in the target, planned from headers before any data
is read (convert.py plans the component with it): one generic negotiation of the request and the source's
spec against the target's caps (bits, group size, symmetry, scale dtype), or the target's own fit, and why
the codes cannot be kept where they cannot (the module is then requantized); no per-format branch. A
target whose config holds one group size gets one (_one_group_size); a target with a packing hook may
hand the modules to another target (_written_target)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..errors import NotStorable, UnsupportedFormat, UsageError
from ..formats.core.ir import QuantSpec
from ..formats.core.layout import QuantModule
from ..formats.core.registry import (family as registered_family, target as registered_target,
                                     targets as registered_targets)
from ..formats.core.request import Options
from ..formats.storage.checkpoint import Component
from ..formats.storage.tensor_io import FLOAT_NAMES, encode_float, finite_scales, read_array, to_float32

# The quantized targets are the format registry's (formats/core/registry.py: caps or fit, plan, leaves,
# requantize / retarget, encoder, config); the float targets dequantize (dequantize.py).
PACKED_TARGETS = tuple(t.name for t in registered_targets())
SCALE_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def _target_spec(m: QuantModule, src: QuantSpec, opts: Options, comp: Component,
                 act_order: bool, src_dtype: str) -> tuple[QuantSpec, str | None]:
    """The spec a module gets in the target, and why it must be requantized (None: codes are kept).
    Requantized defaults are what vLLM runs: symmetric, no act-order; a code-book source keeps its
    block size as the group size when GPTQ kernels take it (32/64/128), else 128; a float source
    (data-free) gets 4-bit, group 128. A group must divide the module's input features. A target with
    its own fit (Target.fit) fits the module itself."""
    tgt = registered_target(opts.to)
    where = comp.tensors[m.weight_tensors[0]].file if m.weight_tensors else None
    fitted = tgt.fit(m, src, opts, lambda caps=None: _negotiate(m, src, opts, where, caps))
    if fitted is not None:                      # the target's own fit (None: the caps negotiation below)
        spec, reason = fitted
        _check_leaves(tgt, spec, m, m.in_features, opts, where)
        return spec, reason
    inp = m.in_features
    caps = tgt.caps
    bits, group, sym, reason = _negotiate(m, src, opts, where, caps)
    if reason is None and act_order and not caps.act_order:
        reason = f"act-order groups become contiguous ({opts.to} stores no g_idx)"
    if opts.get("scale_dtype"):
        scale_code = SCALE_CODES[opts.get("scale_dtype")]
        if scale_code not in caps.scale_dtypes:
            raise UsageError(f"--scale-dtype {opts.get('scale_dtype')}: {opts.to} stores scales as "
                             f"{', '.join(sorted(caps.scale_dtypes))}", tensor=m.name, file=where)
    elif not reason and (kept := _kept_scale_dtype(m, comp, src, caps, src_dtype)):
        scale_code = kept
    elif src.scale_divisor != 1:
        scale_code = caps.divisor_scale
    elif reason or src.scale_dtype not in caps.scale_dtypes:
        scale_code = "F16" if "F16" in caps.scale_dtypes else sorted(caps.scale_dtypes)[0]
    else:
        scale_code = src.scale_dtype
    offset = "float" if reason is None and getattr(src, "offset", None) else None
    spec = QuantSpec("int", bits, -1 if group <= 0 else group, sym, scale_dtype=scale_code,
                     zero_encoding=tgt.zero_encoding, offset=offset)
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
    bits = opts.get("bits") or (src.bits if src.scheme in ("int", "float") else 4)
    offsets_lost = bool(getattr(src, "offset", None)) and not (caps is not None and caps.float_offsets)
    if offsets_lost and not opts.get("bits") and bits > 4:
        bits = 8                                # requantized: 5- to 8-bit offsets to 8 bits (GGUF's K-quant rule)
    if caps is not None and bits not in caps.bits:
        if opts.get("bits") or caps.fallback_bits is None:
            raise UsageError(f"{opts.to} stores {', '.join(map(str, sorted(caps.bits)))}-bit codes, not "
                             f"{bits}-bit", tensor=m.name, file=where)
        bits = caps.fallback_bits
    if opts.get("group_size") is not None:
        group = opts.get("group_size")
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
        if opts.get("group_size") is not None:
            raise UsageError(f"--group-size {group}: {opts.to} stores groups of "
                             f"{', '.join(map(str, sorted(caps.group_sizes)))} only", tensor=m.name, file=where)
        group = _default_group(None, inp)
    tiled = False                               # a per-row source kept in groups (Caps.tiles_rows)
    if caps is not None:
        if group <= 0 and not caps.per_row:
            tiled = caps.tiles_rows and not codebook and src.group_size <= 0 and opts.get("group_size") is None
            if opts.get("group_size") is not None:
                raise UsageError(f"{opts.to} stores groups, not one scale per output row: give --group-size "
                                 f"a divisor of {inp}", tensor=m.name, file=where)
            group = _default_group(None, inp)
            if group <= 0:
                raise UnsupportedFormat(f"{opts.to} stores groups of 32, 64 or 128 inputs; none divides this "
                                        f"module's {inp}", tensor=m.name, file=where)
        elif group > 0 and not caps.grouped:
            if opts.get("group_size") is not None:
                raise UsageError(f"{opts.to} stores one scale per output row: use --group-size -1",
                                 tensor=m.name, file=where)
            group = -1
    sym = (getattr(src, "symmetric", True) if codebook else src.symmetric) if opts.get("sym") is None else opts.get("sym")
    if caps is not None and not sym and not caps.asym:
        if caps.asym_refusal:
            raise UnsupportedFormat(caps.asym_refusal, tensor=m.name, file=where)
        if opts.get("sym") is False:
            raise UsageError(f"{opts.to} stores symmetric codes only: drop --asym", tensor=m.name, file=where)
        sym = True
    reason = None
    if src.scheme == "float":
        reason = src.requantized()
    elif codebook:
        reason = f"{src.name} codes are not integers"
    elif offsets_lost:
        reason = "float offsets (w = s * q + b) are not integer zero points" + (
            f"; {src.bits}-bit codes become {bits}-bit" if bits != src.bits else "")
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
