"""validate's per-layer comparison (validation/__init__.py schedules it): a window of both sides read and its codes
compared (_read_layer, on reader threads), each block of rows dequantized, multiplied and summed up
(_compare_rows, on compute threads), and a layer's sums judged against its criterion (_report)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .bounds import output_bound, settle_by_codes
from .device import _host64
from .sides import HostWeight, Side
from ..formats.core.ir import QuantTensor


@dataclass(frozen=True)
class _Plan:
    name: str
    blocks: list                        # (r0, r1) row blocks to compare
    windows: list                       # (r0, r1, first block, end block): the rows read at once
    tol: float | tuple | None
    kernels: dict                       # side -> the producer's kernel to cross-check, or None
    eps: float                          # the pair's scale rounding (0: the weights must be identical)
    w_rel: float                        # per weight: |W_B - W_A| <= w_rel |W_A| + w_floor
    w_floor: float


@dataclass(frozen=True, eq=False)
class _Layer:
    plan: _Plan
    a: HostWeight
    b: HostWeight
    settled: str | None                 # settle_by_codes: "identical", "within" or None


def _read_layer(a: Side, b: Side, plan: _Plan, window: tuple) -> _Layer:
    """Everything of one window of a layer that the host must do (read, unpack, compare codes): runs
    on reader threads, ahead of the blocks, so reading overlaps the comparison of earlier windows."""
    ha, hb = (s.host(plan.name, window[:2]) for s in (a, b))
    settled = settle_by_codes(ha.qt, hb.qt, plan.w_rel) if plan.tol is None else None
    return _Layer(plan, ha, hb, settled)


@dataclass
class _Sums:
    """What the blocks of one layer add up to (each block's own, then the layer's)."""
    rows: int = 0
    d2: float = 0.0
    a2: float = 0.0
    b2: float = 0.0
    ab: float = 0.0
    wd2: float = 0.0
    wa2: float = 0.0
    max_abs: float = 0.0
    ratio: float = 0.0                  # >= max_c ||dY_c|| / || |X| |W_A[c]|^T || (exact where it mattered)
    worst: int = 0
    worst_rel: float = -1.0
    over: int = 0
    first_over: list | None = None
    finite: bool = True
    settled: str | None = None          # settle_by_codes' answer, or "stored": float weights stored alike
    ys: tuple = ()                      # the first block's (Y_A, Y_B) on the host, for the kernels

    def add(self, o: _Sums) -> None:
        self.settled = o.settled if self.rows == 0 or self.settled == o.settled else None
        for k in ("rows", "d2", "a2", "b2", "ab", "wd2", "wa2", "over"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.max_abs, self.ratio = max(self.max_abs, o.max_abs), max(self.ratio, o.ratio)
        if o.worst_rel > self.worst_rel:
            self.worst, self.worst_rel = o.worst, o.worst_rel
        self.first_over = self.first_over or o.first_over
        self.finite = self.finite and o.finite


def _factored_outputs(qa: QuantTensor, qb: QuantTensor, r0: int, r1: int, XT):
    """(Y_A, Y_B) of rows r0:r1 for two integer layers holding the same codes, zero points and contiguous
    groups (settle_by_codes said "within"): Y = sum_g s[:, g] * ((Q - Z)_g X_g^T), with the integer
    (Q - Z) exact in float32 and multiplied once for both sides, so one product serves two and the
    difference carries no cancellation of two independent products. None where the groups are not
    contiguous (act-order) or the codes are a code book: the caller multiplies each side."""
    if qa.spec.scheme != "int" or qa.g_idx is not None or qa.biases is not None or qb.biases is not None:
        return None
    inp, rows, n = XT.shape[0], r1 - r0, XT.shape[1]
    v = qa.codes[r0:r1].astype(np.float32)
    z = qa.zeros[r0:r1].astype(np.float32)
    G, gs = z.shape[1], qa.spec.group_size
    if G == 1:
        v -= z
        p = v @ XT                                                        # [rows, n]
        ys = [p * q.scales[r0:r1] for q in (qa, qb)]
    elif gs > 0 and G * gs == inp:
        v3 = v.reshape(rows, G, gs)
        v3 -= z[:, :, None]
        p = np.matmul(v3.transpose(1, 0, 2), XT.reshape(G, gs, n))          # [G, rows, n]
        ys = [np.einsum("grn,rg->rn", p, q.scales[r0:r1]) for q in (qa, qb)]
    else:
        return None
    for y, q in zip(ys, (qa, qb)):
        if q.spec.scale_divisor != 1:
            y *= np.float32(1.0 / q.spec.scale_divisor)
    return ys


def _finite_without_product(layer: _Layer, raw) -> bool | None:
    """Whether identical weights are certainly finite, with no product: stored float bits that are
    neither NaN nor inf, or finite scales whose largest weight (|code - zero| < 256) cannot overflow.
    None where that is not certain (the product decides)."""
    if raw is not None:
        bits = raw.view(np.uint16) if raw.dtype.itemsize == 2 else None
        if layer.a.info.dtype == "F16":
            return not bool(((bits & 0x7C00) == 0x7C00).any())
        if layer.a.info.dtype == "BF16":
            return not bool(((bits & 0x7F80) == 0x7F80).any())
        return bool(np.isfinite(raw).all())
    qt = layer.a.qt
    top = float(np.abs(qt.scales).max(initial=0.0)) / qt.spec.scale_divisor
    return True if math.isfinite(top) and top * 256 < 2.0**127 else None


def _compare_block(layer_future, r0: int, r1: int, XT, XabsT, device, keep_ys: bool) -> _Sums:
    """_compare_rows without numpy's overflow / invalid-value warnings on stderr: a weight or output that
    is not finite is what the comparison itself looks for, and fails the layer by name."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _compare_rows(layer_future, r0, r1, XT, XabsT, device, keep_ys)


