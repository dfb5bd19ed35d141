"""Find what a path holds: a model folder, a single safetensors file, or a diffusers-style pipeline.

Reads only JSON files and safetensors headers. The shard index is validated the way a loader would
use it: shard names may not leave the folder, every shard must exist, and every tensor the index maps
must be in the shard it names. Pickle weights (.bin/.pt/.pth/.ckpt) are never opened.

Nothing outside SRC is read (``SourceRoot``): SRC itself may be a link, but every file or folder
reached from it must resolve inside it, with one exception, the Hugging Face cache, whose snapshot
files are links to ``../../blobs/<hash>``: when SRC lies in ``models--*/snapshots/<rev>``, links to
regular files directly in that repository's ``blobs`` folder are read as the files they stand for.
Anything else that resolves outside SRC, a dangling link, and anything that is not a regular file or
folder (FIFO, socket, device) is refused with one line naming it, before it is opened. Pipeline
component names from model_index.json must be plain folder names.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from ...errors import CorruptCheckpoint, InputNotFound
from .safetensors_header import Header, TensorInfo, file_kind, open_regular, read_header

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".pk", ".joblib")
# Stand-alone quantization configs, read where config.json has no quantization_config and never carried
# into an output (hf_quant_config.json: NVIDIA ModelOpt's, which vLLM also detects ModelOpt by).
QUANT_CONFIG_FILES = ("quantize_config.json", "quantization_config.json", "hf_quant_config.json")
MAX_JSON_BYTES = 64 << 20
_HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def is_pickle(name: str) -> bool:
    """A file name pickles are stored under (never opened, never carried into an output)."""
    return os.path.splitext(name)[1].lower() in PICKLE_SUFFIXES


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


@dataclass(frozen=True)
class SourceRoot:
    """Where the files of one source may live: its folder (resolved), and the blob store of the
    Hugging Face cache repository it is a snapshot of, if it is one."""

    folder: Path
    blobs: Path | None = None

    @classmethod
    def of(cls, path: str | os.PathLike) -> "SourceRoot":
        real = Path(os.path.realpath(path))
        for parent in real.parents:
            if parent.name == "snapshots" and parent.parent.name.startswith(_HF_REPO_PREFIXES) \
                    and (parent.parent / "blobs").is_dir():
                return cls(real, parent.parent / "blobs")
        return cls(real)

    def allows_file(self, real: Path) -> bool:
        return _inside(real, self.folder) or (self.blobs is not None and real.parent == self.blobs)

    def check(self, path: Path, what: str | None = None) -> str | None:
        """What ``path`` is, before anything reads or copies it: "file" (a regular file qconv may
        read), "dir" (a folder inside SRC), or None (nothing there). Anything else is refused."""
        prefix = f"{what} " if what else ""
        try:
            lst = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CorruptCheckpoint(f"cannot read{' ' + what if what else ''}: {exc.strerror or exc}",
                                    file=path) from None
        link = stat.S_ISLNK(lst.st_mode)
        real = Path(os.path.realpath(path))
        try:
            st = os.stat(path) if link else lst
        except OSError:
            raise CorruptCheckpoint(f"{prefix}is a link to {os.readlink(path)!r}, which does not exist "
                                    f"(a broken or looping link)", file=path) from None
        target = f"a link to {str(real)!r}, which is " if link else ""
        if stat.S_ISDIR(st.st_mode):
            if not _inside(real, self.folder):
                how = f"is a link to {str(real)!r}," if link else f"resolves to {str(real)!r},"
                raise CorruptCheckpoint(f"{prefix}{how} a folder outside the source folder; qconv reads "
                                        f"nothing outside SRC", file=path)
            return "dir"
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpoint(f"{prefix}is {target}{file_kind(st.st_mode)}, not a regular file; "
                                    f"qconv reads only regular files", file=path)
        if not self.allows_file(real):
            raise CorruptCheckpoint(f"{prefix}is a link that resolves outside the source folder (to "
                                    f"{str(real)!r}); qconv reads nothing outside SRC: copy the file "
                                    f"in, or run qconv on the folder that holds it", file=path)
        return "file"


def plain_name(name: object) -> bool:
    """A single folder name: not empty, not '.' or '..', no separator, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\x00" not in name and not os.path.isabs(name))


@dataclass(frozen=True)
class Component:
    """One set of weights: a model folder, one file, or one subfolder of a pipeline."""

    name: str
    path: Path
    files: tuple[Path, ...]                  # the safetensors files, in a stable order
    headers: Mapping[Path, Header]
    tensors: Mapping[str, TensorInfo]        # every tensor, merged over shards
    config: Mapping | None = None            # config.json
    side_configs: Mapping[str, Mapping] = field(default_factory=dict)  # quantize_config.json, ...
    index_file: Path | None = None
    warnings: tuple[str, ...] = ()
    root: SourceRoot | None = None           # where its files may live (None: a single file)
    # tensors stored in a second shard besides the one the index maps them to: (name, mapped, other)
    duplicates: tuple[tuple[str, str, str], ...] = ()
    # a container with no folder to carry files from (a GGUF): () -> {file name: JSON document} a folder
    # written from it gets (its tokenizer.json / tokenizer_config.json); picklable, for --jobs workers
    made_files: Callable[[], Mapping[str, object]] | None = None
    # config keys as the source names them where config is not its config.json (a GGUF's metadata keys)
    config_names: Mapping[str, str] = field(default_factory=dict)

    @property
    def bytes_on_disk(self) -> int:
        return sum(h.file_size for h in self.headers.values())


