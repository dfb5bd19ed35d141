"""A writing verb never writes what it cannot vouch for (issue 10, items 3, 6, 9, 11, 13).

Each case breaks one thing in a copy of a real fixture: a tensor no quantized module accounts for (an
int8 weight whose SCB is gone, or missing from the index; a 4-bit weight whose quant_state is gone; a
module with both .weight and .qweight), a method qconv does not decode, or a state tensor of the wrong
dtype, shape or range. Every writing verb (dequantize, convert, convert --validate, bnb8-to-gptq,
validate) must refuse it with a documented exit (5: a method qconv does not decode; 4: inconsistent
data) and ONE stderr line naming the file and the tensor: no traceback, no RuntimeWarning, no DST, no
litter beside it, and the source byte-identical.
"""

import hashlib
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, copy_checkpoint, run_qconv

CORRUPT, UNSUPPORTED = 4, 5
REFERENCE = CHECKPOINTS            # fixtures copied from the shared reference checkpoints
Q = "model.layers.0.self_attn.q_proj"
ST = "model.safetensors"


def _edit_tensors(folder: Path, fn) -> None:
    """Apply fn to the fixture's tensors (name -> torch tensor) and save them back in one file."""
    tensors = load_file(folder / ST)
    fn(tensors)
    save_file(tensors, folder / ST, metadata={"format": "pt"})


def _edit_config(folder: Path, fn) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    fn(config)
    path.write_text(json.dumps(config))


def _edit_quant_state(folder: Path, fn) -> None:
    """Apply fn to q_proj's bitsandbytes quant_state JSON and store it back as its uint8 tensor."""
    def edit(tensors):
        name = next(k for k in tensors if k.startswith(Q + ".weight.quant_state."))
        state = json.loads(bytes(tensors[name].numpy()))
        fn(state)
        tensors[name] = torch.frombuffer(bytearray(json.dumps(state).encode()), dtype=torch.uint8)
    _edit_tensors(folder, edit)


# Each case: make(tmp_path) -> (broken source, code, strings the message must hold). The source is
# a copy of the fixture named by the case's first word.

def bnb8_scb_removed(t):
    d = copy_checkpoint("llama-bnb8", t)
    _edit_tensors(d, lambda ts: ts.pop(Q + ".SCB"))
    return d, CORRUPT, [ST, Q + ".weight", "SCB"]


def bnb8_scb_not_in_index(t):
    d = copy_checkpoint("llama-bnb8", t)
    names = sorted(load_file(d / ST))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: ST for n in names if n != Q + ".SCB"}}))
    return d, CORRUPT, [ST, Q + ".weight", "SCB"]


def bnb8_weight_removed(t):
    d = copy_checkpoint("llama-bnb8", t)
    _edit_tensors(d, lambda ts: ts.pop(Q + ".weight"))
    return d, CORRUPT, [ST, Q, "has SCB but no int8 weight tensor"]


def bnb8_scb_bfloat16(t):
    d = copy_checkpoint("llama-bnb8", t)
    _edit_tensors(d, lambda ts: ts.update({Q + ".SCB": ts[Q + ".SCB"].to(torch.bfloat16)}))
    return d, CORRUPT, [ST, Q, "SCB is BF16, expected float32"]


def bnb8_scb_nan(t):
    d = copy_checkpoint("llama-bnb8", t)
    _edit_tensors(d, lambda ts: ts[Q + ".SCB"].__setitem__(3, float("nan")))
    return d, CORRUPT, [ST, Q + ".SCB", "non-finite"]


def bnb4_quant_state_removed(t):
    d = copy_checkpoint("llama-bnb4-nf4-dq", t)
    _edit_tensors(d, lambda ts: ts.pop(Q + ".weight.quant_state.bitsandbytes__nf4"))
    return d, CORRUPT, [ST, Q + ".weight", "quant_state"]


def bnb4_nested_absmax_bfloat16(t):
    d = copy_checkpoint("llama-bnb4-nf4-dq", t)
    name = Q + ".weight.nested_absmax"
    _edit_tensors(d, lambda ts: ts.update({name: ts[name].to(torch.bfloat16)}))
    return d, CORRUPT, [ST, Q, "nested_absmax is BF16, expected float32"]


def bnb4_absmax_inf(t):
    d = copy_checkpoint("llama-bnb4-fp4", t)
    _edit_tensors(d, lambda ts: ts[Q + ".weight.absmax"].__setitem__(0, float("inf")))
    return d, CORRUPT, [ST, Q + ".weight.absmax", "non-finite"]


