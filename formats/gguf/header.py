"""Read and validate a GGUF file's header with the standard library only (no numpy, no torch, no ``gguf``).

File layout (ggml/docs/gguf.md; gguf-py's ``gguf_reader.py`` is the reference reader), little-endian::

    "GGUF"  u32 version (2 or 3)  u64 n_tensors  u64 n_kv
    n_kv x      [ string key ][ u32 value type ][ value ]          string = u64 length + UTF-8 bytes
                                                                   array  = u32 type, u64 count, elements
    n_tensors x [ string name ][ u32 n_dims ][ n_dims x u64 ne0, ne1, ... ][ u32 ggml type ][ u64 offset ]
    padding to general.alignment (default 32)
    data: each tensor at data start + its offset, which is a multiple of the alignment

Every length and count in that header is the file's claim, so none is trusted: each is checked against the
bytes the file really has left before anything is read or allocated, reads go through one bounded buffer,
and very long arrays and strings (a tokenizer's 150k tokens) are read through but kept only as a summary
(``Elided``), so memory stays small whatever the file says. A file this module accepts is one llama.cpp's
loader accepts too, but for gaps between tensors (llama.cpp wants them packed; gguf-py reads them) and
tensor names over 63 bytes; every refusal names the file and the key or tensor.
"""

from __future__ import annotations

import codecs
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ...errors import CorruptCheckpoint, UnsupportedFormat, UsageError
from ..core.options import Option, integer, one_of, yes_no
from ..storage.safetensors_header import open_regular

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_NESTING = 8                 # arrays of arrays, this deep at most
MAX_NAME_BYTES = 1 << 16        # keys and tensor names are short; a longer one is a lie about its length
KEEP_ELEMENTS = 64              # arrays up to this long are kept whole ...
HEAD_ELEMENTS = 8               # ... longer ones as their type, count and first few elements
KEEP_STRING_BYTES = 1 << 20     # strings up to 1 MiB are kept whole, longer ones as a head
HEAD_CHARS = 256
_CHUNK = 1 << 20
_INT64_MAX = (1 << 63) - 1

