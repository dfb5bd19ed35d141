"""A narrowing that changes what a module computes is refused before DST exists, never an exit 0 with a
different model (issue 20, item 1): finite bfloat16 scales that become infinite as float16, non-zero
scales flushed to 0, dequantized weights beyond float16's range or beyond float32's."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import copy_checkpoint, one_error, run_qconv

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def awq_with(tmp_path):
    """llama-awq-w4g128 (bf16 scales) with q_proj's first two scales set to the given values."""
    def make(*values):
        src = copy_checkpoint("llama-awq-w4g128", tmp_path / "work")
        tensors = load_file(src / "model.safetensors")
        assert tensors[Q + ".scales"].dtype == torch.bfloat16
        for i, v in enumerate(values):
            tensors[Q + ".scales"][0, i] = v
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
        return src
    return make


def _refused(tmp_path, src, code, args, *needles):
    proc = run_qconv("convert", src, tmp_path / "out", *args)
    line = one_error(proc, code, str(src / "model.safetensors"), Q, *needles)
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    return line


@pytest.mark.parametrize("args", [["--to", "auto-round"], ["--to", "gptq", "--scale-dtype", "float16"],
                                  ["--to", "compressed-tensors", "--scale-dtype", "float16"],
                                  ["--to", "awq", "--scale-dtype", "float16"]])
def test_scales_beyond_float16_are_refused(tmp_path, awq_with, args):
    src = awq_with(1e5, 1e30)          # weights up to 8e30: finite in float32, so a narrowing, not a corruption
    _refused(tmp_path, src, 5, args, "2 scales do not fit float16", "infinity", "bfloat16")


@pytest.mark.parametrize("args", [["--to", "auto-round"], ["--to", "gptq-v2", "--scale-dtype", "float16"]])
def test_scales_flushed_to_zero_are_refused(tmp_path, awq_with, args):
    src = awq_with(3e-9)
    _refused(tmp_path, src, 5, args, "1 non-zero scales (the smallest 3e-09) become 0 in float16")


def test_the_same_scales_are_kept_where_the_dtype_holds_them(tmp_path, awq_with):
    """The refusal is about the narrowing, not the values: kept as bfloat16 (or float32), the codes and
    these scales are written exactly and read back as they were."""
    src = awq_with(1e5, 3e-9)
    out = tmp_path / "out"
    run_qconv("convert", src, out, "--to", "gptq-v2", check=0)
    scales = load_file(out / "model.safetensors")[Q + ".scales"]
    assert scales.dtype == torch.bfloat16
    assert torch.equal(scales, load_file(src / "model.safetensors")[Q + ".scales"])      # both [groups, out]


def test_weights_beyond_float16_are_refused_and_bfloat16_holds_them(tmp_path, awq_with):
    src = awq_with(1e5)
    line = _refused(tmp_path, src, 5, ["--to", "float16"], "weights exceed float16's range")
    assert "bfloat16 or float32" in line
    proc = run_qconv("dequantize", "--dtype", "float16", src, tmp_path / "out")
    one_error(proc, 5, Q, "weights exceed float16's range")
    run_qconv("convert", src, tmp_path / "bf16", "--to", "bfloat16", check=0)
    w = load_file(tmp_path / "bf16" / "model.safetensors")[Q + ".weight"]
    assert torch.isfinite(w).all() and w.abs().max() > 65504


@pytest.mark.parametrize("to", ["float32", "bfloat16"])
def test_weights_beyond_float32_are_refused(tmp_path, awq_with, to):
    src = awq_with(3e38)
    _refused(tmp_path, src, 4, ["--to", to], "codes times its scales are not finite in float32")


@pytest.mark.parametrize("to", ["bnb8", "bnb4-nf4", "compressed-tensors-w8a8"])
def test_requantizing_weights_beyond_float32_is_refused_in_one_line(tmp_path, awq_with, to):
    """No requantization of weights that are not finite, and no numpy warnings on stderr on the way."""
    src = awq_with(3e38)
    _refused(tmp_path, src, 4, ["--to", to], "codes times its scales are not finite in float32")


def test_validate_refuses_such_a_source_without_warnings(tmp_path, awq_with):
    """Weights that are not finite in float32 are no model to compare: validate refuses the source as
    every verb does (issue 34), in one line, before any comparison (no NaN in a report)."""
    src = awq_with(3e38)
    proc = run_qconv("validate", src, src)
    one_error(proc, 4, str(src / "model.safetensors"), Q, "codes times its scales are not finite in float32")
    assert proc.stdout == ""


def test_validate_fails_a_layer_beyond_float16_without_warnings(tmp_path, awq_with):
    """Finite in float32 but beyond the model's float16: the layer is compared (and fails against the
    intact fixture, whose weights these are not), its numbers finite, nothing on stderr."""
    src = awq_with(1e30)
    proc = run_qconv("validate", src, copy_checkpoint("llama-awq-w4g128", tmp_path / "intact"))
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith(Q + " ")]
    assert row.split()[1] == "FAIL" and "nan" not in row and "inf" not in row, row
