"""The compressed-tensors-nvfp4 target: llm-compressor's NVFP4A16 (nvfp4-pack-quantized, weights only).
From the float base model it writes the producer's own file byte for byte (llm-compressor's arithmetic
reproduced op for op, one global scale for q/k/v and for gate/up); NVFP4 sources keep their codes
(compressed-tensors: the same bytes back; ModelOpt: codes and e4m3 scales kept, its global multiplier
made a divisor, the rounding reported); the output loads in transformers with compressed-tensors."""

import json

import numpy as np
import pytest
import torch

from conftest import (CHECKPOINTS, assert_same_tensors as _same_files, convert_component, load_tensors,
                      one_error, run_qconv, tensor_bytes as _bytes)

TARGET = "compressed-tensors-nvfp4"


def _convert(src, dst, *args):
    return convert_component(src, dst, TARGET, *args)


def _qc(folder, drop_observer=True):
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    if drop_observer:          # qconv writes null, llm-compressor the observer it ran (memoryless_minmax)
        for group in qc["config_groups"].values():
            group["weights"].pop("observer")
    return qc


def test_the_float_model_gives_llm_compressors_bytes(tmp_path):
    """Data-free from llama-fp16, every tensor is llm-compressor's NVFP4A16 file's (packed e2m1 codes,
    e4m3 group scales, float32 global scales shared by q/k/v and by gate/up, float tensors passed
    through) and so is the config, observer aside."""
    out = tmp_path / "out"
    comp = _convert(CHECKPOINTS / "llama-fp16", out)
    assert comp["requantized"] == comp["modules"] == 14
    assert {r["reason"] for r in comp["layers"]} == {"float16 weights quantized data-free to NVFP4 (no calibration data)"}
    _same_files(out, CHECKPOINTS / "llama-ct-nvfp4a16")
    assert _qc(out) == _qc(CHECKPOINTS / "llama-ct-nvfp4a16")
    weights = _qc(out, False)["config_groups"]["group_0"]["weights"]
    assert weights["observer"] is None and weights["strategy"] == "tensor_group" and weights["group_size"] == 16


def test_fused_modules_share_one_global_scale(tmp_path):
    """What vLLM fuses into one GEMM shares one global scale, 2688 / (their joint absolute maximum) in
    the model dtype as torch computes a number over a tensor (generate_gparam's expression): q/k/v, and gate/up of every expert and of the dense MLPs; o_proj and down_proj have
    their own. The MoE router stays bfloat16."""
    out = tmp_path / "out"
    _convert(CHECKPOINTS / "qwen3moe-bf16", out)
    ours, base = load_tensors(out), load_tensors(CHECKPOINTS / "qwen3moe-bf16")
    groups = {}
    for name in ours:
        if name.endswith(".weight_global_scale"):
            prefix = name[: -len(".weight_global_scale")]
            parent, leaf = prefix.rsplit(".", 1)
            key = (parent, "qkv" if leaf in ("q_proj", "k_proj", "v_proj") else
                   "gate_up" if leaf in ("gate_proj", "up_proj") else leaf)
            groups.setdefault(key, []).append(prefix)
    assert any(k[1] == "qkv" for k in groups) and sum(k[1] == "gate_up" for k in groups) >= 4
    for (parent, kind), members in groups.items():
        assert len(members) == {"qkv": 3, "gate_up": 2}.get(kind, 1), members
        absmax = max(base[m + ".weight"].abs().max() for m in members)           # bfloat16
        expected = (448.0 * 6.0 / absmax.reshape(1)).float()    # torch: reciprocal in bfloat16, then times
        for m in members:
            assert torch.equal(ours[m + ".weight_global_scale"], expected.reshape(1)), m
    router = [k for k in ours if k.endswith("mlp.gate.weight")]
    assert router and all(ours[k].dtype == torch.bfloat16 for k in router)


def test_nvfp4_sources_keep_their_bytes(tmp_path):
    """compressed-tensors NVFP4A16 -> here is the same file; NVFP4 (W4A4) too: every weight tensor and its
    calibrated activation global scales, and llm-compressor's W4A4 input_activations in the config."""
    out = tmp_path / "a16"
    comp = _convert(CHECKPOINTS / "llama-ct-nvfp4a16", out)
    assert comp["codes_kept"] == 14 and comp["requantized"] == 0 and comp["scales_rounded"] == 0
    _same_files(out, CHECKPOINTS / "llama-ct-nvfp4a16")
    assert _qc(out) == _qc(CHECKPOINTS / "llama-ct-nvfp4a16")
    out = tmp_path / "a4"
    comp = _convert(CHECKPOINTS / "llama-ct-nvfp4", out)
    assert comp["codes_kept"] == 14 and comp["warnings"] == []
    assert comp["static_activation_scales"] == {"carried": 14, "dropped": 0}
    _same_files(out, CHECKPOINTS / "llama-ct-nvfp4")
    ours, theirs = _qc(out)["config_groups"]["group_0"], _qc(CHECKPOINTS / "llama-ct-nvfp4")["config_groups"]["group_0"]
    for key in ("input_activations", "weights"):        # observers: null in qconv's writers (nothing reads them)
        assert {**ours[key], "observer": None} == {**theirs[key], "observer": None}


