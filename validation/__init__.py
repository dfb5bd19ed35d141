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
import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..probes import outlier_activations
from ..progress import report as report_progress
from .bounds import pair_bounds
# _factored_outputs and dequantize_block: tests and benchmarks import them from here
from .compare import _compare_block, _factored_outputs, _Plan, _read_layer, _report, _Sums  # noqa: F401
from .device import _compute_device, _highest_precision, _on_device, dequantize_block  # noqa: F401
from .kernels import _kernel_name, _kernel_sample, _kernel_summary, _submit_kernels
from .sides import Side
from .tensors import compare_plain_tensors, plain_tensors
from ..formats.storage.checkpoint import Component, open_target
from ..formats.core.layout import natural_key
from ..formats.core.reader import WINDOW_ELEMENTS

# The figures the docs quote (tests/docs/test_docs.py reads them here); the tests shrink some of them here.
MAX_ROWS = 4096            # sampled rows: larger layers are checked on evenly spread row windows
WINDOWS = 8
BLOCK_ELEMENTS = 1 << 22   # all rows: weights per block (16 MiB of float32 per side)
PREFETCH = 2               # layers read and unpacked ahead at most, on as many reader threads
READ_AHEAD = 1 << 27       # bytes of codes held for layers read ahead and being compared (beyond one ahead)
COMPUTE_THREADS = 2        # blocks dequantized, multiplied and compared at once (one per core here)
IN_FLIGHT = 4              # blocks submitted ahead of the one being summed up
KERNEL_SAMPLE = 16         # layers per kernel cross-checked by default, besides one of each shape


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


def _activations(n: int, inp: int, seed: int) -> np.ndarray:
    return outlier_activations(n, inp, seed)


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
    eligible, chosen = _kernel_choice(a, b, [n for n in common if a.shape(n) == b.shape(n)], kernels, seed)
    if modules is not None:
        common = [n for n in common if n in modules]
    results, plans, inputs = _plan_layers(a, b, common, chosen, dev, samples=samples, seed=seed, rows=rows,
                                          tolerances={n: (tolerances or {}).get(n, tol) for n in common})
    _compare_layers(a, b, plans, inputs, dev, results, f"validating {ca.name}", len(common))
    layers = [results[name] for name in common]
    # Every other tensor (biases, norms, buffers, ...): exactly, or within its dtype change's rounding
    # (validation/tensors.py). Once per pair: a sharded job (modules given) leaves it to its first shard.
    tensors = compare_plain_tensors(plain_tensors(ca, a.det, a.entries), plain_tensors(cb, b.det, b.entries)) \
        if modules is None or shard_first else {"compared": 0, "differ": [], "only_in_a": [], "only_in_b": []}
    # Nothing compared proves nothing: a pair with no layer in common fails.
    return {"component": ca.name, "ok": bool(layers) and all(r["ok"] for r in layers) and not tensors["differ"],
            "device": "cpu" if dev is None else str(dev), "rows": "all" if rows == "all" else "sampled",
            "kernels": _kernel_summary(layers, eligible, kernels, seed), "layers": layers,
            "tensors": {"compared": tensors["compared"], "differ": tensors["differ"]},
            "only_in_a": sorted(set(a.entries) - set(b.entries), key=natural_key) + tensors["only_in_a"],
            "only_in_b": sorted(set(b.entries) - set(a.entries), key=natural_key) + tensors["only_in_b"]}


def _kernel_choice(a: Side, b: Side, same_shape: list[str], kernels: str, seed: int) -> tuple[dict, dict]:
    """(eligible, chosen), per side ("a", "b"): layer -> the producer's kernel that can run it, and the
    layers it runs on (all of them with kernels="all", else the seeded sample, KERNEL_SAMPLE)."""
    eligible = {s: {n: k for n in same_shape if (k := _kernel_name(side, side.entries[n]))}
                for s, side in (("a", a), ("b", b))}
    chosen = eligible if kernels == "all" else {s: _kernel_sample(side, eligible[s], seed, KERNEL_SAMPLE)
                                                for s, side in (("a", a), ("b", b))}
    return eligible, chosen


def _plan_layers(a: Side, b: Side, common: list[str], chosen: dict, dev, *, samples: int, seed: int, rows: str,
                 tolerances: dict) -> tuple[dict, list[_Plan], dict]:
    """(results, plans, inputs): the plan of every layer in common with rows to compare, the activations
    each is multiplied by (host X, X^T and |X|^T where the blocks are computed; one seeded batch per input
    width), and the reports of the layers settled without a block (shapes that differ, no rows)."""
    results, plans, inputs, activations = {}, [], {}, {}
    for name in common:
        if a.shape(name) != b.shape(name):
            results[name] = {"module": name, "ok": False,
                             "problem": f"shapes differ: {list(a.shape(name))} vs {list(b.shape(name))}"}
            continue
        out, inp = a.shape(name)
        plan = _plan_layer(a, b, name, tolerances[name], rows, {s: chosen[s].get(name) for s in ("a", "b")})
        if inp not in activations:
            x = _activations(samples, inp, seed)
            xt = np.ascontiguousarray(x.T)
            activations[inp] = (x, *_on_device((xt, np.abs(xt)), dev))
        inputs[name] = activations[inp]
        if plan.blocks:
            plans.append(plan)
        else:                            # an empty layer: nothing can differ
            results[name] = _report(plan, _Sums(), inp, out)
    return results, plans, inputs


def _plan_layer(a: Side, b: Side, name: str, layer_tol, rows: str, kernels: dict) -> _Plan:
    """One layer's plan: its row blocks and the windows they are read in, its criterion (layer_tol; the
    pair's bounds) and the producers' kernels it runs."""
    out, inp = a.shape(name)
    eps, w_rel, w_floor = pair_bounds(a.entries[name], b.entries[name])
    # A requantized layer is held to its whole-matrix weight error, so it is read whole.
    blocks = row_blocks(out, inp) if rows == "all" or isinstance(layer_tol, tuple) else row_windows(out)
    step = math.lcm(32, a.row_step(name), b.row_step(name))
    return _Plan(name, blocks, row_windows_read(blocks, inp, out, step), layer_tol, kernels, eps, w_rel, w_floor)


def _compare_layers(a: Side, b: Side, plans: list[_Plan], inputs: dict, dev, results: dict, label: str,
                    total: int) -> None:
    """Every planned layer compared block by block (_blocks) and reported into results as its last block
    is summed up, with the producers' kernels cross-checked on its first block on a thread of their own."""
    sums, jobs = {}, []
    kernel_pool = ThreadPoolExecutor(1, thread_name_prefix="qconv-kernel")
    kernel_device = dev if dev is not None else "cpu"
    try:
        with _highest_precision() if dev is not None else contextlib.nullcontext():
            for plan, bi, s in _blocks(a, b, plans, dev, inputs):
                sums.setdefault(plan.name, _Sums()).add(s)
                if bi == 0:
                    jobs += _submit_kernels(kernel_pool, a, b, plan, inputs[plan.name][0], s.ys, kernel_device)
                if bi == len(plan.blocks) - 1:
                    out, inp = a.shape(plan.name)
                    results[plan.name] = _report(plan, sums.pop(plan.name), inp, out)
                    report_progress(label, len(results), total, "layers")
            for name, side_key, job in jobs:
                k = job.result()
                layer = results[name]
                layer.setdefault("kernels", {})[side_key] = k
                layer["ok"] = layer["ok"] and k["ok"] is not False
    finally:
        kernel_pool.shutdown(wait=True, cancel_futures=True)


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
