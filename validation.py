"""`qconv validate A B`: per-layer matmul equivalence between any two checkpoints.

For every Linear present in both (quantized or not, any supported format), a seeded activation batch X
shaped like real activations (unit-scale, with a few outlier columns above LLM.int8's 6.0 threshold)
goes through both sides' exact dequantized weights in float32: Y_A = X W_A^T, Y_B = X W_B^T.

Pass criterion (no tolerance given): eps is the scale rounding the pair implies: 0 when both sides store
their scales the same way (so any difference is a defect), else the unit roundoff of the coarser side
(2^-11 float16 scales or weights, 2^-8 bfloat16, 2^-24 float32). Then

    every weight:           |W_B[c, i] - W_A[c, i]|  <=  (eps + 2^-21) |W_A[c, i]|  (+ 2^-25 for float16
                            subnormals; both terms 0 when eps is 0: the weights must be identical)
    every output channel:   ||Y_A[:, c] - Y_B[:, c]||  <=  (eps + in * 2^-23) || |X| |W_A[c]|^T ||

The first is what keeping the codes means (2^-21 covers the float32 roundings of the products on both
sides); one changed code moves a weight by a whole quantization step and fails it even where, among
thousands of inputs, it hides in the output. The second is the rigorous output bound that follows
(in * 2^-23 covers float32 accumulation); it is the matmul-equivalence statement. With --tol, the
criterion is instead relative Frobenius error of Y <= tol. For a layer that `convert --validate`
requantized, the result's weights must differ from the source's by no more than the error convert
measured and reported (a packing or zero-point defect adds to it); Y's metrics are reported alongside.

Cheaper arithmetic where it is exact: when both sides hold the same integer codes (and zero points and
groups), the per-weight criterion is settled from the scales alone, with no float product: bit for bit
identical weights when the scales are equal too (B's product is then A's, computed once), else every
weight within the bound when each scale pair is close enough whatever the code (float32 rounding of
the products included); float weights stored bit for bit alike are identical the same way. Only where
codes or stored weights differ is every weight compared in float32, and the first one off named. The output bound's denominator is first taken from ||Y_A[:, c]|| (which it dominates,
so passing that stricter test passes the bound); || |X| |W_A[c]|^T || costs a third product only for
the blocks where that does not settle it.

The producers' own kernels (bitsandbytes' LLM.int8 matmul with its outlier threshold and its 4-bit
matmul; auto-round's CPU kernel for GPTQ v1 and auto_round:auto_gptq) run on the same X too and must
agree with qconv's decoding within that kernel's own arithmetic, so validation is never only qconv's
decoder checked against itself. By default they run where they buy evidence: every distinct (format,
kernel, shape) once, plus a seeded sample of KERNEL_SAMPLE layers per kernel (every layer when there
are no more); kernels="all" runs them on every layer. They run on a thread of their own, which imports
torch and the library only when a kernel is used, while the comparison goes on.

Work is split over the cores: reader threads read and unpack the next windows of rows (at most about
WINDOW_ELEMENTS weights of a layer, read from only those rows' bytes: Family.read with rows) while
compute threads dequantize, multiply and compare blocks of about BLOCK_ELEMENTS weights, so memory is
bounded by a few windows and blocks whatever the size of a layer or of the model. On the CPU that is numpy itself (QuantTensor.dequantize_rows, the
reference decoding); on CUDA it is dequantize_block, bit for bit the same. Every row is checked; with
--rows sampled, layers above 4,096 rows are checked on 8 evenly spread windows of 512 rows (the report
marks those layers).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .probes import outlier_activations
from .errors import UsageError
from .progress import report as report_progress
from .validate_tensors import compare_plain_tensors, plain_tensors
from .formats.storage.checkpoint import Component, open_target
from .formats.core.detect import Detection
from .formats.core.experts import is_fused_name, split_module, split_names, why_not_split
from .formats.core.ir import QuantTensor
from .formats.core.layout import QuantModule, natural_key
from .formats.core.reader import WINDOW_ELEMENTS, model_dtype, read_module, require_decodable
from .formats.core.registry import family
from .formats.storage.safetensors_header import DTYPES, FLOAT_DTYPES, TensorInfo
from .formats.storage.tensor_io import read_array, to_float32

ULP = {"F16": 2.0**-11, "BF16": 2.0**-8, "F32": 2.0**-24, "F64": 2.0**-53}
MAX_ROWS = 4096            # sampled rows: larger layers are checked on evenly spread row windows
WINDOWS = 8
BLOCK_ELEMENTS = 1 << 22   # all rows: weights per block (16 MiB of float32 per side)
WEIGHT_SLACK = 2.0**-21    # float32 roundings of the scale products on both sides (a few 2^-24)
PREFETCH = 2               # layers read and unpacked ahead at most, on as many reader threads
READ_AHEAD = 1 << 27       # bytes of codes held for layers read ahead and being compared (beyond one ahead)
COMPUTE_THREADS = 2        # blocks dequantized, multiplied and compared at once (one per core here)
IN_FLIGHT = 4              # blocks submitted ahead of the one being summed up
KERNEL_SAMPLE = 16         # layers per kernel cross-checked by default, besides one of each shape
UNIT = 2.0**-24 * (1 + 2.0**-20)   # float32 unit roundoff, with room for float64's roundings of the check


@dataclass(frozen=True)
class Entry:
    name: str
    module: QuantModule | None
    info: TensorInfo | None

    @property
    def representation(self) -> tuple:
        """How the weight's scales are stored: equal representations must give identical weights."""
        m = self.module
        if m is None:
            return ("float", self.info.dtype)
        return (m.family, m.details.get("scales_dtype"))

    @property
    def floor(self) -> float:
        """Absolute rounding of the stored weight below the normal range: float16 subnormals (2^-25)."""
        return 2.0**-25 if self.module is None and self.info.dtype == "F16" else 0.0

    @property
    def eps(self) -> float:
        """The rounding of the stored weight or scales: their dtype's unit roundoff (float32 where a
        format says nothing, as bitsandbytes' float32 SCB and absmax), or the rounding of the product
        where the producer rounds it through a narrower float (compressed-tensors' NVFP4: bfloat16)."""
        m = self.module
        if m is None:
            return ULP.get(self.info.dtype, 0.0)
        return max(ULP.get(m.details.get("scales_dtype"), ULP["F32"]), ULP.get(m.details.get("product_dtype"), 0.0))


