"""GGUF headers (formats/gguf/header.py) on real files written by llama.cpp's own gguf-py writer: every
tensor and metadata value agrees with gguf-py's reader, the summary and `qconv inspect` report them, and a
mutation set over one small real file (each refusal made by editing its bytes) is refused with one line
naming the file, exit 4 or 5, in bounded memory."""

import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType

from conftest import CHECKPOINTS, REPO, one_error, run_qconv, split_gguf
from qconv import inspect as api_inspect
from qconv.cli import main
from qconv.errors import CorruptCheckpoint, UnsupportedFormat, UsageError
from qconv.formats.gguf.header import (FILE_TYPES, GGML_TYPES, KEEP_ELEMENTS, Elided, bits_per_weight,
                                       looks_like_gguf, read_header, summary)
from qconv.formats.gguf.split import read_gguf

ALIGN = 64          # the small file's general.alignment: not the default, so the default is no accident


def _write(path, kv, tensors, *, alignment=None, **writer):
    w = gguf.GGUFWriter(path, "llama", **writer)
    if alignment:
        w.add_custom_alignment(alignment)
    for add, *args in kv:
        getattr(w, add)(*args)
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _small_kv():
    return [
        ("add_name", "Tiny Llama"), ("add_file_type", 7),
        ("add_context_length", 2048), ("add_embedding_length", 64), ("add_block_count", 2),
        ("add_head_count", 4), ("add_layer_norm_rms_eps", 1e-5), ("add_rope_freq_base", 10000.0),
        ("add_uint8", "test.u8", 200), ("add_int8", "test.i8", -3), ("add_uint16", "test.u16", 60000),
        ("add_int16", "test.i16", -30000), ("add_uint32", "test.u32", 4_000_000_000),
        ("add_int32", "test.i32", -2_000_000_000), ("add_uint64", "test.u64", 2**40),
        ("add_int64", "test.i64", -(2**40)), ("add_float32", "test.f32", 0.1), ("add_float64", "test.f64", 0.1),
        ("add_bool", "test.bool", True), ("add_string", "test.text", "héllo ✓"),
        ("add_string", "test.key_a", "a"), ("add_string", "test.key_b", "b"),
        ("add_array", "test.ints", [1, 2, 3]), ("add_array", "test.floats", [0.5, 1e-6]),
        ("add_array", "test.nested", [[1, 2], [3]]), ("add_array", "test.long", list(range(100))),
        ("add_uint16", "split.no", 0), ("add_uint16", "split.count", 1), ("add_int32", "split.tensors.count", 9),
        ("add_tokenizer_model", "gpt2"), ("add_tokenizer_pre", "qwen2"),
        ("add_token_list", [f"tok{i}" for i in range(100)]), ("add_token_merges", [f"t{i} o" for i in range(10)]),
        ("add_bos_token_id", 1), ("add_eos_token_id", 2), ("add_chat_template", "{{ messages }}"),
    ]


def _small_tensors():
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return [
        ("a.weight", gguf.quants.quantize(f32(8, 64), T.Q8_0), T.Q8_0),
        ("b.weight", gguf.quants.quantize(f32(4, 64), T.Q4_0), T.Q4_0),
        ("k.weight", rng.integers(0, 256, (2, 144), dtype=np.uint8), T.Q4_K),     # (2, 256) Q4_K blocks
        ("m.weight", gguf.quants.quantize(f32(2, 64), T.MXFP4), T.MXFP4),
        ("c.weight", f32(4, 32).astype(np.float16), None),
        ("e.weight", gguf.quants.quantize(f32(2, 32), T.BF16), T.BF16),
        ("x.weight", f32(2, 3, 32), None),                                         # 3-D, GGUF order (32, 3, 2)
        ("empty.weight", np.zeros((0, 32), np.float32), None),                     # a zero dimension is allowed
        ("norm.weight", f32(64), None),                                            # 256 bytes: no trailing pad
    ]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("gguf") / "small.gguf", _small_kv(), _small_tensors(), alignment=ALIGN)


@pytest.fixture(scope="module")
def layout(small):
    """Byte positions of the small file's fields, from gguf-py's reader: where each mutation edits."""
    r = GGUFReader(small)

    def at(field, part):
        return field.offset + sum(int(p.nbytes) for p in field.parts[:part])
    keys = {name: f for name, f in r.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in r.tensors}
    return {"r": r, "at": at, "keys": keys, "tensors": tensors, "ti": {n: t.field for n, t in tensors.items()},
            "end": max(t.data_offset + t.n_bytes for t in r.tensors)}


