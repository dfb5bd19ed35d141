"""The model card every writing verb leaves (convert/card.py), read back by the Hub's own parser
(huggingface_hub.ModelCard, offline): its front matter, the body's account of the run against the run's own
--json report, and the SHA-256 table against the files themselves."""

import hashlib
import json
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from conftest import CHECKPOINTS, QCONV, REPO, child_env, child_signals, copy_checkpoint, one_error, run_qconv

GPTQ = "llama-gptq-w4g64-asym"          # GPTQModel 4-bit group 64, asymmetric: every code fits compressed-tensors
MLX = "llama-mlx-w4g64"                 # mlx_lm.convert, with the card mlx_lm wrote (front matter only)
MIXED = "llama-mlx-mixed36"             # the same, mlx-lm's mixed_3_6 recipe
SOURCE_CARD = """---
license: apache-2.0
base_model: example-org/Tiny-Llama-Base
pipeline_tag: text-generation
tags:
- gptq
---
# Tiny Llama GPTQ

The source's own text: | a pipe | and `code`.
"""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hash_table(text: str) -> dict[str, str]:
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| `") and len(line.split("|")) == 4]
    return {r[1].strip(" `"): r[2].strip(" `") for r in rows if len(r[2].strip(" `")) == 64}


def _convert(src, dst, *args, check=0):
    proc = run_qconv("convert", "--json", src, dst, *args, check=check)
    return json.loads(proc.stdout) if check == 0 else proc


def test_a_lossless_conversion_card_reads_in_the_hubs_parser_and_its_hashes_are_the_files(tmp_path):
    src = copy_checkpoint(GPTQ, tmp_path)
    (src / "README.md").write_text(SOURCE_CARD)
    dst = tmp_path / "tiny-ct"
    result = _convert(src, dst, "--to", "compressed-tensors", "--validate", "--jobs", "1")
    # every code kept: no error to draw
    assert result["card"] == {"file": "README.md", "picture": None, "base_model": "example-org/Tiny-Llama-Base",
                              "warnings": []}
    text = (dst / "README.md").read_text()
    card = ModelCard(text)
    meta = card.data.to_dict()
    # a quantized source's card names its base: the output quantizes the same model
    assert meta["base_model"] == "example-org/Tiny-Llama-Base" and meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0" and meta["pipeline_tag"] == "text-generation"
    assert meta["library_name"] == "transformers"
    assert meta["tags"] == ["qconv", "compressed-tensors", "4-bit"]
    (comp,) = result["components"]
    assert comp["codes_kept"] == comp["modules"] == 14 and comp["requantized"] == 0
    assert f"{comp['modules']} quantized modules, **14 with their codes kept** exactly, 0 requantized" in card.text
    assert "passed: 16 layers of the result read back" in card.text
    assert "qconv convert llama-gptq-w4g64-asym tiny-ct --to compressed-tensors" in card.text
    # every source file read or carried and every output file but the card itself, each hash the file's
    hashes = _hash_table(text)
    sources = sorted(p.name for p in src.iterdir() if p.is_file())
    outputs = sorted(p.name for p in dst.iterdir() if p.is_file() and p.name != "README.md")
    assert sorted(hashes) == sorted([f"source/{n}" for n in sources] + [f"output/{n}" for n in outputs])
    for name, digest in hashes.items():
        side, file = name.split("/", 1)
        assert digest == _sha((src if side == "source" else dst) / file), name
    # the source's own card below, as it was, marked as the source's; its README is not also carried
    assert "## The source's model card (llama-gptq-w4g64-asym/README.md, as it was)" in card.text
    assert card.text.rstrip().endswith("The source's own text: | a pipe | and `code`.")
    assert text.count("---\n") >= 3


