"""The machinery every conversion shares: plan the output tensors from headers, write them shard by
shard as they are produced, copy the other files, and stage it all atomically (formats/storage/staging.py).

A conversion supplies, per component, the list of ``OutTensor``s (name, dtype, shape, and a producer
of its bytes, slab by slab) and the new config; this module does the rest the same way for all.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..errors import CorruptCheckpoint, UnsupportedFormat
from ..formats.storage.checkpoint import (QUANT_CONFIG_FILES, Component, SourceRoot, is_pickle, listing, open_target,
                                  plain_name)
from ..formats.core.reader import require_decodable
from ..formats.storage.safetensors_header import FLOAT_DTYPES, TensorInfo, open_regular
from ..formats.storage.safetensors_writer import DEFAULT_MAX_SHARD, ShardWriter, index_json, plan_shards  # noqa: F401
from ..formats.storage.tensor_io import plain_chunks
from ..progress import report
from .parallel import Replan, threads, write_shards
from ..formats.storage.staging import staged_output, test_hook



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
        _POOL = ThreadPoolExecutor(max(1, min(4, threads())), thread_name_prefix="qconv")
    pending: deque = deque()
    for item in items:
        pending.append(_POOL.submit(fn, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def passthrough(info: TensorInfo, dtype: str | None = None) -> OutTensor:
    target = dtype if dtype is not None and info.dtype in FLOAT_DTYPES else info.dtype
    return OutTensor(info.name, target, info.shape, lambda: plain_chunks(info, target))


class Progress:
    """Bytes written so far, as progress events to the caller's callback (progress.py); never printed here."""

    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = max(total, 1), 0, label

    def advance(self, n: int) -> None:
        self.done += n
        report(self.label, self.done, self.total, "bytes")

    def close(self) -> None:
        pass


def weights_base(comp: Component) -> str:
    """Keep the source's weight file name: model, diffusion_pytorch_model, ..."""
    if comp.index_file is not None:
        return comp.index_file.name[: -len(".safetensors.index.json")]
    if not comp.files[0].name.endswith(".safetensors"):       # a GGUF source
        return "model"
    stem = comp.files[0].name[: -len(".safetensors")]
    return stem.split("-00")[0] if "-of-" in stem else stem


# What is carried from SRC into DST besides the converted weights. Every file is copied by content
# (never as a link) from a path SourceRoot.check accepted: a regular file inside SRC (or a blob of
# the Hugging Face cache repository SRC is a snapshot of); a link out of SRC, a broken link, a FIFO,
# socket or device is refused before anything is written. Pickles are never carried: each one left
# out is named in the summary's warnings. Outputs are created with O_EXCL | O_NOFOLLOW, so nothing is
# ever written through a link.

@dataclass
class CopyPlan:
    files: list[tuple[Path, str]]            # (source file, path relative to the output folder)
    folders: list[str]                       # relative output folders to create, parents first
    left_out: list[str]                      # pickles not carried, relative to the source folder


def _is_own_file(name: str) -> bool:
    """Files of a converted folder that qconv writes itself (weights, index, config) or drops (the
    stand-alone quant configs, replaced by config.json's)."""
    return name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json")) \
        or name in QUANT_CONFIG_FILES


def plan_other_files(folder: Path, root: SourceRoot | None = None) -> CopyPlan:
    """The top-level files of a converted model folder to carry along (subfolders are not)."""
    root = root or SourceRoot.of(folder)
    plan = CopyPlan([], [], [])
    for p in listing(folder):
        if _is_own_file(p.name):
            continue
        if is_pickle(p.name):
            plan.left_out.append(p.name)
        elif not p.is_dir() and root.check(p) == "file":
            plan.files.append((p, p.name))
    return plan


def _plan_tree(folder: Path, rel: str, root: SourceRoot, plan: CopyPlan, seen: frozenset) -> None:
    real = os.path.realpath(folder)
    if real in seen:
        raise CorruptCheckpoint("is a link to a folder that contains it (a loop); refusing to follow it",
                                file=folder)
    plan.folders.append(rel)
    for p in listing(folder):
        sub = f"{rel}/{p.name}"
        if is_pickle(p.name):
            plan.left_out.append(sub)
            continue
        kind = root.check(p)
        if kind == "dir":
            _plan_tree(p, sub, root, plan, seen | {real})
        elif kind == "file":
            plan.files.append((p, sub))


def plan_pipeline_copies(src: Path, root: SourceRoot, converted: set[str]) -> CopyPlan:
    """Everything of a pipeline but its converted components: files and whole folders, by content."""
    plan = CopyPlan([], [], [])
    for p in listing(src):
        if p.name in converted:
            continue
        if is_pickle(p.name):
            plan.left_out.append(p.name)
            continue
        kind = root.check(p)
        if kind == "dir":
            _plan_tree(p, p.name, root, plan, frozenset({os.path.realpath(src)}))
        elif kind == "file":
            plan.files.append((p, p.name))
    return plan


def copy_file(src: Path, dst: Path) -> None:
    """Copy the content of regular file ``src`` to the new file ``dst`` (never through a link)."""
    with open_regular(src) as fin:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0), 0o666)
        with os.fdopen(fd, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)


def carry(plan: CopyPlan, out: Path) -> None:
    for rel in plan.folders:
        os.mkdir(out / rel)
    for src, rel in plan.files:
        copy_file(src, out / rel)


