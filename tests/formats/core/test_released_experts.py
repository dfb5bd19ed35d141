"""Qwen3-VL-MoE as released (issue 53): the released checkpoints store each fused experts tensor
transposed relative to what transformers saves (Qwen/Qwen3-VL-30B-A3B-Instruct: gate_up_proj [128, 2048,
1536] = [E, H, 2I], down_proj [128, 768, 2048] = [E, I, H]; transformers' own [E, 2I, H] / [E, H, I]), and
transformers transposes them when it loads (conversion_mapping.py "qwen3_vl_moe": Transpose(1, 2,
check_dims=True)). qconv reads either, told apart by the shapes against the config
(formats/core/experts.py fused_layout), an expert at a time.

The expectation comes from the producer, not from qconv: the tiny Qwen3-VL-MoE transformers made
(qwen3vlmoe-bf16, its own layout) rewritten into the released one (conftest.released_layout) is the same
model to transformers (checked below), so every target must get the same bytes from either, and every
comparison must pair them exactly. FP8: transformers' fine-grained FP8 (quantize-on-load, 32 x 32 blocks)
saves Qwen3-VL-MoE in its own fused layout; the released layout of it (codes and block-scale grid
transposed together, as vLLM's loader transposes them, routed_experts._orient_fused_weight) must read as
the same Linears."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import CHECKPOINTS, one_error, released_layout, run_qconv

OWN = CHECKPOINTS / "qwen3vlmoe-bf16"
TEXT = json.loads((OWN / "config.json").read_text())["text_config"]
H, I, E = TEXT["hidden_size"], TEXT["moe_intermediate_size"], TEXT["num_local_experts"]
LAYERS = TEXT["num_hidden_layers"]
MOE = "model.language_model.layers.0.mlp.experts"


def _own(dst: Path) -> Path:
    """The fixture as transformers saved it, with a tokenizer (a GGUF needs one)."""
    shutil.copytree(OWN, dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHECKPOINTS / "qwen3vl-bnb8-skipvisual" / name, dst)
    return dst


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """(transformers' own, released): the same folder name, so outputs name the model alike."""
    root = tmp_path_factory.mktemp("layouts")
    return _own(root / "own" / "m"), released_layout(OWN, root / "released" / "m")


def _files(folder: Path) -> dict[str, bytes]:
    """Every output file but the model card, which hashes the two sources' (different) files."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix != ".md" and p.name != "README.md"}


def test_transformers_reads_the_rewrite_as_its_own_layout(layouts):
    """The rewrite is the layout transformers' conversion mapping transposes on load: both folders load
    to the same parameters, and the released one holds [E, H, 2I] / [E, I, H] by the config's sizes."""
    from safetensors import safe_open
    from transformers import Qwen3VLMoeForConditionalGeneration

    own, released = layouts
    with safe_open(released / "model.safetensors", "pt") as f:
        assert f.get_slice(MOE + ".gate_up_proj").get_shape() == [E, H, 2 * I]
        assert f.get_slice(MOE + ".down_proj").get_shape() == [E, I, H]
    a, b = (Qwen3VLMoeForConditionalGeneration.from_pretrained(p, dtype=torch.float32).state_dict() for p in layouts)
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


def _module(shape, hidden, inter):
    from qconv.formats.core.source import float_fused
    from qconv.formats.storage.safetensors_header import TensorInfo

    info = TensorInfo("model.language_model.layers.0.mlp.experts.gate_up_proj", "BF16", shape, Path("m.safetensors"),
                      0, 2 * shape[0] * shape[1] * shape[2])
    config = {"model_type": "qwen3_vl_moe", "text_config": {"hidden_size": hidden, "moe_intermediate_size": inter}}
    return float_fused(info), config


def test_the_layout_is_told_from_the_shapes_against_the_config():
    """At Qwen3-VL-30B-A3B's sizes (hidden 2048, moe_intermediate 768, 128 experts): the released shape is
    the transposed layout, transformers' own is rows; each expert's gate / up / down view has the Linear's
    shape; a shape that is neither, and a square expert (the shapes cannot tell), are refused naming both."""
    from qconv.errors import NotStorable
    from qconv.formats.core.experts import ROWS, TRANSPOSED, fused_layout, split_module

    released, config = _module((128, 2048, 1536), 2048, 768)
    own, _ = _module((128, 1536, 2048), 2048, 768)
    assert (fused_layout(config, released), fused_layout(config, own)) == (TRANSPOSED, ROWS)
    views = split_module(released, config)
    assert len(views) == 256 and {(v.out_features, v.in_features) for v in views} == {(768, 2048)}
    assert [(v.name.rsplit("experts.", 1)[1], v.details["rows_of"][1], v.details["columns"]) for v in views[2:4]] == \
        [("1.gate_proj", 2048, (2048, 0)), ("1.up_proj", 2048, (2048, 768))]
    neither, _ = _module((128, 2048, 1024), 2048, 768)
    with pytest.raises(NotStorable, match=r"neither the released layout \[128, 2048, 1536\] nor transformers' own "
                                          r"\[128, 1536, 2048\]"):
        fused_layout(config, neither)
    square, square_config = _module((128, 1536, 1536), 1536, 768)
    with pytest.raises(NotStorable, match="square per expert: the shapes cannot tell"):
        fused_layout(square_config, square)


@pytest.mark.parametrize("target", ["gguf", "compressed-tensors", "fp8", "mlx"])
def test_every_target_writes_the_same_bytes_from_either_layout(layouts, tmp_path, target):
    """convert from the released layout writes what it writes from transformers' own, byte for byte
    (GGUF: the text model and its mmproj file), and says it split the fused tensors alike."""
    made = []
    for src in layouts:
        out = tmp_path / src.parent.name
        dst = out / "m.gguf" if target == "gguf" else out / "m"
        proc = run_qconv("convert", src, dst, "--to", target, "--json", check=0)
        made.append((_files(out), json.loads(proc.stdout)["components"][0].get("experts_split")))
    assert made[0][0] and made[0] == made[1]


def test_validate_pairs_the_layouts_exactly(layouts):
    """validate compares the released layout with transformers' own expert by expert, either way round."""
    own, released = layouts
    for a, b in ((released, own), (own, released)):
        report = json.loads(run_qconv("validate", a, b, "--json", check=0).stdout)
        experts = [layer for layer in report["layers"] if ".experts." in layer["module"]]
        assert report["ok"] is True and not report["components"][0]["only_in_a"] + report["components"][0]["only_in_b"]
        assert len(experts) == LAYERS * 3 * E and {layer["max_abs"] for layer in experts} == {0.0}


def test_a_layout_that_is_neither_is_refused_naming_the_tensor(tmp_path):
    """A config whose moe_intermediate_size matches neither stored shape: refused, nothing written."""
    src = released_layout(OWN, tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = I // 2
    (src / "config.json").write_text(json.dumps(config))
    one_error(run_qconv("convert", src, tmp_path / "out", "--to", "compressed-tensors"), 5,
              "tensor 'model.language_model.layers.0.mlp.experts.down_proj'",
              f"is stored [{E}, {I}, {H}], neither the released layout [{E}, {I // 2}, {H}] nor transformers' own "
              f"[{E}, {H}, {I // 2}]")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def fp8_layouts(tmp_path_factory):
    """transformers' fine-grained FP8 of the fixture (32 x 32 blocks, quantized on load on CPU, where only
    its device check refuses: fixtures/checkpoints/make_reference_fp.py fp8 does the same), and the
    released layout of it."""
    from transformers import FineGrainedFP8Config, Qwen3VLMoeForConditionalGeneration
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    root = tmp_path_factory.mktemp("fp8")
    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    try:
        model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
            OWN, dtype=torch.bfloat16, device_map="cpu", quantization_config=FineGrainedFP8Config(weight_block_size=(32, 32)))
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check
    own = root / "own" / "m"
    model.save_pretrained(own)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHECKPOINTS / "qwen3vl-bnb8-skipvisual" / name, own)
    return own, released_layout(own, root / "released" / "m")


