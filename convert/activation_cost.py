"""What quantizing activations at run time costs, reported by `convert` for targets whose kernels do it
(compressed-tensors W8A8: int8 activations per token, computed dynamically).

Per layer, on the same seeded outlier-shaped activations validate uses (unit scale, a few columns
above LLM.int8's 6.0 threshold, as real LLM activations have), three outputs are compared:

* the source's own matmul: LLM.int8's mixed-precision matmul for a bitsandbytes int8 source
  (bitsandbytes' kernel: outlier columns in float16, the rest int8), else the float product of the
  source's exact weights (what weight-only kernels compute);
* the target's: X quantized per token to int8 (s_x = max|x| / 127, round, clamp to +-127), times the
  written int8 codes, times both scales (exact in float64, as the int32 accumulation is);
* the float product of the written weights.

The report gives, per layer, the relative Frobenius error of the target's output against the source's
matmul (the accuracy trade a user makes by serving W8A8 instead), and each against float. A layer of
more than MAX_CHANNELS output channels is measured on WINDOWS windows of WINDOW_ROWS channels spread
evenly over it (an estimate of the same ratio, as validate samples rows), so the report costs a bounded
part of a large layer's decoding.
"""

from __future__ import annotations

import math

import numpy as np

from ..formats.storage.checkpoint import Component
from ..formats.core.detect import Detection
from ..formats.core.ir import QuantTensor
from ..formats.core.layout import QuantModule
from ..formats.core.reader import model_dtype, read_module, require_decodable
from ..formats.core.registry import family
from ..probes import outlier_activations

SAMPLES = 32


def int8_token_matmul(x: np.ndarray, qt: QuantTensor, rows: tuple[int, int] | None = None) -> np.ndarray:
    """Y = X W^T with X quantized per token to int8, as W8A8 kernels run it (per-channel int8 weights);
    only the output channels r0:r1 of W where rows is given."""
    r0, r1 = rows or (0, qt.shape[0])
    sx = np.abs(x).max(axis=1, keepdims=True).astype(np.float64) / 127.0
    xq = np.clip(np.rint(x / np.where(sx > 0, sx, 1.0)), -127, 127)
    q = qt.codes[r0:r1].astype(np.float64) - qt.zeros[r0:r1].astype(np.float64)   # [rows, in], per-channel zeros
    sw = qt.scales[r0:r1].astype(np.float64)[:, 0] / qt.spec.scale_divisor
    return (xq @ q.T) * sx * sw[None, :]


BLOCK_ELEMENTS = 1 << 20     # weights of one block of output channels held in float64 at a time
MAX_CHANNELS = 2048          # output channels compared whole; a larger layer is sampled:
WINDOWS, WINDOW_ROWS = 32, 64  # windows of channels spread evenly over it


