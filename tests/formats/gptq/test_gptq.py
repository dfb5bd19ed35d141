"""GPTQ and auto-round's GPTQ packing (formats/gptq/): the symmetric zero-point words of v1 and v2, the
real checkpoints storing them, write / read round trips on ragged shapes, GPTQModel's word-wise v1 zero
points, auto-round's packing formats and the lookalike layouts refused, v1 zero points of 0 named and
refused by --validate, g_idx kept and written as GPTQ producers write it, and inspect's settings against
the producers'. auto-round's AWQ packing (--to auto-round of asymmetric sources): test_auto_round_awq.py
beside this file. The generic fixture suites (readers against the producer's oracle, windows, every
conversion, golden inspect reports) cover GPTQ too."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from safetensors.torch import load_file, save_file

from qconv.formats.core.ir import QuantSpec, QuantTensor
from qconv.formats.gptq import codec as gptq_codec
from qconv.formats.storage.checkpoint import open_target

from conftest import (CHECKPOINTS, PROPS, inspect_report as _report, provenance as _provenance,
                      read_only_module as _read_only_module, run_qconv)


# ---- zero points, packing and round trips --------------------------------------------------------

# Sym v1/v2 qzeros words (docs/formats.md, GPTQ: "useful as a format sniff"), as unsigned 32-bit.
SYM_ZEROS = {("v1", 2): [0x55555555], ("v1", 3): [0xDB6DB6DB, 0xB6DB6DB6, 0x6DB6DB6D],
             ("v1", 4): [0x77777777], ("v1", 8): [0x7F7F7F7F],
             ("v2", 2): [0xAAAAAAAA], ("v2", 3): [0x24924924, 0x49249249, 0x92492492],
             ("v2", 4): [0x88888888], ("v2", 8): [0x80808080]}


@pytest.mark.parametrize("encoding, bits", sorted(SYM_ZEROS))
def test_symmetric_zero_words_match_the_documented_constants(encoding, bits):
    out = 32
    qt = QuantTensor(QuantSpec("int", bits, 32, True, scale_dtype="F16"), (out, 32), "float16",
                     codes=np.zeros((out, 32), np.uint8), scales=np.ones((out, 1), np.float32),
                     zeros=np.full((out, 1), 1 << (bits - 1), np.uint8))
    words = gptq_codec.encode(qt, zero_encoding=encoding)["qzeros"][1].view(np.uint32)
    assert words.reshape(-1).tolist() == SYM_ZEROS[(encoding, bits)] * (words.size // len(SYM_ZEROS[(encoding, bits)]))


@pytest.mark.parametrize("name, bits", [("llama-gptq-w2g128", 2), ("llama-gptq-w3g128", 3),
                                        ("llama-gptq-w8g128", 8), ("llama-autoround-w8g128", 8)])
def test_real_sym_checkpoints_store_the_v1_constants(name, bits):
    from qconv.formats.storage.tensor_io import read_array

    comp = open_target(CHECKPOINTS / name).components[0]
    word = read_array(comp.tensors["model.layers.0.self_attn.q_proj.qzeros"]).view(np.uint32)
    pattern = SYM_ZEROS[("v1", bits)]
    assert word[0].tolist() == (pattern * 64)[:word.shape[1]]


def _torch(code, values):
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t.view(torch.bfloat16) if code == "BF16" else t


def _write_gptq(folder, qt, encoding, desc_act, qc=None):
    folder.mkdir()
    arrays = gptq_codec.encode(qt, zero_encoding=encoding)
    save_file({f"layer.{k}": _torch(*v) for k, v in arrays.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": qc or {
        "quant_method": "gptq", "bits": qt.spec.bits, "group_size": qt.spec.group_size,
        "sym": qt.spec.symmetric, "desc_act": desc_act,
        "checkpoint_format": "gptq" if encoding == "v1" else "gptq_v2"}}))


@PROPS
@given(bits=st.sampled_from([2, 3, 4, 8]), in_runs=st.integers(1, 6), out_runs=st.integers(1, 3),
       group_size=st.sampled_from([-1, 32, 64, 128]), sym=st.booleans(), act_order=st.booleans(),
       encoding=st.sampled_from(["v1", "v2"]), scale_dtype=st.sampled_from(["F16", "BF16", "F32"]),
       seed=st.integers(0, 2**16))
def test_gptq_write_read_round_trip(tmp_path, bits, in_runs, out_runs, group_size, sym, act_order,
                                    encoding, scale_dtype, seed):
    """Ragged shapes: in is a multiple of 32 but often not of the group size (a short last group)."""
    rng = np.random.default_rng(seed)
    inp, out = 32 * in_runs, 32 * out_runs
    groups = 1 if group_size == -1 else -(-inp // group_size)
    g_idx = None
    if act_order and group_size != -1:
        g_idx = (rng.permutation(inp) // group_size).astype(np.int64)
    zeros = (np.full((out, groups), 1 << (bits - 1)) if sym else
             rng.integers(0, 1 << bits, size=(out, groups))).astype(np.uint8)
    scales = rng.uniform(1e-3, 1e-1, size=(out, groups)).astype(np.float32)
    if scale_dtype != "F32":            # values the stored dtype holds exactly
        scales = torch.from_numpy(scales).to(getattr(torch, {"F16": "float16", "BF16": "bfloat16"}[scale_dtype])).float().numpy()
    qt = QuantTensor(QuantSpec("int", bits, group_size, sym, scale_dtype=scale_dtype), (out, inp), "float16",
                     codes=rng.integers(0, 1 << bits, size=(out, inp), dtype=np.uint8),
                     scales=scales, zeros=zeros, g_idx=g_idx)
    folder = Path(tempfile.mkdtemp(dir=tmp_path)) / "g"     # tmp_path is shared by all examples
    _write_gptq(folder, qt, encoding, act_order)
    back = _read_only_module(folder)
    assert back.spec.bits == bits and back.spec.group_size == group_size
    assert back.spec.zero_encoding == encoding and back.spec.symmetric == sym
    assert back.spec.scale_dtype == scale_dtype
    assert np.array_equal(back.codes, qt.codes)
    assert np.array_equal(back.zeros, qt.zeros)         # z = 0 survives per-field v1 too
    assert np.array_equal(back.scales, qt.scales)
    assert np.array_equal(back.groups, qt.groups)
    assert np.array_equal(back.dequantize(), qt.dequantize())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptqmodel_v1_zero_points_decode_as_gptqmodel_reads_them(tmp_path, bits):
    """GPTQModel writes v1 by subtracting 0x11111111 (4-bit) from whole words, which borrows when a
    zero point is 0, and reads by adding it back (docs/formats.md, GPTQ). A GPTQModel file (meta.quantizer)
    is decoded word-wise, so every zero point survives; field-wise decoding would get the neighbour of
    each 0 wrong by one."""
    rng = np.random.default_rng(bits)
    out, inp = 64, 64
    zeros = rng.integers(0, 1 << bits, size=(out, 1)).astype(np.uint8)
    zeros[::3] = 0
    qt = QuantTensor(QuantSpec("int", bits, -1, False, scale_dtype="F16"), (out, inp), "float16",
                     codes=rng.integers(0, 1 << bits, size=(out, inp), dtype=np.uint8),
                     scales=np.full((out, 1), 0.01, np.float16).astype(np.float32), zeros=zeros)
    arrays = gptq_codec.encode(qt, zero_encoding="v2")
    one_per_field = sum(1 << (bits * j) for j in range(32 // bits))
    arrays["qzeros"] = ("I32", ((arrays["qzeros"][1].view(np.uint32).astype(np.int64) - one_per_field)
                                % 2**32).astype(np.uint32).view(np.int32))    # GPTQModel's v2 -> v1
    folder = tmp_path / "m"
    folder.mkdir()
    save_file({f"layer.{k}": _torch(*v) for k, v in arrays.items()}, folder / "model.safetensors")
    qc = {"quant_method": "gptq", "bits": bits, "group_size": -1, "sym": False, "desc_act": False,
          "checkpoint_format": "gptq", "meta": {"quantizer": ["gptqmodel:7.7.0"]}}
    (folder / "config.json").write_text(json.dumps({"quantization_config": qc}))
    assert np.array_equal(_read_only_module(folder).zeros, zeros)
    qc.pop("meta")                    # the same bytes from another writer decode field by field
    (folder / "config.json").write_text(json.dumps({"quantization_config": qc}))
    fieldwise = _read_only_module(folder).zeros
    assert not np.array_equal(fieldwise, zeros)


def _asym_module(bits=4, out=64, inp=128, gs=64, seed=0):
    rng = np.random.default_rng(seed)
    zeros = rng.integers(0, 1 << bits, size=(out, inp // gs)).astype(np.uint8)
    zeros[0, 0] = 0
    return QuantTensor(QuantSpec("int", bits, gs, False, scale_dtype="F16"), (out, inp), "float16",
                       codes=rng.integers(0, 1 << bits, size=(out, inp), dtype=np.uint8),
                       scales=np.full((out, inp // gs), 0.01, np.float16).astype(np.float32), zeros=zeros)


# auto-round's packing formats and their zero-point conventions (docs/formats.md, auto-round).
@pytest.mark.parametrize("qc, encoding", [
    ({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq"}, "v1"),
    ({"quant_method": "auto-round", "packing_format": "auto_round:gptq"}, "v1"),        # alias
    ({"quant_method": "auto-round", "packing_format": "auto"}, "v1"),                   # alias
    ({"quant_method": "auto-round", "packing_format": "auto_round:gptqmodel"}, "v2"),
    ({"quant_method": "auto-round", "packing_format": "auto_round"}, "v2"),
    ({"quant_method": "intel/auto-round", "backend": "auto_round:gptq:exllamav2"}, "v1"),
    ({"quant_method": "intel/auto-round", "backend": "auto_round:exllamav2"}, "v2"),
])
def test_auto_round_packing_formats(tmp_path, qc, encoding):
    qt = _asym_module()
    qc = {**qc, "bits": 4, "group_size": 64, "sym": False}
    _write_gptq(tmp_path / "m", qt, encoding, False, qc)
    back = _read_only_module(tmp_path / "m")
    assert back.spec.zero_encoding == encoding
    assert np.array_equal(back.zeros, qt.zeros) and np.array_equal(back.dequantize(), qt.dequantize())


@pytest.mark.parametrize("qc, code, needle", [
    # auto_awq is AWQ's layout (read by the AWQ reader): GPTQ words labelled so are not AWQ-shaped
    ({"quant_method": "auto-round", "packing_format": "auto_round:auto_awq"}, 4, "which AWQ GEMM never writes"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, 5, "'marlin' is not a layout"),
    ({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "data_type": "nv_fp"}, 5,
     "data_type 'nv_fp'"),
])
def test_lookalike_layouts_are_refused_not_misread(tmp_path, qc, code, needle):
    from conftest import run_qconv

    _write_gptq(tmp_path / "m", _asym_module(), "v1", False, {**qc, "bits": 4, "group_size": 64})
    proc = run_qconv("dequantize", tmp_path / "m", tmp_path / "out")
    assert proc.returncode == code and needle in proc.stderr and not (tmp_path / "out").exists()


def test_a_zero_point_of_0_written_as_gptq_v1_is_named(tmp_path):
    """GPTQ v1 stores z - 1: a zero of 0 wraps to 2^b - 1. convert --to gptq says which modules hold one
    (GPTQModel's word-wise reader cannot get it back); --to gptq-v2 stores it exactly, with no warning."""
    import json as _json

    from conftest import run_qconv

    _write_gptq(tmp_path / "v2", _asym_module(), "v2", False)
    proc = run_qconv("convert", "--json", tmp_path / "v2", tmp_path / "v1", "--to", "gptq", check=0)
    (warning,) = [w for w in _json.loads(proc.stdout)["components"][0]["warnings"] if "zero points of 0" in w]
    assert "1 modules" in warning and "layer" in warning and "--to gptq-v2" in warning
    proc = run_qconv("convert", "--json", tmp_path / "v2", tmp_path / "v2b", "--to", "gptq-v2", check=0)
    assert not any("zero points of 0" in w for w in _json.loads(proc.stdout)["components"][0]["warnings"])
    assert np.array_equal(_read_only_module(tmp_path / "v2b").zeros, _asym_module().zeros)


@pytest.mark.parametrize("source", ["llama-ct-w4a16-asym", "llama-awq-w4g128"])
def test_convert_validate_refuses_v1_zero_points_of_0_whatever_the_source(tmp_path, source):
    """--to gptq --validate of a module with a zero point of 0 fails alike from every source (before,
    a compressed-tensors source failed on auto-round's kernel with "relative error 0" and an AWQ one, whose
    bf16 scales that kernel does not take, passed): the result is two models to GPTQ's readers, so it is
    not vouched for; --to gptq-v2 is, and writes it exactly."""
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    from conftest import copy_checkpoint, one_error, run_qconv

    src = copy_checkpoint(source, tmp_path / "work")
    tensors = load_torch(src / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj"
    if source.startswith("llama-ct"):
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
        zp = unpack_from_int32(tensors[q + ".weight_zero_point"], 4, torch.Size([256, 2]), packed_dim=0)
        zp[0, 0] = -8                                   # stored signed: unsigned zero point 0
        tensors[q + ".weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0).contiguous()
    else:
        tensors[q + ".qzeros"][0, 0] &= ~0xF            # AWQ: the first nibble is output channel 0
    save_torch(tensors, src / "model.safetensors", metadata={"format": "pt"})
    proc = run_qconv("convert", src, tmp_path / "v1", "--to", "gptq", "--validate")
    one_error(proc, 1, str(src / "model.safetensors"), "1 modules have zero points of 0", "--to gptq-v2", q)
    assert not (tmp_path / "v1").exists()
    run_qconv("convert", src, tmp_path / "v2", "--to", "gptq-v2", "--validate", check=0)


# ---- g_idx ---------------------------------------------------------------------------------------

GPTQMODEL = ["llama-gptq-w2g128", "llama-gptq-w3g128", "llama-gptq-w4g128-actorder", "llama-gptq-w4g64-asym",
             "llama-gptq-w8g128"]


def _tensor_bytes(path):
    return {k: (str(v.dtype), tuple(v.shape), v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for k, v in load_file(path).items()}


@pytest.mark.parametrize("name", GPTQMODEL)
def test_gptq_v2_and_back_is_byte_identical_g_idx_included(tmp_path, name):
    """GPTQModel writes g_idx for every layer; v1 -> v2 -> v1 gives back every tensor byte for byte."""
    run_qconv("convert", CHECKPOINTS / name, tmp_path / "v2", "--to", "gptq-v2", check=0)
    run_qconv("convert", tmp_path / "v2", tmp_path / "v1", "--to", "gptq", check=0)
    source = _tensor_bytes(CHECKPOINTS / name / "model.safetensors")
    assert any(k.endswith(".g_idx") for k in source)
    assert _tensor_bytes(tmp_path / "v1" / "model.safetensors") == source


def test_gptq_targets_write_g_idx_as_gptq_producers_do(tmp_path):
    """bnb8-to-gptq (per-row groups): g_idx is all zeros, one per input feature, int32; a GPTQ 4-bit g64
    target: g_idx[i] = i // 64, which is what GPTQModel's own fixture stores."""
    run_qconv("bnb8-to-gptq", CHECKPOINTS / "llama-bnb8", tmp_path / "g8", check=0)
    out = load_file(tmp_path / "g8" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj"
    assert out[f"{q}.g_idx"].dtype == torch.int32
    assert torch.equal(out[f"{q}.g_idx"], torch.zeros(out[f"{q}.qweight"].shape[0] * 4, dtype=torch.int32))
    run_qconv("convert", CHECKPOINTS / "llama-bnb4-nf4-dq", tmp_path / "g4", "--to", "gptq", "--group-size", "64",
              check=0)
    ours = load_file(tmp_path / "g4" / "model.safetensors")[f"{q}.g_idx"]
    theirs = load_file(CHECKPOINTS / "llama-gptq-w4g64-asym" / "model.safetensors")[f"{q}.g_idx"]
    assert torch.equal(ours, theirs)


# ---- inspect, against the producers' settings ----------------------------------------------------

@pytest.mark.parametrize("name", ["llama-gptq-w2g128", "llama-gptq-w3g128", "llama-gptq-w4g128-actorder",
                                  "llama-gptq-w4g64-asym", "llama-gptq-w8g128",
                                  "llama-autoround-w4g128-mixed8", "llama-autoround-w8g128"])
def test_gptq_settings_match_provenance(name):
    (report,) = _report(name)["components"]
    s = _provenance(name)["settings"]
    assert report["bits"] == int(s["bits"])
    assert report["group_size"] == int(s["group_size"])
    assert report["sym"] == (s["sym"] == "True")
    assert report["desc_act"] == (s.get("desc_act") == "True")
    assert report["zero_point"] == "stored z-1 (v1)"   # GPTQModel "gptq" and auto_round:auto_gptq
    if report["method"] == "auto-round":
        assert report["packing_format"] == s["format"]
    else:
        assert report["method"] == "GPTQ" and report["checkpoint_format"] == "gptq"
