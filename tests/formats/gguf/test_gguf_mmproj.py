"""`--to gguf` on a VL model writes its vision tower as llama.cpp's mmproj file beside DST (formats/gguf/
mmproj.py): the tensors are the tower's (split as llama.cpp's graph reads them: q / k / v rows, the Conv3d
patch embedding's two temporal kernels), each exactly the source's or its producer's own dequantization,
with the keys llama.cpp's converter writes; llama.cpp's converter itself is the structural oracle (names,
shapes, types, keys and bytes); what llama.cpp cannot represent is refused before anything is written.
libmtmd running the pair against transformers: tests/consumers/test_llamacpp_mmproj.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
from safetensors import safe_open

from conftest import CHECKPOINTS, REPO, copy_checkpoint, one_error, run_qconv

LLAMACPP = REPO / ".venv-llamacpp" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
COSMETIC = {"general.name", "general.size_label", "general.quantized_by"}   # names, not model data


def _convert(src, dst, *args, check=0):
    proc = run_qconv("convert", src, dst, "--to", "gguf", "--json", *args, check=check)
    return json.loads(proc.stdout)["components"][0] if check == 0 else proc


def _read(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    keys = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(s) for s in reversed(t.shape)), np.array(t.data))
               for t in reader.tensors}
    return keys, tensors


def _source(folder) -> dict:
    """The vision tower's stored tensors as float32 (bfloat16 exactly widened)."""
    from safetensors.torch import load_file

    return {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items() if "visual." in k}


def test_qwen25_vl_tower_is_written_exactly(tmp_path):
    src = CHECKPOINTS / "qwen25vl-bf16"
    comp = _convert(src, tmp_path / "m.gguf")
    assert comp["warnings"] == [] and comp["mmproj"] == {
        "file": "mmproj-m.gguf", "projector": "qwen2.5vl_merger", "tensors": 39, "gguf_types": {"BF16": 16, "F32": 23},
        "dequantized_modules": 0, "codes_kept_modules": 0, "float_rounded": []}
    keys, tensors = _read(tmp_path / "mmproj-m.gguf")
    config = json.loads((src / "config.json").read_text())
    vision, pre = config["vision_config"], json.loads((src / "preprocessor_config.json").read_text())
    assert keys["general.architecture"] == "clip" and keys["general.type"] == "mmproj"
    assert keys["clip.projector_type"] == "qwen2.5vl_merger" and keys["clip.use_silu"] is True
    assert keys["clip.vision.n_wa_pattern"] == vision["fullatt_block_indexes"][0] + 1
    assert keys["clip.vision.block_count"] == vision["depth"] and keys["clip.vision.patch_size"] == vision["patch_size"]
    assert keys["clip.vision.projection_dim"] == config["text_config"]["hidden_size"]
    assert np.allclose(keys["clip.vision.image_mean"], pre["image_mean"], rtol=1e-7)
    raw = _source(src)
    h = vision["hidden_size"]
    qkv = raw["visual.blocks.1.attn.qkv.weight"]
    for i, x in enumerate("qkv"):                               # the fused rows, split as llama.cpp reads them
        assert tensors[f"v.blk.1.attn_{x}.weight"][0] == "BF16"
        got = tensors[f"v.blk.1.attn_{x}.weight"][2].view(np.uint16).astype(np.uint32) << 16
        assert np.array_equal(got.view(np.float32), qkv[i * h:(i + 1) * h])
    patch = raw["visual.patch_embed.proj.weight"]              # [hidden, 3, 2, p, p]: two Conv2d kernels, F32
    for t, name in enumerate(("v.patch_embd.weight", "v.patch_embd.weight.1")):
        kind, shape, data = tensors[name]
        assert kind == "F32" and shape == (h, 3, 14, 14) and np.array_equal(data.reshape(shape), patch[:, :, t])
    assert tensors["v.post_ln.weight"][0] == "F32"
    assert np.array_equal(tensors["v.post_ln.weight"][2], raw["visual.merger.ln_q.weight"])


