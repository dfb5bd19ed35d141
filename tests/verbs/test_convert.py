"""`qconv convert` / `qconv bnb8-to-gptq`: lossless paths keep every code, round trips are
byte-identical, and what qconv writes loads in the real consumers (transformers with auto-round's CPU
kernels for GPTQ and auto-round, transformers with bitsandbytes for bnb8). The bitsandbytes 4-bit target
writing bitsandbytes' own bytes and double quantization: tests/formats/bnb/test_bnb.py."""

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import CHECKPOINTS, is_card, load_tensors, model_logits as _logits, run_convert as _convert, run_qconv


def _unpack8(qweight):
    """Independent of qconv's packer: 8-bit GPTQ codes, four per int32 along dim 0, lowest byte first."""
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=1)
    return codes.reshape(-1, qweight.shape[1])


@pytest.mark.parametrize("name", ["llama-bnb8", "qwen3vl-bnb8-skipvisual"])
def test_bnb8_to_gptq_keeps_codes_exactly(tmp_path, name):
    out = tmp_path / "gptq"
    proc = _convert(CHECKPOINTS / name, out, "bnb8-to-gptq", "--json")
    (report,) = json.loads(proc.stdout)["components"]
    src, dst = load_tensors(CHECKPOINTS / name), load_tensors(out)
    modules = [k[: -len(".SCB")] for k in src if k.endswith(".SCB")]
    assert report["modules"] == len(modules) > 0
    for m in modules:
        cb, scb = src[m + ".weight"], src[m + ".SCB"]
        codes = _unpack8(dst[m + ".qweight"]).T                        # [out, in]
        assert torch.equal(codes, cb.to(torch.int64) + 128), m
        assert dst[m + ".scales"].dtype == torch.float16 and dst[m + ".scales"].shape == (1, cb.shape[0])
        assert torch.equal(dst[m + ".scales"][0], (scb / 127).to(torch.float16)), m
        assert torch.equal(dst[m + ".qzeros"], torch.full_like(dst[m + ".qzeros"], 0x7F7F7F7F))
        # g_idx as GPTQModel writes it for one group per row: every input feature in group 0
        assert torch.equal(dst[m + ".g_idx"], torch.zeros(cb.shape[1], dtype=torch.int32)), m
    for k, v in src.items():                                            # everything else untouched
        if not k.endswith((".SCB", ".weight_format")) and k[: -len(".weight")] not in modules:
            assert torch.equal(dst[k], v) and dst[k].dtype == v.dtype, k
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format")} == \
        {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True, "desc_act": False,
         "checkpoint_format": "gptq"}
    assert "meta" not in qc
    assert report["scales"] == sum(src[m + ".SCB"].numel() for m in modules)
    assert 0 < report["max_scale_rel_error"] <= 2**-11                 # fp16 rounding, reported


# What qconv writes must run in the consumers. The comparison is with the same weights dequantized to
# float32 and run by plain transformers, so the only differences are the stored scale's rounding (fp16
# scales: at most 2^-11 relative) and the consumer kernel's fp16/bf16 arithmetic: measured below 0.3 %;
# a wrong code or zero point moves logits by tens of percent.
KERNEL_TOLERANCE = 0.01
BF16_KERNEL_TOLERANCE = 0.03


@pytest.mark.parametrize("name, args", [
    ("llama-bnb8", ["bnb8-to-gptq"]),
    ("qwen3vl-bnb8-skipvisual", ["bnb8-to-gptq"]),
    ("llama-autoround-w4g128-mixed8", ["--to", "gptq"]),
    ("llama-gptq-w8g128", ["--to", "auto-round"]),
    ("llama-gptq-w3g128", ["--to", "auto-round"]),
    ("llama-bnb4-nf4-dq", ["--to", "gptq"]),                      # requantized
    ("llama-gptq-w4g128-actorder", ["--to", "auto-round"]),       # requantized: act-order -> contiguous
])
def test_gptq_and_auto_round_outputs_run_in_auto_round_kernels(tmp_path, name, args):
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    from transformers import AutoRoundConfig

    out = tmp_path / "out"
    _convert(CHECKPOINTS / name, out, *args)
    reference = tmp_path / "reference"                 # the output's own weights, dequantized
    run_qconv("dequantize", "--dtype", "float32", out, reference, check=0)
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]])
    kwargs = {"quantization_config": AutoRoundConfig()} if args[-1] != "auto-round" else {}
    vlm = name.startswith("qwen3vl")
    model, logits = _logits(out, ids, vlm, **kwargs)
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    expected = {k[: -len(".qweight")] for k in load_tensors(out) if k.endswith(".qweight")}
    assert quantized == expected                      # every stored module runs the kernel, no other
    _, ref = _logits(reference, ids, vlm)
    rel = ((logits - ref).norm() / ref.norm()).item()
    assert rel < KERNEL_TOLERANCE, rel