def _flat(value):
    """Our value flattened as gguf-py's ReaderField.contents() gives nested arrays."""
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    return [value]


def _same(ours, theirs, vtype):
    if vtype == GGUFValueType.FLOAT32:                    # ours is the shortest decimal of the same float32
        return np.float32(ours) == np.float32(theirs) and isinstance(ours, float)
    return ours == theirs and type(ours) is type(theirs)


# --- agreement with gguf-py ----------------------------------------------------------------------------

def test_tensors_agree_with_gguf_reader(small, layout):
    h = read_header(small)
    r = layout["r"]
    assert [t.name for t in h.tensors] == [t.name for t in r.tensors]
    for ours, theirs in zip(h.tensors, r.tensors):
        assert ours.shape == tuple(int(d) for d in theirs.shape), ours.name
        assert ours.type == int(theirs.tensor_type) and ours.type_name == theirs.tensor_type.name, ours.name
        assert ours.offset == theirs.data_offset and ours.offset % ALIGN == 0, ours.name
        assert ours.nbytes == theirs.n_bytes and ours.numel == theirs.n_elements, ours.name
    assert h.version == 3 and h.alignment == ALIGN == r.alignment and h.data_offset == r.data_offset
    assert h.file_size == small.stat().st_size
    shapes = {t.name: t.shape for t in h.tensors}
    assert shapes["x.weight"] == (32, 3, 2) and shapes["k.weight"] == (256, 2) and shapes["empty.weight"] == (32, 0)


def test_metadata_agrees_with_gguf_reader(small, layout):
    md = read_header(small).metadata
    assert list(md) == list(layout["keys"])
    for key, field in layout["keys"].items():
        ours, theirs, vtype = md[key], field.contents(), field.types[-1]
        if isinstance(ours, Elided):
            assert ours.count == len(theirs) and ours.type == f"array[{vtype.name.lower()}]", key
            assert all(_same(o, t, vtype) for o, t in zip(ours.head, theirs[:len(ours.head)], strict=True)), key
        elif isinstance(ours, list):
            flat = _flat(ours)
            assert len(flat) == len(theirs) and all(_same(o, t, vtype) for o, t in zip(flat, theirs)), key
        else:
            assert _same(ours, theirs, vtype), (key, ours, theirs)
    assert md["test.f32"] == 0.1 and md["llama.attention.layer_norm_rms_epsilon"] == 1e-5    # shortest decimals
    assert md["test.nested"] == [[1, 2], [3]] and md["test.text"] == "héllo ✓"
    assert md["test.long"] == Elided("array[int32]", 100, tuple(range(8)))
    assert len(md["test.ints"]) <= KEEP_ELEMENTS


def test_summary(small, layout):
    s = summary(read_header(small))
    r = layout["r"]
    params = sum(t.n_elements for t in r.tensors)
    nbytes = sum(t.n_bytes for t in r.tensors)
    quantized = sum(t.n_elements for t in r.tensors
                    if t.tensor_type in (T.Q8_0, T.Q4_0, T.Q4_K, T.MXFP4))
    assert (s["architecture"], s["name"], s["file_type"], s["version"]) == ("llama", "Tiny Llama", "Q8_0", 3)
    assert (s["tensors"], s["parameters"], s["tensor_bytes"]) == (9, params, nbytes)
    assert s["bits_per_weight"] == round(8 * nbytes / params, 3)
    assert s["quantized_parameters"] == quantized and s["quantized_share"] == round(quantized / params, 4)
    assert s["types"]["Q8_0"] == {"tensors": 1, "parameters": 512, "bytes": 16 * 34, "bits_per_weight": 8.5}
    assert s["types"]["Q4_K"] == {"tensors": 1, "parameters": 512, "bytes": 288, "bits_per_weight": 4.5}
    assert s["types"]["F32"]["tensors"] == 3 and sum(t["tensors"] for t in s["types"].values()) == 9
    assert s["tokenizer"] == {"model": "gpt2", "pre": "qwen2", "tokens": 100, "merges": 10, "bos_token_id": 1,
                              "eos_token_id": 2, "chat_template": True}
    assert s["hparams"] == {"llama.context_length": 2048, "llama.embedding_length": 64, "llama.block_count": 2,
                            "llama.attention.head_count": 4, "llama.attention.layer_norm_rms_epsilon": 1e-5,
                            "llama.rope.freq_base": 10000.0}
    assert s["split"] == {"no": 0, "count": 1, "tensors": 9}
    assert (s["alignment"], s["data_offset"], s["file_size"]) == (ALIGN, r.data_offset, small.stat().st_size)


