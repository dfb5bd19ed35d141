"""Zero-size quantized modules are carried (issue 20, item 5): a compressed-tensors Linear with
weight_shape [256, 0] or [0, 256] converts to every target, validates, reads back and dequantizes to a
weight of that shape; none exits 70 (a crash) or 4 (qconv refusing what it wrote itself). The module is
one of its own beside the model's (a q_proj of 0 inputs in a hidden-256 model is a model no loader
builds, refused as such since issue 35)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import copy_checkpoint, run_qconv

Q = "model.layers.0.mlp.zero_proj"
LIKE = "model.layers.0.self_attn.q_proj"       # whose other tensors (ModelOpt's per-tensor scales) it copies
TARGETS = ["gptq", "gptq-v2", "auto-round", "awq", "bnb8", "bnb4-nf4", "bnb4-fp4", "compressed-tensors",
           "compressed-tensors-w8a8", "fp8", "compressed-tensors-fp8", "compressed-tensors-fp8 --block-size 128x128",
           "compressed-tensors-nvfp4", "compressed-tensors-mxfp4", "mlx", "float16", "bfloat16", "float32"]


def _zero_size_source(factory, fixture: str, tensors_of) -> Path:
    """``fixture`` copied with a module Q added: q_proj's stored tensors, those of ``tensors_of()``
    replaced (a zero-size module)."""
    src = copy_checkpoint(fixture, factory.mktemp("zero"))
    tensors = load_file(src / "model.safetensors")
    tensors.update({Q + k[len(LIKE):]: t.clone() for k, t in tensors.items() if k.startswith(LIKE + ".")})
    tensors.update({Q + leaf: t for leaf, t in tensors_of().items()})
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


@pytest.fixture(scope="module", params=[(256, 0), (0, 256)], ids=["in0", "out0"])
def zero_size(request, tmp_path_factory):
    out, inp = request.param
    return _zero_size_source(tmp_path_factory, "llama-ct-w4a16", lambda: {
        ".weight_packed": torch.zeros((out, inp // 8), dtype=torch.int32),
        ".weight_scale": torch.zeros((out, inp // 128), dtype=torch.float16),
        ".weight_shape": torch.tensor([out, inp])}), (out, inp)


@pytest.mark.parametrize("to", TARGETS)
def test_zero_size_modules_convert_validate_and_read_back(tmp_path, zero_size, to):
    src, shape = zero_size
    out = tmp_path / "out"
    proc = run_qconv("convert", src, out, "--to", *to.split(), "--validate")
    assert proc.returncode == 0, proc.stderr
    run_qconv("inspect", "--strict", out, check=0)
    run_qconv("dequantize", "--dtype", "float32", out, tmp_path / "float", check=0)
    weight = load_file(tmp_path / "float" / "model.safetensors")[Q + ".weight"]
    assert tuple(weight.shape) == shape and weight.dtype == torch.float32


def test_zero_size_source_validates_and_dequantizes(tmp_path, zero_size):
    src, shape = zero_size
    run_qconv("validate", src, src, check=0)
    run_qconv("dequantize", src, tmp_path / "float", check=0)
    assert tuple(load_file(tmp_path / "float" / "model.safetensors")[Q + ".weight"].shape) == shape


# modelopt-nvfp4 keeps NVFP4 codes only (every other source is refused): its zero-size module is ModelOpt's.
@pytest.fixture(scope="module", params=[(256, 0), (0, 256)], ids=["in0", "out0"])
def zero_size_modelopt(request, tmp_path_factory):
    out, inp = request.param
    return _zero_size_source(tmp_path_factory, "llama-modelopt-nvfp4", lambda: {
        ".weight": torch.zeros((out, inp // 2), dtype=torch.uint8),
        ".weight_scale": torch.zeros((out, inp // 16), dtype=torch.float8_e4m3fn)}), (out, inp)


def test_zero_size_modelopt_nvfp4_converts_validates_and_reads_back(tmp_path, zero_size_modelopt):
    src, shape = zero_size_modelopt
    out = tmp_path / "out"
    proc = run_qconv("convert", src, out, "--to", "modelopt-nvfp4", "--validate")
    assert proc.returncode == 0, proc.stderr
    run_qconv("inspect", "--strict", out, check=0)
    run_qconv("dequantize", "--dtype", "float32", out, tmp_path / "float", check=0)
    weight = load_file(tmp_path / "float" / "model.safetensors")[Q + ".weight"]
    assert tuple(weight.shape) == shape and weight.dtype == torch.float32
    stored = load_file(out / "model.safetensors")[Q + ".weight"]
    assert stored.shape == load_file(src / "model.safetensors")[Q + ".weight"].shape