def test_bnb8_output_runs_in_bitsandbytes(tmp_path):
    """bnb8 -> GPTQ with float32 scales -> bnb8 gives back the source's bytes (SCB recovered exactly),
    so LLM.int8 computes exactly what it computes on the producer's own file, run here in the same process
    (not the stored oracle: torch's bf16 kernels pick their path by CPU, AVX2 / AVX512 / AMX, and moved
    these logits by 1 % under AVX2); through float16 scales SCB moves by the scale rounding, and the model
    still runs in bitsandbytes within LLM.int8's own error of that (its activation quantization: 1.3-1.7 %
    measured, see test_dequantize.TOLERANCE)."""
    import bitsandbytes as bnb

    src = CHECKPOINTS / "qwen3vl-bnb8-skipvisual"
    ids = load_file(src / "oracle" / "logits.safetensors")["input_ids"]
    _, oracle = _logits(src, ids, vlm=True)
    for scale_dtype in ("float32", "float16"):
        gptq, back = tmp_path / f"gptq-{scale_dtype}", tmp_path / f"bnb8-{scale_dtype}"
        _convert(src, gptq, "bnb8-to-gptq", "--scale-dtype", scale_dtype)
        _convert(gptq, back, "--to", "bnb8")
        qc = json.loads((back / "config.json").read_text())["quantization_config"]
        assert qc["llm_int8_threshold"] == 6.0 and isinstance(qc["llm_int8_threshold"], float)
        assert "lm_head" in qc["llm_int8_skip_modules"] and "visual" not in qc["llm_int8_skip_modules"]
        model, logits = _logits(back, ids, vlm=True)
        quantized = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)}
        assert quantized == {k[: -len(".SCB")] for k in load_tensors(back) if k.endswith(".SCB")}
        source, result = load_tensors(src), load_tensors(back)
        if scale_dtype == "float32":
            assert all(torch.equal(source[k], result[k]) and source[k].dtype == result[k].dtype for k in source)
            assert torch.equal(logits, oracle)
        else:
            assert ((logits - oracle).norm() / oracle.norm()).item() < 0.03