def test_ggml_tables_are_gguf_pys():
    assert GGML_TYPES == {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in T}
    names = {int(f): ("F32" if f.name == "ALL_F32" else f.name.removeprefix("MOSTLY_")) for f in gguf.LlamaFileType}
    assert FILE_TYPES == names
    assert (bits_per_weight(T.Q4_K), bits_per_weight(T.Q8_0), bits_per_weight(T.BF16)) == (4.5, 8.5, 16.0)
    with pytest.raises(UnsupportedFormat, match="unknown ggml type 4"):
        bits_per_weight(4)


def test_long_values_are_validated_whole_and_kept_small(tmp_path):
    """A 150k-token vocabulary and a 1.8 MB chat template (3-byte characters across the 1 MiB read
    chunks) are validated whole but kept as a count and a head (how fast: benchmarks, not asserted)."""
    template = "✓" * 600_000
    path = _write(tmp_path / "vocab.gguf",
                  [("add_token_list", [f"tök{i}" for i in range(150_000)]),
                   ("add_token_scores", [float(i) for i in range(150_000)]), ("add_chat_template", template)],
                  [("norm.weight", np.ones(64, np.float32), None)])
    h = read_header(path)
    tracemalloc.start()
    assert read_header(path) == h
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert path.stat().st_size > 3 * 2**20 and peak < 4 * 2**20, peak   # the read buffer; what is kept is a few KB
    md = h.metadata
    assert md["tokenizer.ggml.tokens"] == Elided("array[string]", 150_000, tuple(f"tök{i}" for i in range(8)))
    assert md["tokenizer.ggml.scores"] == Elided("array[float32]", 150_000, tuple(float(i) for i in range(8)))
    assert md["tokenizer.chat_template"] == Elided("string", len(template.encode()), "✓" * 256)
    assert summary(h)["tokenizer"]["tokens"] == 150_000 and summary(h)["tokenizer"]["chat_template"]
    assert h.tensors[0].offset == h.data_offset == path.stat().st_size - 256


