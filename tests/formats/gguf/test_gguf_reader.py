"""`qconv dequantize model.gguf DST`: a GGUF back as a Hugging Face folder that transformers loads. The
GGUFs are qconv's own from the producers' fixtures (llama.cpp's reader and runtime accept them:
tests/formats/gguf/test_gguf_writer.py, tests/consumers/test_llamacpp.py), and one written by gguf-py's own
quantizer; K-quant files made by llama.cpp's quantizer are read in tests/consumers/test_llamacpp.py."""

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import CHECKPOINTS, assert_same_tokenizer, one_error, requantize_gguf, run_qconv, split_gguf


def tensors(folder):
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def gguf_of(src, path, *args):
    run_qconv("convert", CHECKPOINTS / src, path, "--to", "gguf", *args, check=0)
    return path


@pytest.mark.parametrize("src", ["llama-gptq-w8g128", "llama-gptq-w4g64-asym", "llama-awq-w4g128",
                                 "llama-gptq-w3g128", "llama-ct-mxfp4", "llama-fp16", "qwen3moe-bf16",
                                 "qwen2-autoround-w4g128", "qwen3-autoround-w8g128"])
def test_a_code_kept_gguf_dequantizes_to_the_sources_float_model(tmp_path, src):
    """Through GGUF and back, every tensor has the values `qconv dequantize` gives for the source itself
    (the codes were kept, q / k rows are put back), the config holds the source's architecture, and
    transformers' logits of the two folders are equal."""
    args = ("--gguf-float",) if src in ("llama-fp16", "qwen3moe-bf16") else ()
    g = gguf_of(src, tmp_path / "m.gguf", *args)
    run_qconv("dequantize", g, tmp_path / "back", check=0)
    run_qconv("dequantize", CHECKPOINTS / src, tmp_path / "direct", check=0)
    back, direct = tensors(tmp_path / "back"), tensors(tmp_path / "direct")
    assert set(back) == set(direct)
    for name, t in direct.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    cfg_back = json.loads((tmp_path / "back" / "config.json").read_text())
    cfg_src = json.loads((CHECKPOINTS / src / "config.json").read_text())
    keys = ["model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings"]
    if cfg_src["model_type"] == "qwen3_moe":
        keys += ["num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"]
    elif cfg_src["model_type"] == "llama":
        keys += ["bos_token_id", "eos_token_id"]
    for cfg in (cfg_src, cfg_back):                   # qwen2's config has no head_dim: hidden / heads
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    for key in keys:
        assert cfg_back[key] == cfg_src[key], key
    assert cfg_back["rope_parameters"]["rope_theta"] == cfg_src["rope_parameters"]["rope_theta"]
    if src == "llama-gptq-w8g128":
        from transformers import AutoModelForCausalLM

        ids = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19]])
        with torch.no_grad():
            a = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)(ids).logits
            b = AutoModelForCausalLM.from_pretrained(tmp_path / "direct", dtype=torch.float32)(ids).logits
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, text_class", [("qwen3vl-bf16", "Qwen3ForCausalLM"),
                                              ("qwen25vl-bf16", "Qwen2ForCausalLM"),
                                              ("qwen3vlmoe-bf16", "Qwen3MoeForCausalLM")])
