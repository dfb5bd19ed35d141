"""`qconv convert SRC out.gguf --to gguf`: the producers' checkpoints into llama.cpp's GGUF, each module's
codes kept in the block type the issue's table names, checked with llama.cpp's own reader and decoder
(gguf-py's GGUFReader and quants.dequantize, the reference for every ggml type) against qconv's
dequantization of the source module, which agrees bit for bit with each producer's (tests elsewhere)."""

import json

import gguf
import numpy as np
import pytest

from conftest import CHECKPOINTS, one_error, run_qconv

from qconv.formats.core.reader import model_dtype, read_module, require_decodable
from qconv.formats.storage.checkpoint import open_target

# The table, per fixture: (GGUF type of its Linears, codes kept). Mixed: auto-round's mixed8
# fixture keeps 8-bit codes in two modules.
KEPT = {
    "llama-gptq-w8g128": {"Q8_0"},                      # 8-bit sym: qs = q - 128
    "llama-autoround-w8g128": {"Q8_0"},
    "llama-ct-w8a16": {"Q8_0"},
    "llama-ct-w8a16-channel": {"Q8_0"},                 # one group per row: every block has the row's scale
    "llama-ct-w8a8": {"Q8_0"},
    "llama-ct-w4a16": {"Q4_0"},                         # 4-bit sym: nibble = q
    "llama-awq-w4g64-sym": {"Q4_0"},
    "llama-autoround-w4g128-mixed8": {"Q4_0", "Q8_0"},
    "llama-gptq-w4g64-asym": {"Q5_0"},                  # 4-bit asym: q5 = q - z + 16
    "llama-awq-w4g128": {"Q5_0"},
    "llama-ct-w4a16-asym": {"Q5_0"},
    "llama-gptq-w3g128": {"Q4_0"},                      # 2-, 3-bit: nibble = q - z + 8
    "llama-gptq-w2g128": {"Q4_0"},
    "llama-ct-w3a16": {"Q4_0"},
    "llama-ct-mxfp4": {"MXFP4"},                        # e2m1 codes and e8m0 exponents as they are
    "qwen2-autoround-w4g128": {"Q4_0"},                 # qwen2 (q / k / v biases), qwen3 (q / k norms):
    "qwen3-autoround-w8g128": {"Q8_0"},                 # no row permutation
}


def convert(src, dst, *args, check=0):
    proc = run_qconv("convert", "--json", CHECKPOINTS / src, dst, "--to", "gguf", *args, check=check)  # src: a name or a path
    return json.loads(proc.stdout)["components"][0] if check == 0 else proc


def unpermute(w, heads):
    """Hugging Face row order from llama.cpp's rotary order, written here from convert_hf_to_gguf's
    LlamaModel.permute (reshape(n_head, 2, rows / n_head / 2, ...).swapaxes(1, 2)), inverted."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_back(path, src):
    """{hf module: float32 weight} of every quantized tensor in the GGUF, decoded by gguf-py, rows in
    Hugging Face order; and {gguf name: ggml type name}."""
    config = json.loads((CHECKPOINTS / src / "config.json").read_text())
    reader = gguf.GGUFReader(path)
    llama = reader.fields["general.architecture"].contents() == "llama"      # only llama's rows are permuted
    out, types = {}, {}
    for t in reader.tensors:
        types[t.name] = t.tensor_type.name
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if llama and t.name.endswith("attn_q.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif llama and t.name.endswith("attn_k.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        out[t.name] = w
    return reader, out, types


def source_weights(src):
    comp = open_target(CHECKPOINTS / src).components[0]
    det = require_decodable(comp)
    dtype = model_dtype(comp, det)
    return {m.name: read_module(comp, det, m, dtype).dequantize() for m in det.modules}


@pytest.mark.parametrize("src", sorted(KEPT))
def test_codes_kept_decode_to_the_source(tmp_path, src):
    """Every Linear is written in its table's type with its codes kept, and llama.cpp's decoder gives back
    exactly the source's dequantized weight (no rounding anywhere: the scales are float16 already)."""
    comp = convert(src, tmp_path / "m.gguf")
    assert comp["codes_kept"] == comp["modules"] == 14 and comp["requantized"] == 0
    assert comp["scales_rounded"] == 0
    _, back, types = read_back(tmp_path / "m.gguf", src)
    kept = {e["tensor"]: e for e in comp["gguf_tensors"] if e["codes"] is not None}
    assert {types[t] for t in kept} == KEPT[src]
    ref = source_weights(src)
    assert len(kept) == len(ref) == 14
    for name, entry in kept.items():
        assert entry["codes"] == "kept"
        np.testing.assert_array_equal(back[name], ref[entry["source"]], err_msg=name)


