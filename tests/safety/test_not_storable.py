"""A format's writer says "cannot hold this" with NotStorable (errors.py), which convert turns into a
refusal naming the module (exit 5); any other ValueError raised inside a writer is a bug and must surface
as one (never a refusal that hides it)."""

import pytest

import qconv
from conftest import CHECKPOINTS
from qconv.errors import NotStorable, UnsupportedFormat
from qconv.formats.compressed_tensors import codec as ct_codec


def _encode_raising(exc):
    def encode(*args, **kwargs):
        raise exc
    return encode


def test_not_storable_is_a_refusal_naming_the_module(tmp_path, monkeypatch):
    monkeypatch.setattr(ct_codec, "encode_for", _encode_raising(NotStorable("codes do not fit in 8 bits")))
    with pytest.raises(UnsupportedFormat, match=r"model\.layers\.0\.\S+: cannot be stored as compressed-tensors: "
                                                r"codes do not fit in 8 bits"):
        qconv.convert(CHECKPOINTS / "llama-gptq-w8g128", tmp_path / "out", to="compressed-tensors")
    assert not (tmp_path / "out").exists()


def test_another_value_error_is_not_taken_for_a_refusal(tmp_path, monkeypatch):
    monkeypatch.setattr(ct_codec, "encode_for", _encode_raising(ValueError("operands could not be broadcast")))
    with pytest.raises(ValueError, match="broadcast") as info:
        qconv.convert(CHECKPOINTS / "llama-gptq-w8g128", tmp_path / "out", to="compressed-tensors")
    assert not isinstance(info.value, (UnsupportedFormat, NotStorable))
    assert not (tmp_path / "out").exists()
