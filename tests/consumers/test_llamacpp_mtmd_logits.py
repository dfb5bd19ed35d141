"""A VL model whole in llama.cpp, image included, computes what transformers computes: the GGUF pair
`qconv convert SRC out.gguf --to gguf` writes (the text model and `mmproj-out.gguf`, every tensor F32:
--gguf-float --gguf-float-type f32 --mmproj-type f32, exactly the bfloat16 sources' values), loaded by
llama.cpp's libmtmd (tests/consumers/mtmd_logits.py, .venv-llamacpp), answers the prompt
"hello <__media__> world" holding one fixed image, and its logits at EVERY text position (the 15 before
the image, which see text only, and the 14 after it) agree with transformers' Qwen2.5-VL / Qwen3-VL
forward on the same token ids (llama.cpp's, so tokenizers do not matter), pixels and M-RoPE positions
(llama.cpp's, which must equal transformers' own get_rope_index). Fixtures: qwen25vl-bf16 (224 x 168
image, 48 image tokens, two attention windows), qwen3vl-bf16 (320 x 256, 80 tokens, two deepstack layers;
its copy gets the tokenizer of qwen3vl-bnb8-skipvisual, as a GGUF needs one), qwen3vlmoe-bf16 (the same
image; its text decoder's experts in llama.cpp's qwen3vlmoe: within the same bounds), and qwen3vlmoe-released
(the same model with its experts as the released checkpoints store them, conftest.released_layout;
transformers reads that folder through its own conversion mapping).

What transformers is made to compute (_emulate_llama_cpp): llama.cpp's choices, not qconv's. Its CPU
conv runs the patch embedding in float16 and its GELU is a float16 table of the tanh approximation:
left as they are, the image embeddings differ by 4.1e-4 / 4.3e-4 and the logits by 4.0e-4 / 2.2e-4
(||difference||_F / ||transformers||_F, Qwen2.5-VL / Qwen3-VL). Its qwen2vl loader never reads the
stored RMSNorm eps and runs the text model with eps 0 (checked here from its own log): with the stored
1e-5, 6.2e-3. Its Qwen3-VL IMROPE leaves the 3 of 32 rotary pairs that sections [8, 12, 12] do not cover
unrotated, where transformers rotates them with t: 6.2e-5. Flash attention (K / V cast to float16) and
the float16 KV cache are turned off on llama.cpp's side instead.

Why the bounds. Measured (1, 2 or 4 threads on either side: the same numbers; reruns too),
Qwen2.5-VL / Qwen3-VL: logits 2.1e-6 / 1.5e-5 relative (||.||_F), max |difference| 3.9e-6 / 3.0e-5 of
the largest |logit| (1.8 / 1.2); image embeddings max |difference| 1.7e-5 / 8.6e-5 of the largest
(float32 rounding that flips some float16 roundings). REL_BOUND 1e-4, ABS_BOUND 2e-4 and EMBD_BOUND 5e-4
lie 6x to 7x above the worst; within them top-1 agrees at every position (the smallest gap between two
tokens is 2.8e-3). Negative controls, each the same comparison with one thing wrong (logits, relative):
transformers with Qwen2.5-VL's stored eps 6.2e-3; Qwen3-VL with eps 0, not its stored 1e-6, 6.3e-4; the
image's M-RoPE rows and columns swapped (a transposed grid) 1.1e-3 / 0.12; the Qwen2.5-VL mmproj with
v.post_ln.weight x 1.001 1.1e-3; Qwen3-VL's two deepstack mergers swapped in the mmproj 0.35: each at
least 6x above REL_BOUND, and required to be 5x above it. The file runs in 9 s on 2 idle cores."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from conftest import CHECKPOINTS, REPO, released_layout, run_qconv

LLAMA_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
SCRIPT = REPO / "tests" / "consumers" / "mtmd_logits.py"
PROMPT = "hello <__media__> world"
REL_BOUND = 1e-4      # ||llama - transformers||_F / ||transformers||_F over every text position's logits
ABS_BOUND = 2e-4      # max |llama - transformers| over them, relative to max |transformers|
EMBD_BOUND = 5e-4     # max |difference| of the image embeddings, relative to their max |value|

pytestmark = [pytest.mark.llamacpp, pytest.mark.consumer(LLAMA_PYTHON, "llama.cpp's Python bindings (.venv-llamacpp)")]

# model: (fixture, image width x height llama.cpp does not resize)
MODELS = {"qwen25vl": ("qwen25vl-bf16", (224, 168)), "qwen3vl": ("qwen3vl-bf16", (320, 256)),
          "qwen3vlmoe": ("qwen3vlmoe-bf16", (320, 256)), "qwen3vlmoe-released": ("qwen3vlmoe-bf16", (320, 256))}


def _image(w: int, h: int) -> np.ndarray:
    return np.random.default_rng(w * 1000 + h).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def _convert(tmp, model: str):
    """qconv's GGUF pair, every tensor F32, and the folder transformers loads. The float Qwen3-VL
    fixture has no tokenizer, which a GGUF needs: its copy gets its int8 twin's (a tiny byte-level
    BPE; the token ids are taken from llama.cpp's side, so which tokenizer does not matter)."""
    fixture, _ = MODELS[model]
    src = CHECKPOINTS / fixture
    if model.endswith("-released"):       # its experts as the released checkpoints store them (issue 53)
        src = released_layout(src, tmp / model)
    if not (src / "tokenizer.json").exists():
        src = shutil.copytree(src, tmp / fixture)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(CHECKPOINTS / "qwen3vl-bnb8-skipvisual" / name, src)
    dst = tmp / f"{model}.gguf"
    proc = run_qconv("convert", src, dst, "--to", "gguf", "--gguf-float", "--gguf-float-type", "f32",
                     "--mmproj-type", "f32", "--json", check=0)
    report = json.loads(proc.stdout)["components"][0]
    assert set(report["gguf_types"]) == {"F32"} and set(report["mmproj"]["gguf_types"]) == {"F32"}, report
    return dst, tmp / report["mmproj"]["file"], src


