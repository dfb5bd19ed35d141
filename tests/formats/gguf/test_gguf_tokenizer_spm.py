"""SentencePiece tokenizers into GGUF (`qconv convert SRC out.gguf --to gguf`, formats/gguf/spm.py and
tokenizer._sentencepiece_tokenizer): a folder with tokenizer.model gets llama.cpp's "llama" vocab.

The tokenizer is fixtures/tokenizers/llama-spm (a real BPE model with byte fallback and 512 pieces,
trained by the sentencepiece trainer: fixtures/make_spm_tokenizer.py), paired with llama-gptq-w8g128's
weights (vocab_size 512) in a temporary folder without that fixture's tokenizer.json. Checked against
sentencepiece's own API on the same model, against llama.cpp's converter (convert_hf_to_gguf.py
--vocab-only, from the llama-cpp-python sdist bin/setup llamacpp keeps in .venv-llamacpp/src) on the same folder, and
bad files are refused in one line with nothing written. llama.cpp tokenizing with the written vocabulary:
tests/consumers/test_llamacpp.py.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import CHECKPOINTS, FIXTURES, REPO, SPM, one_error, run_qconv, spm_folder

sentencepiece = pytest.importorskip("sentencepiece")

WEIGHTS = "llama-gptq-w8g128"
# llama.cpp's own converter, from the sdist bin/setup llamacpp builds the bindings from and keeps extracted
LLAMACPP = REPO / ".venv-llamacpp" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def tokenizer_fields(path: Path) -> dict:
    """Every tokenizer.* key of a GGUF, read by gguf-py."""
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def convert(src: Path, dst: Path) -> dict:
    run_qconv("convert", src, dst, "--to", "gguf", check=0)
    return tokenizer_fields(dst)


@pytest.fixture(scope="module")
def sp():
    return sentencepiece.SentencePieceProcessor(model_file=str(SPM / "tokenizer.model"))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm")
    return convert(spm_folder(tmp / "src"), tmp / "out.gguf")


def sp_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return UNKNOWN
    if sp.is_control(i):
        return CONTROL
    if sp.is_unused(i):
        return UNUSED
    if sp.is_byte(i):
        return BYTE
    return NORMAL


def test_fixture_is_what_its_script_trains():
    """fixtures/make_spm_tokenizer.py regenerates tokenizer.model byte for byte (the trainer, one thread,
    from the corpus beside it); it is the model the llama fixtures' vocab_size asks for."""
    sys.path.insert(0, str(FIXTURES))
    try:
        import make_spm_tokenizer
    finally:
        sys.path.remove(str(FIXTURES))
    assert make_spm_tokenizer.train(SPM / "corpus.txt") == (SPM / "tokenizer.model").read_bytes()
    config = json.loads((CHECKPOINTS / WEIGHTS / "config.json").read_text())
    model = sentencepiece.SentencePieceProcessor(model_file=str(SPM / "tokenizer.model"))
    assert model.vocab_size() == config["vocab_size"] == 512
    assert (model.unk_id(), model.bos_id(), model.eos_id(), model.pad_id()) == (0, 1, 2, -1)
    assert sum(model.is_byte(i) for i in range(512)) == 256


def test_reader_reads_what_sentencepiece_reads(sp):
    """qconv's stdlib protobuf reader: the same pieces, scores (float32) and types as sentencepiece."""
    from qconv.formats.gguf import spm

    model = spm.read_model(SPM / "tokenizer.model")
    assert list(model.pieces) == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    assert list(model.scores) == [sp.get_score(i) for i in range(sp.vocab_size())]
    assert list(model.types) == [sp_type(sp, i) for i in range(sp.vocab_size())]
    assert (model.model_type, model.byte_fallback, model.add_dummy_prefix, model.remove_extra_whitespaces) == \
        (2, True, True, False)
    assert dict(model.special_ids) == {"unk": 0, "bos": 1, "eos": 2, "pad": -1}


