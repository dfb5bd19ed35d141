"""mlx-lm itself (mlx 0.32.4 / mlx-lm 0.32.2 on CPU, in .venv-mlx: bin/setup mlx) as the consumer of
`qconv convert --to mlx`: each output loads with mlx_lm.load and generates; mlx's own ``mx.dequantize``
(scales and biases in float32) decodes every module to exactly qconv's decoding of the file; where the
codes were kept, to exactly the source's decoding (GPTQ, AWQ, auto-round, compressed-tensors, and GGUF
blocks written by gguf-py's own quantizer); bitsandbytes int8 within its float16 scale rounding; and with
every parameter cast to float32, mlx-lm's logits equal transformers' on qconv's float32 dequantization of
the same output (tests/consumers/mlx_run.py runs mlx-lm in a subprocess).

Equal means bit for bit but for the sign of a zero: where a negative scale (auto-round writes some) meets
its zero point, MLX computes s*z + (-s*z) = +0 and (q - z) * s is -0 (formats/mlx/codec.py).

Why the logit bound. Both sides hold the same float32 weights; they differ only in float32 summation order
(mlx's matmuls, attention and norms against torch's): measured on these fixtures (2 layers, vocab 512,
12 positions, log-probabilities over the reference's top 5 tokens) 0.9e-6 to 2.4e-6 over every case below.
TOLERANCE = 1e-4 is 40x the worst of them (room for another CPU's summation order); the negative control
(test_a_wrong_code_is_seen: the zero points of one group of 128 inputs of one down_proj off by one) moves
them by 3.0e-3, 30x the bound.
"""

import json
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import CHECKPOINTS, REPO, compare_logprobs, llama_cpp_decoding, requantize_gguf, run_qconv

MLX_PYTHON = REPO / ".venv-mlx" / "bin" / "python"
SCRIPT = REPO / "tests" / "consumers" / "mlx_run.py"

pytestmark = [pytest.mark.mlx, pytest.mark.consumer(MLX_PYTHON, "mlx-lm (.venv-mlx)")]

IDS = [1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]
TOLERANCE = 1e-4

# (case, source: a fixture, "gguf:<fixture>:<gguf-py type>" for a GGUF whose blocks gguf-py's quantizer
# wrote from qconv's float GGUF of the fixture, "qconv-gguf:<fixture>" for qconv's GGUF of it, or
# "file:<path>" for a file in the repository (llama.cpp's own K-quants), extra convert arguments, whether
# every code is kept)
CASES = [
    ("gptq-w4g64-asym", "llama-gptq-w4g64-asym", (), True),
    ("gptq-w8g128", "llama-gptq-w8g128", (), True),
    ("gptq-w3g128", "llama-gptq-w3g128", (), True),
    ("gptq-w2g128", "llama-gptq-w2g128", (), True),
    ("awq-w4g128", "llama-awq-w4g128", (), True),
    ("awq-w4g64-sym", "llama-awq-w4g64-sym", (), True),
    ("ct-w4a16", "llama-ct-w4a16", (), True),
    ("ct-w8a8-per-channel", "llama-ct-w8a8", (), True),
    ("autoround-mixed8", "llama-autoround-w4g128-mixed8", (), True),
    ("qwen3-autoround-w8-negative-scales", "qwen3-autoround-w8g128", (), True),
    ("qwen2-autoround-w4", "qwen2-autoround-w4g128", (), True),
    ("bnb8", "llama-bnb8", (), True),
    ("gguf-q8_0", "gguf:llama-fp16:Q8_0", (), True),
    ("gguf-q4_0", "gguf:llama-fp16:Q4_0", (), True),
    ("gguf-q5_0", "gguf:llama-fp16:Q5_0", (), True),
    ("gguf-q4_1-float-offsets", "gguf:llama-fp16:Q4_1", (), True),
    ("llama.cpp-q4_k_m", "file:fixtures/gguf/llama-fp16-Q4_K_M.gguf", (), False),    # its Q6_K requantized
    ("llama.cpp-q5_k_m", "file:fixtures/gguf/llama-fp16-Q5_K_M.gguf", (), False),
    ("ct-mxfp4-mode-mxfp4", "llama-ct-mxfp4", (), True),
    ("gguf-mxfp4-mode-mxfp4", "qconv-gguf:llama-ct-mxfp4", (), True),
    ("gptq-actorder-requantized", "llama-gptq-w4g128-actorder", (), False),
    ("fp16-data-free", "llama-fp16", (), False),
    ("fp16-data-free-asym-3bit-g32", "llama-fp16", ("--bits", "3", "--group-size", "32", "--asym"), False),
    ("qwen3moe-fp8-stacked-experts", "qwen3moe-fp8-block", (), False),
    ("mlx-lm-mixed36-kept", "llama-mlx-mixed36", (), True),
]


