"""The machinery every conversion shares: plan the output tensors from headers, write them shard by
shard as they are produced, copy the other files, and stage it all atomically (staging.py).

A conversion supplies, per component, the list of ``OutTensor``s (name, dtype, shape, and a producer
of its bytes, slab by slab) and the new config; this module does the rest the same way for all.
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
from typing import Callable, Iterable

import numpy as np

from ..formats.checkpoint import PICKLE_SUFFIXES, QUANT_CONFIG_FILES, Component, open_target
from ..formats.detect import detect
from ..formats.safetensors_header import FLOAT_DTYPES, TensorInfo
from ..formats.safetensors_writer import ShardWriter, index_json, plan_shards
from ..formats.tensor_io import convert_float, read_array
from .staging import staged_output

SLAB_BYTES = 4 << 20            # bytes of one slab of rows of a plain tensor
DEFAULT_MAX_SHARD = 5 * 10**9   # transformers' default max_shard_size ("5GB")


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str                                  # safetensors dtype code
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[np.ndarray]]  # the stored bytes, in order, slab by slab


_POOL: ThreadPoolExecutor | None = None


def ordered(fn, items, depth: int = 4):
    """fn over items on a small thread pool (numpy and torch release the GIL), results in order, at
    most ``depth`` in flight so memory stays bounded."""
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


def plain_chunks(info: TensorInfo, dtype: str):
    """A stored tensor, slab by slab, cast to ``dtype`` when both are floating point."""
    def cast(data):
        return convert_float(data, info.dtype, dtype) if info.dtype in FLOAT_DTYPES and dtype != info.dtype else data

    if len(info.shape) < 2 or info.shape[0] == 0:
        yield cast(read_array(info))
        return
    rows = max(1, SLAB_BYTES // max(1, info.nbytes // info.shape[0]))
    for r0 in range(0, info.shape[0], rows):
        yield cast(read_array(info, rows=(r0, min(r0 + rows, info.shape[0]))))


def passthrough(info: TensorInfo, dtype: str | None = None) -> OutTensor:
    target = dtype if dtype is not None and info.dtype in FLOAT_DTYPES else info.dtype
    return OutTensor(info.name, target, info.shape, lambda: plain_chunks(info, target))


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


def weights_base(comp: Component) -> str:
    """Keep the source's weight file name: model, diffusion_pytorch_model, ..."""
    if comp.index_file is not None:
        return comp.index_file.name[: -len(".safetensors.index.json")]
    stem = comp.files[0].name[: -len(".safetensors")]
    return stem.split("-00")[0] if "-of-" in stem else stem


def copy_other_files(src: Path, dst: Path) -> list[str]:
    """Every top-level file but the weights, the index, config.json (rewritten), stand-alone quant
    configs (replaced by config.json's) and pickles (never carried along)."""
    copied = []
    for p in sorted(src.iterdir()):
        if p.name == "config.json" or p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json") \
                or p.suffix in PICKLE_SUFFIXES or p.name in QUANT_CONFIG_FILES:
            continue
        if p.is_file():
            shutil.copyfile(p, dst / p.name)
            copied.append(p.name)
    return copied


def write_component(comp: Component, out_dir: Path, tensors: list[OutTensor], config: dict | None,
                    max_shard: int, label: str) -> dict:
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise AssertionError("duplicate output tensor names")
    shards = plan_shards([(t.name, t.dtype, t.shape) for t in tensors], max_shard, weights_base(comp))
    by_name = {t.name: t for t in tensors}
    progress = Progress(sum(s.data_bytes for s in shards), label)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    try:
        for shard in shards:
            writer = ShardWriter(out_dir, shard)
            try:
                for name, _, _ in shard.tensors:
                    n = writer.write_tensor(name, by_name[name].chunks())
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
        (out_dir / f"{weights_base(comp)}.safetensors.index.json").write_text(index)
    if config is not None:
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copied = copy_other_files(comp.path, out_dir) if comp.path.is_dir() else []
    return {"shards": [s.filename for s in shards], "tensors": len(tensors), "bytes_written": written,
            "copied": copied}


def run(src: Path, dst: Path, convert_component: Callable[[Component, Path], dict], *,
        overwrite: bool, check: Callable[[list[tuple[Component, Path, dict]]], None] | None = None) -> dict:
    """Open SRC, convert each quantized component into a staged DST (a plain model folder is one
    component; a pipeline's unquantized components are copied as they are), then publish DST."""
    src, dst = Path(src), Path(dst)
    target = open_target(src)
    t0 = time.monotonic()
    with staged_output(src, dst, overwrite=overwrite) as tmp:
        reports, written = [], []
        if target.kind == "pipeline":
            done = set()
            for comp in target.components:
                if detect(comp).method == "unquantized":
                    continue
                reports.append(convert_component(comp, tmp / comp.name))
                written.append((comp, tmp / comp.name, reports[-1]))
                done.add(comp.name)
            for p in sorted(src.iterdir()):
                if p.name in done:
                    continue
                if p.is_dir():
                    shutil.copytree(p, tmp / p.name, symlinks=True)
                elif p.is_file():
                    shutil.copyfile(p, tmp / p.name)
        else:
            reports.append(convert_component(target.components[0], tmp))
            written.append((target.components[0], tmp, reports[-1]))
        if check is not None:            # before the rename: a result that fails never reaches DST
            check(written)
    return {"source": str(src), "destination": str(dst), "seconds": round(time.monotonic() - t0, 3),
            "components": reports}
