"""transformers' / DeepSeek's fine-grained FP8 (quant_method "fp8", formats/fp8/), issue 17, on the files
transformers itself wrote (fixtures/checkpoints/llama-fp8-block, qwen3moe-fp8-block with its experts'
scales fused per layer, qwen3moe-fp8-block-fused with fused e4m3 experts). What every fixture goes
through anyway (the reader against the producer's oracle, dequantize loading in transformers, every
conversion, row windows, refusals) is in the parametrized suites; here: ragged blocks, the MoE layouts,
what inspect says of them, and validate pairing them."""

import json
import math
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, copy_checkpoint, inspect_json, load_tensors, run_qconv

GATE = "model.layers.0.mlp.gate_proj"
RAGGED = "model.layers.0.mlp.ragged_proj"
MOE = "model.layers.0.mlp.experts"


def _header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


@pytest.mark.parametrize("rows, cols", [(320, 256), (512, 200), (200, 130), (1, 1)])
def test_ragged_blocks_take_the_block_size_from_the_config(tmp_path, rows, cols):
    """A dimension that is not a multiple of the block (DeepSeek's kv_a_proj_with_mqa, 576 x 7168 with a
    5 x 56 scale) has a last, partial block. Cut out of a producer-made 512 x 256 module, codes and
    scales as transformers wrote them, it must decode to the same corner of the producer's own oracle:
    the block size comes from weight_block_size, never from dividing the shapes (576 / 5 is not 128).
    The cut is stored as a Linear of its own beside gate_proj (one the config does not size, as
    kv_a_proj_with_mqa is sized by kv_lora_rank): the model's own modules stay as its config says."""
    src = copy_checkpoint("llama-fp8-block", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    w, s = tensors[GATE + ".weight"], tensors[GATE + ".weight_scale_inv"]
    tensors[RAGGED + ".weight"] = w[:rows, :cols].clone()
    tensors[RAGGED + ".weight_scale_inv"] = s[: math.ceil(rows / 128), : math.ceil(cols / 128)].clone()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    run_qconv("dequantize", "--dtype", "float32", src, tmp_path / "out", check=0)
    oracle = load_file(CHECKPOINTS / "llama-fp8-block" / "oracle" / "dequant.safetensors")[GATE + ".weight"]
    got = load_file(tmp_path / "out" / "model.safetensors")[RAGGED + ".weight"]
    assert torch.equal(got, oracle[:rows, :cols])


def test_inspect_reports_block_size_scales_and_experts():
    (dense,) = inspect_json(CHECKPOINTS / "llama-fp8-block")["components"]
    assert (dense["method"], dense["weight_block_size"], dense["scale_fmt"]) == ("fine-grained FP8", [128, 128], "float")
    assert dense["scales_dtype"] == "torch.float32" and "experts" not in dense
    for name in ("qwen3moe-fp8-block", "qwen3moe-fp8-block-fused"):
        (moe,) = inspect_json(CHECKPOINTS / name)["components"]
        # one compact line for every layer's experts (a 256-expert, 58-layer model reads the same)
        assert moe["experts"] == {"model.layers.{0-1}.mlp.experts": 4}, name
        config = json.loads((CHECKPOINTS / name / "config.json").read_text())
        assert config["num_local_experts"] == 4


@pytest.mark.parametrize("name", ["qwen3moe-fp8-block", "qwen3moe-fp8-block-fused"])
def test_bits_per_weight_count_each_stored_byte_once(name):
    """Per-expert weights share their layer's fused scales: counted once, the two MoE layouts (the same
    codes and scales stored two ways) report the same e4m3 bits per weight, computed here from the
    headers."""
    (report,) = inspect_json(CHECKPOINTS / name)["components"]
    header = _header(CHECKPOINTS / name / "model.safetensors")
    e4m3 = [h for h in header.values() if isinstance(h, dict) and h.get("dtype") == "F8_E4M3"]
    scales = [h for k, h in header.items() if k.endswith("scale_inv")]
    params = sum(math.prod(h["shape"]) for h in e4m3)
    stored = params + sum(4 * math.prod(h["shape"]) for h in scales)
    assert report["quantized_parameters"] == {"e4m3": params}
    assert report["quantized_bits_per_weight"] == {"e4m3": round(8 * stored / params, 3)}


def test_fused_experts_dequantize_in_their_own_layout(tmp_path):
    """No silent splitting: fused e4m3 experts become fused float experts of the same name and shape,
    equal to the per-expert layout's gate and up rows stacked (the same model saved two ways)."""
    run_qconv("dequantize", "--dtype", "float32", CHECKPOINTS / "qwen3moe-fp8-block-fused", tmp_path / "f", check=0)
    run_qconv("dequantize", "--dtype", "float32", CHECKPOINTS / "qwen3moe-fp8-block", tmp_path / "p", check=0)
    fused, per = load_tensors(tmp_path / "f"), load_tensors(tmp_path / "p")
    assert fused[MOE + ".gate_up_proj"].shape == (4, 256, 256) and fused[MOE + ".down_proj"].shape == (4, 256, 128)
    assert not any(k.startswith(MOE + ".0.") for k in fused)
    for e in range(4):
        gate_up = torch.cat([per[f"{MOE}.{e}.gate_proj.weight"], per[f"{MOE}.{e}.up_proj.weight"]])
        assert torch.equal(fused[MOE + ".gate_up_proj"][e], gate_up)
        assert torch.equal(fused[MOE + ".down_proj"][e], per[f"{MOE}.{e}.down_proj.weight"])


@pytest.mark.parametrize("name", ["llama-fp8-block", "qwen3moe-fp8-block", "qwen3moe-fp8-block-fused"])
def test_validate_pairs_every_layer_with_the_dequantized_model(tmp_path, name):
    run_qconv("dequantize", CHECKPOINTS / name, tmp_path / "out", check=0)
    report = json.loads(run_qconv("validate", "--json", CHECKPOINTS / name, tmp_path / "out", check=0).stdout)
    (comp,) = report["components"]
    with safe_open(CHECKPOINTS / name / "oracle" / "dequant.safetensors", framework="pt") as f:
        quantized = {k.removesuffix(".weight") for k in f.keys()}
    layers = {r["module"]: r for r in comp["layers"]}
    assert quantized <= set(layers)                     # every e4m3 module, fused experts included
    assert set(layers) - quantized <= {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate",
                                       "model.layers.1.mlp.gate"}
    assert all(r["ok"] for r in layers.values())


def test_validate_sees_a_changed_expert(tmp_path):
    """A negative control: one code of one fused expert changed in the dequantized copy fails that layer."""
    run_qconv("dequantize", CHECKPOINTS / "qwen3moe-fp8-block-fused", tmp_path / "out", check=0)
    path = tmp_path / "out" / "model.safetensors"
    tensors = load_file(path)
    tensors[MOE + ".down_proj"][2, 7, 3] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    proc = run_qconv("validate", "--json", CHECKPOINTS / "qwen3moe-fp8-block-fused", tmp_path / "out", check=1)
    (comp,) = json.loads(proc.stdout)["components"]
    failed = [r["module"] for r in comp["layers"] if not r["ok"]]
    assert failed == [MOE + ".down_proj"]


def test_e4m3_code_book_is_torchs():
    """The e4m3 table decodes every byte as torch.float8_e4m3fn does (0x7F / 0xFF: NaN)."""
    from qconv.formats.core.minifloat import E4M3
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(E4M3, ref, equal_nan=True)
    assert np.isnan(E4M3[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(E4M3, [0x7F, 0xFF])).all()


# ---------------------------------------------------------------------------------------------
# Writing fine-grained FP8 (--to fp8): what transformers' own quantizer writes

def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_fp8_from_a_float_model_is_what_transformers_writes(tmp_path):
    """llama-fp16 quantized data-free by qconv: every tensor (e4m3 codes, float32 weight_scale_inv, the
    float ones) and the quantization_config equal transformers' FineGrainedFP8 output of the same model."""
    run_qconv("convert", CHECKPOINTS / "llama-fp16", tmp_path / "out", "--to", "fp8", check=0)
    ours, theirs = load_tensors(tmp_path / "out"), load_tensors(CHECKPOINTS / "llama-fp8-block")
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not _same(ours[k], theirs[k])] == []
    qc = lambda p: json.loads((p / "config.json").read_text())["quantization_config"]  # noqa: E731
    assert qc(tmp_path / "out") == qc(CHECKPOINTS / "llama-fp8-block")


def test_fp8_from_a_float_moe_is_what_transformers_writes(tmp_path):
    """qwen3moe-bf16: the same codes per expert, and scales equal to the fused per-layer scales
    transformers saved (cut per expert); the routers (mlp.gate) stay bfloat16 as there."""
    run_qconv("convert", CHECKPOINTS / "qwen3moe-bf16", tmp_path / "out", "--to", "fp8", check=0)
    ours, theirs = load_tensors(tmp_path / "out"), load_tensors(CHECKPOINTS / "qwen3moe-fp8-block")
    for layer in (0, 1):
        experts = f"model.layers.{layer}.mlp.experts"
        for e in range(4):
            gate_up = torch.cat([ours[f"{experts}.{e}.gate_proj.weight_scale_inv"],
                                 ours[f"{experts}.{e}.up_proj.weight_scale_inv"]])
            assert torch.equal(gate_up, theirs[experts + ".gate_up_proj_scale_inv"][e])
            assert torch.equal(ours[f"{experts}.{e}.down_proj.weight_scale_inv"], theirs[experts + ".down_proj_scale_inv"][e])
    shared = [k for k in theirs if not k.endswith("_proj_scale_inv") or k.endswith("weight_scale_inv")]
    assert [k for k in shared if not _same(ours[k], theirs[k])] == []
    assert ours["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["llama-fp8-block", "qwen3moe-fp8-block"])
def test_fp8_to_fp8_keeps_every_code(tmp_path, name):
    out = tmp_path / "out"
    (comp,) = json.loads(run_qconv("convert", "--json", CHECKPOINTS / name, out, "--to", "fp8", check=0).stdout)["components"]
    assert comp["codes_kept"] == comp["modules"] > 0 and comp["requantized"] == 0
    src, ours = load_tensors(CHECKPOINTS / name), load_tensors(out)
    codes = [k for k, v in src.items() if v.dtype == torch.float8_e4m3fn]
    assert codes and all(_same(ours[k], src[k]) for k in codes)


def test_another_block_size_is_a_requantization_said_so(tmp_path):
    out = tmp_path / "out"
    proc = run_qconv("convert", "--json", "--validate", CHECKPOINTS / "llama-fp8-block", out, "--to", "fp8",
                     "--block-size", "64x128", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["requantized"] == comp["modules"] == 14
    assert {r["reason"] for r in comp["layers"]} == {"e4m3 128 x 128 blocks become 64 x 128 blocks"}
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [64, 128]
    assert load_tensors(out)[GATE + ".weight_scale_inv"].shape == (8, 2)
    assert comp["validation"]["ok"] and comp["validation"]["layers"] == 16


@pytest.mark.parametrize("value", ["128", "0x128", "axb", "128x128x1"])
def test_a_block_size_that_is_not_one_is_a_usage_error(tmp_path, value):
    proc = run_qconv("convert", CHECKPOINTS / "llama-fp16", tmp_path / "out", "--to", "fp8", "--block-size", value,
                     check=2)
    assert "block size" in proc.stderr and not (tmp_path / "out").exists()


def test_transformers_runs_qconvs_fp8_output(tmp_path):
    """transformers on CPU loads the fp8 output (it dequantizes FP8 there) and gives the logits of the
    producer's oracle model, loaded the same way (dtype float32 dequantizes the Linears to float32 but
    leaves norms and embeddings in float16: .float() makes the forward run, as the oracle's did)."""
    from transformers import AutoModelForCausalLM

    run_qconv("convert", CHECKPOINTS / "llama-fp16", tmp_path / "out", "--to", "fp8", check=0)
    oracle = load_file(CHECKPOINTS / "llama-fp8-block" / "oracle" / "logits.safetensors")
    logits = []
    for folder in (tmp_path / "out", CHECKPOINTS / "llama-fp8-block"):
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.float32).float()
        with torch.no_grad():
            logits.append(model(input_ids=oracle["input_ids"]).logits.float())
    assert torch.equal(logits[0], logits[1])                 # the producer's own file, run the same way
    # and the oracle's logits, up to the summation order of another machine's threads (measured 7e-7)
    assert ((logits[0] - oracle["logits"]).norm() / oracle["logits"].norm()).item() < 1e-5
