"""The serve-ready targets: compressed-tensors (pack-quantized W{bits}A16, int-quantized W8A8) and AWQ
GEMM, written through the format registry. Lossless paths keep every code (checked against the
producer-made files byte for byte), lossy ones say why, and outputs load in their consumers
(transformers with compressed-tensors here; vLLM in test_vllm_cpu.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import CHECKPOINTS, run_qconv, load_tensors


def _convert(src, dst, *args):
    proc = run_qconv("convert", "--json", src, dst, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)



def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


# Round trips through the other formats back to the producer's own file: every tensor byte for byte.
ROUND_TRIPS = [
    ("llama-ct-w4a16", ["gptq-v2", "compressed-tensors"]),
    ("llama-ct-w4a16", ["gptq", "awq", "compressed-tensors"]),
    ("llama-ct-w4a16-asym", ["awq", "gptq-v2", "compressed-tensors"]),
    ("llama-ct-w8a16", ["gptq-v2", "compressed-tensors"]),
    ("llama-ct-w8a16-channel", ["gptq", "compressed-tensors"]),
    ("llama-ct-w3a16", ["gptq-v2", "compressed-tensors"]),
    ("llama-ct-mixed", ["gptq-v2", "compressed-tensors"]),
    ("llama-ct-w8a8", ["bnb8", "compressed-tensors-w8a8 --scale-dtype float16"]),
    ("llama-awq-w4g128", ["compressed-tensors", "gptq-v2", "awq"]),
    ("llama-awq-w4g64-sym", ["compressed-tensors", "awq"]),
    ("llama-gptq-w4g64-asym", ["compressed-tensors", "awq", "gptq"]),
    ("llama-gptq-w8g128", ["compressed-tensors", "gptq"]),
]


@pytest.mark.parametrize("name,chain", ROUND_TRIPS, ids=[f"{n}:{'>'.join(c)}" for n, c in ROUND_TRIPS])
def test_round_trips_keep_every_byte(tmp_path, name, chain):
    src = CHECKPOINTS / name
    for i, step in enumerate(chain):
        to, *options = step.split()
        dst = tmp_path / f"{i}-{to}"
        report = _convert(src, dst, "--to", to, *options)
        (comp,) = report["components"]
        assert comp["requantized"] == 0 and comp["codes_kept"] == comp["modules"] > 0, comp
        src = dst
    original, back = load_tensors(CHECKPOINTS / name), load_tensors(src)
    # GPTQ sources: g_idx is written by GPTQ targets, and AWQ/CT carry none; unquantized tensors keep
    # their values (auto-round-made files keep them in bfloat16, others as stored).
    assert sorted(back) == sorted(original)
    differ = [k for k in original if not _same_bytes(original[k], back[k])]
    assert differ == []


@pytest.mark.parametrize("to", ["compressed-tensors", "compressed-tensors-w8a8"])
def test_bnb_int8_becomes_compressed_tensors_codes_kept(tmp_path, to):
    """CB stored as is (int-quantized: the int8 weight itself; pack-quantized: CB + 128), scale SCB / 127
    in float32: the only rounding, reported; validate proves every weight within float32's bound."""
    out = tmp_path / "out"
    (comp,) = _convert(CHECKPOINTS / "llama-bnb8", out, "--to", to)["components"]
    assert comp["codes_kept"] == comp["modules"] == 14 and comp["requantized"] == 0
    assert 0 < comp["max_scale_rel_error"] <= 2.0**-24
    src, ours = load_tensors(CHECKPOINTS / "llama-bnb8"), load_tensors(out)
    q = "model.layers.0.self_attn.q_proj"
    if to.endswith("w8a8"):
        assert torch.equal(ours[f"{q}.weight"], src[f"{q}.weight"])
    assert ours[f"{q}.weight_scale"].dtype == torch.float32
    assert torch.equal(ours[f"{q}.weight_scale"][:, 0].double(),
                       (src[f"{q}.SCB"].double() / 127).float().double())
    proc = run_qconv("validate", "--json", CHECKPOINTS / "llama-bnb8", out)
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and {r["weights_checked"] for r in result["layers"] if r["module"].startswith(
        "model.layers.")} == {"codes identical, scales within the bound"}


def test_w8a8_config_is_llm_compressors(tmp_path):
    """The W8A8 output's config says what llm-compressor's W8A8 preset says: int-quantized, 8-bit
    symmetric per-channel weights, dynamic per-token int8 input activations, lm_head ignored."""
    out = tmp_path / "out"
    _convert(CHECKPOINTS / "llama-bnb8", out, "--to", "compressed-tensors-w8a8")
    ours = json.loads((out / "config.json").read_text())["quantization_config"]
    theirs = json.loads((CHECKPOINTS / "llama-ct-w8a8" / "config.json").read_text())["quantization_config"]
    for qc in (ours, theirs):
        for group in qc["config_groups"].values():
            group["weights"].pop("observer")
            group["input_activations"].pop("observer")
    assert ours["config_groups"] == theirs["config_groups"] and ours["ignore"] == theirs["ignore"] == ["lm_head"]
    assert ours["format"] == theirs["format"] == "int-quantized"