def test_a_gguf_gets_its_card_beside_it_with_every_requantized_module_and_its_error(tmp_path):
    """mlx_lm's mixed_3_6 folder into GGUF: its 3-bit modules keep their codes (Q4_1), its 6-bit ones no
    GGUF type holds with float offsets (Q8_0, requantized): the card lists each of those with its error."""
    dst = tmp_path / "tiny.gguf"
    result = _convert(CHECKPOINTS / MIXED, dst, "--to", "gguf", "--jobs", "1", "--base-model", "example-org/Tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf", "tiny.md"]
    assert result["card"]["picture"] is None                    # no matplotlib here: the card says how
    card = ModelCard((tmp_path / "tiny.md").read_text())
    meta = card.data.to_dict()
    # mlx_lm's card says library mlx: the GGUF is not, and says gguf; its language and pipeline carried
    assert "library_name" not in meta and meta["tags"] == ["qconv", "gguf", "4-bit", "8-bit"]   # Q4_1, Q8_0
    assert meta["language"] == "en" and meta["pipeline_tag"] == "text-generation"
    assert meta["base_model"] == "example-org/Tiny"
    (comp,) = result["components"]
    rows = [line.split(" | ") for line in card.text.splitlines() if line.startswith(f"| {MIXED} | `")]
    assert len(rows) == comp["requantized"] == 3 and comp["codes_kept"] == 13
    for r in comp["layers"]:
        row = next(x for x in rows if x[1] == f"`{r['module']}`")
        assert float(row[3]) == pytest.approx(r["rel_frobenius"], rel=1e-3)
        assert float(row[4].rstrip(" |")) == pytest.approx(r["rtn_rel_frobenius"], rel=1e-3)
    assert {t for t in comp["gguf_types"] if t.startswith("Q")} == {"Q4_1", "Q8_0"}
    types = ", ".join(f"{n} {t}" for t, n in comp["gguf_types"].items())
    assert f"tensor types: {types}" in card.text
    assert "needs matplotlib: `pip install qconv[plot]`" in card.text
    hashes = _hash_table((tmp_path / "tiny.md").read_text())
    assert hashes["output/tiny.gguf"] == _sha(dst)
    assert hashes["source/model.safetensors"] == _sha(CHECKPOINTS / MIXED / "model.safetensors")


def test_the_card_is_the_same_wherever_the_run_is_and_no_card_leaves_the_source_readme(tmp_path):
    a, b = tmp_path / "a" / "out", tmp_path / "b" / "out"
    for dst in (a, b):
        _convert(CHECKPOINTS / GPTQ, dst, "--to", "gptq-v2", "--jobs", "1")
    assert (a / "README.md").read_bytes() == (b / "README.md").read_bytes()
    src = copy_checkpoint(GPTQ, tmp_path)
    (src / "README.md").write_text(SOURCE_CARD)
    plain = tmp_path / "plain"
    result = _convert(src, plain, "--to", "gptq-v2", "--no-card")
    assert "card" not in result
    assert (plain / "README.md").read_text() == SOURCE_CARD


def test_a_float_sources_base_is_its_cache_repository_not_its_cards_parent(tmp_path):
    # a float model's card names what it was fine-tuned from: the quantization's base is the model itself,
    # which a Hugging Face cache snapshot names
    repo = tmp_path / "hub" / "models--example-org--Tiny-Qwen3-MoE"
    snap = repo / "snapshots" / "0123abcd"
    shutil.copytree(CHECKPOINTS / "qwen3moe-bf16", snap, ignore=shutil.ignore_patterns("oracle"))
    (repo / "blobs").mkdir()
    (snap / "README.md").write_text("---\nbase_model: example-org/Its-Parent\nlicense: mit\n---\nA fine-tune.\n")
    dst = tmp_path / "out"
    result = _convert(snap, dst, "--to", "compressed-tensors", "--bits", "8", "--no-search", "--jobs", "1")
    meta = ModelCard((dst / "README.md").read_text()).data.to_dict()
    assert meta["base_model"] == "example-org/Tiny-Qwen3-MoE" and meta["license"] == "mit"
    assert meta["tags"] == ["qconv", "compressed-tensors", "8-bit"]
    (comp,) = result["components"]
    assert comp["from"] == "unquantized" and comp["requantized"] == comp["modules"] > 0


def test_dequantize_and_bnb8_to_gptq_leave_cards(tmp_path):
    out = tmp_path / "float"
    proc = run_qconv("dequantize", "--json", CHECKPOINTS / MLX, out, "--dtype", "float32", "--jobs", "1", check=0)
    assert json.loads(proc.stdout)["card"]["file"] == "README.md"
    card = ModelCard((out / "README.md").read_text())
    assert card.data.to_dict()["tags"] == ["qconv", "dequantized"]
    assert "16 quantized modules (MLX) dequantized exactly to float32" in card.text
    assert "qconv dequantize llama-mlx-w4g64 float --dtype float32" in card.text
    gptq = tmp_path / "gptq"
    run_qconv("bnb8-to-gptq", CHECKPOINTS / "llama-bnb8", gptq, "--scale-dtype", "float32", "--jobs", "1", check=0)
    card = ModelCard((gptq / "README.md").read_text())
    assert card.data.to_dict()["tags"] == ["qconv", "gptq", "8-bit"]
    assert "qconv bnb8-to-gptq llama-bnb8 gptq --scale-dtype float32" in card.text


