"""gpt-oss MXFP4 (quant_method "mxfp4", formats/mxfp4/) on fixtures/checkpoints/qwen3moe-mxfp4-gptoss: a
gpt-oss-layout checkpoint made by fixtures/make_mxfp4_gptoss.py from the real qwen3moe-bf16 (no producer of
the layout runs on a CPU; see its PROVENANCE.json), whose oracle is transformers' own decoder
(convert_moe_packed_tensors). What every fixture goes through anyway (readers against the oracle, windows,
the golden inspect report, every conversion) is in the parametrized suites; here: the consumer's decoder
itself, the fused layout kept by dequantize, validate, and the refusals."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qconv.formats.core.detect import detect
from qconv.formats.core.reader import read_module
from qconv.formats.storage.checkpoint import open_target

from conftest import CHECKPOINTS, copy_checkpoint, inspect_json, load_tensors, one_error, run_qconv

NAME = "qwen3moe-mxfp4-gptoss"
SRC = CHECKPOINTS / NAME
MOE = "model.layers.0.mlp.experts"
E, I, H = 4, 128, 256


def _oracle():
    return load_file(SRC / "oracle" / "dequant.safetensors")


def test_reader_equals_transformers_decoder_bit_for_bit():
    """Every fused module read by qconv is transformers' convert_moe_packed_tensors of the stored bytes
    (run here, and as stored in the oracle), transposed back to [E, out, in], bit for bit (signed zeros
    included)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    comp = open_target(SRC).components[0]
    det = detect(comp)
    stored, oracle = load_file(SRC / "model.safetensors"), _oracle()
    assert sorted(m.float_name for m in det.modules) == sorted(oracle)
    for m in det.modules:
        assert (m.family, m.scheme, m.experts, m.group_size) == ("mxfp4", "e2m1", E, 32)
        ref = convert_moe_packed_tensors(stored[m.name + "_blocks"], stored[m.name + "_scales"], dtype=torch.float32)
        ref = ref.transpose(1, 2).contiguous()
        assert ref.shape == m.float_shape
        assert torch.equal(ref.view(torch.int32), oracle[m.float_name].view(torch.int32)), m.name
        got = read_module(comp, det, m, "bfloat16").dequantize().reshape(m.float_shape)
        assert np.array_equal(got.view(np.uint32), ref.numpy().view(np.uint32)), m.name


def test_inspect_reports_fused_experts_compactly():
    (report,) = inspect_json(SRC)["components"]
    assert report["method"] == "gpt-oss MXFP4" and report["warnings"] == []
    assert report["experts"] == {"model.layers.{0-1}.mlp.experts": E}
    assert report["group_size"] == 32 and report["scales_dtype"] == "torch.uint8"
    assert report["quantized_modules"] == {"e2m1": [f"model.layers.{n}.mlp.experts.{p}" for n in (0, 1)
                                                    for p in ("down_proj", "gate_up_proj")]}
    assert report["quantized_bits_per_weight"] == {"e2m1": 4.25}     # 4 bits + one 8-bit scale per 32


def test_dequantize_keeps_the_fused_interleaved_layout(tmp_path):
    """No silent transposing or reordering: the stored [E, out, in] tensors under the fused names, gate_up
    rows still interleaved (even rows near the base's gate_proj, odd rows near its up_proj), biases
    carried (as every float tensor, in the --dtype asked for), nothing of the packed format left."""
    run_qconv("dequantize", "--dtype", "float32", SRC, tmp_path / "out", check=0)
    out, stored = load_tensors(tmp_path / "out"), load_file(SRC / "model.safetensors")
    base = load_file(CHECKPOINTS / "qwen3moe-bf16" / "model.safetensors")
    assert not any(k.endswith(("_blocks", "_scales")) for k in out)
    assert out[MOE + ".gate_up_proj"].shape == (E, 2 * I, H) and out[MOE + ".down_proj"].shape == (E, H, I)
    for key in (MOE + ".gate_up_proj", MOE + ".down_proj"):
        assert torch.equal(out[key], _oracle()[key])
    for key in (MOE + ".gate_up_proj_bias", MOE + ".down_proj_bias"):
        assert torch.equal(out[key], stored[key].float())              # --dtype float32 casts every float
    gate_up = out[MOE + ".gate_up_proj"]
    for e in range(E):
        gate, up = base[f"{MOE}.{e}.gate_proj.weight"].float(), base[f"{MOE}.{e}.up_proj.weight"].float()
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()             # noqa: E731
        assert rel(gate_up[e, 0::2], gate) < 0.2 and rel(gate_up[e, 1::2], up) < 0.2
        assert rel(gate_up[e, :I], gate) > 1.0                             # not gate-then-up
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config


