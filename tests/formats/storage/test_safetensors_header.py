"""The header reader against the format spec (golden bytes) and against safetensors itself."""

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from qconv.errors import CorruptCheckpoint
from qconv.formats.storage.safetensors_header import encode_header, read_header

from conftest import CHECKPOINTS


def _file(tmp_path, header: dict, data: bytes, name="x.safetensors"):
    raw = json.dumps(header).encode()
    p = tmp_path / name
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return p


def test_golden_bytes(tmp_path):
    # Written byte by byte from the spec: u64 LE length, JSON, data.
    raw = b'{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[3],"data_offsets":[4,10]},' \
          b'"a":{"dtype":"I8","shape":[2,2],"data_offsets":[0,4]}}'
    p = tmp_path / "g.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(range(10)))
    h = read_header(p)
    assert h.metadata == {"format": "pt"}
    assert list(h.tensors) == ["b", "a"]                      # header order is kept
    a, b = h.tensors["a"], h.tensors["b"]
    assert (a.dtype, a.shape, a.offset, a.nbytes, a.numel) == ("I8", (2, 2), 8 + len(raw), 4, 4)
    assert (b.dtype, b.shape, b.offset, b.nbytes) == ("BF16", (3,), 8 + len(raw) + 4, 6)
    assert b.torch_dtype == "torch.bfloat16"


@pytest.mark.parametrize("name", ["llama-bnb4-nf4-bf16storage", "llama-gptq-w3g128",
                                  "qwen3vl-bnb8-skipvisual"])
def test_agrees_with_safetensors_on_real_files(name):
    path = CHECKPOINTS / name / "model.safetensors"
    h = read_header(path)
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(h.tensors)
        for key in f.keys():
            sl = f.get_slice(key)
            assert tuple(sl.get_shape()) == h.tensors[key].shape
            assert sl.get_dtype() == h.tensors[key].dtype
        meta = f.metadata() or {}
    assert meta == dict(h.metadata)


def test_encode_header_round_trip(tmp_path):
    tensors = [("w", "I8", (4, 6)), ("s", "F32", (4,)), ("f", "U8", ()), ("e", "BF16", (0, 3))]
    header, size = encode_header(tensors, {"format": "pt"})
    assert len(header) % 8 == 0
    p = tmp_path / "r.safetensors"
    p.write_bytes(header + bytes(size))
    h = read_header(p)
    assert [(t.name, t.dtype, t.shape) for t in h.tensors.values()] == tensors
    with safe_open(p, framework="pt") as f:                   # and safetensors agrees
        assert f.get_tensor("w").shape == (4, 6) and f.get_tensor("f").shape == ()


# ---- property: qconv refuses exactly what safetensors refuses -----------------------------------

def _valid_file(tmp_path):
    p = tmp_path / "base.safetensors"
    save_file({"a": torch.zeros(3, 5, dtype=torch.int8), "b": torch.ones(7, dtype=torch.bfloat16),
               "c": torch.zeros(2, 2, dtype=torch.float32)}, p, metadata={"format": "pt"})
    return p


mutation = st.one_of(
    st.tuples(st.just("offset"), st.sampled_from("abc"), st.integers(0, 1), st.integers(-9, 9)),
    st.tuples(st.just("shape"), st.sampled_from("abc"), st.integers(0, 1), st.integers(-3, 3)),
    st.tuples(st.just("dtype"), st.sampled_from("abc"),
              st.sampled_from(["I8", "U8", "F16", "BF16", "F32", "I64", "F64", "Q4", "bool"]),
              st.just(0)),
    st.tuples(st.just("resize"), st.just(""), st.just(0), st.integers(-40, 40)),
    st.tuples(st.just("length"), st.just(""), st.just(0), st.integers(-16, 16)),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_refuses_exactly_what_safetensors_refuses(tmp_path, mutations):
    base = _valid_file(tmp_path)
    blob = base.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    length_delta = 0
    for kind, key, idx, value in mutations:
        if kind == "offset":
            header[key]["data_offsets"][idx] = max(0, header[key]["data_offsets"][idx] + value)
        elif kind == "shape":
            shape = header[key]["shape"]
            if idx < len(shape):
                shape[idx] = max(0, shape[idx] + value)
        elif kind == "dtype":
            header[key]["dtype"] = idx
        elif kind == "resize":
            data = data[:len(data) + value] if value < 0 else data + bytes(value)
        elif kind == "length":
            length_delta = value
    raw = json.dumps(header).encode()
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", max(0, len(raw) + length_delta)) + raw + data)
    try:
        with safe_open(p, framework="pt"):
            pass
        theirs = None
    except Exception as exc:  # safetensors raises its own error types
        theirs = exc
    try:
        read_header(p)
        ours = None
    except CorruptCheckpoint as exc:
        ours = exc
        assert str(p) in str(exc)
    assert (ours is None) == (theirs is None), (mutations, ours, theirs)