def test_a_quantized_tower_is_its_producers_dequantization(tmp_path):
    """Qwen3-VL in bitsandbytes int8 with the vision tower quantized (seed 000): each Linear of the tower
    dequantized, F32, bit for bit bitsandbytes' own dequantization (the fixture's oracle); the deepstack
    mergers under the vision layer they follow."""
    src = CHECKPOINTS / "qwen3vl-bnb8-skipvisual"
    comp = _convert(src, tmp_path / "m.gguf")
    assert comp["warnings"] == [] and comp["mmproj"]["dequantized_modules"] == 14
    keys, tensors = _read(tmp_path / "mmproj-m.gguf")
    vision = json.loads((src / "config.json").read_text())["vision_config"]
    assert keys["clip.projector_type"] == "qwen3vl_merger" and keys["clip.use_gelu"] is True
    assert keys["clip.vision.is_deepstack_layers"] == [i in vision["deepstack_visual_indexes"]
                                                       for i in range(vision["depth"])]
    names = {"blocks.0.attn.qkv": "v.blk.0.attn_qkv", "blocks.1.mlp.linear_fc2": "v.blk.1.ffn_down",
             "merger.linear_fc1": "mm.0", "deepstack_merger_list.1.linear_fc2":
             f"v.deepstack.{vision['deepstack_visual_indexes'][1]}.fc2"}
    with safe_open(src / "oracle" / "dequant.safetensors", "np") as oracle:
        for hf, name in names.items():
            kind, shape, data = tensors[name + ".weight"]
            assert kind == "F32"
            assert np.array_equal(data.reshape(shape), oracle.get_tensor(f"model.visual.{hf}.weight")), hf


def test_q8_0_keeps_bitsandbytes_codes(tmp_path, monkeypatch):
    """--mmproj-type q8_0 from the bitsandbytes int8 tower: every Q8_0 weight holds bitsandbytes' own int8
    codes (the checkpoint's CB), each 32-block's scale its row's SCB / 127 in float16; the report says so,
    with the scales' rounding, and --validate reads it back. Negative control: one code off by one fails
    validation, nothing written."""
    from qconv.errors import ValidationFailed
    from qconv.formats.core.request import Options
    from qconv.formats.gguf import mmproj, writer
    from qconv.convert.convert import convert as convert_to_gguf   # the engine, through the GGUF sink

    src = CHECKPOINTS / "qwen3vl-bnb8-skipvisual"
    comp = _convert(src, tmp_path / "m.gguf", "--mmproj-type", "q8_0", "--validate")
    mm = comp["mmproj"]
    assert mm["gguf_types"] == {"F32": 32, "Q8_0": 14} and mm["validation"]["ok"] is True
    assert (mm["codes_kept_modules"], mm["dequantized_modules"]) == (14, 0)
    assert {e["codes"] for e in mm["q8_0"]} == {"kept"} and len(mm["q8_0"]) == 14
    assert all(0 < e["max_scale_rel_error"] < 2.0 ** -11 and e["rel_frobenius"] < 1e-3 for e in mm["q8_0"])
    with safe_open(next(src.glob("*.safetensors")), "np") as f:          # its int8 codes and float32 SCB
        raw = {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.visual.") and k.endswith((".weight", ".SCB"))
               and f.get_slice(k).get_dtype() in ("I8", "F32")}
    _, tensors = _read(tmp_path / "mmproj-m.gguf")
    for e in mm["q8_0"]:
        kind, shape, data = tensors[e["tensor"]]
        rows = data.shape[0]
        blocks = data.reshape(rows, -1, 34)
        codes = blocks[:, :, 2:].view(np.int8).reshape(rows, -1)
        scales = blocks[:, :, :2].copy().view(np.float16)[..., 0]
        stem = e["source"][:-len(".weight")]
        assert np.array_equal(codes, raw[stem + ".weight"]), e["tensor"]
        want = (raw[stem + ".SCB"] / np.float32(127)).astype(np.float16)
        assert np.array_equal(scales, np.repeat(want[:, None], scales.shape[1], axis=1)), e["tensor"]

    real = mmproj._q8_0

    def one_code_off(*args):                             # the first code of the first block, one step off
        blocks, how = real(*args)
        blocks = blocks.copy()
        blocks[0, 2] = (blocks[0, 2:3].view(np.int8) + (1 if blocks[0, 2:3].view(np.int8)[0] < 127 else -1)).view(np.uint8)[0]
        return blocks, how
    monkeypatch.setattr(mmproj, "_q8_0", one_code_off)
    with pytest.raises(ValidationFailed, match=r"mmproj-m\.gguf: \S+ does not read back as \S+'s codes"):
        convert_to_gguf(src, tmp_path / "bad" / "m.gguf", Options("gguf", mmproj_type="q8_0"), validate=True)
    assert not (tmp_path / "bad").exists()


