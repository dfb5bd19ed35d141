"""llama.cpp itself (llama-cpp-python 0.3.36 in .venv-llamacpp, built for a generic CPU by `bin/setup
llamacpp`) as the consumer of `qconv convert --to gguf`: every GGUF qconv writes from the fixtures loads
and runs, and its next-token log-probabilities agree with those transformers computes from the float
model qconv dequantizes from the same source (where codes are kept), or from the GGUF itself (`qconv
dequantize out.gguf`, where modules were requantized and so the file holds another model) (tests/consumers/llamacpp_logits.py runs llama.cpp, each
file in a subprocess of its own, so a crash is told from a wrong answer).

Why the bounds. llama.cpp's CPU matmuls quantize activations to 8-bit blocks for every quantized weight
type (Q8_0's vec_dot pairs), which the float run does not, so this is not an allclose. Measured on the
tiny fixtures (2 layers, vocab 512, 12 positions, log-probabilities over the float run's top 5 tokens;
llama.cpp is deterministic here, the same numbers on every rerun): code-kept files differ from their float
model by 0.012 to 0.046 (Q4_1's float16 minimum the largest; llama, qwen2, qwen3), requantized ones
(qwen3-moe included) from theirs by 0.012 to 0.019, 0.040 with the embeddings and lm_head in Q8_0 too
(--gguf-float-type q8_0), float GGUFs by 0.0004 (F32) to 0.0044, gpt-oss-layout MXFP4
experts kept (qwen3moe-mxfp4-gptoss, against its oracle logits: ORACLE_REFERENCE) by 0.009 (the same file
with gate and up swapped: 0.32), the VL text decoders against transformers' Qwen3-VL / Qwen2.5-VL on text
by 0.010 / 0.009, llama-3's rope scaling by 0.017 (0.042 with its factors set to 1), llama.cpp's own Q4_K_M / Q6_K files
(its quantizer's) against transformers on qconv's reading of them by 0.019 / 0.015, and against
transformers on the GPTQ 8-bit model qconv converts them to by 0.022 / 0.031; a layout error (llama's q / k rows left in Hugging Face order in ONE
tensor kind, the negative control) by 0.70, with 6 of 12 top-1 tokens changed. TOLERANCE = 0.1 lies
2x above the worst legitimate difference and 7x below the control.
"""

import json
import shutil
import subprocess

import gguf
import numpy as np
import pytest

from conftest import CHECKPOINTS, REPO, compare_logprobs, gguf_tensors, run_qconv

LLAMA_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
SCRIPT = REPO / "tests" / "consumers" / "llamacpp_logits.py"

pytestmark = [pytest.mark.llamacpp, pytest.mark.consumer(LLAMA_PYTHON, "llama.cpp's Python bindings (.venv-llamacpp)")]

LLAMA3 = "+llama3-rope"       # a fixture's copy whose config asks for llama-3's rope scaling (rope_freqs)
IDS = [1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]      # the fixtures' oracle prompt (oracle/logits.safetensors)
TOLERANCE = 0.1