def source(src, tmp):
    """The fixture, or a GGUF made from it: qconv's float GGUF, its block weights quantized by gguf-py
    ("gguf:"), or qconv's GGUF of it, its codes kept ("qconv-gguf:")."""
    if src.startswith("file:"):
        return REPO / src[5:]
    if src.startswith("qconv-gguf:"):
        path = tmp / f"{src[11:]}.gguf"
        if not path.exists():
            run_qconv("convert", CHECKPOINTS / src[11:], path, "--to", "gguf", check=0)
        return path
    if not src.startswith("gguf:"):
        return CHECKPOINTS / src
    _, fixture, kind = src.split(":")
    path = tmp / f"{fixture}-{kind}.gguf"
    if not path.exists():
        if not (tmp / f"{fixture}-f16.gguf").exists():
            run_qconv("convert", CHECKPOINTS / fixture, tmp / f"{fixture}-f16.gguf", "--to", "gguf", "--gguf-float",
                      check=0)
        requantize_gguf(tmp / f"{fixture}-f16.gguf", path, lambda name, t: name.startswith("blk.") and t == "F16"
                        and not name.endswith("norm.weight"), kind)
    return path


def qconv_decoding(path, dtype="float32"):
    """{module: qconv's float32 decoding} of a folder or GGUF."""
    from qconv.formats.core.detect import detect
    from qconv.formats.core.reader import read_module
    from qconv.formats.storage.checkpoint import open_target

    comp = open_target(path).components[0]
    det = detect(comp)
    out = {}
    for m in det.modules:
        t = read_module(comp, det, m, dtype)
        out[m.name] = t.dequantize_rows(0, t.shape[0])
    return out


def same(a, b):
    return a.shape == b.shape and np.array_equal(a, b) and np.array_equal(a.view(np.uint32)[a != 0],
                                                                         b.view(np.uint32)[b != 0])


def float_logits(folder):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlx")
    outs, summaries = {}, {}
    for case, src, args, _ in CASES:
        outs[case] = tmp / case
        proc = run_qconv("convert", "--json", source(src, tmp), outs[case], "--to", "mlx", *args, check=0)
        summaries[case] = json.loads(proc.stdout)["components"][0]
    proc = subprocess.run([str(MLX_PYTHON), str(SCRIPT), "--ids", ",".join(map(str, IDS)), "--out", str(tmp / "run"),
                           *map(str, outs.values())], capture_output=True, text=True, timeout=1800,
                          stdin=subprocess.DEVNULL)
    result_file = tmp / "run" / "result.json"
    assert result_file.is_file(), proc.stderr[-3000:]
    result = json.loads(result_file.read_text())
    table = {}
    for case, src, _, kept in CASES:
        entry = result[str(outs[case])]
        if "error" in entry:
            table[case] = entry
            continue
        run_qconv("dequantize", outs[case], tmp / f"{case}-float", "--dtype", "float32", check=0)
        logits = load_file(f"{entry['dir']}/logits.safetensors")["logits"]
        table[case] = {**entry, "summary": summaries[case], "source": source(src, tmp), "out": outs[case],
                       "mx_weights": load_file(f"{entry['dir']}/weights.safetensors"),
                       **compare_logprobs(logits, float_logits(tmp / f"{case}-float"), TOLERANCE)}
    print(json.dumps({c: {k: v for k, v in e.items() if k in ("max_abs_logprob_diff", "top1", "generated", "error")}
                      for c, e in table.items()}, indent=1))
    return table


