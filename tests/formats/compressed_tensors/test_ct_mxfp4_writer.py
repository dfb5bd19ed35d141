"""The compressed-tensors-mxfp4 target: llm-compressor's MXFP4A16 (mxfp4-pack-quantized, weights only).
From the float base model it writes the producer's own file byte for byte (llm-compressor's arithmetic
reproduced op for op); MXFP4 sources keep their codes and e8m0 scales (the same bytes back); other
sources are requantized with the error reported; the output loads in transformers with compressed-tensors."""

import json

import numpy as np
import pytest
import torch

from conftest import CHECKPOINTS, assert_same_tensors, convert_component, one_error, run_qconv

TARGET = "compressed-tensors-mxfp4"


def _qc(folder, drop_observer=True):
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    if drop_observer:          # qconv writes null, llm-compressor the observer it ran (memoryless_minmax)
        for group in qc["config_groups"].values():
            group["weights"].pop("observer")
    return qc


def test_the_float_model_gives_llm_compressors_bytes(tmp_path):
    """Data-free from llama-fp16, every tensor is llm-compressor's MXFP4A16 file's (packed e2m1 codes,
    e8m0 exponents, float tensors passed through) and so is the config, observer aside."""
    out = tmp_path / "out"
    comp = convert_component(CHECKPOINTS / "llama-fp16", out, TARGET)
    assert comp["requantized"] == comp["modules"] == 14
    assert {r["reason"] for r in comp["layers"]} == {"float16 weights quantized data-free to MXFP4 (no calibration data)"}
    assert_same_tensors(out, CHECKPOINTS / "llama-ct-mxfp4")
    assert _qc(out) == _qc(CHECKPOINTS / "llama-ct-mxfp4")
    weights = _qc(out, False)["config_groups"]["group_0"]["weights"]
    assert weights["observer"] is None and weights["group_size"] == 32 and weights["scale_dtype"] == "torch.uint8"


def test_mxfp4_sources_keep_their_bytes(tmp_path):
    """llm-compressor's MXFP4 file through qconv gives the same bytes back, every code kept; through a
    float folder and back it is requantized, and that is said."""
    comp = convert_component(CHECKPOINTS / "llama-ct-mxfp4", tmp_path / "same", TARGET)
    assert comp["codes_kept"] == comp["modules"] == 14 and comp["requantized"] == 0
    assert_same_tensors(tmp_path / "same", CHECKPOINTS / "llama-ct-mxfp4")
    assert _qc(tmp_path / "same") == _qc(CHECKPOINTS / "llama-ct-mxfp4")


@pytest.mark.parametrize("src", ["llama-gptq-w4g128-actorder", "llama-ct-nvfp4a16", "llama-fp8-block"])
def test_other_sources_are_requantized_and_validate(tmp_path, src):
    """Other formats are requantized from their exact weights, each layer's error reported, and the
    result validates against the source within it (convert --validate)."""
    proc = run_qconv("convert", "--json", "--validate", CHECKPOINTS / src, tmp_path / "out", "--to", TARGET, check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["requantized"] == comp["modules"] == 14 and comp["validation"]["ok"]
    assert all(0 < r["rel_frobenius"] < 0.3 for r in comp["layers"])


def test_output_loads_in_transformers(tmp_path):
    """transformers (compressed-tensors installed) decompresses the output into exactly the weights of
    qconv's dequantization of the same file, so the two models give the same logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out, flat = tmp_path / "out", tmp_path / "float"
    convert_component(CHECKPOINTS / "llama-gptq-w4g128-actorder", out, TARGET)
    run_qconv("dequantize", out, flat, check=0)
    ids = load_file(CHECKPOINTS / "llama-ct-mxfp4" / "oracle" / "logits.safetensors")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.float16,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    plain = AutoModelForCausalLM.from_pretrained(flat, device_map="cpu", dtype=torch.float16)
    theirs, ours = dict(model.named_parameters()), dict(plain.named_parameters())
    linears = [k for k in ours if k.endswith("proj.weight")]
    assert len(linears) == 14
    for k in linears:
        assert torch.equal(theirs[k].to(torch.float16), ours[k]), k
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits.float(), plain(input_ids=ids).logits.float())


@pytest.mark.parametrize("args,needle", [
    (["--bits", "4"], "--bits: --to compressed-tensors-mxfp4 takes no such option"),
    (["--group-size", "32"], "--group-size: --to compressed-tensors-mxfp4"),
    (["--scale-dtype", "float16"], "--scale-dtype: --to compressed-tensors-mxfp4"),
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

    m = QuantModule("model.layers.0.mlp.down_proj", "float", "float16", 16, 8, 48, ("x.weight",), ())
    with pytest.raises(UnsupportedFormat, match="48 input features, not a whole number of MXFP4 groups of 32"):
        target(TARGET).fit(m, QuantSpec("int", 16, -1, True), Options(TARGET), None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantizer_is_compressed_tensors_own(dtype):
    """quantize_mxfp4 against compressed-tensors' own calculate_qparams (generate_mx_scales), quantize,
    pack_fp4_to_uint8 and compress_mx_scale, on weights with an all-zero group, a group below float16's
    range, group maxima on round_to_power_2's boundary (significand 1.75 rounds up, just below it down),
    values on e2m1's rounding ties and -0.0."""
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from qconv.formats.compressed_tensors.codec import quantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(40, 128, generator=gen) * torch.logspace(-4, 1, 128)).to(dtype)
    w[3, 32:64] = 0
    w[4, :32] = 1e-7
    w[5, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5],
                             dtype=dtype) * 0.125
    w[6, 0], w[6, 32], w[6, 64] = 1.75, 1.74, -1.75 * 2**-10
    w[9, :4] = -0.0
    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                            scale_dtype=torch.uint8)
    groups = w.reshape(40, 4, 32)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    theirs = pack_fp4_to_uint8(quantize(w, scale, zp, args))
    codes, exponents = quantize_mxfp4(w.float().numpy(), str(dtype).split(".")[1])
    assert np.array_equal(codes[:, 0::2] | (codes[:, 1::2] << 4), theirs.numpy())
    assert np.array_equal(exponents, compress_mx_scale(scale, torch.uint8).numpy())
    # an all-zero group: e = 0, 2^-127, which float16 flushes to 0 and then takes 1 (uint8's eps) for;
    # bfloat16 and float32 hold 2^-127
    assert exponents[3, 1] == (127 if dtype == torch.float16 else 0)
