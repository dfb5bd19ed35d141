"""compressed-tensors (llm-compressor) checkpoints: formats/compressed_tensors/header.py (headers,
config) and formats/compressed_tensors/codec.py (data), against the producer-made fixtures, their oracles, the stored bytes
and compressed-tensors' own compressors."""

import copy
import functools
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qconv.errors import CorruptCheckpoint, UnsupportedFormat
from qconv.formats.compressed_tensors import header as ct
from qconv.formats.compressed_tensors import codec as ct_codec
from qconv.formats.core.ir import QuantSpec, QuantTensor
from qconv.formats.storage.safetensors_header import read_header
from qconv.formats.storage.tensor_io import read_array

from conftest import CHECKPOINTS, copy_checkpoint, run_qconv

# fixtures/checkpoints/README.md: llm-compressor 0.14.0.1 + compressed-tensors 0.19.0.
CT_FIXTURES = ["llama-ct-mixed", "llama-ct-w3a16", "llama-ct-w4a16", "llama-ct-w4a16-asym",
               "llama-ct-w8a16", "llama-ct-w8a16-channel", "llama-ct-w8a8"]
# Their settings (README table, docs/formats.md, compressed-tensors), per fixture: (format, bits, group size, symmetric).
SETTINGS = {"llama-ct-w3a16": ("pack-quantized", 3, 128, True),
            "llama-ct-w4a16": ("pack-quantized", 4, 128, True),
            "llama-ct-w4a16-asym": ("pack-quantized", 4, 128, False),
            "llama-ct-w8a16": ("pack-quantized", 8, 128, True),
            "llama-ct-w8a16-channel": ("pack-quantized", 8, -1, True),
            "llama-ct-w8a8": ("int-quantized", 8, -1, True)}
# The base model (llama-fp16): hidden 256, intermediate 512, 2 layers, 4 heads of 64, 2 KV heads.
SHAPES = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
          "gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}
LINEARS = [f"model.layers.{i}.{part}.{proj}" for i in range(2)
           for part, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                               ("mlp", ("gate_proj", "up_proj", "down_proj")))
           for proj in projs]


@functools.lru_cache(maxsize=None)
def _checkpoint(name):
    folder = CHECKPOINTS / name
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    return qc, read_header(folder / "model.safetensors").tensors


@functools.lru_cache(maxsize=None)
def _modules(name):
    qc, tensors = _checkpoint(name)
    return {m.name: m for m in ct.find_modules(tensors, qc)}


def _oracle(name):
    return load_file(CHECKPOINTS / name / "oracle" / "dequant.safetensors")


def _bits_of(x32):
    return np.ascontiguousarray(x32, dtype=np.float32).view(np.uint32)


# ---------------------------------------------------------------------------------------------
# The fixtures, read

@pytest.mark.parametrize("name", CT_FIXTURES)
def test_read_matches_oracle_bit_for_bit(name):
    qc, tensors = _checkpoint(name)
    modules = _modules(name)
    oracle = _oracle(name)
    assert sorted(modules) == sorted(k[: -len(".weight")] for k in oracle) == sorted(LINEARS)
    for mname, m in modules.items():
        assert m.problems == ()
        qt = ct_codec.read(m, tensors, qc, "float16")
        want = oracle[mname + ".weight"]
        assert qt.shape == want.shape == SHAPES[mname.rpartition(".")[2]]
        got = qt.dequantize().astype(np.float16).astype(np.float32)
        differ = np.count_nonzero(_bits_of(got) != _bits_of(want))
        assert differ == 0, f"{mname}: {differ} of {want.size} values differ from the oracle"