def copy_other_files(src: Path, dst: Path, root: SourceRoot | None = None) -> list[str]:
    """Every top-level file but the weights, the index, config.json (rewritten), stand-alone quant
    configs (replaced by config.json's) and pickles (never carried along)."""
    plan = plan_other_files(src, root)
    carry(plan, dst)
    return [rel for _, rel in plan.files]


def _left_out_warning(names: list[str]) -> str:
    return (f"left out {len(names)} pickle file(s), which qconv never carries into an output: "
            f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''}")


def write_shard(out_dir: Path, shard, by_name: dict, written: Callable[[int], None]) -> None:
    """One planned shard, tensor by tensor in plan order; ``written(n)`` after each tensor."""
    writer = ShardWriter(out_dir, shard)
    try:
        for name, _, _ in shard.tensors:
            written(writer.write_tensor(name, by_name[name].chunks()))
    except BaseException:
        writer.abort()
        raise
    writer.close()


def made_warnings(comp: Component) -> list[str]:
    """A container's own warnings about the files it rebuilds (a GGUF whose tokenizer qconv does not
    rebuild): said by every verb that writes a folder from it."""
    return list(comp.warnings) if comp.made_files is not None else []


def write_component(comp: Component, out_dir: Path, tensors: list[OutTensor], config: dict | None,
                    max_shard: int, label: str, *, jobs: int = 1, replan: Replan | None = None,
                    state=None, base: str | None = None) -> dict:
    """Write the planned tensors as shards (in worker processes where jobs > 1, there is more than one
    shard and ``replan`` says how a worker rebuilds this plan: parallel.py), then the index, config.json
    and the other files of the source folder. comp None (a GGUF source): no source folder, base names
    the shards."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise AssertionError("duplicate output tensor names")
    # a container's rebuilt files (a GGUF's tokenizer), before any shard: one it cannot rebuild is refused first
    made = comp.made_files() if comp is not None and comp.made_files is not None else {}
    base = base or weights_base(comp)            # a GGUF source names no safetensors file: "model"
    shards = plan_shards([(t.name, t.dtype, t.shape) for t in tensors], max_shard, base)
    by_name = {t.name: t for t in tensors}
    progress = Progress(sum(s.data_bytes for s in shards), label)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = 0

    def advance(n: int) -> None:
        nonlocal written
        written += n
        progress.advance(n)
        test_hook("tensor-written")

    try:
        if replan is not None and min(jobs, len(shards)) > 1:
            write_shards(comp, out_dir, shards, replan, min(jobs, len(shards)), advance, state, write_shard)
        else:
            for shard in shards:
                write_shard(out_dir, shard, by_name, advance)
    finally:
        progress.close()
    index = index_json(shards)
    if index is not None:
        (out_dir / f"{base}.safetensors.index.json").write_text(index)
    if config is not None:
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    carried = plan_other_files(comp.path, comp.root) if comp is not None and comp.path.is_dir() \
        else CopyPlan([], [], [])
    carry(carried, out_dir)
    for name, doc in made.items():
        (out_dir / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    return {"shards": [s.filename for s in shards], "tensors": len(tensors), "bytes_written": written,
            "copied": [rel for _, rel in carried.files] + sorted(made), "left_out": carried.left_out}


def _output_folder(tmp: Path, comp: Component) -> Path:
    """A pipeline component's output folder: a plain name, so it stays inside the staging folder."""
    if not plain_name(comp.name):
        raise CorruptCheckpoint(f"component {comp.name!r} is not a plain folder name; refusing to write "
                                f"it", file=comp.path)
    return tmp / comp.name


def run(src: Path, dst: Path, convert_component: Callable[[Component, Path], dict], *,
        overwrite: bool, check: Callable[[list[tuple[Component, Path, dict]]], None] | None = None) -> dict:
    """Open SRC, convert each quantized component into a staged DST (a plain model folder is one
    component; a pipeline's unquantized components are copied as they are), then publish DST.
    Everything that will be read or copied is checked before DST is touched."""
    src, dst = Path(src), Path(dst)
    target = open_target(src)
    t0 = time.monotonic()
    if target.kind == "pipeline":
        # every component is checked: a float one with stray quantization data is refused, not copied
        todo = [c for c in target.components if require_decodable(c).modules]
        if not todo:
            raise UnsupportedFormat("no component of this pipeline is quantized; there is nothing to "
                                    "convert or dequantize", file=src)
        pipeline_plan = plan_pipeline_copies(src, target.root, {c.name for c in todo})
    else:
        todo, pipeline_plan = list(target.components), CopyPlan([], [], [])
    for comp in todo:                        # refuse a bad file before any work, not after it
        if comp.path.is_dir():
            plan_other_files(comp.path, comp.root)
    with staged_output(src, dst, overwrite=overwrite) as tmp:
        reports, written = [], []
        for comp in todo:
            out = _output_folder(tmp, comp) if target.kind == "pipeline" else tmp
            report = convert_component(comp, out)
            if report.get("left_out"):
                report.setdefault("warnings", []).append(_left_out_warning(report["left_out"]))
            reports.append(report)
            written.append((comp, out, report))
        carry(pipeline_plan, tmp)
        if check is not None:            # before the rename: a result that fails never reaches DST
            check(written)
    result = {"source": str(src), "destination": str(dst), "seconds": round(time.monotonic() - t0, 3),
              "components": reports}
    if target.kind == "pipeline":
        result["left_out"] = pipeline_plan.left_out
        result["warnings"] = [_left_out_warning(pipeline_plan.left_out)] if pipeline_plan.left_out else []
    return result
