"""Never silently wrong, round 4 continued (issue 35): configs and GGUF metadata that contradict their
tensors, memory bombs sized by a config, options a target does not take, and the refusals that must be
one line.

A model's structural keys (vocab_size, hidden_size, num_hidden_layers, heads, head_dim, MLP and expert
sizes: formats/core/structure.py) are compared with the tensors by every verb that writes or compares
(exit 4 naming the key, the file and, where one, the tensor), by a GGUF source's reader, and by inspect
(a warning; --strict exits 1). Every run here satisfies the hostile-input sweep's contract
(sweep_cases.check_contract: a documented exit, one `qconv: error:` line, no traceback or Python warning,
SRC unchanged, no DST and no litter after a failure)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, QCONV, child_env, child_signals, copy_checkpoint
from sweep_cases import Run, check_contract, edit_json, litter, run_inprocess, snapshot

MEMORY_LIMIT = 4 << 30          # a run refused before it allocates fits well inside this; a bomb does not


def _limited():
    """preexec_fn: default signals and an address-space limit, so a regression that sizes an allocation
    by a lying config fails with a MemoryError here instead of exhausting the machine."""
    signals = child_signals()

    def preexec():
        signals()
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    return preexec


def run_limited(*args, env=None) -> Run:
    proc = subprocess.run([QCONV, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=child_env(**(env or {})), preexec_fn=_limited())
    return Run(list(args), proc.returncode, proc.stdout, proc.stderr)


def _verb_args(verb: str, src: Path, dst: Path, original: Path) -> list:
    return {"inspect": ["inspect", "--strict", src],
            "dequantize": ["dequantize", src, dst],
            "to-gptq": ["convert", "--to", "gptq", src, dst],
            "to-gguf": ["convert", "--to", "gguf", src, dst.with_suffix(".gguf")],
            "validate": ["validate", src, original]}[verb]


def _strict_inspect(run: Run, code: int) -> None:
    """inspect --strict: the report on stdout, exit 1 where it warns (no error line: the report says it)."""
    assert run.code == code, str(run)
    assert "Traceback" not in run.err + run.out and "Warning" not in run.err, str(run)
    assert all(line.startswith("qconv: ") for line in run.err.splitlines()), str(run)


def _refused(run: Run, tmp_path: Path, src_dir: Path, before: dict, code: int, *names: str) -> None:
    check_contract(run, names=names, refusal_only=True)
    assert run.code == code, str(run)
    assert snapshot(src_dir) == before, f"SRC changed\n{run}"
    assert not (tmp_path / "made").exists() and not litter(tmp_path), f"DST or litter left\n{run}"


# ------------------------------------------------------------------------ config.json against the tensors
def _set(key, value):
    """Set KEY (in text_config where the config has one, as a VL model's decoder keys are)."""
    def edit(doc):
        (doc["text_config"] if "text_config" in doc else doc)[key] = value
    return edit


def _drop_head_dim(doc):
    doc.pop("head_dim", None)
    doc["num_attention_heads"] = 3


CONFIG_CASES = {
    # name: (fixture, edit, what the error line names)
    "vocab-5e6": ("llama-fp8-block", _set("vocab_size", 5_000_000), ["vocab_size is 5000000", "512 rows"]),
    "hidden-300": ("llama-gptq-w4g128-actorder", _set("hidden_size", 300), ["hidden_size is 300", "256 columns"]),
    "layers-9": ("llama-ct-w4a16", _set("num_hidden_layers", 9), ["num_hidden_layers is 9", "layer 2 missing"]),
    "layers-1": ("llama-bnb4-nf4-dq", _set("num_hidden_layers", 1), ["num_hidden_layers is 1", "2 layers"]),
    "intermediate-500": ("llama-awq-w4g128", _set("intermediate_size", 500), ["intermediate_size is 500"]),
    "heads-3": ("llama-fp16", _set("num_attention_heads", 3), ["num_attention_heads is 3"]),
    "heads-3-no-head-dim": ("llama-bnb8", _drop_head_dim, ["num_attention_heads is 3"]),
    "head-dim-2^40": ("llama-modelopt-nvfp4", _set("head_dim", 1 << 40), ["head_dim is 1099511627776"]),
    "kv-heads-3": ("llama-ct-nvfp4a16", _set("num_key_value_heads", 3), ["num_key_value_heads"]),
    "hidden-str": ("llama-gptq-w8g128", _set("hidden_size", "256"), ["hidden_size is '256'"]),
    "moe-intermediate-100": ("qwen3moe-fp8-block", _set("moe_intermediate_size", 100),
                             ["moe_intermediate_size is 100", "128 columns"]),
    "moe-fused-intermediate-100": ("qwen3moe-fp8-block-fused", _set("moe_intermediate_size", 100),
                                   ["moe_intermediate_size is 100"]),
    "experts-8": ("qwen3moe-fp8-block", _set("num_local_experts", 8), ["num_local_experts is 8", "expert 4 missing"]),
    "experts-2": ("qwen3moe-ct-fp8-block", _set("num_local_experts", 2), ["num_local_experts is 2", "4 experts"]),
    "vl-vocab": ("qwen3vl-bnb8-skipvisual", _set("vocab_size", 1000), ["text_config.vocab_size is 1000"]),
}
VERBS = ["inspect", "dequantize", "to-gptq", "to-gguf", "validate"]


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_that_contradicts_its_tensors_is_refused_by_every_verb(tmp_path, case, verb):
    fixture, edit, names = CONFIG_CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint(fixture, work)
    edit_json(src / "config.json", edit)
    before = snapshot(work)
    run = run_inprocess(*_verb_args(verb, src, tmp_path / "made" / "dst", CHECKPOINTS / fixture))
    if verb == "inspect":                       # a warning, and --strict fails on it
        _strict_inspect(run, 1)
        assert "config and tensors disagree" in run.out, str(run)
        assert all(n in run.out for n in names), str(run)
        assert snapshot(work) == before
        return
    _refused(run, tmp_path, work, before, 4, str(src / "config.json"), *names)


def test_a_lying_vocab_size_allocates_nothing(tmp_path):
    """The reported memory bomb: vocab_size 200,000,000 beside 512 embedding rows made --to gguf pad its
    token list to 200M entries (24 GB) until the kernel killed it. Refused before any allocation: the run
    fits in an address space of MEMORY_LIMIT."""
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint("llama-fp8-block", work)
    edit_json(src / "config.json", _set("vocab_size", 200_000_000))
    before = snapshot(work)
    run = run_limited("convert", "--to", "gguf", src, tmp_path / "made" / "out.gguf")
    _refused(run, tmp_path, work, before, 4, "vocab_size is 200000000", "model.embed_tokens.weight")


def test_every_fixture_agrees_with_its_config():
    """The real producers' checkpoints have nothing to report: the checks hold what loaders hold."""
    from qconv.formats.core.detect import detect
    from qconv.formats.core.structure import disagreements, logical_shapes
    from qconv.formats.storage.checkpoint import open_target

    checked = 0
    for folder in sorted(p for p in CHECKPOINTS.iterdir() if p.is_dir()):
        for comp in open_target(folder).components:
            det = detect(comp)
            assert disagreements(comp.config, logical_shapes(comp.tensors, det.modules)) == [], comp.path
            checked += 1
    assert checked >= 40


# ------------------------------------------------------------------------ GGUF metadata against the tensors
def rewrite_gguf(src: Path, dst: Path, key: str, value, value_type=None) -> None:
    """SRC rewritten by gguf-py's own writer with one metadata value changed (its type: value_type, else
    the field's own), every tensor as it is."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for k, field in reader.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        v = value if k == key else field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(k, v, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(k, v, value_type if k == key and value_type is not None else field.types[0])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    made = run_inprocess("convert", "--to", "gguf", CHECKPOINTS / "llama-gptq-w8g128", path)
    assert made.code == 0, str(made)
    return path


GGUF_CASES = {
    "block-count-9": ("llama.block_count", 9, ["llama.block_count is 9"]),
    "block-count-1": ("llama.block_count", 1, ["llama.block_count is 1"]),
    "block-count-2^31": ("llama.block_count", (1 << 31) - 1, ["llama.block_count is 2147483647"]),
    "head-count-0": ("llama.attention.head_count", 0, ["llama.attention.head_count is 0"]),
    "head-count-3": ("llama.attention.head_count", 3, ["llama.attention.head_count is 3"]),
    "head-count-kv-3": ("llama.attention.head_count_kv", 3, ["llama.attention.head_count"]),
    "embedding-300": ("llama.embedding_length", 300, ["llama.embedding_length is 300", "256 columns"]),
    "feed-forward-500": ("llama.feed_forward_length", 500, ["llama.feed_forward_length is 500", "512 rows"]),
    "vocab-5e6": ("llama.vocab_size", 5_000_000, ["llama.vocab_size is 5000000", "512 rows"]),
    "head-count-str": ("llama.attention.head_count", "four", ["llama.attention.head_count is 'four'"]),
}


@pytest.mark.parametrize("verb", ["inspect", "dequantize", "to-gptq", "to-gguf"])
@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_metadata_that_contradicts_its_tensors_is_refused(tmp_path, gguf_model, case, verb):
    import gguf

    key, value, names = GGUF_CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    src = work / "model.gguf"
    rewrite_gguf(gguf_model, src, key, value, gguf.GGUFValueType.STRING if isinstance(value, str) else None)
    before = snapshot(work)
    args = _verb_args(verb, src, tmp_path / "made" / "dst", gguf_model)
    run = run_limited(*args) if value == (1 << 31) - 1 else run_inprocess(*args)
    if verb == "inspect":
        _strict_inspect(run, 1)
        assert "metadata and tensors disagree" in run.out, str(run)
        assert all(n in run.out for n in names), str(run)
        return
    _refused(run, tmp_path, work, before, 4, str(src), *names)


# ------------------------------------------------------------------------ values no GGUF field holds
@pytest.mark.parametrize("key,value,gguf_key", [
    ("max_position_embeddings", 1 << 62, "llama.context_length"),
    ("rms_norm_eps", 1e300, "llama.attention.layer_norm_rms_epsilon"),
])
def test_config_values_a_gguf_field_cannot_hold_are_refused(tmp_path, key, value, gguf_key):
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint("llama-fp16", work)
    edit_json(src / "config.json", _set(key, value))
    before = snapshot(work)
    run = run_inprocess("convert", "--to", "gguf", src, tmp_path / "made" / "out.gguf")
    _refused(run, tmp_path, work, before, 4, str(src / "config.json"), gguf_key)


# ------------------------------------------------------------------------ options a target does not take
OPTION_CASES = [
    ("gguf", ["--group-size", "64"], "--group-size"), ("gguf", ["--sym"], "--sym/--asym"),
    ("gguf", ["--block-size", "128x128"], "--block-size"), ("gguf", ["--scale-dtype", "float16"], "--scale-dtype"),
    ("gguf", ["--blocksize", "64"], "--block-size"),    # the old spelling of bnb4's --block-size
    ("gptq", ["--gguf-asym", "q4_1"], "--gguf-asym"), ("gptq", ["--gguf-float"], "--gguf-float"),
    ("gptq", ["--block-size", "64x64"], "--block-size"), ("gptq", ["--quant-storage", "uint8"], "--quant-storage"),
    ("awq", ["--no-double-quant"], "--double-quant/--no-double-quant"), ("bnb8", ["--group-size", "128"], "--group-size"),
    ("bnb4-nf4", ["--scale-dtype", "float32"], "--scale-dtype"), ("fp8", ["--bits", "8"], "--bits"),
    ("fp8", ["--scale-dtype", "float32"], "--scale-dtype"), ("compressed-tensors-mxfp4", ["--bits", "4"], "--bits"),
    ("modelopt-nvfp4", ["--group-size", "16"], "--group-size"), ("float16", ["--bits", "4"], "--bits"),
    ("bfloat16", ["--gguf-float-type", "f32"], "--gguf-float-type"),
]


@pytest.mark.parametrize("to,args,flag", OPTION_CASES, ids=[f"{t}{a[0]}" for t, a, _ in OPTION_CASES])
def test_an_option_the_target_does_not_take_is_a_usage_error(tmp_path, to, args, flag):
    dst = tmp_path / "made" / ("out.gguf" if to == "gguf" else "out")
    run = run_inprocess("convert", "--to", to, *args, CHECKPOINTS / "llama-gptq-w4g128-actorder", dst)
    check_contract(run, names=(f"{flag}: --to {to} takes no such option",), refusal_only=True)
    assert run.code == 2 and not (tmp_path / "made").exists(), str(run)


@pytest.mark.parametrize("bits", ["2", "3", "5", "6", "7"])
def test_gguf_bits_other_than_4_or_8_are_a_usage_error(tmp_path, bits):
    """--to gguf --bits 3 requantized every module to Q8_0 with the false reason "4-bit codes become
    3-bit": GGUF's requantized modules are Q4_0 or Q8_0 only."""
    run = run_inprocess("convert", "--to", "gguf", "--bits", bits, CHECKPOINTS / "llama-gptq-w4g128-actorder",
                        tmp_path / "made" / "out.gguf")
    check_contract(run, names=(f"--bits {bits}: --to gguf requantizes to Q4_0 (--bits 4) or Q8_0 (--bits 8)",),
                   refusal_only=True)
    assert run.code == 2


# ------------------------------------------------------------------------ a refusal's advice works
def _intermediate_500(work: Path) -> Path:
    """llama-fp16 with an MLP of 500 (config and tensors alike: a model every loader builds), so down_proj
    has 500 input features, not whole 32-weight GGUF blocks."""
    src = copy_checkpoint("llama-fp16", work)
    tensors = load_file(src / "model.safetensors")
    for name in list(tensors):
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            tensors[name] = tensors[name][:500].contiguous()
        elif name.endswith("down_proj.weight"):
            tensors[name] = tensors[name][:, :500].contiguous()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    edit_json(src / "config.json", _set("intermediate_size", 500))
    return src


def test_gguf_float_does_what_the_refusal_says(tmp_path):
    """A module whose inputs are not whole blocks is refused with "use --gguf-float"; with --gguf-float
    it is written as float, its values the source's exactly (the same refusal came back before)."""
    import gguf

    work = tmp_path / "work"
    work.mkdir()
    src = _intermediate_500(work)
    before = snapshot(work)
    run = run_inprocess("convert", "--to", "gguf", src, tmp_path / "made" / "out.gguf")
    _refused(run, tmp_path, work, before, 5, "model.layers.0.mlp.down_proj", "use --gguf-float")
    out = tmp_path / "out.gguf"
    run = run_inprocess("convert", "--to", "gguf", "--gguf-float", src, out)
    check_contract(run)
    assert run.code == 0, str(run)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    down = tensors["blk.0.ffn_down.weight"]
    assert down.tensor_type == gguf.GGMLQuantizationType.F16
    want = load_file(src / "model.safetensors")["model.layers.0.mlp.down_proj.weight"].numpy()
    assert np.array_equal(np.asarray(down.data).reshape(want.shape), want)
    run = run_inprocess("convert", "--to", "gguf", "--gguf-float", "--gguf-float-type", "q8_0", src,
                        tmp_path / "made" / "q8.gguf")
    _refused(run, tmp_path, work, before, 5, "model.layers.0.mlp.down_proj", "--gguf-float-type f16, bf16 or f32")


def test_nvfp4_module_of_odd_width_is_refused_by_both_nvfp4_targets(tmp_path):
    """A ModelOpt NVFP4 module of 254 inputs (an extra Linear, so the model's own stay as its config says)
    is no whole number of NVFP4 groups of 16: --to modelopt-nvfp4 exited 70, compressed-tensors-nvfp4 5."""
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint("llama-modelopt-nvfp4", work)
    tensors = load_file(src / "model.safetensors")
    q, odd = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.odd_proj"
    for leaf, t in [(k[len(q) + 1:], v) for k, v in tensors.items() if k.startswith(q + ".")]:
        tensors[f"{odd}.{leaf}"] = t[:, :127].contiguous() if leaf == "weight" else t.clone()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(work)
    for to in ("modelopt-nvfp4", "compressed-tensors-nvfp4"):
        run = run_inprocess("convert", "--to", to, src, tmp_path / "made" / "dst")
        _refused(run, tmp_path, work, before, 5, odd)
        assert "254 input features" in run.err or "has 254 input features" in run.err, str(run)


# ------------------------------------------------------------------------ FP8 configs no loader takes
def _qc(key, value):
    def edit(doc):
        doc["quantization_config"][key] = value
    return edit


FP8_CONFIG_CASES = {
    "activation-banana": (_qc("activation_scheme", "banana"), 4, "activation_scheme is 'banana'"),
    "static-without-scales": (_qc("activation_scheme", "static"), 4, "activation_scheme is static"),
    "modules-to-convert": (_qc("modules_to_convert", ["embed_tokens"]), 5, "modules_to_convert"),
    "ue8m0-not-powers-of-two": (_qc("scale_fmt", "ue8m0"), 4, "scale_fmt is ue8m0"),
}


@pytest.mark.parametrize("verb", ["dequantize", "to-gptq", "to-gguf"])
@pytest.mark.parametrize("case", sorted(FP8_CONFIG_CASES))
def test_fp8_config_fields_no_loader_takes_are_refused(tmp_path, case, verb):
    edit, code, needle = FP8_CONFIG_CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint("llama-fp8-block", work)
    edit_json(src / "config.json", edit)
    before = snapshot(work)
    run = run_inprocess(*_verb_args(verb, src, tmp_path / "made" / "dst", CHECKPOINTS / "llama-fp8-block"))
    _refused(run, tmp_path, work, before, code, needle)


# ------------------------------------------------------------------------ tokenizers into GGUF
def _vocab_edit(fn):
    def edit(doc):
        fn(doc["model"]["vocab"], doc)
    return edit


def _duplicate_id(vocab, doc):
    first = next(t for t, i in vocab.items() if i == 3)
    vocab[first + "x"] = 3


TOKENIZER_CASES = {
    "duplicate-id": (_vocab_edit(_duplicate_id), "the same id 3"),
    "negative-id": (_vocab_edit(lambda v, d: v.update({"zzz-negative": -1})), "the id -1"),
    "merge-of-unknown": (lambda d: d["model"]["merges"].append("qqqq zzzz"), "qqqq zzzz"),
    "added-negative": (lambda d: d["added_tokens"].append({"id": -5, "content": "<x>", "special": True}),
                       "added token"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_CASES))
def test_tokenizer_json_no_tokenizer_builds_is_refused(tmp_path, case):
    edit, needle = TOKENIZER_CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint("llama-gptq-w8g128", work)
    doc = json.loads((src / "tokenizer.json").read_text())
    if not doc.get("added_tokens"):
        doc["added_tokens"] = []
    edit(doc)
    (src / "tokenizer.json").write_text(json.dumps(doc))
    before = snapshot(work)
    run = run_inprocess("convert", "--to", "gguf", src, tmp_path / "made" / "out.gguf")
    _refused(run, tmp_path, work, before, 4, str(src / "tokenizer.json"), needle)


def test_legacy_rope_scaling_is_the_one_computed(tmp_path):
    """transformers computes with rope_scaling where a config has it (over rope_parameters): a yarn there
    is refused for GGUF as it is in rope_parameters, never dropped."""
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint("llama-fp16", work)
    edit_json(src / "config.json", _set("rope_scaling", {"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 64}))
    before = snapshot(work)
    run = run_inprocess("convert", "--to", "gguf", src, tmp_path / "made" / "out.gguf")
    _refused(run, tmp_path, work, before, 5, "rope type 'yarn'")


# ------------------------------------------------------------------------ a killed GGUF run leaves nothing
def test_a_killed_gguf_run_is_cleaned_up_by_the_next(tmp_path):
    """SIGKILL (the kernel's out-of-memory killer) cannot be caught: the staging folder stays, and the
    next run to the same DST removes it before it writes."""
    out = tmp_path / "out.gguf"
    src = CHECKPOINTS / "llama-gptq-w8g128"
    proc = subprocess.run([QCONV, "convert", "--to", "gguf", str(src), str(out)], capture_output=True, text=True,
                          timeout=300, env=child_env(QCONV_TEST_SIGNAL="tensor-written:SIGKILL"),
                          preexec_fn=child_signals())
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out.gguf.qconv-tmp-")]
    run = run_inprocess("convert", "--to", "gguf", src, out)
    assert run.code == 0, str(run)
    assert sorted(os.listdir(tmp_path)) == ["out.gguf", "out.md"]        # the GGUF and its model card


# ------------------------------------------------------------------------ the Python API's arguments
@pytest.mark.parametrize("call", [
    lambda q: q.inspect(None), lambda q: q.inspect(b"/tmp"), lambda q: q.dequantize(None, "x"),
    lambda q: q.convert(CHECKPOINTS / "llama-fp16", None, to="gptq"), lambda q: q.validate(b"a", "b"),
    lambda q: q.inspect(CHECKPOINTS / "llama-fp16", strict="no"),
    lambda q: q.dequantize(CHECKPOINTS / "llama-fp16", "x", overwrite="yes"),
], ids=["inspect-none", "inspect-bytes", "dequantize-none", "convert-none", "validate-bytes", "strict-no",
        "overwrite-yes"])
def test_api_arguments_of_the_wrong_type_are_usage_errors(call):
    import qconv
    from qconv.errors import UsageError

    with pytest.raises(UsageError) as err:
        call(qconv)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
