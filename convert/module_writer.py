"""One module of `qconv convert` written (convert.py plans the component, target_spec.py its spec): its
codes kept with their scales re-expressed for the target (_retarget), or its exact weights requantized
(the target's own quantizer, by windows of rows where it is row-separable, else convert's integer
requantizer), checked before any of its bytes are written (scales the stored dtype holds, finite
weights and error, a g_idx only where the target stores one), and handed to the writer whole or a window
of rows at a time (_Stream), as each of its output tensors asks."""

from __future__ import annotations

import math
from typing import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ..errors import NotStorable
from ..formats.core.activation import static_activation
from ..formats.core.detect import Detection
from ..formats.core.ir import QuantSpec, QuantTensor, stack_rows
from ..formats.core.layout import QuantModule
from ..formats.core.reader import read_module
from ..formats.core.registry import ModuleContext, Target, family as registered_family, target as registered_target
from ..formats.core.request import Options
from ..formats.core.requantize import combined, error_sums, layer_error_of, requantize, unmeasurable, unrepresentable
from ..formats.core.source import exact_rows, exact_weights, refuse, whole
from ..formats.core.tally import Stats, Tally
from ..formats.storage.checkpoint import Component
from ..formats.storage.tensor_io import FLOAT_NAMES, encode_float, to_float32
from .engine import OutTensor


