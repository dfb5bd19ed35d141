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

Where the producing library is installed, each side's own kernel runs on the same X too (bitsandbytes'
LLM.int8 matmul with its outlier threshold and its 4-bit matmul; auto-round's CPU kernel for GPTQ v1 and
auto_round:auto_gptq) and must agree with qconv's decoding within that kernel's own arithmetic, so
validation is never only qconv's decoder checked against itself.

Work is split so the device does the arithmetic: worker threads read and unpack the next layers (codes,
zero points, scales) while the device dequantizes (dequantize_block, bit for bit the numpy reference)
and compares the current one, one block of rows at a time, so device memory is bounded by a block.
Every row is checked; with --rows sampled, layers above 4,096 rows are checked on 8 evenly spread
windows of 512 rows (faster on a CPU; the report marks those layers).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UsageError
from .formats.checkpoint import Component, open_target
from .formats.detect import Detection, detect
from .formats.ir import QuantTensor
from .formats.layout import QuantModule, natural_key
from .formats.reader import model_dtype, read_module
from .formats.safetensors_header import FLOAT_DTYPES, TensorInfo
from .formats.tensor_io import read_array

ULP = {"F16": 2.0**-11, "BF16": 2.0**-8, "F32": 2.0**-24, "F64": 2.0**-53}
MAX_ROWS = 4096            # sampled rows: larger layers are checked on evenly spread row windows
WINDOWS = 8
BLOCK_ELEMENTS = 1 << 25   # all rows: weights per block on the device (128 MiB of float32 per side)
WEIGHT_SLACK = 2.0**-21    # float32 roundings of the scale products on both sides (a few 2^-24)
PREFETCH = 4               # layers read and decoded ahead of the device, on worker threads
# LLM.int8 quantizes activations to int8 (1/127 steps); the 4-bit kernel computes in float32 here;
# auto-round's torch kernel rounds the dequantized weight to float16 before the matmul (2^-11).
KERNEL_TOLERANCE = {"bnb8": 0.05, "bnb4": 1e-4, "gptq": 2e-3}


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
        if m.family == "gptq":
            return ("gptq", m.details.get("scales_dtype"))
        return (m.family,)

    @property
    def floor(self) -> float:
        """Absolute rounding of the stored weight below the normal range: float16 subnormals (2^-25)."""
        return 2.0**-25 if self.module is None and self.info.dtype == "F16" else 0.0

    @property
    def eps(self) -> float:
        m = self.module
        if m is None:
            return ULP.get(self.info.dtype, 0.0)
        if m.family == "gptq":
            return ULP.get(m.details.get("scales_dtype"), 2.0**-11)
        return ULP["F32"]


class Side:
    def __init__(self, comp: Component):
        self.comp = comp
        self.det: Detection = detect(comp)
        self.dtype = model_dtype(comp, self.det)
        self.entries: dict[str, Entry] = {m.name: Entry(m.name, m, None) for m in self.det.modules}
        for name, info in comp.tensors.items():
            if (name.endswith(".weight") and len(info.shape) == 2 and info.dtype in FLOAT_DTYPES
                    and name not in self.det.claimed_tensors):
                self.entries.setdefault(name[: -len(".weight")], Entry(name[: -len(".weight")], None, info))

    def shape(self, name: str) -> tuple[int, int]:
        e = self.entries[name]
        return (e.module.out_features, e.module.in_features) if e.module else tuple(e.info.shape)

    def host(self, name: str) -> HostWeight:
        """The layer as the host holds it: decoded on a worker thread when quantized (a QuantTensor); a
        float weight is read a block of rows at a time, when the device asks for it, so memory stays
        bounded by a block even for a float lm_head."""
        e = self.entries[name]
        if e.module is None:
            return HostWeight(None, e.info)
        return HostWeight(read_module(self.comp, self.det, e.module, self.dtype, contiguous=False), None)


