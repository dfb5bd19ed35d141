"""`--to gguf`'s sink: llama.cpp's one-file container as the destination convert's engine writes into
(convert/engine.py run, the same path as a folder target's: open, check, stage, write, read back, publish,
report; convert/sink.py has the steps). The family provides it through the registry (``FileTarget.sink``),
so the engine never names GGUF.

What a GGUF output is, beside a folder: DST is a file, named ``*.gguf``, staged in a temporary folder beside
it and moved there whole (staging.staged_output(files=True)); past --max-shard-size it is a split set
(``NAME-0000i-of-0000N.gguf``, gguf-py's split writer, as llama.cpp's loader finds it from the first); a VL
model's vision tower is a second file of the same output, ``mmproj-NAME.gguf`` beside it (mmproj.py). Both
files are written the same way (write_file): the metadata and every tensor's header first, as planned
from headers, then each tensor's bytes as they are encoded. What is written is writer.py's and mmproj.py's
(their plans, encodings, reports and read-back checks).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ...errors import OutputError, UnsupportedFormat, UsageError
from ..core.request import Options
from ..core.tally import Tally
from ..storage.checkpoint import Component
from ..storage.staging import test_hook
from . import arch as garch
from . import mmproj, writer
from .header import looks_like_gguf

_STORED = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}     # block types: bytes (uint8)


def write_file(path: Path, arch: str, keys: list, tensors: list, data: Callable[[list], Iterable],
               split_max: int = 0) -> tuple[list[Path], int]:
    """One GGUF file at path (a split set past split_max bytes of tensors: gguf-py's splitting): the
    metadata keys (key, type, value), every tensor's header (objects with name, type_name, shape as
    stored, nbytes), then their bytes, ``data(tensors in the order written)`` yielding each one's arrays
    in turn. (the files written, the tensors' bytes)"""
    import gguf

    out = gguf.GGUFWriter(path, arch, split_max_size=split_max)
    for key, kind, value in keys:
        garch.add_key(out, key, kind, value)
    for t in tensors:
        out.add_tensor_info(t.name, t.shape, np.dtype(_STORED.get(t.type_name, np.uint8)), t.nbytes,
                            raw_dtype=None if t.type_name in ("F32", "F16") else
                            getattr(gguf.GGMLQuantizationType, t.type_name))
    shards = [list(names) for names in out.tensors]    # tensor names per file, in write order
    files = out.format_shard_names(path)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_ti_data_to_file()
    by_name = {t.name: t for t in tensors}
    order = [(fout, by_name[name]) for fout, names in zip(out.fout, shards) for name in names]
    written = 0
    for (fout, t), chunks in zip(order, data([t for _, t in order])):
        out.write_padding(fout, fout.tell())
        n = 0
        for chunk in chunks:
            b = np.ascontiguousarray(chunk)
            fout.write(b.tobytes() if b.ndim == 0 else memoryview(b).cast("B"))
            n += b.nbytes
        if n != t.nbytes:
            raise AssertionError(f"{t.name}: wrote {n} bytes, planned {t.nbytes}")
        out.write_padding(fout, n)
        written += n
        test_hook("tensor-written")
    out.close()
    return files, written


def _ahead(outs: list, jobs: int):
    """Each tensor's chunks, in order. With jobs > 1 the quantized modules (read, decoded, encoded: numpy
    work that leaves the GIL) are made in threads up to `jobs` tensors ahead of the one being written, so
    memory stays bounded by that window of modules; float tensors stream slab by slab as they are
    written. The bytes are the same whatever jobs."""
    if jobs <= 1:
        yield from (o.chunks() for o in outs)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs, thread_name_prefix="qconv-gguf") as pool:
        pending = {}
        try:
            for i, o in enumerate(outs):
                for j in range(i, min(i + jobs + 1, len(outs))):
                    if j not in pending and outs[j].kept is not None:
                        pending[j] = pool.submit(lambda o=outs[j]: list(o.chunks()))
                yield pending.pop(i).result() if i in pending else o.chunks()
        finally:
            for f in pending.values():
                f.cancel()


