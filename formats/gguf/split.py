"""llama.cpp's split GGUF, read as one model from its first file, with the standard library only.

A split model (gguf-py's ``GGUFWriter(split_max_size=...)``, ``llama-gguf-split``, qconv's own
``--to gguf`` past ``--max-shard-size``) is N files ``NAME-00001-of-0000N.gguf`` ... ``NAME-0000N-of-0000N.gguf``,
each a GGUF of its own, whose tensor offsets are within that file. Each holds ``split.no`` (u16, from 0),
``split.count`` (u16, N) and ``split.tensors.count`` (i32, the whole set's tensors); the first holds the
model's metadata, the others only those keys. llama.cpp (llama-model-loader.cpp) is given the first file:
a later one is refused ("model must be loaded with the first split"), the others are found by name from
the first's suffix (``llama_split_prefix`` / ``llama_split_path``: ``-%05d-of-%05d.gguf``), each must hold its
own ``split.no``, and a tensor name in two files is refused. qconv does the same and checks more (every
file's ``split.count`` and ``split.tensors.count`` agree with the first's, the set holds that many tensors),
reads no file but the N the first one's name gives, and reads each one's header through header.read_header
(bounded, hostile-input safe), so a bad set is refused naming the file before any tensor data is read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...errors import CorruptCheckpoint, UsageError
from .header import GGUFHeader, read_header

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_name(prefix: str, no: int, count: int) -> str:
    """The name of split ``no`` (from 0) of ``count``, as llama_split_path makes it."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def _key(header: GGUFHeader, key: str, *, low: int, high: int) -> int | None:
    value = header.metadata.get(key)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise CorruptCheckpoint(f"key {key!r} is {value!r}, expected an integer from {low} to {high}",
                                file=header.path)
    return value


def position(header: GGUFHeader) -> tuple[int, int] | None:
    """(split.no, split.count) of a file that is one of a split set (split.count over 1), else None."""
    count = _key(header, "split.count", low=0, high=0xFFFF)
    if count is None or count <= 1:
        return None
    no = _key(header, "split.no", low=0, high=0xFFFF)
    if no is None:
        raise CorruptCheckpoint(f"says it is one of {count} split files (split.count) but has no split.no",
                                file=header.path)
    if no >= count:
        raise CorruptCheckpoint(f"split.no is {no}, past the {count} files its split.count says", file=header.path)
    return no, count


def read_gguf(path: str | os.PathLike) -> GGUFHeader:
    """One GGUF file's header, or, for the first file of a split set, the whole set's: the first file's
    metadata, every file's tensors in order (each GGUFTensor's ``file`` says which file holds it),
    ``files`` the set's files and ``file_size`` their total. A later file of a set is refused, naming the
    first to pass instead."""
    path = Path(path)
    first = read_header(path)
    where = position(first)
    if where is None:
        return first
    no, count = where
    m = _NAME.search(path.name)
    if no != 0:
        hint = f" ({split_name(path.name[:m.start()], 0, count)})" if m and m.start() else ""
        raise UsageError(f"is split {no + 1} of {count} of a split GGUF; pass its first file{hint}, from which "
                         f"the others are found, as llama.cpp does", file=path)
    suffix = split_name("", 0, count)
    if not path.name.endswith(suffix) or len(path.name) == len(suffix):
        raise CorruptCheckpoint(f"is the first of {count} split files (split.count), but its name does not end in "
                                f"{suffix!r}, by which llama.cpp and qconv find the others", file=path)
    prefix = path.name[: -len(suffix)]
    paths = [path.with_name(split_name(prefix, i, count)) for i in range(1, count)]
    for i, p in enumerate(paths, 1):                 # every file there before any is read
        if not os.path.lexists(p):
            raise CorruptCheckpoint(f"split {i + 1} of {count} is missing: the split GGUF {path.name} begins is "
                                    f"incomplete", file=p)
    total = _key(first, "split.tensors.count", low=0, high=(1 << 31) - 1)
    headers, names = [first], {t.name for t in first.tensors}
    for i, p in enumerate(paths, 1):
        h = read_header(p)
        if _key(h, "split.count", low=0, high=0xFFFF) != count:
            raise CorruptCheckpoint(f"split.count is {h.metadata.get('split.count')!r}, but {path.name}'s is {count}: "
                                    f"not a file of the same split GGUF", file=p)
        if position(h)[0] != i:
            raise CorruptCheckpoint(f"split.no is {h.metadata['split.no']}, but its name makes it split {i + 1} of "
                                    f"{count} (split.no {i}): the files are out of order", file=p)
        if total is not None and _key(h, "split.tensors.count", low=0, high=(1 << 31) - 1) != total:
            raise CorruptCheckpoint(f"split.tensors.count is {h.metadata.get('split.tensors.count')!r}, but "
                                    f"{path.name}'s is {total}: not a file of the same split GGUF", file=p)
        for t in h.tensors:
            if t.name in names:
                raise CorruptCheckpoint("is in an earlier file of the split GGUF too", file=p, tensor=t.name)
            names.add(t.name)
        headers.append(h)
    if total is not None and len(names) != total:
        raise CorruptCheckpoint(f"split.tensors.count says the {count} split files hold {total} tensors, but they "
                                f"hold {len(names)}", file=path)
    return GGUFHeader(path, first.version, first.alignment, first.metadata,
                      tuple(t for h in headers for t in h.tensors), first.data_offset,
                      sum(h.file_size for h in headers), files=tuple(h.path for h in headers))
