"""`qconv dequantize`: any supported checkpoint -> a standard unquantized folder.

Streaming: the output is planned from headers alone (names, dtypes, shapes, shards), then written
tensor by tensor; a quantized module is decoded on its own and dequantized a slab of rows at a time
(on a small thread pool), and plain tensors are converted a slab at a time, so memory is bounded by one
module's codes plus a few slabs, whatever the model size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import UnsupportedFormat
from ..formats.storage.checkpoint import Component
from ..formats.core.detect import Detection, without_quantization
from ..formats.core.layout import QuantModule, natural_key
from ..formats.core.reader import WINDOW_ELEMENTS, model_dtype, read_module, require_decodable
from ..formats.core.source import finite_rows, where_of
from ..formats.core.registry import family
from ..formats.storage.tensor_io import FLOAT_CODES, FLOAT_NAMES, all_finite, encode_float
from .fused_experts import fuse_experts
from .engine import DEFAULT_MAX_SHARD, OutTensor, made_warnings, ordered, passthrough, run, write_component
from .card import Card
from .sink import FolderSink
from .parallel import Replan


def _dequantized(comp: Component, det: Detection, m: QuantModule, code: str, src_dtype: str) -> OutTensor:
    """A quantized module's float weight, slab by slab. A weight that is not finite is refused, never
    written: codes times scales beyond float32 (finite_rows), or beyond the output dtype's range
    (float16's 65504: a wider dtype holds it)."""
    where = where_of(comp, m)

    def rows_of(qt, r0, r1):
        w = finite_rows(comp, m, qt, r0, r1)
        out = encode_float(w, code)
        if not all_finite(out, code):
            raise UnsupportedFormat(f"its weights exceed {FLOAT_NAMES[code]}'s range (largest "
                                    f"{float(np.abs(w).max()):.3g}); write bfloat16 or float32 instead", **where)
        return out

    def chunks():
        for w0, w1 in read_windows(m):
            qt = read_module(comp, det, m, src_dtype, None if (w0, w1) == (0, m.out_features) else (w0, w1))
            rows, n = qt.slab_rows(), w1 - w0
            yield from ordered(lambda r0: rows_of(qt, r0, min(r0 + rows, n)), range(0, n, rows))
    return OutTensor(m.float_name, code, m.float_shape, chunks)


def read_windows(m: QuantModule) -> list[tuple[int, int]]:
    """The output rows a module is read in: whole when it holds at most WINDOW_ELEMENTS codes, else
    windows of about that many, on its family's row step (Family.read with rows), so memory is bounded
    by a window of codes, not by the module (a 16384 x 16384 4-bit layer: one 256 MiB window would be
    the whole; sixteen of 16 MiB are read instead)."""
    out, inp = m.out_features, m.in_features
    if out * inp <= WINDOW_ELEMENTS:
        return [(0, out)]
    step = family(m.family).row_step(m)
    per = max(step, WINDOW_ELEMENTS // max(1, inp) // step * step)
    return [(r0, min(out, r0 + per)) for r0 in range(0, out, per)]


def plan_component(comp: Component, det: Detection, code: str) -> list[OutTensor]:
    """Every output tensor, predicted from headers: quantized modules become `<module>.weight` of the
    target dtype (fused experts: the stored 3-D tensor's name and shape, QuantModule.float_name); their
    state is dropped; floating tensors are cast; the rest is copied. A model whose loaders read fused
    experts only gets per-expert weights fused (fused_experts.py)."""
    src_dtype = model_dtype(comp, det)
    out = {m.float_name: _dequantized(comp, det, m, code, src_dtype) for m in det.modules}
    claimed = det.claimed_tensors
    for name, info in comp.tensors.items():
        if name not in claimed:          # require_decodable refused a plain weight in a module's place
            out[name] = passthrough(info, code)
    out = fuse_experts(out, comp.config, comp.files[0] if comp.files else comp.path)
    return [out[k] for k in sorted(out, key=natural_key)]


def rewrite_config(config: dict, dtype: str) -> dict:
    cfg = without_quantization(config)

    def set_dtype(d: dict, top: bool):
        keys = [k for k in ("dtype", "torch_dtype") if k in d]
        for k in keys:
            d[k] = dtype
        if top and not keys:
            d["dtype"] = dtype
        for v in d.values():
            if isinstance(v, dict):
                set_dtype(v, False)
    set_dtype(cfg, True)
    return cfg


def _replan(comp: Component, code: str):
    """A --jobs worker's plan (parallel.Replan); dequantizing measures nothing."""
    return plan_component(comp, require_decodable(comp), code), None


def dequantize_component(comp: Component, out_dir: Path, dtype: str | None, max_shard: int, jobs: int = 1) -> dict:
    det = require_decodable(comp)
    target = dtype or model_dtype(comp, det)
    plan = plan_component(comp, det, FLOAT_CODES[target])
    config = rewrite_config(dict(comp.config), target) if comp.config is not None else None
    written = write_component(comp, out_dir, plan, config, max_shard, f"dequantizing {comp.name}", jobs=jobs,
                              replan=Replan(_replan, (FLOAT_CODES[target],)))
    return {"component": comp.name, "method": det.method, "dtype": target,
            "dequantized_modules": len(det.modules), **written,
            "warnings": list(det.warnings) + made_warnings(comp)}


def dequantize(src: Path, dst: Path, *, dtype: str | None = None, overwrite: bool = False,
               max_shard_size: int = DEFAULT_MAX_SHARD, jobs: int = 1, card: Card | None = None) -> dict:
    return run(src, dst, FolderSink(lambda comp, out: dequantize_component(comp, out, dtype, max_shard_size, jobs)),
               overwrite=overwrite, card=card)
