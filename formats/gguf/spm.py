"""SentencePiece's ``tokenizer.model`` read with the standard library only (no sentencepiece, no protobuf):
the pieces, their scores and types, and the few trainer / normalizer settings llama.cpp's "llama" vocab
depends on. It is a protobuf (sentencepiece_model.proto), read as one::

    ModelProto      1: repeated SentencePiece pieces   2: TrainerSpec   3: NormalizerSpec   (others skipped)
    SentencePiece   1: string piece   2: float score   3: enum type (NORMAL 1, UNKNOWN 2, CONTROL 3,
                                                                    USER_DEFINED 4, UNUSED 5, BYTE 6)
    TrainerSpec     3: model_type (UNIGRAM 1, BPE 2, WORD 3, CHAR 4)   24: treat_whitespace_as_suffix
                    35: byte_fallback   40-43: unk / bos / eos / pad id (int32, -1 for none)
    NormalizerSpec  2: precompiled_charsmap   3: add_dummy_prefix   4: remove_extra_whitespaces
                    5: escape_whitespaces

    a field = varint key (number << 3 | wire type), then by wire type: 0 varint, 1 eight bytes,
              2 varint length + that many bytes (strings, nested messages), 5 four bytes

Every length is the file's claim: each is checked against the bytes left in its enclosing message before
anything is sliced (slices are views of the one buffer read, at most MAX_MODEL_BYTES), varints are at most
ten bytes, and nesting is two messages deep. A malformed file is refused in one line naming it
(CorruptCheckpoint), a well-formed one llama.cpp's vocab cannot tokenize like sentencepiece does
(UnsupportedFormat), never a traceback.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..storage.safetensors_header import open_regular

MAX_MODEL_BYTES = 64 << 20      # Llama-2's is 0.5 MB, the largest released ones a few MB
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6     # = llama.cpp's token types
_TYPES = {NORMAL: "NORMAL", UNKNOWN: "UNKNOWN", CONTROL: "CONTROL", USER_DEFINED: "USER_DEFINED",
          UNUSED: "UNUSED", BYTE: "BYTE"}
_MODEL_TYPES = {1: "UNIGRAM", 2: "BPE", 3: "WORD", 4: "CHAR"}
_F32 = struct.Struct("<f")


@dataclass(frozen=True)
class SpModel:
    pieces: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]          # sentencepiece's piece types, which are llama.cpp's token types
    model_type: int = 1             # TrainerSpec defaults (sentencepiece_model.proto) where the file has none
    byte_fallback: bool = False
    treat_whitespace_as_suffix: bool = False
    special_ids: tuple[tuple[str, int], ...] = (("unk", 0), ("bos", 1), ("eos", 2), ("pad", -1))
    charsmap_bytes: int = 0         # NormalizerSpec.precompiled_charsmap (0: no normalization)
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


class _Message:
    """The fields of one protobuf message: buf[start:end], a view of the file's bytes."""

    def __init__(self, buf: memoryview, start: int, end: int, path: Path, what: str):
        self.buf, self.pos, self.end, self.path, self.what = buf, start, end, path, what

    def corrupt(self, problem: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"is not a SentencePiece model: {self.what} {problem}", file=self.path)

    def varint(self, what: str) -> int:
        value = 0
        for shift in range(0, 70, 7):
            if self.pos >= self.end:
                raise self.corrupt(f"ends inside {what} at byte {self.pos} (truncated)")
            b = self.buf[self.pos]
            self.pos += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                if value >> 64:
                    break
                return value
        raise self.corrupt(f"has {what} longer than a 64-bit varint at byte {self.pos}")

    def fields(self):
        """(field number, wire type, value): an int for varints, a (start, end) span for length-delimited
        fields, the raw bytes for fixed 32 / 64-bit ones."""
        while self.pos < self.end:
            at = self.pos
            key = self.varint("a field key")
            number, wire = key >> 3, key & 7
            if number == 0 or number >= 1 << 29:
                raise self.corrupt(f"has field number {number} at byte {at}")
            if wire == 0:
                yield number, wire, self.varint(f"field {number}")
            elif wire in (1, 5):
                n = 8 if wire == 1 else 4
                if n > self.end - self.pos:
                    raise self.corrupt(f"ends inside field {number} at byte {self.pos} (truncated)")
                self.pos += n
                yield number, wire, bytes(self.buf[self.pos - n:self.pos])
            elif wire == 2:
                n = self.varint(f"the length of field {number}")
                if n > self.end - self.pos:
                    raise self.corrupt(f"field {number} at byte {at} claims {n} bytes, but only "
                                       f"{self.end - self.pos} are left in it (truncated, or a lying length)")
                self.pos += n
                yield number, wire, (self.pos - n, self.pos)
            else:
                raise self.corrupt(f"has wire type {wire} (field {number}, byte {at}), which "
                                   f"sentencepiece_model.proto never uses")

    def expect(self, number: int, wire: int, want: int, name: str) -> None:
        if wire != want:
            raise self.corrupt(f"has {name} (field {number}) with wire type {wire}, expected {want}")

    def sub(self, span, what: str) -> "_Message":
        return _Message(self.buf, span[0], span[1], self.path, what)

    def text(self, span, what: str) -> str:
        try:
            return str(self.buf[span[0]:span[1]], "utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"has {what} that is not UTF-8") from None


def _int32(value: int) -> int:
    """A protobuf int32 (negative ones are ten-byte varints of the 64-bit two's complement)."""
    value &= (1 << 64) - 1
    value = value - (1 << 64) if value >> 63 else value
    return value if -(1 << 31) <= value < 1 << 31 else -1


def read_model(path: Path) -> SpModel:
    """Parse and check ``tokenizer.model``; refuses what sentencepiece itself would not load (no pieces,
    an empty or repeated piece, an unknown piece type, no unknown piece or two)."""
    path = Path(path)
    try:
        with open_regular(path, what="tokenizer.model") as f:
            raw = f.read(min(os.fstat(f.fileno()).st_size, MAX_MODEL_BYTES) + 1)
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read tokenizer.model: {exc.strerror or exc}", file=path) from None
    if len(raw) > MAX_MODEL_BYTES:
        raise CorruptCheckpoint(f"tokenizer.model is over {MAX_MODEL_BYTES} bytes, larger than any real "
                                f"SentencePiece model", file=path)
    buf = memoryview(raw)
    top = _Message(buf, 0, len(buf), path, "ModelProto")
    pieces, scores, types, trainer, normalizer, specs = [], [], [], {}, {}, set()
    for number, wire, value in top.fields():
        if number == 1:
            top.expect(number, wire, 2, "a piece")
            piece, score, kind = _piece(top.sub(value, f"piece {len(pieces)}"))
            pieces.append(piece)
            scores.append(score)
            types.append(kind)
        elif number in (2, 3):
            top.expect(number, wire, 2, "trainer_spec" if number == 2 else "normalizer_spec")
            spec = top.sub(value, "trainer_spec" if number == 2 else "normalizer_spec")
            (trainer if number == 2 else normalizer).update(_scalars(spec))
            specs.add(number)
    if not pieces:
        raise CorruptCheckpoint("is not a SentencePiece model: it has no pieces", file=path)
    if specs != {2, 3}:                               # sentencepiece writes both after the pieces: a file cut
        missing = " and ".join(n for k, n in ((2, "trainer_spec"), (3, "normalizer_spec")) if k not in specs)
        raise CorruptCheckpoint(f"is not a whole SentencePiece model: it has no {missing} (truncated?)", file=path)
    seen: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if not piece:
            raise CorruptCheckpoint(f"SentencePiece model: piece {i} is empty", file=path)
        if piece in seen:
            raise CorruptCheckpoint(f"SentencePiece model: piece {i} {piece!r} repeats piece {seen[piece]}",
                                    file=path)
        seen[piece] = i
    unknown = [i for i, t in enumerate(types) if t == UNKNOWN]
    if len(unknown) != 1:
        raise CorruptCheckpoint(f"SentencePiece model: {len(unknown)} pieces of type UNKNOWN (ids "
                                f"{unknown[:4]}), where sentencepiece needs exactly one", file=path)
    special = tuple((name, _int32(trainer.get(field, default)))
                    for name, field, default in (("unk", 40, 0), ("bos", 41, 1), ("eos", 42, 2), ("pad", 43, -1)))
    return SpModel(tuple(pieces), tuple(scores), tuple(types), model_type=trainer.get(3, 1),
                   byte_fallback=bool(trainer.get(35, 0)), treat_whitespace_as_suffix=bool(trainer.get(24, 0)),
                   special_ids=special, charsmap_bytes=normalizer.get(2, 0),
                   add_dummy_prefix=bool(normalizer.get(3, 1)), remove_extra_whitespaces=bool(normalizer.get(4, 1)),
                   escape_whitespaces=bool(normalizer.get(5, 1)))


def _piece(msg: _Message) -> tuple[str, float, int]:
    piece, score, kind = "", 0.0, NORMAL
    for number, wire, value in msg.fields():
        if number == 1:
            msg.expect(number, wire, 2, "its piece")
            piece = msg.text(value, "its piece")
        elif number == 2:
            msg.expect(number, wire, 5, "its score")
            (score,) = _F32.unpack(value)
        elif number == 3:
            msg.expect(number, wire, 0, "its type")
            if value not in _TYPES:
                raise msg.corrupt(f"has type {value}, not one of sentencepiece's (1 to 6)")
            kind = value
    return piece, score, kind


def _scalars(msg: _Message) -> dict[int, int]:
    """A spec's varint fields by number, and the byte length of its length-delimited ones (strings are
    not needed here: a non-empty precompiled_charsmap is all that matters)."""
    out = {}
    for number, wire, value in msg.fields():
        if wire == 0:
            out[number] = value
        elif wire == 2:
            out[number] = value[1] - value[0]
    return out


def check_llama_cpp_can_tokenize(model: SpModel, path: Path) -> None:
    """llama.cpp's "llama" vocab (llm_tokenizer_spm) merges adjacent pieces by score, as sentencepiece's
    BPE model does, escapes spaces to U+2581 and prepends one (add_dummy_prefix); it does no Unicode
    normalization and never collapses whitespace. A model that asks sentencepiece for anything else would
    be tokenized differently by llama.cpp; llama.cpp's converter writes it anyway, qconv refuses it."""
    why = None
    if model.model_type != 2:
        why = (f"its model_type is {_MODEL_TYPES.get(model.model_type, model.model_type)}, and llama.cpp's "
               f"'llama' vocab merges pieces as sentencepiece's BPE does (qconv maps BPE models)")
    elif model.charsmap_bytes:
        why = (f"it normalizes text ({model.charsmap_bytes}-byte precompiled_charsmap), which llama.cpp's "
               f"'llama' vocab does not")
    elif model.remove_extra_whitespaces:
        why = "it collapses runs of whitespace (remove_extra_whitespaces), which llama.cpp's 'llama' vocab does not"
    elif not model.escape_whitespaces or model.treat_whitespace_as_suffix:
        why = "its whitespace handling (escape_whitespaces off or treat_whitespace_as_suffix) is not llama.cpp's"
    if why:
        raise UnsupportedFormat(f"SentencePiece model: {why}; nothing written", file=path)
    bad = next((i for i, s in enumerate(model.scores) if not math.isfinite(s)), None)
    if bad is not None:
        raise CorruptCheckpoint(f"SentencePiece model: piece {bad} has score {model.scores[bad]}", file=path)