def test_gguf_vocab_is_sentencepieces(sp, written):
    """tokens, scores (the model's own, not gguf-py LlamaHfVocab's -1000) and token types equal
    sentencepiece's id_to_piece / get_score / is_*; the special ids are its ids; llama.cpp's "llama"
    model with the default pre-tokenizer, its dummy prefix, tokenizer_config.json's add_bos / add_eos
    and chat template."""
    n = sp.vocab_size()
    assert written["tokenizer.ggml.model"] == "llama" and written["tokenizer.ggml.pre"] == "default"
    assert written["tokenizer.ggml.tokens"] == [sp.id_to_piece(i) for i in range(n)]
    np.testing.assert_array_equal(np.float32(written["tokenizer.ggml.scores"]),
                                  np.float32([sp.get_score(i) for i in range(n)]))
    assert written["tokenizer.ggml.token_type"] == [sp_type(sp, i) for i in range(n)]
    assert sorted(set(written["tokenizer.ggml.token_type"])) == [NORMAL, UNKNOWN, CONTROL, BYTE]
    assert (written["tokenizer.ggml.bos_token_id"], written["tokenizer.ggml.eos_token_id"],
            written["tokenizer.ggml.unknown_token_id"]) == (sp.bos_id(), sp.eos_id(), sp.unk_id())
    assert written["tokenizer.ggml.padding_token_id"] == 0        # config.json's pad_token_id
    assert written["tokenizer.ggml.add_space_prefix"] is True
    assert (written["tokenizer.ggml.add_bos_token"], written["tokenizer.ggml.add_eos_token"]) == (True, False)
    tc = json.loads((SPM / "tokenizer_config.json").read_text())
    assert written["tokenizer.chat_template"] == tc["chat_template"]
    assert "tokenizer.ggml.merges" not in written


def test_inspect_reports_the_llama_tokenizer(tmp_path):
    spm_folder(tmp_path / "src")
    run_qconv("convert", tmp_path / "src", tmp_path / "out.gguf", "--to", "gguf", check=0)
    text = run_qconv("inspect", tmp_path / "out.gguf", check=0).stdout
    assert "tokenizer: llama (pre default), 512 tokens, bos 1, eos 2, chat template" in text
    tok = json.loads(run_qconv("inspect", "--json", tmp_path / "out.gguf", check=0).stdout)["gguf"]["tokenizer"]
    assert (tok["model"], tok["tokens"], tok["merges"]) == ("llama", 512, None)


