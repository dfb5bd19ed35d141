"""validate's account of every tensor that is not a Linear weight: biases, norms, rotary buffers, conv
weights of vision towers, position ids, anything a checkpoint holds besides its Linears (which
validation/__init__.py compares by matmul equivalence) and their quantization state.

A release script reads validate's exit 0 as "the two checkpoints compute the same thing", so each such
tensor is accounted for:

* on one side only: reported (``only_in_a`` / ``only_in_b``) and failed;
* same dtype: the stored bytes must be identical;
* two float dtypes, one holding every value of the other (float16 or bfloat16 and float32, say: a norm
  dequantize wrote as float32, or a float32 one written as bfloat16): the narrower side must be the wider
  one cast to it, rounded to nearest even as torch (and qconv's writers) cast, bit for bit; so a widening
  must be exact, and a value that overflows the narrower dtype fails;
* float16 and bfloat16 (neither holds the other): every value within |b - a| <= u |a| + f, u the
  coarser unit roundoff (2^-8), f half float16's smallest subnormal (2^-25, where float16 rounds
  absolutely); infinities and NaN must match;
* two integer dtypes: the same values; a float on one side and an integer on the other: a difference.

Both sides are read a slab of rows at a time, so memory stays bounded whatever a tensor's size.
"""

from __future__ import annotations

import numpy as np

from ..formats.core.layout import natural_key
from ..formats.storage.safetensors_header import FLOAT_DTYPES, TensorInfo
from ..formats.storage.tensor_io import convert_float, read_array, to_float32

UNIT_ROUNDOFF = {"F16": 2.0**-11, "BF16": 2.0**-8, "F32": 2.0**-24, "F64": 2.0**-53}
HALF_SUBNORMAL = {"F16": 2.0**-25, "BF16": 2.0**-134, "F32": 2.0**-150, "F64": 0.0}
SLAB_BYTES = 16 << 20


def plain_tensors(comp, det, entries) -> dict[str, TensorInfo]:
    """The tensors of a component that no Linear entry (quantized module or float weight) and no
    quantization state accounts for."""
    taken = set(det.claimed_tensors) | {e.info.name for e in entries.values() if e.info is not None}
    return {name: info for name, info in comp.tensors.items() if name not in taken}


