"""Decode a component's quantized modules into QuantTensors, one module at a time (callers ask for
the module they are about to write, so only one is decoded at once), and decide, once per component
and before anything is written, whether it can be decoded at all (require_decodable)."""

from __future__ import annotations

import numpy as np

from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..storage.checkpoint import Component
from ..storage.tensor_io import FLOAT_CODES
from . import activation, structure
from .detect import DECODED_METHODS, Detection, detect
from .ir import FloatWeight, QuantTensor, nonfinite_weight
from .layout import QuantModule, module_of
from .registry import dialects_for, families, family
from .requantize import ExactRows


def require_decodable(comp: Component) -> Detection:
    """The component's detection, or the refusal every writing verb (dequantize, convert, validate)
    makes before it writes: a quant_method qconv does not decode is UnsupportedFormat; a module it
    cannot decode exactly, a quantization tensor no module accounts for (which would be copied as a
    plain weight), or a plain weight beside a module's packed one is CorruptCheckpoint (or
    UnsupportedFormat for a layout qconv does not read). Data-level checks (non-finite scales) follow
    when each module is read."""
    det = detect(comp)
    tensors = comp.tensors
    if comp.duplicates:
        name, mapped, other = comp.duplicates[0]
        raise CorruptCheckpoint(f"is stored in both {mapped} (where the index maps it) and {other}"
                                + (f", as are {len(comp.duplicates) - 1} more tensors" if len(comp.duplicates) > 1 else "")
                                + "; loaders disagree on which is the model's, so qconv will not pick one",
                                file=comp.index_file, tensor=name)
    if det.cfg_method not in DECODED_METHODS:
        raise UnsupportedFormat(f"quant_method {det.cfg_method!r} is not a method qconv decodes (it reads "
                                f"{', '.join(f.method for f in families() if f.quantized)} and auto-round); refusing to "
                                f"write it as anything else", file=comp.path / det.qc_source)
    for dialect in dialects_for(det.cfg_method):
        refusal = dialect.refuse(det.qc) if det.qc else None
        if refusal is not None:
            cls, message = refusal
            raise cls(message, file=comp.path / det.qc_source)
    packed = [m for m in det.modules if family(m.family).needs_config]
    if packed and det.qc is None:
        first = tensors[packed[0].weight_tensors[0]]
        raise CorruptCheckpoint(f"packed {family(packed[0].family).method} codes, but neither config.json's "
                                "quantization_config nor a "
                                "quantize_config.json says how they were written (zero-point format, "
                                "symmetry, bits); no loader reads them as quantized", file=first.file,
                                tensor=first.name)
    declared = _declared_experts(comp.config)
    for m in det.modules:
        check_module(det, m, tensors)
        if m.experts and declared is not None and m.experts != declared[1]:
            info = tensors[m.weight_tensors[0]]
            raise CorruptCheckpoint(f"{m.experts} fused experts, but config.json's {declared[0]} is {declared[1]}: "
                                    f"loaders build {declared[1]}", file=info.file, tensor=info.name)
        clash = tensors.get(m.name + ".weight")
        if clash is not None and clash.name not in det.claimed_tensors:
            raise CorruptCheckpoint(f"a plain weight beside the module's packed {m.weight_tensors[0]!r}: no "
                                    f"loader reads both, and qconv cannot tell which is meant",
                                    file=clash.file, tensor=clash.name)
    if det.unaccounted:
        name, more = det.unaccounted[0], len(det.unaccounted) - 1
        declared = (det.qc or {}).get("quant_method")
        said = (f" ({det.qc_source}'s quant_method {declared!r} decodes none of it)"
                if det.qc_source and isinstance(declared, str) else "")
        raise CorruptCheckpoint(f"{_unaccounted_problem(name, tensors)}"
                                f"{f' (and {more} more such tensors)' if more else ''}{said}: it cannot be "
                                f"decoded, and copied it would pass for a plain weight",
                                file=tensors[name].file, tensor=name)
    # the model's structural keys against its tensors (structure.py): after every tensor is accounted for
    structure.check(comp.config, structure.logical_shapes(tensors, det.modules),
                    file=comp.path / "config.json" if comp.path.is_dir() else comp.path, names=comp.config_names,
                    source="its metadata" if comp.config_names else "config.json")
    return det


