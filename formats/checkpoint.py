"""Find what a path holds: a model folder, a single safetensors file, or a diffusers-style pipeline.

Reads only JSON files and safetensors headers. The shard index is validated the way a loader would
use it: shard names may not leave the folder, every shard must exist, and every tensor the index maps
must be in the shard it names. Pickle weights (.bin/.pt/.pth/.ckpt) are never opened.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..errors import CorruptCheckpoint, InputNotFound
from .safetensors_header import Header, TensorInfo, read_header

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
QUANT_CONFIG_FILES = ("quantize_config.json", "quantization_config.json")
MAX_JSON_BYTES = 64 << 20


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

    @property
    def bytes_on_disk(self) -> int:
        return sum(h.file_size for h in self.headers.values())


@dataclass(frozen=True)
class Target:
    path: Path
    kind: str                                # "model", "file" or "pipeline"
    components: tuple[Component, ...]


def load_json(path: Path, *, what: str = "JSON file") -> object:
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CorruptCheckpoint(f"{what} is {size} bytes, larger than any real one", file=path)
        return json.loads(path.read_bytes().decode("utf-8"))
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


def open_target(path: str | os.PathLike) -> Target:
    path = Path(path)
    if not path.exists():
        raise InputNotFound("no such file or folder", file=path)
    if path.is_file():
        if path.suffix != ".safetensors":
            if path.suffix in PICKLE_SUFFIXES:
                raise InputNotFound(_PICKLE_HINT, file=path)
            raise InputNotFound("not a .safetensors file or a model folder", file=path)
        header = read_header(path)
        comp = Component(name=path.name, path=path, files=(path,), headers={path: header},
                         tensors=dict(header.tensors))
        return Target(path, "file", (comp,))
    if not path.is_dir():
        raise InputNotFound("not a regular file or folder", file=path)

    index = path / "model_index.json"
    if index.is_file():
        return Target(path, "pipeline", tuple(_open_pipeline(path, index)))
    return Target(path, "model", (open_component(path, path.resolve().name or str(path)),))


_PICKLE_HINT = ("holds only pickle weights, which qconv never loads (unpickling runs arbitrary code); "
                "convert them to safetensors with a tool you trust, then run qconv on the result")


def _open_pipeline(root: Path, index: Path) -> list[Component]:
    doc = _load_json_object(index, "model_index.json")
    components = []
    for key in sorted(doc):
        value = doc[key]
        if key.startswith("_") or not isinstance(value, list):
            continue
        sub = root / key
        if not sub.is_dir():
            continue
        if _weight_files(sub) or _pickle_files(sub):
            components.append(open_component(sub, key))
    if not components:
        raise InputNotFound("pipeline (model_index.json) has no component folder holding weights",
                            file=root)
    return components


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" and p.is_file())


def _pickle_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


def _read_configs(folder: Path) -> tuple[dict | None, dict[str, dict]]:
    config = None
    cfg_path = folder / "config.json"
    if cfg_path.is_file():
        config = _load_json_object(cfg_path, "config.json")
        qc = config.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise CorruptCheckpoint("quantization_config must be a JSON object, found "
                                    f"{type(qc).__name__}", file=cfg_path)
    side = {}
    for fname in QUANT_CONFIG_FILES:
        p = folder / fname
        if p.is_file():
            side[fname] = _load_json_object(p, fname)
    return config, side


def _check_shard_name(folder: Path, index_path: Path, shard: object, tensor: str) -> Path:
    if not isinstance(shard, str) or not shard or "\x00" in shard:
        raise CorruptCheckpoint(f"weight_map entry names no valid shard ({shard!r})",
                                file=index_path, tensor=tensor)
    candidate = Path(shard)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise CorruptCheckpoint(f"weight_map points outside the folder ({shard!r}); refusing to "
                                f"follow it", file=index_path, tensor=tensor)
    full = folder / candidate
    try:
        full.resolve().relative_to(folder.resolve())
    except ValueError:
        raise CorruptCheckpoint(f"shard {shard!r} resolves outside the folder (a link?); refusing "
                                f"to follow it", file=index_path, tensor=tensor) from None
    if not full.is_file():
        raise CorruptCheckpoint(f"weight_map names shard {shard!r}, which does not exist",
                                file=index_path, tensor=tensor)
    return full


def open_component(folder: Path, name: str) -> Component:
    """Open one model folder: configs, shard index (if any) and every safetensors header."""
    if not any(folder.iterdir()):
        raise InputNotFound("folder is empty", file=folder)
    config, side = _read_configs(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
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
                checked[s] = _check_shard_name(folder, index_path, s, t)
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
        unmapped = sorted(n for f in files for n in headers[f].tensors if n not in weight_map)
        if unmapped:
            warnings.append(f"{len(unmapped)} tensors are in the shards but not in "
                            f"{index_path.name} (loaders ignore them), e.g. {unmapped[0]}")
        stray = sorted(set(_weight_files(folder)) - set(files))
        if stray:
            warnings.append(f"{len(stray)} safetensors files are not named by {index_path.name} "
                            f"(loaders ignore them): {', '.join(p.name for p in stray[:3])}")
    else:
        files = _weight_files(folder)
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
                     warnings=tuple(warnings))
