"""A VL model whole in llama.cpp: `qconv convert SRC out.gguf --to gguf` writes the text model and its vision
tower as `mmproj-out.gguf`; llama.cpp's libmtmd (llama_cpp.mtmd_cpp, .venv-llamacpp) loads the pair,
encodes fixed images, and its image embeddings (the vision tower and merger's output, Qwen3-VL's deepstack
features after it) equal transformers' own vision tower on the same pixels.

Sources: the float Qwen2.5-VL fixture (the tower copied: bfloat16 as the source, and --mmproj-type f32),
and Qwen3-VL in bitsandbytes int8 with its vision tower quantized (the seed-000 situation: the tower's
Linears dequantized exactly, F32), compared with transformers' Qwen3-VL on the float folder
`qconv dequantize` makes of the same source (its exact weights).

Why the bounds. llama.cpp computes the tower with its own kernels (flash attention; bf16 weights
multiplied as bf16, where transformers upcasts them to float32 here): measured on these fixtures, the
largest |difference| relative to the largest |embedding| is 4.4e-4 to 5.5e-4 for F32 towers and 2.2e-3 to
2.8e-3 for the BF16 one. Negative controls, on the F32 file with one layout error each: attn_q and attn_k
swapped in one layer 1.7e-2, a gated MLP's gate and up swapped 3.5e-2, the Conv3d patch embedding split
wrong (its first temporal kernel twice) 0.84. TOLERANCE: 2e-3 for F32 towers (4x above the worst), 6e-3
for BF16 ones (2x); every control lies at least 8x above the F32 bound.

Q8_0 towers (--mmproj-type q8_0): ggml multiplies a Q8_0 weight by activations it quantizes to 8 bits
per 32-block too (vec_dot_q8_0_q8_0), so its output is further from transformers' float32 whatever the
weights: 1.0e-2 from bitsandbytes' own codes kept (weights within 2^-11 of bitsandbytes' dequantization,
test_gguf_mmproj checks the codes), 2.1e-2 from the bf16 tower quantized (its ~1 % weight error on top).
Bound 4e-2 (2x); control: the Q8_0 file with the merger's first Linear's rows reversed, 1.39."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from conftest import CHECKPOINTS, REPO, run_qconv

LLAMA_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
SCRIPT = REPO / "tests" / "consumers" / "mtmd_embed.py"
TOLERANCE = {"F32": 2e-3, "BF16": 6e-3, "Q8_0": 4e-2}      # by the type of the tower's 2-D weights

pytestmark = [pytest.mark.llamacpp, pytest.mark.consumer(LLAMA_PYTHON, "llama.cpp's Python bindings (.venv-llamacpp)")]

# (case, fixture, extra convert arguments, image sizes llama.cpp does not resize, mmproj types written)
CASES = [
    ("qwen25vl-bf16", "qwen25vl-bf16", (), "112x112,224x168", {"BF16": 16, "F32": 23}),
    ("qwen25vl-f32", "qwen25vl-bf16", ("--mmproj-type", "f32"), "224x168", {"F32": 39}),
    ("qwen3vl-bnb8", "qwen3vl-bnb8-skipvisual", (), "128x128,160x96", {"F32": 46}),
    ("qwen3vl-bnb8-q8_0", "qwen3vl-bnb8-skipvisual", ("--mmproj-type", "q8_0"), "128x128,160x96",
     {"F32": 32, "Q8_0": 14}),
    ("qwen25vl-q8_0", "qwen25vl-bf16", ("--mmproj-type", "q8_0"), "224x168", {"F32": 23, "Q8_0": 16}),
    ("qwen3vlmoe-f32", "qwen3vlmoe-bf16", ("--mmproj-type", "f32"), "128x128", {"F32": 46}),
]


def _mtmd(text, mmproj, sizes, out) -> dict:
    proc = subprocess.run([str(LLAMA_PYTHON), str(SCRIPT), str(text), str(mmproj), sizes, str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"llama.cpp exited {proc.returncode}: {proc.stderr[-3000:]}"
    return dict(np.load(out))


def _transformers(folder, images: dict) -> dict:
    """transformers' vision tower (and merger; Qwen3-VL: [merger, deepstack...] concatenated, as llama.cpp
    feeds them) on each image as its processor lays out a still image: x / 255, (x - mean) / std,
    repeated over the two temporal patches, patches in the merger's 2 x 2 order."""
    import torch
    import transformers

    config = json.loads((folder / "config.json").read_text())
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    cls = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
           "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration}[config["model_type"]]
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    v = model.config.vision_config
    p, m, t = v.patch_size, v.spatial_merge_size, v.temporal_patch_size
    mean, std = (torch.tensor(pre[k], dtype=torch.float64) for k in ("image_mean", "image_std"))
    out = {}
    for key, image in images.items():
        x = ((torch.from_numpy(image).double() / 255 - mean) / std).permute(2, 0, 1).float()
        c, h, w = x.shape
        gh, gw = h // p, w // p
        patches = x.unsqueeze(0).repeat(t, 1, 1, 1).reshape(1, t, c, gh // m, m, p, gw // m, m, p)
        pixels = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, c * t * p * p)
        with torch.no_grad():
            y = model.model.visual(pixels, grid_thw=torch.tensor([[1, gh, gw]]))
        parts = [y.pooler_output] + list(getattr(y, "deepstack_features", None) or [])
        out[key] = torch.cat(parts, dim=-1).float().numpy()
    return out