def _digest(folder):
    """Every file's hash but the model card's (it names the run's source and command)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and not is_card(p)}


def test_lossless_round_trips_are_byte_identical(tmp_path):
    g = tmp_path / "g"
    _convert(CHECKPOINTS / "llama-bnb8", g, "bnb8-to-gptq")
    _convert(g, tmp_path / "b", "--to", "bnb8")
    _convert(tmp_path / "b", tmp_path / "g2", "--to", "gptq")            # gptq -> bnb8 -> gptq
    assert _digest(g) == _digest(tmp_path / "g2")
    _convert(g, tmp_path / "v2", "--to", "gptq-v2")
    _convert(tmp_path / "v2", tmp_path / "v1", "--to", "gptq")           # v1 -> v2 -> v1
    assert _digest(g) == _digest(tmp_path / "v1")
    v2 = load_tensors(tmp_path / "v2")
    assert torch.equal(v2["model.norm.weight"], load_tensors(g)["model.norm.weight"])
    assert (v2["model.layers.0.mlp.up_proj.qzeros"] == torch.tensor(0x80808080 - 2**32, dtype=torch.int32)).all()

    src = CHECKPOINTS / "llama-autoround-w4g128-mixed8"                  # auto-round -> gptq -> auto-round
    _convert(src, tmp_path / "ar", "--to", "auto-round")
    _convert(src, tmp_path / "gq", "--to", "gptq")
    _convert(tmp_path / "gq", tmp_path / "ar2", "--to", "auto-round")
    assert _digest(tmp_path / "ar") == _digest(tmp_path / "ar2")
    original, repacked = load_tensors(src), load_tensors(tmp_path / "ar")
    assert original.keys() == repacked.keys()
    assert all(torch.equal(original[k], repacked[k]) and original[k].dtype == repacked[k].dtype for k in original)
    qc = json.loads((tmp_path / "ar" / "config.json").read_text())["quantization_config"]
    assert qc["extra_config"] == {"model.layers.0.self_attn.q_proj": {"bits": 8},
                                  "model.layers.1.mlp.down_proj": {"bits": 8}}


def test_float32_scales_keep_more(tmp_path):
    fp16 = json.loads(_convert(CHECKPOINTS / "llama-bnb8", tmp_path / "a", "bnb8-to-gptq", "--json").stdout)
    fp32 = json.loads(_convert(CHECKPOINTS / "llama-bnb8", tmp_path / "b", "bnb8-to-gptq", "--scale-dtype",
                               "float32", "--json").stdout)
    (a,), (b,) = fp16["components"], fp32["components"]
    assert b["max_scale_rel_error"] < 2**-23 < a["max_scale_rel_error"]
    assert load_tensors(tmp_path / "b")["model.layers.0.mlp.up_proj.scales"].dtype == torch.float32


def _rtn_sq_error(w, bits, group):
    """Plain GPTQ symmetric round-to-nearest (scale 2 absmax / (2^b - 1) stored as float16, zero
    2^(b-1)), written here independently of qconv: the baseline requantization must beat."""
    out, inp = w.shape
    g = w.reshape(out, inp // group, group).astype(np.float64)
    scale = (np.abs(g).max(axis=2, keepdims=True) / ((2**bits - 1) / 2)).astype(np.float16).astype(np.float64)
    scale[scale == 0] = 1
    zero = 2 ** (bits - 1)
    q = np.clip(np.round(g / scale) + zero, 0, 2**bits - 1)
    return float((((q - zero) * scale - g) ** 2).sum())


@pytest.mark.parametrize("name", ["llama-bnb4-nf4-dq", "llama-bnb4-fp4", "llama-bnb4-nf4-bf16storage"])
def test_requantized_4bit_beats_round_to_nearest(tmp_path, name):
    """nf4/fp4 -> GPTQ int4: the error each layer adds is measured here from the files (the output
    dequantized by qconv against the producer's own oracle), must match what convert reported, and
    must be below plain round-to-nearest's on every layer and at least 20 % below it overall."""
    out, deq = tmp_path / "gptq", tmp_path / "deq"
    report = json.loads(_convert(CHECKPOINTS / name, out, "--to", "gptq", "--json").stdout)["components"][0]
    assert report["requantized"] == report["modules"] == 14 and report["codes_kept"] == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (4, 64, True, False)
    run_qconv("dequantize", "--dtype", "float32", out, deq, check=0)
    oracle, ours = load_file(CHECKPOINTS / name / "oracle" / "dequant.safetensors"), load_tensors(deq)
    layers = {r["module"]: r for r in report["layers"]}
    total = total_rtn = 0.0
    for key, w in oracle.items():
        w = w.double().numpy()
        sq = float(((ours[key].double().numpy() - w) ** 2).sum())
        rtn = _rtn_sq_error(w, 4, 64)
        r = layers[key[: -len(".weight")]]
        # convert measures against the unrounded float32 source; the oracle is bitsandbytes' float16
        # rounding of it, so the two measurements agree to that rounding, not to the last bit.
        assert abs(sq - r["sq_error"]) <= 1e-3 * sq and abs(rtn - r["rtn_sq_error"]) <= 1e-3 * rtn, key
        assert sq < rtn, key
        total, total_rtn = total + sq, total_rtn + rtn
    assert total <= 0.8 * total_rtn, total / total_rtn
    assert report["sq_error_vs_rtn"] == pytest.approx(total / total_rtn, abs=1e-4)


def test_no_search_writes_plain_round_to_nearest(tmp_path):
    """--no-search: each requantized module is plain GPTQ round-to-nearest (_rtn_sq_error, written here
    independently), its error in both columns of the report; the searched default beats it."""
    name = "llama-bnb4-nf4-dq"
    plain = json.loads(_convert(CHECKPOINTS / name, tmp_path / "rtn", "--to", "gptq", "--no-search",
                                "--json").stdout)["components"][0]
    searched = json.loads(_convert(CHECKPOINTS / name, tmp_path / "s", "--to", "gptq", "--json").stdout)["components"][0]
    assert plain["search"] is False and searched["search"] is True
    assert plain["sq_error_vs_rtn"] == 1 and searched["sq_error_vs_rtn"] < 0.8
    run_qconv("dequantize", "--dtype", "float32", tmp_path / "rtn", tmp_path / "deq", check=0)
    oracle, ours = load_file(CHECKPOINTS / name / "oracle" / "dequant.safetensors"), load_tensors(tmp_path / "deq")
    layers = {r["module"]: r for r in plain["layers"]}
    for key, w in oracle.items():
        w = w.double().numpy()
        sq, rtn = float(((ours[key].double().numpy() - w) ** 2).sum()), _rtn_sq_error(w, 4, 64)
        r = layers[key[: -len(".weight")]]
        assert r["sq_error"] == r["rtn_sq_error"] and abs(sq - rtn) <= 1e-3 * rtn, key


@pytest.mark.parametrize("name, args, reason", [
    ("llama-bnb8", ["--to", "gptq", "--bits", "4", "--group-size", "128"], "8-bit codes become 4-bit"),
    ("llama-gptq-w8g128", ["--to", "gptq", "--group-size", "64"], "group size 128 becomes 64"),
    ("llama-gptq-w4g64-asym", ["--to", "gptq", "--sym"], "asymmetric zero points become symmetric"),
    ("llama-gptq-w8g128", ["--to", "bnb8"], "bitsandbytes int8 holds 8-bit symmetric codes with one scale per "
                                            "row; this module has 8-bit sym codes in groups of 128"),
    ("llama-bnb4-fp4", ["--to", "bnb8"], "fp4 codes are not integers"),
])
def test_other_lossy_paths_requantize_and_say_why(tmp_path, name, args, reason):
    report = json.loads(_convert(CHECKPOINTS / name, tmp_path / "o", *args, "--json").stdout)["components"][0]
    assert report["requantized"] == 14 and all(r["reason"] == reason for r in report["layers"])
    assert all(r["sq_error"] <= r["rtn_sq_error"] for r in report["layers"])


def test_pipeline_and_determinism_and_source_untouched(tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(CHECKPOINTS / "pipeline-qwen3vl-bnb8", src)
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    _convert(src, tmp_path / "a", "bnb8-to-gptq")
    _convert(src, tmp_path / "b", "bnb8-to-gptq")
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before
    for sub in ("", "text_encoder", "tokenizer"):
        assert _digest(tmp_path / "a" / sub) == _digest(tmp_path / "b" / sub)
    assert _digest(tmp_path / "a" / "tokenizer") == _digest(src / "tokenizer")
    single = tmp_path / "single"
    _convert(CHECKPOINTS / "qwen3vl-bnb8-skipvisual", single, "bnb8-to-gptq")
    assert _digest(tmp_path / "a" / "text_encoder") == _digest(single)


@pytest.mark.parametrize("case", ["truncated", "index_outside_folder", "pickle_only", "quant_state_not_json"])
def test_bad_input_leaves_no_destination(tmp_path, case):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "safety"))
    from test_bad_input import CASES

    make, code = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    path, needles = make(work)
    proc = run_qconv("convert", "--to", "gptq", path, tmp_path / "out")
    assert proc.returncode == code and all(n in proc.stderr for n in needles), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


