"""Fused MoE experts into formats that hold one Linear per expert (issue 17): transformers 5's fused
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] (saved with save_original_format=False)
are written as `experts.N.gate_proj` / `up_proj` / `down_proj`, the layout transformers' default save
writes and every loader of the integer formats reads.

The expectation comes from the producer, not from qconv: transformers saved the same FP8 model both ways
(qwen3moe-fp8-block: per-expert weights; qwen3moe-fp8-block-fused: fused), so converting either must give
the same bytes. gpt-oss' interleaved layout, which no loader reads per expert, is refused
(test_mxfp4_gptoss.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, copy_checkpoint, convert_component, load_tensors, one_error, run_qconv

FUSED, PER_EXPERT = CHECKPOINTS / "qwen3moe-fp8-block-fused", CHECKPOINTS / "qwen3moe-fp8-block"
MOE = "model.layers.0.mlp.experts"


@pytest.mark.parametrize("target", ["gptq", "compressed-tensors-w8a8", "compressed-tensors", "awq", "bnb8",
                                    "fp8", "compressed-tensors-fp8", "compressed-tensors-nvfp4"])
def test_fused_experts_convert_to_what_the_per_expert_save_converts_to(tmp_path, target):
    a = convert_component(FUSED, tmp_path / "fused", target)
    b = convert_component(PER_EXPERT, tmp_path / "per", target)
    assert (tmp_path / "fused" / "model.safetensors").read_bytes() == (tmp_path / "per" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "fused" / "config.json").read_text()) == \
        json.loads((tmp_path / "per" / "config.json").read_text())
    assert a["modules"] == b["modules"] == 8 + 2 * 4 * 3 and a["layers"] == b["layers"]
    assert a["experts_split"] == {"fused_tensors": 4, "modules": 24,
                                  "examples": [MOE + ".down_proj", MOE + ".gate_up_proj"]}
    assert "experts_split" not in b
    names = set(load_tensors(tmp_path / "fused"))
    assert not any(n.startswith((MOE + ".gate_up_proj", MOE + ".down_proj")) for n in names)
    assert {f"{MOE}.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")} <= \
        {n.rsplit(".", 1)[0] for n in names}


def test_the_split_is_what_transformers_fuses(tmp_path):
    """Rows of the source's own dequantization: expert N's gate_proj is the first half of gate_up_proj[N]
    (transformers' conversion_mapping concatenates gate then up), up_proj the second, down_proj is
    down_proj[N]. Written as float32 codes kept (fp8 -> fp8 keeps every e4m3 code and block scale), so
    the dequantized split equals the producer's fused oracle exactly."""
    run_qconv("convert", FUSED, tmp_path / "out", "--to", "fp8", check=0)
    run_qconv("dequantize", tmp_path / "out", tmp_path / "float", "--dtype", "float32", check=0)
    ours = load_tensors(tmp_path / "float")
    oracle = load_file(FUSED / "oracle" / "dequant.safetensors")
    for layer in (0, 1):
        moe = f"model.layers.{layer}.mlp.experts"
        gate_up, down = oracle[moe + ".gate_up_proj"], oracle[moe + ".down_proj"]
        for e in range(4):
            assert torch.equal(ours[f"{moe}.{e}.gate_proj.weight"], gate_up[e, :128])
            assert torch.equal(ours[f"{moe}.{e}.up_proj.weight"], gate_up[e, 128:])
            assert torch.equal(ours[f"{moe}.{e}.down_proj.weight"], down[e])


def test_validate_pairs_fused_experts_with_the_split_ones(tmp_path):
    """convert --validate compares each per-expert Linear with its rows of the fused source; validate
    pairs a fused float folder with a per-expert one, and an expert changed in one of them fails alone."""
    proc = run_qconv("convert", "--json", "--validate", FUSED, tmp_path / "w8", "--to", "compressed-tensors-w8a8",
                     check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert {k: v for k, v in comp["validation"].items() if k != "output_errors"} == \
        {"ok": True, "layers": 36, "device": "cpu"}
    assert len(comp["validation"]["output_errors"]) == 36
    run_qconv("dequantize", FUSED, tmp_path / "fused", check=0)
    run_qconv("dequantize", PER_EXPERT, tmp_path / "per", check=0)
    report = json.loads(run_qconv("validate", "--json", tmp_path / "fused", tmp_path / "per", check=0).stdout)
    (comp,) = report["components"]
    layers = {r["module"] for r in comp["layers"]}
    assert f"{MOE}.3.up_proj" in layers and len(layers) == 36 and not comp["only_in_a"] and not comp["only_in_b"]
    path = tmp_path / "per" / "model.safetensors"
    tensors = load_file(path)
    tensors[f"{MOE}.2.up_proj.weight"][5, 9] += 0.5
    save_file(tensors, path, metadata={"format": "pt"})
    report = json.loads(run_qconv("validate", "--json", FUSED, tmp_path / "per", check=1).stdout)
    (comp,) = report["components"]
    assert [r["module"] for r in comp["layers"] if not r["ok"]] == [f"{MOE}.2.up_proj"]


@pytest.mark.parametrize("target", ["gptq", "compressed-tensors-w8a8"])
def test_a_fused_float_model_is_quantized_per_expert(tmp_path, target):
    """Data-free quantization of a float model with fused experts quantizes the experts too (as per-expert
    Linears), never leaves them float: the same bytes as from the per-expert float model, and the same
    report (W8A8's activation cost reads each expert's rows of the fused source)."""
    run_qconv("dequantize", FUSED, tmp_path / "fused", check=0)
    run_qconv("dequantize", PER_EXPERT, tmp_path / "per", check=0)
    a = convert_component(tmp_path / "fused", tmp_path / "a", target)
    b = convert_component(tmp_path / "per", tmp_path / "b", target)
    assert a["modules"] == 32 and a["experts_split"]["modules"] == 24
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a["layers"] == b["layers"] and a.get("activation_cost") == b.get("activation_cost")


def test_a_model_type_with_another_fused_layout_is_refused(tmp_path):
    """Other model types fuse differently (Qwen3-VL-MoE transposed, Mixtral renamed): refused by name."""
    src = copy_checkpoint("qwen3moe-fp8-block-fused", tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "mixtral"
    (src / "config.json").write_text(json.dumps(config))
    one_error(run_qconv("convert", src, tmp_path / "out", "--to", "compressed-tensors-w8a8"), 5,
              "fused MoE experts", "'mixtral'")
    assert not (tmp_path / "out").exists()


def test_the_split_is_the_same_whatever_the_jobs(tmp_path):
    convert_component(FUSED, tmp_path / "one", "gptq", "--jobs", "1", "--max-shard-size", "200KB")
    convert_component(FUSED, tmp_path / "two", "gptq", "--jobs", "2", "--max-shard-size", "200KB")
    one, two = sorted((tmp_path / "one").glob("*.safetensors")), sorted((tmp_path / "two").glob("*.safetensors"))
    assert len(one) > 2 and [p.name for p in one] == [p.name for p in two]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two))


def test_an_odd_gate_up_is_refused_not_split(tmp_path):
    """A fused gate_up_proj with an odd number of rows per expert has no gate half and up half: convert
    refuses it (exit 5, one line naming it); validate leaves it fused, unpaired, and fails (exit 1). The
    config says no moe_intermediate_size (an architecture qconv's structure checks do not size: with one,
    255 rows against 2 x 128 is refused first, as a config the tensors contradict, exit 4)."""
    run_qconv("dequantize", FUSED, tmp_path / "fused", check=0)
    path = tmp_path / "fused" / "model.safetensors"
    tensors = load_file(path)
    tensors[MOE + ".gate_up_proj"] = tensors[MOE + ".gate_up_proj"][:, :255].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    one_error(run_qconv("convert", tmp_path / "fused", tmp_path / "out", "--to", "gptq"), 4,
              "moe_intermediate_size (128) x its gate and up halves (2) is 256, but it has 255 rows per expert")
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    del config["moe_intermediate_size"]
    (tmp_path / "fused" / "config.json").write_text(json.dumps(config))
    one_error(run_qconv("convert", tmp_path / "fused", tmp_path / "out", "--to", "gptq"), 5,
              "cannot be split", "255 gate_up_proj rows per expert: not a gate half and an up half",
              MOE + ".gate_up_proj")
    assert not (tmp_path / "out").exists()
    run_qconv("dequantize", PER_EXPERT, tmp_path / "per", check=0)
    report = json.loads(run_qconv("validate", "--json", tmp_path / "fused", tmp_path / "per", check=1).stdout)
    (comp,) = report["components"]
    assert MOE + ".gate_up_proj" in comp["only_in_a"] and f"{MOE}.0.gate_proj" in comp["only_in_b"]
