"""validate accounts for every tensor, not only the Linears (issue 20, item 2): biases, norms and every
other tensor are compared exactly, or within the rounding their dtype change implies, and anything on
one side only is reported and fails (validation/tensors.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, copy_checkpoint, run_qconv

Q = "model.layers.0.self_attn.q_proj"
NORM = "model.layers.0.input_layernorm.weight"


def _with(src, dst, edit):
    """A copy of the checkpoint folder src at dst whose tensors edit(tensors) changed."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    shards = sorted(dst.glob("*.safetensors"))
    assert len(shards) == 1
    tensors = load_file(shards[0])
    edit(tensors)
    save_file(tensors, shards[0], metadata={"format": "pt"})
    return dst


def _validate(a, b):
    proc = run_qconv("validate", "--json", a, b)
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(params=["llama-fp16", "llama-awq-w4g128", "llama-ct-w4a16"])
def with_bias(request, tmp_path):
    """A fixture whose q_proj has a bias of 0.5 (in the model's dtype)."""
    src = copy_checkpoint(request.param, tmp_path / "work")
    dtype = load_file(next(src.glob("*.safetensors")))[NORM].dtype

    def add_bias(t):
        t[Q + ".bias"] = torch.full((256,), 0.5, dtype=dtype)
    return _with(src, tmp_path / "a", add_bias)


def test_a_changed_bias_fails(tmp_path, with_bias):
    def edit(t):
        t[Q + ".bias"][3] = 4.0
    code, report = _validate(with_bias, _with(with_bias, tmp_path / "b", edit))
    assert code == 1 and not report["ok"]
    (comp,) = report["components"]
    (d,) = comp["tensors"]["differ"]
    assert d["tensor"] == Q + ".bias" and "1 values differ (first at flat index 3: 0.5 vs 4)" in d["problem"]
    assert all(layer["ok"] for layer in report["layers"])          # the Linears themselves are equal


def test_a_bias_on_one_side_only_fails(tmp_path, with_bias):
    b = _with(with_bias, tmp_path / "b", lambda t: t.pop(Q + ".bias"))
    code, report = _validate(with_bias, b)
    assert code == 1 and report["components"][0]["only_in_a"] == [Q + ".bias"]
    code, report = _validate(b, with_bias)
    assert code == 1 and report["components"][0]["only_in_b"] == [Q + ".bias"]


def test_a_changed_norm_fails_and_the_cli_says_which(tmp_path, with_bias):
    def edit(t):
        t[NORM] += 5
    b = _with(with_bias, tmp_path / "b", edit)
    code, report = _validate(with_bias, b)
    assert code == 1 and report["components"][0]["tensors"]["differ"][0]["tensor"] == NORM
    text = run_qconv("validate", with_bias, b).stdout
    assert f"FAIL tensor {NORM}" in text and text.splitlines()[-1].startswith("FAILED:")
    assert "1 other tensors differ" in text.splitlines()[-1]


def test_identical_pairs_and_dtype_changes_within_their_rounding_pass(tmp_path, with_bias):
    code, report = _validate(with_bias, with_bias)
    assert code == 0 and report["components"][0]["tensors"] == {"compared": 6, "differ": []}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        run_qconv("dequantize", "--dtype", dtype, with_bias, out, check=0)
        code, report = _validate(with_bias, out)
        assert code == 0, report["components"][0]["tensors"]
        assert report["components"][0]["tensors"]["compared"] == 6


def test_a_change_beyond_the_dtype_rounding_fails(tmp_path):
    """float16 against float32: the float16 side must be the float32 one rounded to float16 (to nearest
    even, as a cast rounds), bit for bit. A float32 norm 2^-12 above the float16 value still rounds to it
    (within the rounding the dtype change implies); one float16 step (2^-10) above does not."""
    src = copy_checkpoint("llama-fp16", tmp_path / "work")
    f32 = tmp_path / "f32"
    run_qconv("dequantize", "--dtype", "float32", src, f32, check=0)
    assert load_file(f32 / "model.safetensors")[NORM].dtype == torch.float32

    def nudged(step):
        def edit(t):
            t[NORM] = t[NORM] * (1 + step)
        return _with(f32, tmp_path / f"nudged-{step}", edit)
    code, report = _validate(src, nudged(2.0**-12))
    assert code == 0, report["components"][0]["tensors"]
    for a, b in ((src, nudged(2.0**-10)), (tmp_path / "nudged-0.0009765625", src)):
        code, report = _validate(a, b)
        (d,) = report["components"][0]["tensors"]["differ"]
        assert code == 1 and d["tensor"] == NORM and "beyond the rounding of F32 -> F16" in d["problem"]


def test_convert_validate_refuses_a_result_whose_other_tensors_differ(tmp_path, monkeypatch):
    """convert --validate checks the whole result, the copied tensors too (here a norm the writer is
    made to damage): nothing is written."""
    from qconv.convert import engine

    original = engine.plain_chunks

    def damaged(info, dtype):
        for chunk in original(info, dtype):
            yield chunk * 2 if info.name == NORM else chunk
    monkeypatch.setattr(engine, "plain_chunks", damaged)
    from qconv.errors import ValidationFailed
    from qconv.convert.convert import Options, convert
    with pytest.raises(ValidationFailed, match="1 other tensors differ \\(first: " + NORM):
        convert(CHECKPOINTS / "llama-bnb8", tmp_path / "out", Options("gptq", bits=8, group_size=-1, sym=True), validate=True)
    assert not (tmp_path / "out").exists()