# transformers 5's fused expert tensors (layout.QuantModule.experts): compared as their stacked rows.
FUSED_EXPERTS = ("gate_up_proj", "down_proj")


class Side:
    def __init__(self, comp: Component):
        self.comp = comp
        self.det: Detection = require_decodable(comp)
        self.dtype = model_dtype(comp, self.det)
        self.entries: dict[str, Entry] = {m.name: Entry(m.name, m, None) for m in self.det.modules}
        for name, info in comp.tensors.items():
            if info.dtype not in FLOAT_DTYPES or name in self.det.claimed_tensors:
                continue
            if name.endswith(".weight") and len(info.shape) == 2:
                self.entries.setdefault(name[: -len(".weight")], Entry(name[: -len(".weight")], None, info))
            elif len(info.shape) == 3 and name.rsplit(".", 1)[-1] in FUSED_EXPERTS:
                # fused experts [E, R, in], as a quantized fused module reads them: E * R rows of in
                flat = replace(info, shape=(info.shape[0] * info.shape[1], info.shape[2]))
                self.entries.setdefault(name, Entry(name, None, flat))

    def split_experts_like(self, other: "Side") -> None:
        """Fused experts compared with the other side's one Linear per expert (convert's split,
        formats/core/experts.py): each fused entry whose split names the other side holds, and whose
        own name it does not, becomes its per-expert views."""
        if why_not_split(self.comp.config) is not None:
            return
        for name, e in list(self.entries.items()):
            if name in other.entries or not is_fused_name(name):
                continue
            try:
                if e.module is not None and e.module.experts:
                    if why_not_split(self.comp.config, e.module) is not None:
                        continue
                    views = [Entry(v.name, v, None) for v in split_module(e.module)]
                elif e.module is None:
                    experts, rows, inp = self.comp.tensors[name].shape
                    size = DTYPES[e.info.dtype][0] // 8
                    views = [Entry(v, None, replace(e.info, shape=(n, inp), offset=e.info.offset + r0 * inp * size,
                                                    nbytes=n * inp * size))
                             for v, r0, n in split_names(name, experts, rows)]
                else:
                    continue
            except ValueError:           # an odd number of gate_up rows: left fused, reported unpaired
                continue
            if all(v.name in other.entries for v in views):
                del self.entries[name]
                self.entries.update((v.name, v) for v in views)

    def shape(self, name: str) -> tuple[int, int]:
        e = self.entries[name]
        return (e.module.out_features, e.module.in_features) if e.module else tuple(e.info.shape)

    def row_step(self, name: str) -> int:
        """Rows a window of this layer's reads starts on (1: a float weight, read by rows)."""
        m = self.entries[name].module
        return 1 if m is None else family(m.family).row_step(m)

    def host(self, name: str, rows: tuple[int, int]) -> HostWeight:
        """Rows r0:r1 of the layer as the host holds them: decoded on a reader thread when quantized (a
        QuantTensor of those rows, read from only their bytes); a float weight is read a block of rows
        at a time, when a block asks for it, so memory stays bounded by a window even for a float
        lm_head."""
        e = self.entries[name]
        if e.module is None:
            return HostWeight(None, e.info)
        window = None if rows == (0, e.module.out_features) else rows
        return HostWeight(read_module(self.comp, self.det, e.module, self.dtype, window), None, rows[0])


