"""`qconv validate A B`: per-layer matmul equivalence between any two checkpoints.

For every Linear present in both (quantized or not, any supported format), a seeded activation batch X
shaped like real activations (unit-scale, with a few outlier columns above LLM.int8's 6.0 threshold)
goes through both sides' exact dequantized weights in float32: Y_A = X W_A^T, Y_B = X W_B^T.

Pass criterion, per output channel c (no tolerance given):

    ||Y_A[:, c] - Y_B[:, c]||  <=  (eps + in * 2^-23) * || |X| |W_A[c]|^T ||

The right-hand side is the rigorous bound for weights that differ by at most a relative eps per element:
eps is the scale rounding the pair implies (0 when both sides store their scales the same way, so any
difference is a defect; 2^-11 when one side holds float16 scales and the other does not, 2^-8 for
bfloat16, 2^-24 for float32), and in * 2^-23 covers float32 accumulation. With --tol, the criterion is
instead relative Frobenius error of Y <= tol. For a layer that `convert --validate` requantized, the
result's weights must differ from the source's by no more than the error convert measured and
reported (a packing or zero-point defect adds to it); Y's metrics are reported alongside.

Where the producing library is installed, each side's own kernel runs on the same X too (bitsandbytes'
LLM.int8 matmul with its outlier threshold and its 4-bit matmul; auto-round's CPU kernel for GPTQ v1 and
auto_round:auto_gptq) and must agree with qconv's decoding within that kernel's own arithmetic, so
validation is never only qconv's decoder checked against itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UsageError
from .formats.checkpoint import Component, open_target
from .formats.detect import Detection, detect
from .formats.layout import QuantModule, natural_key
from .formats.reader import model_dtype, read_module
from .formats.safetensors_header import FLOAT_DTYPES, TensorInfo
from .formats.tensor_io import read_array, to_float32

ULP = {"F16": 2.0**-11, "BF16": 2.0**-8, "F32": 2.0**-24, "F64": 2.0**-53}
MAX_ROWS = 4096            # larger layers are checked on evenly spread row windows (row_windows)
WINDOWS = 8
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

    def weight(self, name: str, windows) -> np.ndarray:
        """Rows of the float32 weight: the given (start, stop) windows, concatenated."""
        e = self.entries[name]
        if e.module is None:
            return np.concatenate([to_float32(read_array(e.info, rows=w), e.info.dtype) for w in windows])
        qt = read_module(self.comp, self.det, e.module, self.dtype)
        return np.concatenate([qt.dequantize_rows(*w) for w in windows])


def row_windows(out: int) -> list[tuple[int, int]]:
    """All rows of a layer up to MAX_ROWS; above, WINDOWS evenly spread blocks of MAX_ROWS / WINDOWS rows
    (the first at row 0, starts on multiples of 32), so only those rows are dequantized."""
    if out <= MAX_ROWS:
        return [(0, out)]
    size = MAX_ROWS // WINDOWS
    starts = sorted({int(s) // 32 * 32 for s in np.linspace(0, out - size, WINDOWS)})
    return [(s, s + size) for s in starts]


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


def _auto_round_output(side: Side, e: Entry, x, k: int, device):
    """auto-round's CPU kernel (auto_round_extension torch_zp QuantLinear, what transformers loads GPTQ
    v1 / auto_round:auto_gptq checkpoints with) on X; it reads v1 zero points as stored + 1."""
    try:
        import torch
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    except ImportError:
        return None
    m, qc = e.module, side.det.qc or {}
    from .formats.gptq_codec import zero_decoding
    # Only what transformers + auto-round load: v1 zeros, fp16 scales, no act-order g_idx, and no
    # GPTQModel `meta` (which that loader refuses).
    if (zero_decoding(qc)[0] != "v1" or "meta" in qc or qc.get("desc_act") or m.bits not in (2, 3, 4, 8)
            or m.details.get("scales_dtype") != "F16"):
        return None
    t = {k[len(m.name) + 1:]: torch.from_numpy(np.ascontiguousarray(read_array(side.comp.tensors[k]))).to(device)
         for k in m.weight_tensors + m.state_tensors}
    layer = QuantLinear(m.bits, m.group_size if m.group_size and m.group_size > 0 else -1, m.in_features,
                        k, bias=False)
    layer.qweight = t["qweight"][:, :k].contiguous()
    layer.qzeros = t["qzeros"][:, : k * m.bits // 32].contiguous()
    layer.scales = t["scales"][:, :k].contiguous()
    with torch.no_grad():
        return layer(torch.from_numpy(x).to(device)).float().cpu().numpy()


def _kernel_output(side: Side, e: Entry, x, k: int, device):
    """The producing library's own kernel on X (on the validation device), where it is installed, for
    output channels 0..k-1 (the whole layer for bitsandbytes 4-bit, whose blocks span rows)."""
    if e.module is not None and e.module.family == "gptq":
        return _auto_round_output(side, e, x, k, device)
    if e.module is None or e.module.family not in ("bnb8", "bnb4"):
        return None
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F
        import torch
    except ImportError:
        return None
    m = e.module
    t = {k[len(m.name) + 1:]: torch.from_numpy(np.ascontiguousarray(read_array(side.comp.tensors[k]))).to(device)
         for k in m.weight_tensors + m.state_tensors}
    xt = torch.from_numpy(x).to(device)
    if m.family == "bnb8":
        state = bnb.MatmulLtState()
        cb, scb = t["weight"][:k].contiguous(), t["SCB"][:k].float().contiguous()
        state.CB, state.SCB, state.threshold, state.has_fp16_weights = cb, scb, 6.0, False
        y = bnb.matmul(xt.half(), cb, state=state).float()
    else:
        qs = F.QuantState.from_dict({k[len("weight."):]: v for k, v in t.items() if k.startswith("weight.")},
                                    device=device)
        qs.dtype = torch.float32
        # The packed bytes in whatever storage dtype they came in: bitsandbytes views them as uint8.
        y = bnb.matmul_4bit(xt, t["weight"].t(), quant_state=qs).float()[:, :k]
    return y.cpu().numpy()


def compare(a: Side, b: Side, name: str, *, samples: int, seed: int, tol: float | tuple | None,
            device) -> dict:
    import torch

    ea, eb = a.entries[name], b.entries[name]
    if a.shape(name) != b.shape(name):
        return {"module": name, "ok": False,
                "problem": f"shapes differ: {list(a.shape(name))} vs {list(b.shape(name))}"}
    out, inp = a.shape(name)
    # A requantized layer is held to its whole-matrix weight error, so it is read whole.
    windows = [(0, out)] if isinstance(tol, tuple) else row_windows(out)
    rows = np.concatenate([np.arange(*w) for w in windows])
    wa, wb = a.weight(name, windows), b.weight(name, windows)
    x = _activations(samples, inp, seed)
    X = torch.from_numpy(x).to(device)
    WA = torch.from_numpy(np.ascontiguousarray(wa)).to(device)
    WB = torch.from_numpy(np.ascontiguousarray(wb)).to(device)
    ya, yb = X @ WA.T, X @ WB.T
    bound = X.abs() @ WA.abs().T
    diff = (ya - yb).double()
    per_channel = diff.norm(dim=0)
    denom = bound.double().norm(dim=0).clamp_min(1e-30)
    rel_channel = (per_channel / ya.double().norm(dim=0).clamp_min(1e-30))
    ratio = float((per_channel / denom).max())
    rel = float(diff.norm() / ya.double().norm().clamp_min(1e-30))
    cosine = float(torch.nn.functional.cosine_similarity(ya.double().flatten(), yb.double().flatten(), dim=0))
    worst = int(rows[int(rel_channel.argmax())])
    if isinstance(tol, tuple):           # a requantized layer: its weight error is what convert reported
        _, reported = tol
        d = wb.astype(np.float64) - wa.astype(np.float64)
        weight_error = float(np.linalg.norm(d) / max(np.linalg.norm(wa.astype(np.float64)), 1e-30))
        ok = weight_error <= reported * (1 + 1e-3) + 1e-6
        criterion = {"weight_rel_error": weight_error, "reported_weight_error": reported}
    elif tol is None:
        eps = 0.0 if ea.representation == eb.representation else max(ea.eps, eb.eps)
        limit = eps + inp * 2.0**-23
        ok = ratio <= limit
        criterion = {"bound_ratio": ratio, "bound": limit}
    else:
        ok = rel <= tol
        criterion = {"tolerance": tol}
    report = {"module": name, "ok": bool(ok), "max_abs": float(diff.abs().max()), "rel_frobenius": rel,
              "cosine": cosine, "worst_channel": worst, "rows_checked": int(len(rows)), **criterion}
    kernels = {}
    # Kernels run on the first window (leading output channels; a multiple of 32 rows, so packed zero
    # points slice cleanly): their cost, not the comparison's, dominates large layers on a CPU.
    k = windows[0][1]
    for side_name, side, e, w in (("a", a, ea, wa), ("b", b, eb, wb)):
        y_kernel = _kernel_output(side, e, x, k, device)
        if y_kernel is None:
            continue
        ours = (X @ torch.from_numpy(np.ascontiguousarray(w[:k])).to(device).T).cpu().double().numpy()
        k_rel = float(np.linalg.norm(y_kernel - ours) / max(np.linalg.norm(ours), 1e-30))
        k_ok = k_rel <= KERNEL_TOLERANCE[e.module.family]
        kernel = {"gptq": "auto-round"}.get(e.module.family, e.module.family)
        kernels[side_name] = {"kernel": kernel, "rel_frobenius": k_rel, "ok": k_ok}
        report["ok"] = report["ok"] and k_ok
    if kernels:
        report["kernels"] = kernels
    return report


def validate_components(ca: Component, cb: Component, *, samples: int = 32, seed: int = 0,
                        tol: float | None = None, device: str = "auto",
                        tolerances: dict[str, float] | None = None) -> dict:
    a, b = Side(ca), Side(cb)
    dev = _torch_device(device)
    common = sorted(set(a.entries) & set(b.entries), key=natural_key)
    layers = []
    for name in common:
        layer_tol = (tolerances or {}).get(name, tol)
        layers.append(compare(a, b, name, samples=samples, seed=seed, tol=layer_tol, device=dev))
    return {"component": ca.name, "ok": all(r["ok"] for r in layers), "device": str(dev), "layers": layers,
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