def _compare_rows(layer_future, r0: int, r1: int, XT, XabsT, device, keep_ys: bool) -> _Sums:
    """Rows r0:r1 of one layer: dequantize both sides, multiply, and sum up what the report needs; every
    weight compared in float32 only where the codes did not settle it. Where they did (on the host):
    weights proven identical need no product at all (outputs equal by construction; computed only for
    a kernel cross-check), and the same codes under close scales are multiplied once for both sides
    (_factored_outputs). Products are taken as W X^T (Y^T, one row per output channel, X^T contiguous),
    which BLAS runs several times faster than X W^T with W transposed."""
    layer: _Layer = layer_future.result()
    p = layer.plan
    inp = XT.shape[0]
    settled = layer.settled
    raw_a, raw_b = layer.a.stored(r0, r1), layer.b.stored(r0, r1)
    if (raw_a is not None and raw_b is not None and layer.a.info.dtype == layer.b.info.dtype
            and np.array_equal(raw_a.view(np.uint8), raw_b.view(np.uint8))):
        settled = "stored"              # float weights stored bit for bit alike
    if (device is None and not keep_ys and p.tol is None and settled in ("identical", "stored")
            and _finite_without_product(layer, raw_a)):
        return _Sums(rows=r1 - r0, settled=settled)         # Y_B is Y_A: nothing to multiply
    origin = layer.a.origin
    ys = (_factored_outputs(layer.a.qt, layer.b.qt, r0 - origin, r1 - origin, XT)
          if device is None and settled == "within" else None)
    WA = None
    if ys is None:
        WA = layer.a.block(r0, r1, device, raw_a)
        WB = WA if settled in ("identical", "stored") else layer.b.block(r0, r1, device, raw_b)
        ya = WA @ XT
        yb = ya if WB is WA else WB @ XT
    else:
        ya, yb = ys
    ya64, yb64 = _host64(ya), _host64(yb)
    s = _Sums(rows=r1 - r0, finite=bool(np.isfinite(ya64).all() and np.isfinite(yb64).all()),
              settled=settled)
    if not s.finite:                    # NaN or inf: the layer fails; nothing else here would be meaningful
        s.ratio = s.max_abs = math.inf
        return s
    d = ya64 - yb64
    dn = np.sqrt(np.einsum("ij,ij->i", d, d))
    an = np.sqrt(np.einsum("ij,ij->i", ya64, ya64))
    s.d2, s.a2 = float(dn @ dn), float(an @ an)
    s.b2, s.ab = float(np.einsum("ij,ij->", yb64, yb64)), float(np.einsum("ij,ij->", ya64, yb64))
    s.max_abs = float(np.abs(d).max(initial=0.0))
    rel = np.divide(dn, an, out=np.where(dn > 0, np.inf, 0.0), where=an > 0)
    if rel.size:
        i = int(rel.argmax())
        s.worst, s.worst_rel = r0 + i, float(rel[i])
    if p.tol is None:
        # ||Y_A[:, c]|| <= || |X| |W_A[c]|^T || up to float32 accumulation (the 1 + in 2^-22): the ratio to
        # it bounds the true one from above; only if that fails the bound is the exact denominator paid.
        ratio = rel * (1 + inp * 2.0**-22)
        if ratio.size and not ratio.max() <= output_bound(p.eps, inp):
            if WA is None:
                WA = layer.a.block(r0, r1, device, raw_a)
            denom = np.sqrt((_host64(abs(WA) @ XabsT) ** 2).sum(axis=1))
            ratio = np.divide(dn, denom, out=np.where(dn > 0, np.inf, 0.0), where=denom > 0)
        s.ratio = float(ratio.max(initial=0.0))
        if settled is None:
            bad = WB != WA if p.w_rel == 0.0 else ~(abs(WB - WA) <= abs(WA) * p.w_rel + p.w_floor)
            s.over = int(bad.sum())
            if s.over:
                row, col = divmod(int(np.argmax(_host64(bad).ravel())), inp)
                s.first_over = [r0 + row, col]
    elif isinstance(p.tol, tuple):
        s.wd2 = float(((_host64(WB) - _host64(WA)) ** 2).sum())
        s.wa2 = float((_host64(WA) ** 2).sum())
    if keep_ys:
        s.ys = (ya64.T, yb64.T)
    return s