@pytest.mark.parametrize("name", CT_FIXTURES)
def test_encode_reproduces_stored_tensors_byte_for_byte(name):
    qc, tensors = _checkpoint(name)
    for mname, m in _modules(name).items():
        qt = ct_codec.read(m, tensors, qc, "float16")
        encoded = ct_codec.encode(qt, m.details["format"])
        stored = {t for t in tensors if t.startswith(mname + ".") and t != mname + ".bias"}
        assert {f"{mname}.{leaf}" for leaf in encoded} == stored
        assert set(m.weight_tensors) | set(m.state_tensors) == stored
        planned = ct_codec.leaves(qt.spec, qt.shape, m.details["format"])
        for leaf, (dtype, values) in encoded.items():
            info = tensors[f"{mname}.{leaf}"]
            assert (dtype, tuple(values.shape)) == (info.dtype, info.shape) == planned[leaf], leaf
            assert values.tobytes() == read_array(info).tobytes(), f"{mname}.{leaf}"


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_headers_describe_the_producers_settings(name):
    fmt, bits, group_size, symmetric = SETTINGS[name]
    for mname, m in _modules(name).items():
        assert (m.family, m.scheme, m.bits, m.group_size) == ("ct", f"int{bits}", bits, group_size)
        assert (m.out_features, m.in_features) == SHAPES[mname.rpartition(".")[2]]
        assert m.details["format"] == fmt and m.details["symmetric"] is symmetric
        assert m.details["strategy"] == ("channel" if group_size == -1 else "group")
        assert m.details["scale_dtype"] == "F16" and m.details["group"] == "group_0"
        leaf = "weight" if fmt == "int-quantized" else "weight_packed"
        assert m.weight_tensors == (f"{mname}.{leaf}",)
        assert (f"{mname}.weight_zero_point" in m.state_tensors) is (not symmetric)
        assert (f"{mname}.weight_shape" in m.state_tensors) is (fmt == "pack-quantized")


def test_mixed_fixture_groups():
    qc, _ = _checkpoint("llama-ct-mixed")
    for mname, m in _modules("llama-ct-mixed").items():
        if ".self_attn." in mname:
            assert (m.details["group"], m.bits, m.group_size) == ("group_0", 4, 64)
        else:
            assert (m.details["group"], m.bits, m.group_size, m.details["strategy"]) == \
                ("group_1", 8, -1, "channel")
        assert ct.scheme_for(qc, mname)[0] == m.details["group"]
    assert ct.scheme_for(qc, "lm_head") is None
    assert ct.scheme_for(qc, "model.layers.0.input_layernorm") is None      # neither attn nor mlp


# ---------------------------------------------------------------------------------------------
# Config matching (compressed_tensors/utils/match.py)

def _qc(groups, ignore=()):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {g: {"targets": t, "weights": {"num_bits": 4}} for g, t in groups.items()},
            "ignore": list(ignore)}


def test_exact_name_and_class_name_targets():
    qc = _qc({"exact": ["model.layers.0.mlp.down_proj"], "linear": ["Linear"]},
             ignore=["lm_head", "model.layers.1.mlp.up_proj"])
    assert ct.scheme_for(qc, "model.layers.0.mlp.down_proj")[0] == "exact"
    assert ct.scheme_for(qc, "model.layers.1.mlp.down_proj")[0] == "linear"
    assert ct.scheme_for(qc, "model.layers.0.self_attn.q_proj")[0] == "linear"
    assert ct.scheme_for(qc, "model.embed_tokens", class_name="Embedding") is None
    assert ct.scheme_for(qc, "lm_head") is None
    assert ct.scheme_for(qc, "model.lm_head")[0] == "linear"            # "lm_head" is an exact name
    assert ct.scheme_for(qc, "model.layers.1.mlp.up_proj") is None      # ignore wins
    # ignore by class name
    assert ct.scheme_for(_qc({"g": ["Linear"]}, ignore=["Linear"]), "model.layers.0.mlp.up_proj") is None


def test_exact_names_come_before_regexes_before_class_names():
    qc = _qc({"cls": ["Linear"], "rx": ["re:.*down_proj$"], "name": ["model.layers.0.mlp.down_proj"]})
    assert ct.scheme_for(qc, "model.layers.0.mlp.down_proj")[0] == "name"
    assert ct.scheme_for(qc, "model.layers.1.mlp.down_proj")[0] == "rx"
    assert ct.scheme_for(qc, "model.layers.1.mlp.up_proj")[0] == "cls"