def test_version_2_is_read_and_big_endian_refused(small, tmp_path):
    data = bytearray(small.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")                # v2 and v3 share the little-endian layout
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(data)
    assert read_header(v2).version == 2 and read_header(v2).tensors == read_header(small).tensors
    big = _write(tmp_path / "big.gguf", [("add_name", "x")], [("norm.weight", np.ones(64, np.float32), None)],
                 endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(UnsupportedFormat, match=r"big\.gguf: big-endian GGUF v3"):
        read_header(big)


# --- qconv inspect -------------------------------------------------------------------------------------

def test_inspect_cli_json_and_text(small):
    doc = json.loads(run_qconv("inspect", "--json", small, check=0).stdout)
    assert doc == {"path": str(small), "kind": "gguf", "gguf": json.loads(json.dumps(summary(read_header(small)))),
                   "warnings": []}
    text = run_qconv("inspect", "--strict", small, check=0).stdout
    assert text.startswith("small.gguf: GGUF v3, llama 'Tiny Llama', file type Q8_0\n")
    for needle in ("9 tensors", "Q4_K", "4.5", "tokenizer: gpt2 (pre qwen2), 100 tokens, 10 merges, bos 1, eos 2, "
                   "chat template", "llama.attention.layer_norm_rms_epsilon  1e-05", "split 1 of 1 (9 tensors"):
        assert needle in text, needle
    result = api_inspect(small)
    assert (result.kind, result.components, result.methods, result.warnings) == ("gguf", (), (), ())


def test_gguf_magic_without_the_suffix(small, tmp_path):
    other = tmp_path / "model.bin"
    other.write_bytes(small.read_bytes())
    assert looks_like_gguf(other) and not looks_like_gguf(tmp_path)
    assert api_inspect(other).data["gguf"] == summary(read_header(small))


# Runs qconv in-process and reports what it loaded and how many bytes it read, as tests/verbs/test_inspect_fullsize.py.
PROBE = r"""
import json, sys
def report():
    io = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
    heavy = sorted(m for m in ("torch", "numpy", "gguf", "safetensors", "transformers") if m in sys.modules)
    print(json.dumps({"rchar": int(io["rchar"]), "heavy": heavy}), file=sys.stderr)
import atexit; atexit.register(report)
from qconv.cli import main
main(sys.argv[1:])
"""


def test_reads_the_header_only_and_never_imports_numpy_or_torch(tmp_path):
    """A 512 MiB F16 tensor held as a hole: inspect reads the header, not the data, and loads neither
    numpy, torch nor gguf-py."""
    path = tmp_path / "sparse.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("sparse")
    w.add_tensor_info("w.weight", (16384, 16384), np.dtype(np.float16), 16384 * 16384 * 2, raw_dtype=T.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.truncate(path, -(-path.stat().st_size // 32) * 32 + 16384 * 16384 * 2)
    proc = subprocess.run([sys.executable, "-c", PROBE, "inspect", "--json", str(path)], capture_output=True,
                          text=True, cwd=REPO.parent, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["gguf"]["types"]["F16"]["parameters"] == 16384 * 16384
    probe = json.loads(proc.stderr.strip().splitlines()[-1])
    assert probe["heavy"] == []
    assert probe["rchar"] < 32 * 2**20, probe


# --- refusals: the small real file, its bytes edited ---------------------------------------------------

def _u32(v):
    return int(v).to_bytes(4, "little")


def _u64(v):
    return int(v).to_bytes(8, "little")


def _mutations(L):
    """(id, [(position, bytes)], error class, needles): each a refusal made by editing the small file."""
    at, K, TI, TS = L["at"], L["keys"], L["ti"], L["tensors"]
    a_off = at(TI["a.weight"], 5)
    return [
        ("magic", [(0, b"GGUX")], CorruptCheckpoint, ["not a GGUF file", "b'GGUX'"]),
        ("version-1", [(4, _u32(1))], UnsupportedFormat, ["GGUF version 1"]),
        ("version-7", [(4, _u32(7))], UnsupportedFormat, ["GGUF version 7"]),
        ("version-0", [(4, _u32(0))], CorruptCheckpoint, ["version 0"]),
        ("n-tensors-lies", [(8, _u64(2**60))], CorruptCheckpoint, [f"claims {2**60} tensors"]),
        ("n-kv-lies", [(16, _u64(2**60))], CorruptCheckpoint, [f"{2**60} metadata keys"]),
        ("key-length-lies", [(at(K["general.name"], 0), _u64(2**62))], CorruptCheckpoint,
         ["metadata key 2 of 38 claims", "bytes are left"]),
        ("string-length-lies", [(at(K["general.name"], 3), _u64(2**62))], CorruptCheckpoint,
         ["key 'general.name'", "claims 4611686018427387904 bytes"]),
        ("name-length-lies", [(at(TI["b.weight"], 0), _u64(2**40))], CorruptCheckpoint,
         ["the name of tensor info 1 of 9", "claims"]),
        ("key-not-utf8", [(at(K["test.key_a"], 1), b"\xff")], CorruptCheckpoint, ["not UTF-8"]),
        ("string-not-utf8", [(at(K["test.text"], 4), b"\xc3\x28")], CorruptCheckpoint,
         ["key 'test.text'", "not UTF-8"]),
        ("token-not-utf8", [(at(K["tokenizer.ggml.tokens"], K["tokenizer.ggml.tokens"].data[80]), b"\xff")],
         CorruptCheckpoint, ["key 'tokenizer.ggml.tokens'[80]", "not UTF-8"]),
        ("name-not-utf8", [(at(TI["c.weight"], 1), b"\x80")], CorruptCheckpoint, ["tensor info 4 of 9", "UTF-8"]),
        ("array-count-lies", [(at(K["tokenizer.ggml.tokens"], 4), _u64(2**60))], CorruptCheckpoint,
         ["key 'tokenizer.ggml.tokens'", f"claims {2**60} string elements"]),
        ("int-array-count-lies", [(at(K["test.long"], 4), _u64(2**60))], CorruptCheckpoint, ["key 'test.long'"]),
        ("nested-count-lies", [(at(K["test.nested"], 6), _u64(2**60))], CorruptCheckpoint, ["key 'test.nested'[0]"]),
        ("unknown-value-type", [(at(K["test.u32"], 2), _u32(13))], CorruptCheckpoint,
         ["key 'test.u32'", "unknown value type 13"]),
        ("unknown-element-type", [(at(K["test.ints"], 3), _u32(99))], CorruptCheckpoint,
         ["key 'test.ints'", "unknown array element type 99"]),
        ("duplicate-key", [(at(K["test.key_b"], 1), b"test.key_a")], CorruptCheckpoint,
         ["'test.key_a' appears twice"]),
        ("alignment-not-power-of-two", [(at(K["general.alignment"], 3), _u32(48))], CorruptCheckpoint,
         ["general.alignment", "is 48", "power of two"]),
        ("alignment-zero", [(at(K["general.alignment"], 3), _u32(0))], CorruptCheckpoint, ["general.alignment"]),
        ("alignment-type", [(at(K["general.alignment"], 2), _u32(5))], CorruptCheckpoint,
         ["general.alignment", "of type int32, expected uint32"]),
        ("n-dims-0", [(at(TI["c.weight"], 2), _u32(0))], CorruptCheckpoint, ["'c.weight'", "0 dimensions"]),
        ("n-dims-5", [(at(TI["c.weight"], 2), _u32(5))], CorruptCheckpoint, ["'c.weight'", "5 dimensions"]),
        ("dim-negative", [(at(TI["x.weight"], 3) + 8, _u64(2**64 - 3))], CorruptCheckpoint,
         ["'x.weight'", "dimension 1", "negative"]),
        ("dims-overflow", [(at(TI["x.weight"], 3) + 8, _u64(2**40) + _u64(2**40))], CorruptCheckpoint,
         ["'x.weight'", "more than an int64"]),
        ("not-whole-blocks", [(at(TI["a.weight"], 3), _u64(48))], CorruptCheckpoint,
         ["'a.weight'", "48 is not a multiple of Q8_0's 32-weight blocks"]),
        ("unknown-ggml-type", [(at(TI["b.weight"], 4), _u32(4))], UnsupportedFormat,
         ["tensor 'b.weight'", "unknown ggml type 4"]),
        ("unknown-ggml-type-big", [(at(TI["b.weight"], 4), _u32(10**6))], UnsupportedFormat,
         ["unknown ggml type 1000000"]),
        ("offset-past-end", [(at(TI["norm.weight"], 5), _u64(2**40))], CorruptCheckpoint,
         ["'norm.weight'", "runs past the end"]),
        ("offset-huge", [(at(TI["norm.weight"], 5), _u64(2**64 - ALIGN))], CorruptCheckpoint, ["runs past the end"]),
        ("offset-misaligned", [(at(TI["b.weight"], 5), _u64(TS["b.weight"].data_offset - L["r"].data_offset + 32))],
         CorruptCheckpoint, ["'b.weight'", f"not a multiple of the alignment {ALIGN}"]),
        ("overlap", [(at(TI["b.weight"], 5), L["r"].data[a_off:a_off + 8].tobytes())], CorruptCheckpoint,
         ["tensor 'b.weight'", "overlaps tensor 'a.weight'"]),
        ("duplicate-name", [(at(TI["b.weight"], 1), b"a")], CorruptCheckpoint, ["tensor 'a.weight'", "appears twice"]),
    ]


def _mutate(small, tmp_path, edits, name="m.gguf"):
    data = bytearray(small.read_bytes())
    for pos, new in edits:
        data[pos:pos + len(new)] = new
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _refused_in_bounds(read, path, cls, case) -> str:
    """read(path) raises exactly cls within 4 MiB of Python allocations (a header that lies about a
    length or a count is never believed, so nothing of its size is allocated or looped over); the
    message. Time is not asserted here (it depends on the machine's load)."""
    tracemalloc.start()
    with pytest.raises(cls) as err:
        read(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 2**20, (case, peak)
    assert type(err.value) is cls, case
    return str(err.value)


def test_each_mutation_is_refused_by_name_in_bounded_memory(small, layout, tmp_path):
    cases = _mutations(layout)
    assert len({c[0] for c in cases}) == len(cases)
    for case, edits, cls, needles in cases:
        path = _mutate(small, tmp_path, edits, f"{case}.gguf")
        message = _refused_in_bounds(read_header, path, cls, case)
        assert message.startswith(f"{path}: ") and "\n" not in message, (case, message)
        for needle in needles:
            assert needle in message, (case, needle, message)


def test_each_mutation_is_one_line_from_the_cli(small, layout, tmp_path, capsys):
    """Through the CLI's own main (in-process: one process for 34 files): exit 4 or 5, one line."""
    for case, edits, cls, needles in _mutations(layout):
        path = _mutate(small, tmp_path, edits, f"{case}.gguf")
        with pytest.raises(SystemExit) as exit_:
            main(["inspect", "--json", str(path)])
        out = capsys.readouterr()
        assert exit_.value.code == cls.exit_code, (case, out.err)
        assert out.out == "" and out.err.count("\n") == 1, (case, out.err)
        assert out.err.startswith(f"qconv: error: {path}: ") and "Traceback" not in out.err, (case, out.err)


@pytest.mark.parametrize("case", ["magic", "version-1", "array-count-lies", "unknown-ggml-type", "overlap"])
def test_refusals_from_the_installed_command(small, layout, tmp_path, case):
    (edits, cls, needles), = [c[1:] for c in _mutations(layout) if c[0] == case]
    path = _mutate(small, tmp_path, edits, f"{case}.gguf")
    one_error(run_qconv("inspect", path), cls.exit_code, str(path), *needles)


def test_every_truncation_is_refused(small, layout, tmp_path):
    """Every prefix of the header (and a sweep through the data) is refused as corrupt, naming the file."""
    data = small.read_bytes()
    end, header_end = layout["end"], layout["r"].data_offset
    assert end == len(data)                              # the last tensor ends the file: no prefix is whole
    path = tmp_path / "cut.gguf"
    for n in [*range(header_end + 1), *range(header_end + 1, end, 37)]:
        path.write_bytes(data[:n])
        with pytest.raises(CorruptCheckpoint) as err:
            read_header(path)
        assert str(err.value).startswith(f"{path}: "), (n, str(err.value))
    path.write_bytes(data[:layout["at"](layout["ti"]["norm.weight"], 5) + 3])
    with pytest.raises(CorruptCheckpoint, match=r"cut\.gguf: tensor 'norm\.weight': truncated: its offset needs 8 "
                                                r"bytes at offset \d+, but the file ends at \d+$"):
        read_header(path)


def test_nesting_too_deep_is_refused(tmp_path):
    path = _write(tmp_path / "deep.gguf", [("add_array", "test.deep", [[[[[[[[[[1]]]]]]]]]])], [])
    with pytest.raises(CorruptCheckpoint, match=r"deep\.gguf: key 'test\.deep'\[0\].*nested more than 8 deep"):
        read_header(path)
    ok = _write(tmp_path / "ok.gguf", [("add_array", "test.deep", [[[[[[[[1]]]]]]]])], [])
    assert read_header(ok).metadata["test.deep"] == [[[[[[[[1]]]]]]]]


def test_not_a_regular_file_and_empty(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CorruptCheckpoint, match="empty.gguf: not a GGUF file: 0 bytes long"):
        read_header(empty)
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(CorruptCheckpoint, match="FIFO"):
        read_header(fifo)


def test_each_mutation_is_refused_by_dequantize_and_convert_before_any_output(small, layout, tmp_path, capsys):
    """`qconv dequantize`, `convert` and `validate` read a GGUF through the same checked header: each
    mutated file is refused with the same exit code and one line, and no DST (nor its staging folder) is
    left. The intact file (a llama without llama's hyperparameters) is refused naming what it lacks."""
    for case, edits, cls, needles in _mutations(layout):
        path = _mutate(small, tmp_path, edits, f"{case}.gguf")
        for argv in (["dequantize", str(path), str(tmp_path / "out")],
                     ["convert", str(path), str(tmp_path / "out"), "--to", "gptq"],
                     ["validate", str(path), str(path)]):
            with pytest.raises(SystemExit) as exit_:
                main(argv)
            out = capsys.readouterr()
            assert exit_.value.code == cls.exit_code, (case, argv[0], out.err)
            assert out.err.count("\n") == 1 and out.err.startswith(f"qconv: error: {path}: "), (case, out.err)
            assert not [p for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))], case
    for argv in (["convert", str(small), str(tmp_path / "o"), "--to", "gptq"], ["validate", str(small), str(small)],
                 ["dequantize", str(small), str(tmp_path / "o")]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 5 and "has no llama.feed_forward_length" in err and err.count("\n") == 1, (argv, err)


# --- split sets: llama.cpp's NAME-0000i-of-0000N.gguf, read from the first file --------------------------

@pytest.fixture(scope="module")
def split_set(tmp_path_factory):
    """A real fixture as one GGUF and as three split files, both written by qconv's --to gguf."""
    return split_gguf("llama-gptq-w8g128", tmp_path_factory.mktemp("split"))


def test_a_split_set_reads_as_its_unsplit_file(split_set):
    """The first file gives the whole set: the unsplit file's tensors (names, shapes, types, bytes) in
    order and its metadata, each tensor at the offset gguf-py's reader finds it at in its own file; the
    summary's totals are the unsplit file's, with the split count and the files."""
    one, first = split_set
    files = sorted(first.parent.glob("m-*-of-00003.gguf"))
    assert [f.name for f in files] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole, h = read_header(one), read_gguf(first)
    strip = lambda t: (t.name, t.shape, t.type_name, t.nbytes)  # noqa: E731
    assert [strip(t) for t in h.tensors] == [strip(t) for t in whole.tensors]
    assert h.files == tuple(files) and h.file_size == sum(f.stat().st_size for f in files)
    theirs = {t.name: (f, t.data_offset) for f in files for t in GGUFReader(f).tensors}
    assert {t.name: (t.file, t.offset) for t in h.tensors} == theirs
    assert len({t.file for t in h.tensors}) == 3
    split_keys = {"split.no": 0, "split.count": 3, "split.tensors.count": len(whole.tensors)}
    assert dict(h.metadata) == {**whole.metadata, **split_keys}
    ours, unsplit = summary(h), summary(whole)
    for key in ("tensors", "parameters", "tensor_bytes", "bits_per_weight", "quantized_parameters", "types",
                "tokenizer", "hparams", "architecture", "file_type"):
        assert ours[key] == unsplit[key], key
    assert ours["split"] == {"no": 0, "count": 3, "tensors": 21, "files": [f.name for f in files]}
    doc = json.loads(run_qconv("inspect", "--json", first, check=0).stdout)
    assert doc["gguf"] == json.loads(json.dumps(ours))
    text = run_qconv("inspect", first, check=0).stdout
    assert "3 split files, read as one: m-00001-of-00003.gguf to m-00003-of-00003.gguf" in text
    assert "21 tensors" in text


def test_inspect_of_a_split_set_reads_headers_only(tmp_path):
    """Header-only as for one file: three split files gguf-py's writer made, each a 512 MiB F16 tensor
    held as a hole, are inspected as one model without reading their data or loading numpy, torch or
    gguf-py."""
    w = gguf.GGUFWriter(tmp_path / "big.gguf", "llama", split_max_size=1)
    w.add_name("sparse")
    for i in range(3):
        w.add_tensor_info(f"w{i}.weight", (16384, 16384), np.dtype(np.float16), 16384 * 16384 * 2, raw_dtype=T.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    files = [tmp_path / f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for f in files:
        os.truncate(f, -(-f.stat().st_size // 32) * 32 + 16384 * 16384 * 2)
    proc = subprocess.run([sys.executable, "-c", PROBE, "inspect", "--json", str(files[0])], capture_output=True,
                          text=True, cwd=REPO.parent, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)["gguf"]
    assert doc["types"]["F16"]["parameters"] == 3 * 16384 * 16384 and doc["tensors"] == 3
    assert doc["split"] == {"no": 0, "count": 3, "tensors": 3, "files": [f.name for f in files]}
    assert doc["file_size"] == sum(f.stat().st_size for f in files) > 3 * 2**29
    probe = json.loads(proc.stderr.strip().splitlines()[-1])
    assert probe["heavy"] == []
    assert probe["rchar"] < 32 * 2**20, probe


def _field_value_at(path, key):
    """Byte position of a scalar metadata value in a GGUF file, from gguf-py's reader."""
    field = GGUFReader(path).fields[key]
    return field.offset + sum(int(p.nbytes) for p in field.parts[:3])


def _patch(path, pos, new):
    data = bytearray(path.read_bytes())
    data[pos:pos + len(new)] = new
    path.write_bytes(bytes(data))


def _split_cases(first):
    """(id, edit(folder) -> path to pass, error class, the file the error names, needles): each a bad split
    set made from the real one by renaming, removing or editing its files."""
    n = lambda i: f"m-0000{i}-of-00003.gguf"  # noqa: E731

    def later(d):
        return d / n(2)

    def missing(d):
        (d / n(3)).unlink()
        return d / n(1)

    def count_mismatch(d):
        _patch(d / n(2), _field_value_at(d / n(2), "split.count"), (4).to_bytes(2, "little"))
        return d / n(1)

    def first_count(d):
        _patch(d / n(1), _field_value_at(d / n(1), "split.count"), (4).to_bytes(2, "little"))
        return d / n(1)

    def out_of_order(d):
        (d / n(2)).rename(d / "x")
        (d / n(3)).rename(d / n(2))
        (d / "x").rename(d / n(3))
        return d / n(1)

    def duplicated(d):
        # a tensor of the last file renamed to one an earlier file holds (same length: only its bytes change)
        earlier = {t.name for i in (1, 2) for t in GGUFReader(d / n(i)).tensors}
        last = [t for t in GGUFReader(d / n(3)).tensors if t.name.startswith("blk.1.")]
        t = next(t for t in last if t.name.replace("blk.1.", "blk.0.") in earlier)
        data = (d / n(3)).read_bytes()
        pos = data.index(t.name.encode())
        assert pos < t.data_offset
        _patch(d / n(3), pos, b"blk.0.")
        return d / n(1)

    def not_gguf(d):
        shutil.copyfile(CHECKPOINTS / "llama-gptq-w8g128" / "model.safetensors", d / n(2))
        return d / n(1)

    def tensors_count(d):
        for i in (1, 2, 3):
            _patch(d / n(i), _field_value_at(d / n(i), "split.tensors.count"), (22).to_bytes(4, "little"))
        return d / n(1)

    def renamed(d):
        (d / n(1)).rename(d / "model.gguf")
        return d / "model.gguf"

    return [
        ("later-split-given", later, UsageError, n(2), ["split 2 of 3", f"pass its first file ({n(1)})"]),
        ("split-missing", missing, CorruptCheckpoint, n(3), ["split 3 of 3 is missing"]),
        ("split-count-mismatch", count_mismatch, CorruptCheckpoint, n(2), ["split.count is 4", f"{n(1)}'s is 3"]),
        ("first-split-count", first_count, CorruptCheckpoint, n(1), ["first of 4 split files", "-00001-of-00004.gguf"]),
        ("split-no-out-of-order", out_of_order, CorruptCheckpoint, n(2), ["split.no is 2", "out of order"]),
        ("tensor-in-two-splits", duplicated, CorruptCheckpoint, n(3), ["tensor 'blk.0.", "in an earlier file"]),
        ("split-not-gguf", not_gguf, CorruptCheckpoint, n(2), ["not a GGUF file"]),
        ("split-tensors-count", tensors_count, CorruptCheckpoint, n(1), ["hold 22 tensors, but they hold 21"]),
        ("first-renamed", renamed, CorruptCheckpoint, "model.gguf", ["does not end in '-00001-of-00003.gguf'"]),
    ]


def _bad_set(first, tmp_path, case, edit):
    folder = tmp_path / case
    folder.mkdir()
    for f in first.parent.glob("m-*.gguf"):
        shutil.copyfile(f, folder / f.name)
    return folder, edit(folder)


def test_bad_split_sets_are_refused_naming_the_file_in_bounded_memory(split_set, tmp_path):
    _, first = split_set
    cases = _split_cases(first)
    for case, edit, cls, named, needles in cases:
        folder, path = _bad_set(first, tmp_path, case, edit)
        message = _refused_in_bounds(read_gguf, path, cls, case)
        assert message.startswith(f"{folder / named}: ") and "\n" not in message, \
            (case, message)
        for needle in needles:
            assert needle in message, (case, needle, message)
    assert read_gguf(first).files                      # the set itself is whole


def test_bad_split_sets_are_refused_by_every_verb_before_any_output(split_set, tmp_path, capsys):
    """inspect, dequantize, convert (to a folder and to GGUF) and validate: one line naming the file, the
    same exit code (2 for a later file given first, 4 for a bad set), and no DST nor staging folder."""
    _, first = split_set
    for case, edit, cls, named, needles in _split_cases(first):
        folder, path = _bad_set(first, tmp_path, case, edit)
        for argv in (["inspect", str(path)], ["dequantize", str(path), str(tmp_path / "out")],
                     ["convert", str(path), str(tmp_path / "out"), "--to", "gptq"],
                     ["convert", str(path), str(tmp_path / "out.gguf"), "--to", "gguf"],
                     ["validate", str(CHECKPOINTS / "llama-gptq-w8g128"), str(path)]):
            with pytest.raises(SystemExit) as exit_:
                main(argv)
            out = capsys.readouterr()
            assert exit_.value.code == cls.exit_code, (case, argv[0], out.err)
            assert out.err.count("\n") == 1 and out.err.startswith(f"qconv: error: {folder / named}: "), \
                (case, argv[0], out.err)
            assert needles[0] in out.err and "Traceback" not in out.err, (case, out.err)
            assert not [p for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))], (case, argv[0])
