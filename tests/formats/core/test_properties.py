"""Property tests: qconv's readers against bitsandbytes' own quantize/dequantize functions on random
shapes and settings, and GPTQ packing round trips through real files."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from safetensors.torch import save_file

from qconv.formats.gptq import codec as gptq_codec
from qconv.formats.storage.checkpoint import open_target
from qconv.formats.core.detect import detect
from qconv.formats.core.ir import QuantSpec, QuantTensor
from qconv.formats.core.packing import pack_int32, unpack_int32, unpack_int32_transposed
from qconv.formats.core.reader import read_module

from conftest import CHECKPOINTS

# derandomize, no example database: the same examples on every machine and every run, whatever the
# environment (a CI variable would otherwise switch Hypothesis's profile) and the working folder hold.
PROPS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _weights(out, inp, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[:, torch.randint(0, inp, (max(1, inp // 16),), generator=g)] *= 20     # heavy-tailed columns
    return w.to(TORCH_DTYPES[dtype])


def _read_only_module(path):
    comp = open_target(path).components[0]
    det = detect(comp)
    (m,) = det.modules
    return read_module(comp, det, m, "float16")


@PROPS
@given(out=st.integers(1, 48), inp=st.integers(1, 80),
       blocksize=st.sampled_from([32, 64, 128, 256, 512, 1024, 2048, 4096]),
       quant_type=st.sampled_from(["nf4", "fp4"]), double_quant=st.booleans(),
       storage=st.sampled_from(["uint8", "bfloat16", "float16", "float32"]),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]), seed=st.integers(0, 2**16))
def test_4bit_reader_equals_bitsandbytes_dequantize(tmp_path, out, inp, blocksize, quant_type,
                                                    double_quant, storage, dtype, seed):
    import bitsandbytes.functional as F

    itemsize = torch.tensor([], dtype=getattr(torch, storage)).element_size()
    assume(((out * inp + 1) // 2) % itemsize == 0)          # bitsandbytes' own view needs it
    w = _weights(out, inp, dtype, seed)
    packed, qs = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=double_quant,
                                 quant_type=quant_type, quant_storage=getattr(torch, storage))
    tensors = {"layer.weight": packed}
    tensors.update({f"layer.weight.{k}": v for k, v in qs.as_dict(packed=True).items()})
    path = tmp_path / f"m{seed}.safetensors"
    save_file(tensors, path)
    qt = _read_only_module(path)
    ours = torch.from_numpy(qt.dequantize()).to(TORCH_DTYPES[dtype])
    assert qt.dtype == dtype and ours.shape == w.shape

    # bitsandbytes' reference dequantization (the pure-torch kernel behind its default backend, run
    # uncompiled), fed the absmax that bitsandbytes itself rebuilds from double quant: bit for bit.
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code
    absmax = qs.absmax
    if qs.nested:
        absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    reference = _dequantize_4bit_compute.__wrapped__(packed.view(torch.uint8).reshape(-1), absmax.float(),
                                                     _get_4bit_code(quant_type, packed.device), blocksize,
                                                     qs.shape, qs.dtype)
    bits = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32}[dtype]
    assert torch.equal(ours.view(bits), reference.view(bits))

    # The public dequantize_4bit: on CPU, rows of even length go to a C kernel whose AVX512 branch
    # (bitsandbytes 0.50 csrc/cpu_ops.cpp, dequantizeBlockwise4bitCpu, taken when the CPU has AVX512F)
    # indexes absmax by row, which matches the flat blocks its quantizer wrote only when rows align with
    # blocks (every real model's rows do): e.g. a [3, 16] weight in blocks of 32 gives another answer
    # than the reference above there, and the right one on CPUs without AVX512. So the public API is
    # compared on aligned rows only, where every branch agrees on every CPU.
    if inp % blocksize == 0:
        public = F.dequantize_4bit(packed, qs)
        if packed.shape[0] == 1:          # bitsandbytes transposes results with a one-row packed weight
            public = public.t()
        assert torch.equal(ours.view(bits), public.view(bits))


def test_codebooks_are_bitsandbytes_own():
    from bitsandbytes.functional import get_4bit_type
    from qconv.formats.bnb.codec import CODEBOOKS

    for name, book in CODEBOOKS.items():
        theirs = get_4bit_type(name, device="cpu").numpy()
        assert np.array_equal(book.view(np.uint32), theirs.view(np.uint32)), name
    from safetensors.numpy import load_file
    for name, qtype in [("llama-bnb4-fp4", "fp4"), ("llama-bnb4-nf4-dq", "nf4")]:
        stored = load_file(CHECKPOINTS / name / "model.safetensors")["model.layers.0.mlp.up_proj.weight.quant_map"]
        assert np.array_equal(stored.view(np.uint32), CODEBOOKS[qtype].view(np.uint32))


@PROPS
@given(out=st.integers(1, 64), inp=st.integers(1, 96), seed=st.integers(0, 2**16))
def test_int8_reader_equals_bitsandbytes_vectorwise_dequant(tmp_path, out, inp, seed):
    import bitsandbytes.functional as F

    w = _weights(out, inp, "float16", seed)
    cb, scb, _ = F.int8_vectorwise_quant(w)
    path = tmp_path / f"m{seed}.safetensors"
    save_file({"layer.weight": cb, "layer.SCB": scb, "layer.weight_format": torch.tensor(0, dtype=torch.uint8)},
              path)
    qt = _read_only_module(path)
    assert torch.equal(torch.from_numpy(qt.dequantize()), F.int8_vectorwise_dequant(cb, scb))


# ---- GPTQ ---------------------------------------------------------------------------------------

@PROPS
@given(bits=st.sampled_from([2, 3, 4, 5, 6, 7, 8]), runs=st.integers(1, 5), cols=st.integers(1, 7),
       seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(bits, runs, cols, seed):
    n = 32 * runs
    codes = np.random.default_rng(seed).integers(0, 1 << bits, size=(n, cols), dtype=np.uint8)
    words = pack_int32(codes, bits, axis=0)
    assert words.dtype == np.int32 and words.shape == (n * bits // 32, cols)
    assert np.array_equal(unpack_int32(words, bits, axis=0), codes)
    transposed = unpack_int32_transposed(words, bits)       # how GPTQ's reader gets [out, in] codes
    assert transposed.flags.c_contiguous and np.array_equal(transposed, codes.T)
    assert np.array_equal(unpack_int32(pack_int32(codes.T, bits, axis=1), bits, axis=1), codes.T)


# Sym v1/v2 qzeros words (FORMATS.md §3.3: "useful as a format sniff"), as unsigned 32-bit.
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
    zero point is 0, and reads by adding it back (FORMATS.md §3.3). A GPTQModel file (meta.quantizer)
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


# auto-round's packing formats and their zero-point conventions (FORMATS.md §4.1-4.2).
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


@PROPS
@given(seed=st.integers(0, 2**16))
def test_scb_survives_float32_gptq_scales(seed):
    """bitsandbytes' SCB is the row absmax of the float16-cast weight (a float16 value); GPTQ stores
    s = float32(SCB / 127); qconv's inverse gives back every such SCB exactly."""
    import bitsandbytes.functional as F
    from qconv.convert.convert import _scb_from_scales

    w = _weights(257, 64, "float16", seed) * float(np.random.default_rng(seed).choice([1e-3, 1, 300]))
    _, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
    s = (scb / 127).numpy().astype(np.float32)
    assert np.array_equal(_scb_from_scales(s), scb.numpy())


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
