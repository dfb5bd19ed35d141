"""Static activation scales (formats/core/activation.py): calibrated on data by the producer, so no
data-free conversion can make them; every target that holds the source's scheme carries them, with its
config saying so, and every other one says in its report what the activations become.

Sources: llm-compressor's FP8 (static per-tensor input_scale) and NVFP4 W4A4 (input_global_scale, a
divisor), ModelOpt's FP8 and NVFP4 (input_scale, a multiplier): fixtures/checkpoints, written by the
producers themselves."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import (CHECKPOINTS, assert_same_tensors, convert_component, copy_checkpoint, load_tensors,
                      one_error, run_qconv, tensor_bytes)

CT_FP8, CT_NVFP4 = "llama-ct-fp8-static", "llama-ct-nvfp4"
MO_FP8, MO_NVFP4 = "llama-modelopt-fp8", "llama-modelopt-nvfp4"


def _groups(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]


def _leaf(tensors, leaf):
    return {k[: -len(leaf) - 1]: v for k, v in tensors.items() if k.endswith("." + leaf)}


def _f32(t) -> np.float32:
    return np.float32(t.float().reshape(-1)[0].item())


def test_ct_fp8_static_round_trip_is_llm_compressors_file(tmp_path):
    """llm-compressor's FP8 (static) -> compressed-tensors-fp8: every tensor byte for byte, input_scale
    included, and the config's groups those of the FP8 preset (observers aside: qconv writes null)."""
    out = tmp_path / "out"
    comp = convert_component(CHECKPOINTS / CT_FP8, out, "compressed-tensors-fp8")
    assert comp["codes_kept"] == 14 and comp["warnings"] == []
    assert comp["static_activation_scales"] == {"carried": 14, "dropped": 0}
    assert_same_tensors(out, CHECKPOINTS / CT_FP8)
    (ours,), (theirs,) = _groups(out).values(), _groups(CHECKPOINTS / CT_FP8).values()
    for key in ("input_activations", "weights"):
        assert {**ours[key], "observer": None} == {**theirs[key], "observer": None}, key
    assert ours["input_activations"]["dynamic"] is False and ours["input_activations"]["strategy"] == "tensor"


def test_modelopt_fp8_input_scales_carried_into_compressed_tensors(tmp_path):
    """ModelOpt FP8 (input_scale F32 [], a multiplier) -> compressed-tensors-fp8: the same multiplier as
    input_scale [1], in the weight scales' dtype where that holds it exactly, else float32; the value
    never changes."""
    out = tmp_path / "out"
    comp = convert_component(CHECKPOINTS / MO_FP8, out, "compressed-tensors-fp8")
    assert comp["static_activation_scales"] == {"carried": 14, "dropped": 0} and comp["warnings"] == []
    src = _leaf(load_file(CHECKPOINTS / MO_FP8 / "model.safetensors"), "input_scale")
    got = _leaf(load_tensors(out), "input_scale")
    assert sorted(got) == sorted(src) and len(got) == 14
    for name, t in got.items():
        assert t.shape == (1,) and _f32(t) == _f32(src[name]), name
        assert t.dtype in (torch.float16, torch.float32)
    assert {str(t.dtype) for t in got.values()} == {"torch.float16", "torch.float32"}   # both cases occur
    (group,) = _groups(out).values()
    assert group["input_activations"]["dynamic"] is False and group["input_activations"]["type"] == "float"


def test_ct_nvfp4_w4a4_round_trip_through_modelopt(tmp_path):
    """compressed-tensors NVFP4 W4A4 -> ModelOpt -> compressed-tensors: every code, group scale and
    activation scale back; the weight global scales (a divisor made a multiplier and back) within one
    float32 ulp; the config W4A4 as llm-compressor wrote it."""
    mo, back = tmp_path / "mo", tmp_path / "back"
    first = convert_component(CHECKPOINTS / CT_NVFP4, mo, "modelopt-nvfp4")
    second = convert_component(mo, back, "compressed-tensors-nvfp4")
    for comp in (first, second):
        assert comp["static_activation_scales"] == {"carried": 14, "dropped": 0} and comp["warnings"] == []
    ours, theirs = load_tensors(back), load_tensors(CHECKPOINTS / CT_NVFP4)
    assert sorted(ours) == sorted(theirs)
    ulps = []
    for name, t in ours.items():
        if name.endswith("weight_global_scale"):
            ulps.append(abs(int(t.view(torch.int32)) - int(theirs[name].view(torch.int32))))
        else:
            assert t.dtype == theirs[name].dtype and torch.equal(tensor_bytes(t), tensor_bytes(theirs[name])), name
    assert len(ulps) == 14 and max(ulps) <= 1
    src_in = _leaf(theirs, "input_global_scale")
    mo_in = _leaf(load_tensors(mo), "input_scale")
    for name, t in mo_in.items():                     # ModelOpt's multiplier is float32(1 / divisor)
        assert _f32(t) == np.float32(1) / _f32(src_in[name]), name
    (group,) = _groups(back).values()
    (src_group,) = _groups(CHECKPOINTS / CT_NVFP4).values()
    assert {**group["input_activations"], "observer": None} == {**src_group["input_activations"], "observer": None}


