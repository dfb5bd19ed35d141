"""Where a conversion goes: the ``Sink`` every writing verb hands the engine (engine.run), which drives each
one the same way: open the source, take the components the sink writes, check everything before DST is
touched, stage, write each component (planned from headers, then streamed), read the result back where
asked, publish it by one rename, report.

A sink is what differs between outputs, and nothing else:

* ``FolderSink`` (here): a model folder, each component's safetensors shards, index and config.json
  (engine.write_component) with the source folder's other files carried along, a pipeline's other
  components and files copied as they are;
* a one-file container (llama.cpp's GGUF: one file, a split set, the mmproj file beside it) is a sink
  its family provides through the registry (``FileTarget.sink``; formats/gguf/sink.py), so nothing here
  names a format.

The copying plan of a folder (what is carried from SRC besides the converted weights) is the folder
sink's own and lives here too; engine.py imports it for write_component.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from ..errors import CorruptCheckpoint, UnsupportedFormat
from ..formats.core.reader import require_decodable
from ..formats.storage.checkpoint import QUANT_CONFIG_FILES, Component, SourceRoot, is_pickle, listing, plain_name
from ..formats.storage.safetensors_header import open_regular


class Sink(Protocol):
    """The steps engine.run calls, in this order, for every target."""

    files: bool      # DST is a file (and the files staged beside it), not a folder (staging.staged_output)

    def destination(self, src: Path, dst: Path) -> None:
        """Refuse a DST this sink cannot write, before the source is opened."""

    def components(self, target, src: Path) -> tuple[list[Component], "CopyPlan | None"]:
        """The components written (refusing a source it cannot take) and what else of SRC is carried."""

    def ready(self, comp: Component, dst: Path) -> None:
        """Everything a component's writing will read or replace checked, before DST is touched."""

    def place(self, tmp: Path, comp: Component, dst: Path, pipeline: bool) -> Path:
        """Where the component is staged, inside the staging folder tmp."""

    def write(self, comp: Component, out: Path) -> dict:
        """The component planned from headers, written streaming at out; its report."""

    def check(self, written: list[tuple[Component, Path, dict]], dst: Path) -> None:
        """The staged result read back (--validate) before it is published; raises to publish nothing."""


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


def _output_folder(tmp: Path, comp: Component) -> Path:
    """A pipeline component's output folder: a plain name, so it stays inside the staging folder."""
    if not plain_name(comp.name):
        raise CorruptCheckpoint(f"component {comp.name!r} is not a plain folder name; refusing to write "
                                f"it", file=comp.path)
    return tmp / comp.name


class FolderSink:
    """A model folder (a pipeline: a folder of component folders). ``convert(comp, out) -> report`` plans a
    component and streams its tensors and config into out (engine.write_component); ``validate(written)``,
    where given, reads the staged result back."""

    files = False

    def __init__(self, convert: Callable[[Component, Path], dict],
                 validate: Callable[[list[tuple[Component, Path, dict]]], object] | None = None):
        self._convert, self._validate = convert, validate

    def destination(self, src: Path, dst: Path) -> None:
        pass

    def components(self, target, src: Path) -> tuple[list[Component], CopyPlan]:
        """A plain model folder is one component; of a pipeline, the quantized ones (every component is
        checked: a float one with stray quantization data is refused, not copied), the rest copied."""
        if target.kind != "pipeline":
            return list(target.components), CopyPlan([], [], [])
        todo = [c for c in target.components if require_decodable(c).modules]
        if not todo:
            raise UnsupportedFormat("no component of this pipeline is quantized; there is nothing to "
                                    "convert or dequantize", file=src)
        return todo, plan_pipeline_copies(src, target.root, {c.name for c in todo})

    def ready(self, comp: Component, dst: Path) -> None:
        if comp.path.is_dir():              # refuse a bad file before any work, not after it
            plan_other_files(comp.path, comp.root)

    def place(self, tmp: Path, comp: Component, dst: Path, pipeline: bool) -> Path:
        return _output_folder(tmp, comp) if pipeline else tmp

    def write(self, comp: Component, out: Path) -> dict:
        return self._convert(comp, out)

    def check(self, written: list[tuple[Component, Path, dict]], dst: Path) -> None:
        if self._validate is not None:
            self._validate(written)
