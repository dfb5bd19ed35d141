"""validate's bound arithmetic (validation/__init__.py states the criteria): the rounding each side's stored
weight or scales implies (ULP), the per-weight and output bounds of a pair, and the codes and scales that
settle the per-weight criterion with no float product (settle_by_codes). numpy only."""

from __future__ import annotations

import numpy as np

from ..formats.core.ir import QuantTensor

ULP = {"F16": 2.0**-11, "BF16": 2.0**-8, "F32": 2.0**-24, "F64": 2.0**-53}
WEIGHT_SLACK = 2.0**-21    # float32 roundings of the scale products on both sides (a few 2^-24)
UNIT = 2.0**-24 * (1 + 2.0**-20)   # float32 unit roundoff, with room for float64's roundings of the check


def pair_bounds(ea, eb) -> tuple[float, float, float]:
    """(eps, w_rel, w_floor) of a layer's two sides (sides.Entry): eps the pair's scale rounding, and
    per weight |W_B - W_A| <= w_rel |W_A| + w_floor. All 0 where both store their scales the same way (the
    weights must then be identical), else the coarser side's rounding, eps + WEIGHT_SLACK, and the float16
    subnormals' floor."""
    if ea.representation == eb.representation:
        return 0.0, 0.0, 0.0
    eps = max(ea.eps, eb.eps)
    return eps, eps + WEIGHT_SLACK, max(ea.floor, eb.floor)


def output_bound(eps: float, inp: int) -> float:
    """Every output channel: ||Y_A[:, c] - Y_B[:, c]|| <= this times || |X| |W_A[c]|^T || (in * 2^-23:
    float32 accumulation over the inputs)."""
    return eps + inp * 2.0**-23


def _roundings(qt: QuantTensor) -> int:
    """float32 roundings between a code and its weight: one product, or, with bitsandbytes' divisor,
    the product, the rounded 1/127 and the second product."""
    return 3 if qt.spec.scheme == "int" and qt.spec.scale_divisor != 1 else 1


def settle_by_codes(qa: QuantTensor | None, qb: QuantTensor | None, w_rel: float) -> str | None:
    """Whether the stored codes and scales alone settle the per-weight criterion, with no float product.

    "identical": the same codes, zero points, groups, scales and divisor, so dequantization gives the
    same bits. "within": the same codes and, for every scale pair (a, b) (scale / divisor, exact in
    float64), |b - a| + u (k_a |a| + k_b |b|) <= w_rel (1 - k_a u) |a|, with u the float32 unit roundoff
    and k the roundings between code and weight on each side (1, or 3 with bitsandbytes' divisor):
    then every weight c a (1 + d_a), c b (1 + d_b) of that group meets |W_B - W_A| <= w_rel |W_A|
    whatever its code c (the inequality is |c| times that), scales kept inside 2^-100..2^100 so that no
    product leaves float32's normal range. None otherwise: the float comparison decides, weight by
    weight, and names the first one off."""
    if qa is None or qb is None or qa.shape != qb.shape or qa.spec.scheme != qb.spec.scheme:
        return None
    if qa.spec.scheme == "float":                   # decoded weights (FloatWeight): no codes to compare
        return None
    if qa.product_dtype != qb.product_dtype:        # one side rounds its products, the other does not
        return None
    if qa.scales.shape != qb.scales.shape:
        return None
    if (qa.biases is None) != (qb.biases is None):   # float offsets on one side only: the floats decide
        return None
    if qa.biases is not None:                       # float offsets: identical codes, scales and biases only
        same = all(np.array_equal(getattr(qa, k), getattr(qb, k)) for k in ("codes", "scales", "biases")) \
            and qa.spec.group_size == qb.spec.group_size and (qa.g_idx is None) == (qb.g_idx is None)
        return "identical" if same and (qa.g_idx is None or np.array_equal(qa.g_idx, qb.g_idx)) else None
    if qa.spec.scheme == "int":
        if qa.zeros.shape != qb.zeros.shape or not np.array_equal(qa.zeros, qb.zeros):
            return None
        if qa.zeros.shape[1] > 1 and not np.array_equal(qa.groups, qb.groups):
            return None
    elif qa.spec.codebook != qb.spec.codebook or qa.spec.group_size != qb.spec.group_size:
        return None
    if not np.array_equal(qa.codes, qb.codes):
        return None
    if qa.spec.scale_divisor == qb.spec.scale_divisor and np.array_equal(qa.scales, qb.scales):
        return "identical"
    if w_rel == 0.0 or qa.product_dtype is not None:   # the bound below counts float32 roundings only
        return None
    a = np.abs(qa.scales.astype(np.float64) / qa.spec.scale_divisor)
    b = np.abs(qb.scales.astype(np.float64) / qb.spec.scale_divisor)
    ka, kb = _roundings(qa), _roundings(qb)
    close = np.abs(b - a) + UNIT * (ka * a + kb * b) <= w_rel * (1 - ka * UNIT) * a
    normal = ((a == 0) & (b == 0)) | ((a >= 2.0**-100) & (a <= 2.0**100) & (b >= 2.0**-100) & (b <= 2.0**100))
    return "within" if bool(np.all(close & normal)) else None