def test_no_mmproj_and_mmproj_type(tmp_path):
    src = CHECKPOINTS / "qwen25vl-bf16"
    comp = _convert(src, tmp_path / "a" / "m.gguf", "--no-mmproj")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["m.gguf", "m.md"] and "mmproj" not in comp
    assert comp["warnings"] == ["30 vision-tower tensors not written (--no-mmproj): llama.cpp reads a VL model's "
                                "vision tower from an mmproj file"]
    comp = _convert(src, tmp_path / "b" / "m.gguf", "--mmproj-type", "f16")
    assert comp["mmproj"]["gguf_types"] == {"F16": 18, "F32": 21}     # the patch kernels F16 too, as llama.cpp's
    rounded = comp["mmproj"]["float_rounded"]                   # bfloat16 -> float16 rounds some values
    assert rounded and all(r["to"] == "F16" and r["values"] > 0 and r["max_rel_error"] > 0 for r in rounded)
    _, tensors = _read(tmp_path / "b" / "mmproj-m.gguf")
    assert {r["tensor"] for r in rounded} <= {n for n, (kind, _, _) in tensors.items() if kind == "F16"}
    one_error(run_qconv("convert", src, tmp_path / "c", "--to", "gptq", "--no-mmproj"), 2,
              "--mmproj/--no-mmproj: --to gptq takes no such option")


def _bad(tmp_path, edit, code, *needles):
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint("qwen25vl-bf16", work)
    edit(src)
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    one_error(_convert(src, tmp_path / "out" / "m.gguf", check=code), code, *needles)
    assert not (tmp_path / "out").exists() and before == {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}


def _config(key, value):
    def edit(src):
        doc = json.loads((src / "config.json").read_text())
        doc["vision_config"][key] = value
        (src / "config.json").write_text(json.dumps(doc))
    return edit


def _pre(key, value):
    def edit(src):
        doc = json.loads((src / "preprocessor_config.json").read_text())
        doc[key] = value
        (src / "preprocessor_config.json").write_text(json.dumps(doc))
    return edit


@pytest.mark.parametrize("edit, code, needles", [
    (lambda src: (src / "preprocessor_config.json").unlink(), 5,
     ("preprocessor_config.json: is missing", "image_mean", "--no-mmproj")),
    (_pre("patch_size", 16), 4, ("preprocessor_config.json", "patch_size 16 disagrees", "vision_config.patch_size 14")),
    (_pre("image_std", [0.5, 0.0, 0.5]), 4, ("preprocessor_config.json", "image_std")),
    (_pre("image_mean", [0.5, 0.5]), 4, ("preprocessor_config.json", "image_mean")),
    (_config("fullatt_block_indexes", [0, 2]), 5, ("config.json", "fullatt_block_indexes")),
    (_config("intermediate_size", 128), 5, ("config.json", "intermediate_size equals hidden_size")),
    (lambda src: (_config("temporal_patch_size", 3)(src), _pre("temporal_patch_size", 3)(src)), 5,
     ("config.json", "temporal_patch_size 3")),
    (_config("window_size", 64), 5, ("config.json", "window_size 64")),
], ids=["no-preprocessor", "patch-disagrees", "zero-std", "two-means", "uneven-full-attention", "ffn-equals-hidden",
        "temporal-3", "window-64"])