def test_validate_pairs_the_source_with_its_dequantized_folder(tmp_path):
    run_qconv("dequantize", SRC, tmp_path / "out", check=0)
    report = json.loads(run_qconv("validate", "--json", SRC, tmp_path / "out", check=0).stdout)
    (comp,) = report["components"]
    layers = {r["module"]: r for r in comp["layers"]}
    assert set(_oracle()) <= set(layers) and all(r["ok"] for r in layers.values())
    # a negative control: one weight of one fused expert changed
    path = tmp_path / "out" / "model.safetensors"
    tensors = load_file(path)
    tensors[MOE + ".down_proj"][2, 7, 3] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    (comp,) = json.loads(run_qconv("validate", "--json", SRC, tmp_path / "out", check=1).stdout)["components"]
    assert [r["module"] for r in comp["layers"] if not r["ok"]] == [MOE + ".down_proj"]


def _edit_tensors(src, fn):
    tensors = load_file(src / "model.safetensors")
    fn(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def _set_scale(tensors):
    tensors[MOE + ".down_proj_scales"][1, 5, 2] = 255


def _cut_scales(tensors):
    tensors[MOE + ".gate_up_proj_scales"] = tensors[MOE + ".gate_up_proj_scales"][:, :, :4].contiguous()


def _drop_expert(tensors):
    for leaf in ("_blocks", "_scales"):
        tensors[MOE + ".down_proj" + leaf] = tensors[MOE + ".down_proj" + leaf][:3].contiguous()


def _narrow_blocks(tensors):       # 8 bytes (16 values) a scale: another block size
    b = tensors[MOE + ".gate_up_proj_blocks"]
    tensors[MOE + ".gate_up_proj_blocks"] = b.reshape(E, 2 * I, H // 16, 8).contiguous()


def _config_experts(src):
    config = json.loads((src / "config.json").read_text())
    config["num_local_experts"] = 8
    (src / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, code, tensor, needle", [
    (_set_scale, 4, MOE + ".down_proj_scales", "e8m0 scales of 255"),
    (_cut_scales, 4, MOE + ".gate_up_proj_blocks", "gate_up_proj_scales has shape [4, 256, 4]"),
    (_drop_expert, 4, MOE + ".down_proj_blocks", "3 experts, but gate_up_proj_blocks holds 4"),
    (_narrow_blocks, 5, MOE + ".gate_up_proj_blocks", "16 bytes per 32 values"),
    ("config", 4, "model.layers.0.mlp.experts.down_proj_blocks", "num_local_experts is 8"),
], ids=["scale_255", "scales_shape", "expert_count_between_tensors", "width", "expert_count_vs_config"])
def test_refusals_name_file_and_tensor_and_write_nothing(tmp_path, edit, code, tensor, needle):
    src = copy_checkpoint(NAME, tmp_path / "src")
    if edit == "config":
        _config_experts(src)
    else:
        _edit_tensors(src, edit)
    for verb in (("dequantize",), ("convert", "--to", "float16")):
        out = tmp_path / verb[0]
        proc = run_qconv(verb[0], src, out, *verb[1:])
        one_error(proc, code, "model.safetensors", tensor, needle)
        assert not out.exists()


def test_fused_experts_into_an_integer_format_are_refused(tmp_path):
    """gpt-oss interleaves gate and up rows and no loader reads its experts one by one, so they are not
    split into per-expert Linears (test_expert_split.py): exit 5, one line naming the tensor."""
    proc = run_qconv("convert", SRC, tmp_path / "out", "--to", "gptq", check=5)
    assert proc.stderr.count("\n") == 1 and "fused MoE experts" in proc.stderr and MOE in proc.stderr
    assert "interleaved" in proc.stderr and "model.safetensors" in proc.stderr
    assert not (tmp_path / "out").exists()