# ggml type id -> (name, block size in weights, bytes per block): ggml.h's ggml_type and gguf-py's
# GGML_QUANT_SIZES (gguf/constants.py, gguf 0.19.0). The single source of GGUF layout truth here.
GGML_TYPES: Mapping[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    6: ("Q5_0", 32, 2 + 4 + 16),
    7: ("Q5_1", 32, 2 + 2 + 4 + 16),
    8: ("Q8_0", 32, 2 + 32),
    9: ("Q8_1", 32, 4 + 4 + 32),
    10: ("Q2_K", 256, 2 + 2 + 256 // 16 + 256 // 4),
    11: ("Q3_K", 256, 2 + 256 // 4 + 256 // 8 + 12),
    12: ("Q4_K", 256, 2 + 2 + 256 // 2 + 12),
    13: ("Q5_K", 256, 2 + 2 + 256 // 2 + 256 // 8 + 12),
    14: ("Q6_K", 256, 2 + 256 // 2 + 256 // 4 + 256 // 16),
    15: ("Q8_K", 256, 4 + 256 + 256 // 8),
    16: ("IQ2_XXS", 256, 2 + 256 // 4),
    17: ("IQ2_XS", 256, 2 + 256 // 4 + 256 // 32),
    18: ("IQ3_XXS", 256, 2 + 256 // 4 + 256 // 8),
    19: ("IQ1_S", 256, 2 + 256 // 8 + 256 // 16),
    20: ("IQ4_NL", 32, 2 + 16),
    21: ("IQ3_S", 256, 2 + 256 // 4 + 256 // 8 + 256 // 32 + 4),
    22: ("IQ2_S", 256, 2 + 256 // 4 + 256 // 16),
    23: ("IQ4_XS", 256, 2 + 2 + 256 // 2 + 256 // 64),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 256 // 8 + 256 // 16 + 256 // 32),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 2 + 4 * 13),
    35: ("TQ2_0", 256, 2 + 64),
    39: ("MXFP4", 32, 1 + 16),
    40: ("NVFP4", 64, 4 + 32),
    41: ("Q1_0", 128, 2 + 16),
}

# general.file_type -> name: llama.h's llama_ftype (gguf-py's LlamaFileType), "MOSTLY_" dropped.
FILE_TYPES: Mapping[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0", 1024: "GUESSED",
}

# value type id -> (name, struct format or None, smallest encoded size): GGUFValueType.
_STRING, _ARRAY, _BOOL, _F32 = 8, 9, 7, 6
VALUE_TYPES: Mapping[int, tuple[str, str | None, int]] = {
    0: ("uint8", "<B", 1), 1: ("int8", "<b", 1), 2: ("uint16", "<H", 2), 3: ("int16", "<h", 2),
    4: ("uint32", "<I", 4), 5: ("int32", "<i", 4), 6: ("float32", "<f", 4), 7: ("bool", "<B", 1),
    8: ("string", None, 8), 9: ("array", None, 4 + 8), 10: ("uint64", "<Q", 8), 11: ("int64", "<q", 8),
    12: ("float64", "<d", 8),
}
_U32, _U64, _F32S = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<f")


def bits_per_weight(type_id: int) -> float:
    """Storage bits per weight of a ggml type, scales and mins included (Q4_K: 4.5, Q8_0: 8.5)."""
    if type_id not in GGML_TYPES:
        raise UnsupportedFormat(f"unknown ggml type {type_id}; qconv knows {', '.join(map(str, GGML_TYPES))}")
    _, block, size = GGML_TYPES[type_id]
    return 8 * size / block


def is_quantized(type_id: int) -> bool:
    """Block types (Q*, IQ*, TQ*, MXFP4, ...) as against plain float and integer elements."""
    return GGML_TYPES[type_id][1] > 1


@dataclass(frozen=True)
class Elided:
    """A metadata value too long to keep (an array of more than KEEP_ELEMENTS elements, a string of more
    than KEEP_STRING_BYTES bytes): it was read through and validated, and only its size and head are kept,
    so a 150k-token vocabulary costs a few hundred bytes. ``type`` is "string" or "array[<element type>]";
    ``count`` is the array's elements or the string's UTF-8 bytes."""

    type: str
    count: int
    head: tuple | str

    def to_json(self) -> dict:
        return {"type": self.type, "count": self.count, "head": plain(self.head)}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor info. ``shape`` is in GGUF order (ne0, the contiguous dimension, first: a [out, in]
    Linear weight reads (in, out)); ``offset`` is absolute within ``file``, the file that holds it (one
    of a split set's: split.py)."""

    name: str
    shape: tuple[int, ...]
    type: int
    type_name: str
    offset: int
    nbytes: int
    file: Path | None = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    alignment: int
    metadata: Mapping[str, Any]        # key -> int | float | bool | str | list | Elided, in file order
    tensors: tuple[GGUFTensor, ...]    # in file order
    data_offset: int
    file_size: int                     # a split set's (split.read_gguf): all its files' bytes
    files: tuple[Path, ...] = ()       # a split set's files, the first (path) first; () for one file


def plain(value):
    """A metadata value as JSON can hold it (Elided as {"type", "count", "head"})."""
    if isinstance(value, Elided):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


GGUF_BITS = {4: "Q4_0", 8: "Q8_0"}                # --bits: what every requantized module becomes
GGUF_ASYM = ("q5_0", "q4_1")
GGUF_FLOAT_TYPES = ("auto", "f32", "f16", "bf16", "q8_0")
MMPROJ_TYPES = ("auto", "f32", "f16", "bf16", "q8_0")


def _bits(value):
    value = integer("bits", 2, 8)(value)
    if value not in GGUF_BITS:
        raise UsageError(f"--bits {value}: --to gguf requantizes to "
                         f"{' or '.join(f'{t} (--bits {b})' for b, t in GGUF_BITS.items())} only")
    return value


# --to gguf's options (writer.py reads them; core/request.py builds the flags and keywords from these)
WRITER_OPTIONS = (
    Option("bits", "--bits", "gguf: the block type every requantized module becomes: 8 (Q8_0) or 4 (Q4_0); "
           "default: Q8_0 from 8-bit and float sources, Q4_0 from 4-bit and below.", _bits, number=True),
    Option("gguf_asym", "--gguf-asym", "gguf: block type of 4-bit asymmetric modules (GPTQ asym, AWQ): q5_0 keeps "
           "every code exactly (5.5 bits a weight), q4_1 too but rounds each block's minimum to float16 (5.0); "
           "default: q5_0.", one_of("gguf_asym", GGUF_ASYM, str.upper), default="q5_0", choices=GGUF_ASYM),
    Option("gguf_float", "--gguf-float", "gguf: store modules whose codes cannot be kept as float (the model's "
           "dtype) instead of requantizing them to Q8_0 / Q4_0.", yes_no("gguf_float"), default=False, kind="flag"),
    Option("gguf_float_type", "--gguf-float-type", "gguf: type of the 2-D float tensors (embeddings, lm_head) and "
           "of --gguf-float's modules: auto keeps the model's 16-bit dtype as llama.cpp's converter does; f32, "
           "f16, bf16 convert (rounding reported, a value f16 cannot hold refused); q8_0 requantizes (error "
           "reported). Norms, biases and the MoE router stay F32. Default: auto.",
           one_of("gguf_float_type", GGUF_FLOAT_TYPES), default="auto", choices=GGUF_FLOAT_TYPES),
    Option("mmproj", "--mmproj/--no-mmproj", "gguf: a vision-language model's vision tower as llama.cpp's "
           "mmproj file beside DST (mmproj-DST; default), or the text model alone.", yes_no("mmproj"), default=True,
           kind="pair"),
    Option("mmproj_type", "--mmproj-type", "gguf: type of the mmproj file's 2-D weights: auto keeps each tensor's "
           "dtype (a quantized tower's Linears dequantized exactly, F32); f32, f16, bf16 convert (rounding "
           "reported); q8_0 keeps 8-bit codes that fit (bitsandbytes int8), else quantizes (error reported). "
           "Norms, biases, the patch and position embeddings stay F32. Default: auto.",
           one_of("mmproj_type", MMPROJ_TYPES), default="auto", choices=MMPROJ_TYPES),
)


def looks_like_gguf(path: str | os.PathLike) -> bool:
    """A regular file named *.gguf, or one that starts with the GGUF magic: what `qconv inspect` reads as
    GGUF rather than as safetensors."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    if path.suffix == ".safetensors":
        return False
    try:
        with open_regular(path) as f:
            return f.read(4) == MAGIC
    except CorruptCheckpoint:
        return False


class _Source:
    """Bounded reads from an open file: every read is checked against the bytes the file has left, so a
    lying length is refused before anything is allocated, and small reads are served from one buffer."""

    def __init__(self, f, size: int, path: Path):
        self.f, self.size, self.path = f, size, path
        self.buf, self.bpos, self.base = b"", 0, 0    # base: file offset of buf[0]

    @property
    def pos(self) -> int:
        return self.base + self.bpos

    def left(self) -> int:
        return self.size - self.pos

    def corrupt(self, problem: str, tensor: str | None = None) -> CorruptCheckpoint:
        return CorruptCheckpoint(problem, file=self.path, tensor=tensor)

    def truncated(self, n: int, what: str, tensor: str | None = None) -> CorruptCheckpoint:
        return self.corrupt(f"truncated: {what} needs {n} bytes at offset {self.pos}, but the file ends at "
                            f"{self.size}", tensor)

    def ensure(self, n: int, what: str, tensor: str | None = None) -> None:
        if self.bpos + n <= len(self.buf):
            return
        if n > self.left():
            raise self.truncated(n, what, tensor)
        rest = self.buf[self.bpos:]
        end = self.base + len(self.buf)
        want = min(max(n - len(rest), _CHUNK), self.size - end)
        self.f.seek(end)
        data = self.f.read(want)
        self.base, self.buf, self.bpos = self.pos, rest + data, 0
        if len(self.buf) < n:                       # the file shrank while it was read
            raise self.truncated(n, what, tensor)

    def take(self, n: int, what: str, tensor: str | None = None) -> bytes:
        self.ensure(n, what, tensor)
        out = self.buf[self.bpos:self.bpos + n]
        self.bpos += n
        return out

    def skip(self, n: int, what: str) -> None:
        if self.bpos + n <= len(self.buf):
            self.bpos += n
            return
        if n > self.left():
            raise self.truncated(n, what)
        self.base, self.buf, self.bpos = self.pos + n, b"", 0

    def u32(self, what: str, tensor: str | None = None) -> int:
        self.ensure(4, what, tensor)
        (v,) = _U32.unpack_from(self.buf, self.bpos)
        self.bpos += 4
        return v

    def u64(self, what: str, tensor: str | None = None) -> int:
        self.ensure(8, what, tensor)
        (v,) = _U64.unpack_from(self.buf, self.bpos)
        self.bpos += 8
        return v

    def string(self, what: str, *, limit: int | None = None, tensor: str | None = None) -> str | Elided:
        """A gguf string; longer than ``limit`` bytes is refused (keys, names), longer than
        KEEP_STRING_BYTES is decoded in chunks and kept as an Elided head."""
        n = self.u64(f"the length of {what}", tensor)
        if n > self.left():
            raise self.corrupt(f"{what} claims {n} bytes, but only {self.left()} bytes are left in the file",
                               tensor)
        if limit is not None and n > limit:
            raise self.corrupt(f"{what} claims {n} bytes; a name is at most {limit} bytes", tensor)
        if n <= KEEP_STRING_BYTES:
            raw = self.take(n, what, tensor)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self.corrupt(f"{what} is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 4]!r})",
                                   tensor) from None
        decoder, head, done = codecs.getincrementaldecoder("utf-8")("strict"), "", 0
        try:
            while done < n:
                k = min(_CHUNK // 16, n - done)
                text = decoder.decode(self.take(k, what, tensor))
                head = head if len(head) >= HEAD_CHARS else (head + text)[:HEAD_CHARS]
                done += k
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not UTF-8", tensor) from None
        return Elided("string", n, head)


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and validate the header of one GGUF file (v2 or v3, little-endian). Reads the header only,
    never tensor data, and holds at most a few MiB whatever the file claims."""
    path = Path(path)
    with open_regular(path) as f:
        try:
            return _parse(_Source(f, os.fstat(f.fileno()).st_size, path))
        except OSError as exc:                      # EIO and the like, mid-read
            raise CorruptCheckpoint(f"cannot read: {exc.strerror or exc}", file=path) from None


def _parse(src: _Source) -> GGUFHeader:
    version, n_tensors, n_kv = _preamble(src)
    metadata, alignment = _metadata(src, n_kv)
    infos = _tensor_infos(src, n_tensors)
    data_offset = -(-src.pos // alignment) * alignment
    tensors = [_tensor(src, *info, alignment, data_offset) for info in infos]
    _check_overlaps(src, tensors)
    return GGUFHeader(src.path, version, alignment, metadata, tuple(tensors), data_offset, src.size)


def _preamble(src: _Source) -> tuple[int, int, int]:
    """(version, tensor count, key count) after the magic, refusing counts the file cannot hold."""
    if src.size < 4:
        magic = src.take(src.size, "the magic")
        raise src.corrupt(f"not a GGUF file: {src.size} bytes long ({magic!r}); a GGUF file starts with {MAGIC!r}")
    magic = src.take(4, "the magic")
    if magic != MAGIC:
        raise src.corrupt(f"not a GGUF file: starts with {magic!r}, expected {MAGIC!r}")
    version = src.u32("the version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS:
            raise UnsupportedFormat(f"big-endian GGUF v{swapped}; qconv reads little-endian GGUF v2 and v3 only",
                                    file=src.path)
        if version == 0:
            raise src.corrupt("GGUF version 0; there is no such version (GGUF v2 and v3 are read)")
        raise UnsupportedFormat(f"GGUF version {version}; qconv reads GGUF v2 and v3 "
                                f"(convert it with a current llama.cpp)", file=src.path)
    n_tensors = src.u64("the tensor count")
    n_kv = src.u64("the metadata key count")
    # Each key/value takes at least 13 bytes (8 length, 4 type, 1 value), each tensor info 32 (8 name
    # length, 4 n_dims, one 8-byte dimension, 4 type, 8 offset): counts the file cannot hold are lies.
    if n_kv * 13 + n_tensors * 32 > src.left():
        raise src.corrupt(f"header claims {n_tensors} tensors and {n_kv} metadata keys, more than the "
                          f"{src.left()} bytes left in the file can hold")
    return version, n_tensors, n_kv


def _metadata(src: _Source, n_kv: int) -> tuple[dict[str, Any], int]:
    """The key/value pairs (each key once) and the data alignment (general.alignment, a power of two)."""
    metadata: dict[str, Any] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = src.string(f"metadata key {i} of {n_kv}", limit=MAX_NAME_BYTES)
        if key in metadata:
            raise src.corrupt(f"metadata key {key!r} appears twice")
        vtype = src.u32(f"the value type of key {key!r}")
        metadata[key] = _value(src, vtype, f"key {key!r}", 0)
        if key == "general.alignment":
            if vtype != 4:
                raise src.corrupt(f"key 'general.alignment' is of type {VALUE_TYPES[vtype][0]}, expected uint32")
            alignment = metadata[key]
            if alignment == 0 or alignment & (alignment - 1):
                raise src.corrupt(f"key 'general.alignment' is {alignment}, expected a power of two")
    return metadata, alignment


def _tensor_infos(src: _Source, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, ggml type, offset in the data) per tensor info, names unique, 1 to MAX_DIMS dims."""
    infos = []
    seen: set[str] = set()
    for i in range(n_tensors):
        where = f"tensor info {i} of {n_tensors}"
        name = src.string(f"the name of {where}", limit=MAX_NAME_BYTES)
        if name in seen:
            raise src.corrupt("appears twice among the tensor infos", name)
        seen.add(name)
        n_dims = src.u32("its n_dims", name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise src.corrupt(f"has {n_dims} dimensions, expected 1 to {MAX_DIMS}", name)
        shape = tuple(src.u64(f"dimension {d}", name) for d in range(n_dims))
        type_id = src.u32("its ggml type", name)
        rel = src.u64("its offset", name)
        infos.append((name, shape, type_id, rel))
    return infos


def _tensor(src: _Source, name: str, shape: tuple[int, ...], type_id: int, rel: int, alignment: int,
            data_offset: int) -> GGUFTensor:
    """One tensor info checked: a known type, whole blocks, an aligned offset, data inside the file."""
    if type_id not in GGML_TYPES:
        raise UnsupportedFormat(f"unknown ggml type {type_id} (removed from ggml, or newer than the types "
                                f"qconv knows: {', '.join(n for n, _, _ in GGML_TYPES.values())})",
                                file=src.path, tensor=name)
    type_name, block, type_size = GGML_TYPES[type_id]
    numel = 1
    for d, ne in enumerate(shape):
        if ne > _INT64_MAX:
            raise src.corrupt(f"dimension {d} is {ne}, negative as ggml's int64", name)
        numel *= ne
    if numel > _INT64_MAX:
        raise src.corrupt(f"shape {list(shape)} has {numel} elements, more than an int64 holds", name)
    if shape[0] % block:
        raise src.corrupt(f"first dimension {shape[0]} is not a multiple of {type_name}'s "
                          f"{block}-weight blocks", name)
    nbytes = numel // block * type_size
    if rel % alignment:
        raise src.corrupt(f"offset {rel} is not a multiple of the alignment {alignment}", name)
    if data_offset + rel + nbytes > src.size:
        raise src.corrupt(f"data [{data_offset + rel}, {data_offset + rel + nbytes}) runs past the end of "
                          f"the file ({src.size} bytes)", name)
    return GGUFTensor(name, shape, type_id, type_name, data_offset + rel, nbytes, src.path)


def _check_overlaps(src: _Source, tensors: list[GGUFTensor]) -> None:
    """No two tensors' data overlap (empty tensors take no room)."""
    placed = sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset)
    for a, b in zip(placed, placed[1:]):
        if b.offset < a.offset + a.nbytes:
            raise src.corrupt(f"data [{b.offset}, {b.offset + b.nbytes}) overlaps tensor {a.name!r} "
                              f"[{a.offset}, {a.offset + a.nbytes})", b.name)


def _value(src: _Source, vtype: int, what: str, depth: int):
    if vtype not in VALUE_TYPES:
        raise src.corrupt(f"{what}: unknown value type {vtype} (known: 0 to 12)")
    name, fmt, _ = VALUE_TYPES[vtype]
    if vtype == _STRING:
        return src.string(what)
    if vtype != _ARRAY:
        size = struct.calcsize(fmt)
        (v,) = struct.unpack(fmt, src.take(size, what))
        return _scalar(vtype, v)
    if depth >= MAX_NESTING:
        raise src.corrupt(f"{what}: arrays nested more than {MAX_NESTING} deep")
    etype = src.u32(f"the element type of {what}")
    if etype not in VALUE_TYPES:
        raise src.corrupt(f"{what}: unknown array element type {etype} (known: 0 to 12)")
    count = src.u64(f"the element count of {what}")
    ename, efmt, emin = VALUE_TYPES[etype]
    if count * emin > src.left():
        raise src.corrupt(f"{what}: array claims {count} {ename} elements (at least {count * emin} bytes), "
                          f"but only {src.left()} bytes are left in the file")
    keep = count if count <= KEEP_ELEMENTS else HEAD_ELEMENTS
    if efmt is not None:                                  # fixed-size elements: read the kept ones, skip the rest
        esize = struct.calcsize(efmt)
        raw = src.take(keep * esize, what)
        items = [_scalar(etype, v) for (v,) in struct.iter_unpack(efmt, raw)]
        src.skip((count - keep) * esize, what)
    else:
        items = [_value(src, etype, f"{what}[{j}]", depth + 1) for j in range(keep)]
        if etype == _STRING:                              # hot path: a tokenizer's 150k tokens
            for j in range(keep, count):
                src.string(f"{what}[{j}]")
        else:
            for j in range(keep, count):
                _value(src, etype, f"{what}[{j}]", depth + 1)
    if count <= KEEP_ELEMENTS:
        return items
    return Elided(f"array[{ename}]", count, tuple(items))


def _scalar(vtype: int, v):
    if vtype == _BOOL:
        return bool(v)
    if vtype == _F32:
        return _shortest_f32(v)
    return v


def _shortest_f32(v: float) -> float:
    """The shortest decimal that is the same float32 (1e-06, not 9.999999974752427e-07), for reports."""
    packed = _F32S.pack(v)
    for digits in range(1, 10):
        try:
            shorter = float(f"{v:.{digits}g}")
            if _F32S.pack(shorter) == packed:
                return shorter
        except (OverflowError, ValueError):
            break
    return v


# ---------------------------------------------------------------------------------------------
# Report

def summary(header: GGUFHeader) -> dict:
    """What `qconv inspect` reports for a GGUF file (JSON-ready): the model, bytes and parameters by ggml
    type, bits per weight, the tokenizer, the architecture's hyperparameters and split info."""
    md = header.metadata
    arch = md.get("general.architecture")
    by_type: dict[str, dict[str, int]] = {}
    params = tensor_bytes = quantized = 0
    for t in header.tensors:
        row = by_type.setdefault(t.type_name, {"tensors": 0, "parameters": 0, "bytes": 0,
                                               "bits_per_weight": bits_per_weight(t.type)})
        row["tensors"] += 1
        row["parameters"] += t.numel
        row["bytes"] += t.nbytes
        params += t.numel
        tensor_bytes += t.nbytes
        if is_quantized(t.type):
            quantized += t.numel
    ftype = md.get("general.file_type")
    report: dict[str, Any] = {
        "version": header.version,
        "architecture": arch,
        "name": md.get("general.name"),
        "file_type": (FILE_TYPES.get(ftype, f"unknown ({ftype})") if isinstance(ftype, int) else None),
        "tensors": len(header.tensors),
        "parameters": params,
        "tensor_bytes": tensor_bytes,
        "bits_per_weight": round(8 * tensor_bytes / params, 3) if params else None,
        "quantized_parameters": quantized,
        "quantized_share": round(quantized / params, 4) if params else None,
        "types": dict(sorted(by_type.items(), key=lambda kv: (-kv[1]["bytes"], kv[0]))),
        "metadata_keys": len(md),
        "alignment": header.alignment,
        "data_offset": header.data_offset,
        "file_size": header.file_size,
    }
    if any(k.startswith("tokenizer.") for k in md):
        report["tokenizer"] = {
            "model": md.get("tokenizer.ggml.model"),
            "pre": md.get("tokenizer.ggml.pre"),
            "tokens": count(md.get("tokenizer.ggml.tokens")),
            "merges": count(md.get("tokenizer.ggml.merges")),
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
            "chat_template": "tokenizer.chat_template" in md,
        }
    if isinstance(arch, str):
        report["hparams"] = {k: plain(v) for k, v in md.items() if k.startswith(f"{arch}.")}
    if md.get("general.type") == "mmproj":            # a vision tower for llama.cpp's libmtmd (gguf/mmproj.py)
        names = [t.name for t in header.tensors]
        report["mmproj"] = {
            "projector": md.get("clip.projector_type") or md.get("clip.vision.projector_type"),
            "vision_blocks": md.get("clip.vision.block_count"),
            "deepstack_layers": len({n.split(".")[2] for n in names if n.startswith("v.deepstack.")}),
            "projector_tensors": sum(1 for n in names if n.startswith("mm.")),
        }
    if "split.no" in md or "split.count" in md:
        report["split"] = {"no": md.get("split.no"), "count": md.get("split.count"),
                           "tensors": md.get("split.tensors.count")}
        if header.files:                              # a whole split set (split.read_gguf): its totals above
            report["split"]["files"] = [p.name for p in header.files]
    return report


def count(value) -> int | None:
    """An array value's length, an elided one's included (None: not an array)."""
    if isinstance(value, Elided):
        return value.count
    if isinstance(value, list):
        return len(value)
    return None


# ---------------------------------------------------------------------------------------------
# The "gguf" family (formats/core/registry.py): modules of a GGUF opened as a source (source.py)

# block types qconv's canonical representation holds exactly: (scheme, bits); Q4_1 / Q5_1 / Q4_K / Q5_K as
# codes with float offsets in groups of 32 (OFFSET_TYPES); the others (Q2_K / Q3_K / Q6_K: 16-weight
# sub-blocks; IQ types) are read as their exact float weights, decoded by gguf-py (codec.read), which convert
# requantizes with the error reported (a FloatSpec, formats/core/ir.py)
EXACT_TYPES = {"Q8_0": ("int8", 8), "Q4_0": ("int4", 4), "Q5_0": ("int5", 5), "MXFP4": ("e2m1", 4),
               "Q4_1": ("int4", 4), "Q5_1": ("int5", 5), "Q4_K": ("int4", 4), "Q5_K": ("int5", 5)}
OFFSET_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def float_spec(type_name: str, type_id: int) -> dict:
    """The FloatSpec fields of a block type qconv keeps no codes of: requantized by default to 4 bits
    below 5.5 bits a weight (Q3_K, Q2_K, IQ4_XS, ...), else to 8 (Q6_K), in groups of 32
    (ggml's blocks and K-quants' sub-blocks); --bits / --group-size override both."""
    return {"name": type_name, "origin": f"GGUF {type_name}", "group_size": 32,
            "bits": 4 if bits_per_weight(type_id) < 5.5 else 8}


def find_modules(tensors: Mapping, qc: Mapping | None) -> list:
    """One module per block tensor of a GGUF source's decoder layers (its quantization_config's
    ggml_types), from headers alone; embeddings and lm_head stored as blocks are float tensors decoded
    when read (source.py), as the folder formats keep them."""
    from ..core.layout import QuantModule

    types = (qc or {}).get("ggml_types") or {}
    order = (qc or {}).get("row_order") or {}
    out = []
    for name, type_name in types.items():
        info = tensors.get(name)
        entry = next(((tid, v) for tid, v in GGML_TYPES.items() if v[0] == type_name), None)
        if info is None or entry is None or not name.endswith(".weight"):
            continue
        tid, (_, block, size) = entry
        rows, row_bytes = info.shape
        scheme, bits = EXACT_TYPES.get(type_name, (type_name.lower(), 0))
        details = {"ggml_type": type_name,
                   "scales_dtype": "U8" if type_name == "MXFP4" else "F32" if type_name.endswith("_K") else "F16"}
        if type_name not in EXACT_TYPES:
            details["float_spec"] = float_spec(type_name, tid)
        group = block
        if type_name in OFFSET_TYPES:               # float minimums, one per 32 weights (a K-quant's sub-block)
            details["offset"], group = "float", 32
        if name in order:
            details["heads"] = int(order[name])
        out.append(QuantModule(name[: -len(".weight")], "gguf", scheme, bits, rows, row_bytes // size * block,
                               (name,), (), group_size=group, details=details))
    return out


def check(m, tensors: Mapping, qc: Mapping | None) -> None:
    """Every block type is read: exactly (EXACT_TYPES) or as its decoded float weights (float_spec)."""
    return None


def settings(qc: Mapping | None, modules: list) -> dict:
    return {"ggml_types": sorted({m.details["ggml_type"] for m in modules})}


def lint(qc, modules, all_modules, comp, warnings) -> None:
    return None
