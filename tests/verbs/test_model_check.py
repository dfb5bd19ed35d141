"""The model-level check (model_check/: `qconv validate A B --model`, `convert --check-model`) in
transformers on the CPU: both models run on the bundled public-domain text, tokenized by A's own tokenizer,
and B's next-token distributions are compared with A's.

What it is held to:
* a lossless conversion (llama-gptq-w8g128 -> compressed-tensors, every code kept) gives KL exactly 0, top-1
  agreement 1 and the same perplexity: the same float32 weights through the same arithmetic;
* the check can fail: the same output with ONE layer's scales x1.01 (model.layers.0.mlp.down_proj) has a KL
  above 0, and x1.05 a larger one; --max-kl turns that into exit 1;
* perplexity is transformers' own: the perplexity the check reports for the float model equals
  exp(transformers' loss with labels) on the same ids (the real consumer, not this code, says what it is);
* refusals, one line, nothing written: A without a tokenizer (exit 5), a text under 64 tokens (exit 2),
  B with another vocabulary (exit 5), per-layer options with --model (exit 2);
* convert --check-model puts the figures into the report and the card; a source without a tokenizer is
  still converted, the card saying why the check could not run.
llama.cpp and mlx-lm as B's engine: tests/consumers/test_llamacpp.py and test_mlx.py."""

import json
import math
import shutil

import pytest

from conftest import CHECKPOINTS, one_error, run_qconv

import qconv
from qconv.model_check import MIN_TOKENS, TEXT

SOURCE = CHECKPOINTS / "llama-gptq-w8g128"
CORRUPTED = "model.layers.0.mlp.down_proj.weight_scale"


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "ct"
    result = qconv.convert(SOURCE, out, to="compressed-tensors", card=False, check_model=True)
    assert result.codes_kept == 14 and not result.requantized
    return out, result


def scaled(src, dst, factor):
    """A copy of a compressed-tensors folder with one layer's scales multiplied by factor."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[CORRUPTED] = (tensors[CORRUPTED].float() * factor).to(tensors[CORRUPTED].dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_lossless_conversion_has_no_divergence(lossless):
    _, result = lossless
    m = result.data["model_check"]
    assert m["ok"] and m["tokens"] == 256          # the fixture's context (max_position_embeddings) caps the text
    assert m["kl_mean"] == m["kl_p99"] == m["kl_max"] == 0.0
    assert m["top1_agreement"] == 1.0 and m["perplexity_a"] == m["perplexity_b"]
    assert m["engine_a"].startswith("transformers") and m["engine_b"].startswith("transformers")


def test_one_layers_scales_off_by_a_percent_are_seen(lossless, tmp_path):
    out, _ = lossless
    small = qconv.check_model(SOURCE, scaled(out, tmp_path / "x1.01", 1.01))
    large = qconv.check_model(SOURCE, scaled(out, tmp_path / "x1.05", 1.05))
    assert 0 < small.kl_mean < large.kl_mean and small.kl_p99 < large.kl_p99
    assert small.perplexity_a == large.perplexity_a != large.perplexity_b
    proc = run_qconv("validate", "--model", "--json", "--max-kl", f"{small.kl_mean / 2:.3g}", SOURCE,
                     tmp_path / "x1.01", check=1)
    doc = json.loads(proc.stdout)
    assert not doc["ok"] and math.isclose(doc["kl_mean"], small.kl_mean, rel_tol=1e-12)
    assert qconv.check_model(SOURCE, tmp_path / "x1.01", max_kl=small.kl_mean * 2).ok


def test_perplexity_is_transformers_own(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = CHECKPOINTS / "llama-fp16"
    ids = AutoTokenizer.from_pretrained(folder)(TEXT.read_text(encoding="utf-8"))["input_ids"][:256]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    m = qconv.check_model(folder, folder)
    assert m.data["tokens"] == len(ids) and m.kl_mean == 0.0
    assert math.isclose(m.perplexity_a, math.exp(loss), rel_tol=1e-5), (m.perplexity_a, math.exp(loss))


def test_refusals_are_one_line(tmp_path):
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(SOURCE, bare, ignore=shutil.ignore_patterns("tokenizer*", "oracle"))
    one_error(run_qconv("validate", "--model", bare, SOURCE), 5, str(bare), "has no tokenizer")

    short = tmp_path / "short.txt"
    short.write_text("When in the Course of human events.")
    one_error(run_qconv("validate", "--model", "--text", short, SOURCE, SOURCE), 2, "short.txt",
              f"at least {MIN_TOKENS}")

    other = tmp_path / "other-vocab"
    shutil.copytree(SOURCE, other, ignore=shutil.ignore_patterns("oracle"))
    doc = json.loads((other / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    first, last = min(vocab, key=vocab.get), max(vocab, key=vocab.get)     # two tokens' ids swapped
    vocab[first], vocab[last] = vocab[last], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(doc))
    one_error(run_qconv("validate", "--model", SOURCE, other), 5, str(other), "vocabulary is not A's")

    huge = tmp_path / "huge.txt"
    huge.write_text("When in the Course of human events. " * 30000)          # over 1 MiB: not read whole
    with pytest.raises(qconv.UsageError, match="over 1024 KiB"):
        qconv.check_model(SOURCE, SOURCE, text=huge)
    huge.unlink()
    one_error(run_qconv("validate", "--model", "--tol", "0.1", SOURCE, SOURCE), 2, "--tol")
    one_error(run_qconv("validate", "--text", short, SOURCE, SOURCE), 2, "--text needs --model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-tokenizer", "other-vocab", "short.txt"]


def test_the_figures_go_into_the_card(lossless, tmp_path):
    out = tmp_path / "with-card"
    proc = run_qconv("convert", "--json", "--check-model", SOURCE, out, "--to", "compressed-tensors", check=0)
    m = json.loads(proc.stdout)["model_check"]
    assert m == {**lossless[1].data["model_check"], "b": m["b"]}      # B: the staged result, then published
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    body = card.text
    assert "## Model-level check" in body and "| 0 | 0 | 0 | 100.00% |" in body
    assert m["text_sha256"] in body and "--check-model" in body

    bare = tmp_path / "no-tokenizer"
    shutil.copytree(SOURCE, bare, ignore=shutil.ignore_patterns("tokenizer*", "oracle"))
    proc = run_qconv("convert", "--json", "--check-model", bare, tmp_path / "out2", "--to", "compressed-tensors",
                     check=0)
    m = json.loads(proc.stdout)["model_check"]
    assert not m["ok"] and "has no tokenizer" in m["refused"]
    assert "could not run" in (tmp_path / "out2" / "README.md").read_text() and (tmp_path / "out2" / "config.json").is_file()
