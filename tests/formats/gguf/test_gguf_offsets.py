"""Float offsets (w = s * q + b, formats/core/ir.py) between GGUF and MLX, with files their producers
wrote: llama.cpp's own quantizer (fixtures/gguf: Q4_K_M, Q5_K_M, Q3_K_M, Q6_K, Q2_K from llama-fp16) and mlx-lm's own
converter (fixtures/checkpoints/llama-mlx-*: min / max biases). Q4_K / Q5_K blocks are read as codes with
float offsets that decode bit for bit as llama.cpp's own decoder (gguf-py's quants.dequantize) and go to
MLX with every code, scale and minimum kept; mlx-lm's affine modules go to GGUF Q4_1 / Q5_1 with every code
kept, decoding bit for bit as mx.dequantize did (the oracles); what no target type holds (Q6_K / Q3_K / Q2_K's
16-weight sub-blocks, 6-bit offsets in GGUF) is requantized with the error reported. mlx-lm and llama.cpp
run these outputs in tests/consumers/test_mlx.py and test_llamacpp.py."""

import json
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from qconv.formats.storage.safetensors_header import read_header

from conftest import CHECKPOINTS, FIXTURES, llama_cpp_decoding, one_error, run_qconv

KQUANTS = FIXTURES / "gguf"
def qconv_reading(path):
    """{module: the QuantTensor or FloatWeight qconv reads} of a folder or GGUF."""
    from qconv.formats.core.detect import detect
    from qconv.formats.core.reader import read_module
    from qconv.formats.storage.checkpoint import open_target

    comp = open_target(path).components[0]
    det = detect(comp)
    return {m.name: read_module(comp, det, m, "float32") for m in det.modules}