@pytest.mark.parametrize("readme, said", [
    (b"---\nlicense: [unclosed\n---\nbody text\n", "its front matter is not YAML"),
    (b"---\n- a\n- list\n---\nbody text\n", "its front matter is not a mapping"),
    (b"\xff\xfe not utf-8", "not UTF-8"),
])
def test_a_source_card_qconv_cannot_read_is_said_and_the_card_still_written(tmp_path, readme, said):
    src = copy_checkpoint(GPTQ, tmp_path)
    (src / "README.md").write_bytes(readme)
    dst = tmp_path / "out"
    result = _convert(src, dst, "--to", "gptq-v2")
    (warning,) = result["card"]["warnings"]
    assert said in warning and str(src / "README.md") in warning
    card = ModelCard((dst / "README.md").read_text())
    assert "license" not in card.data.to_dict() and said in card.text
    assert ("body text" in card.text) == readme.endswith(b"body text\n")


def test_a_card_beside_a_gguf_that_exists_is_refused_before_any_work(tmp_path):
    (tmp_path / "tiny.md").write_text("mine\n")
    proc = _convert(CHECKPOINTS / MLX, tmp_path / "tiny.gguf", "--to", "gguf", check=6)
    one_error(proc, 6, "tiny.md", "exists; pass --overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.md"]
    assert (tmp_path / "tiny.md").read_text() == "mine\n"
    _convert(CHECKPOINTS / MLX, tmp_path / "tiny.gguf", "--to", "gguf", "--overwrite", "--jobs", "1")
    assert ModelCard((tmp_path / "tiny.md").read_text()).data.to_dict()["tags"][1] == "gguf"


def test_a_base_model_that_is_not_a_repository_id_is_a_usage_error(tmp_path):
    proc = run_qconv("convert", CHECKPOINTS / GPTQ, tmp_path / "out", "--to", "gptq-v2", "--base-model", "../x")
    one_error(proc, 2, "base_model '../x' is not a Hugging Face repository id")
    assert not (tmp_path / "out").exists()


def test_a_link_out_of_src_that_the_card_would_hash_is_refused_before_any_work(tmp_path):
    src = copy_checkpoint(GPTQ, tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the model's")
    (src / "notes.txt").symlink_to(outside)
    proc = _convert(src, tmp_path / "m.gguf", "--to", "gguf", check=4)
    one_error(proc, 4, "notes.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [GPTQ, "outside.txt"]
    _convert(src, tmp_path / "m.gguf", "--to", "gguf", "--no-card")      # the GGUF itself reads no such file


PLOT = REPO / ".venv-plot"              # qconv[plot]'s matplotlib, made by bin/setup test, kept off .venv's path


def _png_size(data: bytes) -> tuple[int, int]:
    """A PNG's width and height, its signature, IHDR and IDAT checked (8-bit RGBA, every row present)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (size,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + size]
        assert struct.unpack(">I", data[pos + 8 + size:pos + 12 + size])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + size
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 6) and b"IEND" in chunks
    assert len(zlib.decompress(chunks[b"IDAT"])) == height * (1 + 4 * width)
    return width, height


@pytest.mark.consumer(PLOT / "matplotlib", "matplotlib (in .venv-plot)")
def test_with_matplotlib_the_card_embeds_a_picture_of_the_per_layer_error(tmp_path):
    def convert(dst, jobs, src=MIXED):
        proc = subprocess.run([QCONV, "convert", "--json", CHECKPOINTS / src, dst, "--to", "gguf", "--jobs", jobs],
                              capture_output=True, text=True, timeout=300, env=child_env(PYTHONPATH=str(PLOT)),
                              preexec_fn=child_signals())
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    result = convert(tmp_path / "tiny.gguf", "1")
    assert result["card"]["picture"] == "tiny-error.png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-error.png", "tiny.gguf", "tiny.md"]
    assert _png_size((tmp_path / "tiny-error.png").read_bytes()) == (900, 320)
    text = (tmp_path / "tiny.md").read_text()
    assert "![per-layer relative error of the conversion](tiny-error.png)" in ModelCard(text).text
    assert _hash_table(text)["output/tiny-error.png"] == _sha(tmp_path / "tiny-error.png")
    # the same bytes, the picture's included, from a second run elsewhere with other --jobs
    convert(tmp_path / "again" / "tiny.gguf", "2")
    for name in ("tiny.md", "tiny-error.png", "tiny.gguf"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / name).read_bytes(), name
    # every code kept (GPTQ 8-bit -> Q8_0): no error to draw, no picture
    kept = convert(tmp_path / "kept" / "k.gguf", "1", "llama-gptq-w8g128")
    assert kept["components"][0]["requantized"] == 0 and kept["card"]["picture"] is None
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["k.gguf", "k.md"]
