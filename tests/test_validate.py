"""`qconv validate` and `convert --validate`: real conversions pass, deliberately corrupted layers fail
and only they are named, and bitsandbytes' own kernels are run as a cross-check."""

import json

import numpy as np
import pytest

from qconv.formats.safetensors_header import read_header

from conftest import CHECKPOINTS, copy_checkpoint, run_qconv


def _validate(a, b, *args):
    proc = run_qconv("validate", "--json", a, b, *args)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None, proc.stderr


def _patch(path, tensor, fn):
    """Rewrite one tensor's bytes in place (same size) through fn(np.ndarray of its raw bytes)."""
    info = read_header(path).tensors[tensor]
    with open(path, "r+b") as f:
        f.seek(info.offset)
        raw = np.frombuffer(f.read(info.nbytes), dtype=np.uint8).copy()
        fn(raw)
        f.seek(info.offset)
        f.write(raw.tobytes())


def test_lossless_conversion_validates_with_kernel_cross_checks(tmp_path):
    out = tmp_path / "gptq"
    run_qconv("bnb8-to-gptq", CHECKPOINTS / "llama-bnb8", out, check=0)
    code, result, _ = _validate(CHECKPOINTS / "llama-bnb8", out)
    assert code == 0 and result["ok"]
    quantized = [r for r in result["layers"] if r["module"].startswith("model.layers.")]
    assert len(quantized) == 14
    for r in quantized:   # bitsandbytes' LLM.int8 matmul on A, auto-round's CPU kernel on B, same X
        assert r["kernels"]["a"]["kernel"] == "bnb8" and r["kernels"]["a"]["ok"]
        assert r["kernels"]["b"]["kernel"] == "auto-round" and r["kernels"]["b"]["ok"]
        assert r["bound_ratio"] <= r["bound"] and r["cosine"] > 0.9999


def test_4bit_kernel_cross_check(tmp_path):
    code, result, _ = _validate(CHECKPOINTS / "llama-bnb4-nf4-bf16storage", CHECKPOINTS / "llama-bnb4-nf4-dq")
    assert code == 0
    for r in result["layers"]:
        if r["module"].startswith("model.layers."):
            assert {k["kernel"] for k in r["kernels"].values()} == {"bnb4"}
            assert all(k["ok"] and k["rel_frobenius"] < 1e-5 for k in r["kernels"].values())
            assert r["max_abs"] == 0.0            # same codes and absmax, other storage dtype


CORRUPTIONS = {
    # a few bits of one packed word of one layer
    "flipped_bits": ("llama-gptq-w4g128-actorder", "model.layers.1.mlp.up_proj.qweight",
                     lambda raw: raw.__setitem__(slice(400, 401), raw[400:401] ^ 0b0110)),
    # one float16 scale one ulp up, in one group of one output channel
    "scale_one_ulp": ("llama-gptq-w4g128-actorder", "model.layers.0.self_attn.k_proj.scales",
                      lambda raw: raw.view(np.uint16).__setitem__(37, raw.view(np.uint16)[37] + 1)),
    # one 4-bit zero point one step off
    "zero_point_off_by_one": ("llama-gptq-w4g64-asym", "model.layers.1.self_attn.o_proj.qzeros",
                              lambda raw: raw.view(np.uint32).__setitem__(3, raw.view(np.uint32)[3] ^ 0x1)),
    # one int8 code of a bitsandbytes weight
    "int8_code": ("llama-bnb8", "model.layers.0.mlp.down_proj.weight",
                  lambda raw: raw.__setitem__(1000, (int(raw[1000]) + 1) % 256)),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_layer_fails_and_only_it_is_named(tmp_path, case):
    name, tensor, fn = CORRUPTIONS[case]
    bad = copy_checkpoint(name, tmp_path)
    _patch(bad / "model.safetensors", tensor, fn)
    code, result, _ = _validate(CHECKPOINTS / name, bad)
    assert code == 1 and not result["ok"]
    failed = [r["module"] for r in result["layers"] if not r["ok"]]
    assert failed == [tensor.rsplit(".", 1)[0]]
    text = run_qconv("validate", CHECKPOINTS / name, bad).stdout
    assert "FAILED: " in text and f"{failed[0]}" in text


def test_modules_on_one_side_only(tmp_path):
    from safetensors.torch import load_file, save_file

    bad = copy_checkpoint("llama-fp16", tmp_path)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    code, result, _ = _validate(CHECKPOINTS / "llama-fp16", bad)
    assert code == 1 and result["components"][0]["only_in_a"] == ["model.layers.1.mlp.gate_proj"]


def test_tolerance_option_for_lossy_pairs(tmp_path):
    out = tmp_path / "int4"
    run_qconv("convert", "--to", "gptq", CHECKPOINTS / "llama-bnb4-nf4-dq", out, check=0)
    assert _validate(CHECKPOINTS / "llama-bnb4-nf4-dq", out)[0] == 1          # not lossless
    assert _validate(CHECKPOINTS / "llama-bnb4-nf4-dq", out, "--tol", "0.3")[0] == 0
    assert _validate(CHECKPOINTS / "llama-bnb4-nf4-dq", out, "--tol", "0.01")[0] == 1


def test_bad_input_exit_codes(tmp_path):
    code, _, err = _validate(tmp_path / "missing", CHECKPOINTS / "llama-bnb8")
    assert code == 3 and err.startswith("qconv: error: ")


def test_convert_validate_refuses_to_publish_a_wrong_result(tmp_path, monkeypatch):
    """An encoder bug (simulated: one code flipped) is caught before the rename: nothing at DST."""
    from qconv.convert.convert import Options, convert
    from qconv.errors import ValidationFailed
    from qconv.formats import gptq_codec

    real = gptq_codec.encode

    def broken(qt, **kw):
        out = real(qt, **kw)
        out["qweight"][1][0, 0] ^= 0x10
        return out

    monkeypatch.setattr(gptq_codec, "encode", broken)
    with pytest.raises(ValidationFailed):
        convert(CHECKPOINTS / "llama-bnb8", tmp_path / "out", Options("gptq", 8, -1, True), validate=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(gptq_codec, "encode", real)
    result = convert(CHECKPOINTS / "llama-bnb8", tmp_path / "out", Options("gptq", 8, -1, True), validate=True)
    assert result["components"][0]["validation"]["ok"]


def test_auto_round_kernel_cross_check(tmp_path):
    out = tmp_path / "gptq"
    run_qconv("convert", "--to", "gptq", CHECKPOINTS / "llama-autoround-w4g128-mixed8", out, check=0)
    code, result, _ = _validate(CHECKPOINTS / "llama-autoround-w4g128-mixed8", out)
    assert code == 0
    quantized = [r for r in result["layers"] if r["module"].startswith("model.layers.")]
    assert all(k["kernel"] == "auto-round" and k["ok"] and k["rel_frobenius"] < 2e-3
               for r in quantized for k in r["kernels"].values())
    assert all(len(r["kernels"]) == 2 for r in quantized)
    assert all(r["max_abs"] == 0.0 for r in quantized)          # a repack: identical weights


def test_gpu_check_script_runs_on_cpu():
    """bin/gpu-check is for lent GPU machines; its logic is exercised here on the CPU, small."""
    import subprocess
    import sys

    from conftest import REPO
    proc = subprocess.run([sys.executable, REPO / "benchmarks" / "gpu_check.py", "--device", "cpu", "--layers", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert len(lines) == 13 and all(line.startswith("  ok") for line in lines)