EXPERT_COUNT_KEYS = structure.EXPERT_COUNT_KEYS


def _declared_experts(config) -> tuple[str, int] | None:
    """(key, count) of the routed experts the model config declares (its text_config for a VLM).
    require_decodable compares it with each fused module's experts, naming the module's stored tensor and
    file; structure.check compares every expert-count key only with the layers under the decoder prefix
    it finds, naming config.json, and runs after the module checks."""
    config = config.get("text_config", config) if isinstance(config, dict) else None
    for key in EXPERT_COUNT_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None


def _unaccounted_problem(name: str, tensors) -> str:
    """What a left-over quantization tensor most likely lost, from its neighbours."""
    info = tensors[name]
    base = name.partition(".weight.")[0] if ".weight." in name else module_of(name)
    if name.endswith(".weight") and info.dtype == "I8" and base + ".SCB" not in tensors:
        return "an int8 weight with no SCB scale tensor (missing from the files or from the index)"
    if base + ".weight.absmax" in tensors and not any(t.startswith(base + ".weight.quant_state.")
                                                      for t in tensors):
        return f"bitsandbytes 4-bit data ({info.dtype}) with no quant_state tensor beside it"
    return f"quantization data ({info.dtype}) that belongs to no quantized module"


def check_module(det: Detection, m: QuantModule, tensors) -> None:
    """Refuse, from headers, a module that read_module could not decode exactly, and one whose activation
    scales contradict its config or are not finite positive values (activation.check: whatever the
    target, which may carry them or drop them)."""
    family(m.family).check_module(m, tensors, det.qc)
    activation.check(m, tensors)


def model_dtype(comp: Component, det: Detection) -> str:
    """The dtype the weights had before quantization: config dtype, else bitsandbytes' quant_state
    dtype, else float16."""
    cfg = comp.config or {}
    for key in ("dtype", "torch_dtype"):
        value = str(cfg.get(key, "")).replace("torch.", "")
        if value in FLOAT_CODES:
            return value
    for m in det.modules:
        if m.details.get("dtype") in FLOAT_CODES:
            return m.details["dtype"]
    return "float16"


# Weights of a layer read at once (16 MiB of codes per side): the window of rows validate and dequantize
# read a module in (read_module with rows), so memory is bounded by a window, not by the layer.
WINDOW_ELEMENTS = 1 << 24


def read_module(comp: Component, det: Detection, m: QuantModule, dtype: str,
                rows: tuple[int, int] | None = None) -> QuantTensor:
    """The module (or its output rows r0:r1, see Family.read) as a QuantTensor; a split expert
    (experts.split_module) as its rows of the fused module it is a view of. Every verb reads a module
    here, so a module whose codes times scales are not finite (an overflowing or NaN scale, a global
    divisor of 1e-30: ir.nonfinite_weight) is refused here for all of them, before anything is written
    from it: no float folder, requantization or comparison can stand for such a weight."""
    qt = _read_module(comp, det, m, dtype, rows)
    if isinstance(getattr(qt, "values", None), ExactRows):
        return qt                # rows read as they are needed, each window refused there if not finite
    bad = nonfinite_weight(qt)
    if bad is not None:
        r, c, value = bad
        first = comp.tensors.get(m.weight_tensors[0]) if m.weight_tensors else None
        largest = float(np.abs(np.asarray(qt.scales, np.float64)).max(initial=0.0))
        raise CorruptCheckpoint(f"its codes times its scales are not finite in float32 (the weight at "
                                f"[{(rows or (0, 0))[0] + r}, {c}] decodes to {value}; the largest scale is "
                                f"{largest:.3g}): no float folder or requantization can hold it",
                                file=first.file if first else None, tensor=m.name)
    return qt


