"""AWQ GEMM codec (formats/awq/header.py, formats/awq/codec.py) against the GPTQModel-made fixtures.

Expectations come from outside the code under test: GPTQModel's own dequantization (oracle/), the stored
bytes of the files, a re-implementation of AutoAWQ's unpacking written here from its source, and
auto-round's AWQ dequantization, which runs on the CPU.
"""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qconv.errors import CorruptCheckpoint, UnsupportedFormat
from qconv.formats.awq import header as awq
from qconv.formats.awq import codec as awq_codec
from qconv.formats.core.ir import QuantSpec, QuantTensor
from qconv.formats.storage.safetensors_header import read_header
from qconv.formats.storage.tensor_io import read_array

from conftest import CHECKPOINTS, copy_checkpoint, run_qconv

FIXTURES = ("llama-awq-w4g128", "llama-awq-w4g64-sym")
# fixtures/checkpoints/README.md: GPTQModel's AWQ kernel on the identity rounds, and differs from
# (q - z) * s in float16 by up to 1.2e-3 of the layer's largest weight. Measured here against qconv's
# float32 (q - z) * s: at most 4.6e-4 of max |w| for llama-awq-w4g128 (asym) and 0 (bit-exact) for
# llama-awq-w4g64-sym.
ORACLE_TOL = 1.2e-3


def _load(name):
    folder = CHECKPOINTS / name
    header = read_header(folder / "model.safetensors")
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    return folder, header.tensors, qc


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request):
    folder, tensors, qc = _load(request.param)
    modules = awq.find_modules(tensors, qc)
    oracle = load_file(str(folder / "oracle" / "dequant.safetensors"))
    raw = load_file(str(folder / "model.safetensors"))
    return request.param, folder, tensors, qc, modules, oracle, raw


# ---------------------------------------------------------------------------------------------
# An independent unpacking, following AutoAWQ's awq/utils/packing_utils.py (casper-hansen/AutoAWQ
# at 88e4c76b, v0.2.9): unpack_awq shifts each int32 by arange(0, 32, bits) and views the result as
# [rows, 8 * cols]; reverse_awq_order gathers the columns with AWQ_REVERSE_ORDER = [0,4,1,5,2,6,3,7]
# in every run of 8; dequantize_gemm masks with 2**bits - 1 ("overflow checks"), repeats zeros and
# scales group_size times along in and computes (iweight - izeros) * scales in the scales' dtype.

_AUTOAWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def autoawq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int = 4, reorder: bool = True):
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    if reorder:
        order = torch.arange(iweights.shape[-1], dtype=torch.int32).view(-1, 32 // bits)
        order = order[:, _AUTOAWQ_REVERSE_ORDER].view(-1)
        iweights, izeros = iweights[:, order], izeros[:, order]
    mask = (1 << bits) - 1
    return torch.bitwise_and(iweights, mask), torch.bitwise_and(izeros, mask)       # [in, out], [G, out]


def autoawq_dequant_f32(qweight, qzeros, scales, group_size, reorder=True):
    iw, iz = autoawq_unpack(qweight, qzeros, reorder=reorder)
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = iz.repeat_interleave(group_size, dim=0)
    return ((iw - z).float() * s).T.contiguous()                                    # [out, in]


def _gs(m):
    return m.in_features if m.group_size == -1 else m.group_size


# ---------------------------------------------------------------------------------------------
# Layout from headers

def test_modules_found_from_headers(fixture):
    name, _, tensors, qc, modules, oracle, _ = fixture
    assert sorted(m.name for m in modules) == sorted(k[: -len(".weight")] for k in oracle)
    expected_gs = 128 if name == "llama-awq-w4g128" else 64
    for m in modules:
        ref = oracle[m.name + ".weight"]
        assert (m.family, m.scheme, m.bits) == ("awq", "int4", 4)
        assert (m.out_features, m.in_features) == tuple(ref.shape)
        assert m.group_size == expected_gs and not m.problems
        assert m.details["version"] == m.details["format"] == "gemm"
        assert m.details["zero_point"] is (name == "llama-awq-w4g128")
        assert m.details["scales_dtype"] == "BF16"
        assert m.weight_tensors == (m.name + ".qweight",)
        assert set(m.state_tensors) == {m.name + ".qzeros", m.name + ".scales"}
        for leaf, (code, shape) in awq_codec.leaves(QuantSpec("int", 4, m.group_size, True, scale_dtype="BF16"),
                                                    (m.out_features, m.in_features)).items():
            info = tensors[m.name + "." + leaf]
            assert (info.dtype, info.shape) == (code, shape), leaf


# ---------------------------------------------------------------------------------------------
# Decoding against the producer's own dequantization

def test_dequantize_matches_gptqmodel_oracle(fixture):
    name, _, tensors, qc, modules, oracle, raw = fixture
    worst = 0.0
    for m in modules:
        qt = awq_codec.read(m, tensors, qc, "bfloat16")
        ref = oracle[m.name + ".weight"].numpy()
        w = qt.dequantize()
        assert w.dtype == np.float32 and w.shape == ref.shape
        peak = float(np.abs(ref).max())
        err = float(np.abs(w - ref).max())
        assert err <= ORACLE_TOL * peak, (m.name, err / peak)
        worst = max(worst, err / peak)
        # The same tensors decoded in natural (non-interleaved) nibble order are far off: the
        # interleave matters. (Measured: a worst error of 1.26x to 2.0x the layer's max |w|.)
        natural = autoawq_dequant_f32(raw[m.name + ".qweight"], raw[m.name + ".qzeros"],
                                      raw[m.name + ".scales"], _gs(m), reorder=False).numpy()
        assert float(np.abs(natural - ref).max()) > 0.5 * peak, m.name
    assert worst <= ORACLE_TOL


def test_canonical_representation(fixture):
    name, _, tensors, qc, modules, _, _ = fixture
    for m in modules:
        qt = awq_codec.read(m, tensors, qc, "bfloat16")
        groups = m.in_features // m.group_size
        assert qt.codes.dtype == np.uint8 and qt.codes.shape == (m.out_features, m.in_features)
        assert qt.codes.flags.c_contiguous and int(qt.codes.max()) <= 15
        assert qt.zeros.shape == qt.scales.shape == (m.out_features, groups)
        assert qt.scales.dtype == np.float32 and qt.g_idx is None
        assert qt.spec.scheme == "int" and qt.spec.bits == 4 and qt.spec.group_size == m.group_size
        assert qt.spec.scale_dtype == "BF16" and qt.spec.zero_encoding is None
        assert qt.spec.symmetric is (name == "llama-awq-w4g64-sym")
        if qt.spec.symmetric:
            assert np.all(qt.zeros == 8)       # what GPTQModel stores for zero_point false


def test_repack_cross_check_against_autoawq_unpacking(fixture):
    _, _, tensors, qc, modules, _, raw = fixture
    for m in modules:
        qt = awq_codec.read(m, tensors, qc, "bfloat16")
        iw, iz = autoawq_unpack(raw[m.name + ".qweight"], raw[m.name + ".qzeros"])
        np.testing.assert_array_equal(qt.codes, iw.T.numpy().astype(np.uint8))
        np.testing.assert_array_equal(qt.zeros, iz.T.numpy().astype(np.uint8))
        np.testing.assert_array_equal(qt.scales, raw[m.name + ".scales"].float().T.numpy())
        # and AutoAWQ's dequantization formula, in float32, is qconv's exactly
        ref = autoawq_dequant_f32(raw[m.name + ".qweight"], raw[m.name + ".qzeros"],
                                  raw[m.name + ".scales"], _gs(m)).numpy()
        np.testing.assert_array_equal(qt.dequantize(), ref)


def test_cross_check_auto_round_awq_dequantize(fixture):
    """auto-round's AWQ export module carries a pure-torch dequantize_gemm (the one its WQLinear_GEMM
    forward uses), which runs on the CPU. (transformers' AWQ integration needs gptqmodel, which is not
    installed here, so it has no CPU path to compare with.)"""
    utils = pytest.importorskip("auto_round.export.export_to_awq.utils")
    _, _, tensors, qc, modules, _, raw = fixture
    for m in (modules[0], modules[-1]):
        qt = awq_codec.read(m, tensors, qc, "bfloat16")
        qw, qz, sc = raw[m.name + ".qweight"], raw[m.name + ".qzeros"], raw[m.name + ".scales"]
        # float32 scales: every product is exact, so the results must be equal bit for bit
        ref32 = utils.dequantize_gemm(qw, qz, sc.float(), 4, _gs(m))
        np.testing.assert_array_equal(qt.dequantize(), ref32.T.numpy())
        # the stored bf16 scales, as auto-round computes: bf16 rounding of the same products
        ref16 = utils.dequantize_gemm(qw, qz, sc, 4, _gs(m))
        assert ref16.dtype == torch.bfloat16
        ours = torch.from_numpy(qt.dequantize()).to(torch.bfloat16)
        assert torch.equal(ours, ref16.T)


# ---------------------------------------------------------------------------------------------
# Writing: the exact inverse

def test_encode_reproduces_stored_bytes(fixture):
    _, _, tensors, qc, modules, _, _ = fixture
    for m in modules:
        qt = awq_codec.read(m, tensors, qc, "bfloat16")
        arrays = awq_codec.encode(qt)
        assert set(arrays) == {"qweight", "qzeros", "scales"}
        for leaf, (code, values) in arrays.items():
            info = tensors[m.name + "." + leaf]
            stored = read_array(info)
            assert code == info.dtype and tuple(values.shape) == info.shape, (m.name, leaf)
            assert values.tobytes() == stored.tobytes(), (m.name, leaf)


def test_encode_other_scale_dtype_and_refusals():
    _, tensors, qc = _load("llama-awq-w4g128")
    m = awq.find_modules(tensors, qc)[0]
    qt = awq_codec.read(m, tensors, qc, "bfloat16")
    code, s16 = awq_codec.encode(qt, scale_dtype="F16")["scales"]
    assert code == "F16" and s16.dtype == np.float16 and s16.shape == (2, m.out_features)
    with pytest.raises(ValueError, match="F16 or BF16"):
        awq_codec.encode(qt, scale_dtype="F32")
    perm = np.random.default_rng(0).permutation(m.in_features) // m.group_size
    with pytest.raises(ValueError, match="g_idx"):
        awq_codec.encode(dataclasses.replace(qt, g_idx=perm))
    trivial = np.arange(m.in_features) // m.group_size        # a trivial g_idx is just contiguous groups
    assert awq_codec.encode(dataclasses.replace(qt, g_idx=trivial))["qweight"][1].shape == (256, 32)
    eight = QuantTensor(QuantSpec("int", 8, 128, True), qt.shape, "bfloat16", codes=qt.codes,
                        scales=qt.scales, zeros=qt.zeros)
    with pytest.raises(ValueError, match="4-bit"):
        awq_codec.encode(eight)
    with pytest.raises(ValueError, match="4-bit"):
        awq_codec.leaves(QuantSpec("int", 3, 128, True, scale_dtype="F16"), (256, 256))
    with pytest.raises(ValueError):
        awq.config_for(QuantSpec("int", 8, 128, True, scale_dtype="F16"))


def test_encode_read_round_trip_random(tmp_path):
    """A synthetic module (per-row groups, fp16 scales, asymmetric zeros) written by encode and read back."""
    rng = np.random.default_rng(7)
    out, inp = 24, 40
    codes = rng.integers(0, 16, (out, inp), dtype=np.uint8)
    zeros = rng.integers(0, 16, (out, 1), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-1, (out, 1)).astype(np.float16).astype(np.float32)
    qt = QuantTensor(QuantSpec("int", 4, -1, False, scale_dtype="F16"), (out, inp), "float16",
                     codes=codes, scales=scales, zeros=zeros)
    arrays = awq_codec.encode(qt)
    path = tmp_path / "model.safetensors"
    save_file({f"m.{leaf}": torch.from_numpy(np.ascontiguousarray(v)) for leaf, (_, v) in arrays.items()},
              str(path))
    tensors = read_header(path).tensors
    qc = {"quant_method": "awq", "bits": 4, "group_size": -1, "zero_point": True, "version": "gemm"}
    (m,) = awq.find_modules(tensors, qc)
    assert (m.out_features, m.in_features, m.group_size) == (out, inp, -1) and not m.problems
    back = awq_codec.read(m, tensors, qc, "float16")
    np.testing.assert_array_equal(back.codes, codes)
    np.testing.assert_array_equal(back.zeros, zeros)
    np.testing.assert_array_equal(back.scales, scales)
    # nibble placement, by hand: column 8c + AWQ_ORDER[i] sits in bits 4i..4i+3 of word c
    word = int(arrays["qweight"][1].view(np.uint32)[5, 2])
    assert [(word >> (4 * i)) & 15 for i in range(8)] == [int(codes[16 + k, 5]) for k in (0, 2, 4, 6, 1, 3, 5, 7)]


# ---------------------------------------------------------------------------------------------
# Config

def test_parse_config_spellings():
    _, _, qc = _load("llama-awq-w4g64-sym")
    p = awq.parse_config(qc)
    assert (p["bits"], p["group_size"], p["zero_point"], p["version"]) == (4, 64, False, "gemm")
    assert not p["problems"] and not p["unsupported"]
    # AutoAWQ's quant_config.json (AwqConfig.to_dict): no quant_method, w_bit / q_group_size, "GEMM"
    p = awq.parse_config({"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM",
                          "modules_to_not_convert": None})
    assert (p["bits"], p["group_size"], p["zero_point"], p["version"]) == (4, 128, True, "gemm")
    assert p["modules_to_not_convert"] == [] and not p["problems"] and not p["unsupported"]
    # auto-round's own format with AWQ packing: sym, not zero_point; no version
    p = awq.parse_config({"quant_method": "auto-round", "packing_format": "auto_round:auto_awq", "bits": 4,
                          "group_size": 128, "sym": False, "data_type": "int"})
    assert (p["method"], p["zero_point"], p["version"], p["packing_format"]) == \
        ("auto-round", True, "gemm", "auto_round:auto_awq")
    assert awq.parse_config({"quant_method": "auto-round", "packing_format": "auto_round:awq",
                             "bits": 4, "group_size": 128})["zero_point"] is False      # sym defaults to true
    # ... and the pre-0.5 spelling, quant_method intel/auto-round with an awq backend
    p = awq.parse_config({"quant_method": "intel/auto-round", "backend": "auto_round:awq", "bits": 4,
                          "group_size": 128, "sym": False})
    assert p["packing_format"] == "auto_round:auto_awq" and not p["unsupported"]
    assert awq.parse_config({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq",
                             "bits": 4})["unsupported"]
    # contradictions and unsupported settings
    assert awq.parse_config({"quant_method": "awq", "bits": 4, "version": "gemm", "format": "gemv"})["problems"]
    assert awq.parse_config({"quant_method": "awq", "bits": 8, "version": "gemm"})["unsupported"]
    assert "gemv_fast" in awq.parse_config({"quant_method": "awq", "bits": 4, "format": "gemv_fast"})["unsupported"][0]


def test_config_for_matches_what_loaders_read():
    for name in FIXTURES:
        folder, _, qc = _load(name)
        side = json.loads((folder / "quantize_config.json").read_text())
        spec = QuantSpec("int", 4, qc["group_size"], not qc["zero_point"], scale_dtype="BF16")
        cfg = awq.config_for(spec, [], qc["group_size"], qc["zero_point"], "BF16")
        for key in ("quant_method", "bits", "group_size", "zero_point", "version", "format"):
            assert cfg[key] == qc[key] == side[key], (name, key)
        assert cfg["modules_to_not_convert"] == []
        # qconv reads back what it writes
        p = awq.parse_config(cfg)
        assert (p["bits"], p["group_size"], p["zero_point"], p["version"]) == \
            (4, qc["group_size"], qc["zero_point"], "gemm") and not p["problems"] and not p["unsupported"]
    cfg = awq.config_for(QuantSpec("int", 4, 128, False, scale_dtype="F16"), ["lm_head"])
    assert cfg["zero_point"] is True and cfg["modules_to_not_convert"] == ["lm_head"]
    # vLLM's AWQConfig.from_config reads ["w_bit", "bits"], ["q_group_size", "group_size"], ["zero_point"]
    assert (cfg["bits"], cfg["group_size"], cfg["zero_point"]) == (4, 128, True)
    transformers = pytest.importorskip("transformers")
    tc = transformers.AwqConfig.from_dict(dict(cfg))
    assert (tc.bits, tc.group_size, tc.zero_point, tc.format) == (4, 128, True, "gemm")
    assert tc.modules_to_not_convert == ["lm_head"] and tc.to_dict()["version"] == "gemm"


# ---------------------------------------------------------------------------------------------
# Refusals, each naming the file and the tensor

def _module_tensors(raw, module):
    return {k: v.clone() for k, v in raw.items() if k.startswith(module + ".")}


def _edited(tmp_path, fixture, module, edit):
    """One module of a producer-made fixture, its tensors changed by edit(dict), saved alone; returns
    (path, headers, the fixture's config)."""
    folder, _, qc = _load(fixture)
    t = _module_tensors(load_file(str(folder / "model.safetensors")), module)
    edit(t)
    path = tmp_path / "model.safetensors"
    save_file(t, str(path))
    return path, read_header(path).tensors, qc


def _assert_names(err, file, tensor):
    msg = str(err.value)
    assert str(file) in msg and repr(tensor) in msg, msg
    assert err.value.file == str(file) and err.value.tensor == tensor


def test_refuses_gemv_version():
    folder, tensors, qc = _load("llama-awq-w4g128")
    for key in ("version", "format"):
        bad = {k: v for k, v in qc.items() if k not in ("version", "format", "checkpoint_format")} | {key: "gemv"}
        m = awq.find_modules(tensors, bad)[0]
        assert m.problems and "gemv" in m.problems[0]
        with pytest.raises(UnsupportedFormat, match="gemv") as err:
            awq_codec.read(m, tensors, bad, "bfloat16")
        _assert_names(err, folder / "model.safetensors", m.name + ".qweight")


def test_refuses_qweight_that_does_not_fit_scales(tmp_path):
    module = "model.layers.0.self_attn.q_proj"
    path, tensors, qc = _edited(tmp_path, "llama-awq-w4g128", module, lambda t: t.update(
        {module + ".qweight": t[module + ".qweight"][:, :30].contiguous()}))    # 240 outputs, scales say 256
    (m,) = awq.find_modules(tensors, qc)
    assert m.problems
    with pytest.raises(CorruptCheckpoint, match="does not fit") as err:
        awq.check(m, tensors, qc)
    _assert_names(err, path, module + ".qweight")
    with pytest.raises(CorruptCheckpoint):
        awq_codec.read(m, tensors, qc, "bfloat16")


def test_refuses_nan_scale(tmp_path):
    module = "model.layers.1.mlp.down_proj"
    path, tensors, qc = _edited(tmp_path, "llama-awq-w4g64-sym", module,
                                lambda t: t[module + ".scales"].__setitem__((3, 17), float("nan")))
    (m,) = awq.find_modules(tensors, qc)
    assert not m.problems                   # headers are fine: only the data is bad
    with pytest.raises(CorruptCheckpoint, match="non-finite") as err:
        awq_codec.read(m, tensors, qc, "bfloat16")
    _assert_names(err, path, module + ".scales")


def test_refuses_packed_module_listed_as_not_converted():
    folder, tensors, qc = _load("llama-awq-w4g128")
    bad = dict(qc, modules_to_not_convert=["mlp.down_proj"])       # vLLM matches by substring
    modules = {m.name: m for m in awq.find_modules(tensors, bad)}
    m = modules["model.layers.0.mlp.down_proj"]
    assert any("modules_to_not_convert" in p for p in m.problems)
    assert not modules["model.layers.0.mlp.up_proj"].problems
    with pytest.raises(CorruptCheckpoint, match="modules_to_not_convert") as err:
        awq.check(m, tensors, bad)
    _assert_names(err, folder / "model.safetensors", m.name + ".qweight")


def test_refuses_other_widths_and_missing_zeros(tmp_path):
    module = "model.layers.0.self_attn.q_proj"
    # auto-round's 5-bit AWQ bit stream: 256 outputs * 5 / 32 = 40 words a row
    _, tensors, qc = _edited(tmp_path, "llama-awq-w4g128", module, lambda t: t.update(
        {module + ".qweight": torch.zeros(256, 40, dtype=torch.int32),
         module + ".qzeros": torch.zeros(2, 40, dtype=torch.int32)}))
    (m,) = awq.find_modules(tensors, qc)
    with pytest.raises(UnsupportedFormat, match="5-bit"):
        awq.check(m, tensors, qc)
    _, tensors, qc = _edited(tmp_path, "llama-awq-w4g128", module, lambda t: t.pop(module + ".qzeros"))
    (m,) = awq.find_modules(tensors, dict(qc, zero_point=False))
    with pytest.raises(CorruptCheckpoint, match="no qzeros"):
        awq.check(m, tensors, qc)


def test_zero_point_false_with_varied_zeros_is_not_symmetric():
    """The zeros are decoded as stored (as every AWQ loader does); a file that says zero_point false
    but stores zero points other than 8 is reported asymmetric, so a writer keeps them."""
    _, tensors, qc = _load("llama-awq-w4g128")
    m = awq.find_modules(tensors, dict(qc, zero_point=False))[0]
    qt = awq_codec.read(m, tensors, dict(qc, zero_point=False), "bfloat16")
    assert qt.spec.symmetric is False and len(np.unique(qt.zeros)) > 1


# ---------------------------------------------------------------------------------------------

def test_awq_module_imports_without_numpy():
    code = "import sys, qconv.formats.awq.header; assert 'numpy' not in sys.modules, 'numpy imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("group_size", [0, -3, "128", True, 64, 3, -1])
def test_a_group_size_the_scales_contradict_or_that_is_no_size_is_refused(tmp_path, group_size):
    """llama-awq-w4g128's config says group_size: a lie or a non-size (0 included) is refused alike:
    inspect warns, --strict exits 1, dequantize exits 4 naming it; the truth (128) passes."""
    src = copy_checkpoint("llama-awq-w4g128", tmp_path / "work")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["group_size"] = group_size
    (src / "config.json").write_text(json.dumps(config))
    assert run_qconv("inspect", "--strict", src).returncode == 1
    proc = run_qconv("dequantize", src, tmp_path / "out")
    assert proc.returncode == 4 and "group_size" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    config["quantization_config"]["group_size"] = 128
    (src / "config.json").write_text(json.dumps(config))
    run_qconv("inspect", "--strict", src, check=0)
