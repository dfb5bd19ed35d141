"""A GGUF file as a source of convert and validate (formats/gguf/source.py, the "gguf" family): Q8_0,
Q4_0, Q5_0 and MXFP4 blocks keep their codes into every target, other block types (gguf-py's own Q5_1
here; llama.cpp's K-quants in tests/consumers/test_llamacpp.py) are requantized from their decoding with
the error reported, GGUF -> GGUF gives every tensor back byte for byte, and `qconv validate` pairs a Hugging
Face folder with a GGUF layer by layer. The GGUFs are qconv's own from the producers' fixtures (llama.cpp reads
and runs them: tests/consumers/test_llamacpp.py)."""

import json

import gguf
import numpy as np
import pytest

import torch
from safetensors.torch import load_file

from conftest import CHECKPOINTS, assert_same_tokenizer, gguf_hf_name, gguf_hf_rows, gguf_tensors, one_error, requantize_gguf, run_qconv, split_gguf


def gguf_of(src, path, *args):
    run_qconv("convert", CHECKPOINTS / src, path, "--to", "gguf", *args, check=0)
    return path


@pytest.mark.parametrize("src, args", [("llama-gptq-w4g64-asym", ()), ("llama-gptq-w8g128", ()),
                                       ("llama-ct-mxfp4", ()), ("llama-gptq-w3g128", ()),
                                       ("qwen3moe-fp8-block", ()), ("qwen2-autoround-w4g128", ()),
                                       ("qwen3moe-bf16", ("--gguf-float",)), ("qwen3vl-bnb8-skipvisual", ())])