def test_regex_is_anchored_at_the_start_only():
    qc = _qc({"g": ["re:model.layers.1"]})
    assert ct.scheme_for(qc, "model.layers.1.mlp.up_proj")[0] == "g"
    assert ct.scheme_for(qc, "model.layers.10.mlp.up_proj")[0] == "g"     # not anchored at the end
    assert ct.scheme_for(qc, "model.layers.0.mlp.up_proj") is None
    assert ct.scheme_for(_qc({"g": ["re:layers.1"]}), "model.layers.1.mlp.up_proj") is None
    assert ct.scheme_for(_qc({"g": ["re:.*layers.1"]}), "model.layers.1.mlp.up_proj")[0] == "g"
    assert ct.scheme_for(_qc({"g": ["re:[unclosed"]}), "model.layers.1.mlp.up_proj") is None


def test_per_group_format_and_mixed_precision():
    qc = _checkpoint("llama-ct-w8a8")[0]
    assert ct.group_format(qc, qc["config_groups"]["group_0"]) == "int-quantized"
    mixed = copy.deepcopy(qc)
    mixed["format"] = "mixed-precision"
    del mixed["config_groups"]["group_0"]["format"]
    assert ct.group_format(mixed, mixed["config_groups"]["group_0"]) == "int-quantized"   # inferred
    w4 = copy.deepcopy(_checkpoint("llama-ct-w4a16")[0])
    w4["format"] = "mixed-precision"
    assert ct.group_format(w4, w4["config_groups"]["group_0"]) == "pack-quantized"


def test_settings_report_and_lints():
    qc, tensors = _checkpoint("llama-ct-mixed")
    modules = list(_modules("llama-ct-mixed").values())
    all_modules = {t.rpartition(".")[0] for t in tensors}
    warnings = []
    report = ct.settings(qc, modules, all_modules, None, warnings)
    assert warnings == []
    assert (report["format"], report["version"], report["ignore"]) == \
        ("pack-quantized", "0.19.0", ["lm_head"])
    assert {g: (d["num_bits"], d["group_size"], d["strategy"], d["modules"])
            for g, d in report["config_groups"].items()} == {"group_0": (4, 64, "group", 8),
                                                             "group_1": (8, None, "channel", 6)}
    assert report["scales_dtype"] == "torch.float16"
    odd = copy.deepcopy(qc)
    odd["config_groups"]["group_0"]["targets"] = ["re:.*vision.*", "re:(", "model.layers.7.mlp.up_proj"]
    warnings = []
    ct.settings(odd, modules, all_modules, None, warnings)
    assert len(warnings) == 3 and "'re:.*vision.*' matches no module" in warnings[0]
    assert "not a valid regex" in warnings[1] and "names no module" in warnings[2]


# ---------------------------------------------------------------------------------------------
# Refusals, on small files written here

def _module_arrays(name, module):
    _, tensors = _checkpoint(name)
    return {t[len(module) + 1:]: read_array(info).copy() for t, info in tensors.items()
            if t.startswith(module + ".")}


def _write(tmp_path, module, arrays, qc):
    path = tmp_path / "model.safetensors"
    save_file({f"{module}.{leaf}": np.ascontiguousarray(a) for leaf, a in arrays.items()}, str(path))
    tensors = read_header(path).tensors
    return path, tensors, ct.find_modules(tensors, qc)


