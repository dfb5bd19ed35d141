"""Never silently wrong, round 5 (issue 47, items 1, 2, 4 and 10): MLX folders whose stacked experts, expert
counts, stray quantization state or config keys would give an output mlx-lm cannot load, or that qconv
misread as another module's fault.

Every refusal here keeps the sweep's contract (sweep_cases.check_contract: one `qconv: error:` line naming
the file, a documented exit, no traceback, SRC unchanged, no DST, no litter). The sources are mlx-lm's own
files (fixtures/checkpoints/*-mlx-*, made by `mlx_lm.convert`: fixtures/make_mlx.py) with one thing edited.
Each refused case exited 0 before (its output failed in `mlx_lm.load`: "Expected shape (4,128,32) but
received (3,128,32)", "bits 32 is not supported"), or blamed lm_head.weight for a config key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS
from sweep_cases import check_contract, edit_json, litter, run_inprocess, snapshot

MOE = "qwen3moe-mlx-w4g64"           # qwen3_moe, 2 layers of 4 experts stacked under mlp.switch_mlp
DENSE = "llama-mlx-w4g64"
STACK = "model.layers.{}.mlp.switch_mlp.{}.{}"
LEAVES = ("weight", "scales", "biases")
PROJS = ("gate_proj", "up_proj", "down_proj")
DOWN = "model.layers.0.mlp.down_proj"


def _source(tmp_path: Path, fixture: str, tensors=None, config=None) -> Path:
    """A copy of FIXTURE under tmp/work with tensors(dict) -> dict and config(doc) applied."""
    work = tmp_path / "work"
    work.mkdir()
    src = work / fixture
    shutil.copytree(CHECKPOINTS / fixture, src, ignore=shutil.ignore_patterns("oracle"))
    if tensors is not None:
        (src / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file(tensors(load_file(src / "model.safetensors")), src / "model.safetensors", metadata={"format": "mlx"})
    if config is not None:
        edit_json(src / "config.json", config)
    return src


def _experts(keep, layers=(0, 1)):
    def edit(t):
        for layer in layers:
            for proj in PROJS:
                for leaf in LEAVES:
                    key = STACK.format(layer, proj, leaf)
                    t[key] = t[key][keep].clone()
        return t
    return edit


def _trim_rows(t):
    for leaf in LEAVES:
        key = STACK.format(0, "gate_proj", leaf)
        t[key] = t[key][:, :120].clone()
    return t


def _set(**values):
    return lambda doc: doc.update(values)


def _float_weight_beside_scales(t):
    t[DOWN + ".weight"] = torch.zeros(256, 512, dtype=torch.bfloat16)     # scales / biases left beside it
    return t


def _stacked_outside_switch_mlp(t):
    for leaf in LEAVES:
        t[f"{DOWN}.{leaf}"] = t[f"{DOWN}.{leaf}"][None].clone()
    return t


def _stacked_as_experts(t):
    """mlx-lm's gpt-oss layout (SwitchGLU named ``experts``), which qconv does not map."""
    for proj in PROJS:
        for leaf in LEAVES:
            t[f"model.layers.0.mlp.experts.{proj}.{leaf}"] = t.pop(STACK.format(0, proj, leaf))
    return t


def _drop_mirror(doc):
    del doc["quantization_config"]


def _quantization(**values):
    def edit(doc):
        del doc["quantization_config"]
        doc["quantization"].update(values)
    return edit


CASES = {
    # name: (fixture, tensors edit, config edit, exit, what the line names)
    # item 1: stacked experts checked as per-expert and fused ones are
    "stacks-lost-last-expert": (MOE, _experts(slice(0, 3)), None, 4,
                                ["num_local_experts is 4", "holds 3 experts", "expert 3 missing", "config.json"]),
    "layer-0-alone-3-experts": (MOE, _experts(slice(0, 3), layers=(0,)), None, 4,
                                ["is 4", "model.layers.0.mlp.experts holds 3 experts"]),
    "moe-intermediate-doubled": (MOE, None, _set(moe_intermediate_size=256), 4,
                                 ["moe_intermediate_size is 256", "model.layers.0.mlp.experts.0"]),
    "gate-stack-120-rows": (MOE, _trim_rows, None, 4,
                            ["moe_intermediate_size is 128", "model.layers.0.mlp.experts.0.gate_proj", "120 rows"]),
    "router-rows": (MOE, lambda t: {**t, **{f"model.layers.0.mlp.gate.{leaf}": t[f"model.layers.0.mlp.gate.{leaf}"][:3]
                                             .clone() for leaf in LEAVES}}, None, 4,
                    ["is 4", "model.layers.0.mlp.gate.weight", "3 rows"]),
    # item 2: every expert-count key, not the first
    "num-experts-8-beside-local-4": (MOE, None, _set(num_experts=8), 4, ["num_experts is 8", "holds 4 experts"]),
    "n-routed-experts-2": (MOE, None, _set(n_routed_experts=2), 4, ["n_routed_experts is 2"]),
    # item 4: tensors no module accounts for
    "scales-beside-float-weight": (DENSE, _float_weight_beside_scales, None, 4,
                                   [DOWN + ".biases", "belongs to no quantized module"]),
    "stray-norm-scales": (DENSE, lambda t: {**t, "model.norm.scales": torch.ones(256, dtype=torch.bfloat16)}, None, 4,
                          ["model.norm.scales", "belongs to no quantized module"]),
    "stray-norm-biases": (DENSE, lambda t: {**t, "model.norm.biases": torch.ones(256, dtype=torch.bfloat16)}, None, 4,
                          ["model.norm.biases", "belongs to no quantized module"]),
    "3d-weight-outside-switch-mlp": (DENSE, _stacked_outside_switch_mlp, None, 4,
                                     [DOWN + ".weight", "outside a switch_mlp block"]),
    "stacked-experts-not-switch-mlp": (MOE, _stacked_as_experts, None, 5,
                                       ["model.layers.0.mlp.experts.", "outside a switch_mlp block"]),
    # item 10: a config key qconv cannot read is named, not lm_head.weight
    "bits-a-string": (DENSE, None, _quantization(bits="4"), 4, ["config.json", "quantization.bits is '4'"]),
    "group-size-a-string": (DENSE, None, _quantization(group_size="64"), 4, ["quantization.group_size is '64'"]),
    "group-size-0": (DENSE, None, _quantization(group_size=0), 4, ["quantization.group_size is 0"]),
}
VERBS = {"dequantize": ["dequantize"], "to-mlx": ["convert", "--to", "mlx"], "to-gptq": ["convert", "--to", "gptq"]}