def _converter(src: Path, dst: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LLAMACPP / "gguf-py"), str(LLAMACPP)])}
    proc = subprocess.run([sys.executable, str(LLAMACPP / "convert_hf_to_gguf.py"), str(src), "--vocab-only",
                           "--outfile", str(dst)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tokenizer_fields(dst)


# the keys where qconv writes more than llama.cpp's converter, on purpose (tokenizer._sentencepiece_tokenizer):
# the model's add_dummy_prefix (llama.cpp's default for "llama" is the same, true) and the unk id named
# by tokenizer_config.json's unk_token (the converter finds names only in a tokenizer.json; llama.cpp's
# default unk for "llama" is the same, 0)
BEYOND_CONVERTER = {"tokenizer.ggml.add_space_prefix": True, "tokenizer.ggml.unknown_token_id": 0}


@pytest.mark.consumer(LLAMACPP / "convert_hf_to_gguf.py", "llama.cpp's converter (bin/setup llamacpp)")
@pytest.mark.parametrize("variant", ["plain", "added-and-padded"])
def test_gguf_vocab_is_llama_cpp_converters(tmp_path, variant):
    """The same folder through llama.cpp's own converter (--vocab-only: _set_vocab_sentencepiece and
    gguf.SpecialVocab): every tokenizer key equal but BEYOND_CONVERTER's. "added-and-padded": vocab_size
    520 (padding [PAD512]... at -10000, UNUSED), added_tokens.json (USER_DEFINED, -1000) and
    tokenizer_config.json's added_tokens_decoder (special: CONTROL; a token that looks special: CONTROL;
    another: USER_DEFINED with "▁" as a space; each -1000; one restating <s>)."""
    src = spm_folder(tmp_path / "src", **({"vocab_size": 520} if variant != "plain" else {}))
    if variant != "plain":
        (src / "added_tokens.json").write_text(json.dumps({"<extra_a>": 512, "<extra_b>": 513, "<far>": 600}))
        tc = json.loads((src / "tokenizer_config.json").read_text())
        tc["added_tokens_decoder"] = {
            "1": {"content": "<s>", "special": True}, "513": {"content": "<|im_end|>", "special": False},
            "514": {"content": "▁user▁name", "special": False}, "515": {"content": "<sys>", "special": True}}
        (src / "tokenizer_config.json").write_text(json.dumps(tc))
    ours = convert(src, tmp_path / "qconv.gguf")
    theirs = _converter(src, tmp_path / "converter.gguf")
    for key, value in BEYOND_CONVERTER.items():
        assert ours.pop(key) == value and key not in theirs, key
    assert ours.keys() == theirs.keys()
    for key in ours:
        if key == "tokenizer.ggml.scores":
            np.testing.assert_array_equal(np.float32(ours[key]), np.float32(theirs[key]))
        else:
            assert ours[key] == theirs[key], key
    if variant != "plain":
        tokens, types = ours["tokenizer.ggml.tokens"], ours["tokenizer.ggml.token_type"]
        assert tokens[512:517] == ["<extra_a>", "<|im_end|>", " user name", "<sys>", "[PAD516]"]
        assert types[512:517] == [USER_DEFINED, CONTROL, USER_DEFINED, CONTROL, UNUSED]
        assert ours["tokenizer.ggml.scores"][512:517] == [-1000.0] * 4 + [-10000.0]


def _metaspace_json() -> dict:
    """A tokenizer.json as transformers' LlamaTokenizerFast saves one (Metaspace, byte fallback)."""
    return {"version": "1.0", "added_tokens": [{"id": 0, "content": "<unk>", "special": True},
                                               {"id": 1, "content": "<s>", "special": True},
                                               {"id": 2, "content": "</s>", "special": True}],
            "normalizer": None,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
            "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                       {"Sequence": {"id": "A", "type_id": 0}}]},
            "model": {"type": "BPE", "byte_fallback": True, "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2}, "merges": []}}


def test_sentencepiece_style_tokenizer_json_uses_tokenizer_model(tmp_path, written):
    """Beside tokenizer.model, a SentencePiece-style tokenizer.json (LlamaTokenizerFast's) is not read for
    the vocabulary: the GGUF's is the model's, as without it; its TemplateProcessing gives add_bos."""
    src = spm_folder(tmp_path / "src", tokenizer_json=_metaspace_json())
    tc = json.loads((src / "tokenizer_config.json").read_text())
    del tc["add_bos_token"]
    (src / "tokenizer_config.json").write_text(json.dumps(tc))
    ours = convert(src, tmp_path / "out.gguf")
    assert ours["tokenizer.ggml.model"] == "llama"
    for key in written:
        if key == "tokenizer.ggml.tokens":           # tokenizer.json's added <unk> <s> </s>: CONTROL, -1000
            assert ours[key] == written[key]
    assert ours["tokenizer.ggml.token_type"][:3] == [CONTROL] * 3
    assert ours["tokenizer.ggml.token_type"][3:] == written["tokenizer.ggml.token_type"][3:]
    assert ours["tokenizer.ggml.add_bos_token"] is True


def test_sentencepiece_style_tokenizer_json_without_model_is_refused(tmp_path):
    src = spm_folder(tmp_path / "src", tokenizer_json=_metaspace_json())
    (src / "tokenizer.model").unlink()
    proc = run_qconv("convert", src, tmp_path / "out.gguf", "--to", "gguf")
    one_error(proc, 5, str(src / "tokenizer.json"), "SentencePiece-style", "tokenizer.model")
    assert not (tmp_path / "out.gguf").exists()


def test_a_folder_with_no_tokenizer_is_refused(tmp_path):
    src = spm_folder(tmp_path / "src")
    (src / "tokenizer.model").unlink()
    proc = run_qconv("convert", src, tmp_path / "out.gguf", "--to", "gguf")
    one_error(proc, 5, "has no tokenizer.json or tokenizer.model")
    assert not (tmp_path / "out.gguf").exists()


# ---------------------------------------------------------------------------------------------------
# Bad tokenizer.model files: a small protobuf writer for the mutations


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _field(number: int, value) -> bytes:
    if isinstance(value, bytes):
        return _varint(number << 3 | 2) + _varint(len(value)) + value
    if isinstance(value, float):
        return _varint(number << 3 | 5) + struct.pack("<f", value)
    return _varint(number << 3) + _varint(value)


def _model(pieces=(("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3), ("\u2581a", -1.0, 1)),
           trainer=None, normalizer=None) -> bytes:
    trainer = {3: 2, **(trainer or {})}
    normalizer = {1: b"identity", 3: 1, 4: 0, **(normalizer or {})}
    body = b"".join(_field(1, _field(1, p.encode()) + _field(2, s) + _field(3, t)) for p, s, t in pieces)
    body += _field(2, b"".join(_field(k, v) for k, v in trainer.items()))
    return body + _field(3, b"".join(_field(k, v) for k, v in normalizer.items()))


def test_the_protobuf_writer_here_writes_what_sentencepiece_reads(tmp_path):
    (tmp_path / "m.model").write_bytes(_model())
    model = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    assert [model.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "\u2581a"]


REAL = (SPM / "tokenizer.model").read_bytes()
CORRUPT = {
    "empty": b"",
    "truncated-in-a-piece": REAL[:1000],
    "truncated-before-the-specs": REAL[:7311],
    "truncated-in-the-normalizer": REAL[:-3],
    "lying-length": b"\x0a" + _varint(1 << 60) + REAL[2:],
    "lying-piece-length": _model()[:2] + _field(1, b"\x0a\x7f<unk>") + _model()[2:],
    "endless-varint": b"\x08" + b"\xff" * 20,
    "group-wire-type": b"\x0b" + REAL,
    "not-utf8": _model(pieces=(("<unk>", 0.0, 2), ("QQQ", 0.0, 1))).replace(b"QQQ", b"\xff\xfe\xfd"),
    "unknown-piece-type": _model(pieces=(("<unk>", 0.0, 2), ("a", 0.0, 9))),
    "no-unknown-piece": _model(pieces=(("<s>", 0.0, 3), ("a", 0.0, 1))),
    "repeated-piece": _model(pieces=(("<unk>", 0.0, 2), ("a", 0.0, 1), ("a", -1.0, 1))),
    "not-a-model": b"GGUF\x03\x00\x00\x00" + b"\x00" * 64,
    "a-json-file": b'{"model": {"type": "BPE"}}',
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_bad_tokenizer_model_is_refused_in_one_line(tmp_path, case):
    """Malformed (truncated, a length past its message, an unknown wire or piece type, what
    sentencepiece itself refuses): exit 4, one line naming the file, nothing written."""
    src = spm_folder(tmp_path / "src", model=CORRUPT[case])
    proc = run_qconv("convert", src, tmp_path / "out.gguf", "--to", "gguf")
    one_error(proc, 4, str(src / "tokenizer.model"))
    assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob("*.gguf*"))


UNSUPPORTED = {
    "unigram": _model(trainer={3: 1}),
    "normalizing": _model(normalizer={1: b"nmt_nfkc", 2: b"\x00" * 64}),
    "collapsing-whitespace": _model(normalizer={4: 1}),
    "whitespace-as-suffix": _model(trainer={24: 1}),
    "more-pieces-than-vocab_size": _model(pieces=[("<unk>", 0.0, 2)] + [(f"p{i}", -float(i), 1) for i in range(600)]),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_a_model_llama_cpp_would_tokenize_differently_is_refused(tmp_path, case):
    """Well-formed, but llama.cpp's "llama" vocab would not tokenize as sentencepiece does (or ids past
    the model's embeddings): exit 5, one line naming the file, nothing written."""
    src = spm_folder(tmp_path / "src", model=UNSUPPORTED[case])
    proc = run_qconv("convert", src, tmp_path / "out.gguf", "--to", "gguf")
    one_error(proc, 5, str(src / "tokenizer.model"), "nothing written")
    assert not (tmp_path / "out.gguf").exists()


def test_every_truncation_is_refused_and_no_length_is_allocated(tmp_path):
    """Every prefix of the real model is refused as corrupt (sentencepiece writes trainer_spec and
    normalizer_spec after the pieces, so a cut anywhere loses one); a length claiming 2^60 bytes is
    refused before anything of that size exists (the reader slices views of the bytes read)."""
    import tracemalloc

    from qconv.errors import CorruptCheckpoint
    from qconv.formats.gguf import spm

    path = tmp_path / "tokenizer.model"
    for n in range(len(REAL)):
        path.write_bytes(REAL[:n])
        with pytest.raises(CorruptCheckpoint):
            spm.read_model(path)
    path.write_bytes(CORRUPT["lying-length"])
    tracemalloc.start()
    with pytest.raises(CorruptCheckpoint, match="claims 1152921504606846976 bytes"):
        spm.read_model(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_llama_vocab_reads_back_as_a_tokenizer_transformers_loads(tmp_path, sp):
    """`qconv dequantize` (and convert to a folder) of a GGUF with llama.cpp's "llama" vocabulary writes
    tokenizer.json (tokenizer._llama_tokenizer_json, transformers' LlamaConverter's form) and
    tokenizer_config.json: transformers loads them and gives sentencepiece's ids with bos first, and
    decodes them back, on every string but the one that spells <s> (which transformers, as for Llama-2's
    own tokenizer.json, matches as the special token)."""
    from transformers import AutoTokenizer

    from conftest import SPM_STRINGS

    spm_folder(tmp_path / "src")
    run_qconv("convert", tmp_path / "src", tmp_path / "out.gguf", "--to", "gguf", check=0)
    proc = run_qconv("dequantize", tmp_path / "out.gguf", tmp_path / "float", check=0)
    assert "warning" not in proc.stderr, proc.stderr
    tok = AutoTokenizer.from_pretrained(tmp_path / "float")
    for text in SPM_STRINGS:
        ids = tok(text).input_ids
        if text.startswith("<s>"):
            assert ids[:2] == [1, 1], ids
            continue
        assert ids == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == text
    tc = json.loads((tmp_path / "float" / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"], tc["add_bos_token"]) == ("<s>", "</s>", "<unk>", True)
    run_qconv("convert", tmp_path / "out.gguf", tmp_path / "gptq", "--to", "gptq", check=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "gptq" / name).read_bytes() == (tmp_path / "float" / name).read_bytes()


def test_a_tokenizer_model_qconv_does_not_rebuild_is_said(tmp_path):
    """A GGUF whose tokenizer model is neither "gpt2" nor "llama": the folder read back has no tokenizer,
    and dequantize and convert say so in a warning."""
    spm_folder(tmp_path / "src")
    run_qconv("convert", tmp_path / "src", tmp_path / "out.gguf", "--to", "gguf", check=0)
    reader = gguf.GGUFReader(tmp_path / "out.gguf", "r+")
    field = reader.fields["tokenizer.ggml.model"]
    field.parts[field.data[0]][:] = np.frombuffer(b"weird", np.uint8)
    reader.data.flush()
    del reader
    proc = run_qconv("dequantize", tmp_path / "out.gguf", tmp_path / "float", check=0)
    assert "qconv: warning:" in proc.stderr and "tokenizer model 'weird'" in proc.stderr
    assert not list((tmp_path / "float").glob("tokenizer*"))
    for target in ("gptq", "float16"):
        proc = run_qconv("convert", "--json", tmp_path / "out.gguf", tmp_path / target, "--to", target, check=0)
        (comp,) = json.loads(proc.stdout)["components"]
        assert any("not one qconv rebuilds" in w for w in comp["warnings"]), comp["warnings"]


def test_gguf_to_gguf_keeps_the_llama_vocab(tmp_path, written):
    spm_folder(tmp_path / "src")
    run_qconv("convert", tmp_path / "src", tmp_path / "a.gguf", "--to", "gguf", check=0)
    assert convert(tmp_path / "a.gguf", tmp_path / "b.gguf") == tokenizer_fields(tmp_path / "a.gguf") == written


def test_random_byte_flips_are_read_or_refused_never_a_crash(tmp_path):
    """500 single-byte mutations of the real model (fixed seed): each is read, or refused as corrupt or
    unsupported, by the reader and its checks; no other exception."""
    import random

    from qconv.errors import CorruptCheckpoint, UnsupportedFormat
    from qconv.formats.gguf import spm

    rng, path, outcomes = random.Random(0), tmp_path / "tokenizer.model", {"read": 0, "refused": 0}
    for _ in range(500):
        raw = bytearray(REAL)
        raw[rng.randrange(len(raw))] = rng.randrange(256)
        path.write_bytes(bytes(raw))
        try:
            spm.check_llama_cpp_can_tokenize(spm.read_model(path), path)
            outcomes["read"] += 1
        except (CorruptCheckpoint, UnsupportedFormat) as exc:
            assert str(path) in str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and outcomes["read"] > 0, outcomes