def _requantize_by_rows(tgt, source, w, spec: QuantSpec, settings: Mapping, window: int):
    """(qt, LayerError) of a row-separable target requantizer (Target.requantize_rows) run on windows of
    rows (multiples of spec.block_rows, about ``window`` weights: convert.REQUANTIZE_WINDOW), each
    window's error measured while it is in hand."""
    out, inp = w.shape
    step = max(1, spec.block_rows)
    per = max(step, window // max(1, inp) // step * step)
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


def _retarget(qt: QuantTensor, spec: QuantSpec, stats: Stats, tgt, settings: dict) -> QuantTensor:
    """Same codes and zero points, scales re-expressed for the target (its retarget hook where it has
    one: bitsandbytes' SCB = s * 127, its double quantization kept or dropped)."""
    if tgt.overrides(Target.retarget):
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


def _stream_windows(tgt, spec: QuantSpec, m: QuantModule, g_idx: bool, settings: dict,
                    window: int) -> list | None:
    """The windows of output rows (about ``window`` weights: convert.STREAM_WINDOW) a requantized module
    is read, requantized, encoded and written in, or None where it cannot be: where some leaf of the
    target is not its rows' leaves stacked (GPTQ's and AWQ's transposed qweight, a packed zero point along
    the output rows, a weight_shape), or its requantizer needs the whole weight. A leaf is stacked when
    planned for a window of `step` rows it is [step, ...] (per-row) or [1, ...] (one per block of step
    rows), and whole [out, ...] or [ceil(out / step), ...], its other dimensions the same."""
    out, inp = m.out_features, m.in_features
    if out == 0 or inp == 0 or spec.flat or (tgt.overrides(Target.requantize) and not tgt.requantize_rows):
        return None
    step = max(1, spec.block_rows)
    step = math.lcm(step, registered_family(m.family).row_step(m))
    per = max(step, window // inp // step * step)
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
    the last window the module's error is combined and reported, as _ModuleWriter.encoded reports a
    whole module."""

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


@dataclass(frozen=True)
class Writing:
    """What every module of a component is written with (convert._plan makes it once the target that
    writes them is known)."""
    comp: Component
    det: Detection
    opts: Options
    src_dtype: str
    tally: Tally                             # filled as the modules are written
    cache: _ModuleCache
    requantize_window: int                   # convert.REQUANTIZE_WINDOW
    stream_window: int                       # convert.STREAM_WINDOW


class _ModuleWriter:
    """One module's writing, planned from headers (data encoded only when the writer asks): its codes kept
    (_retarget) or requantized, the checks every module or window of one passes before its bytes are
    written, and its output tensors, whole (encoded, through the cache) or a window of rows at a time
    (_Stream)."""

    def __init__(self, w: Writing, m: QuantModule, spec: QuantSpec, with_g_idx: bool, lossy: str | None):
        self.w, self.m, self.spec, self.with_g_idx, self.lossy = w, m, spec, with_g_idx, lossy
        self.tgt = registered_target(w.opts.to)
        # GPTQ targets always carry g_idx, as GPTQModel and AutoGPTQ write it (trivial, i // group, without
        # act-order): loaders that expect it get real values, and GPTQ -> v2 -> GPTQ is byte-identical.
        # Others carry none (act-order was planned as a requantization where they cannot store it).
        self.write_g_idx = self.tgt.g_idx == "always" or with_g_idx

    def requantized(self, source, settings: dict) -> tuple[QuantTensor, object]:
        """(qt, LayerError) of a lossy module, or of a window of its rows: the target's own quantizer (by
        windows of rows where it is row-separable), else convert's integer requantizer."""
        w, m, spec, tgt = self.w, self.m, self.spec, self.tgt
        if tgt.overrides(Target.requantize) and tgt.requantize_rows and not getattr(source.spec, "flat", False):
            with np.errstate(over="ignore", invalid="ignore"):
                return _requantize_by_rows(tgt, source, exact_rows(w.comp, m, source), spec, settings,
                                           w.requantize_window)
        if tgt.overrides(Target.requantize):           # the target's own quantizer (code books)
            weights = exact_weights(w.comp, m, source)
            qt, rtn = tgt.requantize(source, weights, spec, settings)
            with np.errstate(over="ignore", invalid="ignore"):
                return qt, _layer_error(weights, qt, rtn)
        qt, err = requantize(exact_rows(w.comp, m, source), spec.bits, spec.group_size, spec.symmetric,
                             spec.scale_dtype, source.dtype, search=w.opts.search)
        return (tgt.retarget(qt, spec, settings)[0] if tgt.overrides(Target.retarget) else replace(qt, spec=spec)), err

    def checked_leaves(self, source, qt: QuantTensor, err, st: Stats) -> dict:
        """The checks every module (or window of one) passes before its bytes are written, and its
        encoded tensors: scales that the stored dtype holds, finite weights (and error, where given), a
        g_idx only where the target stores one."""
        comp, m, spec, to = self.w.comp, self.m, self.spec, self.w.opts.to
        _check_scales(m, comp, source, qt, spec, self.w.opts, self.lossy)
        why = unrepresentable(qt, err, FLOAT_NAMES.get(spec.scale_dtype, ""))
        if why:
            raise refuse(m, comp, f"cannot be written as {to}: {why}")
        st.scale_dtype = qt.spec.scale_dtype
        if spec.zero_encoding == "v1" and qt.zeros is not None and bool((qt.zeros == 0).any()) \
                and m.name not in st.v1_zero:
            st.v1_zero.append(m.name)
        if qt.g_idx is not None and not self.with_g_idx:
            raise refuse(m, comp, f"act-order g_idx cannot be stored in {to}")  # planned as lossy
        try:
            return self.tgt.encode(qt, spec, self.write_g_idx)
        except NotStorable as exc:             # data the header-level plan could not see (zero points)
            raise refuse(m, comp, f"cannot be stored as {to}: {exc}") from None

    def encoded(self, settings: dict, into: Tally | None = None):
        """The module's encoded tensors, whole; its Stats added to ``into`` where given."""
        w, m, lossy = self.w, self.m, self.lossy
        st = Stats()
        source = read_module(w.comp, w.det, m, w.src_dtype)      # a float module's rows: read as they are needed
        if not lossy:
            source = whole(source)
        qt, err = self.requantized(source, settings) if lossy else (_retarget(source, self.spec, st, self.tgt,
                                                                               settings), None)
        leaves = self.checked_leaves(source, qt, err, st)
        if lossy:
            st.requantized(m.name, lossy, source.spec.name, self.spec.name, err)
        st.modules += 1
        if into is not None:
            into.add(m.name, st)
        return leaves

    def weights(self):                        # ExactRows: a plan reads them a window at a time
        w = self.w
        return exact_rows(w.comp, self.m, read_module(w.comp, w.det, self.m, w.src_dtype))

    def settings(self, src_spec) -> dict:
        """The write settings the target's plan gives the module (Target.plan; {} for targets without
        one): settings the header needs first (a nested double-quant offset)."""
        w, m = self.w, self.m
        if not self.tgt.overrides(Target.plan):
            return {}
        return self.tgt.plan(ModuleContext(m, self.spec, self.lossy, w.opts, m.details.get("dtype") or w.src_dtype,
                                           lambda trial: self.encoded(trial), self.weights, w.comp.tensors,
                                           src_spec, static_activation(m, w.comp.tensors)))

    def stream(self, settings: dict, windows: list) -> _Stream:
        """The module written a window of rows at a time: each window requantized and checked as it is
        read, the error checked whole and the module added to the tally after the last."""
        w, m = self.w, self.m
        st, errors, source_name = Stats(), [], []

        def window(r0: int, r1: int) -> dict:
            source = read_module(w.comp, w.det, m, w.src_dtype, (r0, r1))
            source_name.append(source.spec.name)
            qt, err = self.requantized(source, settings)
            errors.append(err)
            return self.checked_leaves(source, qt, None, st)      # the error is checked whole, in finish

        def finish() -> None:
            err = combined(errors)
            why = unmeasurable(err)
            if why:
                raise refuse(m, w.comp, f"cannot be written as {w.opts.to}: {why}")
            st.requantized(m.name, self.lossy, source_name[0], self.spec.name, err)
            st.modules += 1
            w.tally.add(m.name, st)

        return _Stream(windows, window, finish)

    def outputs(self, settings: dict) -> list[OutTensor]:
        """The module's output tensors, planned from headers: each reads the module when the writer asks,
        streamed by windows of rows where the target's leaves allow (_stream_windows), else whole."""
        w, m, spec = self.w, self.m, self.spec
        windows = (_stream_windows(self.tgt, spec, m, self.write_g_idx, settings, w.stream_window) if self.lossy
                   else None)

        def tensor(leaf, dtype, shape):
            if windows is not None:
                return OutTensor(f"{m.name}.{leaf}", dtype, shape,
                                 lambda: w.cache.get(m.name, lambda: self.stream(settings, windows),
                                                     stale=lambda s: leaf in s.served).leaf(leaf))
            return OutTensor(f"{m.name}.{leaf}", dtype, shape,
                             lambda: [w.cache.get(m.name, lambda: self.encoded(settings, w.tally))[leaf][1]])

        leaves = self.tgt.module_leaves(spec, (m.out_features, m.in_features), self.write_g_idx, settings)
        return [tensor(leaf, dtype, shape) for leaf, (dtype, shape) in leaves.items()]


def _module_writer(w: Writing, m: QuantModule, spec: QuantSpec, with_g_idx: bool, lossy: str | None,
                   src_spec=None):
    """(settings, outputs) for one module: the write settings its target's plan gives it (Target.plan;
    {} for targets without one), and outputs(settings) -> its output tensors, planned from headers
    (data encoded only when the writer asks). Every module is planned before any is laid out, so that
    a target's share hook can settle what modules hold in common (Target.share)."""
    writer = _ModuleWriter(w, m, spec, with_g_idx, lossy)
    return writer.settings(src_spec), writer.outputs