def _gguf_types(path) -> dict:
    import gguf

    types: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return dict(sorted(types.items()))


@pytest.mark.parametrize("case, fixture, args, sizes, types", CASES, ids=[c[0] for c in CASES])
def test_mtmd_image_embeddings_equal_transformers_vision_tower(tmp_path, case, fixture, args, sizes, types):
    src = CHECKPOINTS / fixture
    dst = tmp_path / f"{case}.gguf"
    proc = run_qconv("convert", src, dst, "--to", "gguf", *args, "--json", check=0)
    report = json.loads(proc.stdout)["components"][0]
    mmproj = tmp_path / f"mmproj-{case}.gguf"
    assert report["mmproj"]["file"] == mmproj.name and mmproj.is_file()
    assert _gguf_types(mmproj) == types == report["mmproj"]["gguf_types"]
    got = _mtmd(dst, mmproj, sizes, tmp_path / "mtmd.npz")
    reference = src
    if report["mmproj"]["dequantized_modules"] or report["mmproj"]["codes_kept_modules"]:   # a quantized tower:
        # transformers on the source's exact weights, as a float folder
        reference = tmp_path / "float"
        run_qconv("dequantize", src, reference, "--dtype", "float32", check=0)
    images = {k[4:]: v for k, v in got.items() if k.startswith("img_")}
    want = _transformers(reference, images)
    for size in sizes.split(","):
        a, b = got[f"embd_{size}"], want[size]
        assert a.shape == b.shape, (size, a.shape, b.shape)
        rel = float(np.abs(a - b).max() / np.abs(b).max())
        bound = TOLERANCE[next(t for t in ("Q8_0", "BF16", "F32") if t in types)]
        assert rel < bound, f"{case} {size}: llama.cpp's image embeddings differ from transformers' by {rel:.3g}"


# layout errors a writer could make: q and k rows swapped in one layer; the patch embedding's first temporal
# kernel written twice (the Conv3d split wrong); the gated MLP's gate and up swapped in one layer
CONTROLS = [("v.blk.1.attn_q.weight", "v.blk.1.attn_k.weight"), ("v.patch_embd.weight.1", "v.patch_embd.weight"),
            ("v.blk.0.ffn_gate.weight", "v.blk.0.ffn_up.weight")]