def _pack_padded(codes, bits):
    """compressed-tensors < 0.18 pack_to_int32: 32 // bits whole codes per word, along dim 1."""
    per_word = 32 // bits
    rows, cols = codes.shape
    words = -(-cols // per_word)
    padded = np.zeros((rows, words * per_word), np.uint64)
    padded[:, :cols] = codes
    out = np.zeros((rows, words), np.uint64)
    for j in range(per_word):
        out |= padded[:, j::per_word] << np.uint64(j * bits)
    return out.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("version", ["0.17.1", "0.19.0"])
def test_padded_pre_018_3bit_layout_is_refused_clearly(tmp_path, version):
    qc = copy.deepcopy(_checkpoint("llama-ct-w3a16")[0])
    qc["version"] = version
    module = "model.layers.0.self_attn.q_proj"
    rng = np.random.default_rng(3)
    arrays = {"weight_packed": _pack_padded(rng.integers(0, 8, size=(256, 256)), 3),
              "weight_scale": (rng.random((256, 2)) * 0.01 + 0.001).astype(np.float16),
              "weight_shape": np.array([256, 256], np.int64)}
    assert arrays["weight_packed"].shape == (256, 26)          # dense 3-bit would be 24 words
    path, tensors, (m,) = _write(tmp_path, module, arrays, qc)
    assert m.problems and "padded" in m.problems[0]
    with pytest.raises(UnsupportedFormat) as err:
        ct.check(m, tensors, qc)
    message = str(err.value)
    assert str(path) in message and f"{module}.weight_packed" in message
    assert "0.18" in message and "padded" in message
    with pytest.raises(UnsupportedFormat):
        ct_codec.read(m, tensors, qc, "float16")


def test_padded_layout_with_channel_scales_is_caught_by_weight_shape(tmp_path):
    qc = copy.deepcopy(_checkpoint("llama-ct-w3a16")[0])
    weights = qc["config_groups"]["group_0"]["weights"]
    weights.update(strategy="channel", group_size=None)
    module = "model.layers.0.self_attn.q_proj"
    rng = np.random.default_rng(4)
    arrays = {"weight_packed": _pack_padded(rng.integers(0, 8, size=(256, 256)), 3),
              "weight_scale": (rng.random((256, 1)) * 0.01 + 0.001).astype(np.float16),
              "weight_shape": np.array([256, 256], np.int64)}
    path, tensors, (m,) = _write(tmp_path, module, arrays, qc)
    assert m.problems == ()            # 26 words a row also fit a dense in of 267..277
    with pytest.raises(UnsupportedFormat) as err:
        ct_codec.read(m, tensors, qc, "float16")
    assert str(path) in str(err.value) and "padded" in str(err.value)


@pytest.mark.parametrize("shape", [[256, 200], [255, 256], [256, 256, 1]])
def test_weight_shape_that_disagrees_is_refused(tmp_path, shape):
    qc = _checkpoint("llama-ct-w4a16")[0]
    module = "model.layers.0.self_attn.q_proj"
    arrays = _module_arrays("llama-ct-w4a16", module)
    arrays["weight_shape"] = np.array(shape, np.int64)
    path, tensors, (m,) = _write(tmp_path, module, arrays, qc)
    if len(shape) != 2:
        assert m.problems and "weight_shape" in m.problems[0]
    with pytest.raises(CorruptCheckpoint) as err:
        ct_codec.read(m, tensors, qc, "float16")
    assert str(path) in str(err.value) and f"{module}.weight_shape" in str(err.value)


def test_nan_scale_is_refused(tmp_path):
    qc = _checkpoint("llama-ct-w4a16-asym")[0]
    module = "model.layers.1.mlp.down_proj"
    arrays = _module_arrays("llama-ct-w4a16-asym", module)
    arrays["weight_scale"][7, 2] = np.nan
    path, tensors, (m,) = _write(tmp_path, module, arrays, qc)
    assert m.problems == ()
    with pytest.raises(CorruptCheckpoint) as err:
        ct_codec.read(m, tensors, qc, "float16")
    assert "non-finite" in str(err.value) and f"{module}.weight_scale" in str(err.value)


def test_asymmetric_without_zero_point_is_refused(tmp_path):
    qc = _checkpoint("llama-ct-w4a16-asym")[0]
    module = "model.layers.0.self_attn.k_proj"
    arrays = _module_arrays("llama-ct-w4a16-asym", module)
    del arrays["weight_zero_point"]
    path, tensors, (m,) = _write(tmp_path, module, arrays, qc)
    with pytest.raises(CorruptCheckpoint) as err:
        ct.check(m, tensors, qc)
    assert "weight_zero_point" in str(err.value) and str(path) in str(err.value)


def test_float_quantized_group_is_unsupported(tmp_path):
    qc = copy.deepcopy(_checkpoint("llama-ct-w8a8")[0])
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "float-quantized"
    qc["config_groups"]["group_0"]["weights"]["type"] = "float"
    module = "model.layers.0.self_attn.q_proj"
    arrays = _module_arrays("llama-ct-w8a8", module)
    _, tensors, (m,) = _write(tmp_path, module, arrays, qc)
    with pytest.raises(UnsupportedFormat, match="float-quantized"):
        ct.check(m, tensors, qc)


def test_int_quantized_codes_outside_their_bits_are_refused(tmp_path):
    qc = copy.deepcopy(_checkpoint("llama-ct-w8a8")[0])
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 4     # W4A8 stores I8 codes in -8..7
    module = "model.layers.0.self_attn.q_proj"
    arrays = _module_arrays("llama-ct-w8a8", module)
    arrays["weight"] = np.clip(arrays["weight"], -8, 7)
    arrays["weight"][0, 0] = 9
    path, tensors, (m,) = _write(tmp_path, module, arrays, qc)
    with pytest.raises(CorruptCheckpoint, match="4-bit range"):
        ct_codec.read(m, tensors, qc, "float16")


def test_header_module_imports_no_numpy():
    code = ("import sys, qconv.formats.compressed_tensors.header as ct; "
            "print(sorted(m for m in ('numpy', 'torch', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# Writing: the config and the leaves

@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_config_for_matches_llm_compressors_config(name):
    qc, tensors = _checkpoint(name)
    specs = {mname: ct_codec.read(m, tensors, qc, "float16").spec for mname, m in _modules(name).items()}
    made = ct.config_for(specs, ["lm_head"], SETTINGS[name][0], class_targets=True)
    want = copy.deepcopy(qc)
    want["config_groups"]["group_0"]["weights"]["observer"] = None    # a calibration choice, not layout
    assert made == want


def test_config_for_mixed_bits_makes_one_group_per_scheme():
    qc, tensors = _checkpoint("llama-ct-mixed")
    specs = {mname: ct_codec.read(m, tensors, qc, "float16").spec
             for mname, m in _modules("llama-ct-mixed").items()}
    made = ct.config_for(specs, ["lm_head"], "pack-quantized")
    assert len(made["config_groups"]) == 2
    for mname, m in _modules("llama-ct-mixed").items():
        gname, group = ct.scheme_for(made, mname)
        assert group["targets"].count(mname) == 1
        want = qc["config_groups"][m.details["group"]]["weights"]
        assert {k: v for k, v in group["weights"].items() if k != "observer"} == \
            {k: v for k, v in want.items() if k != "observer"}
    assert ct.scheme_for(made, "lm_head") is None


# ---------------------------------------------------------------------------------------------
# compressed-tensors' own functions (installed in the test environment)

_TORCH_DTYPES = {"I32": "torch.int32", "I64": "torch.int64", "I8": "torch.int8", "F16": "torch.float16"}


def _ct_scheme(group):
    from compressed_tensors.quantization import QuantizationScheme
    return QuantizationScheme(**group)


@pytest.mark.parametrize("name", CT_FIXTURES)
def test_read_matches_compressed_tensors_decompress(name):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.base import BaseCompressor
    from safetensors.torch import load_file as load_torch

    qc, tensors = _checkpoint(name)
    state = load_torch(CHECKPOINTS / name / "model.safetensors")
    for mname in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        m = _modules(name)[mname]
        group = qc["config_groups"][m.details["group"]]
        compressor = BaseCompressor.get_value_from_registry(group["format"])
        local = {k[len(mname) + 1:]: v for k, v in state.items() if k.startswith(mname + ".")}
        theirs = compressor.decompress(local, _ct_scheme(group))["weight"]
        assert theirs.dtype == torch.float16
        ours = ct_codec.read(m, tensors, qc, "float16").dequantize().astype(np.float16)
        assert np.array_equal(ours.view(np.uint16), theirs.numpy().view(np.uint16)), mname


@pytest.mark.parametrize("bits", range(1, 9))
def test_dense_packing_matches_pack_to_int32_on_ragged_shapes(bits):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    rng = np.random.default_rng(bits)
    offset = 1 << (bits - 1)
    for shape in [(830, 545), (7, 33), (3, 1), (64, 96)]:
        q = rng.integers(-offset, offset, size=shape).astype(np.int8)
        for dim in (0, 1):
            theirs = pack_to_int32(torch.from_numpy(q), bits, packed_dim=dim).numpy()
            ours = ct_codec.pack_dense((q.astype(np.int16) + offset).astype(np.uint8), bits, axis=dim)
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), (shape, dim)
            back = unpack_from_int32(torch.from_numpy(theirs), bits, torch.Size(shape), packed_dim=dim)
            mine = ct_codec.unpack_dense(theirs, bits, shape[dim], axis=dim).astype(np.int16) - offset
            assert np.array_equal(mine, back.numpy()), (shape, dim)


@pytest.mark.parametrize("fmt,bits,group_size,symmetric", [
    ("pack-quantized", 3, 64, False), ("pack-quantized", 5, -1, True), ("pack-quantized", 2, 32, True),
    ("pack-quantized", 8, -1, False), ("int-quantized", 8, -1, True), ("int-quantized", 4, 32, False)])
def test_encode_matches_compressed_tensors_compress(fmt, bits, group_size, symmetric):
    """Random codes, through compressed-tensors' own compress (quantize + pack) and through encode."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.base import BaseCompressor

    rng = np.random.default_rng(bits * 10 + group_size)
    out, inp = 83, 320
    groups = 1 if group_size == -1 else inp // group_size
    offset = 1 << (bits - 1)
    codes = rng.integers(0, 1 << bits, size=(out, inp)).astype(np.uint8)
    zeros = (np.full((out, groups), offset) if symmetric else rng.integers(0, 1 << bits, size=(out, groups))
             ).astype(np.uint8)
    scales16 = (rng.random((out, groups)) * 0.01 + 0.001).astype(np.float16)
    spec = QuantSpec("int", bits, group_size, symmetric, scale_dtype="F16")
    qt = QuantTensor(spec, (out, inp), "float16", codes=codes, scales=scales16.astype(np.float32),
                     zeros=zeros)
    ours = ct_codec.encode(qt, fmt)

    weight = torch.from_numpy(qt.dequantize())     # (q - zp) * s is exact in float32: w / s gives q back
    args = {"num_bits": bits, "symmetric": symmetric, "type": "int",
            "strategy": "channel" if group_size == -1 else "group",
            "group_size": None if group_size == -1 else group_size}
    group = {"targets": ["Linear"], "weights": args, "format": fmt,
             "input_activations": dict(ct.INPUT_ACTIVATIONS_INT8_TOKEN) if fmt == "int-quantized" else None}
    local = {"weight": weight, "weight_scale": torch.from_numpy(scales16)}
    if not symmetric:
        local["weight_zero_point"] = torch.from_numpy((zeros.astype(np.int16) - offset).astype(np.int8))
    theirs = BaseCompressor.get_value_from_registry(fmt).compress(local, _ct_scheme(group))
    assert sorted(theirs) == sorted(ours)
    for leaf, (dtype, values) in ours.items():
        t = theirs[leaf].contiguous()
        assert str(t.dtype) == _TORCH_DTYPES[dtype], leaf
        assert values.tobytes() == t.numpy().tobytes(), leaf


def test_config_for_parses_as_compressed_tensors_config():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    specs = {"model.layers.0.self_attn.q_proj": QuantSpec("int", 4, 128, False, scale_dtype="F16"),
             "model.layers.0.mlp.up_proj": QuantSpec("int", 8, -1, True, scale_dtype="F32")}
    for fmt in ("pack-quantized", "int-quantized"):
        made = ct.config_for(specs, ["lm_head"], fmt)
        parsed = QuantizationConfig.model_validate(made)
        assert len(parsed.config_groups) == 2 and parsed.format == fmt
        assert parsed.quantization_status == "compressed"


def _compress_with_ct(tmp_path, module, group, weight, scale, zero_point=None, extra=None):
    """One module compressed by compressed-tensors itself, saved as a checkpoint file."""
    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from safetensors.torch import save_file as save_torch

    local = {"weight": torch.from_numpy(weight), "weight_scale": torch.from_numpy(scale)}
    if zero_point is not None:
        local["weight_zero_point"] = torch.from_numpy(zero_point)
    stored = BaseCompressor.get_value_from_registry(group["format"]).compress(local, _ct_scheme(group))
    stored.update(extra or {})
    path = tmp_path / "model.safetensors"
    save_torch({f"{module}.{k}": v.contiguous() for k, v in stored.items()}, str(path))
    return stored, read_header(path).tensors


@pytest.mark.parametrize("bits,symmetric", [(4, True), (3, False), (8, False)])
def test_ragged_channel_module_made_by_compressed_tensors(tmp_path, bits, symmetric):
    """in = 250 is no multiple of 32 / bits: the headers give a range, weight_shape the value."""
    pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    rng = np.random.default_rng(bits)
    out, inp, offset = 70, 250, 1 << (bits - 1)
    q = rng.integers(-offset, offset, size=(out, inp))
    zp = np.zeros((out, 1), np.int64) if symmetric else rng.integers(-offset, offset, size=(out, 1))
    scale = (rng.random((out, 1)) * 0.01 + 0.001).astype(np.float16)
    weight = ((q - zp) * scale.astype(np.float32)).astype(np.float32)
    group = {"targets": ["Linear"], "format": "pack-quantized",
             "weights": {"num_bits": bits, "symmetric": symmetric, "strategy": "channel"}}
    qc = ct.config_for({}, ["lm_head"])
    qc["config_groups"] = {"group_0": group}
    module = "model.layers.0.mlp.down_proj"
    stored, tensors = _compress_with_ct(tmp_path, module, group, weight, scale,
                                        None if symmetric else zp.astype(np.int8))
    (m,) = ct.find_modules(tensors, qc)
    assert m.problems == () and m.details["in_range"][0] <= inp <= m.details["in_range"][1]
    qt = ct_codec.read(m, tensors, qc, "float16")
    assert qt.shape == (out, inp)
    from compressed_tensors.compressors.base import BaseCompressor
    theirs = BaseCompressor.get_value_from_registry("pack-quantized").decompress(
        dict(stored), _ct_scheme(group))["weight"].numpy()
    assert np.array_equal(qt.dequantize().astype(np.float16).view(np.uint16), theirs.view(np.uint16))
    for leaf, (dtype, values) in ct_codec.encode(qt).items():
        assert values.tobytes() == stored[leaf].contiguous().numpy().tobytes(), leaf


def test_act_order_g_idx_of_older_releases(tmp_path):
    """compressed-tensors <= 0.18 wrote weight_g_idx for actorder "group": w[o, i] uses the scale of
    group g_idx[i]. Codes packed by compressed-tensors' pack_to_int32, expectation by hand."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file as save_torch

    rng = np.random.default_rng(7)
    out, inp, gs = 48, 128, 32
    q = rng.integers(-8, 8, size=(out, inp)).astype(np.int8)
    g_idx = rng.permutation(np.arange(inp) // gs).astype(np.int32)
    scale = (rng.random((out, inp // gs)) * 0.01 + 0.001).astype(np.float16)
    module = "model.layers.0.self_attn.q_proj"
    stored = {"weight_packed": pack_to_int32(torch.from_numpy(q), 4),
              "weight_scale": torch.from_numpy(scale),
              "weight_shape": torch.tensor([out, inp]), "weight_g_idx": torch.from_numpy(g_idx)}
    path = tmp_path / "model.safetensors"
    save_torch({f"{module}.{k}": v for k, v in stored.items()}, str(path))
    qc = ct.config_for({}, ["lm_head"], version="0.18.0")
    qc["config_groups"] = {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
        "num_bits": 4, "symmetric": True, "strategy": "group", "group_size": gs, "actorder": "group"}}}
    tensors = read_header(path).tensors
    (m,) = ct.find_modules(tensors, qc)
    assert m.problems == () and m.details["actorder"] == "group" and m.in_features == inp
    qt = ct_codec.read(m, tensors, qc, "float16")
    want = (q.astype(np.float16) * scale[:, g_idx]).astype(np.float16)
    assert np.array_equal(qt.dequantize().astype(np.float16).view(np.uint16), want.view(np.uint16))
    for leaf, (dtype, values) in ct_codec.encode(qt).items():
        assert values.tobytes() == read_array(tensors[f"{module}.{leaf}"]).tobytes(), leaf


QUIP_TRANSFORMS = {"config_groups": {
    "v": {"type": "random-hadamard", "randomize": True, "requires_grad": False, "head_dim": None,
          "apply": [{"targets": ["Linear"], "location": "input", "ignore": ["lm_head"], "inverse": False},
                    {"targets": ["Linear"], "location": "weight_input", "ignore": ["lm_head"], "inverse": True}]},
    "u": {"type": "hadamard", "randomize": False, "requires_grad": False, "head_dim": None,
          "apply": [{"targets": ["Linear"], "location": "weight_output", "ignore": ["lm_head"], "inverse": False},
                    {"targets": ["Linear"], "location": "output", "ignore": ["lm_head"], "inverse": True}]}}}


@pytest.mark.parametrize("transforms, refused", [(QUIP_TRANSFORMS, True), ({}, False), (None, False),
                                                 ({"config_groups": {}}, False)])
def test_transform_config_is_refused_not_dropped(tmp_path, transforms, refused):
    """compressed-tensors' transform_config (llm-compressor's QuIP / SpinQuant Hadamard rotations, as
    its QUIP template writes them): the rotations are fused into the stored weights and applied to
    activations at run time (their online matrices stored as `<module>.<group>_input.weight`), so the
    codes alone are another model. inspect warns (--strict exits 1); every other verb refuses (exit 5)
    and writes nothing. An empty transform_config, as qconv writes, is no transform."""
    src = copy_checkpoint("llama-ct-w4a16", tmp_path / "work")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["transform_config"] = transforms
    (src / "config.json").write_text(json.dumps(config))
    strict = run_qconv("inspect", "--strict", src)
    assert strict.returncode == (1 if refused else 0), strict.stderr
    assert ("transform_config applies v (random-hadamard), u (hadamard)" in strict.stdout) == refused
    for args in (["dequantize", src, tmp_path / "out"], ["convert", src, tmp_path / "out", "--to", "gptq"],
                 ["validate", src, src]):
        proc = run_qconv(*args)
        if refused:
            assert proc.returncode == 5 and len(proc.stderr.splitlines()) == 1, proc.stderr
            assert "transform_config" in proc.stderr and "compute something else" in proc.stderr
            assert not (tmp_path / "out").exists()
        else:
            assert proc.returncode == 0, proc.stderr
            if args[0] != "validate":
                shutil.rmtree(tmp_path / "out")


@pytest.fixture
def ct_act_order(tmp_path):
    """llama-ct-w4a16 with q_proj rewritten as an act-order module (weight_g_idx, a permutation of its
    2 groups of 128 over the inputs; actorder "group" in a config group of its own), codes unchanged."""
    src = copy_checkpoint("llama-ct-w4a16", tmp_path / "work")
    module = "model.layers.0.self_attn.q_proj"
    tensors = load_file(src / "model.safetensors")
    g_idx = np.random.default_rng(3).permutation(np.arange(256) // 128).astype(np.int32)
    tensors[f"{module}.weight_g_idx"] = g_idx
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    qc = config["quantization_config"]
    group = json.loads(json.dumps(qc["config_groups"]["group_0"]))
    group["targets"], group["weights"]["actorder"] = [module], "group"
    qc["config_groups"] = {"act": group, **qc["config_groups"]}
    (src / "config.json").write_text(json.dumps(config))
    return src, module, g_idx


@pytest.mark.parametrize("to", ["gptq", "gptq-v2"])
def test_ct_act_order_is_kept_by_gptq(tmp_path, ct_act_order, to):
    """GPTQ stores g_idx: compressed-tensors' act-order module keeps its codes and its g_idx there
    (desc_act true), and validates as the same computation."""
    src, module, g_idx = ct_act_order
    proc = run_qconv("convert", "--json", src, tmp_path / "out", "--to", to, "--validate")
    assert proc.returncode == 0, proc.stderr
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["requantized"] == 0 and comp["codes_kept"] == comp["modules"]
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert np.array_equal(out[f"{module}.g_idx"], g_idx)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["desc_act"] is True


@pytest.mark.parametrize("to", ["awq", "auto-round", "bnb8"])
def test_ct_act_order_is_requantized_where_g_idx_cannot_be_stored(tmp_path, ct_act_order, to):
    src, module, _ = ct_act_order
    proc = run_qconv("convert", "--json", src, tmp_path / "out", "--to", to, "--validate")
    assert proc.returncode == 0, proc.stderr
    (comp,) = json.loads(proc.stdout)["components"]
    assert module in [r["module"] for r in comp["layers"]]
