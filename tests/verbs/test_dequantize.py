"""`qconv dequantize` and the readers behind it, against the producers' own dequantization."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from qconv.formats.storage.checkpoint import open_target
from qconv.formats.core.detect import detect
from qconv.formats.core.reader import read_module

from conftest import CHECKPOINTS, FIXTURES, QCONV, QUANTIZED, child_env, child_signals, copy_checkpoint, run_qconv


def _producer(name):
    return json.loads((CHECKPOINTS / name / "oracle" / "PROVENANCE.json").read_text())["producer"]


def _producer_dtype(name):
    """The dtype the producer's own dequantization returns (fixtures/checkpoints/README.md)."""
    producer = _producer(name)
    if producer == "bitsandbytes":
        settings = json.loads((CHECKPOINTS / name / "oracle" / "PROVENANCE.json").read_text())["settings"]
        return "float32" if settings.get("load_in_8bit") == "True" else "float16"
    if producer == "transformers":                    # FineGrainedFP8 reloaded with dtype float32
        return "float32"
    if producer == "modelopt":                        # FP8QTensor / NVFP4QTensor .dequantize(float32)
        return "float32"
    if producer == "qconv-fixture":                   # gpt-oss MXFP4 made here; oracle: transformers'
        return "float32"                              # convert_moe_packed_tensors(dtype=float32), exact
    if producer == "mlx_lm.convert":                  # the oracle: mx.dequantize, scales and biases in float32
        return "float32"
    if producer == "llm-compressor":                  # compressed-tensors decompresses in the model dtype
        config = json.loads((CHECKPOINTS / name / "config.json").read_text())   # (bfloat16 for the MoE base)
        return config.get("dtype") or config["torch_dtype"]
    return "float16"      # GPTQModel dequantize_weight / auto-round kernel, both in fp16


def _oracle(name):
    return load_file(CHECKPOINTS / name / "oracle" / "dequant.safetensors")


def _rounded_to(w, dtype):
    """float32 values rounded to dtype and widened back, as torch casts (numpy has no bfloat16)."""
    return torch.from_numpy(np.ascontiguousarray(w)).to(getattr(torch, dtype)).float().numpy()


@pytest.mark.parametrize("name", QUANTIZED)
def test_readers_reproduce_the_producer_oracle_exactly(name):
    comp = open_target(CHECKPOINTS / name).components[0]
    det = detect(comp)
    oracle = _oracle(name)
    dtype = _producer_dtype(name)
    assert len(det.modules) == len(oracle)
    for m in det.modules:
        w = _rounded_to(read_module(comp, det, m, "float16").dequantize(), dtype)
        ref = oracle[m.float_name].numpy()                  # fused experts: the stored 3-D name and shape
        ref = ref.reshape(m.out_features, m.in_features)
        assert w.shape == ref.shape
        assert np.array_equal(w, ref), (m.name, int((w != ref).sum()))


def _dequantize(src, dst, *args):
    return run_qconv("dequantize", src, dst, *args, check=0)


