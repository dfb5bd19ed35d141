"""bitsandbytes (formats/bnb/): LLM.int8 and 4-bit (nf4 / fp4, double quant, every storage dtype) read
as bitsandbytes' own functions dequantize them on random shapes and settings, its codebooks, inspect's
settings and parameter dtypes against the producer and the model transformers + bitsandbytes loads, and the
4-bit target writing bitsandbytes' own bytes and double quantization. The generic fixture suites (readers
against the producer's oracle, windows, every conversion, golden inspect reports) cover bitsandbytes too."""

import json

import numpy as np
import pytest
import torch
from hypothesis import assume, given, strategies as st
from safetensors.torch import load_file, save_file

from conftest import (CHECKPOINTS, PROPS, inspect_json, inspect_report as _report, load_tensors,
                      model_logits as _logits, provenance as _provenance, random_weights as _weights,
                      read_only_module as _read_only_module, run_convert as _convert, run_qconv)

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# ---- reading, against bitsandbytes' own functions ------------------------------------------------

@PROPS
@given(out=st.integers(1, 48), inp=st.integers(1, 80),
       blocksize=st.sampled_from([32, 64, 128, 256, 512, 1024, 2048, 4096]),
       quant_type=st.sampled_from(["nf4", "fp4"]), double_quant=st.booleans(),
       storage=st.sampled_from(["uint8", "bfloat16", "float16", "float32"]),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]), seed=st.integers(0, 2**16))
def test_4bit_reader_equals_bitsandbytes_dequantize(tmp_path, out, inp, blocksize, quant_type,
                                                    double_quant, storage, dtype, seed):
    import bitsandbytes.functional as F

    itemsize = torch.tensor([], dtype=getattr(torch, storage)).element_size()
    assume(((out * inp + 1) // 2) % itemsize == 0)          # bitsandbytes' own view needs it
    w = _weights(out, inp, dtype, seed)
    packed, qs = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=double_quant,
                                 quant_type=quant_type, quant_storage=getattr(torch, storage))
    tensors = {"layer.weight": packed}
    tensors.update({f"layer.weight.{k}": v for k, v in qs.as_dict(packed=True).items()})
    path = tmp_path / f"m{seed}.safetensors"
    save_file(tensors, path)
    qt = _read_only_module(path)
    ours = torch.from_numpy(qt.dequantize()).to(TORCH_DTYPES[dtype])
    assert qt.dtype == dtype and ours.shape == w.shape

    # bitsandbytes' reference dequantization (the pure-torch kernel behind its default backend, run
    # uncompiled), fed the absmax that bitsandbytes itself rebuilds from double quant: bit for bit.
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code
    absmax = qs.absmax
    if qs.nested:
        absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    reference = _dequantize_4bit_compute.__wrapped__(packed.view(torch.uint8).reshape(-1), absmax.float(),
                                                     _get_4bit_code(quant_type, packed.device), blocksize,
                                                     qs.shape, qs.dtype)
    bits = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32}[dtype]
    assert torch.equal(ours.view(bits), reference.view(bits))

    # The public dequantize_4bit: on CPU, rows of even length go to a C kernel whose AVX512 branch
    # (bitsandbytes 0.50 csrc/cpu_ops.cpp, dequantizeBlockwise4bitCpu, taken when the CPU has AVX512F)
    # indexes absmax by row, which matches the flat blocks its quantizer wrote only when rows align with
    # blocks (every real model's rows do): e.g. a [3, 16] weight in blocks of 32 gives another answer
    # than the reference above there, and the right one on CPUs without AVX512. So the public API is
    # compared on aligned rows only, where every branch agrees on every CPU.
    if inp % blocksize == 0:
        public = F.dequantize_4bit(packed, qs)
        if packed.shape[0] == 1:          # bitsandbytes transposes results with a one-row packed weight
            public = public.t()
        assert torch.equal(ours.view(bits), public.view(bits))


def test_codebooks_are_bitsandbytes_own():
    from bitsandbytes.functional import get_4bit_type
    from qconv.formats.bnb.codec import CODEBOOKS

    for name, book in CODEBOOKS.items():
        theirs = get_4bit_type(name, device="cpu").numpy()
        assert np.array_equal(book.view(np.uint32), theirs.view(np.uint32)), name
    from safetensors.numpy import load_file
    for name, qtype in [("llama-bnb4-fp4", "fp4"), ("llama-bnb4-nf4-dq", "nf4")]:
        stored = load_file(CHECKPOINTS / name / "model.safetensors")["model.layers.0.mlp.up_proj.weight.quant_map"]
        assert np.array_equal(stored.view(np.uint32), CODEBOOKS[qtype].view(np.uint32))


@PROPS
@given(out=st.integers(1, 64), inp=st.integers(1, 96), seed=st.integers(0, 2**16))
def test_int8_reader_equals_bitsandbytes_vectorwise_dequant(tmp_path, out, inp, seed):
    import bitsandbytes.functional as F

    w = _weights(out, inp, "float16", seed)
    cb, scb, _ = F.int8_vectorwise_quant(w)
    path = tmp_path / f"m{seed}.safetensors"
    save_file({"layer.weight": cb, "layer.SCB": scb, "layer.weight_format": torch.tensor(0, dtype=torch.uint8)},
              path)
    qt = _read_only_module(path)
    assert torch.equal(torch.from_numpy(qt.dequantize()), F.int8_vectorwise_dequant(cb, scb))


# ---- inspect, against the producer and the model transformers loads ------------------------------