def test_modelopt_nvfp4_keeps_its_codes(tmp_path):
    """ModelOpt NVFP4: the same packed codes and e4m3 scales; its multiplier weight_scale_2 becomes the
    divisor float32(1 / s2); where e4m3 / (1 / s2) is not e4m3 * s2 the summary counts the rounding,
    and the result validates against the source (the bfloat16 product compressed-tensors decodes
    through counted in the bound)."""
    out = tmp_path / "out"
    comp = _convert(CHECKPOINTS / "llama-modelopt-nvfp4", out, "--validate")
    assert comp["codes_kept"] == 14 and comp["requantized"] == 0
    assert 0 < comp["scales_rounded"] and comp["max_scale_rel_error"] < 2.0**-22
    assert comp["validation"]["ok"]
    ours, theirs = load_tensors(out), load_tensors(CHECKPOINTS / "llama-modelopt-nvfp4")
    for name, s2 in theirs.items():
        if not name.endswith(".weight_scale_2"):
            continue
        prefix = name[: -len(".weight_scale_2")]
        assert torch.equal(ours[prefix + ".weight_packed"], theirs[prefix + ".weight"])
        assert torch.equal(_bytes(ours[prefix + ".weight_scale"]), _bytes(theirs[prefix + ".weight_scale"]))
        assert ours[prefix + ".weight_global_scale"].item() == np.float32(1) / np.float32(s2.item())
    assert not any(k.endswith((".weight_scale_2", ".input_scale")) for k in ours)


@pytest.mark.parametrize("src", ["llama-fp16", "llama-modelopt-nvfp4"])
def test_outputs_load_in_transformers(tmp_path, src):
    """transformers (compressed-tensors installed) loads the output as compressed-tensors NVFP4 and
    decompresses it on the CPU (dequantize=True: run_compressed=False, as the fixtures' oracles were made) into exactly
    the weights of qconv's dequantization of the same file (which follows compressed-tensors' bfloat16
    product), so the two models give the same logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out, flat = tmp_path / "out", tmp_path / "float"
    _convert(CHECKPOINTS / src, out)
    run_qconv("dequantize", out, flat, check=0)
    ids = load_file(CHECKPOINTS / "llama-ct-nvfp4a16" / "oracle" / "logits.safetensors")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.float16,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    plain = AutoModelForCausalLM.from_pretrained(flat, device_map="cpu", dtype=torch.float16)
    theirs, ours = dict(model.named_parameters()), dict(plain.named_parameters())
    linears = [k for k in ours if k.endswith("proj.weight")]
    assert len(linears) == 14
    for k in linears:
        assert torch.equal(theirs[k].to(torch.float16), ours[k]), k
    with torch.no_grad():
        got, reference = model(input_ids=ids).logits.float(), plain(input_ids=ids).logits.float()
    assert torch.equal(got, reference)


@pytest.mark.parametrize("args,needle", [
    (["--bits", "4"], "--bits: --to compressed-tensors-nvfp4 takes no such option"),
    (["--group-size", "32"], "--group-size: --to compressed-tensors-nvfp4"),
    (["--scale-dtype", "float16"], "--scale-dtype: --to compressed-tensors-nvfp4"),
    (["--block-size", "128x128"], "--block-size: --to compressed-tensors-nvfp4"),
])
def test_options_are_usage_errors(tmp_path, args, needle):
    proc = run_qconv("convert", CHECKPOINTS / "llama-fp16", tmp_path / "out", "--to", TARGET, *args)
    one_error(proc, 2, needle)
    assert not (tmp_path / "out").exists()


def test_inputs_not_in_whole_groups_are_refused():
    from qconv.convert.convert import Options
    from qconv.errors import UnsupportedFormat
    from qconv.formats.core.ir import QuantSpec
    from qconv.formats.core.layout import QuantModule
    from qconv.formats.core.registry import target

    m = QuantModule("model.layers.0.mlp.down_proj", "float", "float16", 16, 8, 40, ("x.weight",), ())
    with pytest.raises(UnsupportedFormat, match="40 input features, not a whole number of NVFP4 groups of 16"):
        target(TARGET).fit(m, QuantSpec("int", 16, -1, True), Options(TARGET), None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantizer_is_compressed_tensors_own(dtype):
    """quantize_nvfp4 and global_scale against compressed-tensors' own generate_gparam,
    calculate_qparams, quantize and pack_fp4_to_uint8, on weights with an all-zero group, values on
    e2m1's rounding ties, tiny negatives (which round to -0) and -0.0 itself."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    from qconv.formats.compressed_tensors.codec import global_scale, quantize_nvfp4

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 128, generator=gen) * 0.05).to(dtype)
    w[3, 16:32] = 0
    w[5, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5],
                             dtype=dtype) * 0.01
    w[7, :16] = -1e-6
    w[7, 0] = 6e-2
    w[9, :4] = -0.0
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                            scale_dtype=torch.float8_e4m3fn)
    absmax = w.abs().max()
    g_theirs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    g_ours = global_scale(float(absmax), "float16" if dtype == torch.float16 else "bfloat16")
    assert g_theirs.item() == g_ours
    groups = w.reshape(48, 8, 16)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g_theirs)
    q = quantize(w, scale, zp, args, global_scale=g_theirs)
    theirs = pack_fp4_to_uint8(q)
    codes, scales = quantize_nvfp4(w.float().numpy(), "float16" if dtype == torch.float16 else "bfloat16", g_ours)
    ours = codes[:, 0::2] | (codes[:, 1::2] << 4)
    assert np.array_equal(ours, theirs.numpy())
    assert np.array_equal(scales, scale.float().numpy())
