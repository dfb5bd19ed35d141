"""Never silently wrong, round 5 (issue 47, items 5 and 6): static activation scales.

A static activation scale (compressed-tensors FP8 static's ``input_scale``, NVFP4 W4A4's
``input_global_scale``, ModelOpt FP8 / NVFP4's ``input_scale``: formats/core/activation.py) is calibrated
on data by the producer, and the engine quantizes that module's activations with it. So, whatever the
target (one that carries the scale, one that drops it, a float folder):

* a module whose config declares static activations but whose scale is missing is refused (exit 4, naming
  the missing tensor), never written with a config that promises a scale it lacks;
* a scale that is not one finite positive value (NaN, inf, 0, negative, two values) is refused (exit 4,
  naming the tensor), never dropped with a "not carried" warning;
* an activation scale on a module whose config declares dynamic activations is refused (exit 4, naming
  the tensor): no engine reads it, and nothing says which of the config and the tensor is meant.

Every run satisfies the sweep's contract (sweep_cases.check_contract: one `qconv: error:` line naming the
file and the tensor, no traceback or warning, SRC unchanged, no DST and no litter). The sources are the
producers' own files (fixtures/checkpoints); the clean ones still convert
(tests/verbs/test_activation_scales.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import CHECKPOINTS, copy_checkpoint
from sweep_cases import check_contract, edit_tensors, litter, run_inprocess, snapshot

CT_FP8, CT_NVFP4 = "llama-ct-fp8-static", "llama-ct-nvfp4"
MO_FP8, MO_NVFP4 = "llama-modelopt-fp8", "llama-modelopt-nvfp4"
CT_DYNAMIC = "llama-ct-fp8-dynamic"
LEAF = {CT_FP8: "input_scale", CT_NVFP4: "input_global_scale", MO_FP8: "input_scale", MO_NVFP4: "input_scale"}
Q = "model.layers.0.self_attn.q_proj"


def _refused(tmp_path: Path, fixture: str, edit, target: str, *names: str) -> None:
    """FIXTURE with its tensors edited, converted --to TARGET: exit 4, one line naming the shard and
    every one of NAMES, SRC unchanged, no DST, no litter."""
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint(fixture, work)
    edit_tensors(src / "model.safetensors", edit)
    before = snapshot(work)
    dst = tmp_path / "made" / "dst"
    run = run_inprocess("convert", src, dst, "--to", target)
    check_contract(run, names=(str(src / "model.safetensors"), *names), refusal_only=True)
    assert run.code == 4, str(run)
    assert snapshot(work) == before, f"SRC changed\n{run}"
    assert not (tmp_path / "made").exists() and not litter(tmp_path), f"DST or litter left\n{run}"


# ------------------------------------------------------------------------ 5: a declared scale missing
MISSING = [(fixture, target) for fixture in (CT_FP8, CT_NVFP4, MO_FP8, MO_NVFP4)
           for target in ("compressed-tensors-fp8", "gptq")
           + (("modelopt-nvfp4", "compressed-tensors-nvfp4") if fixture in (CT_NVFP4, MO_NVFP4) else ())]


@pytest.mark.parametrize("fixture, target", MISSING)
def test_a_static_scale_missing_on_one_module_is_refused(tmp_path, fixture, target):
    """q_proj's scale deleted, every other module's kept: the config still declares static activations
    for every Linear, so the engine would load q_proj without its scale. Exit 4 naming the tensor."""
    name = f"{Q}.{LEAF[fixture]}"
    _refused(tmp_path, fixture, lambda ts: ts.pop(name), target, name, "missing")


# ------------------------------------------------------------------------ 6: corrupt or stray scales
VALUES = {"nan": [float("nan")], "inf": [float("inf")], "zero": [0.0], "negative": [-1.0], "shape-2": [0.5, 0.5]}


@pytest.mark.parametrize("target", ["fp8", "gptq", "float16"])
@pytest.mark.parametrize("value", sorted(VALUES))
def test_a_corrupt_activation_scale_is_refused_whatever_the_target(tmp_path, value, target):
    """input_scale NaN, inf, 0, -1 or of shape [2]: a state tensor of the wrong range or shape is exit 4,
    also for a target that would drop it with a "not carried" warning."""
    name = f"{Q}.input_scale"

    def edit(ts):
        ts[name] = torch.tensor(VALUES[value], dtype=ts[name].dtype)
    _refused(tmp_path, CT_FP8, edit, target, name, "activation scale")


@pytest.mark.parametrize("target", ["compressed-tensors-fp8", "gptq", "float16"])
def test_an_activation_scale_on_a_dynamic_config_is_refused(tmp_path, target):
    """A stray input_scale beside an FP8_DYNAMIC module (its config: dynamic per-token activations): no
    engine reads it, and the file does not say which is meant. Exit 4 naming the tensor, never dropped
    silently."""
    name = f"{Q}.input_scale"

    def edit(ts):
        ts[name] = torch.tensor([0.01], dtype=torch.float16)
    _refused(tmp_path, CT_DYNAMIC, edit, target, name, "dynamic")


def test_every_producer_file_passes_the_activation_check():
    """The producers' own checkpoints (every fixture, the static, dynamic and weight-only ones alike)
    hold what their configs declare: nothing here is refused."""
    from qconv.formats.core import activation
    from qconv.formats.core.detect import detect
    from qconv.formats.storage.checkpoint import open_target

    declared = set()
    for folder in sorted(p for p in CHECKPOINTS.iterdir() if p.is_dir()):
        for comp in open_target(folder).components:
            for m in detect(comp).modules:
                activation.check(m, comp.tensors)
                said = m.details.get("activations")
                if said:
                    declared.add((folder.name, said["static"]))
    assert {(CT_FP8, True), (CT_NVFP4, True), (MO_FP8, True), (MO_NVFP4, True), (CT_DYNAMIC, False),
            ("llama-ct-w4a16", False)} <= declared


def test_a_bfloat16_activation_scale_is_carried_as_its_value(tmp_path):
    """llm-compressor stores input_scale in the weight scales' dtype, bfloat16 for a bfloat16 model: it is
    carried as the value it holds, never as its 16 bits read as an integer (0.01 is 0x3C24: 15396.0)."""
    from safetensors.torch import load_file

    src = copy_checkpoint(CT_FP8, tmp_path)
    edit_tensors(src / "model.safetensors", lambda ts: ts.update(
        {k: t.to(torch.bfloat16) for k, t in ts.items() if k.endswith(("input_scale", "weight_scale"))}))
    run = run_inprocess("convert", src, tmp_path / "out", "--to", "compressed-tensors-fp8")
    check_contract(run)
    assert run.code == 0, str(run)
    ours, theirs = load_file(tmp_path / "out" / "model.safetensors"), load_file(src / "model.safetensors")
    scales = [k for k in theirs if k.endswith(".input_scale")]
    assert len(scales) == 14
    for k in scales:
        assert ours[k].float().item() == theirs[k].float().item(), k


@pytest.mark.parametrize("fixture, edit, name", [
    (MO_NVFP4, lambda ts: ts.pop(f"{Q}.input_scale"), f"{Q}.input_scale"),
    (CT_DYNAMIC, lambda ts: ts.__setitem__(f"{Q}.input_scale", torch.tensor([0.01], dtype=torch.float16)),
     f"{Q}.input_scale"),
], ids=["missing", "stray"])
def test_inspect_warns_of_what_every_writing_verb_refuses(tmp_path, fixture, edit, name):
    """inspect never refuses a readable folder: it reports the contradiction (from headers) as a warning,
    and --strict exits 1 on it."""
    src = copy_checkpoint(fixture, tmp_path)
    edit_tensors(src / "model.safetensors", edit)
    run = run_inprocess("inspect", "--strict", src)
    assert run.code == 1 and "Traceback" not in run.err, str(run)
    assert "1 activation scales contradict the config" in run.out and name in run.out, str(run)
