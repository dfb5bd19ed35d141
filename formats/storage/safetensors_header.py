"""Read and validate safetensors headers with the standard library only (no torch, no numpy).

File layout (https://github.com/huggingface/safetensors, format.md)::

    [ u64 little-endian N ][ N bytes of UTF-8 JSON header ][ data buffer ........................ ]
                            {"__metadata__": {str: str},            offsets are relative to the
                             "<name>": {"dtype": "BF16",             start of the data buffer
                                        "shape": [out, in],
                                        "data_offsets": [begin, end]}, ...}

The checks are those of the reference Rust implementation (``Metadata::validate``), so a file this
module accepts is one that ``safetensors`` loads, and every refusal names the file and the tensor:
header length past the end of the file, header that is not a JSON object, unknown dtype, bad shape,
byte size that disagrees with shape x dtype, offsets that overlap, leave gaps, or run past the file,
and bytes left over after the last tensor.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Mapping

from ...errors import CorruptCheckpoint

# safetensors dtype code -> (bits per element, torch dtype name). The single source of dtype truth.
DTYPES: Mapping[str, tuple[int, str]] = {
    "BOOL": (8, "torch.bool"),
    "U8": (8, "torch.uint8"),
    "I8": (8, "torch.int8"),
    "U16": (16, "torch.uint16"),
    "I16": (16, "torch.int16"),
    "F16": (16, "torch.float16"),
    "BF16": (16, "torch.bfloat16"),
    "U32": (32, "torch.uint32"),
    "I32": (32, "torch.int32"),
    "F32": (32, "torch.float32"),
    "U64": (64, "torch.uint64"),
    "I64": (64, "torch.int64"),
    "F64": (64, "torch.float64"),
    "C64": (64, "torch.complex64"),
    "F8_E4M3": (8, "torch.float8_e4m3fn"),
    "F8_E4M3FNUZ": (8, "torch.float8_e4m3fnuz"),
    "F8_E5M2": (8, "torch.float8_e5m2"),
    "F8_E5M2FNUZ": (8, "torch.float8_e5m2fnuz"),
    "F8_E8M0": (8, "torch.float8_e8m0fnu"),
    "F6_E2M3": (6, "float6_e2m3"),
    "F6_E3M2": (6, "float6_e3m2"),
    "F4": (4, "torch.float4_e2m1fn_x2"),
}

FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

# The reference implementation refuses headers above 100 MB; so do we (a hostile length cannot make
# qconv allocate gigabytes).
MAX_HEADER_BYTES = 100_000_000
_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its header describes it. ``offset`` is absolute within ``file``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int
    # A tensor stored in a container's own encoding (a GGUF's block-typed embeddings, its llama q / k rows
    # in rotary order): decode(info, rows) gives rows r0:r1 (None: all) of ``shape`` as info.dtype values,
    # from its stored bytes (offset, nbytes, whole rows of them), for any float dtype ``info`` is given
    # (replace(info, dtype=...) decodes straight into another); tensor_io.read_array calls it. None: the
    # bytes are dtype's own. Picklable.
    decode: Callable | None = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> str:
        return DTYPES[self.dtype][1]


@dataclass(frozen=True)
class Header:
    file: Path
    file_size: int
    header_bytes: int
    metadata: Mapping[str, str]
    tensors: Mapping[str, TensorInfo]   # in header order


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a st_mode describes, in words ("a FIFO (named pipe)", ...), for messages."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, *, what: str | None = None, buffering: int = -1) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file (directly or through a link). A FIFO,
    socket or device is refused before it is opened, and the check is repeated on the open descriptor
    (opened with O_NONBLOCK, so even a FIFO swapped in meanwhile cannot block the open): a read can
    neither hang on a pipe nor run without end on /dev/zero. Raises CorruptCheckpoint naming the file."""
    prefix = f"{what} " if what else ""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpoint(f"{prefix}is {file_kind(st.st_mode)}, not a regular file; qconv reads "
                                    f"only regular files", file=path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read{' ' + what if what else ''}: {exc.strerror or exc}",
                                file=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpoint(f"{prefix}is {file_kind(st.st_mode)}, not a regular file; qconv reads "
                                    f"only regular files", file=path)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def _no_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate the header of one safetensors file. Reads 8 + N bytes, never tensor data."""
    path = Path(path)
    size, n, raw = _read_raw_header(path)
    doc = _parse_json(raw, path)
    metadata = _metadata(doc, path)
    data_start = 8 + n
    data_size = size - data_start
    tensors, spans = _tensor_entries(doc, path, data_start, data_size)
    _check_tiling(spans, data_size, path)
    return Header(path, size, n, metadata, tensors)


def _read_raw_header(path: Path) -> tuple[int, int, bytes]:
    """(file size, header length N, the N header bytes), refusing a length field the file cannot hold."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CorruptCheckpoint(
                    f"file is {size} bytes, too short to be safetensors (needs an 8-byte header "
                    f"length); it is truncated or not a safetensors file", file=path)
            (n,) = _LEN.unpack(head)
            if n > MAX_HEADER_BYTES:
                raise CorruptCheckpoint(
                    f"header length field says {n} bytes, above the {MAX_HEADER_BYTES}-byte limit; "
                    f"the file is corrupt or not a safetensors file", file=path)
            if 8 + n > size:
                raise CorruptCheckpoint(
                    f"header length {n} runs past the end of the {size}-byte file; the file is "
                    f"truncated or not a safetensors file", file=path)
            raw = f.read(n)
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read: {exc.strerror or exc}", file=path) from None
    return size, n, raw