# (case, fixture, extra convert arguments, whether every code is kept)
CASES = [
    ("gptq-w8-q8_0", "llama-gptq-w8g128", (), True),
    ("bnb8-q8_0", "llama-bnb8", (), True),
    ("ct-w8a8-q8_0", "llama-ct-w8a8", (), True),
    ("ct-w4a16-q4_0", "llama-ct-w4a16", (), True),
    ("awq-sym-q4_0", "llama-awq-w4g64-sym", (), True),
    ("gptq-asym-q5_0", "llama-gptq-w4g64-asym", (), True),
    ("awq-q5_0", "llama-awq-w4g128", (), True),
    ("gptq-asym-q4_1", "llama-gptq-w4g64-asym", ("--gguf-asym", "q4_1"), True),
    ("gptq-w3-q4_0", "llama-gptq-w3g128", (), True),
    ("gptq-w2-q4_0", "llama-gptq-w2g128", (), True),
    ("autoround-mixed", "llama-autoround-w4g128-mixed8", (), True),
    ("ct-mxfp4", "llama-ct-mxfp4", (), True),
    ("gptq-actorder-requant", "llama-gptq-w4g128-actorder", (), False),
    ("fp16-data-free-q8_0", "llama-fp16", (), False),
    ("fp16-float", "llama-fp16", ("--gguf-float",), True),
    ("fp16-float-f32", "llama-fp16", ("--gguf-float", "--gguf-float-type", "f32"), True),
    ("gptq-w8-emb-q8_0", "llama-gptq-w8g128", ("--gguf-float-type", "q8_0"), False),   # embeddings requantized
    ("qwen2-w4-q4_0", "qwen2-autoround-w4g128", (), True),
    ("qwen3-w8-q8_0", "qwen3-autoround-w8g128", (), True),
    ("qwen3moe-fp8-requant", "qwen3moe-fp8-block", (), False),
    ("qwen3moe-bf16-float", "qwen3moe-bf16", ("--gguf-float",), True),
    ("qwen3vl-bnb8-q8_0", "qwen3vl-bnb8-skipvisual", (), True),
    ("qwen25vl-bf16-float", "qwen25vl-bf16", ("--gguf-float",), True),
    ("llama3-rope-q8_0", "llama-gptq-w8g128" + LLAMA3, (), True),
    ("qwen3moe-mxfp4-gptoss-kept", "qwen3moe-mxfp4-gptoss", (), True),
    ("qwen3moe-bf16-float-f16", "qwen3moe-bf16", ("--gguf-float", "--gguf-float-type", "f16"), True),
    ("qwen3vlmoe-bf16-float", "qwen3vlmoe-bf16", ("--gguf-float", "--no-mmproj"), True),
    ("mlx-lm-w4g64-q4_1", "llama-mlx-w4g64", (), True),        # mlx-lm's float offsets: Q4_1, codes kept
    ("mlx-lm-w5g32-q5_1", "llama-mlx-w5g32", (), True),        # ... and Q5_1
]
K_QUANTS = ("Q4_K_M", "Q6_K")
ARCH = {"qwen2-w4-q4_0": "qwen2", "qwen3-w8-q8_0": "qwen3", "qwen3moe-fp8-requant": "qwen3moe",
        "qwen3moe-bf16-float": "qwen3moe", "qwen3vl-bnb8-q8_0": "qwen3vl",
        "qwen25vl-bf16-float": "qwen2vl", "qwen3moe-mxfp4-gptoss-kept": "qwen3moe",
        "qwen3moe-bf16-float-f16": "qwen3moe", "qwen3vlmoe-bf16-float": "qwen3vlmoe"}
# Sources whose `qconv dequantize` folder transformers loads as ANOTHER model: qwen3moe-mxfp4-gptoss keeps
# gpt-oss' interleaved gate / up rows under a qwen3_moe config (tests/verbs/test_dequantize.py), which
# Qwen3MoeExperts reads as gate rows then up rows (measured: logits 1.08 away from the right model). Their
# float reference is the fixture's oracle/logits.safetensors instead: transformers' Qwen3MoeForCausalLM in
# float32 with the oracle's experts de-interleaved (fixtures/make_mxfp4_gptoss.py), on the same IDS.
ORACLE_REFERENCE = {"qwen3moe-mxfp4-gptoss"}


def float_logits(folder):
    """transformers' logits of the float model at `folder`, in float32 (a VL model: on text alone)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vl = "vision_config" in json.loads((folder / "config.json").read_text())
    model = (AutoModelForImageTextToText if vl else AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


def oracle_logits(src):
    """The fixture's own transformers logits (oracle/logits.safetensors) for IDS."""
    from safetensors.numpy import load_file

    oracle = load_file(CHECKPOINTS / src / "oracle" / "logits.safetensors")
    assert oracle["input_ids"].tolist() == [IDS]
    return oracle["logits"][0].astype(np.float32)


