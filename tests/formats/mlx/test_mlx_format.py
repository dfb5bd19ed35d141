"""Apple MLX both ways (formats/mlx/, target "mlx"): the code streams against an independent bit-by-bit
packing, mlx-lm's own checkpoints (fixtures/checkpoints/*-mlx-*, written by mlx_lm.convert) read bit for
bit as mx.dequantize decodes them (their oracle), every integer source written with its codes kept and its
float32 weights equal to the source's, and what cannot be kept requantized with its error reported.
mlx-lm itself loading and running the outputs: tests/consumers/test_mlx.py."""

import json
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import load_file

from qconv.formats.core.detect import detect
from qconv.formats.core.ir import QuantTensor
from qconv.formats.core.reader import read_module
from qconv.formats.mlx import codec
from qconv.formats.storage.checkpoint import open_target
from qconv.formats.storage.safetensors_header import read_header
from qconv.formats.storage.tensor_io import read_array

from conftest import CHECKPOINTS, inspect_json, one_error, run_qconv

MLX_FIXTURES = ("llama-mlx-w4g64", "llama-mlx-mixed36", "qwen3moe-mlx-w4g64", "llama-mlx-mxfp4", "llama-mlx-w5g32")


def reference_pack(codes, bits):
    """Each row as one integer, code i at bit i * bits, cut into little-endian 32-bit words."""
    rows, n = codes.shape
    out = np.zeros((rows, n * bits // 32), np.uint32)
    for r in range(rows):
        acc = 0
        for i, c in enumerate(codes[r]):
            acc |= int(c) << (i * bits)
        for k in range(out.shape[1]):
            out[r, k] = (acc >> (32 * k)) & 0xFFFFFFFF
    return out


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
def test_code_streams_match_a_bit_by_bit_packing(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, (5, 128), dtype=np.uint8)
    words = reference_pack(codes, bits)
    assert np.array_equal(codec.pack(codes, bits), words)
    assert np.array_equal(codec.unpack(words, bits), codes)


def modules_of(path):
    comp = open_target(path).components[0]
    det = detect(comp)
    return comp, det, {m.name: m for m in det.modules}


def header(folder):
    """{tensor: (dtype code, shape)} of a folder's one shard, from its header."""
    from qconv.formats.storage.safetensors_header import read_header

    return {name: (info.dtype, tuple(info.shape)) for name, info in read_header(folder / "model.safetensors").tensors.items()}


def same(a, b):
    """Equal weights: bit for bit, but for the sign of a zero (see codec.zero_points)."""
    return np.array_equal(a, b) and not np.isnan(a).any() and np.array_equal(
        a.view(np.uint32)[a != 0], b.view(np.uint32)[b != 0])


def decoded(path, dtype="float32"):
    """{module: qconv's float32 decoding}, and the QuantTensor / FloatWeight of each."""
    comp, det, modules = modules_of(path)
    read = {name: read_module(comp, det, m, dtype) for name, m in modules.items()}
    return {name: t.dequantize_rows(0, t.shape[0]) for name, t in read.items()}, read


@pytest.mark.parametrize("name", MLX_FIXTURES)
def test_mlx_lm_checkpoints_read_as_mx_dequantize_decodes_them(name):
    """Every module of mlx-lm's own files, bit for bit its oracle (mx.dequantize, float32 scales and
    biases); mx.quantize's min / max biases are no integer zero points, so each is its codes with float
    offsets (w = s * q + b, the biases as stored); mode mxfp4's e2m1 codes and e8m0 scales are codes."""
    oracle = load_file(CHECKPOINTS / name / "oracle" / "dequant.safetensors")
    weights, read = decoded(CHECKPOINTS / name)
    assert sorted(oracle) == sorted(n + ".weight" for n in weights)
    for module, w in weights.items():
        assert np.array_equal(w.view(np.uint32), oracle[module + ".weight"].view(np.uint32)), module
    if name.endswith("mxfp4"):
        assert all(isinstance(t, QuantTensor) and t.spec.scheme == "e2m1" for t in read.values())
    else:
        assert all(isinstance(t, QuantTensor) and t.spec.offset == "float" and t.zeros is None
                   and t.biases is not None for t in read.values())


def test_inspect_reads_mixed_bits_and_stacked_experts():
    (mixed,) = inspect_json(CHECKPOINTS / "llama-mlx-mixed36")["components"]
    assert mixed["method"] == "MLX" and mixed["warnings"] == []
    assert mixed["bits"] == [3, 6] and mixed["per_module_overrides"] == 16
    assert sorted(mixed["quantized_modules"]) == ["int3", "int6"]
    (moe,) = inspect_json(CHECKPOINTS / "qwen3moe-mlx-w4g64")["components"]
    assert moe["warnings"] == []
    int4 = moe["quantized_modules"]["int4"]
    assert "model.layers.0.mlp.experts.3.down_proj" in int4 and not any("switch_mlp" in m for m in int4)
    assert moe["quantized_modules"]["int8"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


def convert_json(src, dst, *args, code=0):
    proc = run_qconv("convert", "--json", src, dst, *args)
    assert proc.returncode == code, proc.stderr[-2000:]
    return json.loads(proc.stdout)["components"][0] if code == 0 else proc


# (fixture, what its modules are): codes kept into MLX, float32 weights equal to the source's
KEPT = ["llama-gptq-w4g64-asym", "llama-gptq-w8g128", "llama-gptq-w3g128", "llama-gptq-w2g128",
        "llama-awq-w4g128", "llama-awq-w4g64-sym", "llama-ct-w4a16", "llama-ct-w4a16-asym", "llama-ct-w8a16",
        "llama-ct-w8a8", "llama-ct-w8a16-channel", "llama-autoround-w4g128-mixed8", "qwen3-autoround-w8g128"]


@pytest.mark.parametrize("src", KEPT)
def test_integer_codes_are_kept_and_decode_bit_for_bit(tmp_path, src):
    out = tmp_path / "mlx"
    comp = convert_json(CHECKPOINTS / src, out, "--to", "mlx", "--validate")
    assert comp["requantized"] == 0 and comp["scales_rounded"] == 0 and comp["validation"]["ok"]
    want, source = decoded(CHECKPOINTS / src)
    got, written = decoded(out)
    assert sorted(got) == sorted(want)
    for name in want:
        assert same(got[name], want[name]), name
        assert isinstance(written[name], QuantTensor)               # integer zero points: codes readable
        assert np.array_equal(written[name].codes, source[name].codes), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"]
    assert config["quantization"]["mode"] == "affine" and "quant_method" not in config["quantization"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]     # mlx-lm's Llama reads only this
    tensors = header(out)
    for name in want:
        assert tensors[name + ".scales"][0] == tensors[name + ".biases"][0] and tensors[name + ".weight"][0] == "U32"


def test_float16_scales_where_they_are_exact(tmp_path):
    """Symmetric 4-bit float16 GPTQ scales in a float16 model: b = -8 s is exact in float16, so scales and
    biases stay float16 (what mlx-lm writes); asymmetric ones in a bfloat16 model need float32."""
    sym = convert_json(CHECKPOINTS / "llama-ct-w4a16", tmp_path / "a", "--to", "mlx")
    asym = convert_json(CHECKPOINTS / "llama-gptq-w4g64-asym", tmp_path / "b", "--to", "mlx")
    assert sym["codes_kept"] == asym["codes_kept"] == 14
    assert sym["scale_dtypes"] == {"F16": 14} and asym["scale_dtypes"] == {"F32": 14}     # the choice, reported
    assert header(tmp_path / "a")["model.layers.0.mlp.up_proj.scales"][0] == "F16"
    assert header(tmp_path / "b")["model.layers.0.mlp.up_proj.biases"][0] == "F32"


def test_bnb_int8_keeps_codes_with_its_scale_rounding_reported(tmp_path):
    """LLM.int8's per-row SCB / 127 repeated in every group of 128 (codes CB + 128, b = -128 s exact), s to
    float16 as --to gptq stores it: the only rounding, reported, and validated against its bound."""
    comp = convert_json(CHECKPOINTS / "llama-bnb8", tmp_path / "mlx", "--to", "mlx", "--validate")
    assert comp["requantized"] == 0 and comp["codes_kept"] == 14 and comp["validation"]["ok"]
    assert 0 < comp["max_scale_rel_error"] <= 2.0**-11
    _, source = decoded(CHECKPOINTS / "llama-bnb8")
    _, written = decoded(tmp_path / "mlx")
    for name, qt in written.items():
        assert qt.spec.group_size == 128 and np.array_equal(qt.codes, source[name].codes)
        assert (qt.zeros == 128).all()


def test_round_trip_through_mlx_gives_the_gptq_codes_back(tmp_path):
    """GPTQ -> MLX -> GPTQ: -b / s is the integer zero point again, so every code, scale and zero point
    comes back (the same decoded weights, the same codes)."""
    src = CHECKPOINTS / "llama-gptq-w4g64-asym"
    convert_json(src, tmp_path / "mlx", "--to", "mlx")
    back = convert_json(tmp_path / "mlx", tmp_path / "gptq", "--to", "gptq-v2", "--validate")
    assert back["requantized"] == 0 and back["validation"]["ok"]
    want, source = decoded(src)
    got, again = decoded(tmp_path / "gptq")
    for name in want:
        assert same(got[name], want[name]), name
        assert np.array_equal(again[name].codes, source[name].codes)
        assert np.array_equal(again[name].zeros, source[name].zeros)


@pytest.mark.parametrize("name", ["llama-mlx-w4g64", "llama-mlx-mixed36", "qwen3moe-mlx-w4g64"])
def test_mlx_lm_files_into_mlx_keep_every_tensor_byte_for_byte(tmp_path, name):
    """mlx_lm.convert's folders (min / max biases, 3- and 6-bit mixed, stacked experts) -> MLX: every code,
    scale and bias kept as it is, so every tensor of the output is byte for byte mlx-lm's."""
    comp = convert_json(CHECKPOINTS / name, tmp_path / "mlx", "--to", "mlx")
    assert comp["requantized"] == 0 and comp["codes_kept"] == comp["modules"] and comp["scales_rounded"] == 0

    def raw(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update({n: (i.dtype, i.shape, read_array(i).tobytes()) for n, i in read_header(f).tensors.items()})
        return out

    assert raw(tmp_path / "mlx") == raw(CHECKPOINTS / name)
    def resolved(folder):
        """Each quantized module's (bits, group size, mode) as mlx-lm resolves its config's entries (a
        per-module entry over the defaults; null: the default)."""
        q = json.loads((folder / "config.json").read_text())["quantization"]
        out = {}
        for n in raw(folder):
            if n.endswith(".scales"):
                m = n[: -len(".scales")]
                entry = q.get(m) if isinstance(q.get(m), dict) else {}
                out[m] = tuple(entry.get(k) or q.get(k, "affine") for k in ("bits", "group_size", "mode"))
        return out

    assert resolved(tmp_path / "mlx") == resolved(CHECKPOINTS / name)


def test_mlx_lm_files_into_gptq_are_requantized_with_the_error_reported(tmp_path):
    """mx.quantize's biases are float offsets, no integer zero points: GPTQ cannot keep its codes; every module is
    requantized from MLX's exact decoding, each layer's error beside round-to-nearest's, and validated
    against that error. Asymmetric by default (MLX's grid is; mx.quantize makes 0 nearly a grid point, so
    an integer zero point nearly fits): far below a symmetric requantization (--sym)."""
    asym = convert_json(CHECKPOINTS / "llama-mlx-w4g64", tmp_path / "asym", "--to", "gptq", "--validate")
    assert asym["requantized"] == asym["modules"] == 16 and asym["validation"]["ok"]
    assert all("float offsets" in r["reason"] and r["rtn_rel_frobenius"] >= r["rel_frobenius"] > 0
               for r in asym["layers"])
    sym = convert_json(CHECKPOINTS / "llama-mlx-w4g64", tmp_path / "sym", "--to", "gptq", "--sym")
    assert asym["max_rel_frobenius"] < 0.01 < sym["max_rel_frobenius"]


def test_moe_experts_are_stacked_as_switch_mlp(tmp_path):
    """Per-expert Linears (FP8 requantized here) are written as mlx-lm's SwitchLinear stacks [E, ...],
    with the config keys mlx-lm's Qwen3-MoE needs; read back, each expert is a view of its rows."""
    comp = convert_json(CHECKPOINTS / "qwen3moe-fp8-block", tmp_path / "mlx", "--to", "mlx", "--validate")
    assert comp["validation"]["ok"]
    tensors = header(tmp_path / "mlx")
    assert not any(".experts." in n for n in tensors)
    assert tensors["model.layers.0.mlp.switch_mlp.gate_proj.weight"] == ("U32", (4, 128, 32))
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["num_experts"] == config["num_local_experts"] == 4
    want, _ = decoded(CHECKPOINTS / "qwen3moe-fp8-block")
    _, written = decoded(tmp_path / "mlx")
    assert sorted(written) == sorted(want)


def test_mlx_moe_source_into_gptq_per_expert(tmp_path):
    comp = convert_json(CHECKPOINTS / "qwen3moe-mlx-w4g64", tmp_path / "gptq", "--to", "gptq", "--validate")
    assert comp["validation"]["ok"]
    names = set(header(tmp_path / "gptq"))
    assert "model.layers.1.mlp.experts.3.down_proj.qweight" in names


def test_act_order_and_odd_groups_are_requantized_with_the_reason(tmp_path):
    act = convert_json(CHECKPOINTS / "llama-gptq-w4g128-actorder", tmp_path / "a", "--to", "mlx", "--validate")
    assert act["validation"]["ok"]
    assert act["requantized"] == 14 and all("act-order" in r["reason"] for r in act["layers"])
    proc = run_qconv("convert", CHECKPOINTS / "llama-gptq-w8g128", tmp_path / "b", "--to", "mlx", "--group-size", "256")
    one_error(proc, 2, "--group-size 256", "32, 64, 128")
    assert not (tmp_path / "b").exists()


def test_unread_modes_and_bad_streams_are_refused(tmp_path):
    """Another mode (nvfp4), a width mx.quantize does not pack (7), and words that do not fit the config."""
    import shutil

    for name, edit, code, words in [
            ("mode", lambda c: c["quantization"].update(mode="nvfp4"), 5, "mode 'nvfp4'"),
            ("bits", lambda c: c["quantization"].update(bits=7), 5, "bits 7"),
            ("group", lambda c: c["quantization"].update(group_size=32), 4, "group_size is 32")]:
        folder = tmp_path / name
        shutil.copytree(CHECKPOINTS / "llama-mlx-w4g64", folder)
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        config["quantization_config"] = config["quantization"]
        (folder / "config.json").write_text(json.dumps(config))
        proc = run_qconv("convert", folder, tmp_path / f"{name}-out", "--to", "gptq")
        one_error(proc, code, words)
        assert not (tmp_path / f"{name}-out").exists()


def test_older_mlx_lm_config_with_only_quantization(tmp_path):
    """mlx-lm before quantization_config was mirrored wrote only "quantization": read the same."""
    import shutil

    folder = tmp_path / "old"
    shutil.copytree(CHECKPOINTS / "llama-mlx-w4g64", folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    (comp,) = inspect_json(folder)["components"]
    assert comp["method"] == "MLX" and comp["warnings"] == []


def test_a_forced_scale_dtype_reports_what_it_rounds(tmp_path):
    """--scale-dtype bfloat16 on asymmetric float16 GPTQ scales: scales and biases rounded, counted in the
    summary. A rounded bias moves every weight of its group by the same amount, which --validate's
    per-weight relative bound (the codes are kept) does not allow near the zero point: it refuses, and
    nothing is written; the default (exact) dtype validates (above)."""
    comp = convert_json(CHECKPOINTS / "llama-gptq-w4g64-asym", tmp_path / "bf16", "--to", "mlx", "--scale-dtype",
                        "bfloat16")
    assert comp["codes_kept"] == 14 and comp["scales_rounded"] > 0 and 0 < comp["max_scale_rel_error"] <= 2.0**-8
    assert header(tmp_path / "bf16")["model.layers.0.mlp.up_proj.biases"][0] == "BF16"
    proc = run_qconv("convert", CHECKPOINTS / "llama-gptq-w4g64-asym", tmp_path / "v", "--to", "mlx", "--scale-dtype",
                     "bfloat16", "--validate")
    one_error(proc, 1, "validation failed, nothing written")
    assert not (tmp_path / "v").exists()


def test_mxfp4_is_kept_byte_for_byte_both_ways(tmp_path):
    """compressed-tensors MXFP4A16 -> MLX mode mxfp4: weight_packed's bytes ARE MLX's words (two codes a
    byte, the even one low = eight a little-endian word, the first lowest) and weight_scale's e8m0 bytes its
    scales; and back. mlx-lm's own mxfp4 file into compressed-tensors keeps its codes too."""
    from qconv.formats.storage.safetensors_header import read_header
    from qconv.formats.storage.tensor_io import read_array

    def raw(folder):
        header_ = read_header(folder / "model.safetensors")
        return {n: read_array(i).tobytes() for n, i in header_.tensors.items()}

    src = CHECKPOINTS / "llama-ct-mxfp4"
    comp = convert_json(src, tmp_path / "mlx", "--to", "mlx", "--validate")
    assert comp["codes_kept"] == 14 and comp["validation"]["ok"]
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    a, b = raw(src), raw(tmp_path / "mlx")
    for name in modules_of(src)[2]:
        assert a[name + ".weight_packed"] == b[name + ".weight"] and a[name + ".weight_scale"] == b[name + ".scales"]
    back = convert_json(tmp_path / "mlx", tmp_path / "ct", "--to", "compressed-tensors-mxfp4")
    assert back["codes_kept"] == 14
    c = raw(tmp_path / "ct")
    assert all(c[k] == v for k, v in a.items() if k.endswith((".weight_packed", ".weight_scale")))
    theirs = convert_json(CHECKPOINTS / "llama-mlx-mxfp4", tmp_path / "ct2", "--to", "compressed-tensors-mxfp4",
                          "--validate")
    assert theirs["requantized"] == 0 and theirs["validation"]["ok"]


def _edited(tmp_path, fixture, edit):
    """A copy of an MLX fixture with its tensors edited (edit(tensors) -> tensors), as torch tensors."""
    import shutil

    import torch  # noqa: F401  (the tensors edit() gets)
    from safetensors.torch import load_file as load_torch, save_file

    folder = tmp_path / "src"
    shutil.copytree(CHECKPOINTS / fixture, folder)
    tensors = edit(load_torch(folder / "model.safetensors"))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "mlx"})
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    return folder


M = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize("fixture, edit, code, words", [
    ("llama-mlx-w4g64", lambda t: {**t, M + ".scales": t[M + ".scales"].clone().fill_(float("nan"))}, 4, "non-finite"),
    ("llama-mlx-w4g64", lambda t: {**t, M + ".biases": t[M + ".biases"][:, :2].clone()}, 4, "do not match scales"),
    ("llama-mlx-w4g64", lambda t: {k: v for k, v in t.items() if k != M + ".biases"}, 4, "no biases tensor"),
    ("llama-mlx-w4g64", lambda t: {**t, M + ".weight": t[M + ".weight"][:, :40].clone()}, 4, "scale groups"),
    ("llama-mlx-mxfp4", lambda t: {**t, M + ".scales": t[M + ".scales"].clone().fill_(255)}, 4, "not finite"),
    ("llama-mlx-w4g64", lambda t: {**t, M + ".biases": t[M + ".biases"].clone().fill_(float("inf"))}, 4, "non-finite"),
], ids=["nan-scales", "biases-shape", "no-biases", "short-words", "e8m0-255", "inf-offsets"])
def test_hostile_mlx_files_get_one_line_naming_the_tensor(tmp_path, fixture, edit, code, words):
    """Every verb that reads data refuses, naming the file and the module, and writes nothing."""
    src = _edited(tmp_path, fixture, edit)
    for verb in (["dequantize"], ["convert", "--to", "gptq"], ["convert", "--to", "mlx"]):
        out = tmp_path / f"out-{verb[-1]}"
        line = one_error(run_qconv(verb[0], src, out, *verb[1:]), code, words, "model.safetensors")
        assert M in line
        assert not out.exists()


def test_inputs_no_mlx_group_divides_are_refused(tmp_path):
    """A Linear of 48 inputs (no group of 32, 64 or 128 divides it): one line, exit 5, nothing written;
    the other targets' rules are their own."""
    import torch

    def add_odd(t):
        return {**t, "model.layers.0.mlp.odd_proj.weight": torch.randn(64, 48, dtype=torch.float16)}

    src = _edited(tmp_path, "llama-fp16", add_odd)
    proc = run_qconv("convert", src, tmp_path / "out", "--to", "mlx")
    one_error(proc, 5, "model.layers.0.mlp.odd_proj", "groups of 32, 64 or 128", "48")
    assert not (tmp_path / "out").exists()


def test_biases_beyond_the_scale_dtype_are_refused_not_written_as_infinity():
    """s = 1000 in float16 with z = 128: b = -128000 is beyond float16's range; the encoder refuses (convert
    then names the module, exit 5) rather than store infinity."""
    from qconv.formats.core.ir import QuantSpec

    spec = QuantSpec("int", 8, 32, True, scale_dtype="F16")
    qt = QuantTensor(spec, (2, 64), "float16", codes=np.full((2, 64), 130, np.uint8),
                     scales=np.full((2, 2), 1000, np.float32), zeros=np.full((2, 2), 128, np.uint8))
    with pytest.raises(ValueError, match="beyond float16's range"):
        codec.encode_for("mlx", qt, spec, False)
    ok = codec.encode_for("mlx", replace(qt, scales=np.full((2, 2), 0.5, np.float32)), spec, False)
    assert ok["biases"][0] == "F16" and np.all(ok["biases"][1] == np.float16(-64))
