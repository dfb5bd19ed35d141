"""Requantize float weights to GPTQ-style integers, for the paths where codes cannot be kept (nf4/fp4 to
int, other bit widths or group sizes, asymmetric to symmetric).

The search is per group and exhaustive over a small grid, measured against the exact source weights
(the source's own dequantization) and with every candidate scale first rounded to the dtype it will be
stored in, so the error chosen is the error the file will have:

* symmetric (zero point 2^(b-1), codes -2^(b-1) .. 2^(b-1)-1 around it): scale = f absmax / d for f
  in 0.50 .. 1.00 with d = 2^(b-1) - 1, or d = 2^(b-1) for groups whose largest magnitude is negative
  (the code range is one step longer on that side). Plain round-to-nearest GPTQ (scale
  2 absmax / (2^b - 1)) is one of the candidates, so the search is never worse than it.
* asymmetric: the [min, max] range shrunk by f in 0.50 .. 1.00, zero point rounded.
* then a few least-squares steps: for the chosen codes the best scale is sum(w q') / sum(q'^2).

Groups are contiguous along the input dimension (no act-order); a short last group is masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats.core.ir import QuantSpec, QuantTensor
from ..formats.storage.tensor_io import encode_float, to_float32
from .parallel import threads

SHRINK = np.linspace(0.50, 1.50, 101, dtype=np.float32)
REFINE_STEPS = 3


@dataclass(frozen=True)
class LayerError:
    rel_frobenius: float        # ||W - Wq|| / ||W||
    max_abs: float
    sq_error: float             # sum of squared errors
    rtn_rel_frobenius: float    # the same for plain round-to-nearest
    rtn_sq_error: float


def _grouped(w: np.ndarray, group_size: int):
    out, inp = w.shape
    # one group per row (group_size <= 0) even for a row of no inputs, whose scale is then any scale
    gs = max(1, inp) if group_size <= 0 else group_size
    groups = 1 if group_size <= 0 else -(-inp // gs)
    padded = np.zeros((out, groups * gs), np.float32)
    padded[:, :inp] = w
    mask = np.zeros(groups * gs, np.float32)
    mask[:inp] = 1
    return padded.reshape(out, groups, gs), mask.reshape(groups, gs), gs


def _stored(scale: np.ndarray, scale_dtype: str) -> np.ndarray:
    s = to_float32(encode_float(np.ascontiguousarray(scale, dtype=np.float32), scale_dtype), scale_dtype)
    return np.where(s > 0, s, np.float32(1.0)).astype(np.float32)     # an all-zero group: any scale


def _sym_candidates(wg, bits):
    amax = np.abs(wg).max(axis=2)
    top = float((1 << (bits - 1)) - 1)
    negative_peak = -wg.min(axis=2) > wg.max(axis=2)
    rtn = amax / np.float32(((1 << bits) - 1) / 2)                   # GPTQ sym RTN: 2 absmax / (2^b - 1)
    yield rtn
    for f in SHRINK:
        yield amax / np.float32(top) * f
        yield np.where(negative_peak, amax / np.float32(top + 1) * f, amax / np.float32(top) * f)


def _search(wg: np.ndarray, mask: np.ndarray, bits: int, sym: bool, scale_dtype: str,
            search: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, groups, gs], scales, zero points) of a block of rows: the search above, each
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
        candidates = (((hi - lo) * f / np.float32(qmax), lo * f) for f in np.concatenate([[1.0], SHRINK]))
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
        for _ in range(REFINE_STEPS):
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
    return codes(best_s, best_z), best_s, best_z


BLOCK_ELEMENTS = 1 << 18        # weights of one block of rows the search works on (1 MiB of float32)
_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(threads(), thread_name_prefix="qconv-requantize")
    return _POOL


def quantize(w: np.ndarray, bits: int, group_size: int, sym: bool, scale_dtype: str = "F16",
             dtype: str = "float16", search: bool = True) -> QuantTensor:
    """float32 [out, in] -> QuantTensor with unsigned codes, true zero points and stored scales. Rows
    are independent (groups lie along a row), so the search runs on blocks of about BLOCK_ELEMENTS
    weights, on every core (numpy releases the GIL): the same result as one pass over the whole
    weight, in bounded memory."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    gs = max(1, inp) if group_size <= 0 else group_size
    groups = 1 if group_size <= 0 else -(-inp // gs)
    codes = np.empty((out, inp), np.uint8)
    scales = np.empty((out, groups), np.float32)
    zeros = np.empty((out, groups), np.uint8)
    step = max(1, BLOCK_ELEMENTS // (groups * gs))

    def block(r0: int) -> None:
        r1 = min(out, r0 + step)
        wg, mask, _ = _grouped(w[r0:r1], group_size)
        q, s, z = _search(wg, mask, bits, sym, scale_dtype, search)
        codes[r0:r1] = q.reshape(r1 - r0, groups * gs)[:, :inp]
        scales[r0:r1], zeros[r0:r1] = s, z

    starts = range(0, out, step)
    if len(starts) > 1:
        list(_pool().map(block, starts))
    else:
        for r0 in starts:
            block(r0)
    spec = QuantSpec("int", bits, -1 if group_size <= 0 else gs, sym, scale_dtype=scale_dtype)
    return QuantTensor(spec, (out, inp), dtype, codes=codes, scales=scales, zeros=zeros)


def error(w: np.ndarray, wq: np.ndarray) -> tuple[float, float, float]:
    diff = (wq.astype(np.float64) - w.astype(np.float64))
    sq = float((diff ** 2).sum())
    norm = float(np.sqrt((w.astype(np.float64) ** 2).sum()))
    return (np.sqrt(sq) / norm if norm else 0.0), float(np.abs(diff).max(initial=0.0)), sq


def error_of(w: np.ndarray, qt: QuantTensor) -> tuple[float, float, float]:
    """error(w, qt.dequantize()), block of rows by block of rows (about BLOCK_ELEMENTS weights, float64
    sums), so no whole-layer copy is made. The sums are numpy's own, in a fixed order, so a report is
    the same whatever the threads (--jobs workers run BLAS on fewer)."""
    out, inp = w.shape
    step = max(1, BLOCK_ELEMENTS // max(1, inp))
    sq = norm2 = mx = 0.0
    for r0 in range(0, out, step):
        r1 = min(out, r0 + step)
        ref = w[r0:r1].astype(np.float64)
        diff = qt.dequantize_rows(r0, r1).astype(np.float64)
        diff -= ref
        sq += float(np.einsum("ij,ij->", diff, diff))      # not BLAS: the same sum whatever its threads
        norm2 += float(np.einsum("ij,ij->", ref, ref))
        mx = max(mx, float(np.abs(diff).max(initial=0.0)))
    norm = np.sqrt(norm2)
    return (float(np.sqrt(sq) / norm) if norm else 0.0), mx, sq


def layer_error(w: np.ndarray, qt: QuantTensor, rtn: QuantTensor) -> LayerError:
    """The error a requantized module adds, next to plain round-to-nearest's (the same tensor where the
    quantizer has no search)."""
    rel, mx, sq = error_of(w, qt)
    rtn_rel, _, rtn_sq = (rel, mx, sq) if rtn is qt else error_of(w, rtn)
    return LayerError(rel, mx, sq, rtn_rel, rtn_sq)


def requantize(w: np.ndarray, bits: int, group_size: int, sym: bool, scale_dtype: str,
               dtype: str, search: bool = True) -> tuple[QuantTensor, LayerError]:
    """Searched quantization of w, with its error and, for comparison, plain round-to-nearest's; with
    search=False (convert --no-search) round-to-nearest itself, its error in both columns."""
    rtn = quantize(w, bits, group_size, sym, scale_dtype, dtype, search=False)
    qt = quantize(w, bits, group_size, sym, scale_dtype, dtype, search=True) if search else rtn
    with np.errstate(over="ignore", invalid="ignore"):    # infinite scales: a NaN error, refused by the caller
        return qt, layer_error(w, qt, rtn)


def unrepresentable(qt: QuantTensor, err: LayerError | None = None, stored_as: str = "") -> str | None:
    """Why a module a target is about to store does not stand for finite weights, or None: a scale its
    dtype holds as infinity or NaN (weights beyond what the stored scale dtype times the code range
    reaches: float16's 65504 x 7 for 4-bit codes), a weight that decodes to NaN or infinity, or an error
    that is not finite. Checked for every module written, whatever quantized it (qconv's search, a
    target's own quantizer, kept codes), so a NaN never reaches a file or a report."""
    from ..formats.core.ir import nonfinite_weight

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
    if err is not None and not all(np.isfinite(v) for v in (err.rel_frobenius, err.max_abs, err.sq_error)):
        return f"its error cannot be measured (relative error {err.rel_frobenius}, largest {err.max_abs})"
    return None
