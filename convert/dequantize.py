"""`qconv dequantize`: any supported checkpoint -> a standard unquantized folder.

Streaming: the output is planned from headers alone (names, dtypes, shapes, shards), then written
tensor by tensor; a quantized module is decoded on its own and dequantized a slab of rows at a time,
and plain tensors are converted a slab at a time, so memory is bounded by one module's codes plus one
slab, whatever the model size.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CorruptCheckpoint, OutputError
from ..formats.checkpoint import PICKLE_SUFFIXES, QUANT_CONFIG_FILES, Component, open_target
from ..formats.detect import Detection, detect
from ..formats.layout import natural_key
from ..formats.reader import model_dtype, read_module
from ..formats.safetensors_header import FLOAT_DTYPES, TensorInfo
from ..formats.safetensors_writer import ShardWriter, index_json, plan_shards
from ..formats.tensor_io import FLOAT_CODES, convert_float, encode_float, read_array
from .staging import staged_output

SLAB_BYTES = 4 << 20            # bytes of one slab of rows of a plain tensor
DEFAULT_MAX_SHARD = 5 * 10**9   # transformers' default max_shard_size ("5GB")


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    module: object = None       # QuantModule for a dequantized weight
    source: TensorInfo | None = None


def plan_component(comp: Component, det: Detection, code: str) -> list[OutTensor]:
    """Every output tensor, predicted from headers: quantized modules become `<module>.weight` of the
    target dtype; their state is dropped; floating tensors are cast; the rest is copied."""
    claimed = det.claimed_tensors
    out = {}
    for m in det.modules:
        out[m.name + ".weight"] = OutTensor(m.name + ".weight", code, (m.out_features, m.in_features), module=m)
    for name, info in comp.tensors.items():
        if name in claimed:
            continue
        if name in out:
            raise CorruptCheckpoint("a plain tensor has the name the dequantized weight needs",
                                    file=info.file, tensor=name)
        dtype = code if info.dtype in FLOAT_DTYPES else info.dtype
        out[name] = OutTensor(name, dtype, info.shape, source=info)
    return [out[k] for k in sorted(out, key=natural_key)]


def _rows_per_slab(info: TensorInfo) -> int:
    return max(1, SLAB_BYTES // max(1, info.nbytes // max(1, info.shape[0])))


_POOL: ThreadPoolExecutor | None = None


def _ordered(fn, items, depth: int = 4):
    """fn over items on a small thread pool (numpy and torch release the GIL), results in order, at
    most ``depth`` slabs in flight so memory stays bounded."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="qconv")
    pending: deque = deque()
    for item in items:
        pending.append(_POOL.submit(fn, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _chunks(t: OutTensor, comp, det, src_dtype_name):
    if t.module is not None:
        qt = read_module(comp, det, t.module, src_dtype_name)
        rows = qt.slab_rows()
        n = t.shape[0]
        yield from _ordered(lambda r0: encode_float(qt.dequantize_rows(r0, min(r0 + rows, n)), t.dtype),
                            range(0, n, rows))
        return
    info = t.source
    if len(info.shape) < 2 or info.shape[0] == 0:
        data = read_array(info)
        yield convert_float(data, info.dtype, t.dtype) if info.dtype in FLOAT_DTYPES else data
        return
    rows = _rows_per_slab(info)
    for r0 in range(0, info.shape[0], rows):
        data = read_array(info, rows=(r0, min(r0 + rows, info.shape[0])))
        yield convert_float(data, info.dtype, t.dtype) if info.dtype in FLOAT_DTYPES else data


def _weights_base(comp: Component) -> str:
    if comp.index_file is not None:
        return comp.index_file.name[: -len(".safetensors.index.json")]
    stem = comp.files[0].name[: -len(".safetensors")]
    return stem.split("-00")[0] if "-of-" in stem else stem


def rewrite_config(config: dict, dtype: str) -> dict:
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}

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


class Progress:
    def __init__(self, total: int, label: str):
        self.enabled = sys.stderr.isatty()
        self.total, self.done, self.label, self.t0 = max(total, 1), 0, label, time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        if self.enabled:
            pct = 100 * self.done / self.total
            rate = self.done / max(time.monotonic() - self.t0, 1e-6) / 1e9
            sys.stderr.write(f"\r{self.label}: {pct:5.1f}%  {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB"
                             f"  {rate:.2f} GB/s ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _copy_other_files(src: Path, dst: Path, skip: set[str]) -> list[str]:
    copied = []
    for p in sorted(src.iterdir()):
        if p.name in skip or p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json") \
                or p.suffix in PICKLE_SUFFIXES or p.name in QUANT_CONFIG_FILES:
            continue
        if p.is_file():
            shutil.copyfile(p, dst / p.name)
            copied.append(p.name)
    return copied


def dequantize_component(comp: Component, out_dir: Path, dtype: str | None, max_shard: int) -> dict:
    det = detect(comp)
    target = dtype or model_dtype(comp, det)
    code = FLOAT_CODES[target]
    plan = plan_component(comp, det, code)
    shards = plan_shards([(t.name, t.dtype, t.shape) for t in plan], max_shard, _weights_base(comp))
    by_name = {t.name: t for t in plan}
    src_dtype = model_dtype(comp, det)
    progress = Progress(sum(s.data_bytes for s in shards), f"dequantizing {comp.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    try:
        for shard in shards:
            writer = ShardWriter(out_dir, shard)
            try:
                for name, _, _ in shard.tensors:
                    n = writer.write_tensor(name, _chunks(by_name[name], comp, det, src_dtype))
                    written += n
                    progress.advance(n)
            except BaseException:
                writer.abort()
                raise
            writer.close()
    finally:
        progress.close()
    index = index_json(shards)
    if index is not None:
        (out_dir / f"{_weights_base(comp)}.safetensors.index.json").write_text(index)
    files = [s.filename for s in shards]
    if comp.config is not None:
        cfg = rewrite_config(dict(comp.config), target)
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    copied = _copy_other_files(comp.path, out_dir, {"config.json"}) if comp.path.is_dir() else []
    return {"component": comp.name, "method": det.method, "dtype": target,
            "dequantized_modules": len(det.modules), "tensors": len(plan), "shards": files,
            "bytes_written": written, "copied": copied, "warnings": list(det.warnings)}


def dequantize(src: Path, dst: Path, *, dtype: str | None = None, overwrite: bool = False,
               max_shard_size: int = DEFAULT_MAX_SHARD) -> dict:
    src, dst = Path(src), Path(dst)
    target = open_target(src)
    t0 = time.monotonic()
    with staged_output(src, dst, overwrite=overwrite) as tmp:
        reports = []
        if target.kind == "pipeline":
            done = set()
            for comp in target.components:
                det_method = detect(comp).method
                if det_method == "unquantized":
                    continue
                reports.append(dequantize_component(comp, tmp / comp.name, dtype, max_shard_size))
                done.add(comp.name)
            for p in sorted(src.iterdir()):
                if p.name in done:
                    continue
                if p.is_dir():
                    shutil.copytree(p, tmp / p.name, symlinks=True)
                elif p.is_file():
                    shutil.copyfile(p, tmp / p.name)
        else:
            reports.append(dequantize_component(target.components[0], tmp, dtype, max_shard_size))
    return {"source": str(src), "destination": str(dst), "seconds": round(time.monotonic() - t0, 3),
            "components": reports}
