"""NVIDIA ModelOpt exports (formats/modelopt/), against the two checkpoints ModelOpt itself wrote
(fixtures/checkpoints/llama-modelopt-fp8, -nvfp4) and copies of them with one thing broken. The generic
fixture tests (test_dequantize, test_row_windows, test_convert_matrix, test_inspect_fixtures) cover the
oracle values, windows, every target and the golden reports; this file covers what they do not: the
oracle's exact bits, the settings inspect reads from ModelOpt's two config files, hf_quant_config.json
read alone, the shared weight_scale_2 visible in what qconv reads, validate against the dequantized
output, and the refusals."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qconv.formats.core.reader import read_module, require_decodable
from qconv.formats.storage.checkpoint import open_target

from conftest import CHECKPOINTS, copy_checkpoint, inspect_json, load_tensors, one_error, run_qconv

FP8, NVFP4 = "llama-modelopt-fp8", "llama-modelopt-nvfp4"
CORRUPT, UNSUPPORTED = 4, 5
ST = "model.safetensors"
Q = "model.layers.0.self_attn.q_proj"
ATTN = ("q_proj", "k_proj", "v_proj")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _edit_tensors(folder: Path, fn) -> None:
    tensors = load_file(folder / ST)
    fn(tensors)
    save_file(tensors, folder / ST, metadata={"format": "pt"})


def _edit_json(path: Path, fn) -> None:
    doc = _json(path)
    fn(doc)
    path.write_text(json.dumps(doc, indent=2))


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Decoding: the producer's bits

@pytest.mark.parametrize("name", [FP8, NVFP4])
def test_float32_output_is_the_oracle_bit_for_bit(tmp_path, name):
    """ModelOpt's FP8QTensor / NVFP4QTensor.dequantize(float32), every bit: signs of zeros too (ModelOpt
    decodes the e2m1 nibble 0x8 as +0.0; -0.0 would be equal as a value, not as bits)."""
    run_qconv("dequantize", CHECKPOINTS / name, tmp_path / "f32", "--dtype", "float32", check=0)
    out = load_tensors(tmp_path / "f32")
    oracle = load_file(CHECKPOINTS / name / "oracle" / "dequant.safetensors")
    assert len(oracle) == 14
    for key, ref in oracle.items():
        assert out[key].dtype == torch.float32
        assert torch.equal(out[key].view(torch.int32), ref.view(torch.int32)), key
    if name == NVFP4:
        codes = load_file(CHECKPOINTS / name / ST)[Q + ".weight"]
        assert int(((codes & 0x0F) == 8).sum() + ((codes >> 4) == 8).sum()) > 0   # there are -0 nibbles


def test_nvfp4_two_scale_levels_are_the_stored_ones_and_weight_scale_2_is_shared():
    """What qconv reads of each NVFP4 module: group_scales are the stored e4m3 weight_scale (decoded
    here by torch), global_scale the stored weight_scale_2, scales their float32 product; and the
    global scale ModelOpt shares across q/k/v and across gate/up is visible as one value."""
    comp = open_target(CHECKPOINTS / NVFP4).components[0]
    det = require_decodable(comp)
    stored = load_file(CHECKPOINTS / NVFP4 / ST)
    globals_ = {}
    for m in det.modules:
        qt = read_module(comp, det, m, "float16")
        assert qt.spec.scheme == "e2m1" and qt.spec.group_size == 16 and qt.spec.global_scale == "multiplier"
        assert m.details["global_scale"] == "multiplier"
        assert qt.codes.shape == (m.out_features, m.in_features) == (stored[m.name + ".weight"].shape[0],
                                                                   2 * stored[m.name + ".weight"].shape[1])
        assert np.array_equal(qt.group_scales, stored[m.name + ".weight_scale"].float().numpy())
        assert qt.global_scale == stored[m.name + ".weight_scale_2"].item()
        assert np.array_equal(qt.scales, qt.group_scales * np.float32(qt.global_scale))
        globals_[m.name] = qt.global_scale
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        assert len({globals_[p + "self_attn." + n] for n in ATTN}) == 1
        assert globals_[p + "mlp.gate_proj"] == globals_[p + "mlp.up_proj"]
        assert globals_[p + "self_attn.o_proj"] != globals_[p + "self_attn.q_proj"]
        assert globals_[p + "mlp.down_proj"] != globals_[p + "mlp.up_proj"]


def test_fp8_scale_is_one_per_tensor():
    comp = open_target(CHECKPOINTS / FP8).components[0]
    det = require_decodable(comp)
    stored = load_file(CHECKPOINTS / FP8 / ST)
    for m in det.modules:
        qt = read_module(comp, det, m, "float16")
        assert qt.spec.scheme == "e4m3" and qt.spec.block_rows == 0 and qt.scales.shape == (m.out_features, 1)
        assert np.all(qt.scales == stored[m.name + ".weight_scale"].item())
        assert m.state_tensors == (m.name + ".weight_scale", m.name + ".input_scale")


# ---------------------------------------------------------------------------------------------
# inspect: ModelOpt's settings, from its two config files

@pytest.mark.parametrize("name", [FP8, NVFP4])
def test_settings_are_what_modelopt_wrote(name):
    (report,) = inspect_json(CHECKPOINTS / name)["components"]
    qc = _json(CHECKPOINTS / name / "config.json")["quantization_config"]
    side = _json(CHECKPOINTS / name / "hf_quant_config.json")["quantization"]
    assert report["method"] == "ModelOpt" and report["config"] == "config.json"
    assert report["quant_algo"] == qc["quant_algo"] == side["quant_algo"]
    assert report["exclude_modules"] == qc["ignore"] == side["exclude_modules"]
    assert report["kv_cache_quant_algo"] == side["kv_cache_quant_algo"]
    assert report["group_size"] == side.get("group_size")            # NVFP4 16; FP8 none (per tensor)
    assert report["input_scale"] == "per tensor (static)"
    assert report["warnings"] == []


def test_hf_quant_config_alone_is_read_and_not_carried(tmp_path):
    """A folder whose config.json has no quantization_config (older ModelOpt exports): qconv reads
    hf_quant_config.json, finds the same modules and settings and writes the same weights; the output
    carries no hf_quant_config.json (vLLM would take the float folder for ModelOpt)."""
    src = copy_checkpoint(NVFP4, tmp_path)
    _edit_json(src / "config.json", lambda c: c.pop("quantization_config"))
    (alone,) = inspect_json(src)["components"]
    (both,) = inspect_json(CHECKPOINTS / NVFP4)["components"]
    assert alone["config"] == "hf_quant_config.json"
    for key in ("method", "quant_algo", "group_size", "exclude_modules", "quantized_modules", "warnings"):
        assert alone[key] == both[key], key
    run_qconv("dequantize", src, tmp_path / "a", check=0)
    run_qconv("dequantize", CHECKPOINTS / NVFP4, tmp_path / "b", check=0)
    assert (tmp_path / "a" / ST).read_bytes() == (tmp_path / "b" / ST).read_bytes()
    for out in (tmp_path / "a", tmp_path / "b"):
        assert not (out / "hf_quant_config.json").exists()
        assert "quantization_config" not in _json(out / "config.json")
    assert (tmp_path / "a" / "tokenizer.json").exists()


def test_configs_that_disagree_and_excludes_that_match_nothing_are_flagged(tmp_path):
    src = copy_checkpoint(FP8, tmp_path)
    _edit_json(src / "hf_quant_config.json", lambda d: d["quantization"].update(
        {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}))
    _edit_json(src / "config.json", lambda c: c["quantization_config"]["ignore"].append("model.vision_tower*"))
    (report,) = inspect_json(src)["components"]
    warnings = report["warnings"]
    assert any("hf_quant_config.json says quant_algo='NVFP4' but config.json says 'FP8'" in w for w in warnings)
    assert any("hf_quant_config.json excludes ['lm_head']" in w for w in warnings)
    assert any("ignore entry 'model.vision_tower*' matches no module" in w for w in warnings)
    assert report["quant_algo"] == "FP8"                          # config.json's, as loaders read it
    assert len(warnings) == 3, warnings


# ---------------------------------------------------------------------------------------------
# validate: the source against its own dequantized folder

@pytest.mark.parametrize("name", [FP8, NVFP4])
def test_source_validates_against_its_dequantized_output(tmp_path, name):
    out = tmp_path / "out"
    run_qconv("dequantize", CHECKPOINTS / name, out, check=0)          # float16, the model's dtype
    proc = run_qconv("validate", "--json", CHECKPOINTS / name, out)
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"], proc.stderr
    assert sum(r["module"].startswith("model.layers.") for r in result["layers"]) == 14
    # one weight of one layer one float16 step off: validate names that layer and fails
    tensors = load_file(out / ST)
    w = tensors[Q + ".weight"]
    w.view(torch.int16)[3, 7] += 1
    save_file(tensors, out / ST, metadata={"format": "pt"})
    proc = run_qconv("validate", "--json", CHECKPOINTS / name, out)
    result = json.loads(proc.stdout)
    assert proc.returncode == 1 and not result["ok"]
    assert [r["module"] for r in result["layers"] if not r["ok"]] == [Q]


# ---------------------------------------------------------------------------------------------
# Refusals: one line naming the file and the tensor, exit 4 (corrupt) or 5 (unsupported), nothing
# written, the source untouched, by every writing verb.

def _set_code(name, value, index=(3, 5)):
    def edit(ts):
        ts[name].view(torch.uint8)[index] = value
    return edit


def _replace(name, fn):
    def edit(ts):
        ts[name] = fn(ts[name])
    return edit


def _config(**fields):
    return lambda c: c["quantization_config"].update(fields)


# case -> (fixture, tensor edit or None, config edit or None, exit code, needles)
CASES = {
    "fp8_weight_nan_code": (FP8, _set_code(Q + ".weight", 0x7F), None, CORRUPT,
                            [Q + ".weight", "e4m3 NaN codes", "[3, 5]"]),
    "fp8_weight_negative_nan_code": (FP8, _set_code(Q + ".weight", 0xFF, (255, 0)), None, CORRUPT,
                                     [Q + ".weight", "e4m3 NaN codes", "[255, 0]"]),
    "fp8_scale_nan": (FP8, _replace(Q + ".weight_scale", lambda t: torch.tensor(float("nan"))), None, CORRUPT,
                      [Q + ".weight_scale", "non-finite"]),
    "fp8_scale_inf": (FP8, _replace(Q + ".weight_scale", lambda t: torch.tensor(float("inf"))), None, CORRUPT,
                      [Q + ".weight_scale", "non-finite"]),
    "fp8_scale_per_channel": (FP8, _replace(Q + ".weight_scale", lambda t: t.expand(256).clone()), None, CORRUPT,
                              [Q + ".weight", "weight_scale has shape [256]"]),
    "fp8_scale_zero_size": (FP8, _replace(Q + ".weight_scale", lambda t: t.reshape(1)[:0].clone()), None, CORRUPT,
                            [Q + ".weight", "weight_scale has shape [0]"]),
    "fp8_scale_missing": (FP8, lambda ts: ts.pop(Q + ".weight_scale"), None, CORRUPT,
                          [Q + ".weight", "no weight_scale"]),
    "nvfp4_scale_nan_code": (NVFP4, _set_code(Q + ".weight_scale", 0x7F, (9, 2)), None, CORRUPT,
                             [Q + ".weight_scale", "e4m3 NaN codes", "[9, 2]"]),
    "nvfp4_scale_2_nan": (NVFP4, _replace(Q + ".weight_scale_2", lambda t: torch.tensor(float("nan"))), None,
                          CORRUPT, [Q + ".weight_scale_2", "not one finite scale"]),
    "nvfp4_scale_2_inf": (NVFP4, _replace(Q + ".weight_scale_2", lambda t: torch.tensor(float("-inf"))), None,
                          CORRUPT, [Q + ".weight_scale_2", "not one finite scale"]),
    "nvfp4_scale_2_zero_size": (NVFP4, _replace(Q + ".weight_scale_2", lambda t: t.reshape(1)[:0].clone()), None,
                                CORRUPT, [Q + ".weight", "weight_scale_2 has shape [0]"]),
    "nvfp4_scale_wrong_shape": (NVFP4, _replace(Q + ".weight_scale", lambda t: t[:, :8].clone()), None, CORRUPT,
                                [Q + ".weight", "weight_scale has shape [256, 8]", "needs [256, 16]"]),
    "nvfp4_scale_float32": (NVFP4, _replace(Q + ".weight_scale", lambda t: t.float()), None, CORRUPT,
                            [Q + ".weight", "weight_scale is F32"]),
    "nvfp4_weight_narrower_than_scales": (NVFP4, _replace(Q + ".weight", lambda t: t[:, :64].clone()), None,
                                          CORRUPT, [Q + ".weight", "256 x 128 NVFP4 weight", "needs [256, 8]"]),
    "nvfp4_excluded_but_quantized": (NVFP4, None, lambda c: c["quantization_config"]["ignore"].append(
        "*self_attn.q_proj"), CORRUPT, [Q + ".weight", "ignore lists '*self_attn.q_proj'"]),
    "fp8_algo_says_nvfp4": (FP8, None, _config(quant_algo="NVFP4"), CORRUPT,
                            ["model.layers.0.mlp.down_proj.weight", "the weight is F8_E4M3"]),
    "fp8_algo_w4a8_awq": (FP8, None, _config(quant_algo="W4A8_AWQ"), UNSUPPORTED,
                          ["model.layers.0.mlp.down_proj.weight", "quant_algo 'W4A8_AWQ'"]),
    "nvfp4_algo_int4_awq": (NVFP4, None, _config(quant_algo="INT4_AWQ"), UNSUPPORTED,
                            ["model.layers.0.mlp.down_proj.weight", "quant_algo 'INT4_AWQ'"]),
    "fp8_algo_mxfp8": (FP8, None, _config(quant_algo="MXFP8"), UNSUPPORTED, ["quant_algo 'MXFP8'"]),
}


def _make(case: str, root: Path) -> tuple[Path, int, list]:
    name, tensors, config, code, needles = CASES[case]
    src = copy_checkpoint(name, root)
    if tensors:
        _edit_tensors(src, tensors)
    if config:
        _edit_json(src / "config.json", config)
    return src, code, [str(src / ST), *needles]


VERBS = {"dequantize": lambda src, dst: ["dequantize", src, dst],
         "convert": lambda src, dst: ["convert", src, dst, "--to", "gptq"],
         "validate": lambda src, dst: ["validate", src, CHECKPOINTS / "llama-fp16"]}


# Every case through dequantize; a header-level and a data-level case of each scheme, and an unsupported
# algo, through the other verbs too.
PAIRS = [(case, "dequantize") for case in sorted(CASES)] + [
    (case, verb) for case in ("fp8_weight_nan_code", "nvfp4_scale_2_nan", "nvfp4_weight_narrower_than_scales",
                              "fp8_algo_w4a8_awq") for verb in ("convert", "validate")]


@pytest.mark.parametrize("case,verb", PAIRS)
def test_writing_verb_refuses(tmp_path, case, verb):
    src, code, needles = _make(case, tmp_path / "src")
    before = _digest(src)
    out = tmp_path / "out"
    out.mkdir()
    one_error(run_qconv(*VERBS[verb](src, out / "dst")), code, *needles)
    assert list(out.iterdir()) == []                 # no DST, no temporary folder beside it
    assert _digest(src) == before


def test_unsupported_algo_in_hf_quant_config_alone(tmp_path):
    src = copy_checkpoint(NVFP4, tmp_path)
    _edit_json(src / "config.json", lambda c: c.pop("quantization_config"))
    _edit_json(src / "hf_quant_config.json", lambda d: d["quantization"].update({"quant_algo": "NVFP4_AWQ"}))
    (report,) = inspect_json(src)["components"]        # inspect reports it, never refuses
    assert report["quant_algo"] == "NVFP4_AWQ" and report["config"] == "hf_quant_config.json"
    assert any("quant_algo 'NVFP4_AWQ' is not a ModelOpt format qconv decodes" in w for w in report["warnings"])
    one_error(run_qconv("dequantize", src, tmp_path / "dst"), UNSUPPORTED, str(src / ST), "quant_algo 'NVFP4_AWQ'")
    assert not (tmp_path / "dst").exists()
