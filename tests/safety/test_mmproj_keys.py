"""Never silently wrong, round 5 (issue 47, item 3): the clip keys of a VL GGUF pair's mmproj file against
the vision tower's tensors.

`qconv` reads a qwen2vl / qwen3vl text GGUF with llama.cpp's mmproj file beside it (mmproj-<name>.gguf)
as the VL model whole (formats/gguf/mmproj.py read_back), its vision_config built from the mmproj file's
`clip.vision.*` keys. llama.cpp builds the tower's graph from the same keys, so a key that lies about the
tensors (a patch_size of 16 beside a 14 x 14 patch kernel, an embedding_length of 17 beside 128-wide
attention, 5 heads that do not divide 128, an image_size of 0) makes a model no loader builds: every verb
refuses it, exit 4 naming the mmproj file and the key (as a text GGUF's own metadata keys are:
test_structure.py), and `inspect m.gguf` warns (--strict exits 1). An mmproj file of another model is
unsupported (exit 5); a pair whose two files are each consistent but not one model is corrupt (exit 4).
Every run satisfies the hostile-input sweep's contract (sweep_cases.check_contract)."""

from __future__ import annotations

import math
import resource
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import CHECKPOINTS, QCONV, child_env, child_signals
from sweep_cases import Run, check_contract, litter, run_inprocess, snapshot

MMPROJ = "mmproj-m.gguf"
KEEP = object()                     # _rewrite: a key left out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Path]:
    """The two Qwen VL towers as GGUF pairs (m.gguf and mmproj-m.gguf in one folder), made once."""
    made = {}
    for name, fixture in (("qwen25", "qwen25vl-bf16"), ("qwen3", "qwen3vl-bf16")):
        root = tmp_path_factory.mktemp(name)
        src = CHECKPOINTS / fixture
        if not (src / "tokenizer.json").exists():       # qwen3vl-bf16 has none: its int8 twin's
            src = shutil.copytree(src, root / fixture)
            for doc in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(CHECKPOINTS / "qwen3vl-bnb8-skipvisual" / doc, src)
        run = run_inprocess("convert", "--to", "gguf", "--gguf-float", src, root / "pair" / "m.gguf")
        assert run.code == 0, str(run)
        made[name] = root / "pair"
    return made