@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_mlx_folders_no_loader_reads_are_refused(tmp_path, case, verb):
    fixture, tensors, config, code, names = CASES[case]
    src = _source(tmp_path, fixture, tensors, config)
    before = snapshot(src.parent)
    run = run_inprocess(*VERBS[verb], src, tmp_path / "made" / "dst")
    check_contract(run, names=names, refusal_only=True)
    assert run.code == code, str(run)
    assert "lm_head" not in run.err, str(run)
    assert snapshot(src.parent) == before, f"SRC changed\n{run}"
    assert not (tmp_path / "made").exists() and not litter(tmp_path), f"DST or litter left\n{run}"


@pytest.mark.parametrize("case", ["stacks-lost-last-expert", "num-experts-8-beside-local-4", "stray-norm-scales",
                                  "3d-weight-outside-switch-mlp", "bits-a-string"])
def test_inspect_warns_of_each(tmp_path, case):
    fixture, tensors, config, _, _ = CASES[case]
    src = _source(tmp_path, fixture, tensors, config)
    run = run_inprocess("inspect", "--strict", src)
    assert run.code == 1 and "Traceback" not in run.out + run.err, str(run)
    assert "!" in run.out, str(run)


# ------------------------------------------------------------------ configs mlx-lm reads, read as it reads them
READ_AS_MLX_LM = {
    # older mlx-lm writes only "quantization"; null is the mode's default (mx.quantize: group 64, 4 bits)
    "quantization-alone": (_drop_mirror, None),
    "group-size-null": (_quantization(group_size=None), None),
    "bits-null": (_quantization(bits=None), None),
    # a mirror that disagrees: mlx-lm reads "quantization"; the disagreeing key is said
    "mirror-disagrees": (lambda doc: doc["quantization_config"].update(bits=8),
                         "quantization_config.bits is 8 but its quantization.bits is 4"),
}


@pytest.fixture(scope="module")
def as_made(tmp_path_factory):
    """--to mlx and dequantize of the fixture as mlx-lm made it."""
    out = tmp_path_factory.mktemp("as-made")
    for verb, args in (("mlx", ["convert", "--to", "mlx"]), ("float", ["dequantize"])):
        run = run_inprocess(*args, CHECKPOINTS / DENSE, out / verb)
        assert run.code == 0, str(run)
    return {verb: _raw(out / verb) for verb in ("mlx", "float")}


def _raw(folder: Path) -> dict:
    """Every tensor's dtype, shape and bytes."""
    from qconv.formats.storage.safetensors_header import read_header
    from qconv.formats.storage.tensor_io import read_array

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        for name, info in read_header(shard).tensors.items():
            out[name] = (info.dtype, tuple(info.shape), read_array(info).tobytes())
    return out


@pytest.mark.parametrize("case", sorted(READ_AS_MLX_LM))
def test_configs_mlx_lm_loads_are_read_as_it_reads_them(tmp_path, as_made, case):
    """Each loads in mlx-lm 0.32.2 (checked by hand: mlx_lm.load reads "quantization" and infers each
    module's bits and group from its shapes); qconv's outputs are byte for byte those of the fixture as
    made, and the one warning names the key that disagrees."""
    edit, warning = READ_AS_MLX_LM[case]
    src = _source(tmp_path, DENSE, config=edit)
    for verb, args in (("mlx", ["convert", "--to", "mlx"]), ("float", ["dequantize"])):
        run = run_inprocess(*args, src, tmp_path / verb)
        assert run.code == 0, str(run)
        warned = [line for line in run.err.splitlines() if "warning" in line]
        assert warned == ([] if warning is None else [next(w for w in warned if warning in w)]), str(run)
        assert _raw(tmp_path / verb) == as_made[verb], case
        if verb == "mlx":
            config = json.loads((tmp_path / verb / "config.json").read_text())
            assert config["quantization"] == config["quantization_config"] == \
                {"group_size": 64, "bits": 4, "mode": "affine"}