def bits_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q6_K", "Q2_K"])
def test_llama_cpps_k_quants_are_read_as_llama_cpp_decodes_them(kind):
    """Every Q4_K / Q5_K tensor of llama.cpp's own files is codes with float offsets (scale d * sc, bias
    -dmin * m, groups of 32) whose decoding is gguf-py's bit for bit; Q6_K, Q3_K and Q2_K (16-weight
    sub-blocks) are their decoded weights, also bit for bit."""
    from qconv.formats.core.ir import FloatWeight, QuantTensor

    theirs, ours = llama_cpp_decoding(KQUANTS / f"llama-fp16-{kind}.gguf"), qconv_reading(KQUANTS / f"llama-fp16-{kind}.gguf")
    theirs.pop("lm_head")                     # llama.cpp's output (Q6_K): a float tensor to qconv, not a module
    assert sorted(theirs) == sorted(ours) and len(ours) == 14
    types = {t for t, _ in theirs.values()}
    assert kind[:4] in types and types <= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    for module, (type_name, w) in theirs.items():
        t = ours[module]
        if type_name in ("Q4_K", "Q5_K"):
            assert isinstance(t, QuantTensor) and t.spec.offset == "float" and t.spec.group_size == 32
            assert t.spec.bits == int(type_name[1]) and t.zeros is None and t.biases.shape == (w.shape[0], w.shape[1] // 32)
        else:
            assert isinstance(t, FloatWeight), (module, type_name)
        assert bits_equal(t.dequantize(), w), (module, type_name)


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M"])
def test_k_quants_go_to_mlx_with_every_code_kept(tmp_path, kind):
    """GGUF Q4_K_M / Q5_K_M -> MLX: every Q4_K / Q5_K module keeps its codes, d * sc and -dmin * m as MLX
    scales and biases in groups of 32 (float32: d * sc is no float16 value in general), so the MLX
    folder decodes to llama.cpp's own decoding bit for bit; the Q6_K modules are requantized with the
    reason and error reported; --validate passes."""
    src = KQUANTS / f"llama-fp16-{kind}.gguf"
    proc = run_qconv("convert", "--json", "--validate", src, tmp_path / "mlx", "--to", "mlx", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    theirs = llama_cpp_decoding(src)
    theirs.pop("lm_head")
    requantized = {m for m, (t, _) in theirs.items() if t == "Q6_K"}
    assert comp["codes_kept"] == 14 - len(requantized) and comp["requantized"] == len(requantized) > 0
    assert comp["scales_rounded"] == 0 and comp["validation"]["ok"]
    assert {r["module"] for r in comp["layers"]} == requantized
    assert all(r["reason"].startswith("GGUF Q6_K") and r["rtn_rel_frobenius"] >= r["rel_frobenius"] > 0
               for r in comp["layers"])
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["quantization"]["mode"] == "affine"
    source, written = qconv_reading(src), qconv_reading(tmp_path / "mlx")
    header = {n: i.dtype for n, i in read_header(tmp_path / "mlx" / "model.safetensors").tensors.items()}
    for module, (type_name, w) in theirs.items():
        if module in requantized:
            continue
        t = written[module]
        assert t.spec.offset == "float" and (t.spec.bits, t.spec.group_size) == (int(type_name[1]), 32)
        assert np.array_equal(t.codes, source[module].codes), module
        assert header[module + ".scales"] == header[module + ".biases"] == "F32"
        assert bits_equal(t.dequantize(), w), module


@pytest.mark.parametrize("fixture, types", [("llama-mlx-w4g64", {"Q4_1"}), ("llama-mlx-w5g32", {"Q5_1"}),
                                            ("llama-mlx-mixed36", {"Q4_1", "Q8_0"})])
def test_mlx_lm_offsets_go_to_gguf_q4_1_q5_1_with_every_code_kept(tmp_path, fixture, types):
    """mlx-lm's own affine folders -> GGUF: 2- to 4-bit modules become Q4_1 (nibble = q, d = s, m = b),
    5-bit Q5_1, each decoding in llama.cpp's decoder to mx.dequantize's weights (the fixture's oracle) bit
    for bit (float16 scales and biases: d and m exact); 6-bit ones (mixed_3_6) have no GGUF type with
    float offsets and are requantized to Q8_0 with the reason said. Back to MLX, the kept modules decode
    to the same weights again (lm_head aside: a GGUF source's output is read as a float tensor)."""
    out = tmp_path / "m.gguf"
    proc = run_qconv("convert", "--json", "--validate", CHECKPOINTS / fixture, out, "--to", "gguf", check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert comp["scales_rounded"] == 0 and comp["validation"]["ok"]
    oracle = load_file(CHECKPOINTS / fixture / "oracle" / "dequant.safetensors")
    theirs = llama_cpp_decoding(out)
    assert {t for t, _ in theirs.values()} == types
    requantized = {r["module"]: r["reason"] for r in comp["layers"]}
    assert set(requantized) == {m for m, (t, _) in theirs.items() if t == "Q8_0"}
    assert all(r == "6-bit codes with float offsets become 8-bit" for r in requantized.values())
    for module, (type_name, w) in theirs.items():
        if type_name != "Q8_0":
            assert bits_equal(w, oracle[module + ".weight"]), module
    back = run_qconv("convert", "--json", out, tmp_path / "mlx", "--to", "mlx", check=0)
    assert json.loads(back.stdout)["components"][0]["requantized"] == 0
    again = qconv_reading(tmp_path / "mlx")
    for module, (type_name, w) in theirs.items():
        if module != "lm_head":               # a GGUF's output is a float tensor to qconv (docs/gguf.md)
            assert bits_equal(again[module].dequantize(), w), module


def test_a_non_finite_k_quant_minimum_is_refused(tmp_path):
    """A Q4_K block whose dmin is a float16 NaN: every verb that reads it refuses in one line naming the
    file and the tensor, and writes nothing."""
    src = tmp_path / "bad.gguf"
    shutil.copy(KQUANTS / "llama-fp16-Q4_K_M.gguf", src)
    reader = gguf.GGUFReader(src, "r+")
    t = next(t for t in reader.tensors if t.tensor_type.name == "Q4_K" and t.name == "blk.0.ffn_up.weight")
    t.data.view(np.uint8).reshape(-1, 144)[3, 2:4] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    reader.data.flush()
    del reader
    for verb in (["dequantize"], ["convert", "--to", "mlx"], ["convert", "--to", "gptq"]):
        dst = tmp_path / f"out-{verb[-1]}"
        line = one_error(run_qconv(verb[0], src, dst, *verb[1:]), 4, "bad.gguf")
        assert "up_proj" in line or "ffn_up" in line, line
        assert not dst.exists()