def test_bnb8_keeps_codes_and_rounds_only_d(tmp_path):
    """LLM.int8: qs = CB, d = SCB / 127 in float16 (the table's only rounding): every weight is within
    the reported scale rounding of bitsandbytes' own (CB * SCB) / 127, and the rounding is said."""
    comp = convert("llama-bnb8", tmp_path / "m.gguf")
    assert comp["codes_kept"] == 14 and comp["scales_rounded"] > 0
    assert 0 < comp["max_scale_rel_error"] <= 2.0 ** -11
    _, back, types = read_back(tmp_path / "m.gguf", "llama-bnb8")
    ref = source_weights("llama-bnb8")
    for e in comp["gguf_tensors"]:
        if e["codes"]:
            assert types[e["tensor"]] == "Q8_0"
            w, r = back[e["tensor"]], ref[e["source"]]
            assert np.all(np.abs(w - r) <= comp["max_scale_rel_error"] * np.abs(r) * (1 + 1e-6) + 1e-30)
            # the codes themselves: CB, exactly (sign of every weight and its ratio to the row's d)
            assert np.array_equal(np.sign(w), np.sign(r))


def test_q4_1_keeps_codes_and_rounds_the_minimum(tmp_path):
    """--gguf-asym q4_1: nibble = q, m = -s z in float16: smaller than Q5_0, the minimum's rounding
    reported as scale rounding, every weight within it of the source."""
    comp = convert("llama-gptq-w4g64-asym", tmp_path / "m.gguf", "--gguf-asym", "q4_1")
    assert comp["codes_kept"] == 14 and comp["gguf_types"]["Q4_1"] == 14
    _, back, _ = read_back(tmp_path / "m.gguf", "llama-gptq-w4g64-asym")
    ref = source_weights("llama-gptq-w4g64-asym")
    worst = max(float(np.abs(back[e["tensor"]] - ref[e["source"]]).max()) for e in comp["gguf_tensors"] if e["codes"])
    assert 0 < worst < 1e-3
    assert (tmp_path / "m.gguf").stat().st_size < convert("llama-gptq-w4g64-asym", tmp_path / "q5.gguf")["bytes_written"]


@pytest.mark.parametrize("src, to, reason", [
    ("llama-gptq-w4g128-actorder", "Q4_0", "act-order groups split a 32-weight block"),
    ("llama-bnb4-nf4-dq", "Q4_0", "nf4 codes are not integers"),
    ("llama-fp8-block", "Q8_0", "e4m3 codes are not integers"),
    ("llama-fp16", "Q8_0", "float16 weights quantized data-free (no calibration data)"),
])
def test_what_cannot_be_kept_is_requantized_with_its_error(tmp_path, src, to, reason):
    """Sources whose codes no block holds are requantized from their exact weights to the type the table
    names, each layer's error reported (and below round-to-nearest's), and --validate reads the file back
    through gguf-py against the source within that error."""
    comp = convert(src, tmp_path / "m.gguf", "--validate")
    assert comp["requantized"] == comp["modules"] == 14 and comp["validation"]["ok"]
    assert {r["reason"] for r in comp["layers"]} == {reason}
    assert {r["to"] for r in comp["layers"]} == {to}
    assert all(0 < r["rel_frobenius"] <= r["rtn_rel_frobenius"] < 0.3 for r in comp["layers"])


def test_bits_request(tmp_path):
    """--bits 8 requantizes 4-bit codes to Q8_0 and says why; MXFP4 keeps its own type whatever --bits."""
    comp = convert("llama-ct-w4a16", tmp_path / "q8.gguf", "--bits", "8")
    assert comp["requantized"] == 14 and set(comp["gguf_types"]) == {"Q8_0", "F16", "F32"}
    assert {r["reason"] for r in comp["layers"]} == {"4-bit codes become 8-bit (--bits 8)"}
    comp = convert("llama-ct-mxfp4", tmp_path / "mx.gguf", "--bits", "4")
    assert comp["codes_kept"] == 14 and comp["gguf_types"]["MXFP4"] == 14