@pytest.mark.parametrize("a, b", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_a_layout_error_is_caught(tmp_path, a, b):
    """The negative control: the same mmproj file with one layout error."""
    import gguf

    dst = tmp_path / "m.gguf"
    run_qconv("convert", CHECKPOINTS / "qwen25vl-bf16", dst, "--to", "gguf", "--mmproj-type", "f32", check=0)
    reader = gguf.GGUFReader(tmp_path / "mmproj-m.gguf", "r+")
    x, y = (next(t for t in reader.tensors if t.name == name) for name in (a, b))
    kept = np.array(x.data)
    x.data[...] = y.data
    if ".patch_embd." not in a:
        y.data[...] = kept
    reader.data.flush()
    got = _mtmd(dst, tmp_path / "mmproj-m.gguf", "224x168", tmp_path / "mtmd.npz")
    want = _transformers(CHECKPOINTS / "qwen25vl-bf16", {"224x168": got["img_224x168"]})["224x168"]
    rel = float(np.abs(got["embd_224x168"] - want).max() / np.abs(want).max())
    assert rel > 5 * TOLERANCE["F32"], rel


def test_a_q8_0_layout_error_is_caught(tmp_path):
    """The Q8_0 bound's negative control: the bitsandbytes tower as Q8_0, the merger's first Linear's rows
    (its Q8_0 blocks) reversed."""
    import gguf

    src, dst = CHECKPOINTS / "qwen3vl-bnb8-skipvisual", tmp_path / "m.gguf"
    run_qconv("convert", src, dst, "--to", "gguf", "--mmproj-type", "q8_0", check=0)
    reader = gguf.GGUFReader(tmp_path / "mmproj-m.gguf", "r+")
    x = next(t for t in reader.tensors if t.name == "mm.0.weight")
    x.data[...] = np.array(x.data)[::-1]
    reader.data.flush()
    got = _mtmd(dst, tmp_path / "mmproj-m.gguf", "128x128", tmp_path / "mtmd.npz")
    run_qconv("dequantize", src, tmp_path / "float", "--dtype", "float32", check=0)
    want = _transformers(tmp_path / "float", {"128x128": got["img_128x128"]})["128x128"]
    rel = float(np.abs(got["embd_128x128"] - want).max() / np.abs(want).max())
    assert rel > 5 * TOLERANCE["Q8_0"], rel


@pytest.mark.parametrize("mmproj_type, types", [("auto", {"F32": 46}), ("q8_0", {"F32": 32, "Q8_0": 14})])
def test_a_gptq_tower_in_mtmd(tmp_path, mmproj_type, types):
    """A GPTQ vision tower (no producer here writes a GPTQ VL model: qconv's own bnb8-to-gptq of the
    Qwen3-VL fixture, every code kept, whose GPTQ reading is proven against GPTQModel's files elsewhere):
    its mmproj file, the tower dequantized exactly or its 8-bit codes kept as Q8_0, gives llama.cpp's
    libmtmd the image embeddings of transformers on the GPTQ folder's exact weights."""
    src = tmp_path / "gptq"
    run_qconv("convert", CHECKPOINTS / "qwen3vl-bnb8-skipvisual", src, "--to", "gptq", "--bits", "8", check=0)
    config = json.loads((src / "config.json").read_text())
    assert "model.visual.blocks" in config["quantization_config"]["block_name_to_quantize"]
    dst = tmp_path / "m.gguf"
    proc = run_qconv("convert", src, dst, "--to", "gguf", "--mmproj-type", mmproj_type, "--json", check=0)
    mm = json.loads(proc.stdout)["components"][0]["mmproj"]
    assert mm["gguf_types"] == types and mm["dequantized_modules"] + mm["codes_kept_modules"] == 14
    got = _mtmd(dst, tmp_path / "mmproj-m.gguf", "128x128", tmp_path / "mtmd.npz")
    run_qconv("dequantize", src, tmp_path / "float", "--dtype", "float32", check=0)
    want = _transformers(tmp_path / "float", {"128x128": got["img_128x128"]})["128x128"]
    rel = float(np.abs(got["embd_128x128"] - want).max() / np.abs(want).max())
    assert rel < TOLERANCE["Q8_0" if "Q8_0" in types else "F32"], rel
