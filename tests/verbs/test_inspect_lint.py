"""Config lint: each disagreement between a config and the tensors, made on a copy of a real
checkpoint, is reported as a warning naming the modules involved; the clean originals have none."""

import json

import pytest
from safetensors.torch import load_file, save_file

from qconv.formats.storage.safetensors_header import read_header

from conftest import inspect_json, run_qconv


def _edit_config(folder, fn, name="config.json"):
    path = folder / name
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg, indent=2))


def _warnings(folder):
    (report,) = inspect_json(folder)["components"]
    return report["warnings"]


def _one(warnings, *needles):
    hits = [w for w in warnings if all(n in w for n in needles)]
    assert len(hits) == 1, (needles, warnings)
    return hits[0]


def test_gptq_bits_in_config_contradict_shapes(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-gptq-w4g64-asym")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(bits=8))
    _one(_warnings(ckpt), "14 modules", "asks for 8-bit but the shapes hold 4-bit codes")


def test_gptq_group_size_in_config_contradicts_shapes(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-gptq-w4g64-asym")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(group_size=128))
    _one(_warnings(ckpt), "14 modules", "group_size 128 does not fit the scales, which hold group size 64")


def test_side_config_disagreeing_with_config_json(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-gptq-w8g128")
    _edit_config(ckpt, lambda c: c.update(group_size=32), "quantize_config.json")
    _one(_warnings(ckpt), "quantize_config.json says group_size=32", "config.json says 128")


def test_extra_config_naming_missing_modules(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-autoround-w4g128-mixed8")
    _edit_config(ckpt, lambda c: c["quantization_config"]["extra_config"].update({
        "model.layers.7.self_attn.q_proj": {"bits": 8}, r".*vision_tower.*": {"bits": 16}}))
    w = _warnings(ckpt)
    _one(w, "'model.layers.7.self_attn.q_proj'", "not a module")
    _one(w, "'.*vision_tower.*'", "matches no module")


def test_mixed_bits_against_extra_config(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-autoround-w4g128-mixed8")
    # Forget one of the two 8-bit layers: its 8-bit codes now contradict the config.
    _edit_config(ckpt, lambda c: c["quantization_config"]["extra_config"].pop("model.layers.1.mlp.down_proj"))
    w = _one(_warnings(ckpt), "asks for 4-bit but the shapes hold 8-bit codes")
    assert "1 modules" in w and "model.layers.1.mlp.down_proj" in w


def test_config_says_quantized_but_tensors_are_not(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-fp16")
    _edit_config(ckpt, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4,
                                                               "group_size": 128}))
    (report,) = inspect_json(ckpt)["components"]
    assert report["method"] == "unquantized"
    _one(report["warnings"], "config.json says GPTQ but no tensor is quantized")


def test_tensors_quantized_but_no_config(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-bnb8")
    _edit_config(ckpt, lambda c: c.pop("quantization_config"))
    (report,) = inspect_json(ckpt)["components"]
    assert report["method"] == "bitsandbytes LLM.int8"
    _one(report["warnings"], "no quantization_config")


def _drop_tensor(folder, name):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})


def test_gptq_module_missing_scales(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-gptq-w8g128")
    _drop_tensor(ckpt, "model.layers.1.mlp.up_proj.scales")
    _one(_warnings(ckpt), "1 modules", "no scales tensor", "model.layers.1.mlp.up_proj")


def test_bnb_int8_weight_missing_scb(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-bnb8")
    _drop_tensor(ckpt, "model.layers.0.self_attn.v_proj.SCB")
    _one(_warnings(ckpt), "no SCB", "model.layers.0.self_attn.v_proj")


def test_bnb4_module_missing_absmax(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-bnb4-fp4")
    _drop_tensor(ckpt, "model.layers.0.mlp.down_proj.weight.absmax")
    _one(_warnings(ckpt), "missing absmax", "model.layers.0.mlp.down_proj")


def test_skip_entry_that_covers_quantized_modules(tmp_checkpoint):
    ckpt = tmp_checkpoint("qwen3vl-bnb8-skipvisual")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(llm_int8_skip_modules=["lm_head", "model.visual"]))
    _one(_warnings(ckpt), "'model.visual'", "not to quantize 14 modules that are stored quantized")


def test_explicit_skip_list_without_lm_head(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-bnb8")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(llm_int8_skip_modules=["model.norm"]))
    _one(_warnings(ckpt), "lm_head is stored unquantized", "add 'lm_head'")


def test_threshold_that_is_not_a_float(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-bnb8")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(llm_int8_threshold=6))
    _one(_warnings(ckpt), "llm_int8_threshold is 6, not a float", "write 6.0")


@pytest.mark.parametrize("field, value, needle", [
    ("bnb_4bit_quant_type", "fp4", "bnb_4bit_quant_type is 'fp4' but the tensors are nf4"),
    ("bnb_4bit_use_double_quant", False, "bnb_4bit_use_double_quant is False but the tensors say True"),
    ("bnb_4bit_quant_storage", "uint8", "quant_storage is 'uint8' but the packed weights are stored as bfloat16"),
])
def test_bnb4_config_contradicting_tensors(tmp_checkpoint, field, value, needle):
    ckpt = tmp_checkpoint("llama-bnb4-nf4-bf16storage")
    _edit_config(ckpt, lambda c: c["quantization_config"].update({field: value}))
    _one(_warnings(ckpt), needle)


def test_desc_act_without_g_idx(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-autoround-w8g128")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(desc_act=True))
    _one(_warnings(ckpt), "desc_act is true but 14 modules have no g_idx")


def test_non_row_weight_format(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-bnb8")
    info = read_header(ckpt / "model.safetensors").tensors["model.layers.1.self_attn.o_proj.weight_format"]
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.seek(info.offset)
        f.write(bytes([2]))                              # col_turing, as bnb 0.43-0.44 could save
    _one(_warnings(ckpt), "'col_turing'", "model.layers.1.self_attn.o_proj")


def test_config_with_unsupported_method_is_named(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-gptq-w8g128")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(quant_method="hqq"))
    (report,) = inspect_json(ckpt)["components"]
    assert report["method"] == "hqq"
    _one(report["warnings"], "'hqq' is not a format qconv decodes")


def test_gptq_tensors_under_an_awq_config_do_not_pass_for_awq(tmp_checkpoint):
    """GPTQ packs along in ([in*b/32, out]), AWQ along out ([in, out/8]): GPTQ words labelled AWQ are
    reported as AWQ modules whose shapes do not fit, never read as AWQ."""
    ckpt = tmp_checkpoint("llama-gptq-w4g64-asym")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(quant_method="awq", version="gemm"))
    (report,) = inspect_json(ckpt)["components"]
    assert report["method"] == "AWQ" and any("modules:" in w for w in report["warnings"])
    proc = run_qconv("dequantize", ckpt, ckpt.parent / "out")
    assert proc.returncode == 4 and "qweight" in proc.stderr and not (ckpt.parent / "out").exists()


def test_gptqmodel_dynamic_overrides(tmp_checkpoint):
    ckpt = tmp_checkpoint("llama-gptq-w4g64-asym")
    _edit_config(ckpt, lambda c: c["quantization_config"].update(dynamic={
        r"+:.*down_proj": {"bits": 8}, r"-:model\.layers\.9\..*": {}, r"-:model\.layers\.1\.self_attn\.q_proj": {}}))
    w = _warnings(ckpt)
    assert "2 modules" in _one(w, "asks for 8-bit but the shapes hold 4-bit codes", "down_proj")
    _one(w, repr(r"-:model\.layers\.9\..*"), "matches no module")
    _one(w, "1 modules", "says not to quantize", "model.layers.1.self_attn.q_proj")