def source(src, tmp):
    """The fixture, or for NAME + LLAMA3 a copy of it whose config.json asks for llama-3.1's rope scaling
    (factor 8, low / high frequency factors 1 / 4) with an original context of 64, so that most of these
    tiny heads' frequencies are scaled (as Llama-3.1's lowest ones are at 8192)."""
    if not src.endswith(LLAMA3):
        return CHECKPOINTS / src
    dst = tmp / src
    if not dst.exists():
        shutil.copytree(CHECKPOINTS / src[:-len(LLAMA3)], dst)
        config = json.loads((dst / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": config["rope_parameters"]["rope_theta"],
                                     "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def without_rope_freqs(path, dst):
    """A second negative control: a copy of a llama-3 GGUF whose rope factors are all 1 (plain rope), as a
    converter that ignored the rope scaling would write it."""
    shutil.copy(path, dst)
    reader = gguf.GGUFReader(dst, "r+")
    next(t for t in reader.tensors if t.name == "rope_freqs.weight").data[:] = 1.0
    reader.data.flush()


def unpermuted_copy(path, dst):
    """The negative control: a copy of a GGUF whose attn_q rows are put back in Hugging Face order,
    as a converter that forgot llama's rotary permutation would write them."""
    shutil.copy(path, dst)
    reader = gguf.GGUFReader(dst, "r+")
    heads = int(reader.fields["llama.attention.head_count"].contents())
    for t in reader.tensors:
        if t.name.endswith("attn_q.weight"):
            rows = t.data.shape[0]
            t.data[:] = t.data.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(t.data.shape)
    reader.data.flush()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llamacpp")
    files, refs, converted = {}, {}, {}
    for case, src, args, kept in CASES:
        files[case] = tmp / f"{case}.gguf"
        run_qconv("convert", source(src, tmp), files[case], "--to", "gguf", *args, check=0)
        if not kept:                # requantized: the float model of what the file holds (qconv reads GGUF back)
            run_qconv("dequantize", files[case], tmp / f"{case}-float", check=0)
            refs[case] = float_logits(tmp / f"{case}-float")
        elif src in ORACLE_REFERENCE:
            refs[src] = oracle_logits(src)
        elif src not in refs:       # codes kept: the float model of the source itself
            run_qconv("dequantize", source(src, tmp), tmp / f"{src}-float", check=0)
            refs[src] = float_logits(tmp / f"{src}-float")
    files["control-qk-order"] = tmp / "control.gguf"
    unpermuted_copy(files["gptq-w8-q8_0"], files["control-qk-order"])
    files["control-rope-freqs"] = tmp / "control-rope.gguf"
    without_rope_freqs(files["llama3-rope-q8_0"], files["control-rope-freqs"])
    for kind in K_QUANTS:              # llama.cpp's own quantizer, from qconv's float GGUF; read back by qconv
        files[kind] = tmp / f"{kind}.gguf"
        proc = subprocess.run([str(LLAMA_PYTHON), str(SCRIPT), "--quantize", kind, str(files["fp16-float"]),
                               str(files[kind])], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        run_qconv("dequantize", files[kind], tmp / f"{kind}-float", check=0)
        refs[kind] = float_logits(tmp / f"{kind}-float")
        # converted by qconv: GGUF -> GGUF copies its blocks as they are; --to gptq requantizes them (8-bit)
        # from gguf-py's decoding, and llama.cpp's logits on the original file are compared with that model's
        files[f"{kind}-copy"] = tmp / f"{kind}-copy.gguf"
        run_qconv("convert", "--validate", files[kind], files[f"{kind}-copy"], "--to", "gguf", check=0)
        proc = run_qconv("convert", "--json", "--validate", files[kind], tmp / f"{kind}-gptq", "--to", "gptq",
                         "--bits", "8", check=0)
        converted[kind] = json.loads(proc.stdout)["components"][0]
        run_qconv("dequantize", tmp / f"{kind}-gptq", tmp / f"{kind}-gptq-float", check=0)
        refs[f"{kind}-gptq"] = float_logits(tmp / f"{kind}-gptq-float")
        files[f"{kind}-as-gptq"] = files[kind]
    out = tmp / "result.json"
    proc = subprocess.run([str(LLAMA_PYTHON), str(SCRIPT), "--ids", ",".join(map(str, IDS)), "--out", str(out),
                           *dict.fromkeys(map(str, files.values()))], capture_output=True, text=True, timeout=1800,
                          stdin=subprocess.DEVNULL)
    assert out.is_file(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    sources = {case: src if kept else case for case, src, _, kept in CASES} | {"control-qk-order": "llama-gptq-w8g128",
                                                                             "control-rope-freqs": "llama-gptq-w8g128" + LLAMA3}
    sources |= {kind: kind for kind in K_QUANTS} | {f"{kind}-copy": kind for kind in K_QUANTS}
    sources |= {f"{kind}-as-gptq": f"{kind}-gptq" for kind in K_QUANTS}
    table = {}
    for case, path in files.items():
        entry = result[str(path)]
        table[case] = entry if "logits" not in entry else {
            **compare_logprobs(np.array(entry["logits"]), refs[sources[case]], TOLERANCE), "arch": entry["arch"]}
    print(json.dumps({k: {kk: v for kk, v in e.items() if kk != "stderr"} for k, e in table.items()}, indent=1))
    table["converted"] = {"paths": {case: str(path) for case, path in files.items()}, "reports": converted}
    return table


@pytest.mark.parametrize("case, src, args, kept", CASES, ids=[c[0] for c in CASES])
def test_llama_cpp_runs_qconvs_gguf(case, src, args, kept, report):
    entry = report[case]
    assert "error" not in entry, f"llama.cpp did not run {case}: {entry.get('error')} {entry.get('stderr', '')[-500:]}"
    assert entry["arch"] == ARCH.get(case, "llama")
    assert entry["max_abs_logprob_diff"] <= TOLERANCE, entry
    assert entry["real_flips"] == 0, entry


@pytest.mark.parametrize("kind", K_QUANTS)
def test_llama_cpps_own_k_quants_read_back(kind, report):
    """A file llama.cpp's quantizer wrote (K-quants, which qconv never writes) read back by `qconv
    dequantize` (gguf-py's decoder, llama's rows un-permuted, config and tokenizer from the metadata)
    is the model llama.cpp runs: its float model in transformers agrees with llama.cpp on the file."""
    entry = report[kind]
    assert "error" not in entry, entry
    assert entry["max_abs_logprob_diff"] <= TOLERANCE and entry["real_flips"] == 0, entry


@pytest.mark.parametrize("kind", K_QUANTS)
def test_llama_cpps_own_k_quants_convert(kind, report):
    """A file llama.cpp's quantizer wrote, converted by qconv. GGUF -> GGUF copies every tensor as it is
    (the same types and bytes; llama.cpp runs the copy). --to gptq --bits 8 requantizes every Linear from
    gguf-py's decoding of its K-quant blocks (the reason and error reported per layer, --validate passed),
    writes the K-quant embeddings as float16 with a warning, and is the model llama.cpp computes on the
    original file: transformers' logits of its float model agree with llama.cpp's."""
    paths, comp = report["converted"]["paths"], report["converted"]["reports"][kind]
    assert gguf_tensors(paths[kind]) == gguf_tensors(paths[f"{kind}-copy"])
    for case in (f"{kind}-copy", f"{kind}-as-gptq"):
        entry = report[case]
        assert "error" not in entry, entry
        assert entry["max_abs_logprob_diff"] <= TOLERANCE and entry["real_flips"] == 0, (case, entry)
    assert comp["requantized"] == comp["modules"] == 14 and comp["validation"]["ok"]
    reasons = {r["reason"] for r in comp["layers"]}      # Q6_K: decoded weights; Q4_K: float offsets GPTQ lacks
    assert reasons and all((r.startswith("GGUF Q6_K") and r.endswith("quantized from its decoded weights"))
                           or r == "float offsets (w = s * q + b) are not integer zero points; 4-bit codes become 8-bit"
                           for r in reasons), reasons
    assert any("block-typed tensors outside the decoder layers" in w for w in comp["warnings"])


def test_llama3_rope_factors_are_what_llama_cpp_applies(report):
    """llama-3's rope scaling reaches llama.cpp as rope_freqs: the file agrees with transformers' llama-3
    model (test_llama_cpp_runs_qconvs_gguf), and the same file with its factors set to 1 is at least twice
    as far from it. These random tiny models are not very sensitive to rope at 12 positions (measured:
    0.017 with the factors, 0.042 without), so the factors' values are checked against transformers' own
    llama-3 frequencies in tests/formats/gguf/test_gguf_writer.py."""
    real, control = report["llama3-rope-q8_0"], report["control-rope-freqs"]
    assert "error" not in real and "error" not in control, (real, control)
    assert control["max_abs_logprob_diff"] > 2 * real["max_abs_logprob_diff"], (real, control)


def test_negative_control_a_wrong_row_order_is_caught(report):
    entry = report["control-qk-order"]
    assert "error" not in entry, entry
    assert entry["max_abs_logprob_diff"] > TOLERANCE, entry


def test_llama_cpp_reads_split_files_as_qconv_does(tmp_path):
    """qconv's split files past --max-shard-size are llama.cpp's: given the first, llama.cpp loads the set
    and computes the unsplit file's logits, and refuses a later file given first, as qconv does
    (formats/gguf/split.py)."""
    from conftest import split_gguf

    one, first = split_gguf("llama-gptq-w8g128", tmp_path)
    later = first.with_name("m-00002-of-00003.gguf")
    out = tmp_path / "result.json"
    subprocess.run([str(LLAMA_PYTHON), str(SCRIPT), "--ids", ",".join(map(str, IDS)), "--out", str(out),
                    str(first), str(one), str(later)], capture_output=True, text=True, timeout=600,
                   stdin=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert "logits" in result[str(first)], result[str(first)]
    np.testing.assert_array_equal(np.array(result[str(first)]["logits"]), np.array(result[str(one)]["logits"]))
    assert "logits" not in result[str(later)], "llama.cpp loaded a later split file on its own"
    proc = run_qconv("inspect", later)
    assert proc.returncode == 2 and "pass its first file (m-00001-of-00003.gguf)" in proc.stderr


SPM_SCRIPT = REPO / "tests" / "consumers" / "llamacpp_tokenize.py"


def _llama_cpp_tokenize(path, tmp):
    from conftest import SPM_STRINGS

    (tmp / "strings.json").write_text(json.dumps(SPM_STRINGS, ensure_ascii=False), encoding="utf-8")
    out = tmp / f"{path.stem}.json"
    proc = subprocess.run([str(LLAMA_PYTHON), str(SPM_SCRIPT), str(path), str(tmp / "strings.json"), str(out)],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text(encoding="utf-8"))


def test_llama_cpp_tokenizes_a_sentencepiece_gguf_as_sentencepiece(tmp_path):
    """A folder with a SentencePiece tokenizer.model (fixtures/tokenizers/llama-spm, BPE with byte
    fallback) converted to GGUF: llama.cpp loads its "llama" vocabulary and tokenizes each string as
    sentencepiece encodes it, bos first, and detokenizes the ids back to the string. The negative control
    is the same file with its scores negated (the merges' priority reversed): llama.cpp then merges in
    another order and half the strings come out otherwise (measured: 7 of 14; with every score -1000, as
    gguf-py's LlamaHfVocab writes them, only 2 of 14 on this small vocabulary, where merging the leftmost
    pair first mostly agrees)."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from conftest import SPM, SPM_STRINGS, spm_folder

    src = spm_folder(tmp_path / "src")
    run_qconv("convert", src, tmp_path / "spm.gguf", "--to", "gguf", check=0)
    got = _llama_cpp_tokenize(tmp_path / "spm.gguf", tmp_path)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(SPM / "tokenizer.model"))
    assert got["model"] == "llama" and got["n_vocab"] == 512
    for text, ids, back in zip(SPM_STRINGS, got["ids"], got["text"]):
        assert ids == [sp.bos_id()] + sp.encode(text), text
        assert back == text == sp.decode(ids[1:])

    shutil.copy(tmp_path / "spm.gguf", tmp_path / "reversed.gguf")
    reader = gguf.GGUFReader(tmp_path / "reversed.gguf", "r+")
    field = reader.fields["tokenizer.ggml.scores"]
    for i in field.data:
        field.parts[i][...] = -field.parts[i]
    reader.data.flush()
    del reader
    control = _llama_cpp_tokenize(tmp_path / "reversed.gguf", tmp_path)
    differ = sum(ids != [sp.bos_id()] + sp.encode(text) for text, ids in zip(SPM_STRINGS, control["ids"]))
    print({"strings": len(SPM_STRINGS), "control_differs": differ})
    assert differ >= 5, differ


def test_the_model_check_runs_a_gguf_in_llama_cpp(report):
    """`qconv validate A B --model` with B a GGUF runs B in llama.cpp itself (model_check/, the gguf
    dialect's Engine), A in transformers. On the F32 GGUF of llama-fp16 the two engines hold the same float32
    weights and differ only in summation order: KL 3.3e-9 measured (bound 1e-6), the same top-1 token at every
    position, and B's perplexity in llama.cpp equals B's in transformers (engine="transformers": qconv's
    decoding of the same file, KL exactly 0) within 1e-4. The Q8_0 file of llama-gptq-w8g128 (codes kept) has
    llama.cpp's 8-bit activations in its figure (6.9e-6 measured); the same file with llama's q / k rows left
    in Hugging Face order in one tensor kind (the negative control) is 2.2e-3 away (top-1 agreement 63%), 313x it
    (bound: 100x)."""
    from qconv import check_model

    paths = report["converted"]["paths"]
    native = check_model(CHECKPOINTS / "llama-fp16", paths["fp16-float-f32"], engine="native", python=LLAMA_PYTHON)
    plain = check_model(CHECKPOINTS / "llama-fp16", paths["fp16-float-f32"], engine="transformers")
    assert native.engine_b.startswith("llama-cpp-python 0.3.36") and plain.engine_b.startswith("transformers")
    assert plain.kl_mean == 0.0 and native.kl_mean < 1e-6 and native.top1_agreement == 1.0, native.data
    assert abs(native.perplexity_b / plain.perplexity_b - 1) < 1e-4
    kept = check_model(CHECKPOINTS / "llama-gptq-w8g128", paths["gptq-w8-q8_0"], python=LLAMA_PYTHON)
    control = check_model(CHECKPOINTS / "llama-gptq-w8g128", paths["control-qk-order"], python=LLAMA_PYTHON)
    assert kept.engine_b.startswith("llama-cpp-python") and 0 < kept.kl_mean < 1e-4
    assert control.kl_mean > 100 * kept.kl_mean, (control.kl_mean, kept.kl_mean)
