"""The modelopt-nvfp4 target: ModelOpt's NVFP4 (quant_algo NVFP4, W4A4) as export_hf_checkpoint writes it.
Only NVFP4 sources that carry a calibrated static activation scale can be written, their codes kept:
ModelOpt's own file comes back byte for byte; compressed-tensors W4A4 keeps its codes and e4m3 scales,
its global divisors become float32 multipliers (1 / divisor, computed here with numpy), and the
rounding that adds to the effective scales is what the summary counts. Every other source (float,
NVFP4A16, integer, FP8) is refused with exit 5 before anything is written: no data-free conversion can
make the input_scale ModelOpt's loaders quantize activations with."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (CHECKPOINTS, assert_same_tensors, convert_component, copy_checkpoint, load_tensors,
                      one_error, run_qconv, tensor_bytes)

TARGET = "modelopt-nvfp4"
MODELOPT = CHECKPOINTS / "llama-modelopt-nvfp4"
CT_W4A4 = CHECKPOINTS / "llama-ct-nvfp4"
# e2m1 magnitudes by the nibble's low 3 bits; bit 3 is the sign (docs/formats.md, e4m3, e2m1, e8m0)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _convert(src, dst, *args):
    return convert_component(src, dst, TARGET, *args)


def _qc(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def _prefixes(tensors, leaf):
    return sorted(k[: -len(leaf) - 1] for k in tensors if k.endswith("." + leaf))


def _fused(prefix):
    """q/k/v and gate/up of one layer share their per-tensor scales (ModelOpt and vLLM fuse them)."""
    parent, leaf = prefix.rsplit(".", 1)
    return parent, {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                    "up_proj": "gate_up"}.get(leaf, leaf)


def _unpack(packed: np.ndarray) -> np.ndarray:
    """uint8 [out, in/2] -> nibbles [out, in], element 2i in the low nibble."""
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
    return codes


def test_modelopt_source_comes_back_byte_for_byte(tmp_path):
    """ModelOpt NVFP4 -> here: every tensor is the source's (packed codes, e4m3 scales, the shared
    weight_scale_2 and input_scale, float tensors), the config is ModelOpt's (its producer entry aside),
    nothing is rounded, nothing warned, and the result validates."""
    out = tmp_path / "out"
    comp = _convert(MODELOPT, out, "--validate")
    assert comp["codes_kept"] == comp["modules"] == 14 and comp["requantized"] == 0
    assert comp["scales_rounded"] == 0 and comp["max_scale_rel_error"] == 0.0
    assert comp["warnings"] == [] and comp["validation"]["ok"]
    assert_same_tensors(out, MODELOPT)
    theirs = _qc(MODELOPT)
    assert theirs.pop("producer")["name"] == "modelopt"
    assert _qc(out) == theirs
    assert not (out / "hf_quant_config.json").exists()


def test_compressed_tensors_w4a4_keeps_codes_and_inverts_its_divisors(tmp_path):
    """compressed-tensors NVFP4 (W4A4) -> ModelOpt: the packed codes and e4m3 scales are the source's
    bytes; weight_scale_2 = float32(1 / weight_global_scale) and input_scale = float32(1 /
    input_global_scale), float32 scalars (shape []), one per fused group; the summary counts exactly the
    effective scales where e4m3 * float32(1 / g) is not compressed-tensors' float32(e4m3) / g (out of
    the scales of the modules where any is), and its largest relative change; no activation scale is
    reported dropped."""
    out = tmp_path / "out"
    comp = _convert(CT_W4A4, out, "--validate")
    assert comp["codes_kept"] == 14 and comp["requantized"] == 0 and comp["validation"]["ok"]
    assert comp["warnings"] == []
    ours, theirs = load_tensors(out), load_tensors(CT_W4A4)
    prefixes = _prefixes(theirs, "weight_packed")
    assert len(prefixes) == 14 and _prefixes(ours, "weight_scale_2") == prefixes
    scales = rounded = 0
    worst = 0.0
    for p in prefixes:
        assert torch.equal(ours[p + ".weight"], theirs[p + ".weight_packed"])
        assert ours[p + ".weight_scale"].dtype == torch.float8_e4m3fn
        assert torch.equal(tensor_bytes(ours[p + ".weight_scale"]), tensor_bytes(theirs[p + ".weight_scale"]))
        g = np.float32(theirs[p + ".weight_global_scale"].numpy()[0])
        ig = np.float32(theirs[p + ".input_global_scale"].numpy()[0])
        s2, ins = ours[p + ".weight_scale_2"], ours[p + ".input_scale"]
        assert s2.dtype == ins.dtype == torch.float32 and s2.shape == ins.shape == ()
        assert s2.numpy() == np.float32(1) / g and ins.numpy() == np.float32(1) / ig
        e4m3 = theirs[p + ".weight_scale"].float().numpy()
        source = e4m3 / g                                 # compressed-tensors: float32(scale) / global
        target = e4m3 * (np.float32(1) / g)               # ModelOpt: float32(scale) * weight_scale_2
        rel = np.abs(target.astype(np.float64) - source) / np.maximum(np.abs(source.astype(np.float64)), 1e-300)
        if (rel > 0).any():         # a module whose effective scales all stay is not counted
            scales, rounded, worst = scales + source.size, rounded + int((rel > 0).sum()), max(worst, float(rel.max()))
    assert (comp["scales"], comp["scales_rounded"]) == (scales, rounded) and 0 < rounded < scales
    assert comp["max_scale_rel_error"] == pytest.approx(worst, rel=1e-12) and worst < 2.0**-22
    groups = {}
    for p in prefixes:
        groups.setdefault(_fused(p), []).append(p)
    assert sorted(len(m) for m in groups.values()) == [1] * 4 + [2] * 2 + [3] * 2
    for members in groups.values():
        assert len({ours[p + ".weight_scale_2"].item() for p in members}) == 1
        assert len({ours[p + ".input_scale"].item() for p in members}) == 1
    assert _qc(out) == {k: v for k, v in _qc(MODELOPT).items() if k != "producer"}


@pytest.mark.parametrize("src", [MODELOPT, CT_W4A4], ids=["modelopt", "ct-w4a4"])
def test_dequantization_is_the_kept_codes_times_the_kept_scales(tmp_path, src):
    """qconv's ModelOpt reader decodes the result (inspect --strict is clean; dequantize to float32) as
    e2m1(nibble) * (float32(e4m3) * weight_scale_2), computed here from the SOURCE's tensors: for a
    ModelOpt source that is ModelOpt's own dequantization (the fixture oracle, bit for bit); for
    compressed-tensors it is its codes and scales under float32(1 / global), within compressed-tensors'
    own bfloat16 product rounding of its oracle."""
    out, flat = tmp_path / "out", tmp_path / "float"
    _convert(src, out)
    run_qconv("inspect", "--strict", out, check=0)
    run_qconv("dequantize", "--dtype", "float32", out, flat, check=0)
    got, theirs = load_file(flat / "model.safetensors"), load_tensors(src)
    oracle = load_file(src / "oracle" / "dequant.safetensors")
    modelopt = src == MODELOPT
    for p in _prefixes(theirs, "weight_scale"):
        packed = theirs[p + (".weight" if modelopt else ".weight_packed")].numpy()
        e4m3 = theirs[p + ".weight_scale"].float().numpy()
        s2 = np.float32(theirs[p + ".weight_scale_2"].item()) if modelopt else \
            np.float32(1) / np.float32(theirs[p + ".weight_global_scale"].item())
        expected = E2M1[_unpack(packed)] * np.repeat(e4m3 * s2, 16, axis=1)
        w = got[p + ".weight"].numpy()
        assert np.array_equal(w, expected), p
        ref = oracle[p + ".weight"].numpy()
        if modelopt:
            assert np.array_equal(w, ref), p
        else:                       # compressed-tensors' own fp16(bf16(e2m1 * (scale / g)))
            assert np.all(np.abs(w - ref) <= 2.0**-8 * np.abs(ref) + 2.0**-24), p


@pytest.mark.parametrize("name,found", [
    ("llama-fp16", "is an unquantized float16 model"),
    ("llama-ct-nvfp4a16", "is compressed-tensors NVFP4 with no static activation scale"),
    ("llama-gptq-w4g128-actorder", "is GPTQ int4, not NVFP4"),
    ("llama-ct-w8a8", "is compressed-tensors int8, not NVFP4"),
    ("llama-fp8-block", "is fine-grained FP8 e4m3, not NVFP4"),
    ("llama-modelopt-fp8", "is ModelOpt e4m3, not NVFP4"),
])
def test_sources_without_an_nvfp4_activation_scale_are_refused(tmp_path, name, found):
    """One line, exit 5, naming the source's file, saying why (a calibrated input_scale no data-free
    conversion makes) and where to go instead; DST is never created."""
    out = tmp_path / "out"
    proc = run_qconv("convert", CHECKPOINTS / name, out, "--to", TARGET)
    one_error(proc, 5, str(CHECKPOINTS / name / "model.safetensors"), found, "calibrated static input_scale",
              "data-free conversion cannot make", "--to compressed-tensors-nvfp4 (NVFP4A16")
    assert not out.exists()


def test_fused_modules_with_different_weight_global_scales_are_refused(tmp_path):
    """A compressed-tensors W4A4 file whose k_proj has its own global scale: ModelOpt holds one
    weight_scale_2 for q/k/v (vLLM applies one to the fused layer), under which k_proj's kept codes
    would decode wrongly; refused before anything is written, naming the modules."""
    src = copy_checkpoint("llama-ct-nvfp4", tmp_path)
    (shard,) = src.glob("*.safetensors")
    tensors = load_file(shard)
    k = "model.layers.0.self_attn.k_proj.weight_global_scale"
    tensors[k] = tensors[k] * 2
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out"
    proc = run_qconv("convert", src, out, "--to", TARGET)
    one_error(proc, 5, str(src), "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
              "different weight global scales", "--to compressed-tensors-nvfp4 keeps them")
    assert not out.exists()


def test_fused_modules_share_their_largest_input_scale(tmp_path):
    """Members of a fused group with different input scales get the largest (what vLLM computes for the
    fused layer: input_scale.max()); everything else stays the source's bytes."""
    src = copy_checkpoint("llama-modelopt-nvfp4", tmp_path)
    tensors = load_file(src / "model.safetensors")
    v = "model.layers.1.self_attn.v_proj.input_scale"
    tensors[v] = tensors[v] * 3
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    comp = _convert(src, out)
    assert comp["codes_kept"] == 14
    ours = load_file(out / "model.safetensors")
    for leaf in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(ours[f"model.layers.1.self_attn.{leaf}.input_scale"], tensors[v])
    assert sorted(ours) == sorted(tensors)
    for name, t in tensors.items():
        if not name.startswith("model.layers.1.self_attn.") or not name.endswith(".input_scale"):
            assert torch.equal(tensor_bytes(ours[name]), tensor_bytes(t)), name