def _slabs(info: TensorInfo):
    shape = tuple(info.shape)
    if len(shape) < 2 or shape[0] == 0:
        yield read_array(info)
        return
    rows = max(1, SLAB_BYTES // max(1, info.nbytes // shape[0]))
    for r0 in range(0, shape[0], rows):
        yield read_array(info, rows=(r0, min(r0 + rows, shape[0])))


def _as_float64(values: np.ndarray, dtype: str) -> np.ndarray:
    return to_float32(values, dtype).astype(np.float64) if dtype != "F64" else values


# (exponent bits, fraction bits) of each float dtype: one holds every value of another when both are >=.
_BITS = {"F16": (5, 10), "BF16": (8, 7), "F32": (8, 23), "F64": (11, 52)}


def _holds(wide: str, narrow: str) -> bool:
    return wide != narrow and all(w >= n for w, n in zip(_BITS[wide], _BITS[narrow]))


def _is_nan(values: np.ndarray, dtype: str) -> np.ndarray:
    return np.isnan(to_float32(values, dtype)) if dtype != "F64" else np.isnan(values)


def _shown(value, dtype: str) -> str:
    if dtype in FLOAT_DTYPES:
        return f"{float(to_float32(np.asarray([value]), dtype)[0]):.9g}"
    return str(value.item() if hasattr(value, "item") else value)


def _difference(ia: TensorInfo, ib: TensorInfo) -> str | None:
    """Why B's tensor is not A's, or None."""
    if tuple(ia.shape) != tuple(ib.shape):
        return f"shapes differ: {list(ia.shape)} vs {list(ib.shape)}"
    a_float, b_float = ia.dtype in FLOAT_DTYPES, ib.dtype in FLOAT_DTYPES
    if a_float != b_float:
        return f"dtypes differ: {ia.dtype} vs {ib.dtype}"
    coarse = max((ia.dtype, ib.dtype), key=lambda d: UNIT_ROUNDOFF.get(d, 0.0))
    offset = 0
    for sa, sb in zip(_slabs(ia), _slabs(ib)):
        flat_a, flat_b = sa.reshape(-1), sb.reshape(-1)
        if flat_a.size == 0:                    # a zero-size tensor: nothing can differ
            continue
        if ia.dtype == ib.dtype:
            differs = flat_a.view(np.uint8).reshape(flat_a.size, -1) != flat_b.view(np.uint8).reshape(flat_b.size, -1)
            bad = np.flatnonzero(differs.any(axis=1))
            if bad.size:
                i = int(bad[0])
                va, vb = _shown(flat_a[i], ia.dtype), _shown(flat_b[i], ib.dtype)
                return f"{bad.size} values differ (first at flat index {offset + i}: {va} vs {vb})"
        elif a_float and _holds(ia.dtype, ib.dtype) or b_float and _holds(ib.dtype, ia.dtype):
            # one dtype holds every value of the other: the narrower side must be the wider one rounded
            # to it exactly as a cast rounds (to nearest even; what dequantize and convert write)
            wide, narrow = (ia, ib) if _holds(ia.dtype, ib.dtype) else (ib, ia)
            sw, sn = (flat_a, flat_b) if wide is ia else (flat_b, flat_a)
            with np.errstate(over="ignore", invalid="ignore"):
                rounded = np.ascontiguousarray(convert_float(sw, wide.dtype, narrow.dtype))
            bad = np.flatnonzero((rounded.view(np.uint8).reshape(rounded.size, -1)
                                  != np.ascontiguousarray(sn).view(np.uint8).reshape(sn.size, -1)).any(axis=1))
            bad = bad[~(_is_nan(rounded[bad], narrow.dtype) & _is_nan(sn[bad], narrow.dtype))]
            if bad.size:
                i = int(bad[0])
                return (f"{bad.size} values differ beyond the rounding of {wide.dtype} -> {narrow.dtype} (first at "
                        f"flat index {offset + i}: {_shown(flat_a[i], ia.dtype)} vs {_shown(flat_b[i], ib.dtype)})")
        elif a_float:                           # float16 vs bfloat16: neither holds the other
            x, y = _as_float64(flat_a, ia.dtype), _as_float64(flat_b, ib.dtype)
            with np.errstate(invalid="ignore", over="ignore"):
                finite = np.isfinite(x) & np.isfinite(y)
                same_special = ~finite & ((x == y) | (np.isnan(x) & np.isnan(y)))
                floor = max(HALF_SUBNORMAL[ia.dtype], HALF_SUBNORMAL[ib.dtype])     # float16's subnormals
                within = finite & (np.abs(y - x) <= UNIT_ROUNDOFF[coarse] * np.abs(x) + floor)
            bad = np.flatnonzero(~(within | same_special))
            if bad.size:
                i = int(bad[0])
                return (f"{bad.size} values differ beyond the rounding of {ia.dtype} -> {ib.dtype} (first at flat "
                        f"index {offset + i}: {x[i]:.9g} vs {y[i]:.9g})")
        else:
            wide = object if "U64" in (ia.dtype, ib.dtype) else np.int64      # every integer exactly
            bad = np.flatnonzero(flat_a.astype(wide) != flat_b.astype(wide))
            if bad.size:
                i = int(bad[0])
                return f"{bad.size} values differ (first at flat index {offset + i}: {flat_a[i]} vs {flat_b[i]})"
        offset += flat_a.size
    return None


def compare_plain_tensors(a: dict[str, TensorInfo], b: dict[str, TensorInfo]) -> dict:
    """{"compared": n, "differ": [{"tensor", "dtypes", "problem"}], "only_in_a": [...], "only_in_b": [...]}"""
    common = sorted(set(a) & set(b), key=natural_key)
    differ = []
    for name in common:
        problem = _difference(a[name], b[name])
        if problem:
            differ.append({"tensor": name, "dtypes": [a[name].dtype, b[name].dtype], "problem": problem})
    return {"compared": len(common), "differ": differ,
            "only_in_a": sorted(set(a) - set(b), key=natural_key),
            "only_in_b": sorted(set(b) - set(a), key=natural_key)}