@pytest.mark.parametrize("case, src, args, kept", CASES, ids=[c[0] for c in CASES])
def test_mlx_lm_runs_it_and_decodes_it_as_qconv_does(report, case, src, args, kept):
    entry = report[case]
    assert "error" not in entry, entry
    assert len(entry["generated"]) == 4 and all(0 <= t < 512 for t in entry["generated"])   # in its own dtypes
    summary = entry["summary"]
    assert (summary["requantized"] == 0) if kept else (summary["requantized"] > 0)
    mx_weights, ours = entry["mx_weights"], qconv_decoding(entry["out"])
    assert sorted(mx_weights) == sorted(ours) and len(ours) >= 14
    for name, w in ours.items():
        assert same(mx_weights[name], w), name
    assert entry["max_abs_logprob_diff"] <= TOLERANCE and entry["top1"] == 1.0, entry["max_abs_logprob_diff"]


@pytest.mark.parametrize("case, src", [(c, s) for c, s, _, kept in CASES if kept], ids=[c for c, _, _, k in CASES if k])
def test_kept_codes_decode_in_mlx_as_in_the_source(report, case, src):
    """mx.dequantize of the written file against qconv's decoding of the SOURCE: every weight the same;
    bitsandbytes int8 within its float16 scale (SCB / 127 rounds once, as --to gptq rounds it)."""
    entry = report[case]
    want = qconv_decoding(entry["source"])
    got = {n: entry["mx_weights"][n] for n in want}
    if src == "llama-bnb8":
        bound = entry["summary"]["max_scale_rel_error"]
        assert 0 < bound <= 2.0**-11
        for name, w in want.items():
            # bitsandbytes' own (CB * SCB) * fl(1/127) rounds twice more: 2^-21 of slack, as validate allows
            assert np.all(np.abs(got[name] - w) <= (bound + 2.0**-21) * np.abs(w)), name
        return
    for name, w in want.items():
        assert same(got[name], w), name


@pytest.mark.parametrize("case", ["llama.cpp-q4_k_m", "llama.cpp-q5_k_m"])
def test_llama_cpps_k_quants_decode_in_mlx_as_llama_cpp_decodes_them(report, case):
    """llama.cpp's own Q4_K_M / Q5_K_M files -> MLX: mx.dequantize of every Q4_K / Q5_K module (float32
    scales d * sc and biases -dmin * m, groups of 32) is llama.cpp's own decoding of the source blocks
    (gguf-py's quants.dequantize, rows in Hugging Face order) bit for bit; only the Q6_K ones were requantized."""
    entry = report[case]
    assert "error" not in entry, entry
    theirs = llama_cpp_decoding(entry["source"])
    kept = {m: w for m, (t, w) in theirs.items() if t in ("Q4_K", "Q5_K")}
    assert len(kept) >= 10 and {r["module"] for r in entry["summary"]["layers"]} == \
        {m for m, (t, _) in theirs.items() if t == "Q6_K" and m != "lm_head"}
    for name, w in kept.items():
        assert same(entry["mx_weights"][name], w), name


MLX_DEQUANTIZE = r"""
import sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.utils import load_model
sys.path.insert(0, sys.argv[3])
from mlx_run import dequantized
model, _ = load_model(Path(sys.argv[1]))
mx.save_safetensors(sys.argv[2], {n: w for n, w in dequantized(model).items()})
"""