def _read_module(comp: Component, det: Detection, m: QuantModule, dtype: str,
                 rows: tuple[int, int] | None = None) -> QuantTensor:
    view = m.details.get("rows_of")
    if view is not None:
        parent, first = view
        r0, r1 = rows or (0, m.out_features)
        step = m.details.get("row_step", 1)
        columns = m.details.get("columns")
        if columns is not None:
            # the released transposed layout (experts.fused_layout): the expert's stored rows, read
            # whole (one expert's slice), and its columns c0 + r0 .. c0 + r1 as rows
            n, c0 = columns
            slab = family(parent.family).read_module(parent, comp.tensors, det.qc, dtype, (first, first + n))
            return transposed_rows(slab, c0 + r0, c0 + r1)
        if step == 1:
            return family(parent.family).read_module(parent, comp.tensors, det.qc, dtype, (first + r0, first + r1))
        # every step-th stacked row (experts.split_interleaved): the window that spans them, then its rows
        window = family(parent.family).read_module(parent, comp.tensors, det.qc, dtype,
                                            (first + r0 * step, first + (r1 - 1) * step + 1))
        return _strided_rows(window, step)
    return family(m.family).read_module(m, comp.tensors, det.qc, dtype, rows)


def _strided_rows(qt: QuantTensor, step: int) -> QuantTensor:
    """Rows 0, step, 2 step, ... of a QuantTensor whose codes and per-row state are [rows, ...] (not a
    flat code book's blocks over the whole weight)."""
    from dataclasses import replace

    if isinstance(qt, FloatWeight):
        values = qt.values
        rows = (qt.shape[0] + step - 1) // step
        return replace(qt, shape=(rows, qt.shape[1]),
                       values=ExactRows((rows, qt.shape[1]), lambda r0, r1: np.asarray(values[r0 * step:(r1 - 1) * step + 1])[::step])
                       if isinstance(values, ExactRows) else values[::step])
    if qt.spec.flat:
        raise AssertionError("interleaved rows of a flat code book")
    pick = (lambda a: None if a is None else a[::step])
    return replace(qt, shape=((qt.shape[0] + step - 1) // step, qt.shape[1]), codes=pick(qt.codes),
                   scales=pick(qt.scales), zeros=pick(qt.zeros), group_scales=pick(qt.group_scales),
                   biases=pick(qt.biases))


def transposed_rows(qt, c0: int, c1: int):
    """Columns c0:c1 of a QuantTensor or FloatWeight as the rows of its transpose, [c1 - c0, rows]: a
    float weight's values; square 2-D blocks' codes, each block's scale on its transposed rows (a block
    of B x B is the same block transposed, so codes and scales stay as stored). Other specs raise
    AssertionError: experts.fused_layout refuses them before any read."""
    from dataclasses import replace

    if isinstance(qt, FloatWeight):
        values = _transposed(np.asarray(qt.values), c0, c1)
        return replace(qt, shape=values.shape, values=values)
    spec, rows = qt.spec, qt.shape[0]
    block = spec.block_rows
    if spec.flat or block <= 0 or block != spec.group_size or qt.zeros is not None or qt.g_idx is not None \
            or qt.group_scales is not None or qt.biases is not None:
        raise AssertionError(f"{spec.name} codes in {block} x {spec.group_size} blocks do not transpose")
    blocks = qt.scales[::block]                          # [ceil(rows / B), ceil(cols / B)], one per block
    scales = np.ascontiguousarray(blocks.T[np.arange(c0, c1) // block])
    return replace(qt, shape=(c1 - c0, rows), codes=_transposed(qt.codes, c0, c1), scales=scales)


def _transposed(a: np.ndarray, c0: int, c1: int, tile: int = 256) -> np.ndarray:
    """a[:, c0:c1].T, contiguous, copied a tile of rows at a time (a tile's columns stay in cache: twice
    as fast as one strided copy of a 2048 x 768 float32 slice)."""
    out = np.empty((c1 - c0, a.shape[0]), a.dtype)
    for r in range(0, a.shape[0], tile):
        out[:, r:r + tile] = a[r:r + tile, c0:c1].T
    return out