@dataclass(frozen=True, eq=False)
class HostWeight:
    qt: QuantTensor | None               # a window's rows (its row 0 is the layer's row ``origin``)
    info: TensorInfo | None
    origin: int = 0

    def stored(self, r0: int, r1: int) -> np.ndarray | None:
        """Rows r0:r1 of a float weight as stored; None for a quantized one."""
        return None if self.info is None else read_array(self.info, rows=(r0, r1))

    def block(self, r0: int, r1: int, device, raw: np.ndarray | None = None):
        """Rows r0:r1 of the float32 weight (a float one from its stored rows ``raw``): numpy's reference
        decoding on the host (device None), else computed on the torch device."""
        if self.qt is None and raw is None:
            raw = self.stored(r0, r1)
        l0, l1 = r0 - self.origin, r1 - self.origin
        if device is None:
            return self.qt.dequantize_rows(l0, l1) if self.qt is not None else to_float32(raw, self.info.dtype)
        import torch

        if self.qt is not None:
            return dequantize_block(self.qt, l0, l1, device)
        if self.info.dtype == "BF16":
            return torch.from_numpy(raw.view(np.int16)).to(device).view(torch.bfloat16).float()
        return torch.from_numpy(raw).to(device).float()


def dequantize_block(qt: QuantTensor, r0: int, r1: int, device):
    """QuantTensor.dequantize_rows(r0, r1) in torch on ``device``, operation for operation (float32
    subtract and multiply are exact IEEE operations on every device, so the result is bit for bit the
    same; tested against the numpy path). Only the codes, zero points and scales travel to the device."""
    import torch

    def dev(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    inp, rows = qt.shape[1], r1 - r0
    if qt.spec.scheme == "float":                   # decoded weights (FloatWeight): the values travel
        return dev(qt.values[r0:r1])
    if not qt.spec.flat:
        codes = qt.codes[r0:r1]
        if codes.flags.c_contiguous:
            c = dev(codes)
        else:                           # a transposed view: transposed on the device
            c = dev(codes.T).T.contiguous()
        if qt.spec.scheme == "int":
            w = c.to(torch.float32)
            z = dev(qt.zeros[r0:r1]).to(torch.float32)
        else:
            w = torch.tensor(np.asarray(qt.spec.codebook, dtype=np.float32), device=device)[c.long()]
            z = None
        s = dev(qt.scales[r0:r1]).to(torch.float32)
        n_groups, gs = s.shape[1], qt.spec.group_size
        if n_groups == 1:
            w = w if z is None else w.sub_(z)
            w.mul_(s)
        elif qt.g_idx is None and gs > 0 and n_groups * gs == inp:
            w3 = w.view(rows, n_groups, gs)
            w3 = w3 if z is None else w3.sub_(z[:, :, None])
            w3.mul_(s[:, :, None])
        else:
            g = dev(qt.groups.astype(np.int64))
            w = w if z is None else w.sub_(z[:, g])
            w.mul_(s[:, g])
        if qt.spec.scale_divisor != 1:
            w.mul_(torch.tensor(np.float32(1.0 / qt.spec.scale_divisor), device=device))
        return _product_rounded(qt, w)
    book = torch.tensor(np.asarray(qt.spec.codebook, dtype=np.float32), device=device)
    bs = qt.spec.group_size
    j0, j1 = r0 * inp, r1 * inp
    w = book[dev(qt.codes[j0:j1]).long()]
    if j0 % bs == 0 and (j1 - j0) % bs == 0:
        w.view(-1, bs).mul_(dev(qt.scales[j0 // bs:j1 // bs])[:, None])
    else:
        b0 = j0 // bs
        w.mul_(dev(qt.scales[b0:(j1 - 1) // bs + 1])[torch.arange(j0, j1, device=device) // bs - b0])
    return _product_rounded(qt, w.view(rows, inp))


def _product_rounded(qt: QuantTensor, w):
    """The float32 product as the producer leaves it: rounded through bfloat16 where QuantTensor
    .product_dtype says so (the same round to nearest even as numpy's round_to_bfloat16)."""
    if qt.product_dtype is None:
        return w
    import torch

    return w.to(torch.bfloat16).to(torch.float32)


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


def row_windows(out: int) -> list[tuple[int, int]]:
    """All rows of a layer up to MAX_ROWS; above, WINDOWS evenly spread blocks of MAX_ROWS / WINDOWS rows
    (the first at row 0, starts on multiples of 32), so only those rows are dequantized."""
    if out <= MAX_ROWS:
        return [(0, out)]
    size = MAX_ROWS // WINDOWS
    starts = sorted({int(s) // 32 * 32 for s in np.linspace(0, out - size, WINDOWS)})
    return [(s, s + size) for s in starts]


def row_blocks(out: int, inp: int) -> list[tuple[int, int]]:
    """Every row, in blocks of about BLOCK_ELEMENTS weights (multiples of 32 rows), so memory on the
    device stays bounded by a block whatever the layer."""
    step = max(32, BLOCK_ELEMENTS // max(inp, 1) // 32 * 32)
    return [(s, min(s + step, out)) for s in range(0, out, step)]


def _activations(n: int, inp: int, seed: int) -> np.ndarray:
    return outlier_activations(n, inp, seed)


def _compute_device(device: str):
    """None for numpy on the host (cpu, or auto without a GPU), else the CUDA torch device. auto asks
    torch only where a GPU can exist (Linux with no NVIDIA device node has none), so a CPU-only
    validation never imports torch unless a producer's kernel is used."""
    if device == "cpu":
        return None
    if device == "auto" and sys.platform == "linux" and not any(Path("/dev").glob("nvidia[0-9]*")):
        return None
    if importlib.util.find_spec("torch") is None:
        if device == "auto":
            return None
        raise UsageError("--device cuda needs torch, which is not installed; use --device cpu")
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if device == "cuda":
        raise UsageError("--device cuda, but torch sees no CUDA device; use --device auto or cpu")
    return None



_KERNELS: dict = {}                 # name -> registry.Kernel, as _kernel_name found them


def _kernel_name(side: Side, e: Entry) -> str | None:
    """The name of the producer's kernel that can run this layer here (its family's Family.kernel), or None."""
    m = e.module
    if m is None:
        return None
    kernel = family(m.family).kernel_for(m, side.det.qc)
    if kernel is None:
        return None
    _KERNELS[kernel.name] = kernel
    return kernel.name


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


def _host64(t) -> np.ndarray:
    return t.astype(np.float64) if isinstance(t, np.ndarray) else t.double().cpu().numpy()


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
    if qa.spec.scheme != "int" or qa.g_idx is not None:
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
        if ratio.size and not ratio.max() <= p.eps + inp * 2.0**-23:
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


def _kernel_check(kernel: str, side: Side, e: Entry, x: np.ndarray, ours: np.ndarray, device) -> dict:
    """One producer's kernel on one layer (the first block of its rows), against qconv's Y there. Runs
    on the kernel thread; its first call imports torch and the library."""
    import torch

    try:
        k = _KERNELS[kernel]
        y = k.output(e.module, k.inputs(e.module, side.comp.tensors, ours.shape[1]), torch.from_numpy(x).to(device),
                           ours.shape[1], device)
    except Exception as exc:  # noqa: BLE001 - the library cannot run it here: said, never counted as a pass
        return {"kernel": kernel, "ok": None, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    k_rel = float(np.linalg.norm(_host64(y) - ours) / max(float(np.linalg.norm(ours)), 1e-30))
    return {"kernel": kernel, "rel_frobenius": k_rel, "ok": bool(k_rel <= _KERNELS[kernel].tolerance)}


def _kernel_sample(side: Side, eligible: dict[str, str], seed: int) -> dict[str, str]:
    """The layers whose producer's kernel runs by default: the first of each distinct (format, kernel,
    shape), plus KERNEL_SAMPLE more drawn with the seed (all of them when there are no more)."""
    chosen, seen = {}, set()
    for n, k in eligible.items():
        m = side.entries[n].module
        key = (m.family, m.scheme, m.group_size, k, side.shape(n))
        if key not in seen:
            seen.add(key)
            chosen[n] = k
    rest = [n for n in eligible if n not in chosen]
    for i in sorted(np.random.default_rng(seed).choice(len(rest), min(KERNEL_SAMPLE, len(rest)), replace=False)):
        chosen[rest[i]] = eligible[rest[i]]
    return chosen


def row_windows_read(blocks: list, inp: int, out: int, step: int) -> list[tuple[int, int, int, int]]:
    """The plan's blocks grouped into windows read at once, (r0, r1, first block, end block): runs of
    contiguous blocks of at most WINDOW_ELEMENTS weights (one block at least), the rows read rounded
    out to multiples of ``step`` (where a window of both sides' layouts may start and end), so what a
    window holds is bounded whatever the size of the layer."""
    windows, start = [], 0
    for i, (r0, r1) in enumerate(blocks):
        last = i == len(blocks) - 1
        if last or blocks[i + 1][0] != r1 or (blocks[i + 1][1] - blocks[start][0]) * inp > WINDOW_ELEMENTS:
            windows.append((blocks[start][0] // step * step, min(out, -(-r1 // step) * step), start, i + 1))
            start = i + 1
    return windows


def _held_bytes(a: Side, b: Side, name: str, window: tuple) -> int:
    """Bytes of codes a read window holds (a byte a code; float weights are read a block at a time)."""
    return sum((window[1] - window[0]) * e.module.in_features for e in (a.entries[name], b.entries[name])
               if e.module is not None)


def _blocks(a: Side, b: Side, plans: list[_Plan], device, inputs: dict):
    """(plan, block index, _Sums) for every block of every plan, in order. Windows of layers are read
    ahead on PREFETCH reader threads while the codes held for windows not yet summed up stay within
    READ_AHEAD bytes (one window ahead always); blocks are computed IN_FLIGHT ahead on COMPUTE_THREADS
    threads. So memory is bounded by a few windows and blocks, whatever the layers' size."""
    readers = ThreadPoolExecutor(PREFETCH, thread_name_prefix="qconv-read")
    compute = ThreadPoolExecutor(COMPUTE_THREADS, thread_name_prefix="qconv-compare")
    todo = deque((plan, w) for plan in plans for w in plan.windows)
    reads, pending, held = deque(), deque(), {}

    def finished():
        p, w, i, f = pending.popleft()
        s = f.result()
        if i == w[3] - 1:
            del held[(p.name, w[2])]
        return p, i, s

    try:
        while todo or reads or pending:
            while todo and len(reads) <= PREFETCH and (
                    len(held) <= 1 or sum(held.values()) + _held_bytes(a, b, todo[0][0].name, todo[0][1])
                    <= READ_AHEAD):
                plan, w = todo.popleft()
                held[(plan.name, w[2])] = _held_bytes(a, b, plan.name, w)
                reads.append((plan, w, readers.submit(_read_layer, a, b, plan, w)))
            if not reads:
                yield finished()
                continue
            plan, w, layer = reads.popleft()
            _, XT, XabsT = inputs[plan.name]
            for bi in range(w[2], w[3]):
                r0, r1 = plan.blocks[bi]
                keep = bi == 0 and any(plan.kernels.values())
                pending.append((plan, w, bi, compute.submit(_compare_block, layer, r0, r1, XT, XabsT, device,
                                                            keep)))
                while len(pending) > IN_FLIGHT:
                    yield finished()
    finally:
        for pool in (compute, readers):
            pool.shutdown(wait=True, cancel_futures=True)


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
        limit = plan.eps + inp * 2.0**-23
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


@contextlib.contextmanager
def _highest_precision():
    """float32 matmuls in full float32 (no TF32 on CUDA), whatever the process had set; the previous
    setting is restored afterwards."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def validate_components(ca: Component, cb: Component, *, samples: int = 32, seed: int = 0,
                        tol: float | None = None, device: str = "auto", rows: str = "all",
                        kernels: str = "sampled", tolerances: dict[str, float] | None = None,
                        modules: set[str] | None = None, shard_first: bool = False) -> dict:
    """One component pair. modules: compare only these layers (one task's shard of a larger job, see
    docs/validate-scaling.md); the kernel sample is still drawn over every layer in common, so the
    shards' reports together are exactly the unsharded one. The tensors that are not Linear weights are
    compared when modules is None, or by the shard marked shard_first."""
    a, b = Side(ca), Side(cb)
    a.split_experts_like(b)
    b.split_experts_like(a)
    dev = _compute_device(device)
    common = sorted(set(a.entries) & set(b.entries), key=natural_key)
    same_shape = [n for n in common if a.shape(n) == b.shape(n)]
    eligible = {s: {n: k for n in same_shape if (k := _kernel_name(side, side.entries[n]))}
                for s, side in (("a", a), ("b", b))}
    chosen = eligible if kernels == "all" else {s: _kernel_sample(side, eligible[s], seed)
                                                for s, side in (("a", a), ("b", b))}
    if modules is not None:
        common = [n for n in common if n in modules]
    results, plans, inputs, activations = {}, [], {}, {}
    for name in common:
        if a.shape(name) != b.shape(name):
            results[name] = {"module": name, "ok": False,
                             "problem": f"shapes differ: {list(a.shape(name))} vs {list(b.shape(name))}"}
            continue
        out, inp = a.shape(name)
        ea, eb = a.entries[name], b.entries[name]
        same = ea.representation == eb.representation
        eps = 0.0 if same else max(ea.eps, eb.eps)
        layer_tol = (tolerances or {}).get(name, tol)
        # A requantized layer is held to its whole-matrix weight error, so it is read whole.
        blocks = row_blocks(out, inp) if rows == "all" or isinstance(layer_tol, tuple) else row_windows(out)
        step = math.lcm(32, a.row_step(name), b.row_step(name))
        plan = _Plan(name, blocks, row_windows_read(blocks, inp, out, step), layer_tol,
                     {s: chosen[s].get(name) for s in ("a", "b")}, eps,
                     0.0 if same else eps + WEIGHT_SLACK, 0.0 if same else max(ea.floor, eb.floor))
        if inp not in activations:
            x = _activations(samples, inp, seed)
            xt = np.ascontiguousarray(x.T)
            activations[inp] = (x, *_on_device((xt, np.abs(xt)), dev))
        inputs[name] = activations[inp]          # (host X, X^T and |X|^T where the blocks are computed)
        if blocks:
            plans.append(plan)
        else:                            # an empty layer: nothing can differ
            results[name] = _report(plan, _Sums(), inp, out)
    sums, jobs = {}, []
    kernel_pool = ThreadPoolExecutor(1, thread_name_prefix="qconv-kernel")
    kernel_device = dev if dev is not None else "cpu"
    try:
        with _highest_precision() if dev is not None else contextlib.nullcontext():
            for plan, bi, s in _blocks(a, b, plans, dev, inputs):
                total = sums.setdefault(plan.name, _Sums())
                total.add(s)
                if bi == 0:
                    for side_key, side, ours in (("a", a, 0), ("b", b, 1)):
                        if plan.kernels[side_key]:
                            jobs.append((plan.name, side_key, kernel_pool.submit(
                                _kernel_check, plan.kernels[side_key], side, side.entries[plan.name],
                                inputs[plan.name][0], s.ys[ours], kernel_device)))
                if bi == len(plan.blocks) - 1:
                    out, inp = a.shape(plan.name)
                    results[plan.name] = _report(plan, sums.pop(plan.name), inp, out)
                    report_progress(f"validating {ca.name}", len(results), len(common), "layers")
            for name, side_key, job in jobs:
                k = job.result()
                layer = results[name]
                layer.setdefault("kernels", {})[side_key] = k
                layer["ok"] = layer["ok"] and k["ok"] is not False
    finally:
        kernel_pool.shutdown(wait=True, cancel_futures=True)
    layers = [results[name] for name in common]
    # Every other tensor (biases, norms, buffers, ...): exactly, or within its dtype change's rounding
    # (validate_tensors.py). Once per pair: a sharded job (modules given) leaves it to its first shard.
    tensors = compare_plain_tensors(plain_tensors(ca, a.det, a.entries), plain_tensors(cb, b.det, b.entries)) \
        if modules is None or shard_first else {"compared": 0, "differ": [], "only_in_a": [], "only_in_b": []}
    # Nothing compared proves nothing: a pair with no layer in common fails.
    return {"component": ca.name, "ok": bool(layers) and all(r["ok"] for r in layers) and not tensors["differ"],
            "device": "cpu" if dev is None else str(dev), "rows": "all" if rows == "all" else "sampled",
            "kernels": _kernel_summary(layers, eligible, kernels, seed), "layers": layers,
            "tensors": {"compared": tensors["compared"], "differ": tensors["differ"]},
            "only_in_a": sorted(set(a.entries) - set(b.entries), key=natural_key) + tensors["only_in_a"],
            "only_in_b": sorted(set(b.entries) - set(a.entries), key=natural_key) + tensors["only_in_b"]}


def _on_device(arrays, dev) -> tuple:
    if dev is None:
        return tuple(arrays)
    import torch

    return tuple(torch.from_numpy(v).to(dev) for v in arrays)


def _kernel_summary(layers: list[dict], eligible: dict, mode: str, seed: int) -> list[dict]:
    """Per side and kernel: how many layers it could run on, how many it checked, where it could not."""
    summary = []
    for side_key in ("a", "b"):
        for kernel in sorted(set(eligible[side_key].values())):
            runs = [r["kernels"][side_key] for r in layers if side_key in r.get("kernels", {})
                    and r["kernels"][side_key]["kernel"] == kernel]
            errors = sorted({k["error"] for k in runs if k["ok"] is None})
            summary.append({"side": side_key, "kernel": kernel, "mode": mode, "seed": seed,
                            "layers": sum(k == kernel for k in eligible[side_key].values()),
                            "checked": sum(k["ok"] is not None for k in runs),
                            "failed": sum(k["ok"] is False for k in runs),
                            "could_not_run": len(runs) - sum(k["ok"] is not None for k in runs), "errors": errors})
    return summary


def validate(path_a: str | Path, path_b: str | Path, **kwargs) -> dict:
    ta, tb = open_target(path_a), open_target(path_b)
    comps_b = {c.name: c for c in tb.components}
    if ta.kind != "pipeline" or tb.kind != "pipeline":
        pairs = [(ta.components[0], tb.components[0])]
    else:
        pairs = [(c, comps_b[c.name]) for c in ta.components if c.name in comps_b]
    results = [validate_components(x, y, **kwargs) for x, y in pairs]
    both = ta.kind == tb.kind == "pipeline"        # components on one side only fail, like modules
    only_a = sorted(set(c.name for c in ta.components) - set(comps_b)) if both else []
    only_b = sorted(set(comps_b) - set(c.name for c in ta.components)) if both else []
    ok = bool(results) and not only_a and not only_b and all(
        r["ok"] and not r["only_in_a"] and not r["only_in_b"] for r in results)
    return {"a": str(path_a), "b": str(path_b), "ok": ok, "components": results,
            "components_only_in_a": only_a, "components_only_in_b": only_b,
            "layers": [dict(layer, component=r["component"]) for r in results for layer in r["layers"]]}
