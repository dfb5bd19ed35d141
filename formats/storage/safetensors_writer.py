"""Plan and write sharded safetensors output, streaming, with no torch.

Sharding is a pure planning step over (name, dtype, shape) triples (like huggingface_hub's
split_state_dict_into_shards: tensors in order, a new shard when the next tensor would pass the limit,
standard ``model-0000X-of-0000N.safetensors`` names and an index). Writing then follows the plan: the
header first, then each tensor's bytes in order, chunk by chunk, so a tensor is never held whole.
"""

from __future__ import annotations

import json
import math
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .safetensors_header import DTYPES, encode_header

DEFAULT_MAX_SHARD = 5 * 10**9   # transformers' default max_shard_size ("5GB")


def nbytes(dtype: str, shape) -> int:
    return math.prod(shape) * DTYPES[dtype][0] // 8


@dataclass(frozen=True)
class Shard:
    filename: str
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]     # (name, dtype, shape)

    @property
    def data_bytes(self) -> int:
        return sum(nbytes(d, s) for _, d, s in self.tensors)


def plan_shards(tensors, max_shard_bytes: int, base: str = "model") -> list[Shard]:
    groups: list[list] = []
    size = 0
    for t in tensors:
        n = nbytes(t[1], t[2])
        if not groups or (groups[-1] and size + n > max_shard_bytes):
            groups.append([])
            size = 0
        groups[-1].append((t[0], t[1], tuple(t[2])))
        size += n
    if len(groups) <= 1:
        return [Shard(f"{base}.safetensors", tuple(groups[0] if groups else ()))]
    total = len(groups)
    return [Shard(f"{base}-{i:05d}-of-{total:05d}.safetensors", tuple(g)) for i, g in enumerate(groups, 1)]


def index_json(shards: list[Shard]) -> str | None:
    """The model.safetensors.index.json text, or None for a single unsharded file."""
    if len(shards) == 1 and "-of-" not in shards[0].filename:
        return None
    weight_map = {name: s.filename for s in shards for name, _, _ in s.tensors}
    doc = {"metadata": {"total_size": sum(s.data_bytes for s in shards)},
           "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(doc, indent=2) + "\n"


class _BackgroundFile:
    """A file written by a helper thread, so the next slab is computed while this one is written
    (numpy and file writes release the GIL). At most ``depth`` chunks wait in memory."""

    def __init__(self, path: Path, depth: int = 8):
        self._f = open(path, "wb")
        self._q: queue.Queue = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qconv-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if self._error is None:
                try:
                    self._f.write(item)
                except BaseException as exc:  # re-raised in the caller's thread
                    self._error = exc

    def write(self, data) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(data)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        self._f.close()
        if self._error is not None:
            raise self._error


class ShardWriter:
    """Writes one planned shard: ``write_tensor(name, chunks)`` for each tensor in plan order."""

    def __init__(self, folder: Path, shard: Shard, metadata=None):
        self.shard = shard
        self.path = folder / shard.filename
        header, _ = encode_header(shard.tensors, metadata if metadata is not None else {"format": "pt"})
        self._f = _BackgroundFile(self.path)
        self._f.write(header)
        self._next = 0

    def write_tensor(self, name: str, chunks) -> int:
        planned, dtype, shape = self.shard.tensors[self._next]
        if planned != name:
            raise AssertionError(f"write of {name!r} out of plan order (expected {planned!r})")
        written = 0
        for chunk in chunks:
            data = memoryview(np.ascontiguousarray(chunk).reshape(-1)).cast("B")   # 1-D: a size-0 chunk casts too
            if data.nbytes:
                self._f.write(data)
            written += data.nbytes
        if written != nbytes(dtype, shape):
            raise AssertionError(f"{name!r}: wrote {written} bytes, planned {nbytes(dtype, shape)}")
        self._next += 1
        return written

    def abort(self) -> None:
        try:
            self._f.close()
        except BaseException:
            pass

    def close(self) -> None:
        self._f.close()
        if self._next != len(self.shard.tensors):
            raise AssertionError(f"{self.path.name}: {len(self.shard.tensors) - self._next} tensors "
                                 f"never written")
