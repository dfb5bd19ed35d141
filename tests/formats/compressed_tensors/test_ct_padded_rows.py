"""compressed-tensors modules whose rows do not fill whole 32-bit words (issue 20, item 4): compressed-tensors
packs each row on its own (pack_to_int32 pads a row to whole runs of 32 codes and keeps ceil(in*b/32)
words), so a packed row pins in_features only to a range, and `weight_shape` says which. qconv reads the
true width (16 bytes, header-level), decodes exactly what compressed-tensors' own unpack_from_int32 gives,
writes every target that can hold it, and refuses those that cannot naming the true shape."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, copy_checkpoint, inspect_json, run_qconv

# A Linear the config does not size (issue 35: a q_proj of 100 inputs in a hidden-256 model is a model no
# loader builds, refused by every writing verb): the model's own modules stay as its config says.
Q = "model.layers.0.mlp.odd_proj"
SCALE_OF = "model.layers.0.self_attn.q_proj.weight_scale"
CASES = [("llama-ct-w4a16", 4, 100), ("llama-ct-w8a16-channel", 8, 7), ("llama-ct-w3a16", 3, 100)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{b}bit-in{i}" for _, b, i in CASES])
def padded(request, tmp_path_factory):
    """The fixture with a valid pack-quantized [256, in] module added (Q), packed by
    compressed-tensors itself; returns (folder, in, its own dequantization as float32)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    name, bits, inp = request.param
    src = copy_checkpoint(name, tmp_path_factory.mktemp("padded"))
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(bits)
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (256, inp), generator=g, dtype=torch.int8)
    packed = pack_to_int32(q, bits).contiguous()
    assert packed.shape == (256, -(-inp * bits // 32)) and (inp * bits) % 32
    scale = (torch.rand(256, 1, generator=g) * 0.01 + 0.001).to(tensors[SCALE_OF].dtype)
    tensors.update({Q + ".weight_packed": packed, Q + ".weight_scale": scale,
                    Q + ".weight_shape": torch.tensor([256, inp])})
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    theirs = unpack_from_int32(packed, bits, torch.Size([256, inp])).float() * scale.float()
    assert torch.equal(unpack_from_int32(packed, bits, torch.Size([256, inp])), q)
    return src, inp, theirs


def test_inspect_counts_the_true_width(padded):
    """inspect (header-level, plus the 16-byte weight_shape) counts the module as 256 x in, not as the
    padded width its words would hold, and has nothing to warn about."""
    src, inp, _ = padded
    (comp,) = inspect_json(src)["components"]
    (before,) = inspect_json(CHECKPOINTS / src.name)["components"]
    assert not comp["warnings"]
    assert sum(comp["quantized_parameters"].values()) == sum(before["quantized_parameters"].values()) + 256 * inp


def test_dequantize_is_compressed_tensors_own(tmp_path, padded):
    src, inp, theirs = padded
    run_qconv("dequantize", "--dtype", "float32", src, tmp_path / "f", check=0)
    ours = load_file(tmp_path / "f" / "model.safetensors")[Q + ".weight"]
    assert ours.shape == (256, inp) and torch.equal(ours, theirs)


@pytest.mark.parametrize("to", ["compressed-tensors", "bnb8", "bnb4-nf4", "compressed-tensors-w8a8",
                                "float16", "bfloat16", "float32", "gptq", "awq"])
def test_every_target_writes_it_or_refuses_naming_the_true_shape(tmp_path, padded, to):
    src, inp, _ = padded
    proc = run_qconv("convert", src, tmp_path / "out", "--to", to, "--validate")
    if proc.returncode == 5:            # 32-bit words along in (GPTQ), whole groups (AWQ): cannot hold it
        assert to in ("gptq", "awq") and re.search(rf"256 x {inp} module|module's {inp}\n", proc.stderr), proc.stderr
        assert not (tmp_path / "out").exists()
        return
    assert proc.returncode == 0, proc.stderr
    run_qconv("dequantize", "--dtype", "float32", tmp_path / "out", tmp_path / "f", check=0)
    assert load_file(tmp_path / "f" / "model.safetensors")[Q + ".weight"].shape == (256, inp)


def test_compressed_tensors_round_trip_is_byte_identical(tmp_path, padded):
    src, _, _ = padded
    run_qconv("convert", src, tmp_path / "out", "--to", "compressed-tensors", check=0)
    theirs, ours = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    for leaf in ("weight_packed", "weight_scale", "weight_shape"):
        assert torch.equal(theirs[f"{Q}.{leaf}"], ours[f"{Q}.{leaf}"]), leaf