def test_float_options(tmp_path):
    """A float model: --bits 4 gives Q4_0; --gguf-float keeps every Linear as the model's float16, byte
    for byte the source's values."""
    comp = convert("llama-fp16", tmp_path / "q4.gguf", "--bits", "4")
    assert set(comp["gguf_types"]) == {"Q4_0", "F16", "F32"}
    comp = convert("llama-fp16", tmp_path / "f.gguf", "--gguf-float")
    assert set(comp["gguf_types"]) == {"F16", "F32"} and comp["requantized"] == 0
    _, back, _ = read_back(tmp_path / "f.gguf", "llama-fp16")
    from safetensors.numpy import load_file

    src = load_file(CHECKPOINTS / "llama-fp16" / "model.safetensors")
    np.testing.assert_array_equal(back["blk.1.attn_q.weight"], src["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(back["token_embd.weight"], src["model.embed_tokens.weight"])
    np.testing.assert_array_equal(back["output_norm.weight"], src["model.norm.weight"])


def test_metadata_is_what_llama_cpp_reads(tmp_path):
    """Hyperparameters from config.json, the tokenizer from tokenizer.json padded to vocab_size, as
    convert_hf_to_gguf writes them."""
    convert("llama-gptq-w8g128", tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")

    def value(key):
        return reader.fields[key].contents()

    config = json.loads((CHECKPOINTS / "llama-gptq-w8g128" / "config.json").read_text())
    tok = json.loads((CHECKPOINTS / "llama-gptq-w8g128" / "tokenizer.json").read_text())
    assert value("general.architecture") == "llama"
    assert value("llama.block_count") == config["num_hidden_layers"]
    assert value("llama.attention.head_count_kv") == config["num_key_value_heads"]
    assert value("llama.rope.freq_base") == config["rope_parameters"]["rope_theta"]
    assert value("general.file_type") == 7                       # LLAMA_FTYPE_MOSTLY_Q8_0
    tokens = value("tokenizer.ggml.tokens")
    assert len(tokens) == config["vocab_size"] == 512
    assert tokens[:len(tok["model"]["vocab"])] == sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    assert tokens[-1] == "[PAD511]" and value("tokenizer.ggml.token_type")[-1] == 5
    assert value("tokenizer.ggml.model") == "gpt2" and value("tokenizer.ggml.pre") == "gpt-2"
    assert value("tokenizer.ggml.bos_token_id") == 1 and value("tokenizer.ggml.eos_token_id") == 2
    assert len(value("tokenizer.ggml.merges")) == len(tok["model"]["merges"])


def test_output_is_deterministic(tmp_path):
    convert("llama-gptq-w4g64-asym", tmp_path / "a.gguf")
    convert("llama-gptq-w4g64-asym", tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


@pytest.mark.parametrize("src", ["llama-gptq-w4g64-asym", "qwen3moe-fp8-block"])
def test_the_same_bytes_whatever_jobs(tmp_path, src):
    """--jobs N makes the quantized modules in N threads ahead of the writer: the file and the summary
    (requantized errors included) are the same as one thread's."""
    one = convert(src, tmp_path / "a.gguf", "--jobs", "1")
    many = convert(src, tmp_path / "b.gguf", "--jobs", "3")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert one.pop("shards") == ["a.gguf"] and many.pop("shards") == ["b.gguf"]
    assert one == many


def test_split_files(tmp_path):
    """Past --max-shard-size, llama.cpp's split files (-00001-of-0000N.gguf), each a GGUF with its split
    keys, every tensor in one of them."""
    comp = convert("llama-gptq-w8g128", tmp_path / "m.gguf", "--max-shard-size", "400KB")
    files = sorted(p.name for p in tmp_path.iterdir() if p.name != "m.md")         # the split set's one model card
    assert files == comp["shards"] and len(files) > 1 and files[0] == f"m-00001-of-{len(files):05d}.gguf"
    card = (tmp_path / "m.md").read_text()
    assert all(f"| `output/{f}` |" in card for f in files)
    names = [t.name for f in files for t in gguf.GGUFReader(tmp_path / f).tensors]
    assert len(names) == len(set(names)) == comp["tensors"]


def test_moe_experts_are_stacked_as_llama_cpp_stacks_them(tmp_path):
    """Qwen3-MoE: each layer's experts in one ffn_{gate,up,down}_exps tensor [experts, out, in], expert by
    expert in order; transformers' fused layout (gate_up_proj split into gate and up, as its conversion
    mapping does) gives the same tensors as its per-expert layout, FP8 requantized to Q8_0 with its error
    reported per expert, and --validate reads every expert back."""
    per = convert("qwen3moe-fp8-block", tmp_path / "per.gguf", "--validate")
    fused = convert("qwen3moe-fp8-block-fused", tmp_path / "fused.gguf", "--validate")
    assert per["validation"]["ok"] and fused["validation"]["ok"]
    assert per["requantized"] == fused["requantized"] == 2 * (4 + 3 * 4)      # 2 layers: q, k, v, o + 3 x 4 experts
    assert {r["reason"] for r in per["layers"]} == {"e4m3 codes are not integers"}
    stacked = [e for e in per["gguf_tensors"] if e.get("experts")]
    assert sorted(e["tensor"] for e in stacked) == sorted(f"blk.{i}.ffn_{p}_exps.weight" for i in range(2)
                                                          for p in ("gate", "up", "down"))
    assert all(e["experts"] == 4 and e["type"] == "Q8_0" for e in stacked)
    a, b = gguf.GGUFReader(tmp_path / "per.gguf"), gguf.GGUFReader(tmp_path / "fused.gguf")
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert np.array_equal(np.asarray(x.data), np.asarray(y.data)), x.name
    gate = next(t for t in a.tensors if t.name == "blk.1.ffn_gate_exps.weight")
    assert list(gate.shape) == [256, 128, 4]                   # GGUF order: in, out, experts
    assert next(t for t in a.tensors if t.name == "blk.0.ffn_gate_inp.weight").tensor_type.name == "F32"
    assert a.fields["qwen3moe.expert_count"].contents() == 4
    assert a.fields["qwen3moe.expert_used_count"].contents() == 2
    assert a.fields["qwen3moe.expert_feed_forward_length"].contents() == 128


def test_a_vl_models_text_decoder_is_written_as_llama_cpps_vl_architecture(tmp_path):
    """Qwen3-VL: the text decoder as llama.cpp's qwen3vl (what its converter's Qwen3VLTextModel writes:
    the text_config's hyperparameters, the mrope sections padded to 4, the deepstack layer count), its
    LLM.int8 codes kept as Q8_0 (d = SCB / 127 rounded to float16, reported), and the vision tower
    (quantized too by transformers 5, as in the user's seed) not in this file: llama.cpp reads it from the
    mmproj file written beside it (test_gguf_mmproj.py)."""
    src = "qwen3vl-bnb8-skipvisual"
    comp = convert(src, tmp_path / "m.gguf", "--validate")
    assert comp["validation"]["ok"] and comp["codes_kept"] == comp["modules"] == 14 and comp["requantized"] == 0
    assert 0 < comp["max_scale_rel_error"] <= 2.0 ** -11
    config = json.loads((CHECKPOINTS / src / "config.json").read_text())
    text = config["text_config"]
    reader, back, types = read_back(tmp_path / "m.gguf", src)

    def value(key):
        return reader.fields[key].contents()

    assert value("general.architecture") == "qwen3vl"
    assert value("qwen3vl.rope.dimension_sections") == text["rope_parameters"]["mrope_section"] + [0]
    assert value("qwen3vl.n_deepstack_layers") == len(config["vision_config"]["deepstack_visual_indexes"])
    assert value("qwen3vl.rope.freq_base") == text["rope_parameters"]["rope_theta"]
    assert value("qwen3vl.block_count") == text["num_hidden_layers"]
    assert value("qwen3vl.embedding_length") == text["hidden_size"]
    header = json.loads((CHECKPOINTS / src / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (CHECKPOINTS / src / "model.safetensors").read_bytes()[:8], "little")])
    vision = [n for n in header if n.startswith("model.visual.")]
    assert len(vision) > 0 and comp["warnings"] == [] and comp["mmproj"]["file"] == "mmproj-m.gguf"
    assert not any("visual" in e["source"] or "merger" in e["source"] for e in comp["gguf_tensors"])
    assert len(reader.tensors) == 25                  # 2 layers x 11 + token_embd, output_norm, output
    from safetensors.torch import load_file

    raw = {k: v.float().numpy() for k, v in load_file(CHECKPOINTS / src / "model.safetensors").items()}
    for entry in comp["gguf_tensors"]:
        if entry["codes"] is None:
            continue
        assert entry["codes"] == "kept" and types[entry["tensor"]] == "Q8_0"
        assert entry["source"].startswith("model.language_model.layers.")
        cb = raw[entry["source"] + ".weight"].astype(np.float64)            # bitsandbytes' own CB * SCB / 127
        scb = raw[entry["source"] + ".SCB"].astype(np.float64)[:, None]
        w = cb * scb / 127
        got = back[entry["tensor"]].astype(np.float64)
        assert np.all(np.abs(got - w) <= comp["max_scale_rel_error"] * np.abs(w) * (1 + 1e-6))
        assert np.array_equal(np.sign(got), np.sign(cb))


def test_llama3_rope_scaling_is_written_as_llama_cpps_rope_factors(tmp_path):
    """llama-3's rope scaling (rope_type llama3) becomes llama.cpp's rope_freqs tensor (what
    LlamaModel.generate_extra_tensors writes): one factor per frequency pair, by which llama.cpp divides
    the frequency, so each factor is transformers' default frequency over its llama-3 one (its own
    ROPE_INIT_FUNCTIONS["llama3"]), within float32 rounding; --validate checks it; a rope type qconv
    does not map is refused by name. llama.cpp's run of such a file: tests/consumers/test_llamacpp.py."""
    import shutil

    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    src = tmp_path / "llama3"
    shutil.copytree(CHECKPOINTS / "llama-gptq-w8g128", src)
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (src / "config.json").write_text(json.dumps(config))
    comp = convert(src, tmp_path / "m.gguf", "--validate")
    assert comp["validation"]["ok"]
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert factors.tensor_type.name == "F32"
    hf = AutoConfig.from_pretrained(src)
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    expected = (default / llama3).numpy()
    assert factors.data.shape == expected.shape == (config["head_dim"] // 2,)
    assert 1.0 in factors.data and 8.0 in factors.data and ((factors.data > 1) & (factors.data < 8)).any()
    np.testing.assert_allclose(factors.data, expected, rtol=1e-6)
    assert reader.fields["llama.rope.freq_base"].contents() == 500000.0
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64}
    (src / "config.json").write_text(json.dumps(config))
    one_error(convert(src, tmp_path / "y.gguf", check=5), 5, "rope type 'yarn'", "nothing written")
    assert not (tmp_path / "y.gguf").exists()


def test_qwen25_vls_text_decoder_is_llama_cpps_qwen2vl(tmp_path):
    """Qwen2.5-VL (saved by transformers 5 under its original names: model.layers.*, visual.*): the text
    decoder as llama.cpp's qwen2vl (Qwen2VLModel: the text_config's hyperparameters and the mrope
    sections; no deepstack), q / k / v biases F32, the vision tower in the mmproj file beside it; float
    weights kept with --gguf-float, and quantized data-free (errors reported) without it."""
    src = "qwen25vl-bf16"
    comp = convert(src, tmp_path / "m.gguf", "--gguf-float", "--validate")
    assert comp["validation"]["ok"]
    text = json.loads((CHECKPOINTS / src / "config.json").read_text())["text_config"]
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "qwen2vl"
    assert fields["qwen2vl.rope.dimension_sections"] == text["rope_parameters"]["mrope_section"] + [0]
    assert fields["qwen2vl.rope.freq_base"] == text["rope_parameters"]["rope_theta"]
    assert "qwen2vl.n_deepstack_layers" not in fields
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.bias"] == types["blk.1.attn_v.bias"] == "F32"
    assert types["blk.0.attn_q.weight"] == "BF16" and len(types) == 27       # 2 x 12 + 3
    assert comp["warnings"] == [] and comp["mmproj"]["projector"] == "qwen2.5vl_merger"
    quantized = convert(src, tmp_path / "q.gguf", "--validate")
    assert quantized["requantized"] == quantized["modules"] == 14 and quantized["validation"]["ok"]


def _gptoss_experts(folder):
    """{(layer, "gate" | "up" | "down"): float32 [E, out, in]} of a gpt-oss-layout folder's fused experts,
    gate and up taken from gate_up's even and odd rows (what GptOssExperts reads as gate and up)."""
    import torch
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    out = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = tensors[p + "gate_up_proj"].to(torch.float32).numpy()
        out[layer, "gate"], out[layer, "up"] = gate_up[:, 0::2], gate_up[:, 1::2]
        out[layer, "down"] = tensors[p + "down_proj"].to(torch.float32).numpy()
    return out


def test_gpt_oss_mxfp4_experts_keep_their_codes(tmp_path):
    """gpt-oss' MXFP4 experts (fused gate_up with gate and up rows INTERLEAVED) into llama.cpp's stacked
    qwen3moe experts: the de-interleave is a permutation of output rows, each row's 32-blocks run along
    the input, so every e2m1 code and e8m0 exponent is kept. llama.cpp's decoder gives back, expert by
    expert, exactly what `qconv dequantize` gives for its even (gate) / odd (up) rows and down_proj, and
    exactly the fixture's oracle (transformers' own convert_moe_packed_tensors); the zero expert biases
    (qwen3moe has none) are left out; GGUF -> GGUF gives every tensor back byte for byte."""
    src = "qwen3moe-mxfp4-gptoss"
    comp = convert(src, tmp_path / "m.gguf", "--validate")
    assert comp["validation"]["ok"] and comp["validation"]["layers"] == 2 * 3 * 4 + 21
    assert comp["codes_kept"] == comp["modules"] == 2 * 3 * 4 and comp["requantized"] == 0
    assert comp["scales_rounded"] == 0 and comp["max_scale_rel_error"] == 0
    stacked = {e["tensor"]: e for e in comp["gguf_tensors"] if e.get("experts")}
    assert sorted(stacked) == sorted(f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down"))
    assert all(e["type"] == "MXFP4" and e["codes"] == "kept" and e["experts"] == 4 for e in stacked.values())
    assert not any("bias" in e["source"] for e in comp["gguf_tensors"])
    _, back, types = read_back(tmp_path / "m.gguf", src)
    assert {types[t] for t in stacked} == {"MXFP4"}
    run_qconv("dequantize", CHECKPOINTS / src, tmp_path / "deq", check=0)
    ours = _gptoss_experts(tmp_path / "deq")
    oracle = _gptoss_experts(CHECKPOINTS / src / "oracle")
    for (layer, proj), w in ours.items():
        got = back[f"blk.{layer}.ffn_{proj}_exps.weight"]
        assert got.shape == w.shape == (4, 256 if proj == "down" else 128, 128 if proj == "down" else 256)
        for e in range(4):
            np.testing.assert_array_equal(got[e], w[e], err_msg=f"layer {layer} {proj} expert {e}")
            np.testing.assert_array_equal(got[e], oracle[layer, proj][e], err_msg=f"layer {layer} {proj} expert {e}")
    # the gate / up halves are not each other's (a wrong row parity would be caught)
    assert not np.array_equal(back["blk.0.ffn_gate_exps.weight"], back["blk.0.ffn_up_exps.weight"])
    proc = run_qconv("convert", "--json", "--validate", tmp_path / "m.gguf", tmp_path / "b.gguf", "--to", "gguf",
                     check=0)
    (again,) = json.loads(proc.stdout)["components"]
    assert again["requantized"] == 0 and again["validation"]["ok"]
    a, b = gguf.GGUFReader(tmp_path / "m.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    assert [(t.name, t.tensor_type) for t in a.tensors] == [(t.name, t.tensor_type) for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert np.asarray(x.data).tobytes() == np.asarray(y.data).tobytes(), x.name


def test_gpt_oss_nonzero_expert_biases_are_refused(tmp_path):
    """llama.cpp's qwen3moe has no expert biases: a gpt-oss-layout source whose biases are not all zero
    is refused naming the bias, never written without it (the fixture with one bias made nonzero)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(CHECKPOINTS / "qwen3moe-mxfp4-gptoss", src, ignore=shutil.ignore_patterns("oracle"))
    for p in [src, *src.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_bias"][2, 7] = torch.tensor(0.5, dtype=torch.bfloat16)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    proc = run_qconv("convert", src, tmp_path / "m.gguf", "--to", "gguf", check=5)
    one_error(proc, 5, "nonzero expert biases", "model.layers.1.mlp.experts.down_proj_bias")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("src, needles", [
    ("qwen3vl-bf16", ("has no tokenizer.json", "nothing written")),      # llama.cpp's GGUF needs one
    ("pipeline-qwen3vl-bnb8", ("give its folder", "pipeline-qwen3vl-bnb8/text_encoder")),
])
def test_what_a_gguf_cannot_be_written_from_is_refused(tmp_path, src, needles):
    proc = convert(src, tmp_path / "m.gguf", check=5)
    one_error(proc, 5, *needles)
    assert list(tmp_path.iterdir()) == []


def test_destination_rules(tmp_path):
    one_error(convert("llama-gptq-w8g128", tmp_path / "m", check=2), 2, ".gguf")
    (tmp_path / "m.gguf").write_bytes(b"keep")
    one_error(convert("llama-gptq-w8g128", tmp_path / "m.gguf", check=6), 6, "--overwrite")
    assert (tmp_path / "m.gguf").read_bytes() == b"keep"
    convert("llama-gptq-w8g128", tmp_path / "m.gguf", "--overwrite")
    assert gguf.GGUFReader(tmp_path / "m.gguf").tensors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.md"]   # and its card; no temporary folder


def test_validate_catches_a_wrong_row_order(tmp_path, monkeypatch):
    """Negative control: with llama's q / k permutation left out, --validate (which reads the file back
    through gguf-py and undoes the permutation) fails and nothing is written."""
    from qconv.formats.gguf import writer as to_gguf
    from qconv.convert.convert import convert as convert_to_gguf   # the engine, through the GGUF sink
    from qconv.errors import ValidationFailed

    monkeypatch.setattr(to_gguf.codec, "permute_rows", lambda blocks, heads: blocks)
    from qconv.convert.convert import Options

    with pytest.raises(ValidationFailed, match=r"attn_[qk]\.weight"):
        convert_to_gguf(CHECKPOINTS / "llama-gptq-w8g128", tmp_path / "m.gguf", Options("gguf"), validate=True)
    assert list(tmp_path.iterdir()) == []


def source_tensors(src):
    """{Hugging Face tensor name: torch tensor} of a fixture, read with safetensors' own torch reader."""
    from safetensors import safe_open

    out = {}
    for f in sorted((CHECKPOINTS / src).glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out |= {k: s.get_tensor(k) for k in s.keys()}
    return out


def hf_rows(data, name, llama, config):
    """A tensor read from the GGUF with llama's q / k rows back in Hugging Face order."""
    if llama and name.endswith(("attn_q.weight", "attn_k.weight")):
        return unpermute(data, config["num_attention_heads" if "attn_q" in name else "num_key_value_heads"])
    return data


FLOAT_TYPE_CASES = [
    ("llama-gptq-w8g128", "f32", ()),                  # BF16 embeddings, lm_head; Linears kept as Q8_0
    ("llama-gptq-w8g128", "f16", ()),
    ("llama-gptq-w8g128", "bf16", ()),
    ("llama-fp16", "f32", ("--gguf-float",)),          # F16 model, every Linear float (llama's q / k permuted)
    ("llama-fp16", "bf16", ("--gguf-float",)),
    ("qwen3moe-bf16", "f16", ("--gguf-float",)),       # BF16 model: some values below float16's normal range
]


@pytest.mark.parametrize("src, kind, extra", FLOAT_TYPE_CASES, ids=[f"{s}-{k}" for s, k, _ in FLOAT_TYPE_CASES])
def test_float_type_converts_the_2d_float_tensors(tmp_path, src, kind, extra):
    """--gguf-float-type f32 / f16 / bf16: embeddings, lm_head and --gguf-float's modules are stored in that
    type, their values as torch converts the source's (f32: the same values; bf16 of bf16: the same bits;
    f16: numpy's float16 rounding); what is not exact is counted in the summary; norms, biases and the
    router stay F32; kept codes are untouched; --validate passes."""
    import torch

    comp = convert(src, tmp_path / "m.gguf", "--gguf-float-type", kind, "--validate", *extra)
    assert comp["validation"]["ok"]
    config = json.loads((CHECKPOINTS / src / "config.json").read_text())
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    llama = reader.fields["general.architecture"].contents() == "llama"
    stored = {t.name: t for t in reader.tensors}
    tensors = source_tensors(src)
    ggml = {"f32": "F32", "f16": "F16", "bf16": "BF16"}[kind]
    floats = 0
    for e in comp["gguf_tensors"]:
        t = stored[e["tensor"]]
        if e["codes"] == "kept":
            assert t.tensor_type.name == "Q8_0"
            continue
        one_d = len(t.shape) == 1 or e["tensor"].endswith("_norm.weight") or ".ffn_gate_inp." in e["tensor"]
        if one_d:
            assert t.tensor_type.name == "F32", e
            continue
        assert t.tensor_type.name == ggml, e
        floats += 1
        names = [e["source"].format(i) for i in range(e["experts"])] if e.get("experts") else [e["source"]]
        source = torch.stack([tensors[n if n in tensors else n + ".weight"] for n in names])
        raw = np.asarray(t.data).view(np.uint16) if t.tensor_type.name == "BF16" else np.asarray(t.data)
        got = hf_rows(raw, t.name, llama, config).reshape(source.shape)
        x = source.float().numpy()
        if kind == "f32":
            want = x
        elif kind == "f16":
            want = x.astype(np.float16)
        else:
            want = source.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            if source.dtype == torch.bfloat16:           # bf16 of bf16: the source's own bytes
                assert got.tobytes() == source.view(torch.int16).numpy().tobytes(), e
        np.testing.assert_array_equal(got, want, err_msg=e["tensor"])
        back = hf_rows(gguf.quants.dequantize(t.data, t.tensor_type), t.name, llama, config).reshape(-1)
        changed = back != x.reshape(-1)
        note = e.get("rounded")
        assert (note["values"] if note else 0) == int(changed.sum()), e
        if note:
            xs = x.reshape(-1)[changed].astype(np.float64)
            rel = np.abs(back[changed] - xs) / np.abs(xs)
            assert note["to"] == ggml and note["max_rel_error"] == pytest.approx(float(rel.max()), rel=1e-6)
    assert floats == (16 if extra else 2)          # 2 layers x (q, k, v, o + gate, up, down), embeddings, lm_head
    if (src, kind) in (("llama-fp16", "bf16"), ("qwen3moe-bf16", "f16")):  # these do round: said, never silent
        assert comp["float_rounded"] and all(r["values"] > 0 for r in comp["float_rounded"])
    if kind == "f32" or (src, kind) == ("llama-gptq-w8g128", "bf16"):
        assert comp["float_rounded"] == []



@pytest.mark.parametrize("src, extra", [("llama-gptq-w8g128", ()), ("llama-gptq-w4g128-actorder", ("--gguf-float",))])
def test_float_type_auto_is_the_default(tmp_path, src, extra):
    """--gguf-float-type auto writes the same bytes as no option (the model's dtype, as before)."""
    convert(src, tmp_path / "a.gguf", *extra)
    convert(src, tmp_path / "b.gguf", "--gguf-float-type", "auto", *extra)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_float_type_q8_0_requantizes_with_its_error(tmp_path):
    """--gguf-float-type q8_0: embeddings and lm_head (and with --gguf-float every Linear of a float model,
    llama's q / k rows permuted) are requantized to Q8_0, each one's error reported as every requantized
    layer's is: what gguf-py decodes from the file has exactly that error against the source."""
    import torch

    comp = convert("llama-gptq-w8g128", tmp_path / "e.gguf", "--gguf-float-type", "q8_0", "--validate")
    assert comp["validation"]["ok"] and comp["codes_kept"] == 14 and comp["requantized"] == 2
    assert {r["module"] for r in comp["layers"]} == {"model.embed_tokens.weight", "lm_head.weight"}
    assert comp["gguf_types"] == {"Q8_0": 16, "F32": 5}
    comp = convert("llama-fp16", tmp_path / "f.gguf", "--gguf-float", "--gguf-float-type", "q8_0", "--validate")
    assert comp["validation"]["ok"] and comp["requantized"] == comp["modules"] == 16
    assert set(comp["gguf_types"]) == {"Q8_0", "F32"}
    _, back, types = read_back(tmp_path / "f.gguf", "llama-fp16")
    tensors = source_tensors("llama-fp16")
    names = {e["source"]: e["tensor"] for e in comp["gguf_tensors"]}
    for r in comp["layers"]:
        src = tensors[r["module"] if r["module"] in tensors else r["module"] + ".weight"].to(torch.float32).numpy()
        w = back[names[r["module"]]].reshape(src.shape).astype(np.float64)
        rel = np.linalg.norm(w - src) / np.linalg.norm(src)
        assert rel == pytest.approx(r["rel_frobenius"], rel=1e-4, abs=1e-6), r["module"]
        assert 0 < r["rel_frobenius"] <= r["rtn_rel_frobenius"] < 0.02


def test_float_type_refuses_a_value_float16_cannot_hold(tmp_path):
    """A finite value past float16's 65504 (one BF16 embedding value set to 99840 in a copy of a real
    checkpoint) is refused with f16 in one line naming the tensor, nothing written; bf16 and f32 hold it,
    and so does auto (the model's BF16)."""
    import shutil
    import struct

    src = tmp_path / "src"
    shutil.copytree(CHECKPOINTS / "llama-gptq-w8g128", src)
    path = src / "model.safetensors"
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    info = json.loads(raw[8:8 + n])["model.embed_tokens.weight"]
    assert info["dtype"] == "BF16"
    at = 8 + n + info["data_offsets"][0] + 2 * 1000
    raw[at:at + 2] = struct.pack("<H", 0x47C3)                    # BF16 bits of 99840
    path.write_bytes(bytes(raw))
    out = tmp_path / "out"
    out.mkdir()
    proc = run_qconv("convert", src, out / "m.gguf", "--to", "gguf", "--gguf-float-type", "f16", check=5)
    one_error(proc, 5, "model.embed_tokens.weight", "99840", "F16", "--gguf-float-type bf16 or f32")
    assert list(out.iterdir()) == []
    for kind in ("bf16", "f32", "auto"):
        proc = run_qconv("convert", "--json", src, out / f"{kind}.gguf", "--to", "gguf", "--gguf-float-type", kind,
                         "--validate", check=0)
        assert json.loads(proc.stdout)["components"][0]["validation"]["ok"]
        t = next(t for t in gguf.GGUFReader(out / f"{kind}.gguf").tensors if t.name == "token_embd.weight")
        assert gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)[1000] == 99840.0


def test_validate_catches_a_wrong_float_conversion(tmp_path, monkeypatch):
    """Negative controls: BF16 written by truncation instead of round-to-nearest-even, and a Q8_0 embedding
    whose reported error is half its real one, each fail --validate, naming the tensor; nothing written."""
    import dataclasses

    from qconv.formats.gguf import writer as to_gguf
    from qconv.convert.convert import convert as convert_to_gguf   # the engine, through the GGUF sink
    from qconv.convert.convert import Options
    from qconv.errors import ValidationFailed

    with monkeypatch.context() as m:
        m.setattr(to_gguf.Rounding, "encode",
                  lambda self, x32: (np.ascontiguousarray(x32, np.float32).view(np.uint32) >> 16).astype(np.uint16))
        with pytest.raises(ValidationFailed, match=r"weight .*does not read back as the source"):
            convert_to_gguf(CHECKPOINTS / "llama-fp16", tmp_path / "m.gguf",
                                    Options("gguf", gguf_float_type="bf16"), validate=True)
    assert list(tmp_path.iterdir()) == []
    real = to_gguf.requantize

    def under_reported(*args, **kwargs):
        qt, err = real(*args, **kwargs)
        return qt, dataclasses.replace(err, rel_frobenius=err.rel_frobenius / 2)

    monkeypatch.setattr(to_gguf, "requantize", under_reported)
    with pytest.raises(ValidationFailed, match=r"(token_embd|output)\.weight .*relative error"):
        convert_to_gguf(CHECKPOINTS / "llama-gptq-w8g128", tmp_path / "m.gguf",
                                Options("gguf", gguf_float_type="q8_0"), validate=True)
    assert list(tmp_path.iterdir()) == []


def test_float_type_is_one_of_the_choices(tmp_path):
    import qconv
    from qconv.errors import UsageError

    with pytest.raises(UsageError, match="gguf_float_type"):
        qconv.convert(CHECKPOINTS / "llama-fp16", tmp_path / "m.gguf", to="gguf", gguf_float_type="f8")
    proc = convert("llama-fp16", tmp_path / "m.gguf", "--gguf-float-type", "fp16", check=2)
    assert "--gguf-float-type" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