def test_what_llama_cpp_cannot_represent_is_refused(tmp_path, edit, code, needles):
    _bad(tmp_path, edit, code, *needles)


def test_a_missing_vision_weight_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    def drop(src):
        tensors = load_file(src / "model.safetensors")
        del tensors["visual.merger.mlp.2.weight"]
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    _bad(tmp_path, drop, 4, "has no vision-tower tensor for mm.2.weight", "qwen2.5vl_merger graph needs")


# --- llama.cpp's own converter as the structural oracle ------------------------------------------------

# its Qwen2VLVisionModel maps visual.merger.mlp.{0,2} through the per-block name table, built for `depth`
# blocks only: a tower of depth 2 (the fixture) has no mm.2 (upstream bug; real models have depth 32).
# Run unchanged but for that table's size.
_RUN_CONVERTER = """
import runpy, sys
root, sys.argv = sys.argv[1], sys.argv[2:]          # [convert_hf_to_gguf.py, its arguments...]
sys.path[:0] = [root + "/gguf-py", root]
import gguf
table = gguf.get_tensor_name_map
gguf.get_tensor_name_map = lambda arch, n: table(arch, max(n, 3) if arch == gguf.MODEL_ARCH.MMPROJ else n)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _llama_cpp_mmproj(src, dst, outtype) -> None:
    env = {**os.environ, "PYTHONPATH": str(LLAMACPP)}
    proc = subprocess.run([sys.executable, "-c", _RUN_CONVERTER, str(LLAMACPP), str(LLAMACPP / "convert_hf_to_gguf.py"),
                           str(src), "--mmproj", "--outtype", outtype, "--outfile", str(dst)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dst


@pytest.mark.consumer(LLAMACPP / "convert_hf_to_gguf.py", "llama.cpp's converter (bin/setup llamacpp)")
@pytest.mark.parametrize("fixture", ["qwen25vl-bf16", "qwen3vl-bf16", "qwen3vlmoe-bf16"])
@pytest.mark.parametrize("outtype", ["bf16", "f16", "f32", "q8_0"])
def test_the_mmproj_file_is_llama_cpp_converters(tmp_path, fixture, outtype):
    """The same tower through `convert_hf_to_gguf.py --mmproj --outtype T` and through `--to gguf
    --mmproj-type T`: every tensor (name, shape, type, bytes) and every key equal but names (COSMETIC);
    Q8_0's error, as reported, measured against the converter's F32 file."""
    src = copy_checkpoint(fixture, tmp_path)
    if not (src / "tokenizer.json").exists():                  # qwen3vl-bf16: the text GGUF needs one
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(CHECKPOINTS / "qwen3vl-bnb8-skipvisual" / name, src / name)
    _llama_cpp_mmproj(src, tmp_path / "ref.gguf", outtype)
    report = _convert(src, tmp_path / "m.gguf", "--mmproj-type", outtype)["mmproj"]
    ref_keys, ref = _read(tmp_path / "ref.gguf")
    keys, ours = _read(tmp_path / "mmproj-m.gguf")
    assert {k: v for k, v in keys.items() if k not in COSMETIC} == {k: v for k, v in ref_keys.items()
                                                                      if k not in COSMETIC}
    assert sorted(ours) == sorted(ref)
    for name, (kind, shape, data) in ref.items():
        assert ours[name][:2] == (kind, shape), name
        assert np.array_equal(ours[name][2].view(np.uint8), data.view(np.uint8)), name
    if outtype == "q8_0":                   # from float, llama.cpp's own Q8_0 quantizer: its error reported
        exact = {name: t[2] for name, t in _read(_llama_cpp_mmproj(src, tmp_path / "ref32.gguf", "f32"))[1].items()}
        for e in report["q8_0"]:
            w = exact[e["tensor"]].astype(np.float64)
            back = gguf.quants.dequantize(ours[e["tensor"]][2], gguf.GGMLQuantizationType.Q8_0)
            assert e["codes"] == "requantized" and 0 < e["rel_frobenius"] < 0.02
            assert abs(np.linalg.norm(back - w) / np.linalg.norm(w) - e["rel_frobenius"]) <= 1e-6
        assert sorted(e["tensor"] for e in report["q8_0"]) == sorted(n for n, t in ours.items() if t[0] == "Q8_0")


def test_validate_reads_the_mmproj_file_back(tmp_path, monkeypatch):
    """--validate reads the mmproj file back with gguf-py (every tensor: the source's, in the type written);
    the negative control, each value one unit in the last place off, fails naming the tensor, nothing written."""
    from qconv.errors import ValidationFailed
    from qconv.formats.core.request import Options
    from qconv.formats.gguf import writer
    from qconv.convert.convert import convert as convert_to_gguf   # the engine, through the GGUF sink

    comp = _convert(CHECKPOINTS / "qwen25vl-bf16", tmp_path / "ok" / "m.gguf", "--validate", "--mmproj-type", "f16")
    assert comp["mmproj"]["validation"] == {"ok": True, "tensors": 39, "reader": "gguf-py (GGUFReader, quants.dequantize)"}
    from qconv.formats.storage.tensor_io import encode_float

    def off_by_one_ulp(self, x32):                       # every value's last bit flipped: a wrong rounding
        stored = encode_float(np.ascontiguousarray(x32, np.float32), self.code)
        return (stored.view(np.uint16) ^ np.uint16(1)).view(stored.dtype)
    monkeypatch.setattr(writer.Rounding, "encode", off_by_one_ulp)
    with pytest.raises(ValidationFailed, match=r"mmproj-m\.gguf: \S+ does not read back as visual\."):
        convert_to_gguf(CHECKPOINTS / "qwen25vl-bf16", tmp_path / "bad" / "m.gguf",
                               Options("gguf", mmproj_type="f16"), validate=True)
    assert not (tmp_path / "bad").exists()


def _cogvlm_folder(path, cogvlm2: bool):
    """A float folder with CogVLM's config and tensor names (those of seed 001's CogVLM2 checkpoint, tiny:
    the refusal reads names and config only)."""
    import torch
    from safetensors.torch import save_file

    h = 64
    t = {"model.embed_tokens.weight": (128, h), "model.norm.weight": (h,), "lm_head.weight": (128, h),
         "model.layers.0.input_layernorm.weight": (h,), "model.layers.0.post_attention_layernorm.weight": (h,),
         "model.layers.0.self_attn.language_expert_query_key_value.weight": (3 * h, h),
         "model.layers.0.self_attn.vision_expert_query_key_value.weight": (3 * h, h),
         "model.vision.patch_embedding.proj.weight": (h, 3, 14, 14)}
    if cogvlm2:
        t.update({"model.layers.0.self_attn.vision_expert_query_key_value.bias": (3 * h,),
                  "model.vision.conv.weight": (h, h, 2, 2), "model.vision.conv.bias": (h,)})
    path.mkdir()
    save_file({k: torch.zeros(s, dtype=torch.bfloat16) for k, s in t.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["CogVLMForCausalLM"], "model_type": "cogvlm2" if cogvlm2 else "cogvlm", "hidden_size": h,
        "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 128,
        "torch_dtype": "bfloat16"}))
    return path


@pytest.mark.parametrize("cogvlm2, needles", [
    (True, ("model.vision.conv, CogVLM2's) has no place in llama.cpp's cogvlm clip graph",
            "loads no bias for the vision expert's query_key_value")),
    (False, ("no CogVLM checkpoint made by CogVLM's own code",)),
])
def test_cogvlm_is_refused_with_the_reason(tmp_path, cogvlm2, needles):
    """CogVLM (seed 001's model): llama.cpp's cogvlm graphs cannot compute CogVLM2 (its vision conv, its
    vision expert's qkv bias), so --to gguf refuses by name, saying why, and writes nothing."""
    src = _cogvlm_folder(tmp_path / "cogvlm", cogvlm2)
    one_error(run_qconv("convert", src, tmp_path / "m.gguf", "--to", "gguf"), 5,
              "config.json", "is CogVLM (CogVLMForCausalLM), which qconv does not write as GGUF", *needles)
    assert not list(tmp_path.glob("*.gguf"))