def test_gguf_to_gguf_gives_every_tensor_back(tmp_path, src, args):
    """GGUF -> GGUF: every tensor the same type and the same bytes, the metadata the same (stacked MoE
    experts, llama's permuted q / k and Q5_0's 5-bit codes included)."""
    first = gguf_of(src, tmp_path / "a.gguf", *args)
    proc = run_qconv("convert", "--json", "--validate", first, tmp_path / "b.gguf", "--to", "gguf", *args, check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["requantized"] == 0 and comp["validation"]["ok"]
    assert gguf_tensors(first) == gguf_tensors(tmp_path / "b.gguf")
    a, b = gguf.GGUFReader(first), gguf.GGUFReader(tmp_path / "b.gguf")
    assert {k: f.contents() for k, f in a.fields.items()} == {k: f.contents() for k, f in b.fields.items()}


@pytest.mark.parametrize("src, target, bits", [("llama-gptq-w8g128", "gptq", 8), ("llama-ct-w4a16", "compressed-tensors", 4),
                                               ("llama-ct-mxfp4", "compressed-tensors-mxfp4", 4)])
def test_gguf_codes_are_kept_into_other_formats(tmp_path, src, target, bits):
    """A GGUF's Q8_0 / Q4_0 / MXFP4 blocks become the target's modules with their codes (groups of 32,
    d the scale), and the result computes what the producer's original folder computes: `qconv validate`
    of the two passes with no tolerance."""
    g = gguf_of(src, tmp_path / "m.gguf")
    proc = run_qconv("convert", "--json", g, tmp_path / "out", "--to", target, check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["from"] == "GGUF" and comp["codes_kept"] == comp["modules"] == 14 and comp["requantized"] == 0
    if target != "compressed-tensors-mxfp4":
        qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
        assert json.dumps(qc).count(f'"num_bits": {bits}') or qc.get("bits") == bits
    run_qconv("validate", CHECKPOINTS / src, tmp_path / "out", check=0)


def test_validate_pairs_a_folder_with_a_gguf(tmp_path):
    """`qconv validate SRC out.gguf`: layer by layer across the name map; equal where codes were kept
    (exit 0), a requantized file fails without --tol (exit 1) and passes with it."""
    kept = gguf_of("llama-gptq-w4g64-asym", tmp_path / "kept.gguf")
    proc = run_qconv("validate", "--json", CHECKPOINTS / "llama-gptq-w4g64-asym", kept, check=0)
    report = json.loads(proc.stdout)
    assert report["ok"] and len(report["layers"]) >= 14
    lossy = gguf_of("llama-gptq-w4g128-actorder", tmp_path / "lossy.gguf")
    run_qconv("validate", CHECKPOINTS / "llama-gptq-w4g128-actorder", lossy, check=1)
    run_qconv("validate", "--tol", "0.2", CHECKPOINTS / "llama-gptq-w4g128-actorder", lossy, check=0)


def test_float_offsets_gptq_cannot_hold_are_requantized_from_their_decoding(tmp_path):
    """A GGUF whose layer-1 Linears gguf-py's own quantizer wrote as Q5_1 (codes with a float minimum, which
    no integer zero point holds) and whose embeddings and lm_head are Q8_0 blocks: convert --to gptq keeps
    layer 0's Q8_0 codes, requantizes layer 1 from gguf-py's decoding (8-bit, groups of 32: Q5_1 is 6 bits a
    weight) and reports each layer's error, which is the error of the written weights against that
    decoding; the embeddings and lm_head become float16 tensors of their decoding, with a warning; the
    result validates, and GGUF -> GGUF gives the file back byte for byte."""
    src = gguf_of("llama-gptq-w8g128", tmp_path / "m.gguf", "--gguf-float-type", "q8_0")
    decoded = requantize_gguf(src, tmp_path / "q51.gguf", lambda name, kind: name.startswith("blk.1.") and kind == "Q8_0")
    assert len(decoded) == 7
    proc = run_qconv("convert", "--json", "--validate", tmp_path / "q51.gguf", tmp_path / "out", "--to", "gptq", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["codes_kept"] == 7 and comp["requantized"] == 7 and comp["validation"]["ok"]
    assert any("lm_head.weight: Q8_0, model.embed_tokens.weight: Q8_0" in w for w in comp["warnings"])
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"]) == (8, 32)
    run_qconv("dequantize", tmp_path / "out", tmp_path / "float", "--dtype", "float32", check=0)
    out = load_file(tmp_path / "float" / "model.safetensors")
    errors = {r["module"]: r for r in comp["layers"]}
    for name, ref in decoded.items():
        module = gguf_hf_name(name)
        assert errors[module]["reason"] == "float offsets (w = s * q + b) are not integer zero points; 5-bit codes become 8-bit"
        ref = gguf_hf_rows(name, ref.astype(np.float64))
        got = out[module + ".weight"].numpy().astype(np.float64)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert 0 < rel < 0.02 and rel == pytest.approx(errors[module]["rel_frobenius"], rel=1e-4, abs=1e-6), module
    reader = {t.name: t for t in gguf.GGUFReader(src).tensors}
    plain = load_file(tmp_path / "out" / "model.safetensors")
    for gname, hf in (("token_embd.weight", "model.embed_tokens.weight"), ("output.weight", "lm_head.weight")):
        t = reader[gname]
        assert t.tensor_type.name == "Q8_0"
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
        assert plain[hf].dtype == torch.float16 and np.array_equal(plain[hf].numpy(), want), hf
    run_qconv("convert", tmp_path / "q51.gguf", tmp_path / "back.gguf", "--to", "gguf", check=0)
    assert (tmp_path / "back.gguf").read_bytes() == (tmp_path / "q51.gguf").read_bytes()


def test_a_float_gguf_converts_as_its_float_folder(tmp_path):
    """llama's float q / k are stored in llama.cpp's rotary row order; read back in Hugging Face order, a
    float16 GGUF of llama-fp16 quantizes data-free to exactly the tensors the folder itself gives (its
    norms as llama.cpp stores them, float32, of the same values), and GGUF -> GGUF with --gguf-float gives
    it back byte for byte."""
    f16 = gguf_of("llama-fp16", tmp_path / "f16.gguf", "--gguf-float")
    run_qconv("convert", "--validate", f16, tmp_path / "from-gguf", "--to", "gptq", check=0)
    run_qconv("convert", CHECKPOINTS / "llama-fp16", tmp_path / "from-folder", "--to", "gptq", check=0)
    a = load_file(tmp_path / "from-gguf" / "model.safetensors")
    b = load_file(tmp_path / "from-folder" / "model.safetensors")
    assert set(a) == set(b)
    for name, t in b.items():
        if name.endswith("norm.weight"):
            assert a[name].dtype == torch.float32 and torch.equal(a[name], t.float()), name
        else:
            assert a[name].dtype == t.dtype and torch.equal(a[name], t), name
    run_qconv("convert", f16, tmp_path / "back.gguf", "--to", "gguf", "--gguf-float", check=0)
    assert (tmp_path / "back.gguf").read_bytes() == f16.read_bytes()


def test_a_split_gguf_converts_and_validates_as_its_unsplit_file(tmp_path):
    """llama.cpp's split files, given by the first: convert to gptq gives the tensors and config the unsplit
    file gives; GGUF -> GGUF writes the unsplit file's GGUF -> GGUF byte for byte (and split again, the
    same tensors); `qconv validate` pairs the split set with the producer's folder and with the unsplit file."""
    one, first = split_gguf("llama-gptq-w8g128", tmp_path)
    assert first.name == "m-00001-of-00003.gguf"
    for g, out in ((first, "gptq-split"), (one, "gptq-one")):
        run_qconv("convert", g, tmp_path / out, "--to", "gptq", check=0)
    a = load_file(tmp_path / "gptq-split" / "model.safetensors")
    b = load_file(tmp_path / "gptq-one" / "model.safetensors")
    assert set(a) == set(b)
    for name, t in b.items():
        assert a[name].dtype == t.dtype and torch.equal(a[name], t), name
    assert (tmp_path / "gptq-split" / "config.json").read_text() == (tmp_path / "gptq-one" / "config.json").read_text()
    run_qconv("convert", "--validate", first, tmp_path / "back-split.gguf", "--to", "gguf", check=0)
    run_qconv("convert", one, tmp_path / "back-one.gguf", "--to", "gguf", check=0)
    assert (tmp_path / "back-split.gguf").read_bytes() == (tmp_path / "back-one.gguf").read_bytes()
    proc = run_qconv("convert", "--json", first, tmp_path / "again.gguf", "--to", "gguf", "--max-shard-size", "1B",
                     check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    again = {k: v for f in comp["shards"] for k, v in gguf_tensors(tmp_path / f).items()}
    assert len(comp["shards"]) == 21 and again == gguf_tensors(one)
    report = json.loads(run_qconv("validate", "--json", CHECKPOINTS / "llama-gptq-w8g128", first, check=0).stdout)
    assert report["ok"] and len(report["layers"]) == 16
    report = json.loads(run_qconv("validate", "--json", first, one, check=0).stdout)
    assert report["ok"] and len(report["layers"]) >= 16


def test_a_split_gguf_is_never_overwritten_by_its_own_conversion(tmp_path):
    """DST whose split files would be the source's own (m.gguf -> m-0000i-of-0000N.gguf) is refused, even
    with --overwrite, and the source is left as it was."""
    _, first = split_gguf("llama-gptq-w8g128", tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("m-*.gguf")}
    one_error(run_qconv("convert", first, tmp_path / "m.gguf", "--to", "gguf", "--max-shard-size", "700KB",
                        "--overwrite"), 6, "m.gguf", "a file of the source")
    one_error(run_qconv("convert", first, tmp_path / "m-00002-of-00003.gguf", "--to", "gguf", "--overwrite"), 6,
              "a file of the source")
    assert {p.name: p.read_bytes() for p in tmp_path.glob("m-*.gguf")} == before


def test_a_folder_converted_from_a_gguf_carries_its_tokenizer(tmp_path):
    """convert GGUF -> folder writes tokenizer.json / tokenizer_config.json rebuilt from the metadata, as
    dequantize does: the folder's tokenizer gives the original fixture's ids, special tokens included."""
    g = gguf_of("llama-ct-w4a16", tmp_path / "m.gguf")
    proc = run_qconv("convert", "--json", g, tmp_path / "out", "--to", "gptq", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(comp["copied"])
    assert_same_tokenizer(tmp_path / "out", "llama-ct-w4a16")


def test_llama3_rope_factors_read_back_as_the_rope_scaling(tmp_path):
    """A llama GGUF's rope_freqs (llama-3's rope scaling) is read back as config.json's rope_parameters
    (llama-3.1's own numbers here: factor 8, low / high 1 / 4, an original context of 8192), which
    transformers turns into the same model: its logits from the folder dequantize writes equal those of
    the source folder's float model. GGUF -> GGUF keeps the factors byte for byte. Factors that are not
    llama-3's ramp are refused by name, nothing written."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    src = tmp_path / "llama3"
    shutil.copytree(CHECKPOINTS / "llama-gptq-w8g128", src)
    config = json.loads((src / "config.json").read_text())
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config["rope_parameters"] = rope
    (src / "config.json").write_text(json.dumps(config))
    run_qconv("convert", src, tmp_path / "m.gguf", "--to", "gguf", check=0)
    run_qconv("dequantize", tmp_path / "m.gguf", tmp_path / "back", check=0)
    run_qconv("dequantize", src, tmp_path / "direct", check=0)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"] == rope
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "direct", dtype=torch.float32)(ids).logits
    assert torch.equal(a, b)
    run_qconv("convert", "--validate", tmp_path / "m.gguf", tmp_path / "again.gguf", "--to", "gguf", check=0)
    assert gguf_tensors(tmp_path / "m.gguf") == gguf_tensors(tmp_path / "again.gguf")
    shutil.copy(tmp_path / "m.gguf", tmp_path / "bent.gguf")
    reader = gguf.GGUFReader(tmp_path / "bent.gguf", "r+")
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors.data[:] = np.linspace(1, 3, factors.data.size, dtype=np.float32)
    reader.data.flush()
    for verb in (("dequantize", tmp_path / "bent.gguf", tmp_path / "out"),
                 ("convert", tmp_path / "bent.gguf", tmp_path / "out", "--to", "gptq")):
        one_error(run_qconv(*verb), 5, "rope_freqs.weight", "llama-3's rope scaling")
        assert not (tmp_path / "out").exists()


def test_float_q_k_windows_read_only_their_heads_rows_in_hugging_face_order(tmp_path):
    """llama's float q / k in a GGUF, read a window of rows at a time (as dequantize, passthrough and validate
    read float weights): every window is the folder's own rows, though llama.cpp's rotary order interleaves
    them within each head."""
    from qconv.formats.gguf.source import open_gguf
    from qconv.formats.storage.tensor_io import read_array

    f16 = gguf_of("llama-fp16", tmp_path / "f16.gguf", "--gguf-float")
    comp = open_gguf(f16)
    folder = load_file(CHECKPOINTS / "llama-fp16" / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        info, want = comp.tensors[name], folder[name].numpy()
        n = info.shape[0]
        for r0, r1 in ((0, n), (0, 1), (3, 5), (n // 3, n // 2 + 7), (n - 1, n)):
            assert np.array_equal(read_array(info, rows=(r0, r1)), want[r0:r1]), (name, r0, r1)
