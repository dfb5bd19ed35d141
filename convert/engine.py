"""The machinery every conversion shares: ``run``, the one path every target takes (open, check, stage,
write each component into its sink, read back, publish atomically through formats/storage/staging.py,
report; the sink is sink.py's: a folder, or a one-file container its family provides), and a folder's
writing: the output tensors planned from headers, written shard by shard as they are produced, the
other files copied.

A folder conversion supplies, per component, the list of ``OutTensor``s (name, dtype, shape, and a
producer of its bytes, slab by slab) and the new config; write_component does the rest the same way for all.
"""

from __future__ import annotations

import json
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..formats.storage.checkpoint import Component, open_target
from ..formats.storage.safetensors_header import FLOAT_DTYPES, TensorInfo
from ..formats.storage.safetensors_writer import DEFAULT_MAX_SHARD, ShardWriter, index_json, plan_shards  # noqa: F401
from ..formats.storage.tensor_io import plain_chunks
from ..progress import report
from .parallel import Replan, threads, write_shards
from .sink import CopyPlan, Sink, carry, plan_other_files
from ..formats.storage.staging import check_file_free, staged_output, test_hook
from .card import Card



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


def run(src: Path, dst: Path, sink: Sink, *, overwrite: bool, card: Card | None = None,
        check: Callable[[Path, Path], dict] | None = None) -> dict:
    """Every target's one path: open SRC, take the components the sink writes (a pipeline's unquantized
    components and other files are carried as they are), check everything that will be read, copied or
    replaced before DST is touched, then write each component into the staged DST, read the result back
    where asked (before the rename: a result that fails never reaches DST), run the model-level check where
    given (check(SRC, the staged result): --check-model, model_check/), write the model card (card.py) from
    the report, publish, report."""
    src, dst = Path(src), Path(dst)
    sink.destination(src, dst)
    if card is not None and sink.files:          # <name>.md beside a one-file DST: refused before any work
        for beside in (card.path(dst, True), card.picture(dst, True)):
            if beside is not None:
                check_file_free(beside, overwrite=overwrite)
    target = open_target(src)
    t0 = time.monotonic()
    todo, copied = sink.components(target, src)
    copied = copied or CopyPlan([], [], [])
    for comp in todo:                        # refuse a bad file before any work, not after it
        sink.ready(comp, dst)
    source = card.source(src, target.kind == "pipeline", [f for c in todo for f in c.files]) if card else None
    with staged_output(src, dst, overwrite=overwrite, files=sink.files) as tmp:
        reports, written = [], []
        for comp in todo:
            out = sink.place(tmp, comp, dst, target.kind == "pipeline")
            report = sink.write(comp, out)
            if report.get("left_out"):
                report.setdefault("warnings", []).append(_left_out_warning(report["left_out"]))
            reports.append(report)
            written.append((comp, out, report))
        carry(copied, tmp)
        sink.check(written, dst)
        result = {"source": str(src), "destination": str(dst), "components": reports}
        if target.kind == "pipeline":
            result["left_out"] = copied.left_out
            result["warnings"] = [_left_out_warning(copied.left_out)] if copied.left_out else []
        if check is not None and written:
            result["model_check"] = check(src, written[0][1])
        if card is not None:
            result["card"] = card.write(tmp, src, dst, sink.files, source, result)
    result["seconds"] = round(time.monotonic() - t0, 3)
    return result
