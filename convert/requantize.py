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


def quantize(w: np.ndarray, bits: int, group_size: int, sym: bool, scale_dtype: str = "F16",
             dtype: str = "float16", search: bool = True) -> QuantTensor:
    """float32 [out, in] -> QuantTensor with unsigned codes, true zero points and stored scales."""
    wg, mask, gs = _grouped(np.asarray(w, np.float32), group_size)
    qmax = (1 << bits) - 1
    if sym:
        mid = np.full(wg.shape[:2], 1 << (bits - 1), np.float32)
        candidates = ((scale, None) for scale in _sym_candidates(wg, bits))
    else:
        lo, hi = np.minimum(wg.min(axis=2), 0), np.maximum(wg.max(axis=2), 0)
        candidates = (((hi - lo) * f / np.float32(qmax), lo * f) for f in np.concatenate([[1.0], SHRINK]))
    best_err = best_s = best_z = None
    for i, (scale, low) in enumerate(candidates):
        s = _stored(scale, scale_dtype)
        zz = mid if sym else np.clip(np.round(-low / s), 0, qmax).astype(np.float32)
        q = np.clip(np.round(wg / s[:, :, None]) + zz[:, :, None], 0, qmax)
        err = (((q - zz[:, :, None]) * s[:, :, None] - wg) ** 2 * mask).sum(axis=2)
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
            q = np.clip(np.round(wg / best_s[:, :, None]) + best_z[:, :, None], 0, qmax) - best_z[:, :, None]
            num, den = (wg * q * mask).sum(axis=2), (q * q * mask).sum(axis=2)
            s = _stored(np.where(den > 0, num / np.maximum(den, 1e-30), best_s), scale_dtype)
            q = np.clip(np.round(wg / s[:, :, None]) + best_z[:, :, None], 0, qmax)
            err = (((q - best_z[:, :, None]) * s[:, :, None] - wg) ** 2 * mask).sum(axis=2)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s = np.where(better, s, best_s)
    q = np.clip(np.round(wg / best_s[:, :, None]) + best_z[:, :, None], 0, qmax)
    out, inp = w.shape
    codes = q.reshape(out, wg.shape[1] * wg.shape[2])[:, :inp].astype(np.uint8)
    spec = QuantSpec("int", bits, -1 if group_size <= 0 else gs, sym, scale_dtype=scale_dtype)
    return QuantTensor(spec, (out, inp), dtype, codes=codes, scales=best_s.astype(np.float32),
                       zeros=best_z.astype(np.uint8))


def error(w: np.ndarray, wq: np.ndarray) -> tuple[float, float, float]:
    diff = (wq.astype(np.float64) - w.astype(np.float64))
    sq = float((diff ** 2).sum())
    norm = float(np.sqrt((w.astype(np.float64) ** 2).sum()))
    return (np.sqrt(sq) / norm if norm else 0.0), float(np.abs(diff).max(initial=0.0)), sq


def requantize(w: np.ndarray, bits: int, group_size: int, sym: bool, scale_dtype: str,
               dtype: str) -> tuple[QuantTensor, LayerError]:
    """Searched quantization of w, with its error and, for comparison, plain round-to-nearest's."""
    qt = quantize(w, bits, group_size, sym, scale_dtype, dtype, search=True)
    rtn = quantize(w, bits, group_size, sym, scale_dtype, dtype, search=False)
    rel, mx, sq = error(w, qt.dequantize())
    rtn_rel, _, rtn_sq = error(w, rtn.dequantize())
    return qt, LayerError(rel, mx, sq, rtn_rel, rtn_sq)