def _rewrite(src: Path, dst: Path, keys: dict | None = None, tensors: dict | None = None) -> None:
    """SRC rewritten by gguf-py's own writer: KEYS' values changed (a value, or (value, "UINT32"): of that
    GGUFValueType, for a new key or another type; KEEP: the key left out), TENSORS' data replaced,
    everything else as it is."""
    import gguf

    keys, tensors = dict(keys or {}), tensors or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for k, field in reader.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        value = keys.pop(k, field.contents())
        if value is KEEP:
            continue
        kind = field.types[0]
        if isinstance(value, tuple):
            value, kind = value[0], gguf.GGUFValueType[value[1]]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(k, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(k, value, kind)
    for k, (value, kind) in keys.items():                # keys the file did not have
        writer.add_key_value(k, value, gguf.GGUFValueType[kind])
    for t in reader.tensors:
        writer.add_tensor(t.name, tensors.get(t.name, np.array(t.data)), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _work(tmp_path: Path, pair: Path, **edit) -> Path:
    """tmp/work: the pair's text GGUF, and its mmproj file rewritten; returns the text GGUF."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(pair / "m.gguf", work / "m.gguf")
    _rewrite(pair / MMPROJ, work / MMPROJ, **edit)
    return work / "m.gguf"


# name: (pair, {key: value}, exit code, what the error line names besides the mmproj file)
CASES = {
    # the four
    "patch-size-16": ("qwen25", {"clip.vision.patch_size": 16}, 4,
                      ["clip.vision.patch_size is 16", "v.patch_embd.weight", "14 x 14"]),
    "embedding-17": ("qwen3", {"clip.vision.embedding_length": 17}, 4,
                     ["clip.vision.embedding_length is 17", "128"]),
    "head-count-5": ("qwen25", {"clip.vision.attention.head_count": 5}, 4,
                     ["clip.vision.attention.head_count is 5", "does not divide", "128"]),
    "image-size-0": ("qwen25", {"clip.vision.image_size": 0}, 4, ["clip.vision.image_size is 0"]),
    # every other key the read-back uses
    "qwen3-patch-size-14": ("qwen3", {"clip.vision.patch_size": 14}, 4,
                            ["clip.vision.patch_size is 14", "v.patch_embd.weight", "16 x 16"]),
    "embedding-130": ("qwen25", {"clip.vision.embedding_length": 130}, 4,
                      ["clip.vision.embedding_length is 130", "v.patch_embd.weight", "128"]),
    "head-count-0": ("qwen25", {"clip.vision.attention.head_count": 0}, 4,
                     ["clip.vision.attention.head_count is 0", "positive integer"]),
    "head-count-64": ("qwen25", {"clip.vision.attention.head_count": 64}, 4,
                      ["clip.vision.attention.head_count is 64", "multiple of 4"]),
    "feed-forward-500": ("qwen25", {"clip.vision.feed_forward_length": 500}, 4,
                         ["clip.vision.feed_forward_length is 500", "v.blk.0.ffn_gate.weight", "256 rows"]),
    "qwen3-feed-forward-500": ("qwen3", {"clip.vision.feed_forward_length": 500}, 4,
                               ["clip.vision.feed_forward_length is 500", "v.blk.0.ffn_up.weight", "256 rows"]),
    "block-count-1": ("qwen25", {"clip.vision.block_count": 1}, 4,
                      ["clip.vision.block_count is 1", "v.blk.0 .. v.blk.1"]),
    "block-count-3": ("qwen25", {"clip.vision.block_count": 3}, 4,
                      ["clip.vision.block_count is 3", "block 2 missing"]),
    "block-count-str": ("qwen25", {"clip.vision.block_count": ("two", "STRING")}, 4,
                        ["clip.vision.block_count is 'two'"]),
    "projection-dim-128": ("qwen25", {"clip.vision.projection_dim": 128}, 4,
                           ["clip.vision.projection_dim is 128", "mm.2.weight", "256 rows"]),
    "qwen3-spatial-merge-3": ("qwen3", {"clip.vision.spatial_merge_size": 3}, 4,
                              ["clip.vision.spatial_merge_size (3)", "mm.0.weight", "512 columns"]),
    "spatial-merge-0": ("qwen25", {"clip.vision.spatial_merge_size": (0, "UINT32")}, 4,
                        ["clip.vision.spatial_merge_size is 0"]),
    "image-size-100": ("qwen25", {"clip.vision.image_size": 100}, 4,
                       ["clip.vision.image_size is 100", "multiple of clip.vision.patch_size (14)"]),
    "n-wa-pattern-5": ("qwen25", {"clip.vision.n_wa_pattern": 5}, 4,
                       ["clip.vision.n_wa_pattern is 5", "clip.vision.block_count (2)"]),
    "n-wa-pattern-missing": ("qwen25", {"clip.vision.n_wa_pattern": KEEP}, 4, ["clip.vision.n_wa_pattern"]),
    "deepstack-flags": ("qwen3", {"clip.vision.is_deepstack_layers": [True, False]}, 4,
                        ["clip.vision.is_deepstack_layers", "v.deepstack.1"]),
    "deepstack-flags-3": ("qwen3", {"clip.vision.is_deepstack_layers": [True, True, False]}, 4,
                          ["clip.vision.is_deepstack_layers", "clip.vision.block_count (2)"]),
    "image-std-0": ("qwen25", {"clip.vision.image_std": [0.5, 0.0, 0.5]}, 4, ["clip.vision.image_std"]),
    "image-mean-2": ("qwen25", {"clip.vision.image_mean": [0.5, 0.5]}, 4, ["clip.vision.image_mean"]),
    "epsilon-nan": ("qwen25", {"clip.vision.attention.layer_norm_epsilon": (math.nan, "FLOAT32")}, 4,
                    ["clip.vision.attention.layer_norm_epsilon is nan"]),
    "no-vision-encoder": ("qwen25", {"clip.has_vision_encoder": False}, 4, ["clip.has_vision_encoder is False"]),
    # llama.cpp computes another activation than the model's: not what qconv reads back
    "gelu-for-silu": ("qwen25", {"clip.use_silu": KEEP, "clip.use_gelu": (True, "BOOL")}, 5, ["clip.use_silu"]),
    "qwen3-no-gelu": ("qwen3", {"clip.use_gelu": False}, 5, ["clip.use_gelu"]),
    # an mmproj file of another model
    "another-projector": ("qwen25", {"clip.projector_type": "qwen3vl_merger"}, 5,
                          ["clip.projector_type 'qwen3vl_merger' is not 'qwen2.5vl_merger'"]),
}
VERBS = {"dequantize": lambda src, dst: ["dequantize", src, dst],
         "to-gptq": lambda src, dst: ["convert", "--to", "gptq", src, dst],
         "to-gguf": lambda src, dst: ["convert", "--to", "gguf", src, dst.with_suffix(".gguf")]}


def _edit(case: str) -> dict:
    return {"keys": CASES[case][1]}


def _refused(run: Run, tmp_path: Path, before: dict, code: int, *names: str) -> None:
    check_contract(run, names=names, refusal_only=True)
    assert run.code == code, str(run)
    assert snapshot(tmp_path / "work") == before, f"SRC changed\n{run}"
    assert not (tmp_path / "made").exists() and not litter(tmp_path), f"DST or litter left\n{run}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_clip_keys_that_contradict_the_tower_are_refused(tmp_path, pairs, case):
    pair, _, code, names = CASES[case]
    src = _work(tmp_path, pairs[pair], **_edit(case))
    before = snapshot(tmp_path / "work")
    for verb, args in VERBS.items():
        run = run_inprocess(*args(src, tmp_path / "made" / "dst"))
        _refused(run, tmp_path, before, code, str(src.with_name(MMPROJ)), *names)


@pytest.mark.parametrize("case", ["patch-size-16", "embedding-17", "head-count-5", "image-size-0", "block-count-1",
                                  "deepstack-flags"])
def test_inspect_warns_of_the_clip_keys(tmp_path, pairs, case):
    """inspect reads headers only and refuses nothing: the text GGUF's report (and the mmproj file's own)
    says the clip keys and the tower disagree, naming the key; --strict exits 1 on it."""
    pair, _, _, names = CASES[case]
    src = _work(tmp_path, pairs[pair], **_edit(case))
    for path in (src, src.with_name(MMPROJ)):
        run = run_inprocess("inspect", path)
        check_contract(run)
        assert run.code == 0 and f"{MMPROJ}: clip keys and tensors disagree" in run.out, str(run)
        assert names[0] in run.out, str(run)
        strict = run_inprocess("inspect", "--strict", path)
        assert strict.code == 1 and "Traceback" not in strict.err, str(strict)


def test_the_intact_pairs_have_nothing_to_report(pairs):
    for pair in pairs.values():
        for path in (pair / "m.gguf", pair / MMPROJ):
            run = run_inprocess("inspect", "--strict", path)
            assert run.code == 0 and "disagree" not in run.out, str(run)


def test_a_pair_that_is_not_one_model_is_corrupt(tmp_path, pairs):
    """Each file consistent (the mmproj file's projector writes 128 features, as its projection_dim says),
    the two not one model: the text model's embeddings are 256 wide. Exit 4 naming the mmproj file, its
    key and the text model's."""
    import gguf

    reader = gguf.GGUFReader(pairs["qwen25"] / MMPROJ)
    data = {t.name: np.array(t.data) for t in reader.tensors if t.name in ("mm.2.weight", "mm.2.bias")}
    src = _work(tmp_path, pairs["qwen25"], keys={"clip.vision.projection_dim": 128},
                tensors={k: np.ascontiguousarray(v[:128]) for k, v in data.items()})
    before = snapshot(tmp_path / "work")
    for verb, args in VERBS.items():
        run = run_inprocess(*args(src, tmp_path / "made" / "dst"))
        _refused(run, tmp_path, before, 4, str(src.with_name(MMPROJ)), "clip.vision.projection_dim 128",
                 "qwen2vl.embedding_length 256", "not one model")


def _limited():
    signals = child_signals()

    def preexec():
        signals()
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    return preexec


def test_a_block_count_of_2_31_allocates_nothing(tmp_path, pairs):
    """block_count 2^31 - 1 beside two blocks: refused from the tensors' names before anything is sized by
    it (the read-back's tensor list once was), in an address space of 4 GiB."""
    src = _work(tmp_path, pairs["qwen25"], keys={"clip.vision.block_count": (1 << 31) - 1})
    before = snapshot(tmp_path / "work")
    args = VERBS["dequantize"](src, tmp_path / "made" / "dst")
    proc = subprocess.run([QCONV, *map(str, args)], capture_output=True, text=True, timeout=300, env=child_env(),
                          preexec_fn=_limited())
    _refused(Run(args, proc.returncode, proc.stdout, proc.stderr), tmp_path, before, 4,
             str(src.with_name(MMPROJ)), "clip.vision.block_count is 2147483647")
