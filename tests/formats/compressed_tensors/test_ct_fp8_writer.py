"""The compressed-tensors-fp8 target: llm-compressor's float-quantized FP8 (FP8_DYNAMIC per channel,
FP8_BLOCK with --block-size). From the float base models it writes the producer's own files byte for
byte (llm-compressor's arithmetic reproduced op for op); e4m3 sources in the same structure keep their
codes (fine-grained FP8 blocks, compressed-tensors FP8 through fp8 and back); the output loads in
transformers with compressed-tensors installed."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import (CHECKPOINTS, assert_same_tensors as _same_files, convert_component, load_tensors,
                      one_error, run_qconv, tensor_bytes as _bytes)

TARGET = "compressed-tensors-fp8"


def _convert(src, dst, *args):
    return convert_component(src, dst, TARGET, *args)


def _qc(folder, drop_observer=True):
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    if drop_observer:          # qconv writes null, llm-compressor the observer it ran (memoryless_minmax)
        for group in qc["config_groups"].values():
            for args in ("weights", "input_activations"):
                if group.get(args):
                    group[args].pop("observer")
    return qc


@pytest.mark.parametrize("base,args,producer", [
    ("llama-fp16", [], "llama-ct-fp8-dynamic"),
    ("llama-fp16", ["--block-size", "128x128"], "llama-ct-fp8-block"),
    ("qwen3moe-bf16", ["--block-size", "128x128"], "qwen3moe-ct-fp8-block"),
])
def test_float_models_give_llm_compressors_bytes(tmp_path, base, args, producer):
    """Data-free from the float model, every tensor is llm-compressor's (e4m3 codes, scales in the
    model dtype, the float tensors passed through) and so is the config, observer aside."""
    out = tmp_path / "out"
    comp = _convert(CHECKPOINTS / base, out, *args)
    assert comp["requantized"] == comp["modules"] > 0
    assert {r["reason"] for r in comp["layers"]} == {f"{'bfloat16' if 'bf16' in base else 'float16'} weights "
                                                     f"quantized data-free to e4m3 (no calibration data)"}
    _same_files(out, CHECKPOINTS / producer)
    assert _qc(out) == _qc(CHECKPOINTS / producer)
    weights = _qc(out, False)["config_groups"]["group_0"]["weights"]
    assert weights["observer"] is None and weights["type"] == "float" and weights["num_bits"] == 8


def test_config_is_the_presets(tmp_path):
    """FP8_DYNAMIC: channel weights, dynamic per-token float8 activations; FP8_BLOCK: block_structure
    [128, 128] weights, dynamic float8 activations per group of 128; lm_head (and MoE routers) ignored."""
    _convert(CHECKPOINTS / "llama-fp16", tmp_path / "dyn")
    _convert(CHECKPOINTS / "llama-fp16", tmp_path / "blk", "--block-size", "128x128")
    dyn, blk = _qc(tmp_path / "dyn"), _qc(tmp_path / "blk")
    for qc in (dyn, blk):
        assert qc["format"] == "float-quantized" and qc["quant_method"] == "compressed-tensors"
        assert qc["ignore"] == ["lm_head"] and list(qc["config_groups"]) == ["group_0"]
        assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    d, b = dyn["config_groups"]["group_0"], blk["config_groups"]["group_0"]
    assert (d["weights"]["strategy"], d["weights"]["block_structure"]) == ("channel", None)
    assert (d["input_activations"]["strategy"], d["input_activations"]["dynamic"]) == ("token", True)
    assert (b["weights"]["strategy"], b["weights"]["block_structure"]) == ("block", [128, 128])
    assert (b["input_activations"]["strategy"], b["input_activations"]["group_size"]) == ("group", 128)
    assert d["input_activations"]["type"] == b["input_activations"]["type"] == "float"


def test_fine_grained_fp8_blocks_keep_their_codes(tmp_path):
    """transformers' FP8 in 128 x 128 blocks: the same codes, and the float32 weight_scale_inv values as
    weight_scale, in the model dtype where every scale of the module is a float16 value, else float32
    (nothing rounds)."""
    out = tmp_path / "out"
    comp = _convert(CHECKPOINTS / "llama-fp8-block", out, "--block-size", "128x128")
    assert comp["codes_kept"] == comp["modules"] == 14 and comp["scales_rounded"] == 0
    ours, theirs = load_tensors(out), load_file(CHECKPOINTS / "llama-fp8-block" / "model.safetensors")
    dtypes = set()
    for name, inverse in theirs.items():
        if not name.endswith(".weight_scale_inv"):
            continue
        prefix = name[: -len(".weight_scale_inv")]
        assert torch.equal(_bytes(ours[prefix + ".weight"]), _bytes(theirs[prefix + ".weight"]))
        scale = ours[prefix + ".weight_scale"]
        assert scale.shape == inverse.shape and torch.equal(scale.float(), inverse)
        dtypes.add(scale.dtype)
        if scale.dtype == torch.float32:
            assert not torch.equal(inverse.half().float(), inverse)     # float32 only where float16 rounds
    assert torch.float32 in dtypes
    assert _qc(out)["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    # without --block-size an e4m3 source in blocks keeps its blocks too
    assert _convert(CHECKPOINTS / "llama-fp8-block", tmp_path / "default")["codes_kept"] == 14


@pytest.mark.parametrize("producer,hops", [
    ("llama-ct-fp8-block", ["fp8", TARGET]),
    ("qwen3moe-ct-fp8-block", ["fp8", TARGET]),
    ("llama-ct-fp8-dynamic", [TARGET]),
    ("llama-ct-fp8-block", [TARGET]),
])
def test_round_trips_give_back_the_producers_bytes(tmp_path, producer, hops):
    src = CHECKPOINTS / producer
    for i, to in enumerate(hops):
        dst = tmp_path / str(i)
        proc = run_qconv("convert", "--json", src, dst, "--to", to)
        assert proc.returncode == 0, proc.stderr
        (comp,) = json.loads(proc.stdout)["components"]
        assert comp["requantized"] == 0
        src = dst
    _same_files(src, CHECKPOINTS / producer)
    assert _qc(src) == _qc(CHECKPOINTS / producer)


def test_other_sources_are_requantized_with_the_reason(tmp_path):
    """Integer codes and channels into blocks are quantized again from the exact weights, said per layer."""
    comp = _convert(CHECKPOINTS / "llama-gptq-w8g128", tmp_path / "int")
    assert comp["requantized"] == comp["modules"]
    assert {r["reason"] for r in comp["layers"]} == {"int8 codes become e4m3"}
    comp = _convert(CHECKPOINTS / "llama-ct-fp8-dynamic", tmp_path / "blk", "--block-size", "128x128")
    assert {r["reason"] for r in comp["layers"]} == {"e4m3 per channel become e4m3 in 128 x 128 blocks"}
    assert comp["requantized"] == comp["modules"]


@pytest.mark.parametrize("src,args", [
    ("llama-fp16", []),
    ("llama-fp16", ["--block-size", "128x128"]),
    ("llama-fp8-block", []),                   # kept codes, float32 scales where float16 would round
])
def test_outputs_load_in_transformers(tmp_path, src, args):
    """transformers (compressed-tensors installed) loads the output as compressed-tensors, and with its
    activation quantization off its logits match plain transformers on qconv's dequantization of the same
    file (the float16 rounding of qconv's output aside); with the dynamic FP8 activations on they move
    as much as llm-compressor's own files move (4.6 % / 5.6 % on the fixtures' float-quantized pair)."""
    from transformers import AutoModelForCausalLM

    out, flat = tmp_path / "out", tmp_path / "float"
    _convert(CHECKPOINTS / src, out, *args)
    run_qconv("dequantize", out, flat, check=0)
    ids = load_file(CHECKPOINTS / "llama-fp8-block" / "oracle" / "logits.safetensors")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", dtype=torch.float32)
    assert type(model.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"
    with torch.no_grad():
        with_activations = model(input_ids=ids).logits.float()
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                module.quantization_enabled = False
        weights_only = model(input_ids=ids).logits.float()
        plain = AutoModelForCausalLM.from_pretrained(flat, device_map="cpu", dtype=torch.float32)
        reference = plain(input_ids=ids).logits.float()

    def rel(a):
        return ((a - reference).norm() / reference.norm()).item()

    assert rel(weights_only) < 2e-3, rel(weights_only)
    assert rel(with_activations) < 0.08, rel(with_activations)


@pytest.mark.parametrize("args,needle", [
    (["--bits", "8"], "--bits: --to compressed-tensors-fp8 takes no such option; its options are --block-size"),
    (["--group-size", "128"], "--group-size: --to compressed-tensors-fp8 takes no such option"),
    (["--sym"], "--sym/--asym: --to compressed-tensors-fp8 takes no such option"),
    (["--scale-dtype", "float32"], "--scale-dtype: --to compressed-tensors-fp8 takes no such option"),
])
def test_integer_options_are_usage_errors(tmp_path, args, needle):
    proc = run_qconv("convert", CHECKPOINTS / "llama-fp16", tmp_path / "out", "--to", TARGET, *args)
    one_error(proc, 2, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [None, (128, 128), (64, 32)])
def test_quantizer_is_compressed_tensors_own_on_partial_blocks(dtype, block):
    """quantize_fp8 against compressed-tensors' own calculate_qparams and quantize() on a weight whose
    dimensions are not multiples of the block (compressed-tensors pads the last blocks, then cuts), with
    an all-zero row (scale: the dtype's eps)."""
    import numpy as np
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from qconv.formats.compressed_tensors.codec import quantize_fp8

    torch.manual_seed(0)
    w = (torch.randn(300, 200) * torch.logspace(-3, 1, 200)).to(dtype)
    w[7] = 0
    if block:
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=list(block))
        b0, b1 = block
        rt, ct = -(-300 // b0), -(-200 // b1)
        padded = torch.nn.functional.pad(w, (0, ct * b1 - 200, 0, rt * b0 - 300))
        blocks = padded.reshape(rt, b0, ct, b1).transpose(1, 2)
        lo, hi = blocks.amin(dim=(-2, -1)), blocks.amax(dim=(-2, -1))
    else:
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    scale, zero = calculate_qparams(lo, hi, args)
    theirs = quantize(x=w, scale=scale, zero_point=zero, args=args, dtype=torch.float8_e4m3fn)
    codes, scales = quantize_fp8(w.float().numpy(), str(dtype).split(".")[1], *(block or (1, -1)))
    assert np.array_equal(scales, scale.float().numpy())
    assert np.array_equal(codes, theirs.contiguous().view(torch.uint8).numpy())