def _report(plan: _Plan, s: _Sums, inp: int, out: int) -> dict:
    rel = (s.d2 / max(s.a2, 1e-60)) ** 0.5
    # Weights proven identical: Y_B is Y_A (the products were skipped, so the sums are partial).
    cosine = 1.0 if s.settled in ("identical", "stored") else s.ab / max((s.a2 * s.b2) ** 0.5, 1e-60)
    tol = plan.tol
    if isinstance(tol, tuple):           # a requantized layer: its weight error is what convert reported
        _, reported = tol
        weight_error = (s.wd2 / max(s.wa2, 1e-60)) ** 0.5
        ok = weight_error <= reported * (1 + 1e-3) + 1e-6
        criterion = {"weight_rel_error": weight_error, "reported_weight_error": reported}
    elif tol is None:
        limit = output_bound(plan.eps, inp)
        ok = s.ratio <= limit and s.over == 0
        criterion = {"bound_ratio": s.ratio, "bound": limit, "weights_over_bound": s.over,
                     "weights_checked": {"identical": "codes and scales identical",
                                         "within": "codes identical, scales within the bound",
                                         "stored": "stored weights identical"}.get(s.settled, "every weight")}
        if s.first_over is not None:
            criterion["first_weight_over_bound"] = s.first_over
    else:
        ok = rel <= tol
        criterion = {"tolerance": tol}
    finite = s.finite and all(math.isfinite(v) for v in (rel, cosine, s.max_abs, *criterion.values())
                              if isinstance(v, float))
    report = {"module": plan.name, "ok": bool(finite and ok), "max_abs": s.max_abs, "rel_frobenius": rel,
              "cosine": cosine, "worst_channel": s.worst, "rows_checked": s.rows, **criterion}
    if not finite:
        report["problem"] = "non-finite values (NaN or inf) in the weights or outputs"
    if s.rows < out:
        report["sampled"] = True
    return report
