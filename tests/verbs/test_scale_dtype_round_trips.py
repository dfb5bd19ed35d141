"""Issue 20 item 14: a lossless round trip through a format whose scales have a fixed dtype
(bitsandbytes int8: float32 SCB = s * 127; auto_round:auto_awq: float16 scales) gives back the source's
scale dtype, and so the same bytes: a kept module's scales are written in the model's 16-bit dtype where
every one is exactly a value of it (convert._kept_scale_dtype). A producer's own scales that are not
exact in it keep their exact dtype: nothing rounds on a codes-kept path."""

import hashlib
import json

import pytest
import torch

from conftest import CHECKPOINTS, is_card, load_tensors, run_qconv


def _digest(folder):
    """Every file's hash but the model card's (it names the run's source and command)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and not is_card(p)}


def _scale_dtypes(folder, suffix):
    return {str(v.dtype) for k, v in load_tensors(folder).items() if k.endswith(suffix)}


@pytest.mark.parametrize("name, fmt, via, scale, via_scale, via_dtype", [
    ("llama-ct-w8a8", "compressed-tensors-w8a8", "bnb8", ".weight_scale", ".SCB", "torch.float32"),
    ("llama-ct-w8a16-channel", "compressed-tensors", "bnb8", ".weight_scale", ".SCB", "torch.float32"),
    ("llama-awq-w4g128", "awq", "auto-round", ".scales", ".scales", "torch.float16"),
])
def test_round_trip_through_a_fixed_scale_dtype_is_byte_identical(tmp_path, name, fmt, via, scale, via_scale,
                                                                   via_dtype):
    a, hop, back = tmp_path / "a", tmp_path / "hop", tmp_path / "back"
    run_qconv("convert", CHECKPOINTS / name, a, "--to", fmt, check=0)          # qconv's own writing of it
    report = json.loads(run_qconv("convert", a, hop, "--to", via, "--json", check=0).stdout)["components"][0]
    assert report["requantized"] == 0 and report["codes_kept"] == report["modules"] > 0
    source_dtypes = _scale_dtypes(a, scale)
    assert _scale_dtypes(hop, via_scale) == {via_dtype} != source_dtypes      # the hop changed the dtype
    run_qconv("convert", hop, back, "--to", fmt, check=0)
    assert _scale_dtypes(back, scale) == source_dtypes
    assert _digest(back) == _digest(a)


def test_producer_scales_not_exact_in_the_model_dtype_stay_exact(tmp_path):
    """bitsandbytes' own SCB / 127 is not a float16 value: compressed-tensors gets float32 scales equal to
    it (float32's own rounding of the division, reported as such), not float16."""
    out = tmp_path / "w8a8"
    report = json.loads(run_qconv("convert", CHECKPOINTS / "llama-bnb8", out, "--to", "compressed-tensors-w8a8",
                                  "--json", check=0).stdout)["components"][0]
    src, dst = load_tensors(CHECKPOINTS / "llama-bnb8"), load_tensors(out)
    modules = [k[: -len(".SCB")] for k in src if k.endswith(".SCB")]
    assert modules and report["codes_kept"] == len(modules)
    for m in modules:
        s = dst[m + ".weight_scale"]
        assert s.dtype == torch.float32, m
        assert torch.equal(s.reshape(-1), src[m + ".SCB"] / 127), m
    assert 0 < report["max_scale_rel_error"] <= 2**-24                  # float32 SCB / 127, not float16's 2^-11