@pytest.mark.parametrize("name, to", [("llama-gptq-w4g128-actorder", "bnb4-nf4"), ("llama-bnb8", "bnb4-fp4")])
def test_requantized_bnb4_runs_in_bitsandbytes(tmp_path, name, to):
    """int -> nf4/fp4: a per-block scale search, never worse than bitsandbytes' own rule (scale = block
    absmax, nearest code) on any layer; the result runs in bitsandbytes' Linear4bit and matches its own
    weights run in float32 to the consumer's own arithmetic (activations in the model's bf16/fp16)."""
    import bitsandbytes as bnb

    out = tmp_path / "out"
    report = json.loads(_convert(CHECKPOINTS / name, out, "--to", to, "--json").stdout)["components"][0]
    assert report["requantized"] == 14
    assert all(r["sq_error"] <= r["rtn_sq_error"] for r in report["layers"])
    reference = tmp_path / "reference"
    run_qconv("dequantize", "--dtype", "float32", out, reference, check=0)
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]])
    model, logits = _logits(out, ids)
    assert {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)} == \
        {k[: -len(".weight.absmax")] for k in load_tensors(out) if k.endswith(".weight.absmax")}
    _, ref = _logits(reference, ids)
    # bitsandbytes' Linear4bit computes in bf16 on CPUs with AVX512-BF16 (measured 0.0076-0.0086 there),
    # in the model's dtype elsewhere: bounded by bf16's rounding of activations and weights (2^-8 each,
    # compounded over two layers), as test_convert_edge does; a wrong code moves logits by tens of percent.
    assert ((logits - ref).norm() / ref.norm()).item() < BF16_KERNEL_TOLERANCE


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_interrupted_conversion_leaves_nothing(tmp_path, sig):
    """The signal arrives mid-conversion whatever the machine's load: the test-only hook
    QCONV_TEST_SIGNAL (formats/storage/staging.py) makes qconv signal itself once its first output tensor is
    on disk, in the staging folder."""
    import subprocess
    import sys

    from conftest import FIXTURES, QCONV, child_env, child_signals
    sys.path.insert(0, str(FIXTURES / "layouts"))
    from build import build

    src = build(FIXTURES / "layouts" / "qwen3vl-8b-bnb8.json", tmp_path / "src")
    proc = subprocess.run([QCONV, "bnb8-to-gptq", src, tmp_path / "out"], capture_output=True, text=True,
                          timeout=600, env=child_env(QCONV_TEST_SIGNAL=f"tensor-written:{sig}"),
                          preexec_fn=child_signals())
    assert proc.returncode == 130 and proc.stderr.strip() == "qconv: interrupted", proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