@dataclass(frozen=True, eq=False)
class HostWeight:
    qt: QuantTensor | None
    info: TensorInfo | None

    def block(self, r0: int, r1: int, device):
        """Rows r0:r1 of the float32 weight, computed on the device."""
        import torch

        if self.qt is not None:
            return dequantize_block(self.qt, r0, r1, device)
        raw = read_array(self.info, rows=(r0, r1))
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
    if qt.spec.scheme == "int":
        codes = qt.codes[r0:r1]
        if codes.flags.c_contiguous:
            w = dev(codes).to(torch.float32)
        else:                           # a transposed view (GPTQ's [in, out]): transposed on the device
            w = dev(codes.T).T.contiguous().to(torch.float32)
        z = dev(qt.zeros[r0:r1]).to(torch.float32)
        s = dev(qt.scales[r0:r1]).to(torch.float32)
        n_groups, gs = z.shape[1], qt.spec.group_size
        if n_groups == 1:
            w.sub_(z).mul_(s)
        elif qt.g_idx is None and gs > 0 and n_groups * gs == inp:
            w3 = w.view(rows, n_groups, gs)
            w3.sub_(z[:, :, None]).mul_(s[:, :, None])
        else:
            g = dev(qt.groups.astype(np.int64))
            w.sub_(z[:, g]).mul_(s[:, g])
        if qt.spec.scale_divisor != 1:
            w.mul_(torch.tensor(np.float32(1.0 / qt.spec.scale_divisor), device=device))
        return w
    book = torch.tensor(np.asarray(qt.spec.codebook, dtype=np.float32), device=device)
    bs = qt.spec.group_size
    j0, j1 = r0 * inp, r1 * inp
    w = book[dev(qt.codes[j0:j1]).long()]
    if j0 % bs == 0 and (j1 - j0) % bs == 0:
        w.view(-1, bs).mul_(dev(qt.scales[j0 // bs:j1 // bs])[:, None])
    else:
        b0 = j0 // bs
        w.mul_(dev(qt.scales[b0:(j1 - 1) // bs + 1])[torch.arange(j0, j1, device=device) // bs - b0])
    return w.view(rows, inp)


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
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, inp)).astype(np.float32)
    outliers = rng.choice(inp, size=max(1, inp // 128), replace=False)
    x[:, outliers] *= np.float32(rng.uniform(8, 20))          # above LLM.int8's 6.0 threshold
    return x


def _torch_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no CUDA device; use --device auto or cpu")
    return torch.device(device)


def _import_bitsandbytes() -> bool:
    """Import bitsandbytes without its import-time log lines (on CPUs with AVX512-BF16 it warns that an
    optional kernel package is missing, which concerns neither validate nor its user)."""
    import logging

    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    finally:
        log.setLevel(level)
    return True


def _kernel_name(side: Side, e: Entry) -> str | None:
    """Which producer's kernel can run this layer here: "bnb8", "bnb4", "auto-round" or None."""
    m = e.module
    if m is None:
        return None
    if m.family in ("bnb8", "bnb4"):
        return m.family if _import_bitsandbytes() else None
    from .formats.gptq_codec import zero_decoding
    qc = side.det.qc or {}
    # Only what transformers + auto-round load: v1 zeros, fp16 scales, no act-order g_idx, and no
    # GPTQModel `meta` (which that loader refuses).
    if (zero_decoding(qc)[0] != "v1" or "meta" in qc or qc.get("desc_act") or m.bits not in (2, 3, 4, 8)
            or m.details.get("scales_dtype") != "F16"):
        return None
    try:
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear  # noqa: F401
    except ImportError:
        return None
    return "auto-round"


def _kernel_inputs(side: Side, e: Entry) -> dict:
    m = e.module
    return {k[len(m.name) + 1:]: np.ascontiguousarray(read_array(side.comp.tensors[k]))
            for k in m.weight_tensors + m.state_tensors}


def _kernel_output(kernel: str, m: QuantModule, raw: dict, X, k: int, device):
    """The producing library's own kernel on X (on the validation device), for output channels 0..k-1
    (the whole layer for bitsandbytes 4-bit, whose blocks span rows)."""
    import torch

    t = {name: torch.from_numpy(v).to(device) for name, v in raw.items()}
    if kernel == "auto-round":
        # auto_round_extension's torch_zp QuantLinear: what transformers loads GPTQ v1 /
        # auto_round:auto_gptq checkpoints with on the CPU; it reads v1 zero points as stored + 1.
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

        layer = QuantLinear(m.bits, m.group_size if m.group_size and m.group_size > 0 else -1, m.in_features,
                            k, bias=False)
        layer.qweight = t["qweight"][:, :k].contiguous()
        layer.qzeros = t["qzeros"][:, : k * m.bits // 32].contiguous()
        layer.scales = t["scales"][:, :k].contiguous()
        with torch.no_grad():
            return layer(X).float()
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    if kernel == "bnb8":
        state = bnb.MatmulLtState()
        cb, scb = t["weight"][:k].contiguous(), t["SCB"][:k].float().contiguous()
        state.CB, state.SCB, state.threshold, state.has_fp16_weights = cb, scb, 6.0, False
        return bnb.matmul(X.half(), cb, state=state).float()
    qs = F.QuantState.from_dict({n[len("weight."):]: v for n, v in t.items() if n.startswith("weight.")},
                                device=device)
    qs.dtype = torch.float32
    # The packed bytes in whatever storage dtype they came in: bitsandbytes views them as uint8.
    return bnb.matmul_4bit(X, t["weight"].t(), quant_state=qs).float()[:, :k]


@dataclass(frozen=True)
class _Plan:
    name: str
    blocks: list                        # (r0, r1) row blocks to compare
    tol: float | tuple | None
    kernels: dict                       # side -> the producer's kernel to cross-check, or None


@dataclass(frozen=True, eq=False)
class _Prepared:
    plan: _Plan
    a: HostWeight
    b: HostWeight
    kernel_inputs: dict                 # side -> raw tensors for that side's own kernel


def _prepare(a: Side, b: Side, plan: _Plan) -> _Prepared:
    """Everything of one layer that the host must do (read, unpack): runs on worker threads, ahead of
    the device, so reading and decoding overlap the comparison of earlier layers."""
    raw = {s: _kernel_inputs(side, side.entries[plan.name]) for s, side in (("a", a), ("b", b))
           if plan.kernels[s]}
    return _Prepared(plan, a.host(plan.name), b.host(plan.name), raw)


def compare(a: Side, b: Side, p: _Prepared, *, samples: int, seed: int, device) -> dict:
    import torch

    name, tol, kernels = p.plan.name, p.plan.tol, p.plan.kernels
    ea, eb = a.entries[name], b.entries[name]
    inp = a.shape(name)[1]
    x = _activations(samples, inp, seed)
    X = torch.from_numpy(x).to(device)
    Xabs = X.abs()
    same = ea.representation == eb.representation
    eps = 0.0 if same else max(ea.eps, eb.eps)
    # Per weight: |W_B - W_A| <= (eps + 2^-21) |W_A| + floor; zero when both store scales alike.
    w_rel = 0.0 if same else eps + WEIGHT_SLACK
    w_floor = 0.0 if same else max(ea.floor, eb.floor)
    sums = dict.fromkeys(("d2", "a2", "b2", "ab", "wd2", "wa2"), 0.0)
    max_abs, ratio, worst, worst_rel, rows_checked = 0.0, 0.0, 0, -1.0, 0
    over, first_over = 0, None
    report_kernels = {}
    for bi, (r0, r1) in enumerate(p.plan.blocks):
        WA, WB = p.a.block(r0, r1, device), p.b.block(r0, r1, device)
        ya, yb = X @ WA.T, X @ WB.T
        diff = (ya - yb).double()
        ya64, yb64 = ya.double(), yb.double()
        per_channel = diff.norm(dim=0)
        absA = WA.abs()
        denom = (Xabs @ absA.T).double().norm(dim=0).clamp_min(1e-30)
        ratio = max(ratio, float((per_channel / denom).max()))
        rel_channel = per_channel / ya64.norm(dim=0).clamp_min(1e-30)
        i = int(rel_channel.argmax())
        if float(rel_channel[i]) > worst_rel:
            worst_rel, worst = float(rel_channel[i]), r0 + i
        max_abs = max(max_abs, float(diff.abs().max()))
        sums["d2"] += float(diff.square().sum())
        sums["a2"] += float(ya64.square().sum())
        sums["b2"] += float(yb64.square().sum())
        sums["ab"] += float((ya64 * yb64).sum())
        if isinstance(tol, tuple):
            sums["wd2"] += float((WB.double() - WA.double()).square().sum())
            sums["wa2"] += float(WA.double().square().sum())
        elif tol is None:
            if w_rel == 0.0:
                bad = WB != WA
            else:
                bad = WB.sub(WA).abs_().gt_(absA.mul_(w_rel).add_(w_floor))
            n = int(torch.count_nonzero(bad))
            if n and first_over is None:
                row, col = (int(v) for v in bad.nonzero()[0])
                first_over = [r0 + row, col]
            over += n
        rows_checked += r1 - r0
        if bi == 0:
            # Kernels run on the first block (leading output channels; a multiple of 32 rows, so packed
            # zero points slice cleanly): on a CPU their cost, not the comparison's, dominates.
            for s, e, ours in (("a", ea, ya), ("b", eb, yb)):
                if kernels[s]:
                    try:
                        y_kernel = _kernel_output(kernels[s], e.module, p.kernel_inputs[s], X, r1, device)
                    except Exception as exc:  # noqa: BLE001 - the library cannot run it here: said, never counted as a pass
                        report_kernels[s] = {"kernel": kernels[s], "ok": None,
                                             "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
                        continue
                    k_rel = float((y_kernel.double() - ours.double()).norm() / ours.double().norm().clamp_min(1e-30))
                    report_kernels[s] = {"kernel": kernels[s], "rel_frobenius": k_rel,
                                         "ok": k_rel <= KERNEL_TOLERANCE[e.module.family]}
    rel = (sums["d2"] / max(sums["a2"], 1e-60)) ** 0.5
    cosine = sums["ab"] / max((sums["a2"] * sums["b2"]) ** 0.5, 1e-60)
    if isinstance(tol, tuple):           # a requantized layer: its weight error is what convert reported
        _, reported = tol
        weight_error = (sums["wd2"] / max(sums["wa2"], 1e-60)) ** 0.5
        ok = weight_error <= reported * (1 + 1e-3) + 1e-6
        criterion = {"weight_rel_error": weight_error, "reported_weight_error": reported}
    elif tol is None:
        limit = eps + inp * 2.0**-23
        ok = ratio <= limit and over == 0
        criterion = {"bound_ratio": ratio, "bound": limit, "weights_over_bound": over}
        if first_over is not None:
            criterion["first_weight_over_bound"] = first_over
    else:
        ok = rel <= tol
        criterion = {"tolerance": tol}
    report = {"module": name, "ok": bool(ok and all(k["ok"] is not False for k in report_kernels.values())),
              "max_abs": max_abs, "rel_frobenius": rel, "cosine": cosine, "worst_channel": worst,
              "rows_checked": rows_checked, **criterion}
    if rows_checked < a.shape(name)[0]:
        report["sampled"] = True
    if report_kernels:
        report["kernels"] = report_kernels
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
                        tolerances: dict[str, float] | None = None) -> dict:
    from .convert.engine import ordered

    a, b = Side(ca), Side(cb)
    dev = _torch_device(device)
    common = sorted(set(a.entries) & set(b.entries), key=natural_key)
    results, plans = {}, []
    for name in common:
        if a.shape(name) != b.shape(name):
            results[name] = {"module": name, "ok": False,
                             "problem": f"shapes differ: {list(a.shape(name))} vs {list(b.shape(name))}"}
            continue
        out, inp = a.shape(name)
        layer_tol = (tolerances or {}).get(name, tol)
        # A requantized layer is held to its whole-matrix weight error, so it is read whole.
        blocks = row_blocks(out, inp) if rows == "all" or isinstance(layer_tol, tuple) else row_windows(out)
        kernels = {s: _kernel_name(side, side.entries[name]) for s, side in (("a", a), ("b", b))}
        plans.append(_Plan(name, blocks, layer_tol, kernels))
    with _highest_precision():
        for p in ordered(lambda plan: _prepare(a, b, plan), plans, depth=PREFETCH):
            results[p.plan.name] = compare(a, b, p, samples=samples, seed=seed, device=dev)
    layers = [results[name] for name in common]
    return {"component": ca.name, "ok": all(r["ok"] for r in layers), "device": str(dev),
            "rows": "all" if rows == "all" else "sampled", "layers": layers,
            "only_in_a": sorted(set(a.entries) - set(b.entries), key=natural_key),
            "only_in_b": sorted(set(b.entries) - set(a.entries), key=natural_key)}


def validate(path_a: str | Path, path_b: str | Path, **kwargs) -> dict:
    ta, tb = open_target(path_a), open_target(path_b)
    comps_b = {c.name: c for c in tb.components}
    if ta.kind != "pipeline" or tb.kind != "pipeline":
        pairs = [(ta.components[0], tb.components[0])]
    else:
        pairs = [(c, comps_b[c.name]) for c in ta.components if c.name in comps_b]
    results = [validate_components(x, y, **kwargs) for x, y in pairs]
    return {"a": str(path_a), "b": str(path_b), "ok": all(r["ok"] and not r["only_in_a"] and not r["only_in_b"]
                                                          for r in results), "components": results,
            "layers": [dict(layer, component=r["component"]) for r in results for layer in r["layers"]]}