@pytest.mark.parametrize("args,needle", [
    (["--bits", "4"], "--bits: --to modelopt-nvfp4 takes no such option; it takes no target options"),
    (["--group-size", "32"], "--group-size: --to modelopt-nvfp4 takes no such option"),
    (["--scale-dtype", "float16"], "--scale-dtype: --to modelopt-nvfp4 takes no such option"),
])
def test_options_are_usage_errors(tmp_path, args, needle):
    proc = run_qconv("convert", MODELOPT, tmp_path / "out", "--to", TARGET, *args)
    one_error(proc, 2, needle)
    assert not (tmp_path / "out").exists()


def test_compressed_tensors_nvfp4_of_the_result_is_the_modelopt_path(tmp_path):
    """CT W4A4 -> ModelOpt -> compressed-tensors-nvfp4 keeps the same packed codes and e4m3 scales all
    the way (its weight global scale is float32(1 / float32(1 / g)), the two reciprocals reported)."""
    mid, back = tmp_path / "mid", tmp_path / "back"
    _convert(CT_W4A4, mid)
    convert_component(mid, back, "compressed-tensors-nvfp4")
    ours, theirs = load_tensors(back), load_tensors(CT_W4A4)
    for p in _prefixes(theirs, "weight_packed"):
        assert torch.equal(ours[p + ".weight_packed"], theirs[p + ".weight_packed"])
        assert torch.equal(tensor_bytes(ours[p + ".weight_scale"]), tensor_bytes(theirs[p + ".weight_scale"]))
        g = np.float32(theirs[p + ".weight_global_scale"].item())
        assert ours[p + ".weight_global_scale"].item() == np.float32(1) / (np.float32(1) / g)
    shutil.rmtree(mid)
