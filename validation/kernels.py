"""validate's cross-check of the producers' own kernels (the family's Kernel: bitsandbytes' LLM.int8 and
4-bit matmul, auto-round's CPU kernel): which layers each runs on, each run against qconv's Y on the
kernel thread, and the summary per side and kernel."""

from __future__ import annotations

import numpy as np

from .device import _host64
from .sides import Entry, Side
from ..formats.core.registry import family


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


def _kernel_sample(side: Side, eligible: dict[str, str], seed: int, sample: int) -> dict[str, str]:
    """The layers whose producer's kernel runs by default: the first of each distinct (format, kernel,
    shape), plus ``sample`` more (validation.KERNEL_SAMPLE) drawn with the seed (all of them when there
    are no more)."""
    chosen, seen = {}, set()
    for n, k in eligible.items():
        m = side.entries[n].module
        key = (m.family, m.scheme, m.group_size, k, side.shape(n))
        if key not in seen:
            seen.add(key)
            chosen[n] = k
    rest = [n for n in eligible if n not in chosen]
    for i in sorted(np.random.default_rng(seed).choice(len(rest), min(sample, len(rest)), replace=False)):
        chosen[rest[i]] = eligible[rest[i]]
    return chosen


def _submit_kernels(pool, a: Side, b: Side, plan, x: np.ndarray, ys: tuple, device) -> list[tuple]:
    """(layer, side, future) of each producer's kernel the plan runs on its layer's first block (Y_A, Y_B
    in ys), submitted to the kernel thread."""
    return [(plan.name, key, pool.submit(_kernel_check, plan.kernels[key], side, side.entries[plan.name], x, ys[i],
                                         device))
            for i, (key, side) in enumerate((("a", a), ("b", b))) if plan.kernels[key]]


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
