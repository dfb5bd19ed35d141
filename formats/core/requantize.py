"""Requantize float weights to GPTQ-style integers, for the paths where codes cannot be kept (nf4/fp4 to
int, other bit widths or group sizes, asymmetric to symmetric).

The search is per group and exhaustive over a small grid, measured against the exact source weights
(the source's own dequantization) and with every candidate scale first rounded to the dtype it will be
stored in, so the error chosen is the error the file will have:

* symmetric (zero point 2^(b-1), codes -2^(b-1) .. 2^(b-1)-1 around it): scale = f absmax / d for f
  in 0.50 .. 1.50 (101 steps) with d = 2^(b-1) - 1, or d = 2^(b-1) for groups whose largest magnitude is negative
  (the code range is one step longer on that side). Plain round-to-nearest GPTQ (scale
  2 absmax / (2^b - 1)) is one of the candidates, so the search is never worse than it.
* asymmetric: the [min, max] range scaled by f in 0.50 .. 1.50, zero point rounded.
* then a few least-squares steps: for the chosen codes the best scale is sum(w q') / sum(q'^2).

At 8 bits and more the grid is five candidates, not 203: round-to-nearest and f = 0.99 .. 0.96 of the
range (the side of the largest magnitude), then one least-squares step. The step there is fine, so
the optimum lies near the full range (measured on DeepSeek-V3-shaped layers, docs/benchmarks.md: the
full grid chose f in 0.95 .. 0.996 and reached 0.975-0.979x round-to-nearest's squared error, the short
one 0.976-0.979x at a thirtieth of the cost). Round-to-nearest is always a candidate and every
candidate's error is exact, so no group's error ever exceeds round-to-nearest's.

Groups are contiguous along the input dimension (no act-order); a short last group is masked. The
weight is read a block of rows at a time (``w[r0:r1]``: an array, or ExactRows reading a module's
rows from its source as they are needed), and each block's error is measured while it is in hand:
memory is bounded by a block per thread plus the codes, whatever the module's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..storage.tensor_io import encode_float, to_float32
from .ir import QuantSpec, QuantTensor
from .threads import on_cores

SHRINK = np.linspace(0.50, 1.50, 101, dtype=np.float32)
REFINE_STEPS = 3
SHRINK_WIDE = np.array([0.99, 0.98, 0.97, 0.96], dtype=np.float32)    # 8 bits and more
REFINE_STEPS_WIDE = 1
WIDE_BITS = 8


class ExactRows:
    """A module's exact float32 weight [out, in], read a window of rows at a time: ``w[r0:r1]`` calls
    read(r0, r1) (thread-safe; it refuses rows that are not finite), ``np.asarray(w)`` reads them all
    (the requantizers that need the whole weight at once). The lossy paths hold a block of rows, not
    the module (528 MB of float32 for DeepSeek-V3's dense MLP)."""

    def __init__(self, shape: tuple[int, int], read):
        self.shape = tuple(shape)
        self._read = read

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ExactRows reads row slices only")
        r0, r1, _ = key.indices(self.shape[0])
        return self._read(r0, max(r0, r1))

    def __array__(self, dtype=None, copy=None):
        whole = self._read(0, self.shape[0])
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __len__(self):
        return self.shape[0]


@dataclass(frozen=True)
class LayerError:
    rel_frobenius: float        # ||W - Wq|| / ||W||
    max_abs: float
    sq_error: float             # sum of squared errors
    rtn_rel_frobenius: float    # the same for plain round-to-nearest
    rtn_sq_error: float
    norm_sq: float = 0.0        # sum of squared source weights (what windows' errors are combined with)


def _grouped(w: np.ndarray, group_size: int, owned: bool = False):
    """w [out, in] as [out, groups, gs] (a short last group padded with zeros) and the mask of real
    inputs; w itself, reshaped, where it is ``owned`` (a fresh array the caller lets the search
    overwrite) and its groups are whole."""
    out, inp = w.shape
    # one group per row (group_size <= 0) even for a row of no inputs, whose scale is then any scale
    gs = max(1, inp) if group_size <= 0 else group_size
    groups = 1 if group_size <= 0 else -(-inp // gs)
    if owned and groups * gs == inp and w.dtype == np.float32 and w.flags.c_contiguous:
        return w.reshape(out, groups, gs), np.ones((groups, gs), np.float32), gs
    padded = np.zeros((out, groups * gs), np.float32)
    padded[:, :inp] = w
    mask = np.zeros(groups * gs, np.float32)
    mask[:inp] = 1
    return padded.reshape(out, groups, gs), mask.reshape(groups, gs), gs


def _stored(scale: np.ndarray, scale_dtype: str) -> np.ndarray:
    s = to_float32(encode_float(np.ascontiguousarray(scale, dtype=np.float32), scale_dtype), scale_dtype)
    return np.where(s > 0, s, np.float32(1.0)).astype(np.float32)     # an all-zero group: any scale


def _sym_candidates(wg, bits):
    hi, lo = wg.max(axis=2), wg.min(axis=2)
    amax = np.maximum(hi, -lo)                                        # |w|'s largest, without an |w| copy
    top = float((1 << (bits - 1)) - 1)
    rtn = amax / np.float32(((1 << bits) - 1) / 2)                   # GPTQ sym RTN: 2 absmax / (2^b - 1)
    yield rtn
    negative_peak = -lo > hi
    if bits >= WIDE_BITS:
        for f in SHRINK_WIDE:
            yield np.where(negative_peak, amax / np.float32(top + 1) * f, amax / np.float32(top) * f)
        return
    for f in SHRINK:
        yield amax / np.float32(top) * f
        yield np.where(negative_peak, amax / np.float32(top + 1) * f, amax / np.float32(top) * f)


def _search(wg: np.ndarray, mask: np.ndarray, bits: int, sym: bool, scale_dtype: str,
            search: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, groups, gs], scales, zero points, squared error per group, round-to-nearest's
    squared error per group) of a block of rows: the search above, each
    candidate's error computed in place in one scratch array, so a block's memory is a few copies of it.
    A candidate whose scale the stored dtype cannot hold (infinite: weights beyond float16's range times
    the code range) or whose error overflows float32 counts as infinitely bad, and numpy says nothing
    about it (no RuntimeWarning): a group no candidate fits keeps an infinite scale, which the caller
    refuses (check_requantized), never a NaN error chosen as the best."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _search_groups(wg, mask, bits, sym, scale_dtype, search)


def _finite_error(err: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(err), err, np.inf)


def _search_groups(wg, mask, bits, sym, scale_dtype, search):
    qmax = (1 << bits) - 1
    if sym:
        mid = np.full(wg.shape[:2], 1 << (bits - 1), np.float32)
        candidates = ((scale, None) for scale in _sym_candidates(wg, bits))
    else:
        lo, hi = np.minimum(wg.min(axis=2), 0), np.maximum(wg.max(axis=2), 0)
        shrink = SHRINK_WIDE if bits >= WIDE_BITS else SHRINK
        candidates = (((hi - lo) * f / np.float32(qmax), lo * f) for f in np.concatenate([[1.0], shrink]))
    t = np.empty_like(wg)
    whole = bool(mask.all())                 # no short last group: the mask multiplies by 1
    half = float(1 << (bits - 1))

    def codes(s, zz):                        # clip(round(w / s) + z, 0, qmax), into t
        np.divide(wg, s[:, :, None], out=t)
        np.round(t, out=t)
        np.add(t, zz[:, :, None], out=t)
        return np.clip(t, 0, qmax, out=t)

    def sq_error(s, zz, centred=False):      # per group: sum(((q - z) s - w)^2 mask), q (or q - z) in t
        if not centred:
            np.subtract(t, zz[:, :, None], out=t)
        np.multiply(t, s[:, :, None], out=t)
        np.subtract(t, wg, out=t)
        np.square(t, out=t)
        if not whole:
            np.multiply(t, mask, out=t)
        return t.sum(axis=2)

    def sym_error(s):                        # z = 2^(b-1) everywhere: q - z = clip(round(w / s), -z, qmax - z)
        np.divide(wg, s[:, :, None], out=t)
        np.round(t, out=t)
        np.clip(t, -half, qmax - half, out=t)
        return sq_error(s, None, centred=True)

    best_err = best_s = best_z = None
    for scale, low in candidates:
        s = _stored(scale, scale_dtype)
        if sym:
            zz, err = mid, sym_error(s)
        else:
            zz = np.clip(np.round(-low / s), 0, qmax).astype(np.float32)
            codes(s, zz)
            err = sq_error(s, zz)
        err = _finite_error(err)
        if best_err is None:
            best_err, best_s, best_z = err, s, zz
            rtn_err = err
        else:
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s = np.where(better, s, best_s)
            best_z = np.where(better, zz, best_z)
        if not search:
            break
    if search:
        # Least-squares refinement: given the codes, the scale that minimises the group's error is
        # sum(w q') / sum(q'^2) (q' = q - z); re-round codes to it, keep whatever is better.
        for _ in range(REFINE_STEPS_WIDE if bits >= WIDE_BITS else REFINE_STEPS):
            q = codes(best_s, best_z)
            q -= best_z[:, :, None]
            q *= mask
            num, den = (wg * q).sum(axis=2), (q * q).sum(axis=2)
            s = _stored(np.where(den > 0, num / np.maximum(den, 1e-30), best_s), scale_dtype)
            if sym:
                err = sym_error(s)
            else:
                codes(s, best_z)
                err = sq_error(s, best_z)
            err = _finite_error(err)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s = np.where(better, s, best_s)
    return codes(best_s, best_z), best_s, best_z, best_err, rtn_err


BLOCK_ELEMENTS = 1 << 18        # weights of one block of rows the search works on (1 MiB of float32)


def quantize(w: np.ndarray, bits: int, group_size: int, sym: bool, scale_dtype: str = "F16",
             dtype: str = "float16", search: bool = True) -> QuantTensor:
    """float32 [out, in] (an array or ExactRows) -> QuantTensor with unsigned codes, true zero points
    and stored scales."""
    return _quantize(w, bits, group_size, sym, scale_dtype, dtype, search)[0]


def _quantize(w, bits: int, group_size: int, sym: bool, scale_dtype: str, dtype: str,
              search: bool) -> tuple[QuantTensor, LayerError]:
    """The QuantTensor and its error. Rows are independent (groups lie along a row), so the search runs
    on blocks of about BLOCK_ELEMENTS weights, on every core: the same result as one pass over the whole
    weight, in bounded memory. Each block's error (the chosen codes' and round-to-nearest's, the
    candidate the search starts from) is measured from the search's own per-group sums while the block
    is in hand, and summed block by block in float64 in a fixed order: the same report whatever the
    threads (--jobs workers run on fewer)."""
    out, inp = w.shape
    gs = max(1, inp) if group_size <= 0 else group_size
    groups = 1 if group_size <= 0 else -(-inp // gs)
    codes = np.empty((out, inp), np.uint8)
    scales = np.empty((out, groups), np.float32)
    zeros = np.empty((out, groups), np.uint8)
    step = max(1, BLOCK_ELEMENTS // (groups * gs))

    def block(r0: int) -> tuple[float, float, float, float]:
        r1 = min(out, r0 + step)
        wg, mask, _ = _grouped(np.asarray(w[r0:r1], np.float32), group_size, owned=isinstance(w, ExactRows))
        q, s, z, err, rtn_err = _search(wg, mask, bits, sym, scale_dtype, search)
        codes[r0:r1] = q.reshape(r1 - r0, groups * gs)[:, :inp]
        scales[r0:r1], zeros[r0:r1] = s, z
        with np.errstate(over="ignore", invalid="ignore"):   # infinite scales: refused by the caller
            q -= z[:, :, None]                               # the decoded weight, as dequantize_rows
            q *= s[:, :, None]                               # computes it: (q - z) * s in float32
            q -= wg
            largest = float(np.abs(q).max(initial=0.0))
            np.square(wg, out=wg)
            return (float(err.sum(dtype=np.float64)), float(rtn_err.sum(dtype=np.float64)),
                    float(wg.sum(dtype=np.float64)), largest)

    parts = on_cores(block, range(0, out, step))
    spec = QuantSpec("int", bits, -1 if group_size <= 0 else gs, sym, scale_dtype=scale_dtype)
    qt = QuantTensor(spec, (out, inp), dtype, codes=codes, scales=scales, zeros=zeros)
    sums = [(p[0], p[2], p[3]) for p in parts]
    return qt, layer_error_of(sums, sums if not search else [(p[1], p[2], 0.0) for p in parts])


def layer_error_of(sums: list, rtn_sums: list) -> LayerError:
    """A LayerError from error_sums of consecutive row windows (the chosen codes' and round-to-nearest's),
    added in the windows' order."""
    sq, norm2 = sum(p[0] for p in sums), sum(p[1] for p in sums)
    rtn_sq = sum(p[0] for p in rtn_sums)
    norm = float(np.sqrt(norm2))
    with np.errstate(over="ignore", invalid="ignore"):
        rel = float(np.sqrt(sq) / norm) if norm else 0.0
        rtn_rel = float(np.sqrt(rtn_sq) / norm) if norm else 0.0
    return LayerError(rel, max((p[2] for p in sums), default=0.0), sq, rtn_rel, rtn_sq, norm2)


def error_sums(w, qt: QuantTensor) -> tuple[float, float, float]:
    """(squared error, squared norm of w, largest absolute error) of qt against w, block of rows by block
    of rows (about BLOCK_ELEMENTS weights) on every core: no whole-layer copy is made. Differences in
    float32, sums in float64 added in the blocks' order, so a report is the same whatever the threads."""
    out, inp = w.shape
    step = max(1, BLOCK_ELEMENTS // max(1, inp))

    def part(r0: int) -> tuple[float, float, float]:
        r1 = min(out, r0 + step)
        ref = np.asarray(w[r0:r1], np.float32)
        diff = np.array(qt.dequantize_rows(r0, r1), np.float32)
        diff -= ref
        largest = float(np.abs(diff).max(initial=0.0))
        np.square(diff, out=diff)
        return float(diff.sum(dtype=np.float64)), float(np.square(ref).sum(dtype=np.float64)), largest

    parts = on_cores(part, range(0, out, step))
    return sum(p[0] for p in parts), sum(p[1] for p in parts), max((p[2] for p in parts), default=0.0)


def layer_error(w, qt: QuantTensor, rtn: QuantTensor) -> LayerError:
    """The error a requantized module adds, next to plain round-to-nearest's (the same tensor where the
    quantizer has no search)."""
    sums = error_sums(w, qt)
    return layer_error_of([sums], [sums if rtn is qt else error_sums(w, rtn)])


def combined(parts: list[LayerError]) -> LayerError:
    """The LayerError of a module from those of its consecutive row windows, added in their order."""
    return layer_error_of([(p.sq_error, p.norm_sq, p.max_abs) for p in parts],
                          [(p.rtn_sq_error, p.norm_sq, 0.0) for p in parts])


def requantize(w, bits: int, group_size: int, sym: bool, scale_dtype: str,
               dtype: str, search: bool = True) -> tuple[QuantTensor, LayerError]:
    """Searched quantization of w, with its error and, for comparison, plain round-to-nearest's; with
    search=False (convert --no-search) round-to-nearest itself, its error in both columns. One pass over
    w: round-to-nearest is the search's first candidate, measured exactly as the others."""
    return _quantize(w, bits, group_size, sym, scale_dtype, dtype, search)


def unrepresentable(qt: QuantTensor, err: LayerError | None = None, stored_as: str = "") -> str | None:
    """Why a module a target is about to store does not stand for finite weights, or None: a scale its
    dtype holds as infinity or NaN (weights beyond what the stored scale dtype times the code range
    reaches: float16's 65504 x 7 for 4-bit codes), a weight that decodes to NaN or infinity, or an error
    that is not finite. Checked for every module written, whatever quantized it (qconv's search, a
    target's own quantizer, kept codes), so a NaN never reaches a file or a report."""
    from .ir import nonfinite_weight

    scales = np.asarray(qt.scales, np.float32)
    if not np.isfinite(scales).all():
        bad = np.nonzero(~np.isfinite(scales))
        where = ", ".join(str(int(v[0])) for v in bad)
        return (f"its weights need scales beyond {stored_as or qt.spec.scale_dtype}'s range (the scale at "
                f"[{where}] would be {float(scales[tuple(v[0] for v in bad)])})")
    bad = nonfinite_weight(qt)
    if bad is not None:
        r, c, value = bad
        return f"the weight at [{r}, {c}] would decode to {value}"
    return unmeasurable(err) if err is not None else None


def unmeasurable(err: LayerError) -> str | None:
    """Why a module's error is no number (an overflow somewhere in its weights), or None."""
    if not all(np.isfinite(v) for v in (err.rel_frobenius, err.max_abs, err.sq_error)):
        return f"its error cannot be measured (relative error {err.rel_frobenius}, largest {err.max_abs})"
    return None
