"""Every reference checkpoint to every target, in-process: each conversion either succeeds or is one
documented refusal; every output inspects clean (its config agrees with its tensors, no warnings) with
exactly the source's quantized modules; its weights stay close to the producer's oracle (exactly the
codes for lossless paths, and within the reported requantization error otherwise); and every result
validates against its source layer by layer (qconv validate's criteria, as convert --validate uses)."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from qconv.convert.convert import Options, check_results, convert
from qconv.errors import UnsupportedFormat, ValidationFailed
from qconv.formats.storage.checkpoint import open_target
from qconv.formats.core.detect import detect
from qconv.formats.core.reader import read_module
from qconv.inspection import inspect_path

from conftest import CHECKPOINTS, QUANTIZED

TARGETS = {"gptq": "GPTQ", "gptq-v2": "GPTQ", "auto-round": "auto-round", "bnb8": "bitsandbytes LLM.int8",
           "bnb4-nf4": "bitsandbytes 4-bit", "bnb4-fp4": "bitsandbytes 4-bit", "float16": "unquantized",
           "compressed-tensors": "compressed-tensors", "compressed-tensors-w8a8": "compressed-tensors",
           "awq": "AWQ", "fp8": "fine-grained FP8", "compressed-tensors-fp8": "compressed-tensors",
           "compressed-tensors-nvfp4": "compressed-tensors", "modelopt-nvfp4": "ModelOpt",
           "compressed-tensors-mxfp4": "compressed-tensors", "mlx": "MLX"}
# (mlx-lm's files are requantized asymmetric: MLX's affine grid is)
ASYMMETRIC = ("llama-gptq-w4g64-asym", "llama-awq-w4g128", "llama-ct-w4a16-asym", "llama-mlx-w4g64", "llama-mlx-mixed36",
              "qwen3moe-mlx-w4g64")
# llama-mlx-w5g32 is llama-mlx-w4g64's producer and recipe at 5 bits in groups of 32: its paths to every
# target are w4g64's (its own, into GGUF Q5_1 and MLX: tests/formats/gguf/test_gguf_offsets.py)
MATRIX = [name for name in QUANTIZED if name != "llama-mlx-w5g32"]
# gpt-oss' fused 3-D MoE experts (gate and up rows interleaved): the quantized formats hold one Linear per
# expert, and gpt-oss has no per-expert layout a loader reads
REFUSED: set = {("qwen3moe-mxfp4-gptoss", t) for t in TARGETS if t not in ("float16", "bfloat16", "float32")}
# transformers 5's fused experts (save_original_format=False) are split into the per-expert Linears its
# default save writes: experts.N.gate_proj / up_proj are the first / second half of gate_up_proj[N]'s rows
# (transformers' conversion_mapping: MergeModulelist(dim=0) + Concatenate(dim=1)), down_proj is down_proj[N]
SPLIT = ("qwen3moe-fp8-block-fused",)


def _split_oracle(oracle: dict) -> dict:
    out = {}
    for key, w in oracle.items():
        prefix, leaf = key.rsplit(".", 1)
        if leaf == "gate_up_proj":
            half = w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = w[e, :half], w[e, half:]
        elif leaf == "down_proj":
            out.update((f"{prefix}.{e}.down_proj.weight", w[e]) for e in range(w.shape[0]))
        else:
            out[key] = w
    return out
# mlx-lm quantizes Qwen3-MoE's router (mlp.gate, 4 experts x 256): 4 output channels are no AWQ GEMM word of 8
REFUSED.add(("qwen3moe-mlx-w4g64", "awq"))
# mlx-lm's mixed 3-bit modules requantized asymmetric get zero points of 0, which GPTQ v1 (z - 1) cannot store
# so that every reader agrees: convert writes them and says so, and validation refuses the result
V1_ZERO = {("llama-mlx-mixed36", "gptq")}
# ModelOpt NVFP4 is W4A4: only NVFP4 sources with a calibrated static activation scale can be written
REFUSED |= {(name, "modelopt-nvfp4") for name in QUANTIZED if name not in ("llama-modelopt-nvfp4", "llama-ct-nvfp4")}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", MATRIX)
def test_every_checkpoint_to_every_target(tmp_path, name, target):
    out = tmp_path / "out"
    if (name, target) in REFUSED:
        with pytest.raises(UnsupportedFormat):
            convert(CHECKPOINTS / name, out, Options(target))
        assert not out.exists()
        return
    result = convert(CHECKPOINTS / name, out, Options(target))
    if (name, target) in V1_ZERO:
        assert result["components"][0]["v1_zero_points"]
        with pytest.raises(ValidationFailed, match="zero points of 0"):
            check_results([(open_target(CHECKPOINTS / name).components[0], out, result["components"][0])])
        return
    (validated,) = check_results([(open_target(CHECKPOINTS / name).components[0], out, result["components"][0])])
    assert validated["ok"] and len(validated["layers"]) >= 14
    (report,) = inspect_path(out)["components"]
    assert report["method"] == TARGETS[target]
    expected = []
    if name in ASYMMETRIC and target == "gptq":      # asym stays asym; v1 is flagged
        expected = [w for w in report["warnings"] if w.startswith("asymmetric with v1 zero points")]
    assert report["warnings"] == expected
    (source,) = inspect_path(CHECKPOINTS / name)["components"]
    modules = sorted(m for ms in source["quantized_modules"].values() for m in ms)
    if target == "float16":
        return
    oracle = load_file(CHECKPOINTS / name / "oracle" / "dequant.safetensors")
    if name in SPLIT:
        oracle = _split_oracle(oracle)
        modules = sorted(k.removesuffix(".weight") for k in oracle)
    assert sorted(m for ms in report["quantized_modules"].values() for m in ms) == modules
    if target == "gptq-v2":
        assert report["checkpoint_format"] == "gptq_v2"
    comp = open_target(out).components[0]
    det = detect(comp)
    (summary,) = result["components"]
    layer_error = {r["module"]: r["rel_frobenius"] for r in summary["layers"]}
    config = json.loads((CHECKPOINTS / name / "config.json").read_text())
    kept_bound = 4e-3 if config.get("dtype", config.get("torch_dtype")) == "bfloat16" else 2e-3
    for m in det.modules:
        w = read_module(comp, det, m, "float16").dequantize().astype(np.float64)
        ref = oracle[m.name + ".weight"].astype(np.float64)
        rel = np.linalg.norm(w - ref) / np.linalg.norm(ref)
        if m.name in layer_error:        # requantized: what convert reported (against float32, so ~)
            assert rel <= layer_error[m.name] * 1.01 + 1e-3, (m.name, rel, layer_error[m.name])
        else:                            # codes kept: only scale rounding (fp16: 2^-11) and the oracle's
            assert rel <= kept_bound, (m.name, rel)    # rounding to the model dtype (bf16: 2^-9)