def _check_not_a_source_file(comp: Component, dst: Path) -> None:
    """DST and the split files it may become (NAME-0000i-of-0000N.gguf) are none of a GGUF source's files,
    the later files of a split source included (staging checks only SRC itself)."""
    if not comp.path.is_file():
        return
    here = dst.absolute().parent.resolve()
    mine = re.compile(re.escape(dst.stem) + r"-\d{5}-of-\d{5}\.gguf")
    for f in comp.files:
        f = f.resolve()
        if f.parent == here and (f.name == dst.name or mine.fullmatch(f.name)):
            raise OutputError(f"would replace {f.name}, a file of the source; write the output somewhere else",
                              file=dst)


class GGUFSink:
    """convert/sink.py's steps for `--to gguf`: one model folder or GGUF file in, one GGUF file (a split
    set past max_shard bytes, the mmproj file beside it) out."""

    files = True

    def __init__(self, opts: Options, *, max_shard: int, jobs: int = 1, validate: bool = False):
        self.opts, self.max_shard, self.jobs, self.validate = opts, max_shard, jobs, validate
        self._vision: dict[str, tuple] = {}            # component -> (its detection, the mmproj file's plan), for check

    def destination(self, src: Path, dst: Path) -> None:
        if dst.suffix != ".gguf":
            raise UsageError("--to gguf writes one .gguf file: give DST a name ending in .gguf", file=dst)

    def components(self, target, src: Path) -> tuple[list[Component], None]:
        if target.kind == "pipeline" or len(target.components) != 1 or (
                target.kind == "file" and not looks_like_gguf(src)):
            names = ", ".join(f"{src / c.name}" for c in target.components) if target.kind == "pipeline" else ""
            raise UnsupportedFormat("--to gguf converts one model folder or GGUF file (a pipeline's language "
                                    f"model: give its folder{': ' + names if names else ''})", file=src)
        return list(target.components), None

    def ready(self, comp: Component, dst: Path) -> None:
        _check_not_a_source_file(comp, dst)

    def place(self, tmp: Path, comp: Component, dst: Path, pipeline: bool) -> Path:
        return tmp / dst.name

    def write(self, comp: Component, out: Path) -> dict:
        """Planned from headers (the text model and its tower, every refusal before a byte is written), the
        text GGUF streamed at out, then the mmproj file beside it; the component's report."""
        tally = Tally()
        det, outs, kv = writer.plan(comp, self.opts, tally)
        vision = writer.vision_of(comp, det, self.opts)
        # gguf-py warns of a split it skips: none below max_shard
        split = self.max_shard if sum(o.nbytes for o in outs) > self.max_shard else 0
        files, written = write_file(out, writer.arch_of(comp).name, writer.header_keys(comp, kv, outs), outs,
                                    lambda order: _ahead(order, self.jobs), split)
        summary = tally.summary()
        if isinstance(vision, tuple):                  # the vision tower: llama.cpp's mmproj file beside DST
            self._vision[comp.name] = (det, vision)
            summary["mmproj"] = self._mmproj(comp, det, out.parent / mmproj.mmproj_name(out), vision)
        return writer.report(comp, det, self.opts, outs, summary, vision, files, written)

    @staticmethod
    def _mmproj(comp: Component, det, path: Path, vision: tuple) -> dict:
        keys, tensors = mmproj.header(comp, vision)
        found = mmproj.Encoded()
        write_file(path, "clip", keys, tensors, lambda order: mmproj.encoded(comp, det, vision, found))
        return mmproj.report(path, vision, found)

    def check(self, written: list[tuple[Component, Path, dict]], dst: Path) -> None:
        """--validate: each file read back with gguf-py (writer.check, mmproj.check) before it is published."""
        if not self.validate:
            return
        for comp, out, report in written:
            report["validation"] = writer.check(comp, [out.parent / f for f in report["shards"]], report, dst)
            if "mmproj" in report:
                det, vision = self._vision[comp.name]
                report["mmproj"]["validation"] = mmproj.check(comp, det, out.parent / report["mmproj"]["file"], vision,
                                                              report["mmproj"], dst)
