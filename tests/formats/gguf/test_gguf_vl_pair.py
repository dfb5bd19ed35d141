"""A GGUF pair read back: a VL text model (qwen2vl, qwen3vl) with llama.cpp's mmproj file beside it
(mmproj-<name>.gguf) is the VL model whole to every verb: `qconv dequantize` writes the folder transformers
loads (config.json with text and vision configs, preprocessor_config.json, the tower under model.visual),
`qconv convert` to another format or back to GGUF keeps it. Without the mmproj file it is the text
model (a warning names the file it looked for). Oracles: the source folder's own tensors and transformers'
forward on it; bitsandbytes' stored int8 codes and scales for a Q8_0 tower."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors import safe_open

from conftest import CHECKPOINTS, inspect_json, load_tensors, one_error, released_layout, run_qconv


def _pair(tmp_path, fixture, *args):
    """`--to gguf` of a fixture (qwen3vl-bf16, which has no tokenizer, with its int8 twin's;
    qwen3vlmoe-released: qwen3vlmoe-bf16 with its experts as the released checkpoints store them)."""
    src = CHECKPOINTS / fixture
    if fixture == "qwen3vlmoe-released":
        src = released_layout(CHECKPOINTS / "qwen3vlmoe-bf16", tmp_path / fixture)
    if not (src / "tokenizer.json").exists():
        src = shutil.copytree(src, tmp_path / fixture)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(CHECKPOINTS / "qwen3vl-bnb8-skipvisual" / name, src)
    dst = tmp_path / "m.gguf"
    run_qconv("convert", src, dst, "--to", "gguf", *args, check=0)
    assert (tmp_path / "mmproj-m.gguf").is_file()
    return src, dst


def _vl_name(name: str) -> str:
    """A source tensor's name as transformers 5 saves a VL model (the read-back folder's names)."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
        return "model.language_model." + name[len("model."):]
    return name