def _llama(text, mmproj, image, out) -> dict:
    np.save(out.with_suffix(".npy"), image)
    proc = subprocess.run([str(LLAMA_PYTHON), str(SCRIPT), str(text), str(mmproj), str(out.with_suffix(".npy")),
                           PROMPT, str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"llama.cpp exited {proc.returncode}: {proc.stderr[-3000:]}"
    return dict(np.load(out))


def _emulate_llama_cpp(model, pixels, rms_eps):
    """Make transformers compute what llama.cpp (this build, on CPU) computes where the two differ by
    design, not by float32 rounding: the patch Conv3d as a float16 im2col times a float16 kernel
    (ggml_conv_2d); every GELU of the tower and merger as ggml's CPU GELU (ggml-cpu/vec.h,
    GGML_GELU_FP16: the tanh approximation read from a float16 table, fp16(gelu_tanh(fp16(x))), 0 below
    -10 and x above 10, where transformers' mergers use the exact erf GELU); the text RMSNorm with the eps
    llama.cpp uses; and Qwen3-VL's interleaved M-RoPE with the rotary pairs no section covers left
    unrotated (llama.cpp drives them with a 4th position component, 0 for every token, where
    transformers uses t). Returns the pixels as llama.cpp's conv sees them."""
    import torch

    class GgmlGelu(torch.nn.Module):
        def forward(self, x):
            h = x.half().float()
            y = (0.5 * h * (1 + torch.tanh(0.7978845608028654 * h * (1 + 0.044715 * h * h)))).half().float()
            return torch.where(x <= -10, 0, torch.where(x >= 10, x, y)).to(x.dtype)

    visual = model.model.visual
    with torch.no_grad():
        visual.patch_embed.proj.weight.copy_(visual.patch_embed.proj.weight.half().float())
    for parent in list(visual.modules()):
        for name, child in list(parent.named_children()):
            if "GELU" in type(child).__name__.upper():
                setattr(parent, name, GgmlGelu())
    for module in model.model.language_model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = rms_eps
    if model.config.model_type in ("qwen3_vl", "qwen3_vl_moe"):
        rotary = model.model.language_model.rotary_emb
        s0, s1, s2 = rotary.mrope_section[:3]
        n = rotary.inv_freq.shape[0]
        free = [i for i in range(n) if not (i % 3 == 0 and i < 3 * s0 or i % 3 == 1 and i < 3 * s1
                                            or i % 3 == 2 and i < 3 * s2)]
        idx = torch.tensor(free + [i + n for i in free], dtype=torch.long)
        forward = rotary.forward

        def unrotated(x, position_ids):
            cos, sin = (t.clone() for t in forward(x, position_ids))
            cos[..., idx], sin[..., idx] = rotary.attention_scaling, 0.0
            return cos, sin

        rotary.forward = unrotated
    return pixels.half().float()


def _transformers(folder, image, got: dict, *, rms_eps: float, positions=None) -> dict:
    """transformers' Qwen2.5-VL / Qwen3-VL forward in float32 on llama.cpp's token ids (its image tokens
    replaced by a placeholder id), the same pixels (built as llama.cpp builds them, in float32: x / 255,
    (x - mean) / std, the frame repeated over the two temporal patches, patches in the merger's 2 x 2
    order) and the M-RoPE positions llama.cpp used (or ``positions``). Returns the image embeddings
    (Qwen3-VL: [merger, deepstack...]), the logits at the text positions and transformers' own
    get_rope_index positions."""
    import torch
    import transformers

    config = json.loads((folder / "config.json").read_text())
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    cls = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
           "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration}[config["model_type"]]
    model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    v = model.config.vision_config
    p, m, t = v.patch_size, v.spatial_merge_size, v.temporal_patch_size
    mean, std = (np.asarray(pre[k], np.float32) for k in ("image_mean", "image_std"))
    x = torch.from_numpy((image.astype(np.float32) / np.float32(255) - mean) / std).permute(2, 0, 1)
    c, h, w = x.shape
    gh, gw = h // p, w // p
    patches = x.unsqueeze(0).repeat(t, 1, 1, 1).reshape(1, t, c, gh // m, m, p, gw // m, m, p)
    pixels = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, c * t * p * p)
    grid = torch.tensor([[1, gh, gw]])
    pixels = _emulate_llama_cpp(model, pixels, rms_eps)
    tokens = torch.from_numpy(got["tokens"])
    image_token = next(i for i in range(model.config.text_config.vocab_size - 1, -1, -1) if i not in tokens)
    model.config.image_token_id = model.model.config.image_token_id = image_token   # the fixtures' is past the vocab
    ids = torch.where(tokens < 0, image_token, tokens)[None]
    mm_types = (tokens < 0).int()[None]
    position_ids = torch.from_numpy(got["positions"] if positions is None else positions).T[:, None]
    with torch.no_grad():
        rope, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
        out = model.model.get_image_features(pixels, grid, return_dict=True)
        embd = [torch.cat(out.pooler_output)] + [torch.cat(f) for f in getattr(out, "deepstack_features", None) or []]
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm_types,
                       position_ids=position_ids, use_cache=False).logits[0]
    return {"embd": torch.cat(embd, dim=-1).numpy(), "logits": logits[tokens >= 0].numpy(),
            "positions": rope[:, 0].T.numpy()}


def _differences(a, b) -> tuple[float, float]:
    """(||a - b||_F / ||b||_F, max |a - b| / max |b|)"""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)), float(np.abs(a - b).max() / np.abs(b).max())