# W8A8 quantizes activations to int8 per token at run time (measured 1.8 % on llm-compressor's own W8A8
# fixture against its float weights); weight-only files differ from their float twin by the fp16/bf16
# rounding of the two runs (measured up to 0.6 %; a zero point off by one in each group gives ~30 %).
@pytest.mark.parametrize("src,to,tol", [
    ("llama-bnb8", "compressed-tensors-w8a8", 0.03),
    ("llama-bnb8", "compressed-tensors", 0.01),
    ("llama-gptq-w4g128-actorder", "compressed-tensors", 0.01),
    ("llama-awq-w4g64-sym", "compressed-tensors", 0.01),
    ("llama-fp8-block", "compressed-tensors-w8a8", 0.03),        # FP8 -> what Ampere / CPUs run (issue 17)
    ("llama-fp8-block", "compressed-tensors", 0.01),
    ("qwen3moe-fp8-block", "compressed-tensors", 0.01),
    ("qwen3moe-fp8-block-fused", "compressed-tensors", 0.01),   # fused experts, split (test_expert_split.py)
])
def test_compressed_tensors_outputs_load_in_transformers(tmp_path, src, to, tol):
    """transformers (compressed-tensors installed) loads the output as compressed-tensors, and its
    logits match plain transformers on qconv's float dequantization of the same file. (Asymmetric
    pack-quantized files, the producer's own included, do not load in transformers 5.23 with
    compressed-tensors 0.19: a zero-point shape mismatch; vLLM runs them, test_vllm_cpu.py.)"""
    from transformers import AutoModelForCausalLM

    out, flat = tmp_path / "out", tmp_path / "float"
    _convert(CHECKPOINTS / src, out, "--to", to)
    run_qconv("dequantize", out, flat, check=0)
    ids = load_file(CHECKPOINTS / src / "oracle" / "logits.safetensors")["input_ids"]
    logits = []
    for folder in (out, flat):
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits.float())
        if folder == out:
            assert type(model.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"
    rel = ((logits[0] - logits[1]).norm() / logits[1].norm()).item()
    assert rel < tol, rel


def test_act_order_into_awq_is_requantized_and_said(tmp_path):
    """AWQ stores no g_idx: act-order groups are requantized contiguous, with the error reported."""
    (comp,) = _convert(CHECKPOINTS / "llama-gptq-w4g128-actorder", tmp_path / "out", "--to", "awq")["components"]
    assert comp["requantized"] > 0
    assert all(r["reason"] == "act-order groups become contiguous (awq stores no g_idx)" for r in comp["layers"])
    assert all(r["rel_frobenius"] > 0 for r in comp["layers"])
    # the error reported is the error the file has: convert --validate holds each layer to it
    proc = run_qconv("convert", "--validate", CHECKPOINTS / "llama-gptq-w4g128-actorder", tmp_path / "v", "--to", "awq")
    assert proc.returncode == 0, proc.stderr


def test_per_row_scales_into_awq_become_groups_and_8_bit_becomes_4(tmp_path):
    (comp,) = _convert(CHECKPOINTS / "llama-bnb8", tmp_path / "out", "--to", "awq")["components"]
    assert comp["requantized"] == comp["modules"] == 14
    assert {r["reason"] for r in comp["layers"]} == {"8-bit codes become 4-bit"}
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["group_size"] == 128 and qc["version"] == "gemm"


@pytest.mark.parametrize("args,code,needle", [
    (["--to", "awq", "--bits", "8"], 2, "awq stores 4-bit codes, not 8-bit"),
    (["--to", "awq", "--group-size", "-1"], 2, "awq stores groups"),
    (["--to", "compressed-tensors-w8a8", "--asym"], 2, "symmetric codes only"),
    (["--to", "compressed-tensors-w8a8", "--group-size", "64"], 2, "one scale per output row"),
    (["--to", "awq", "--scale-dtype", "float32"], 2, "awq stores scales as BF16, F16"),
])
def test_what_a_target_cannot_hold_is_a_usage_error(tmp_path, args, code, needle):
    proc = run_qconv("convert", CHECKPOINTS / "llama-gptq-w4g64-asym", tmp_path / "out", *args)
    assert proc.returncode == code and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_w8a8_reports_what_int8_activations_cost(tmp_path):
    """Per layer, on outlier-shaped activations: per-token int8 activations against bitsandbytes' own
    LLM.int8 matmul (which keeps the outlier columns in float16). LLM.int8 stays close to the float
    product; per-token int8 quantizes the outliers' rows coarsely, so it costs more; both are said."""
    (comp,) = _convert(CHECKPOINTS / "llama-bnb8", tmp_path / "out", "--to", "compressed-tensors-w8a8")["components"]
    cost = comp["activation_cost"]
    assert cost["source_matmul"] == ["bitsandbytes LLM.int8 (threshold 6.0)"]
    assert [r["module"] for r in cost["layers"]] == sorted(
        (r["module"] for r in cost["layers"]), key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
    assert len(cost["layers"]) == 14
    for r in cost["layers"]:
        assert r["source_matmul_vs_float"] < 0.01 < r["vs_source_matmul"] < 0.2
    text = run_qconv("convert", CHECKPOINTS / "llama-bnb8", tmp_path / "text", "--to", "compressed-tensors-w8a8").stdout
    assert "run-time int8, per token, dynamic activations" in text and "median layer" in text
    (gptq,) = _convert(CHECKPOINTS / "llama-gptq-w8g128", tmp_path / "g", "--to", "compressed-tensors-w8a8")["components"]
    assert gptq["activation_cost"]["source_matmul"] == ["float"]     # weight-only source: a float product
    # group 128 -> per-channel is a requantization: the written weights differ from the source's
    assert gptq["requantized"] == 14 and all(r["source_matmul_vs_float"] > 0 for r in gptq["activation_cost"]["layers"])
