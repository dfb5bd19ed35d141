"""compressed-tensors' floating-point formats (docs/formats.md, compressed-tensors FP8 to MXFP4), on llm-compressor's own files:
float-quantized FP8 (FP8, FP8_DYNAMIC, FP8_BLOCK), nvfp4-pack-quantized (NVFP4A16, NVFP4) and
mxfp4-pack-quantized (MXFP4A16). What the generic fixture tests (test_dequantize.py: bit for bit against
the producer's oracle, windows, the convert matrix, golden inspect reports) do not cover: the settings
inspect reports against what the producers were asked for, float and integer groups mixed in one
file, validate's device decoding of NVFP4's bfloat16 rounding, and refusals of broken copies: exit 4
(corrupt) or 5 (unsupported), one line naming the file and the tensor, nothing written, the source
untouched."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qconv.formats.core.detect import detect
from qconv.formats.core.reader import read_module
from qconv.formats.storage.checkpoint import open_target

from conftest import CHECKPOINTS, copy_checkpoint, inspect_json, run_qconv

CORRUPT, UNSUPPORTED = 4, 5
ST = "model.safetensors"
Q = "model.layers.0.self_attn.q_proj"
FP8_DYNAMIC, FP8_BLOCK, FP8_STATIC = "llama-ct-fp8-dynamic", "llama-ct-fp8-block", "llama-ct-fp8-static"
NVFP4A16, NVFP4, MXFP4, MOE = "llama-ct-nvfp4a16", "llama-ct-nvfp4", "llama-ct-mxfp4", "qwen3moe-ct-fp8-block"


def _component(path):
    (report,) = inspect_json(path)["components"]
    return report


# ---------------------------------------------------------------------------------------------
# What inspect reports, against the presets the producer was asked for (PROVENANCE.json) and what
# fixtures/checkpoints/README.md says llm-compressor wrote for them.

# preset -> (scheme, strategy, block_structure, top-level group_size): llm-compressor's preset table
# (docs/formats.md, compressed-tensors FP8 to MXFP4); FP8 per tensor has no groups at all.
PRESETS = {"FP8": ("e4m3", "tensor", None, None), "FP8_DYNAMIC": ("e4m3", "channel", None, -1),
           "FP8_BLOCK": ("e4m3", "block", [128, 128], 128), "NVFP4A16": ("e2m1", "tensor_group", None, 16),
           "NVFP4": ("e2m1", "tensor_group", None, 16), "MXFP4A16": ("e2m1", "group", None, 32)}
# fixtures/checkpoints/README.md: FP8 scales in the model dtype (fp16; bf16 for the MoE base), NVFP4's
# e4m3 group scales, MXFP4's e8m0 scales as uint8 bytes.
SCALE_DTYPES = {FP8_DYNAMIC: "torch.float16", FP8_BLOCK: "torch.float16", FP8_STATIC: "torch.float16",
                MOE: "torch.bfloat16", NVFP4A16: "torch.float8_e4m3fn", NVFP4: "torch.float8_e4m3fn",
                MXFP4: "torch.uint8"}


@pytest.mark.parametrize("name", sorted(SCALE_DTYPES))
def test_inspect_reports_the_producers_settings(name):
    preset = json.loads((CHECKPOINTS / name / "oracle" / "PROVENANCE.json").read_text())["settings"]["scheme"]
    scheme, strategy, block, group_size = PRESETS[preset]
    r = _component(CHECKPOINTS / name)
    assert r["method"] == "compressed-tensors"
    assert list(r["quantized_modules"]) == [scheme]
    (group,) = r["config_groups"].values()
    assert group["type"] == "float" and group["strategy"] == strategy
    assert group.get("block_structure") == block
    assert r["bits"] == (8 if scheme == "e4m3" else 4)
    assert r["group_size"] == group_size
    assert r["scales_dtype"] == SCALE_DTYPES[name]
    assert r.get("global_scale", "").startswith("divisor") == preset.startswith("NVFP4")
    # FP8 keeps static input_scale tensors, NVFP4 static input_global_scale ones: a fact of the group, not a
    # warning (a clean producer file passes inspect --strict); the dynamic presets have none.
    assert r["warnings"] == []
    leaf = {"FP8": "input_scale", "NVFP4": "input_global_scale"}.get(preset)
    assert group.get("activation_scales", "").startswith(f"{leaf} on 14 of 14 modules") == (leaf is not None), group


def test_static_activation_scales_are_claimed_not_counted_as_weights():
    """FP8's input_scale and NVFP4's input_global_scale are quantization state: no parameter count,
    no orphan warning, and a dequantized folder drops them."""
    for name, leaf in ((FP8_STATIC, "input_scale"), (NVFP4, "input_global_scale")):
        tensors = load_file(CHECKPOINTS / name / ST)
        assert Q + "." + leaf in tensors
        comp = open_target(CHECKPOINTS / name).components[0]
        det = detect(comp)
        assert not det.unaccounted and Q + "." + leaf in det.state_tensors


# ---------------------------------------------------------------------------------------------
# Float and integer groups in one file

def _mixed(tmp_path) -> Path:
    """llm-compressor's FP8_DYNAMIC attention beside its W4A16 MLPs (both made from llama-fp16): one
    file, two config groups, format mixed-precision."""
    d = copy_checkpoint(FP8_DYNAMIC, tmp_path)
    fp8, w4 = load_file(CHECKPOINTS / FP8_DYNAMIC / ST), load_file(CHECKPOINTS / "llama-ct-w4a16" / ST)
    tensors = {k: v for k, v in fp8.items() if ".mlp." not in k}
    tensors.update({k: v for k, v in w4.items() if ".mlp." in k})
    save_file(tensors, d / ST, metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    qc = config["quantization_config"]
    int_group = json.loads((CHECKPOINTS / "llama-ct-w4a16" / "config.json").read_text())[
        "quantization_config"]["config_groups"]["group_0"]
    qc["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    qc["config_groups"]["group_1"] = {**int_group, "targets": ["re:.*mlp.*"]}
    qc["format"] = "mixed-precision"
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_float_and_integer_groups_mix_in_one_file(tmp_path):
    d = _mixed(tmp_path)
    r = _component(d)
    assert r["warnings"] == []
    assert {s: len(m) for s, m in r["quantized_modules"].items()} == {"e4m3": 8, "int4": 6}
    comp = open_target(d).components[0]
    det = detect(comp)
    oracles = {n: load_file(CHECKPOINTS / n / "oracle" / "dequant.safetensors")
               for n in (FP8_DYNAMIC, "llama-ct-w4a16")}
    for m in det.modules:
        ref = oracles[FP8_DYNAMIC if ".self_attn." in m.name else "llama-ct-w4a16"][m.name + ".weight"]
        w = torch.from_numpy(read_module(comp, det, m, "float16").dequantize()).half().float()
        assert torch.equal(w, ref), m.name
    out = tmp_path / "out"
    run_qconv("dequantize", d, out, check=0)
    assert run_qconv("validate", d, out, check=0).returncode == 0


# ---------------------------------------------------------------------------------------------
# NVFP4's two roundings on every decoding path

def test_validate_device_decoding_rounds_nvfp4_through_bfloat16_as_numpy_does():
    """validate's torch decoding (dequantize_block, here on the CPU device) gives numpy's bits, and
    both are the producer's: fp16(bf16(product)) equals the oracle."""
    from qconv.validation import dequantize_block

    comp = open_target(CHECKPOINTS / NVFP4A16).components[0]
    det = detect(comp)
    oracle = load_file(CHECKPOINTS / NVFP4A16 / "oracle" / "dequant.safetensors")
    for m in det.modules[:4]:
        qt = read_module(comp, det, m, "float16")
        assert qt.product_dtype == "bfloat16"
        ref = qt.dequantize()
        got = dequantize_block(qt, 0, qt.shape[0], torch.device("cpu")).numpy()
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), m.name
        part = dequantize_block(qt, 3, 40, torch.device("cpu")).numpy()
        assert np.array_equal(part.view(np.uint32), ref[3:40].view(np.uint32)), m.name
        assert torch.equal(torch.from_numpy(ref).half().float(), oracle[m.name + ".weight"])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_nvfp4_validates_against_its_dequantized_folder(tmp_path, dtype):
    """validate decodes NVFP4 with its bfloat16 rounding: the dequantized folder (float16 holds every
    bfloat16-rounded weight of this fixture, test_dequantize.py) is the same outputs exactly, where the
    unrounded float32 product would differ in most weights."""
    out = tmp_path / "out"
    run_qconv("dequantize", CHECKPOINTS / NVFP4A16, out, "--dtype", dtype, check=0)
    proc = run_qconv("validate", "--json", CHECKPOINTS / NVFP4A16, out, check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["ok"]
    layers = [r for r in comp["layers"] if r["module"].startswith("model.layers.")]
    assert len(layers) == 14 and all(r["ok"] and r["max_abs"] == 0.0 for r in layers)


# ---------------------------------------------------------------------------------------------
# Refusals: one thing broken in a copy of a producer's file

def _edit_tensors(folder: Path, fn) -> None:
    tensors = load_file(folder / ST)
    fn(tensors)
    save_file(tensors, folder / ST, metadata={"format": "pt"})


def _edit_config(folder: Path, fn) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    fn(config["quantization_config"])
    path.write_text(json.dumps(config))


def _set_byte(name, index, value):
    return lambda ts: ts[name].view(torch.uint8).__setitem__(index, value)


def _set(name, index, value):
    return lambda ts: ts[name].__setitem__(index, value)


def _replace(name, fn):
    return lambda ts: ts.update({name: fn(ts[name])})


def _group(fn):
    return lambda qc: fn(qc["config_groups"]["group_0"]["weights"])


# case -> (fixture, tensor edit or None, config edit or None, exit code, strings the one line holds)
CASES = {
    "fp8_nan_code_0x7f": (FP8_DYNAMIC, _set_byte(Q + ".weight", (3, 5), 0x7F), None, CORRUPT,
                          [Q + ".weight", "e4m3 NaN codes", "[3, 5]"]),
    "fp8_nan_code_0xff": (FP8_BLOCK, _set_byte(Q + ".weight", (200, 130), 0xFF), None, CORRUPT,
                          [Q + ".weight", "e4m3 NaN codes", "[200, 130]"]),
    "fp8_scale_nan": (FP8_DYNAMIC, _set(Q + ".weight_scale", (7, 0), float("nan")), None, CORRUPT,
                      [Q + ".weight_scale", "non-finite"]),
    "fp8_scale_inf": (FP8_BLOCK, _set(Q + ".weight_scale", (1, 0), float("inf")), None, CORRUPT,
                      [Q + ".weight_scale", "non-finite"]),
    "fp8_tensor_scale_nan": (FP8_STATIC, _set(Q + ".weight_scale", 0, float("nan")), None, CORRUPT,
                             [Q + ".weight_scale", "non-finite"]),
    "fp8_channel_scale_wrong_shape": (FP8_DYNAMIC, _replace(Q + ".weight_scale", lambda s: s[:128].clone()), None,
                                      CORRUPT, [Q + ".weight_scale", "shape [128, 1]", "gives [256, 1]"]),
    "fp8_block_scale_wrong_shape": (FP8_BLOCK, _replace(Q + ".weight_scale", lambda s: s[:1].clone()), None,
                                    CORRUPT, [Q + ".weight_scale", "shape [1, 2]", "gives [2, 2]"]),
    "fp8_tensor_scale_per_channel": (FP8_STATIC, _replace(Q + ".weight_scale", lambda s: s.repeat(256, 1)), None,
                                     CORRUPT, [Q + ".weight_scale", "shape [256, 1]", "one scale"]),
    "fp8_block_structure_contradicts_shapes": (FP8_BLOCK, None, _group(lambda w: w.update(block_structure=[64, 64])),
                                               CORRUPT, ["model.layers.0.mlp.down_proj.weight_scale",  # first
                                                         "shape [2, 4]", "block_structure [64, 64] over a 256 x 512",
                                                         "gives [4, 8]"]),
    "fp8_block_structure_missing": (FP8_BLOCK, None, _group(lambda w: w.update(block_structure=None)), CORRUPT,
                                    ["strategy 'block' but block_structure None"]),
    "fp8_scale_removed": (FP8_DYNAMIC, lambda ts: ts.pop(Q + ".weight_scale"), None, CORRUPT,
                          [Q + ".weight", "(F8_E4M3) that belongs to no quantized module"]),
    "fp8_weight_bfloat16": (FP8_DYNAMIC, _replace(Q + ".weight", lambda w: w.to(torch.bfloat16)), None, UNSUPPORTED,
                            [Q + ".weight", "weight is BF16"]),
    "fp8_strategy_group": (FP8_DYNAMIC, None, _group(lambda w: w.update(strategy="group", group_size=128)),
                           UNSUPPORTED, ["strategy 'group'"]),
    "fp8_int_weights_config": (FP8_DYNAMIC, None, _group(lambda w: w.update(type="int")), CORRUPT,
                               ["'float-quantized'", "int 8-bit"]),
    "nvfp4_group_scale_nan": (NVFP4A16, _set_byte(Q + ".weight_scale", (9, 2), 0x7F), None, CORRUPT,
                              [Q + ".weight_scale", "non-finite"]),
    "nvfp4_scale_wrong_shape": (NVFP4, _replace(Q + ".weight_scale", lambda s: s[:, :8].clone()), None, CORRUPT,
                                [Q + ".weight_scale", "shape [256, 8]", "give [256, 16]"]),
    "nvfp4_global_scale_zero": (NVFP4A16, _set(Q + ".weight_global_scale", 0, 0.0), None, CORRUPT,
                                [Q + ".weight_global_scale", "holds 0.0"]),
    "nvfp4_global_scale_inf": (NVFP4, _set(Q + ".weight_global_scale", 0, float("inf")), None, CORRUPT,
                               [Q + ".weight_global_scale", "holds inf"]),
    "nvfp4_global_scale_nan": (NVFP4A16, _set(Q + ".weight_global_scale", 0, float("nan")), None, CORRUPT,
                               [Q + ".weight_global_scale", "holds nan"]),
    "nvfp4_global_scale_removed": (NVFP4A16, lambda ts: ts.pop(Q + ".weight_global_scale"), None, CORRUPT,
                                   [Q + ".weight_global_scale", "no weight_global_scale"]),
    "nvfp4_global_scale_bfloat16": (NVFP4A16, _replace(Q + ".weight_global_scale", lambda g: g.to(torch.bfloat16)),
                                    None, CORRUPT, [Q + ".weight_global_scale", "BF16 [1], expected F32 [1]"]),
    "nvfp4_scale_float16": (NVFP4A16, _replace(Q + ".weight_scale", lambda s: s.to(torch.float16)), None,
                            UNSUPPORTED, [Q + ".weight_scale", "weight_scale is F16"]),
    "mxfp4_scale_255": (MXFP4, _set(Q + ".weight_scale", (17, 3), 255), None, CORRUPT,
                        [Q + ".weight_scale", "e8m0 scales of 255", "[17, 3]"]),
    "mxfp4_scale_wrong_shape": (MXFP4, _replace(Q + ".weight_scale", lambda s: s[:, :4].clone()), None, CORRUPT,
                                [Q + ".weight_scale", "shape [256, 4]", "give [256, 8]"]),
    "mxfp4_global_scale_added": (MXFP4, lambda ts: ts.update({Q + ".weight_global_scale": torch.ones(1)}), None,
                                 CORRUPT, [Q + ".weight_global_scale", "one level of scales"]),
    "mxfp4_group_size_16": (MXFP4, None, _group(lambda w: w.update(group_size=16)), UNSUPPORTED,
                            ["group_size 16", "groups of 32"]),
}


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("verb", ["dequantize", "convert"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_copies_are_refused_and_nothing_is_written(tmp_path, case, verb):
    name, edit_tensors, edit_config, code, needles = CASES[case]
    src = copy_checkpoint(name, tmp_path / "src")
    if edit_tensors:
        _edit_tensors(src, edit_tensors)
    if edit_config:
        _edit_config(src, edit_config)
    before = _digest(src)
    out = tmp_path / "out"
    out.mkdir()
    args = ["dequantize", src, out / "dst"] if verb == "dequantize" else ["convert", src, out / "dst", "--to", "gptq"]
    proc = run_qconv(*args)
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconv: error: "), proc.stderr
    for needle in [str(src / ST)] + needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    assert list(out.iterdir()) == []
    assert _digest(src) == before