def test_fp8_experts_in_the_released_layout_read_as_their_own(fp8_layouts, tmp_path):
    """FP8 fused experts stored transposed (codes [E, H, 2I] with scales [E, H/32, 2I/32]): validate pairs
    them with transformers' own layout exactly, --to gguf and --to fp8 write the same bytes from either,
    and either dequantized is the model transformers computes the same logits with."""
    from transformers import AutoModelForImageTextToText

    own, released = fp8_layouts
    report = json.loads(run_qconv("validate", released, own, "--json", check=0).stdout)
    assert report["ok"] is True and {layer["max_abs"] for layer in report["layers"] if ".experts." in layer["module"]} == {0.0}
    for target, name in (("gguf", "m.gguf"), ("fp8", "m")):
        outs = []
        for src in fp8_layouts:
            out = tmp_path / target / src.parent.name
            run_qconv("convert", src, out / name, "--to", target, *(("--no-mmproj",) if target == "gguf" else ()),
                      check=0)
            outs.append(_files(out))
        assert outs[0] and outs[0] == outs[1], target
    logits = []
    for src in fp8_layouts:
        back = tmp_path / "float" / src.parent.name
        run_qconv("dequantize", src, back, "--dtype", "float32", check=0)
        model = AutoModelForImageTextToText.from_pretrained(back, dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19]])).logits)
    assert torch.equal(*logits)