def test_modelopt_nvfp4_becomes_w4a4_compressed_tensors(tmp_path):
    """ModelOpt NVFP4 (W4A4) -> compressed-tensors-nvfp4 is W4A4 too: input_global_scale = float32(1 /
    input_scale), config dynamic "local"."""
    out = tmp_path / "out"
    comp = convert_component(CHECKPOINTS / MO_NVFP4, out, "compressed-tensors-nvfp4")
    assert comp["static_activation_scales"] == {"carried": 14, "dropped": 0}
    src = _leaf(load_file(CHECKPOINTS / MO_NVFP4 / "model.safetensors"), "input_scale")
    got = _leaf(load_tensors(out), "input_global_scale")
    assert sorted(got) == sorted(src)
    for name, t in got.items():
        assert t.dtype == torch.float32 and t.shape == (1,) and _f32(t) == np.float32(1) / _f32(src[name])
    (group,) = _groups(out).values()
    assert group["input_activations"]["dynamic"] == "local" and group["input_activations"]["num_bits"] == 4


@pytest.mark.parametrize("target, args, becomes", [
    ("compressed-tensors-fp8", ("--block-size", "128,128"), "e4m3, dynamic"),
    ("gptq", (), "unquantized"),
    ("compressed-tensors-w8a8", (), "int8 per token, dynamic"),
])
def test_targets_that_cannot_hold_them_say_what_activations_become(tmp_path, target, args, becomes):
    """A target that cannot hold the source's static scale writes none, and its report says so: the scale
    tensors named, what the activations become; the config says dynamic / no activation quantization."""
    out = tmp_path / "out"
    comp = convert_component(CHECKPOINTS / CT_FP8, out, target, *args)
    assert comp["static_activation_scales"] == {"carried": 0, "dropped": 14}
    (warning,) = [w for w in comp["warnings"] if "static activation scales" in w]
    assert warning.startswith("14 static activation scales are not carried "
                              "(model.layers.0.mlp.down_proj.input_scale") and becomes in warning, warning
    assert not [k for k in load_tensors(out) if k.endswith("input_scale")]
    acts = [g.get("input_activations") for g in _groups(out).values()] if target != "gptq" else []
    assert all(a is None or a["dynamic"] is True for a in acts)


def test_gguf_says_the_activation_scales_are_not_carried(tmp_path):
    comp = convert_component(CHECKPOINTS / CT_NVFP4, tmp_path / "m.gguf", "gguf")
    assert comp["static_activation_scales"] == {"carried": 0, "dropped": 14}
    assert any("input_global_scale" in w and "gguf holds none" in w for w in comp["warnings"]), comp["warnings"]


@pytest.mark.parametrize("value", [float("nan"), 0.0, -0.5, float("inf")])
def test_a_bad_activation_scale_is_refused_where_it_would_be_carried(tmp_path, value):
    """An input_scale that is not one finite positive value: one line naming the file and the tensor, exit
    4, nothing written."""
    from safetensors.torch import save_file

    src = copy_checkpoint(CT_FP8, tmp_path)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.input_scale"
    tensors[name] = torch.tensor([value], dtype=tensors[name].dtype)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    dst = tmp_path / "out"
    proc = run_qconv("convert", src, dst, "--to", "compressed-tensors-fp8")
    one_error(proc, 4, "model.safetensors", name, "activation scale")
    assert not dst.exists()


@pytest.mark.parametrize("name", [CT_FP8, CT_NVFP4, MO_FP8, MO_NVFP4])
def test_clean_producer_files_pass_inspect_strict(name):
    """Static activation scales are a fact of the checkpoint, reported, never a warning: --strict passes."""
    proc = run_qconv("inspect", "--strict", "--json", CHECKPOINTS / name)
    assert proc.returncode == 0, proc.stderr
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["warnings"] == []
    facts = json.dumps(comp)
    assert "activation_scales" in facts or '"input_scale": "per tensor (static)"' in facts