@dataclass(frozen=True)
class Target:
    path: Path
    kind: str                                # "model", "file" or "pipeline"
    components: tuple[Component, ...]
    root: SourceRoot | None = None           # None for a single file


def load_json(path: Path, *, what: str = "JSON file") -> object:
    """Parse a JSON file: a regular file only (open_regular), and never more than MAX_JSON_BYTES read
    whatever its size claims."""
    try:
        with open_regular(path, what=what) as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise CorruptCheckpoint(f"{what} is over {MAX_JSON_BYTES} bytes, larger than any real one",
                                    file=path)
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise CorruptCheckpoint(f"{what} is not valid JSON ({reason})", file=path) from None
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read {what}: {exc.strerror or exc}", file=path) from None


def _load_json_object(path: Path, what: str) -> dict:
    doc = load_json(path, what=what)
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"{what} must be a JSON object, found {type(doc).__name__}", file=path)
    return doc


@dataclass(frozen=True)
class Container:
    """A one-file model format other than safetensors (llama.cpp's GGUF), declared by its family:
    ``sniff(path) -> bool`` from the first bytes, ``open(path) -> Component`` (headers only), and for
    inspect its own header-only report: ``describe(path) -> {"kind": name, name: ..., "warnings": [...]}``
    and ``render(report) -> text``."""
    name: str
    sniff: Callable
    open: Callable
    describe: Callable | None = None
    render: Callable | None = None


_CONTAINERS: dict[str, Container] = {}


def register_container(entry: Container) -> Container:
    _CONTAINERS[entry.name] = entry
    return entry


def container_named(name: str) -> Container | None:
    return _CONTAINERS.get(name)


def container_of(path: str | os.PathLike) -> Container | None:
    """The registered container a file is (None: none is)."""
    path = Path(path)
    if not path.is_file() or path.suffix == ".safetensors":
        return None
    return next((c for c in _CONTAINERS.values() if c.sniff(path)), None)


def open_target(path: str | os.PathLike) -> Target:
    path = Path(path)
    if not path.exists():
        raise InputNotFound("no such file or folder", file=path)
    if path.is_file():
        if path.suffix != ".safetensors":
            container = container_of(path)
            if container is not None:                  # llama.cpp's GGUF: gguf/source.py
                return Target(path, "file", (container.open(path),))
            if path.suffix in PICKLE_SUFFIXES:
                raise InputNotFound(_PICKLE_HINT, file=path)
            raise InputNotFound("not a .safetensors file or a model folder", file=path)
        header = read_header(path)
        comp = Component(name=path.name, path=path, files=(path,), headers={path: header},
                         tensors=dict(header.tensors))
        return Target(path, "file", (comp,))
    if not path.is_dir():
        raise InputNotFound("not a regular file or folder", file=path)

    root = SourceRoot.of(path)
    index = path / "model_index.json"
    if root.check(index, "model_index.json") == "file":
        return Target(path, "pipeline", tuple(_open_pipeline(path, index, root)), root)
    return Target(path, "model", (open_component(path, path.resolve().name or str(path), root),), root)


_PICKLE_HINT = ("holds only pickle weights, which qconv never loads (unpickling runs arbitrary code); "
                "convert them to safetensors with a tool you trust, then run qconv on the result")


def _open_pipeline(folder: Path, index: Path, root: SourceRoot) -> list[Component]:
    doc = _load_json_object(index, "model_index.json")
    components = []
    for key in sorted(doc):
        value = doc[key]
        if key.startswith("_") or not isinstance(value, list):
            continue
        if not plain_name(key):
            raise CorruptCheckpoint(f"component {key!r} is not a plain folder name inside the pipeline "
                                    f"(no '/', '..' or absolute paths); refusing it", file=index)
        sub = folder / key
        if root.check(sub, "component folder") != "dir":
            continue
        if _weight_files(sub, root) or _pickle_files(sub):
            components.append(open_component(sub, key, root))
    if not components:
        raise InputNotFound("pipeline (model_index.json) has no component folder holding weights",
                            file=folder)
    return components


def listing(folder: Path) -> list[Path]:
    """A folder's entries, sorted; an unreadable folder is a one-line refusal naming it."""
    try:
        return sorted(folder.iterdir())
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot list the folder: {exc.strerror or exc}", file=folder) from None


def _weight_files(folder: Path, root: SourceRoot) -> list[Path]:
    return [p for p in listing(folder) if p.suffix == ".safetensors" and root.check(p) == "file"]


def _pickle_files(folder: Path) -> list[Path]:
    return [p for p in listing(folder) if is_pickle(p.name) and p.is_file()]