@pytest.mark.parametrize("bits, group", [(2, 128), (3, 32), (6, 64), (8, 32)])
def test_mlx_lm_folders_of_every_width_keep_their_codes(tmp_path, bits, group):
    """mlx_lm.convert's own folders of llama-fp16 (min / max biases; the widths and groups the fixtures do
    not hold: 4-bit g64, 5-bit g32 and mixed 3 / 6-bit g64 are fixtures): --to mlx gives every tensor back
    byte for byte; --to gguf keeps 2- and 3-bit codes in Q4_1 (nibble = q, d = s, m = b), each weight in
    llama.cpp's decoder (gguf-py) bit for bit mx.dequantize's, and requantizes 6- and 8-bit ones to Q8_0
    (no GGUF type holds a float offset at those widths), the reason said."""
    src = tmp_path / "mlx-lm"
    subprocess.run([str(MLX_PYTHON), "-m", "mlx_lm", "convert", "--hf-path", str(CHECKPOINTS / "llama-fp16"),
                    "--mlx-path", str(src), "--quantize", "--q-bits", str(bits), "--q-group-size", str(group)],
                   check=True, capture_output=True, timeout=600)
    subprocess.run([str(MLX_PYTHON), "-c", MLX_DEQUANTIZE, str(src), str(tmp_path / "mx.safetensors"),
                    str(SCRIPT.parent)], check=True, capture_output=True, timeout=600)
    mx_weights = load_file(tmp_path / "mx.safetensors")
    same_mlx = json.loads(run_qconv("convert", "--json", src, tmp_path / "mlx", "--to", "mlx", check=0).stdout)
    assert same_mlx["components"][0]["codes_kept"] == same_mlx["components"][0]["modules"] == 16
    from qconv.formats.storage.safetensors_header import read_header
    from qconv.formats.storage.tensor_io import read_array

    def raw(folder):
        return {n: (i.dtype, read_array(i).tobytes()) for f in sorted(folder.glob("*.safetensors"))
                for n, i in read_header(f).tensors.items()}

    assert raw(tmp_path / "mlx") == raw(src)
    proc = run_qconv("convert", "--json", "--validate", src, tmp_path / "m.gguf", "--to", "gguf", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    theirs = llama_cpp_decoding(tmp_path / "m.gguf")
    types = {t for t, _ in theirs.values()}
    assert comp["validation"]["ok"] and len(theirs) == 15
    if bits <= 4:
        assert types == {"Q4_1"} and comp["requantized"] == 0
        for name, (_, w) in theirs.items():
            assert same(w, mx_weights[name]), name
    else:
        assert types == {"Q8_0"} and comp["requantized"] == comp["modules"] == 16
        assert {r["reason"] for r in comp["layers"]} == {f"{bits}-bit codes with float offsets become 8-bit"}


def test_a_wrong_code_is_seen(report, tmp_path):
    """The negative control: the gptq-w8g128 output with the zero points of one group of inputs of one
    down_proj off by one (its biases moved by one scale) is another model to mlx-lm, and the checks above
    see it."""
    import shutil

    from safetensors.torch import load_file as load_torch, save_file

    case = "gptq-w8g128"
    bad = tmp_path / "bad"
    shutil.copytree(report[case]["out"], bad)
    tensors = load_torch(bad / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    tensors[f"{name}.biases"][:, 0] -= tensors[f"{name}.scales"][:, 0]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "mlx"})
    proc = subprocess.run([str(MLX_PYTHON), str(SCRIPT), "--ids", ",".join(map(str, IDS)), "--out", str(tmp_path / "run"),
                           str(bad)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    entry = json.loads((tmp_path / "run" / "result.json").read_text())[str(bad)]
    assert "error" not in entry, entry
    logits = load_file(f"{entry['dir']}/logits.safetensors")["logits"]
    good = load_file(f"{report[case]['dir']}/logits.safetensors")["logits"]
    assert compare_logprobs(logits, good, TOLERANCE)["max_abs_logprob_diff"] > 10 * TOLERANCE
    want = qconv_decoding(CHECKPOINTS / "llama-gptq-w8g128")[name]
    assert not same(load_file(f"{entry['dir']}/weights.safetensors")[name], want)


def test_the_model_check_runs_an_mlx_folder_in_mlx_lm(report):
    """`qconv validate A B --model` with B an MLX folder runs B in mlx-lm itself (model_check/, the mlx
    dialect's Engine; every parameter cast to float32), A in transformers on qconv's decoding of the GPTQ
    source. Codes kept, so both hold the same float32 weights: KL 3.8e-14 measured (bound 1e-9), the same
    top-1 token at every position, B's perplexity in mlx-lm equal to B's in transformers within 1e-6."""
    from qconv import check_model

    src, out = CHECKPOINTS / "llama-gptq-w4g64-asym", report["gptq-w4g64-asym"]["out"]
    native = check_model(src, out, engine="native", python=MLX_PYTHON)
    plain = check_model(src, out, engine="transformers")
    assert native.engine_b.startswith("mlx-lm 0.32.2") and plain.kl_mean == 0.0
    assert native.kl_mean < 1e-9 and native.top1_agreement == 1.0, native.data
    assert abs(native.perplexity_b / plain.perplexity_b - 1) < 1e-6
