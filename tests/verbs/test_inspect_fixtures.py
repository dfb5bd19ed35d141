"""`qconv inspect` on every reference checkpoint: golden reports, and cross-checks against what the
producers themselves say (their oracles). GPTQ's and bitsandbytes' settings against what their producers
were asked for, and bitsandbytes' against the model transformers loads: tests/formats/gptq/test_gptq.py,
tests/formats/bnb/test_bnb.py."""

import ast
import json
import math
import os
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import (ALL_CHECKPOINTS, CHECKPOINTS, QUANTIZED, inspect_json, inspect_report as _report,
                      provenance as _provenance, run_qconv)

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_golden_report(name):
    """Golden reports were checked by hand once (see tests/verbs/golden/README.md). Regenerate with
    QCONV_UPDATE_GOLDEN=1 only when a change is intended, and review the diff."""
    result = _report(name)
    result.pop("path")
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("QCONV_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(result, indent=2) + "\n")
    assert result == json.loads(golden.read_text())


def _expected_scheme(name, module):
    """The scheme the producer was asked for, from PROVENANCE.json alone."""
    prov = _provenance(name)
    s = prov["settings"]
    if prov["producer"] == "bitsandbytes":
        return "int8" if s.get("load_in_8bit") == "True" else s["bnb_4bit_quant_type"]
    if prov["producer"] == "transformers":           # FineGrainedFP8: e4m3 weights
        return {"fp8": "e4m3"}[s["quantization_config"]["quant_method"]]
    if prov["producer"] == "qconv-fixture":          # gpt-oss MXFP4, made by fixtures/make_mxfp4_gptoss.py
        return {"mxfp4": "e2m1"}[s["quantization_config"]["quant_method"]]
    if prov["producer"] == "modelopt":               # mtq.quantize with one of ModelOpt's preset configs
        return {"FP8_DEFAULT_CFG": "e4m3", "NVFP4_DEFAULT_CFG": "e2m1"}[s["config"]]
    if prov["producer"] == "mlx_lm.convert" and s.get("mode") == "mxfp4":   # MLX's e2m1 mode
        return "e2m1"
    if prov["producer"] == "llm-compressor":         # a preset, or config groups with re: / class targets
        if "scheme" in s:                            # JSON-quoted by make_reference.py, bare by make_reference_fp.py
            scheme = json.loads(s["scheme"]) if s["scheme"].startswith('"') else s["scheme"]
            return {"W4A16": "int4", "W4A16_ASYM": "int4", "W8A16": "int8", "W8A8": "int8", "FP8": "e4m3",
                    "FP8_DYNAMIC": "e4m3", "FP8_BLOCK": "e4m3", "NVFP4A16": "e2m1", "NVFP4": "e2m1",
                    "MXFP4A16": "e2m1"}[scheme]
        for group in json.loads(s["config_groups"]).values():
            if any(t == "Linear" or re.match(t[3:], module) for t in group["targets"]):
                return f"int{group['weights']['num_bits']}"
    layer_config = ast.literal_eval(s.get("layer_config", "{}"))
    return f"int{layer_config.get(module, {}).get('bits', int(s['bits']))}"


@pytest.mark.parametrize("name", QUANTIZED)
def test_modules_and_counts_match_the_producer_oracle(name):
    """The oracle holds one [out, in] weight per module the producer quantized: the module list,
    each module's scheme, and the logical parameter counts must all agree with it."""
    (report,) = _report(name)["components"]
    with safe_open(CHECKPOINTS / name / "oracle" / "dequant.safetensors", framework="pt") as f:
        # a module's weight is "<module>.weight"; fused experts are keyed by the stored 3-D tensor's name
        shapes = {k.removesuffix(".weight"): f.get_slice(k).get_shape() for k in f.keys()}
    listed = {m: s for s, mods in report["quantized_modules"].items() for m in mods}
    assert sorted(listed) == sorted(shapes)
    expected_params: dict = {}
    for module, shape in shapes.items():
        scheme = _expected_scheme(name, module)
        assert listed[module] == scheme, module
        expected_params[scheme] = expected_params.get(scheme, 0) + math.prod(shape)
    assert report["quantized_parameters"] == expected_params
    for names in report["quantized_modules"].values():          # natural order: layers.2 < layers.10
        assert names == sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def test_pipeline_reports_each_weight_component_under_its_folder_name():
    result = _report("pipeline-qwen3vl-bnb8")
    assert result["kind"] == "pipeline"
    assert [c["component"] for c in result["components"]] == ["text_encoder"]   # tokenizer has no weights
    (pipe,) = result["components"]
    (plain,) = _report("qwen3vl-bnb8-skipvisual")["components"]
    assert {k: v for k, v in pipe.items() if k != "component"} == \
        {k: v for k, v in plain.items() if k != "component"}


def test_skip_visual_is_flagged_with_the_prefix_that_would_work():
    (report,) = _report("qwen3vl-bnb8-skipvisual")["components"]
    (warning,) = report["warnings"]
    assert "'visual'" in warning and "'model.visual'" in warning and "14 quantized modules" in warning
    assert report["skip_modules"] == ["lm_head", "visual"]
    visual = [m for m in report["linear8bit_modules"] if m.startswith("model.visual.")]
    assert len(visual) == 14


def test_single_safetensors_file(tmp_path):
    result = inspect_json(CHECKPOINTS / "llama-gptq-w4g64-asym" / "model.safetensors")
    assert result["kind"] == "file"
    (report,) = result["components"]
    assert report["component"] == "model.safetensors"
    assert report["config"] is None and report["method"] == "GPTQ"
    assert report["bits"] == 4 and report["group_size"] == 64     # from the shapes alone
    assert any("no quantization_config" in w for w in report["warnings"])


def test_human_output_has_tables_and_folded_module_names():
    proc = run_qconv("inspect", CHECKPOINTS / "llama-autoround-w4g128-mixed8", check=0)
    out = proc.stdout
    assert out.startswith("llama-autoround-w4g128-mixed8: auto-round")
    assert "packing_format" in out and "auto_round:auto_gptq" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["int4", "12", "983,040", "4.156"] in lines
    assert ["int8", "2", "196,608", "8.188"] in lines
    assert "    model.layers.{0-1}.mlp.gate_proj" in out.splitlines()
    assert "    model.layers.0.self_attn.q_proj" in out.splitlines()        # the 8-bit one
    assert proc.stderr == ""


def test_output_is_deterministic():
    a = run_qconv("inspect", "--json", CHECKPOINTS / "pipeline-qwen3vl-bnb8", check=0).stdout
    b = run_qconv("inspect", "--json", CHECKPOINTS / "pipeline-qwen3vl-bnb8", check=0).stdout
    assert a == b


def test_strict_exits_1_on_warnings_only():
    assert run_qconv("inspect", "--strict", CHECKPOINTS / "qwen3vl-bnb8-skipvisual").returncode == 1
    assert run_qconv("inspect", "--strict", CHECKPOINTS / "llama-bnb8").returncode == 0