def _nested(key, value, message, tensor=Q + ".weight.quant_state.bitsandbytes__nf4"):
    def case(t):
        d = copy_checkpoint("llama-bnb4-nf4-dq", t)
        _edit_quant_state(d, lambda qs: qs.update({key: value}))
        return d, CORRUPT, [ST, f"tensor '{tensor}'", message]
    return case


bnb4_nested_blocksize_0 = _nested("nested_blocksize", 0, "nested_blocksize 0")
# q_proj's 1024 absmax codes have 4 nested absmax values: blocks of 256, not of 1.
bnb4_nested_blocksize_1 = _nested("nested_blocksize", 1, "nested_absmax has shape [4]; 1024 absmax codes in "
                                  "nested blocks of 1 need [1024]", tensor=Q)
bnb4_nested_blocksize_x = _nested("nested_blocksize", "x", "nested_blocksize 'x'")
bnb4_nested_offset_abc = _nested("nested_offset", "abc", "nested_offset 'abc'")
bnb4_nested_offset_nan = _nested("nested_offset", float("nan"), "nested_offset nan")
bnb4_dtype_object = _nested("dtype", {"a": 1}, "dtype {'a': 1}")


def _gptq_width(bits):
    """q_proj's shapes rewritten as bits-wide codes (qzeros bits*out/32 words wide, qweight in*bits/32
    rows): a width GPTQ never packs, which a uint8 code would silently truncate."""
    def case(t):
        d = copy_checkpoint("llama-gptq-w4g64-asym", t)

        def edit(ts):
            out, inp = ts[Q + ".scales"].shape[1], ts[Q + ".g_idx"].shape[0]
            gen = torch.Generator().manual_seed(bits)
            ts[Q + ".qweight"] = torch.randint(0, 1 << 30, (inp * bits // 32, out), generator=gen,
                                               dtype=torch.int32)
            ts[Q + ".qzeros"] = torch.randint(0, 1 << 30, (ts[Q + ".scales"].shape[0], out * bits // 32),
                                              generator=gen, dtype=torch.int32)
        _edit_tensors(d, edit)
        return d, CORRUPT, [ST, Q, f"{bits}-bit codes"]
    return case


gptq_12bit_shapes = _gptq_width(12)
gptq_16bit_shapes = _gptq_width(16)


def gptq_scale_nan(t):
    d = copy_checkpoint("llama-gptq-w4g64-asym", t)
    _edit_tensors(d, lambda ts: ts[Q + ".scales"].__setitem__((1, 2), float("nan")))
    return d, CORRUPT, [ST, Q + ".scales", "non-finite"]


def gptq_weight_and_qweight(t):
    d = copy_checkpoint("llama-gptq-w4g64-asym", t)
    _edit_tensors(d, lambda ts: ts.update({Q + ".weight": torch.zeros(256, 256, dtype=torch.float16)}))
    return d, CORRUPT, [ST, Q + ".weight", "qweight"]


def _method(method):
    def case(t):
        d = copy_checkpoint("llama-gptq-w4g64-asym", t)
        _edit_config(d, lambda c: c["quantization_config"].update({"quant_method": method}))
        return d, UNSUPPORTED, ["config.json", f"quant_method {method!r}"]
    return case


def gptq_method_awq(t):
    """GPTQ words under an AWQ config: AWQ's reader finds them in GPTQ's layout and refuses."""
    d = copy_checkpoint("llama-gptq-w4g64-asym", t)
    _edit_config(d, lambda c: c["quantization_config"].update({"quant_method": "awq"}))
    return d, UNSUPPORTED, [ST, "qweight", "AWQ version/format 'gptq'"]


def gptq_method_compressed_tensors(t):
    """GPTQ words under a compressed-tensors config: no compressed-tensors module claims them."""
    d = copy_checkpoint("llama-gptq-w4g64-asym", t)
    _edit_config(d, lambda c: c["quantization_config"].update({"quant_method": "compressed-tensors"}))
    return d, CORRUPT, [ST, "belongs to no quantized module"]


gptq_method_unknown = _method("hqq")


def _reference(name, method):
    """A producer-made checkpoint relabelled with a method qconv does not decode (fixtures/checkpoints)."""
    def case(t):
        d = t / name
        shutil.copytree(REFERENCE / name, d, ignore=shutil.ignore_patterns("oracle"))
        _edit_config(d, lambda c: c["quantization_config"].update({"quant_method": method}))
        return d, UNSUPPORTED, ["config.json", f"quant_method {method!r}"]
    return case


reference_awq_as_hqq = _reference("llama-awq-w4g128", "hqq")
reference_compressed_tensors_as_hqq = _reference("llama-ct-w4a16", "hqq")


def reference_awq_as_fp8(t):
    """AWQ words under a fine-grained FP8 config: no FP8 module claims them."""
    d = t / "awq"
    shutil.copytree(REFERENCE / "llama-awq-w4g128", d, ignore=shutil.ignore_patterns("oracle"))
    _edit_config(d, lambda c: c.update({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    return d, CORRUPT, [ST, "belongs to no quantized module"]


# Fine-grained FP8 (transformers / DeepSeek, issue 17): transformers' own files, one thing broken.
FP8 = "llama-fp8-block"
MOE = "model.layers.0.mlp.experts"


def _fp8_code(code):
    def case(t):
        d = copy_checkpoint(FP8, t)
        _edit_tensors(d, lambda ts: ts[Q + ".weight"].view(torch.uint8).__setitem__((3, 5), code))
        return d, CORRUPT, [ST, Q + ".weight", "e4m3 NaN codes", "[3, 5]"]
    return case


fp8_code_nan_positive = _fp8_code(0x7F)
fp8_code_nan_negative = _fp8_code(0xFF)


def fp8_scale_nan(t):
    d = copy_checkpoint(FP8, t)
    _edit_tensors(d, lambda ts: ts[Q + ".weight_scale_inv"].__setitem__((1, 1), float("nan")))
    return d, CORRUPT, [ST, Q + ".weight_scale_inv", "non-finite"]


def fp8_scale_inf(t):
    d = copy_checkpoint(FP8, t)
    _edit_tensors(d, lambda ts: ts[Q + ".weight_scale_inv"].__setitem__((0, 1), float("inf")))
    return d, CORRUPT, [ST, Q + ".weight_scale_inv", "non-finite"]


def fp8_scale_wrong_shape(t):
    d = copy_checkpoint(FP8, t)
    _edit_tensors(d, lambda ts: ts.update({Q + ".weight_scale_inv": ts[Q + ".weight_scale_inv"][:1].clone()}))
    return d, CORRUPT, [ST, Q + ".weight", "weight_scale_inv has shape [1, 2]", "gives [2, 2]"]


def fp8_scale_int_dtype(t):
    d = copy_checkpoint(FP8, t)
    _edit_tensors(d, lambda ts: ts.update({Q + ".weight_scale_inv": ts[Q + ".weight_scale_inv"].to(torch.int32)}))
    return d, UNSUPPORTED, [ST, Q + ".weight", "weight_scale_inv is I32"]


def fp8_block_size_contradicts_shapes(t):
    d = copy_checkpoint(FP8, t)
    _edit_config(d, lambda c: c["quantization_config"].update({"weight_block_size": [64, 64]}))
    return d, CORRUPT, [ST, "weight_block_size [64, 64]", "gives"]


def fp8_no_block_size_with_block_scales(t):
    d = copy_checkpoint(FP8, t)
    _edit_config(d, lambda c: c["quantization_config"].update({"weight_block_size": None}))
    return d, CORRUPT, [ST, "no weight_block_size"]


def fp8_fmt_e5m2(t):
    d = copy_checkpoint(FP8, t)
    _edit_config(d, lambda c: c["quantization_config"].update({"fmt": "e5m2"}))
    return d, UNSUPPORTED, ["config.json", "fmt 'e5m2'"]


def fp8_expert_scales_removed(t):
    """Per-expert e4m3 weights whose fused scales are gone."""
    d = copy_checkpoint("qwen3moe-fp8-block", t)
    _edit_tensors(d, lambda ts: ts.pop(MOE + ".gate_up_proj_scale_inv"))
    return d, CORRUPT, [ST, MOE + ".0.gate_proj.weight", "without a scale"]


def fp8_fused_expert_scales_for_fewer_experts(t):
    """Fused experts whose scales hold fewer experts than the weights."""
    d = copy_checkpoint("qwen3moe-fp8-block-fused", t)
    _edit_tensors(d, lambda ts: ts.update({MOE + ".down_proj_scale_inv": ts[MOE + ".down_proj_scale_inv"][:3].clone()}))
    return d, CORRUPT, [ST, MOE + ".down_proj", "down_proj_scale_inv has shape [3, 2, 1]"]

CASES = {name: fn for name, fn in dict(globals()).items()
         if name.startswith(("bnb8_", "bnb4_", "gptq_", "reference_", "fp8_")) and callable(fn)
         and not name.startswith("_")}

# The source fixture each broken copy is checked against by validate (the intact original).
INTACT = {"bnb8": "llama-bnb8", "bnb4": "llama-bnb4-nf4-dq", "gptq": "llama-gptq-w4g64-asym",
          "reference": "llama-fp16", "fp8": "llama-fp16"}


def _verb_args(verb, case, src, dst):
    family = case.split("_")[0]
    target = "gptq-v2" if family == "gptq" else "gptq"
    if verb == "dequantize":
        return ["dequantize", src, dst]
    if verb == "convert":
        return ["convert", src, dst, "--to", target]
    if verb == "convert-validate":
        return ["convert", src, dst, "--to", target, "--validate", "--json"]
    if verb == "bnb8-to-gptq":
        return ["bnb8-to-gptq", src, dst]
    return ["validate", src, CHECKPOINTS / INTACT[family]]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


# bnb8-to-gptq takes bitsandbytes int8 sources only (any other is refused, exit 5: test_convert_edge.py)
PAIRS = [(case, verb) for case in sorted(CASES)
         for verb in ("dequantize", "convert", "convert-validate", "bnb8-to-gptq", "validate")
         if verb != "bnb8-to-gptq" or case.startswith("bnb8_")]


@pytest.mark.parametrize("case,verb", PAIRS)
def test_writing_verb_refuses(tmp_path, case, verb):
    src, code, needles = CASES[case](tmp_path / "src")
    before = _digest(src)
    out = tmp_path / "out"
    dst = out / "dst"
    out.mkdir()
    proc = run_qconv(*_verb_args(verb, case, src, dst))
    assert proc.returncode == code, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("qconv: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    assert list(out.iterdir()) == []                 # no DST, no temp folder left beside it
    assert _digest(src) == before


def test_bnb8_scb_missing_one_module_is_named(tmp_path):
    """The message names the module whose SCB is missing, not just some int8 tensor."""
    src, _, _ = bnb8_scb_removed(tmp_path)
    proc = run_qconv("dequantize", src, tmp_path / "dst", check=CORRUPT)
    assert f"tensor '{Q}.weight'" in proc.stderr and str(src / ST) in proc.stderr


# ---------------------------------------------------------------------------------------------
# inspect: packed integer tensors in a folder whose config claims no quantization, or a method
# qconv does not decode, are reported, never counted as plain weights without a word.

def _inspect_warnings(path):
    proc = run_qconv("inspect", "--json", path, check=0)
    [component] = json.loads(proc.stdout)["components"]
    return component["warnings"]


def test_inspect_warns_int8_weights_without_scb_and_no_config(tmp_path):
    d = copy_checkpoint("llama-bnb8", tmp_path)
    _edit_tensors(d, lambda ts: [ts.pop(k) for k in list(ts) if k.endswith((".SCB", ".weight_format"))])
    _edit_config(d, lambda c: c.pop("quantization_config"))
    warnings = _inspect_warnings(d)
    assert any("14 int8 weights have no SCB scale tensor" in w and "model.layers.0.mlp.down_proj" in w
               for w in warnings), warnings


def test_inspect_warns_bnb4_state_without_quant_state_and_no_config(tmp_path):
    d = copy_checkpoint("llama-bnb4-nf4-dq", tmp_path)
    _edit_tensors(d, lambda ts: [ts.pop(k) for k in list(ts) if ".quant_state." in k])
    _edit_config(d, lambda c: c.pop("quantization_config"))
    warnings = _inspect_warnings(d)
    assert any("quantization tensors belong to no quantized module" in w for w in warnings), warnings


@pytest.mark.parametrize("name,leaf", [("llama-ct-w4a16", "weight_packed"), ("llama-awq-w4g128", "qweight")])
def test_inspect_warns_packed_tensors_of_an_undecoded_method(tmp_path, name, leaf):
    method = "hqq"
    d = tmp_path / name
    shutil.copytree(REFERENCE / name, d, ignore=shutil.ignore_patterns("oracle"))
    _edit_config(d, lambda c: c["quantization_config"].update({"quant_method": method}))
    warnings = _inspect_warnings(d)
    assert any(f"quant_method {method!r} is not a format qconv decodes" in w for w in warnings), warnings
    assert any("quantization tensors belong to no quantized module" in w and f"down_proj.{leaf}" in w
               for w in warnings), warnings