def _parse_json(raw: bytes, path: Path) -> dict:
    """The header bytes as a JSON object: UTF-8, starting with '{', no duplicate keys."""
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("does not start with '{'")
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise CorruptCheckpoint(f"header is not a valid JSON object ({reason})", file=path) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpoint("header is JSON but not an object", file=path)
    return doc


def _metadata(doc: dict, path: Path) -> dict:
    """Pop ``__metadata__`` off the header: a mapping of strings to strings (null reads as empty)."""
    metadata = doc.pop("__metadata__", None)       # null is allowed (safetensors reads it as none)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        found = type(metadata).__name__ if not isinstance(metadata, dict) else "other values"
        raise CorruptCheckpoint(f"__metadata__ must be an object mapping strings to strings (found "
                                f"{found}); safetensors refuses this header", file=path)
    return metadata


def _tensor_entries(doc: dict, path: Path, data_start: int,
                    data_size: int) -> tuple[dict[str, TensorInfo], list[tuple[int, int, str]]]:
    """Each entry checked on its own (dtype, shape, offsets, byte size, inside the data buffer), in
    one pass: the TensorInfos in header order, and their (begin, end, name) spans for the tiling."""
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in doc.items():
        if not isinstance(entry, dict):
            raise CorruptCheckpoint("header entry is not an object", file=path, tensor=name)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise CorruptCheckpoint(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})",
                                    file=path, tensor=name)
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CorruptCheckpoint(f"shape {shape!r} is not a list of non-negative integers",
                                    file=path, tensor=name)
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_int(o) and o >= 0 for o in offsets) or offsets[1] < offsets[0]):
            raise CorruptCheckpoint(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end",
                                    file=path, tensor=name)
        bits = DTYPES[dtype][0]
        numel = math.prod(shape)
        if (numel * bits) % 8:
            raise CorruptCheckpoint(f"{numel} elements of {dtype} do not fill whole bytes",
                                    file=path, tensor=name)
        nbytes = numel * bits // 8
        begin, end = offsets
        if end - begin != nbytes:
            raise CorruptCheckpoint(
                f"shape {shape} of {dtype} needs {nbytes} bytes but data_offsets {offsets} span "
                f"{end - begin}", file=path, tensor=name)
        if end > data_size:
            raise CorruptCheckpoint(
                f"data_offsets {offsets} run past the end of the data ({data_size} bytes after the "
                f"header); the file is truncated", file=path, tensor=name)
        tensors[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, nbytes)
        spans.append((begin, end, name))
    return tensors, spans


def _check_tiling(spans: list[tuple[int, int, str]], data_size: int, path: Path) -> None:
    """Offsets must tile the data buffer exactly: sorted, no overlap, no gap, nothing left over."""
    spans.sort()
    expected, previous = 0, None
    for begin, end, name in spans:
        if begin < expected:
            raise CorruptCheckpoint(f"data_offsets [{begin}, {end}] overlap tensor {previous!r}",
                                    file=path, tensor=name)
        if begin > expected:
            raise CorruptCheckpoint(f"data_offsets [{begin}, {end}] leave a gap of {begin - expected} "
                                    f"bytes after {previous!r}" if previous else
                                    f"data_offsets [{begin}, {end}] do not start at 0",
                                    file=path, tensor=name)
        expected, previous = end, name
    if expected != data_size:
        raise CorruptCheckpoint(
            f"{data_size - expected} bytes after the last tensor are not described by the header "
            f"(tensors end at {expected}, data is {data_size} bytes)", file=path)


def read_small_tensors(infos, limit: int = 1 << 20) -> dict[str, bytes]:
    """Read the raw bytes of tiny tensors (bitsandbytes' quant_state JSON, weight_format bytes),
    opening each file once."""
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in infos:
        if info.nbytes > limit:
            raise CorruptCheckpoint(f"expected a small metadata tensor but it holds {info.nbytes} "
                                    f"bytes", file=info.file, tensor=info.name)
        by_file.setdefault(info.file, []).append(info)
    out = {}
    for path, group in by_file.items():
        current = None
        try:
            with open_regular(path) as f:
                for current in sorted(group, key=lambda i: i.offset):
                    f.seek(current.offset)
                    data = f.read(current.nbytes)
                    if len(data) != current.nbytes:
                        raise CorruptCheckpoint("file ended while reading the tensor: truncated",
                                                file=path, tensor=current.name)
                    out[current.name] = data
        except OSError as exc:
            raise CorruptCheckpoint(f"cannot read: {exc.strerror or exc}", file=path,
                                    tensor=current.name if current else None) from None
    return out


def encode_header(tensors, metadata: Mapping[str, str] | None = None) -> tuple[bytes, int]:
    """Plan a safetensors file: ``tensors`` is an iterable of ``(name, dtype, shape)`` laid out in
    that order. Returns the 8-byte length plus the JSON header (space-padded to a multiple of 8, as
    safetensors pads it) and the size of the data section that must follow."""
    doc: dict = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * DTYPES[dtype][0] // 8
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return _LEN.pack(len(raw)) + raw, offset