def test_a_vl_gguf_dequantizes_to_the_text_model_it_computes(tmp_path, name, text_class):
    """A qwen3vl / qwen2vl GGUF holds Qwen3-VL's / Qwen2.5-VL's text decoder (the vision tower is
    llama.cpp's mmproj file; with it beside, test_gguf_vl_pair.py): alone, dequantize writes it as the
    text model, saying so, and on text that model's
    logits are the VL model's own on the same weights (the mrope streams are equal for text; Qwen3-VL's
    deepstack adds image features only). The qwen3vl-bf16 fixture has no tokenizer, which a GGUF needs:
    the bnb8 fixture's (same base) is put beside a copy of it; --gguf-float keeps the bf16 weights as
    they are."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    src = tmp_path / name
    shutil.copytree(CHECKPOINTS / name, src)
    if not (src / "tokenizer.json").exists():
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(CHECKPOINTS / "qwen3vl-bnb8-skipvisual" / f, src / f)
    run_qconv("convert", src, tmp_path / "m.gguf", "--to", "gguf", "--gguf-float", "--no-mmproj", check=0)
    proc = run_qconv("dequantize", "--json", tmp_path / "m.gguf", tmp_path / "back", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["warnings"] and "VL model's text decoder" in comp["warnings"][0]
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["architectures"] == [text_class] and "mrope_section" not in cfg["rope_parameters"]
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]])
    with torch.no_grad():
        text = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)(ids).logits
        vl = AutoModelForImageTextToText.from_pretrained(CHECKPOINTS / name, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(text, vl, rtol=1e-5, atol=1e-5)


def test_the_tokenizer_comes_back(tmp_path):
    """tokenizer.json rebuilt from the GGUF's metadata gives the original tokenizer's ids, special tokens
    and unknown characters included."""
    g = gguf_of("llama-ct-w4a16", tmp_path / "m.gguf")
    run_qconv("dequantize", g, tmp_path / "back", check=0)
    assert_same_tokenizer(tmp_path / "back", "llama-ct-w4a16")


def test_other_ggml_types_decode_as_gguf_py_decodes_them(tmp_path):
    """A file whose Linears gguf-py's own quantizer wrote as Q5_1 (a type qconv never writes): each
    dequantized tensor is gguf-py's decoding of it, rows un-permuted."""
    src = gguf_of("llama-gptq-w8g128", tmp_path / "m.gguf")
    expected = requantize_gguf(src, tmp_path / "q51.gguf", lambda name, kind: kind == "Q8_0")
    run_qconv("dequantize", tmp_path / "q51.gguf", tmp_path / "back", "--dtype", "float32", check=0)
    back = tensors(tmp_path / "back")
    q = back["model.layers.0.self_attn.q_proj.weight"].numpy()
    ref = expected["blk.0.attn_q.weight"]
    rows = ref.shape[0]
    np.testing.assert_array_equal(q, ref.reshape(4, rows // 8, 2, -1).swapaxes(1, 2).reshape(ref.shape))
    np.testing.assert_array_equal(back["model.layers.1.mlp.down_proj.weight"].numpy(), expected["blk.1.ffn_down.weight"])


def test_bad_gguf_sources_are_refused_before_anything_is_written(tmp_path):
    src = gguf_of("llama-gptq-w8g128", tmp_path / "m.gguf")
    data = src.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    one_error(run_qconv("dequantize", tmp_path / "cut.gguf", tmp_path / "out1"), 4, "cut.gguf")
    # an architecture qconv does not map back: refused by name
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"]
    patched = bytearray(data)
    start = arch.parts[-1].ctypes.data - reader.data.ctypes.data
    patched[start:start + 5] = b"llamb"
    (tmp_path / "other.gguf").write_bytes(bytes(patched))
    one_error(run_qconv("dequantize", tmp_path / "other.gguf", tmp_path / "out2"), 5, "'llamb'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "m.gguf", "m.md", "other.gguf"]


def test_a_split_gguf_dequantizes_as_its_unsplit_file(tmp_path):
    """llama.cpp's split files, given by the first (as llama.cpp takes them): the folder holds the same
    tensors, config and tokenizer as the unsplit file's, byte for byte."""
    one, first = split_gguf("llama-gptq-w8g128", tmp_path, "1B")     # one tensor a file: 21 files
    assert first.name == "m-00001-of-00021.gguf"
    run_qconv("dequantize", first, tmp_path / "split", check=0)
    run_qconv("dequantize", one, tmp_path / "one", check=0)
    a, b = tensors(tmp_path / "split"), tensors(tmp_path / "one")
    assert set(a) == set(b) and len(a) == 21
    for name, t in b.items():
        assert a[name].dtype == t.dtype and torch.equal(a[name], t), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "split" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