def channel_windows(out: int, step: int = 1) -> list[tuple[int, int]]:
    """The output channels a layer's cost is measured on: all of them, or WINDOWS windows of WINDOW_ROWS
    (at least step) starting on multiples of step (the row windows both sides' readers take)."""
    size = math.lcm(WINDOW_ROWS, step)
    if out <= max(MAX_CHANNELS, WINDOWS * size):
        return [(0, out)]
    starts = sorted({int(r) // step * step for r in np.linspace(0, out - size, WINDOWS)})
    return [(r0, r0 + size) for r0 in starts]


def _step(q: QuantModule) -> int:
    return family(q.family).row_step(q)


def _by_rows(windows: list[tuple[int, int]], inp: int, fn) -> np.ndarray:
    """np.hstack of fn(r0, r1) over blocks of the windows' output channels: a layer's float64 weight is
    never held whole."""
    step = max(1, BLOCK_ELEMENTS // max(1, inp))
    return np.hstack([fn(r0, min(w1, r0 + step)) for w0, w1 in windows for r0 in range(w0, w1, step)])


def _source_kernel(comp: Component, det: Detection, m: QuantModule, x: np.ndarray):
    """(label, output) of the source's own kernel where it quantizes activations at run time (a registry
    Kernel with source_output: bitsandbytes' LLM.int8), or None when there is none or it cannot run here."""
    kernel = family(m.family).kernel_for(m, det.qc)
    if kernel is None or kernel.source_output is None:
        return None
    try:
        import torch

        y = kernel.output(m, kernel.inputs(m, comp.tensors, m.out_features), torch.from_numpy(x), m.out_features, "cpu")
        return kernel.source_output, y.numpy().astype(np.float64)
    except Exception:  # noqa: BLE001 - the kernel is optional; the report says which matmul it used
        return None


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


def activation_cost(src: Component, det: Detection, modules: list[QuantModule], out: Component,
                    seed: int = 0) -> dict:
    """The report: per layer and its worst, for the written component ``out`` of source ``src``."""
    src_dtype = model_dtype(src, det)
    out_det = require_decodable(out)
    written = {m.name: m for m in out_det.modules}
    out_dtype = model_dtype(out, out_det)
    def layer(m: QuantModule) -> tuple[dict, str]:
        tm = written[m.name]
        x = outlier_activations(SAMPLES, m.in_features, seed)
        x64 = x.astype(np.float64)
        windows, in_f = channel_windows(m.out_features, math.lcm(_step(m), _step(tm))), m.in_features
        whole = windows == [(0, m.out_features)]
        own = _source_kernel(src, det, m, x)
        y_source = np.hstack([own[1][:, r0:r1] for r0, r1 in windows]) if own is not None else None
        kernel = own[0] if own is not None else "float"
        ys = {"float": [], "target": [], "source": []}
        for w0, w1 in windows:                 # each side read a window at a time, only its rows' bytes
            rows = None if whole else (w0, w1)
            target = read_module(out, out_det, tm, out_dtype, rows)
            local = [(0, w1 - w0)]
            ys["float"].append(_by_rows(local, in_f, lambda r0, r1: x64 @ target.dequantize_rows(r0, r1).astype(np.float64).T))
            ys["target"].append(_by_rows(local, in_f, lambda r0, r1: int8_token_matmul(x, target, (r0, r1))))
            if kernel == "float":
                rows_of = read_module(src, det, m, src_dtype, rows).dequantize_rows
                ys["source"].append(_by_rows(local, in_f, lambda r0, r1: x64 @ rows_of(r0, r1).astype(np.float64).T))
        y_float, y_target = np.hstack(ys["float"]), np.hstack(ys["target"])
        if kernel == "float":
            y_source = np.hstack(ys["source"])
        return ({"module": m.name, "vs_source_matmul": round(_rel(y_target, y_source), 6),
                 "source_matmul_vs_float": round(_rel(y_source, y_float), 6),
                 "int8_activations_vs_float": round(_rel(y_target, y_float), 6)}, kernel)

    # a zero-size layer computes nothing to compare; one layer at a time (its float64 matmuls are BLAS's,
    # threaded already: two layers at once measured 25 % slower on 2 cores)
    done = [layer(m) for m in modules if m.out_features and m.in_features]
    layers = [r for r, _ in done]
    kernels = {k for _, k in done}
    worst = max(layers, key=lambda r: r["vs_source_matmul"], default=None)
    return {"activations": "int8, per token, dynamic", "source_matmul": sorted(kernels),
            "samples": SAMPLES, "seed": seed, "layers": layers,
            "channels": f"all up to {MAX_CHANNELS} per layer, else {WINDOWS} windows of {WINDOW_ROWS} spread evenly",
            "max_vs_source_matmul": worst["vs_source_matmul"] if worst else None,
            "worst_layer": worst["module"] if worst else None,
            "median_vs_source_matmul": float(np.median([r["vs_source_matmul"] for r in layers])) if layers else None}
