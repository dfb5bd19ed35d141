"""The hostile-input sweep (issue 10), kept as tests: a catalogue of broken or hostile inputs, each a
real fixture copied into tmp_path and changed by one small named mutation, run through the verbs that
can meet it (over the catalogue: inspect, inspect --json, dequantize, convert --to every target,
bnb8-to-gptq, validate against the intact fixture, convert --validate).

Every run: a documented exit code, never 70; on failure exactly one stderr line ``qconv: error:`` naming
the file; no traceback and no Python warning; no DST, no ``.DST.qconv-*`` litter and no parent folder
qconv created; the work folder (SRC and whatever lies beside it) byte-identical. An exit 0 of a writing
verb is checked against the intact fixture's producer oracle (exit 0 with wrong weights is what the
sweep exists to catch), and a case whose input no verb may vouch for must not exit 0 at all.

Runs are in-process (qconv.cli.main; its signal handlers are restored after each run and it never
changes directory); inputs that could hang a regressed reader (FIFOs, /dev/zero, a huge group size)
run as subprocesses with a timeout."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import CHECKPOINTS
from sweep_cases import (SECRET, TARGETS, check_contract, check_output, edit_header, edit_json,
                         edit_quant_state, edit_tensors, expected_weights, fixture_copy, litter,
                         read_raw_header, reshard, run_inprocess, run_subprocess, snapshot, strict_json)

REFERENCE = CHECKPOINTS            # fixtures copied from the shared reference checkpoints
ST = "model.safetensors"
Q = "model.layers.0.self_attn.q_proj"
WRITING = ("dequantize", "to-", "bnb8-to-gptq", "validate-")


@dataclass
class Case:
    name: str
    fixture: str                  # the intact fixture: validate's other side, and the oracle
    make: Callable                # make(work) -> the source to run on
    names: tuple = ()             # what the error line must name (the broken file, tensor)
    kind: str = "state"           # read: every verb refuses; state: inspect may describe it, nothing
    #                               else may exit 0; benign: exit 0 allowed, and then checked
    verbs: list | None = None     # None: the kind's default set, convert targets rotating
    extra: dict = field(default_factory=dict)       # verb -> extra arguments
    must_succeed: tuple = ()      # verbs that must exit 0
    subprocess: bool = False
    expected: Callable | None = None                # fixture -> expected weights, when not the oracle's
    prepare: Callable | None = None                 # prepare(tmp) before the run (beside DST)
    inspect_warns: bool = False   # inspect must say what it sees does not add up (it reads headers only)


def _work_victim(work):
    fixture_copy("llama-bnb8", work, "victim")
    return work / "victim"


def _pipeline(work):
    return fixture_copy("pipeline-qwen3vl-bnb8", work, "pipe")


def _add_components(pipe, *keys):
    edit_json(pipe / "model_index.json", lambda d: d.update({k: ["transformers", "X"] for k in keys}))


# --- read: the container itself is broken; every verb refuses --------------------------------------

def truncated_shard(w):
    m = fixture_copy("llama-bnb8", w)
    os.truncate(m / ST, (m / ST).stat().st_size // 2)
    return m


def header_length_past_end(w):
    m = fixture_copy("llama-gptq-w8g128", w)
    blob = bytearray((m / ST).read_bytes())
    blob[:8] = struct.pack("<Q", len(blob) + 10)
    (m / ST).write_bytes(bytes(blob))
    return m


def overlapping_offsets(w):
    m = fixture_copy("llama-bnb4-fp4", w)

    def fn(h):
        (b0, e0), _ = min((v["data_offsets"], k) for k, v in h.items() if k != "__metadata__")
        (b1, e1), k1 = sorted((v["data_offsets"], k) for k, v in h.items() if k != "__metadata__")[1]
        shift = min(16, e0 - b0)
        h[k1]["data_offsets"] = [b1 - shift, e1 - shift]
    edit_header(m / ST, fn)
    return m


def offsets_past_end(w):
    m = fixture_copy("llama-autoround-w8g128", w)

    def fn(h):
        last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        b, e = h[last]["data_offsets"]
        h[last]["data_offsets"] = [b + 1024, e + 1024]
    edit_header(m / ST, fn)
    return m


def shape_beyond_span(w):
    m = fixture_copy("llama-gptq-w4g64-asym", w)
    edit_header(m / ST, lambda h: h[Q + ".qweight"].update(shape=[64, 256]))
    return m


def scb_dtype_relabel_f16(w):
    m = fixture_copy("llama-bnb8", w)
    edit_header(m / ST, lambda h: h[Q + ".SCB"].update(dtype="F16"))       # half the bytes it spans
    return m


def header_not_json(w):
    m = fixture_copy("llama-bnb4-nf4-bf16storage", w)
    blob = (m / ST).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    (m / ST).write_bytes(blob[:8] + b"{" + b"\xff" * (n - 1) + blob[8 + n:])
    return m


def metadata_list(w):
    m = fixture_copy("llama-autoround-w4g128-mixed8", w)
    edit_header(m / ST, lambda h: h.update({"__metadata__": []}))
    return m


def config_bad_json(w):
    m = fixture_copy("llama-gptq-w3g128", w)
    (m / "config.json").write_text("{'bits': 3,}")
    return m


def quantization_config_not_object(w):
    m = fixture_copy("llama-bnb4-nf4-dq", w)
    edit_json(m / "config.json", lambda c: c.update(quantization_config="bitsandbytes"))
    return m


def index_missing_shard(w):
    m = fixture_copy("llama-bnb8", w)
    reshard(m)
    (m / "model-00002-of-00002.safetensors").unlink()
    return m


def index_points_outside(w):
    m = fixture_copy("llama-gptq-w4g64-asym", w)
    reshard(m)
    shutil.copy(m / "model-00001-of-00002.safetensors", w / "evil.safetensors")

    def fn(d):
        wm = d["weight_map"]
        wm.update({k: "../evil.safetensors" for k in sorted(wm)[:3]})
    edit_json(m / "model.safetensors.index.json", fn)
    return m


def duplicate_tensor_across_shards(w):
    m = fixture_copy("llama-bnb8", w)
    from safetensors.torch import save_file
    save_file({"model.norm.weight": torch.full((256,), 2.0, dtype=torch.float16)}, m / "extra.safetensors")
    return m


def index_fifo(w):
    m = fixture_copy("llama-bnb8", w)
    os.mkfifo(m / "model.safetensors.index.json")
    return m


def index_dev_zero(w):
    m = fixture_copy("llama-bnb8", w)
    (m / "model.safetensors.index.json").symlink_to("/dev/zero")
    return m


def weights_link_out_of_src(w):
    _work_victim(w)
    m = fixture_copy("llama-bnb8", w)
    (m / ST).unlink()
    (m / ST).symlink_to("../victim/model.safetensors")
    return m


def pipeline_key_parent(w):
    _work_victim(w)
    pipe = _pipeline(w)
    _add_components(pipe, "../victim")
    return pipe


def pipeline_key_absolute(w):
    victim = _work_victim(w)
    pipe = _pipeline(w)
    _add_components(pipe, str(victim))
    return pipe


def pipeline_component_link_etc(w):
    pipe = _pipeline(w)
    (pipe / "scheduler").symlink_to("/etc")
    _add_components(pipe, "scheduler")
    return pipe


def pipeline_component_truncated(w):
    pipe = _pipeline(w)
    os.truncate(pipe / "text_encoder" / ST, 1000)
    return pipe


def quant_state_not_json(w):
    m = fixture_copy("llama-bnb4-nf4-dq", w)
    header, _ = read_raw_header(m / ST)
    name = Q + ".weight.quant_state.bitsandbytes__nf4"
    (n,) = struct.unpack("<Q", (m / ST).read_bytes()[:8])
    with open(m / ST, "r+b") as f:
        f.seek(8 + n + header[name]["data_offsets"][0])
        f.write(b"\x00garbage")
    return m


# --- state: well-formed files whose quantization state qconv cannot account for --------------------

def _tensors_edit(fixture, fn):
    def make(w):
        m = fixture_copy(fixture, w)
        edit_tensors(m / ST, fn)
        return m
    return make


def _set(name, index, value):
    return lambda ts: ts[name].__setitem__(index, value)


def scb_not_in_index(w):
    m = fixture_copy("llama-bnb8", w)
    header, _ = read_raw_header(m / ST)
    (m / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: ST for k in header if k not in ("__metadata__", Q + ".SCB")}}))
    return m


def _quant_state_edit(key, value, fixture="llama-bnb4-nf4-dq", *, drop=False):
    def make(w):
        m = fixture_copy(fixture, w)
        edit_quant_state(m / ST, Q, lambda qs: qs.pop(key) if drop else qs.update({key: value}))
        return m
    return make


def nested_absmax_reshaped(w):
    """The same 4 float32 values, stored as [2, 2]: bitsandbytes flattens nothing here."""
    m = fixture_copy("llama-bnb4-nf4-dq", w)
    edit_header(m / ST, lambda h: h[Q + ".weight.nested_absmax"].update(shape=[2, 2]))
    return m


def _gptq_width(bits):
    """q_proj's shapes rewritten as bits-wide codes, a width GPTQ never packs."""
    def edit(ts):
        out, inp = ts[Q + ".scales"].shape[1], ts[Q + ".g_idx"].shape[0]
        gen = torch.Generator().manual_seed(bits)
        ts[Q + ".qweight"] = torch.randint(0, 1 << 30, (inp * bits // 32, out), generator=gen, dtype=torch.int32)
        ts[Q + ".qzeros"] = torch.randint(0, 1 << 30, (ts[Q + ".scales"].shape[0], out * bits // 32),
                                          generator=gen, dtype=torch.int32)
    return _tensors_edit("llama-gptq-w4g64-asym", edit)


def _scale_nan_float32(ts):
    ts[Q + ".scales"] = ts[Q + ".scales"].float()
    ts[Q + ".scales"][1, 2] = float("nan")


def _method(method):
    def make(w):
        m = fixture_copy("llama-gptq-w4g64-asym", w)
        edit_json(m / "config.json", lambda c: c["quantization_config"].update(quant_method=method))
        return m
    return make


def _reference(name, method):
    """A producer-made checkpoint relabelled with a quant_method qconv does not decode."""
    def make(w):
        shutil.copytree(REFERENCE / name, w / "model", ignore=shutil.ignore_patterns("oracle"))
        edit_json(w / "model" / "config.json", lambda c: c["quantization_config"].update(quant_method=method))
        return w / "model"
    return make


def _fp8_config(**changes):
    def make(w):
        m = fixture_copy("llama-fp8-block", w)
        edit_json(m / "config.json", lambda c: c["quantization_config"].update(changes))
        return m
    return make


def quantization_config_removed(w):
    m = fixture_copy("llama-gptq-w4g64-asym", w)
    edit_json(m / "config.json", lambda c: c.pop("quantization_config"))
    (m / "quantize_config.json").unlink()
    return m


def pipelines_disjoint(w):
    pipe = _pipeline(w)
    (pipe / "text_encoder").rename(pipe / "text_encoder_renamed")
    edit_json(pipe / "model_index.json",
              lambda d: d.update(text_encoder_renamed=d.pop("text_encoder")))
    return pipe


# --- benign: exit 0 is allowed (some verbs must succeed), and its result is checked -------------------

PICKLE = pickle.dumps({"harmless": True})


def pickle_beside_weights(w):
    m = fixture_copy("llama-bnb8", w)
    (m / "training_args.bin").write_bytes(PICKLE)
    (m / "extra.pkl").write_bytes(PICKLE)
    return m


def pipeline_pickles(w):
    pipe = _pipeline(w)
    (pipe / "extra.pkl").write_bytes(PICKLE)
    (pipe / "text_encoder" / "training_args.bin").write_bytes(PICKLE)
    return pipe


def zero_size_tensor(w):
    m = fixture_copy("llama-bnb8", w)
    edit_tensors(m / ST, lambda ts: ts.update({"model.empty_buffer": torch.zeros(0, 256, dtype=torch.float16)}))
    return m


def _with_zero_size(fixture):
    want = expected_weights(fixture)
    want[""]["model.empty_buffer"] = torch.zeros(0, 256).numpy()
    return want


def unquantized_source(w):
    return fixture_copy("llama-fp16", w)


def sharded_control(w):
    m = fixture_copy("llama-bnb8", w)
    reshard(m)
    return m


def sharded_gptq_control(w):
    m = fixture_copy("llama-gptq-w4g64-asym", w)
    reshard(m)
    return m


def intact_bnb8(w):
    return fixture_copy("llama-bnb8", w)


def stale_temp_of_dead_run(tmp):
    """A complete-looking temp folder of a run killed by SIGKILL: a PID above Linux's pid_max."""
    stale = tmp / "made" / f".dst.qconv-tmp-{2**22 + 1}"
    stale.mkdir(parents=True)
    shutil.copy(CHECKPOINTS / "llama-fp16" / ST, stale / ST)
    shutil.copy(CHECKPOINTS / "llama-fp16" / "config.json", stale / "config.json")


def json_nan_threshold(w):
    m = fixture_copy("llama-bnb8", w)
    edit_json(m / "config.json", lambda c: c["quantization_config"].update(llm_int8_threshold=float("nan")))
    return m


READ, STATE, BENIGN = "read", "state", "benign"
CATALOGUE = [
    Case("truncated_shard", "llama-bnb8", truncated_shard, (ST,), READ),
    Case("header_length_past_end", "llama-gptq-w8g128", header_length_past_end, (ST, "header length"), READ),
    Case("overlapping_offsets", "llama-bnb4-fp4", overlapping_offsets, (ST, "overlap"), READ),
    Case("offsets_past_end", "llama-autoround-w8g128", offsets_past_end, (ST,), READ),
    Case("shape_beyond_span", "llama-gptq-w4g64-asym", shape_beyond_span, (ST, Q + ".qweight"), READ),
    Case("scb_dtype_relabel_f16", "llama-bnb8", scb_dtype_relabel_f16, (ST, Q + ".SCB"), READ),
    Case("header_not_json", "llama-bnb4-nf4-bf16storage", header_not_json, (ST,), READ),
    Case("metadata_list", "llama-autoround-w4g128-mixed8", metadata_list, (ST, "__metadata__"), READ),
    Case("config_bad_json", "llama-gptq-w3g128", config_bad_json, ("config.json",), READ),
    Case("quantization_config_not_object", "llama-bnb4-nf4-dq", quantization_config_not_object,
         ("config.json", "quantization_config"), READ),
    Case("index_missing_shard", "llama-bnb8", index_missing_shard, ("model.safetensors.index.json",), READ),
    Case("index_points_outside", "llama-gptq-w4g64-asym", index_points_outside,
         ("model.safetensors.index.json", "outside"), READ),
    Case("duplicate_tensor_across_shards", "llama-bnb8", duplicate_tensor_across_shards,
         ("model.norm.weight", "extra.safetensors"), READ),
    Case("index_fifo", "llama-bnb8", index_fifo, ("model.safetensors.index.json", "FIFO"), READ, subprocess=True),
    Case("index_dev_zero", "llama-bnb8", index_dev_zero, ("model.safetensors.index.json",), READ, subprocess=True),
    Case("weights_link_out_of_src", "llama-bnb8", weights_link_out_of_src, (ST, "outside"), READ),
    Case("pipeline_key_parent", "pipeline-qwen3vl-bnb8", pipeline_key_parent, ("model_index.json", "../victim"),
         READ),
    Case("pipeline_key_absolute", "pipeline-qwen3vl-bnb8", pipeline_key_absolute, ("model_index.json", "victim"),
         READ),
    Case("pipeline_component_link_etc", "pipeline-qwen3vl-bnb8", pipeline_component_link_etc,
         ("scheduler", "outside"), READ),
    Case("pipeline_component_truncated", "pipeline-qwen3vl-bnb8", pipeline_component_truncated,
         ("text_encoder/" + ST,), READ),
    Case("quant_state_not_json", "llama-bnb4-nf4-dq", quant_state_not_json, (ST, Q + ".weight.quant_state"), READ),

    Case("scb_removed", "llama-bnb8", _tensors_edit("llama-bnb8", lambda ts: ts.pop(Q + ".SCB")), (ST, Q),
         inspect_warns=True),
    Case("scb_not_in_index", "llama-bnb8", scb_not_in_index, (Q,)),
    Case("scb_bfloat16", "llama-bnb8",
         _tensors_edit("llama-bnb8", lambda ts: ts.update({Q + ".SCB": ts[Q + ".SCB"].bfloat16()})), (ST, Q)),
    Case("scb_nan", "llama-bnb8", _tensors_edit("llama-bnb8", _set(Q + ".SCB", 3, float("nan"))), (ST, Q)),
    Case("int8_weight_removed", "llama-bnb8", _tensors_edit("llama-bnb8", lambda ts: ts.pop(Q + ".weight")),
         (ST, Q)),
    Case("quant_state_removed", "llama-bnb4-nf4-dq",
         _tensors_edit("llama-bnb4-nf4-dq", lambda ts: ts.pop(Q + ".weight.quant_state.bitsandbytes__nf4")),
         (ST, Q), inspect_warns=True),
    Case("nested_absmax_bfloat16", "llama-bnb4-nf4-dq", _tensors_edit("llama-bnb4-nf4-dq", lambda ts: ts.update(
        {Q + ".weight.nested_absmax": ts[Q + ".weight.nested_absmax"].bfloat16()})), (ST, Q)),
    Case("nested_blocksize_0", "llama-bnb4-nf4-dq", _quant_state_edit("nested_blocksize", 0), (ST, Q)),
    Case("nested_blocksize_1", "llama-bnb4-nf4-dq", _quant_state_edit("nested_blocksize", 1), (ST, Q)),
    Case("nested_blocksize_x", "llama-bnb4-nf4-dq", _quant_state_edit("nested_blocksize", "x"), (ST, Q)),
    Case("nested_offset_abc", "llama-bnb4-nf4-dq", _quant_state_edit("nested_offset", "abc"), (ST, Q)),
    Case("quant_state_dtype_object", "llama-bnb4-nf4-dq", _quant_state_edit("dtype", {"a": 1}), (ST, Q)),
    Case("absmax_inf", "llama-bnb4-fp4",
         _tensors_edit("llama-bnb4-fp4", _set(Q + ".weight.absmax", 0, float("inf"))), (ST, Q)),
    Case("absmax_beyond_float16", "llama-bnb4-fp4",
         _tensors_edit("llama-bnb4-fp4", _set(Q + ".weight.absmax", 5, 1e30)), (ST, Q)),
    Case("nested_absmax_reshaped", "llama-bnb4-nf4-dq", nested_absmax_reshaped, (ST, Q)),
    Case("quant_state_dtype_missing", "llama-bnb4-fp4", _quant_state_edit("dtype", None, "llama-bnb4-fp4", drop=True),
         (ST, Q)),
    Case("quant_state_nested_dtype_bfloat16", "llama-bnb4-nf4-dq", _quant_state_edit("nested_dtype", "bfloat16"),
         (ST, Q)),
    Case("g_idx_out_of_range", "llama-gptq-w4g128-actorder",
         _tensors_edit("llama-gptq-w4g128-actorder", _set(Q + ".g_idx", 5, 99)), (ST, Q)),
    Case("qweight_16bit_shapes", "llama-gptq-w4g64-asym", _gptq_width(16), (ST, Q)),
    Case("qweight_12bit_shapes", "llama-gptq-w4g64-asym", _gptq_width(12), (ST, Q)),
    Case("scale_nan_float32", "llama-gptq-w4g64-asym", _tensors_edit("llama-gptq-w4g64-asym", _scale_nan_float32),
         (ST, Q)),
    Case("weight_and_qweight", "llama-gptq-w4g64-asym", _tensors_edit("llama-gptq-w4g64-asym", lambda ts: ts.update(
        {Q + ".weight": torch.zeros(256, 256, dtype=torch.float16)})), (ST, Q)),
    Case("quant_method_awq", "llama-gptq-w4g64-asym", _method("awq"), (ST, "AWQ"), inspect_warns=True),
    Case("quant_method_compressed_tensors", "llama-gptq-w4g64-asym", _method("compressed-tensors"),
         (ST, "no quantized module"), inspect_warns=True),
    Case("quant_method_unknown", "llama-gptq-w4g64-asym", _method("hqq"), ("config.json", "hqq"), inspect_warns=True),
    Case("reference_awq_as_hqq", "llama-fp16", _reference("llama-awq-w4g128", "hqq"), ("config.json", "hqq"),
         inspect_warns=True),
    Case("reference_compressed_tensors_as_hqq", "llama-fp16", _reference("llama-ct-w4a16", "hqq"),
         ("config.json", "hqq"), inspect_warns=True),
    # fp8 is decoded (issue 17): GPTQ words under a fine-grained FP8 config belong to no module
    Case("quant_method_fp8_over_gptq", "llama-gptq-w4g64-asym", _method("fp8"), (ST, "no quantized module"),
         inspect_warns=True),
    # fine-grained FP8 (issue 17): transformers' own files, one thing broken
    Case("fp8_code_nan", "llama-fp8-block", _tensors_edit("llama-fp8-block", lambda ts: ts[Q + ".weight"].view(
        torch.uint8).__setitem__((0, 0), 0x7F)), (ST, Q + ".weight", "NaN")),
    Case("fp8_scale_nan", "llama-fp8-block",
         _tensors_edit("llama-fp8-block", _set(Q + ".weight_scale_inv", (0, 0), float("nan"))), (ST, Q)),
    Case("fp8_scale_shape", "llama-fp8-block", _tensors_edit("llama-fp8-block", lambda ts: ts.update(
        {Q + ".weight_scale_inv": ts[Q + ".weight_scale_inv"].reshape(-1).clone()})), (ST, Q)),
    Case("fp8_scale_removed", "llama-fp8-block",
         _tensors_edit("llama-fp8-block", lambda ts: ts.pop(Q + ".weight_scale_inv")), (ST, Q)),
    Case("fp8_block_size_64", "llama-fp8-block", _fp8_config(weight_block_size=[64, 64]), (ST, "weight_block_size")),
    Case("fp8_block_size_text", "llama-fp8-block", _fp8_config(weight_block_size="128"),
         ("config.json", "weight_block_size")),
    Case("fp8_weight_float16", "llama-fp8-block", _tensors_edit("llama-fp8-block", lambda ts: ts.update(
        {Q + ".weight": ts[Q + ".weight"].to(torch.float16)})), (ST, Q + ".weight_scale_inv")),
    Case("fp8_expert_scale_for_3_experts", "qwen3moe-fp8-block", _tensors_edit("qwen3moe-fp8-block", lambda ts: ts.update(
        {"model.layers.0.mlp.experts.down_proj_scale_inv":
         ts["model.layers.0.mlp.experts.down_proj_scale_inv"][:3].clone()})), (ST, "model.layers.0.mlp.experts.3")),
    Case("quantization_config_removed", "llama-gptq-w4g64-asym", quantization_config_removed, ("qweight",),
         inspect_warns=True),
    Case("pipelines_disjoint", "pipeline-qwen3vl-bnb8", pipelines_disjoint, verbs=["validate"]),

    Case("pickle_beside_weights", "llama-bnb8", pickle_beside_weights, kind=BENIGN,
         verbs=["dequantize", "bnb8-to-gptq", "to-float32"], must_succeed=("dequantize", "bnb8-to-gptq")),
    Case("pipeline_pickles", "pipeline-qwen3vl-bnb8", pipeline_pickles, kind=BENIGN,
         verbs=["dequantize", "bnb8-to-gptq", "validate-bnb8"], must_succeed=("dequantize", "bnb8-to-gptq")),
    Case("zero_size_tensor", "llama-bnb8", zero_size_tensor, kind=BENIGN, expected=_with_zero_size,
         verbs=["inspect-json", "dequantize", "bnb8-to-gptq", "to-bnb4-nf4", "validate-gptq-v2", "validate"]),
    Case("unquantized_source", "llama-fp16", unquantized_source, kind=BENIGN,
         verbs=["to-gptq", "to-auto-round", "to-bnb8", "to-bnb4-nf4", "bnb8-to-gptq", "validate-bnb4-fp4",
                "dequantize"]),
    Case("sharded_control", "llama-bnb8", sharded_control, kind=BENIGN,
         verbs=["inspect", "dequantize", "bnb8-to-gptq", "validate", *(f"to-{t}" for t in TARGETS)],
         must_succeed=("inspect", "dequantize", "bnb8-to-gptq", "validate", "to-gptq", "to-bnb8", "to-float16",
                       "to-bnb4-fp4")),
    Case("sharded_gptq_control", "llama-gptq-w4g64-asym", sharded_gptq_control, kind=BENIGN,
         verbs=["dequantize", "validate-gptq-v2", "validate-bnb4-nf4", *(f"to-{t}" for t in TARGETS)],
         must_succeed=("dequantize", "validate-gptq-v2", "to-gptq-v2", "to-gptq", "to-bfloat16")),
    Case("stale_temp_of_dead_run", "llama-bnb8", intact_bnb8, kind=BENIGN, prepare=stale_temp_of_dead_run,
         verbs=["dequantize", "bnb8-to-gptq"], must_succeed=("dequantize", "bnb8-to-gptq")),
    Case("json_nan_threshold", "llama-bnb8", json_nan_threshold, kind=BENIGN,
         verbs=["inspect-json", "dequantize", "bnb8-to-gptq"]),
    Case("max_shard_size_inf", "llama-bnb8", intact_bnb8, kind=BENIGN, verbs=["dequantize", "to-gptq-v2"],
         extra={"dequantize": ["--max-shard-size", "infGB"], "to-gptq-v2": ["--max-shard-size", "nanGB"]}),
    Case("validate_seed_negative", "llama-bnb8", intact_bnb8, kind=BENIGN, verbs=["validate"],
         extra={"validate": ["--seed", "-1"]}),
    Case("group_size_huge", "llama-bnb4-fp4", lambda w: fixture_copy("llama-bnb4-fp4", w), kind=BENIGN,
         verbs=["to-gptq"], extra={"to-gptq": ["--group-size", "100000"]}, subprocess=True),
]


def _default_verbs(case: Case, i: int) -> list[str]:
    """The kind's verbs; convert targets rotate over the catalogue so that each one meets every kind."""
    a, b, c = TARGETS[i % 9], TARGETS[(i + 4) % 9], TARGETS[(i + 7) % 9]
    if case.kind == READ:
        return ["inspect", "inspect-json", "dequantize", f"to-{a}", "bnb8-to-gptq", "validate", f"validate-{b}"]
    return ["inspect-json", "dequantize", f"to-{a}", f"to-{c}", "bnb8-to-gptq", "validate", f"validate-{b}"]


for _i, _case in enumerate(CATALOGUE):
    if _case.verbs is None:
        _case.verbs = _default_verbs(_case, _i)
CASES = {c.name: c for c in CATALOGUE}
RUNS = [(c.name, v) for c in CATALOGUE for v in c.verbs]


def _args(verb: str, case: Case, src: Path, dst: Path) -> list:
    extra = case.extra.get(verb, [])
    if verb == "inspect":
        return ["inspect", *extra, src]
    if verb == "inspect-json":
        return ["inspect", "--json", *extra, src]
    if verb == "validate":
        return ["validate", *extra, src, CHECKPOINTS / case.fixture]
    if verb in ("dequantize", "bnb8-to-gptq"):
        return [verb, "--json", *extra, src, dst]
    target = verb.split("-", 1)[1]
    check = ["--validate"] if verb.startswith("validate-") else []
    return ["convert", "--json", *check, "--to", target, *extra, src, dst]


def _is_bnb8(fixture: str) -> bool:
    return "bnb8" in fixture


def _outside(tmp: Path) -> list[str]:
    return sorted(p for p in os.listdir(tmp) if p not in ("work", "checks"))


@pytest.mark.parametrize("case, verb", RUNS, ids=[f"{c}-{v}" for c, v in RUNS])
def test_sweep(tmp_path, case, verb):
    case = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    (work / "secret.txt").write_text(SECRET)
    src = case.make(work)
    if case.prepare:
        case.prepare(tmp_path)
    dst = tmp_path / "made" / "dst"
    before, outside, litter_before = snapshot(work), _outside(tmp_path), litter(tmp_path)
    args = _args(verb, case, src, dst)
    run = run_subprocess(*args, timeout=60) if case.subprocess else run_inprocess(*args)

    refusal_only = case.kind == READ or (case.kind == STATE and not verb.startswith("inspect"))
    names = case.names if refusal_only else ()
    if verb == "bnb8-to-gptq" and run.code == 5 and "not bitsandbytes LLM.int8" in run.err:
        assert not _is_bnb8(case.fixture), f"a bnb int8 source refused as another method\n{run}"
        names = ()                           # refused for its method before its data is read
    check_contract(run, names=names, refusal_only=refusal_only)
    if verb in case.must_succeed:
        assert run.code == 0, f"{case.name}: {verb} must succeed\n{run}"
    assert snapshot(work) == before, f"the work folder (SRC and what lies beside it) changed\n{run}"
    writing = verb.startswith(WRITING)
    if run.code != 0 or not writing:
        assert _outside(tmp_path) == outside, f"DST, a temp folder or a parent left behind\n{run}"
        assert set(litter(tmp_path)) <= set(litter_before), f"litter\n{run}"
    else:
        assert litter(tmp_path) == [], f"litter beside DST after success\n{run}"
        assert dst.is_dir(), f"exit 0 without DST\n{run}"
        expected = case.expected(case.fixture) if case.expected else None
        check_output(run, case.fixture, dst, tmp_path / "checks", expected=expected)
    if run.code == 0 and "--json" in args:
        strict_json(run.out)
    if verb == "inspect-json" and run.code == 0 and case.inspect_warns:
        report = strict_json(run.out)
        assert any(c["warnings"] for c in report["components"]), \
            f"inspect describes a checkpoint no verb can vouch for without a warning\n{run}"


def test_catalogue_covers_every_verb_and_kind():
    """Every verb meets the catalogue; every convert target meets a read and a state case, both plain
    and with --validate; the catalogue stays the size of the sweep it keeps."""
    verbs = {v for _, v in RUNS}
    assert {"inspect", "inspect-json", "dequantize", "bnb8-to-gptq", "validate"} <= verbs
    for kind in (READ, STATE):
        kind_verbs = {v for c in CATALOGUE if c.kind == kind for v in c.verbs}
        assert {f"to-{t}" for t in TARGETS} <= kind_verbs, kind
        assert {f"validate-{t}" for t in TARGETS} <= kind_verbs, kind
    assert len(CATALOGUE) >= 40


def test_output_check_catches_wrong_weights(tmp_path):
    """The exit-0 check is not vacuous: a correct result passes it, and one changed element of a
    quantized module, a changed norm, or a missing tensor each fail it."""
    from safetensors.torch import save_file

    dst = tmp_path / "dst"
    run = run_inprocess("dequantize", "--json", CHECKPOINTS / "llama-bnb8", dst)
    assert run.code == 0, str(run)
    check_output(run, "llama-bnb8", dst, tmp_path / "checks")
    intact = (dst / ST).read_bytes()
    from safetensors.torch import load_file

    def broken(fn):
        (dst / ST).write_bytes(intact)
        tensors = load_file(dst / ST)
        fn(tensors)
        save_file(tensors, dst / ST, metadata={"format": "pt"})
        with pytest.raises(AssertionError):
            check_output(run, "llama-bnb8", dst, tmp_path / "checks")

    def one_code(ts):
        w = ts[Q + ".weight"]
        w[7, 11] += w[7].abs().max() / 127
    broken(one_code)
    broken(lambda ts: ts["model.norm.weight"].__setitem__(3, 0.5))
    broken(lambda ts: ts.pop("model.layers.1.mlp.up_proj.weight"))
    broken(lambda ts: ts.update(stray=torch.zeros(4, dtype=torch.int32)))