def _read_configs(folder: Path, root: SourceRoot) -> tuple[dict | None, dict[str, dict]]:
    config = None
    cfg_path = folder / "config.json"
    if root.check(cfg_path) == "file":
        config = _load_json_object(cfg_path, "config.json")
        qc = config.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise CorruptCheckpoint("quantization_config must be a JSON object, found "
                                    f"{type(qc).__name__}", file=cfg_path)
    side = {}
    for fname in QUANT_CONFIG_FILES:
        p = folder / fname
        if root.check(p) == "file":
            side[fname] = _load_json_object(p, fname)
    return config, side


def _check_shard_name(folder: Path, index_path: Path, shard: object, tensor: str,
                      root: SourceRoot) -> Path:
    if not isinstance(shard, str) or not shard or "\x00" in shard:
        raise CorruptCheckpoint(f"weight_map entry names no valid shard ({shard!r})",
                                file=index_path, tensor=tensor)
    candidate = Path(shard)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise CorruptCheckpoint(f"weight_map points outside the folder ({shard!r}); refusing to "
                                f"follow it", file=index_path, tensor=tensor)
    full = folder / candidate
    if not root.allows_file(Path(os.path.realpath(full))):
        raise CorruptCheckpoint(f"shard {shard!r} resolves outside the folder (a link?); refusing "
                                f"to follow it", file=index_path, tensor=tensor)
    if root.check(full, "shard") != "file":
        raise CorruptCheckpoint(f"weight_map names shard {shard!r}, which does not exist",
                                file=index_path, tensor=tensor)
    return full


def open_component(folder: Path, name: str, root: SourceRoot | None = None) -> Component:
    """Open one model folder: configs, shard index (if any) and every safetensors header. ``root``:
    where its files may live (default: the folder itself, or its Hugging Face cache repository)."""
    root = root or SourceRoot.of(folder)
    entries = listing(folder)
    if not entries:
        raise InputNotFound("folder is empty", file=folder)
    config, side = _read_configs(folder, root)
    indexes = [p for p in entries if p.name.endswith(".safetensors.index.json")
               and root.check(p, "shard index") == "file"]
    warnings: list[str] = []
    index_path = None
    if indexes:
        index_path = indexes[0]
        if len(indexes) > 1:
            warnings.append(f"several shard indexes ({', '.join(p.name for p in indexes)}); "
                            f"read {index_path.name}")
        doc = _load_json_object(index_path, "shard index")
        weight_map = doc.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpoint("shard index has no weight_map object", file=index_path)
        checked: dict[str, Path] = {}
        shard_of = {}
        for t, s in weight_map.items():
            if not isinstance(s, str) or s not in checked:
                checked[s] = _check_shard_name(folder, index_path, s, t, root)
            shard_of[t] = checked[s]
        files = sorted(set(shard_of.values()))
        headers = {f: read_header(f) for f in files}
        tensors: dict[str, TensorInfo] = {}
        for t in sorted(weight_map):
            info = headers[shard_of[t]].tensors.get(t)
            if info is None:
                raise CorruptCheckpoint(f"the index maps it to {shard_of[t].name}, which has no such "
                                        f"tensor", file=index_path, tensor=t)
            tensors[t] = info
        duplicates = tuple(sorted((n, shard_of[n].name, f.name) for f in files for n in headers[f].tensors
                                  if n in shard_of and shard_of[n] != f))
        if duplicates:
            n, mapped, other = duplicates[0]
            warnings.append(f"{len(duplicates)} tensors are stored in two shards, e.g. {n} in {mapped} (the "
                            f"index's) and {other}: loaders that read the index get one, loaders that read "
                            f"every shard the other; writing verbs refuse it")
        unmapped = sorted(n for f in files for n in headers[f].tensors if n not in weight_map)
        if unmapped:
            warnings.append(f"{len(unmapped)} tensors are in the shards but not in "
                            f"{index_path.name} (loaders ignore them), e.g. {unmapped[0]}")
        stray = sorted(set(_weight_files(folder, root)) - set(files))
        if stray:
            warnings.append(f"{len(stray)} safetensors files are not named by {index_path.name} "
                            f"(loaders ignore them): {', '.join(p.name for p in stray[:3])}")
    else:
        duplicates = ()
        files = _weight_files(folder, root)
        if not files:
            if _pickle_files(folder):
                raise InputNotFound(_PICKLE_HINT, file=folder)
            raise InputNotFound("no .safetensors weights in this folder", file=folder)
        headers = {f: read_header(f) for f in files}
        tensors = {}
        for f in files:
            for t, info in headers[f].tensors.items():
                if t in tensors:
                    raise CorruptCheckpoint(f"tensor is stored in both {tensors[t].file.name} and "
                                            f"{f.name}, and there is no index to say which is used",
                                            file=folder, tensor=t)
                tensors[t] = info
    return Component(name=name, path=folder, files=tuple(files), headers=headers, tensors=tensors,
                     config=config, side_configs=side, index_file=index_path,
                     warnings=tuple(warnings), root=root, duplicates=duplicates)