@pytest.mark.parametrize("name", ["llama-bnb4-fp4", "llama-bnb4-nf4-dq", "llama-bnb4-nf4-bf16storage"])
def test_bnb4_settings_match_provenance(name):
    (report,) = _report(name)["components"]
    s = _provenance(name)["settings"]
    assert report["method"] == "bitsandbytes 4-bit"
    assert report["quant_type"] == s["bnb_4bit_quant_type"]
    assert report["double_quant"] == (s["bnb_4bit_use_double_quant"] == "True")
    assert report["quant_storage"] == s.get("bnb_4bit_quant_storage", "torch.uint8").split(".")[-1]
    assert report["blocksize"] == 64                      # bitsandbytes 0.50's default (FORMATS §2.5)


@pytest.mark.parametrize("name", ["llama-bnb8", "qwen3vl-bnb8-skipvisual", "llama-bnb4-fp4",
                                  "llama-bnb4-nf4-dq", "llama-bnb4-nf4-bf16storage"])
def test_bnb_parameter_dtypes_equal_named_parameters_of_the_loaded_model(name):
    """Load the checkpoint with transformers + bitsandbytes on CPU: named_parameters() per dtype, and
    the set of Linear8bitLt / Linear4bit modules, must be what inspect read from the headers."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForImageTextToText, AutoModelForCausalLM

    (report,) = _report(name)["components"]
    cls = AutoModelForImageTextToText if name.startswith("qwen3vl") else AutoModelForCausalLM
    model = cls.from_pretrained(CHECKPOINTS / name, device_map="cpu")
    counts: dict = {}
    for _, p in model.named_parameters():
        counts[str(p.dtype)] = counts.get(str(p.dtype), 0) + p.numel()
    assert report["parameter_dtypes"] == dict(sorted(counts.items()))
    quantized = sorted(n for n, m in model.named_modules()
                       if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)))
    listed = sorted(m for mods in report["quantized_modules"].values() for m in mods)
    assert listed == quantized
    del model, torch


# ---- the 4-bit target ----------------------------------------------------------------------------

def test_bnb4_repack_writes_bitsandbytes_own_bytes(tmp_path):
    """Same format in, same format out: every tensor qconv writes, quant_state JSON included, is byte for
    byte what bitsandbytes wrote; changing storage dtype or dropping double quant keeps every value."""
    src = CHECKPOINTS / "llama-bnb4-nf4-dq"
    _convert(src, tmp_path / "same", "--to", "bnb4-nf4")
    original, same = load_tensors(src), load_tensors(tmp_path / "same")
    assert original.keys() == same.keys()
    assert all(torch.equal(original[k], same[k]) and original[k].dtype == same[k].dtype for k in original)
    _convert(src, tmp_path / "other", "--to", "bnb4-nf4", "--quant-storage", "bfloat16", "--no-double-quant")
    other = load_tensors(tmp_path / "other")
    assert other["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.up_proj.weight.nested_absmax" not in other
    for name in ("same", "other"):
        run_qconv("dequantize", "--dtype", "float16", tmp_path / name, tmp_path / f"{name}-deq", check=0)
    assert all(torch.equal(v, load_tensors(tmp_path / "same-deq")[k]) for k, v in load_tensors(tmp_path / "other-deq").items())
    # Run against the producer's own file in this process, not the stored oracle: on CPUs with
    # AVX512-BF16 Linear4bit runs a packed bf16 kernel (bitsandbytes/nn/modules.py, Linear4bit.forward),
    # elsewhere another; the same values give the same logits on either, so the bound is float32 noise.
    ids = load_file(src / "oracle" / "logits.safetensors")["input_ids"]
    _, theirs = _logits(src, ids)
    _, logits = _logits(tmp_path / "other", ids)
    assert ((logits - theirs).norm() / theirs.norm()).item() < 1e-5


def test_new_double_quantization_is_read_by_bitsandbytes_as_written(tmp_path):
    """qconv's own double quantization (for --double-quant on a source without it): bitsandbytes'
    QuantState.from_dict + dequantize_4bit on the written tensors gives what qconv reads back."""
    import bitsandbytes.functional as F
    from bitsandbytes.functional import QuantState, create_dynamic_map
    from qconv.formats.bnb.codec import DYNAMIC_MAP

    assert np.array_equal(DYNAMIC_MAP.view(np.uint32), create_dynamic_map(signed=True).numpy().view(np.uint32))
    out, deq = tmp_path / "dq", tmp_path / "deq"
    report = json.loads(_convert(CHECKPOINTS / "llama-bnb4-fp4", out, "--to", "bnb4-fp4", "--double-quant",
                                 "--json").stdout)["components"][0]
    assert all(r["reason"] == "block absmax gets double-quantized" for r in report["layers"])
    # The config says what the tensors hold (it used to say False beside nested tensors, and inspect
    # warned about its own output).
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bnb_4bit_use_double_quant"] is True
    assert inspect_json(out)["components"][0]["warnings"] == []
    run_qconv("dequantize", "--dtype", "float16", out, deq, check=0)
    written, ours = load_tensors(out), load_tensors(deq)
    for module in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj"):
        prefix = module + ".weight."
        state = {k[len(prefix):]: v for k, v in written.items() if k.startswith(prefix)}
        qs = QuantState.from_dict(state, device=torch.device("cpu"))
        assert qs.nested
        theirs = F.dequantize_4bit(written[module + ".weight"], qs)
        assert torch.equal(theirs, ours[module + ".weight"]), module