def _llama_rms_eps(model: str, folder) -> float:
    """The text RMSNorm eps llama.cpp runs with: the stored one, but 0 for Qwen2.5-VL, whose qwen2vl
    loader (src/models/qwen2vl.cpp) never reads qwen2vl.attention.layer_norm_rms_epsilon."""
    if model == "qwen25vl":
        return 0.0
    return json.loads((folder / "config.json").read_text())["text_config"]["rms_norm_eps"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """model -> (text GGUF, mmproj GGUF, transformers' folder, image, llama.cpp's answer), made once."""
    done = {}

    def get(model):
        if model not in done:
            tmp = tmp_path_factory.mktemp(model)
            text, mmproj, folder = _convert(tmp, model)
            image = _image(*MODELS[model][1])
            done[model] = text, mmproj, folder, image, _llama(text, mmproj, image, tmp / "llama.npz")
        return done[model]
    return get


@pytest.mark.parametrize("model", MODELS)
def test_mtmd_logits_equal_transformers_at_every_text_position(run, model):
    text, mmproj, folder, image, got = run(model)
    eps = _llama_rms_eps(model, folder)
    assert float(got["rms_eps"]) == pytest.approx(eps, rel=0.05), "llama.cpp's text RMSNorm eps changed"
    tokens = got["tokens"]
    image_rows = np.flatnonzero(tokens < 0)
    assert len(image_rows) == len(got["embd"]) and image_rows[0] > 0 and image_rows[-1] < len(tokens) - 1
    assert np.all(np.diff(image_rows) == 1) and len(got["logits"]) == len(tokens) - len(image_rows)
    want = _transformers(folder, image, got, rms_eps=eps)
    assert (want["positions"] == got["positions"]).all(), "transformers' M-RoPE positions are not llama.cpp's"
    embd = _differences(got["embd"], want["embd"])[1]
    assert embd < EMBD_BOUND, f"{model}: the image embeddings differ by {embd:.3g}"
    rel, top = _differences(got["logits"], want["logits"])
    assert rel < REL_BOUND and top < ABS_BOUND, f"{model}: the logits differ by {rel:.3g} (max {top:.3g})"


def _transposed_grid(got) -> dict:
    positions = got["positions"].copy()
    image = got["tokens"] < 0
    positions[image] = positions[image][:, [0, 2, 1]]
    return {"positions": positions}


def _post_ln_scaled(tensors):
    tensors["v.post_ln.weight"].data[...] *= 1.001


def _deepstack_swapped(tensors):
    for name in [n for n in tensors if n.startswith("v.deepstack.0.")]:
        a, b = tensors[name], tensors[name.replace(".0.", ".1.")]
        kept = np.array(a.data)
        a.data[...] = b.data
        b.data[...] = kept


# (model, what goes wrong: transformers' side changed, or the mmproj file edited before llama.cpp runs it)
CONTROLS = [
    ("qwen25vl", "stored-rms-eps", lambda got: {"rms_eps": 1e-5}, None),
    ("qwen3vl", "rms-eps-0", lambda got: {"rms_eps": 0.0}, None),
    ("qwen25vl", "grid-transposed", _transposed_grid, None),
    ("qwen3vl", "grid-transposed", _transposed_grid, None),
    ("qwen25vl", "mmproj-post-ln-x1.001", lambda got: {}, _post_ln_scaled),
    ("qwen3vl", "mmproj-deepstack-swapped", lambda got: {}, _deepstack_swapped),
    ("qwen3vlmoe", "grid-transposed", _transposed_grid, None),
]


@pytest.mark.parametrize("model, case, change, edit", CONTROLS, ids=[f"{c[0]}-{c[1]}" for c in CONTROLS])
def test_negative_control_fails_the_bound(run, tmp_path, model, case, change, edit):
    """The same comparison with one thing wrong: the text RMSNorm eps (Qwen2.5-VL: the stored one, which
    llama.cpp does not use; Qwen3-VL: 0, not the stored one, which it does), the image's M-RoPE rows and
    columns swapped (a transposed grid), one mmproj tensor 0.1 % off, Qwen3-VL's two deepstack mergers
    swapped in the mmproj file."""
    import gguf

    text, mmproj, folder, image, got = run(model)
    if edit is not None:
        shutil.copy(mmproj, tmp_path / mmproj.name)
        reader = gguf.GGUFReader(tmp_path / mmproj.name, "r+")
        edit({t.name: t for t in reader.tensors})
        reader.data.flush()
        got = _llama(text, tmp_path / mmproj.name, image, tmp_path / "llama.npz")
    want = _transformers(folder, image, got, **{"rms_eps": _llama_rms_eps(model, folder), **change(got)})
    rel, top = _differences(got["logits"], want["logits"])
    assert rel > 5 * REL_BOUND, f"{model} {case}: the logits differ by only {rel:.3g} (max {top:.3g})"