def _vl_logits(folder):
    """transformers' VL forward in float32 on a fixed prompt holding one 16 x 16-patch image (random pixels,
    the image token moved into the tiny vocab): its M-RoPE positions, vision tower and merger all count."""
    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    v, vocab = model.config.vision_config, model.config.text_config.vocab_size
    g = 8 * v.spatial_merge_size                      # 16 x 16 patches: Qwen2.5-VL attends in 2 x 2 windows
    pixels = torch.randn(g * g, 3 * v.temporal_patch_size * v.patch_size ** 2,
                         generator=torch.Generator().manual_seed(0))
    image = vocab - 1
    model.config.image_token_id = model.model.config.image_token_id = image
    ids = torch.tensor([[5, 6, 7] + [image] * (g * g // v.spatial_merge_size ** 2) + [8, 9, 10]])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, g, g]]),
                     mm_token_type_ids=(ids == image).int()).logits


@pytest.mark.parametrize("fixture", ["qwen25vl-bf16", "qwen3vl-bf16", "qwen3vlmoe-released"])
def test_a_gguf_pair_dequantizes_to_the_vl_model(tmp_path, fixture):
    """Written with its codes kept (--gguf-float: every bfloat16 tensor as BF16, norms and biases F32),
    read back: every tensor of the source, byte for byte under transformers 5's names; the configs say
    the same model, and transformers' VL forward with an image gives the source's logits exactly.
    Qwen3-VL-MoE: llama.cpp's stacked experts come back fused in the released layout the source has
    ([E, H, 2I] / [E, I, H]: convert/fused_experts.py), the one transformers, vLLM and mlx-lm read."""
    import torch

    src, gguf_file = _pair(tmp_path, fixture, "--gguf-float")
    assert inspect_json(gguf_file)["gguf"]["mmproj_beside"] == "mmproj-m.gguf"
    run_qconv("dequantize", gguf_file, tmp_path / "back", check=0)
    back = tmp_path / "back"
    want = {_vl_name(k): v for k, v in load_tensors(src).items()}
    got = load_tensors(back)
    assert sorted(got) == sorted(want)
    assert [k for k in got if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    a, b = (json.loads((f / "config.json").read_text()) for f in (src, back))
    assert (b["architectures"], b["model_type"]) == (a["architectures"], a["model_type"])
    keys = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size",
            "temporal_patch_size", "out_hidden_size", "hidden_act", "fullatt_block_indexes", "window_size",
            "deepstack_visual_indexes", "num_position_embeddings", "in_channels")
    assert {k: b["vision_config"].get(k) for k in keys} == {k: a["vision_config"].get(k) for k in keys}
    assert b["text_config"]["rope_parameters"] == a["text_config"]["rope_parameters"]
    pa, pb = (json.loads((f / "preprocessor_config.json").read_text()) for f in (src, back))
    for k in ("image_mean", "image_std"):
        assert np.array_equal(np.float32(pa[k]), np.float32(pb[k])), k
    assert {k: pb[k] for k in ("patch_size", "merge_size", "temporal_patch_size")} == \
        {k: pa[k] for k in ("patch_size", "merge_size", "temporal_patch_size")}
    assert torch.equal(_vl_logits(back), _vl_logits(src))


def test_a_gguf_pair_converts_back_to_the_same_pair(tmp_path):
    """GGUF pair -> --to gguf: the mmproj file written from the one read back is the same file (every
    tensor and key but general.name), and --validate reads both back."""
    import gguf

    _, first = _pair(tmp_path, "qwen25vl-bf16", "--gguf-float")
    proc = run_qconv("convert", first, tmp_path / "again" / "m.gguf", "--to", "gguf", "--gguf-float", "--validate",
                     "--json", check=0)
    assert json.loads(proc.stdout)["components"][0]["mmproj"]["validation"]["ok"] is True

    def read(path):
        r = gguf.GGUFReader(path)
        return ({k: f.contents() for k, f in r.fields.items() if k != "general.name"},
                {t.name: (t.tensor_type.name, np.array(t.data).tobytes()) for t in r.tensors})
    assert read(tmp_path / "mmproj-m.gguf") == read(tmp_path / "again" / "mmproj-m.gguf")


def test_a_q8_0_tower_reads_back_as_its_codes(tmp_path):
    """The bitsandbytes int8 tower as Q8_0 (--mmproj-type q8_0) read back: its Linears are modules of
    8-bit codes (the gguf family's), and dequantized each is bitsandbytes' int8 codes times its row's
    SCB / 127 in float16, exactly."""
    src, gguf_file = _pair(tmp_path, "qwen3vl-bnb8-skipvisual", "--mmproj-type", "q8_0")
    proc = run_qconv("dequantize", gguf_file, tmp_path / "back", "--dtype", "float32", "--json", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["dequantized_modules"] == 14 + 14        # the text decoder's 14 Linears and the tower's
    got = load_tensors(tmp_path / "back")
    with safe_open(next(src.glob("*.safetensors")), "np") as f:
        stems = [k[:-len(".SCB")] for k in f.keys() if k.startswith("model.visual.") and k.endswith(".SCB")]
        assert len(stems) == 14
        for stem in stems:
            codes, scb = f.get_tensor(stem + ".weight"), f.get_tensor(stem + ".SCB")
            want = codes.astype(np.float32) * (scb / np.float32(127)).astype(np.float16).astype(np.float32)[:, None]
            assert np.array_equal(got[stem + ".weight"].numpy(), want), stem


def test_without_the_mmproj_file_it_is_the_text_model(tmp_path):
    _, gguf_file = _pair(tmp_path, "qwen25vl-bf16", "--gguf-float")
    (tmp_path / "mmproj-m.gguf").rename(tmp_path / "elsewhere.gguf")
    assert inspect_json(gguf_file)["gguf"]["mmproj_beside"] is None
    assert "no mmproj file beside it (llama.cpp's mmproj-m.gguf)" in run_qconv("inspect", gguf_file, check=0).stdout
    proc = run_qconv("dequantize", gguf_file, tmp_path / "back", check=0)
    assert "no mmproj-m.gguf (llama.cpp's mmproj file) lies beside it" in proc.stderr
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "vision_config" not in config
    assert not (tmp_path / "back" / "preprocessor_config.json").exists()


def _edit_mmproj(path, drop=None, keys=None):
    """The mmproj file rewritten with gguf-py: a tensor dropped, keys changed."""
    import gguf

    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(path.with_suffix(".new"), "clip")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        value = (keys or {}).get(k, f.contents())
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(k, value)
        else:
            w.add_key_value(k, value, kind)
    for t in r.tensors:
        if t.name != drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path.with_suffix(".new").replace(path)


@pytest.mark.parametrize("case, edit, code, needles", [
    ("another projector", dict(keys={"clip.projector_type": "qwen3vl_merger"}), 5,
     ("mmproj-m.gguf", "clip.projector_type 'qwen3vl_merger' is not 'qwen2.5vl_merger'")),
    ("a missing tensor", dict(drop="v.blk.1.attn_k.weight"), 4,
     ("mmproj-m.gguf", "has no v.blk.1.attn_k.weight", "model.visual.blocks.1.attn.qkv.weight")),
    ("a lying key", dict(keys={"clip.vision.projection_dim": 128}), 4,      # tests/safety/test_mmproj_keys.py
     ("mmproj-m.gguf", "clip.vision.projection_dim is 128", "mm.2.weight")),
])
def test_a_pair_that_is_not_one_model_is_refused(tmp_path, case, edit, code, needles):
    _, gguf_file = _pair(tmp_path, "qwen25vl-bf16", "--gguf-float")
    _edit_mmproj(tmp_path / "mmproj-m.gguf", **edit)
    one_error(run_qconv("dequantize", gguf_file, tmp_path / "back"), code, *needles)
    assert not (tmp_path / "back").exists()


def test_a_moe_pair_goes_to_compressed_tensors_and_back_whole(tmp_path):
    """Qwen3-VL-MoE from its released layout to a GGUF pair (Q8_0 decoder), then to compressed-tensors
    (every Q8_0 code kept as int8 group 32) and back to float: the VL model whole, its experts fused as
    its loaders read them, the same weights as the GGUF pair read back directly, and transformers' VL
    forward with an image gives that folder's logits exactly; inspect says the pair is read back."""
    import torch

    _, gguf_file = _pair(tmp_path, "qwen3vlmoe-released")
    assert inspect_json(gguf_file)["gguf"]["mmproj_read_back"] is True
    proc = run_qconv("convert", gguf_file, tmp_path / "ct", "--to", "compressed-tensors", "--json", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["codes_kept"] == comp["modules"] == 2 * (4 + 3 * 4) and comp["requantized"] == 0
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"] and "vision_config" in config
    for folder, src in (("direct", gguf_file), ("back", tmp_path / "ct")):
        run_qconv("dequantize", src, tmp_path / folder, "--dtype", "float32", check=0)
    direct, back = load_tensors(tmp_path / "direct"), load_tensors(tmp_path / "back")
    assert sorted(direct) == sorted(back) and [k for k in direct if not torch.equal(direct[k], back[k])] == []
    moe = "model.language_model.layers.0.mlp.experts"
    assert (tuple(back[moe + ".gate_up_proj"].shape), tuple(back[moe + ".down_proj"].shape)) == ((4, 256, 192), (4, 96, 256))
    assert torch.equal(_vl_logits(tmp_path / "back"), _vl_logits(tmp_path / "direct"))


def test_a_truncated_mmproj_file_is_refused_naming_it(tmp_path):
    _, gguf_file = _pair(tmp_path, "qwen25vl-bf16", "--gguf-float")
    mm = tmp_path / "mmproj-m.gguf"
    mm.write_bytes(mm.read_bytes()[: mm.stat().st_size // 2])
    one_error(run_qconv("dequantize", gguf_file, tmp_path / "back"), 4, "mmproj-m.gguf", "runs past the end of the file")
    assert not (tmp_path / "back").exists()