def _weights(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


CT_FP4 = ("llama-ct-mxfp4", "llama-ct-nvfp4", "llama-ct-nvfp4a16")


@pytest.mark.parametrize("name", QUANTIZED)
def test_cli_output_equals_oracle_at_producer_dtype_and_float32_is_unrounded(tmp_path, name):
    dtype = _producer_dtype(name)
    _dequantize(CHECKPOINTS / name, tmp_path / "p", "--dtype", dtype)
    _dequantize(CHECKPOINTS / name, tmp_path / "f", "--dtype", "float32")
    at_dtype, f32 = _weights(tmp_path / "p"), _weights(tmp_path / "f")
    rounded = 0
    for key, ref in _oracle(name).items():
        assert at_dtype[key].dtype == getattr(torch, dtype)
        assert torch.equal(at_dtype[key].float(), ref), key
        assert f32[key].dtype == torch.float32
        assert torch.equal(f32[key].to(getattr(torch, dtype)).float(), ref), key
        rounded += int((f32[key] != ref).sum())
    if dtype != "float32" and "-w2g" not in name and name not in ("llama-awq-w4g64-sym", "qwen2-autoround-w4g128",
                                                                  *CT_FP4):
        # float32 output keeps what the producer's fp16 rounding drops. Nothing to keep where every
        # product (q-z)*s is exact in fp16: 2-bit (|q-z| <= 2), and symmetric 4-bit whose scales have
        # bfloat16's 8 significant bits (AWQ's bfloat16 scales; auto-round's of a bfloat16 model) times
        # |q-8| <= 8, at most 3 more bits: 11, fp16's precision; nor for
        # compressed-tensors FP4: MXFP4's e2m1 * 2^k is exact, and NVFP4's product is already rounded
        # to bfloat16 (8 significant bits) before float16, which holds every such weight of these
        # fixtures (none is below float16's normal range).
        assert rounded > 0


# Logit tolerances (relative Frobenius error against oracle/logits.safetensors). The oracle ran the
# producer's kernels; the dequantized model runs a plain float matmul on the same weights, so the gap is
# the kernels' own arithmetic, not dequantization (which is exact, tested above):
# - bitsandbytes int8: LLM.int8 quantizes activations to int8 per row (error up to 1/254 of each row's
#   absmax per element) and computes outlier columns in fp16: measured 1.3 % (llama), 1.7 % (qwen3vl).
# - bitsandbytes 4-bit: computes in bnb_4bit_compute_dtype (bf16 for nf4: 8-bit mantissa): 0.7 %.
# - GPTQ / auto-round / compressed-tensors weight-only: fp16/bf16 kernels: 0.04-0.9 % depending on the
#   output dtype.
# - compressed-tensors W8A8: int8 activations per token (dynamic), like LLM.int8 without its outlier
#   path: measured 1.8 %.
# - ModelOpt: transformers cannot load it, so its oracle logits are the float32 base with the oracle
#   weights put in, activations unquantized: the gap is only the float16 folder's own rounding, measured
#   0.11 % (FP8) and 0.13 % (NVFP4). ModelOpt's fake-quant model, FP8 activations included
#   (logits_modelopt_fakequant), is 5.9 % away: activation quantization, not weights.
# A decoding error is an order of magnitude larger: a zero point off by one in every group gives ~30 %.
TOLERANCE = {"bitsandbytes": 0.03, "gptqmodel": 0.015, "auto-round": 0.015, "llm-compressor": 0.015,
             "transformers": 0.015, "modelopt": 0.005, "mlx_lm.convert": 0.015}
# Fixtures whose dequantized folder plain transformers loads WRONG by design, so the test below does not
# apply: qwen3moe-mxfp4-gptoss keeps gpt-oss' fused experts with gate and up rows INTERLEAVED (even rows
# gate, odd rows up) under a qwen3_moe config, and dequantize keeps that stored layout (no silent
# reordering, docs/formats.md); Qwen3MoeExperts reads experts.gate_up_proj [E, 2I, H] as gate rows then up
# rows (chunk(2)), so the folder loads without error and computes another function. Its
# oracle/logits.safetensors are the base with the oracle weights de-interleaved (PROVENANCE.json); the
# reader is checked bit for bit against transformers' own decoder above.
NOT_TRANSFORMERS_LOADABLE = {"qwen3moe-mxfp4-gptoss"}


@pytest.mark.parametrize("name", [n for n in QUANTIZED if n not in NOT_TRANSFORMERS_LOADABLE])
def test_dequantized_folder_loads_in_plain_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    out = tmp_path / "out"
    _dequantize(CHECKPOINTS / name, out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert not (out / "quantize_config.json").exists() and not (out / "quantization_config.json").exists()
    for f in (CHECKPOINTS / name).iterdir():
        if f.is_file() and f.name.startswith("tokenizer"):
            assert (out / f.name).read_bytes() == f.read_bytes()
    cls = AutoModelForImageTextToText if name.startswith("qwen3vl") else AutoModelForCausalLM
    model = cls.from_pretrained(out, device_map="cpu")
    assert getattr(model, "hf_quantizer", None) is None
    assert str(model.dtype) == f"torch.{config['dtype']}"
    oracle = load_file(CHECKPOINTS / name / "oracle" / "logits.safetensors")
    # Schemes that quantize activations too (compressed-tensors FP8 / NVFP4) also carry the producer's
    # logits on its decompressed weights alone: what a dequantized folder computes.
    expected = oracle.get("logits_weights_only", oracle["logits"])
    with torch.no_grad():
        logits = model(input_ids=oracle["input_ids"]).logits.float()
    rel = ((logits - expected).norm() / expected.norm()).item()
    assert rel < (0.03 if name.endswith("-w8a8") else TOLERANCE[_producer(name)]), rel


def test_sharded_output_with_index_loads_identically(tmp_path):
    from transformers import AutoModelForCausalLM

    src = CHECKPOINTS / "llama-bnb4-nf4-dq"
    _dequantize(src, tmp_path / "one")
    _dequantize(src, tmp_path / "many", "--max-shard-size", "1MB")
    shards = sorted((tmp_path / "many").glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert all(s.stat().st_size < 1.2e6 for s in shards)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    weights = {}
    for s in shards:
        with safe_open(s, framework="pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == s.name
                weights[k] = f.get_tensor(k)
    assert sorted(weights) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert all(torch.equal(weights[k], v) for k, v in _weights(tmp_path / "one").items())
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "one")(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "many")(input_ids=ids).logits
    assert torch.equal(a, b)


def test_pipeline_dequantizes_quantized_components_and_copies_the_rest(tmp_path):
    src = CHECKPOINTS / "pipeline-qwen3vl-bnb8"
    out = tmp_path / "pipe"
    proc = _dequantize(src, out, "--json")
    result = json.loads(proc.stdout)
    assert [c["component"] for c in result["components"]] == ["text_encoder"]
    assert (out / "model_index.json").read_bytes() == (src / "model_index.json").read_bytes()
    for f in (src / "tokenizer").iterdir():
        assert (out / "tokenizer" / f.name).read_bytes() == f.read_bytes()
    plain = tmp_path / "plain"
    _dequantize(CHECKPOINTS / "qwen3vl-bnb8-skipvisual", plain)
    assert (out / "text_encoder" / "model.safetensors").read_bytes() == \
        (plain / "model.safetensors").read_bytes()


def _digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_deterministic_and_source_untouched(tmp_path):
    src = copy_checkpoint("llama-gptq-w3g128", tmp_path)
    before = _digest(src)
    first = _dequantize(src, tmp_path / "a" / "out")           # the model card names DST: the same name
    _dequantize(src, tmp_path / "b" / "out")
    assert first.stderr == ""                  # no progress bar when stderr is not a terminal
    assert _digest(tmp_path / "a" / "out") == _digest(tmp_path / "b" / "out")
    assert "README.md" in _digest(tmp_path / "a" / "out")
    assert _digest(src) == before


def test_existing_destination(tmp_path):
    src = CHECKPOINTS / "llama-bnb8"
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    proc = run_qconv("dequantize", src, dst)
    assert proc.returncode == 6 and "not empty; pass --overwrite" in proc.stderr
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    _dequantize(src, dst, "--overwrite")
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]          # no temporary litter
    empty = tmp_path / "empty"
    empty.mkdir()
    _dequantize(src, empty)                                               # an empty folder is fine


@pytest.mark.parametrize("where", ["same", "inside"])
def test_destination_in_source_is_refused(tmp_path, where):
    src = copy_checkpoint("llama-bnb8", tmp_path)
    before = _digest(src)
    dst = src if where == "same" else src / "out"
    proc = run_qconv("dequantize", "--overwrite", src, dst)
    assert proc.returncode == 6 and "source" in proc.stderr
    assert _digest(src) == before


# Bad inputs: the inspect cases (tests/safety/test_bad_input.py), through dequantize.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "safety"))
from test_bad_input import CASES  # noqa: E402


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_leaves_no_destination(tmp_path, case):
    make, code = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    path, needles = make(work)
    out = tmp_path / "out"
    proc = run_qconv("dequantize", path, out)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconv: error: "), proc.stderr
    assert all(n in lines[0] for n in needles)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    assert not (work / "PWNED").exists()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_leaves_nothing(tmp_path, sig):
    """The signal arrives mid-dequantization whatever the machine's load: the test-only hook
    QCONV_TEST_SIGNAL (formats/storage/staging.py) makes qconv signal itself once its first output tensor is
    on disk, in the staging folder (this test used to signal after a sleep, and so depended on how
    busy the machine was)."""
    sys.path.insert(0, str(FIXTURES / "layouts"))
    from build import build
    src = build(FIXTURES / "layouts" / "qwen3vl-8b-bnb8.json", tmp_path / "src")
    out = tmp_path / "out"
    proc = subprocess.run([QCONV, "dequantize", src, out], capture_output=True, text=True, timeout=600,
                          env=child_env(QCONV_TEST_SIGNAL=f"tensor-written:{sig}"),
                          preexec_fn=child_signals())
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "qconv: interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_an_interrupt_wrapped_by_a_library_is_still_an_interrupt(monkeypatch, capsys):
    """A signal can land inside code that wraps whatever it raises (here: Python's class creation,
    which turned a SIGTERM during torch's import into "RuntimeError: Error calling __set_name__"): that
    is still an interruption, exit 130, never an internal error."""
    from qconv import cli
    from qconv.formats.storage.staging import _Terminated

    def wrapped(**kwargs):
        try:
            raise _Terminated()
        except KeyboardInterrupt as exc:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance 'by_key'") from exc
    monkeypatch.setattr(cli.cli, "main", wrapped)
    with pytest.raises(SystemExit) as stop:
        cli.main(["inspect", str(CHECKPOINTS / "llama-bnb8")])
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip() == "qconv: interrupted"


def test_non_row_int8_layout_is_refused(tmp_path):
    from qconv.formats.storage.safetensors_header import read_header

    src = copy_checkpoint("llama-bnb8", tmp_path)
    info = read_header(src / "model.safetensors").tensors["model.layers.0.mlp.up_proj.weight_format"]
    with open(src / "model.safetensors", "r+b") as f:
        f.seek(info.offset)
        f.write(bytes([3]))                                   # col_ampere (bitsandbytes 0.43-0.44)
    proc = run_qconv("dequantize", src, tmp_path / "out")
    assert proc.returncode == 5, proc.stderr
    assert "model.layers.0.mlp.up_proj" in proc.stderr and "'col_ampere'" in proc.stderr
    assert not (tmp_path / "out").exists()
