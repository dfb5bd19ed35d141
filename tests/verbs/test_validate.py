"""`qconv validate` and `convert --validate`: real conversions pass, deliberately corrupted layers fail
and only they are named, and bitsandbytes' own kernels are run as a cross-check."""

import dataclasses
import json

import numpy as np
import pytest

from qconv.formats.storage.safetensors_header import read_header

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
    """A lossy pair (the float model quantized data-free to 4 bits, round-to-nearest: relative output error
    up to 0.38 per layer) fails without --tol, passes a tolerance above its error and fails one below. A
    pair with no producer's kernel on either side, so each run is the comparison alone (the kernels'
    cross-checks are tested below)."""
    out = tmp_path / "int4"
    run_qconv("convert", "--to", "compressed-tensors", "--no-search", "--no-card", CHECKPOINTS / "llama-fp16", out,
              check=0)
    code, result, _ = _validate(CHECKPOINTS / "llama-fp16", out)
    assert code == 1 and not result["components"][0]["kernels"]               # not lossless
    worst = max(layer["rel_frobenius"] for layer in result["layers"])
    assert 0.1 < worst < 0.5
    assert _validate(CHECKPOINTS / "llama-fp16", out, "--tol", "0.5")[0] == 0
    assert _validate(CHECKPOINTS / "llama-fp16", out, "--tol", "0.01")[0] == 1


def test_bad_input_exit_codes(tmp_path):
    code, _, err = _validate(tmp_path / "missing", CHECKPOINTS / "llama-bnb8")
    assert code == 3 and err.startswith("qconv: error: ")


def test_convert_validate_refuses_to_publish_a_wrong_result(tmp_path, monkeypatch):
    """An encoder bug (simulated: one code flipped) is caught before the rename: nothing at DST."""
    from qconv.convert.convert import Options, convert
    from qconv.errors import ValidationFailed
    from qconv.formats.gptq import codec as gptq_codec

    real = gptq_codec.encode

    def broken(qt, **kw):
        out = real(qt, **kw)
        out["qweight"][1][0, 0] ^= 0x10
        return out

    monkeypatch.setattr(gptq_codec, "encode", broken)
    with pytest.raises(ValidationFailed):
        convert(CHECKPOINTS / "llama-bnb8", tmp_path / "out", Options("gptq", bits=8, group_size=-1, sym=True), validate=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(gptq_codec, "encode", real)
    result = convert(CHECKPOINTS / "llama-bnb8", tmp_path / "out", Options("gptq", bits=8, group_size=-1, sym=True), validate=True)
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
    lines = proc.stdout.splitlines()
    results = [line for line in lines if line.startswith(("  ok", "  FAIL"))]
    # 1 device-decoding row, 14 lossless fixture conversions (the fixtures whose method has a lossless
    # target here: 12 before the dense Qwen auto-round pair), the generated model, its negative control
    assert len(results) == 17 and all(line.startswith("  ok") for line in results)
    kernels = lines[lines.index("own kernels cross-checked:") + 1:]
    assert [k.split()[0] for k in kernels] == ["auto-round", "bnb4", "bnb8"]
    assert not any("could not run" in k for k in kernels)


def _gpu_check():
    """benchmarks/gpu_check.py, whose checks the tests run on the CPU."""
    import importlib.util

    from conftest import REPO
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_dequantization_is_bit_exact():
    """validate dequantizes on its device (torch); that must be the numpy reference path bit for bit, for
    whole layers and for row blocks that start and end mid-group / mid-block (the same check gpu-check
    runs on CUDA)."""
    gpu_check = _gpu_check()
    cases = list(gpu_check.device_cases())
    assert len(cases) > 100 and any(not q.codes.flags.c_contiguous for _, _, q in cases)
    kinds = {(qt.spec.name, qt.g_idx is not None) for _, qt, _ in cases}
    assert {("int8", False), ("int4", True), ("int3", False), ("int2", False), ("nf4", False),
            ("fp4", False)} <= kinds
    assert any(getattr(qt, "biases", None) is not None for _, qt, _ in cases)     # MLX's float offsets
    checked, wrong = gpu_check.device_mismatches("cpu")
    assert wrong == [] and checked == 3 * len(cases)


@pytest.fixture(scope="module")
def large_model(tmp_path_factory):
    """A generated TinyLlama-shaped decoder layer (GPTQ int8, qconv's bnb8-to-gptq layout) whose MLP
    layers have 5,632 output rows: above the 4,096 that sampled validation checks whole."""
    folder = tmp_path_factory.mktemp("large") / "gptq8"
    _gpu_check()._generated_gptq8(folder, 1)
    return folder


def test_every_row_is_checked_and_sampled_rows_say_so(large_model, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(large_model, bad)
    # One int8 code of output row 600 of gate_proj (qweight is [in / 4, out]: row 600 is column 600),
    # a row between the sampled windows (0..511 and 704..1215).
    shard = next(bad.glob("*.safetensors"))
    tensor = "model.layers.0.mlp.gate_proj.qweight"
    out = read_header(shard).tensors[tensor].shape[1]
    _patch(shard, tensor, lambda raw: raw.view(np.int32).__setitem__(3 * out + 600, raw.view(np.int32)[3 * out + 600] ^ 0x100))

    code, result, _ = _validate(large_model, bad)                     # every row, by default
    assert code == 1 and [r["module"] for r in result["layers"] if not r["ok"]] == ["model.layers.0.mlp.gate_proj"]
    bad_layer = next(r for r in result["layers"] if not r["ok"])
    assert bad_layer["worst_channel"] == 600 and bad_layer["rows_checked"] == 5632
    assert result["components"][0]["rows"] == "all" and not any(r.get("sampled") for r in result["layers"])

    # Sampled rows (faster on a CPU) miss it, and the report says which layers were sampled.
    code, result, _ = _validate(large_model, bad, "--rows", "sampled")
    assert code == 0 and result["components"][0]["rows"] == "sampled"
    sampled = sorted(r["module"] for r in result["layers"] if r.get("sampled"))
    assert sampled == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert all(r["rows_checked"] == 4096 for r in result["layers"] if r.get("sampled"))
    from qconv.cli import _validate_table          # the text the CLI prints for that same report

    assert "(4 large layers on sampled rows; --rows all checks every row)" in _validate_table(result)


def test_one_code_off_after_a_lossless_conversion_fails(large_model, tmp_path):
    """GPTQ int8 (float16 scales) -> bnb int8 keeps the codes; the two sides store scales differently,
    so weights may differ by float16 scale rounding, but not by one code step. One changed code among
    5,632 inputs moves that output channel far less than the output-level bound allows: it is the
    per-weight bound that names it."""
    out = tmp_path / "bnb8"
    run_qconv("convert", "--to", "bnb8", large_model, out, check=0)
    code, result, _ = _validate(large_model, out)
    assert code == 0 and all(r["weights_over_bound"] == 0 for r in result["layers"])
    _patch(out / "model.safetensors", "model.layers.0.mlp.down_proj.weight",
           lambda raw: raw.__setitem__(5007, (int(raw[5007]) + 1) % 256))
    code, result, _ = _validate(large_model, out)
    failed = [r for r in result["layers"] if not r["ok"]]
    assert code == 1 and [r["module"] for r in failed] == ["model.layers.0.mlp.down_proj"]
    assert failed[0]["weights_over_bound"] == 1 and failed[0]["first_weight_over_bound"] == [0, 5007]
    assert failed[0]["bound_ratio"] < failed[0]["bound"]


def test_a_kernel_that_cannot_run_is_reported_never_passed(monkeypatch):
    """If a producer's kernel raises on this machine (say, no kernel image for a GPU), the layer rests on
    the weight and output bounds, and the report and table say the cross-check did not run."""
    from qconv import cli, validation
    from qconv.formats.bnb import kernel as bnb_kernel

    def unavailable(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device\ndetails")

    monkeypatch.setattr(bnb_kernel, "INT8", dataclasses.replace(bnb_kernel.INT8, output=unavailable))
    result = validation.validate(CHECKPOINTS / "llama-bnb8", CHECKPOINTS / "llama-bnb8", device="cpu")
    kernels = [k for r in result["layers"] for k in r.get("kernels", {}).values()]
    assert result["ok"] and len(kernels) == 2 * 14
    assert all(k["ok"] is None and "rel_frobenius" not in k for k in kernels)
    assert {k["error"] for k in kernels} == {"RuntimeError: no kernel image is available for execution on the device"}
    text = cli._validate_table(result)
    assert "bnb8 could not run" in text and "warning: kernel cross-check could not run (bnb8: RuntimeError" in text


def _strict_json(text):
    """json.loads that refuses NaN and Infinity (not JSON: RFC 8259)."""
    def refuse(name):
        raise ValueError(f"{name} in --json output")
    return json.loads(text, parse_constant=refuse)


def test_a_nan_weight_fails_names_the_layer_and_json_stays_json(tmp_path):
    """One NaN float16 weight (max() and <= both ignore NaN): the layer fails, the rest pass, and --json
    writes null, never NaN."""
    bad = copy_checkpoint("llama-fp16", tmp_path)
    _patch(bad / "model.safetensors", "model.layers.0.mlp.up_proj.weight",
           lambda raw: raw.view(np.uint16).__setitem__(77, 0x7E00))            # float16 NaN
    proc = run_qconv("validate", "--json", CHECKPOINTS / "llama-fp16", bad)
    result = _strict_json(proc.stdout)
    assert proc.returncode == 1 and not result["ok"]
    assert [r["module"] for r in result["layers"] if not r["ok"]] == ["model.layers.0.mlp.up_proj"]
    failed = next(r for r in result["layers"] if not r["ok"])
    assert "non-finite" in failed["problem"]
    text = run_qconv("validate", CHECKPOINTS / "llama-fp16", bad).stdout
    assert "FAILED: 15/16" in text and "model.layers.0.mlp.up_proj" in text


def test_a_nan_scale_never_passes(tmp_path):
    bad = copy_checkpoint("llama-bnb8", tmp_path)
    _patch(bad / "model.safetensors", "model.layers.1.self_attn.q_proj.SCB",
           lambda raw: raw.view(np.float32).__setitem__(3, np.nan))
    proc = run_qconv("validate", CHECKPOINTS / "llama-bnb8", bad)
    assert proc.returncode not in (0, 70) and "OK" not in proc.stdout
    assert "model.layers.1.self_attn.q_proj" in proc.stdout + proc.stderr


def test_nothing_in_common_is_a_failure(tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(CHECKPOINTS / "pipeline-qwen3vl-bnb8", other)
    (other / "text_encoder").rename(other / "text_encoder_2")
    index = json.loads((other / "model_index.json").read_text())
    index["text_encoder_2"] = index.pop("text_encoder")
    (other / "model_index.json").write_text(json.dumps(index))
    code, result, _ = _validate(CHECKPOINTS / "pipeline-qwen3vl-bnb8", other)
    assert code == 1 and not result["ok"] and result["layers"] == []
    assert result["components_only_in_a"] == ["text_encoder"] and result["components_only_in_b"] == ["text_encoder_2"]
    text = run_qconv("validate", CHECKPOINTS / "pipeline-qwen3vl-bnb8", other).stdout
    assert "FAILED: 0/0" in text and "nothing was compared" in text


def test_negative_seed_is_a_usage_error():
    proc = run_qconv("validate", "--seed", "-1", CHECKPOINTS / "llama-bnb8", CHECKPOINTS / "llama-bnb8")
    assert proc.returncode == 2 and "--seed" in proc.stderr and "Traceback" not in proc.stderr


def test_lossless_pairs_are_settled_by_codes(tmp_path):
    """bnb int8 -> GPTQ keeps every code, with float16 scales: the weights are proved within the bound
    from codes and scales alone; a repack (auto-round -> GPTQ) keeps codes and scales: identical."""
    out = tmp_path / "gptq"
    run_qconv("bnb8-to-gptq", CHECKPOINTS / "llama-bnb8", out, check=0)
    code, result, _ = _validate(CHECKPOINTS / "llama-bnb8", out)
    quantized = [r for r in result["layers"] if r["module"].startswith("model.layers.")]
    assert code == 0 and {r["weights_checked"] for r in quantized} == {"codes identical, scales within the bound"}
    assert {r["weights_checked"] for r in result["layers"] if r not in quantized} == {"stored weights identical"}
    repack = tmp_path / "repack"
    run_qconv("convert", "--to", "gptq", CHECKPOINTS / "llama-autoround-w4g128-mixed8", repack, check=0)
    code, result, _ = _validate(CHECKPOINTS / "llama-autoround-w4g128-mixed8", repack)
    assert code == 0 and {r["weights_checked"] for r in result["layers"] if r["module"].startswith("model.layers.")} \
        == {"codes and scales identical"}


def test_a_scale_off_by_more_than_its_rounding_is_not_settled_by_codes(tmp_path):
    """Same codes, one float16 scale moved by 2^-9 of itself (four times its rounding): the codes do not
    settle it, every weight is compared, and the weights it scales are named."""
    out = tmp_path / "gptq"
    run_qconv("bnb8-to-gptq", CHECKPOINTS / "llama-bnb8", out, check=0)
    _patch(out / "model.safetensors", "model.layers.0.mlp.gate_proj.scales",
           lambda raw: raw.view(np.uint16).__setitem__(5, raw.view(np.uint16)[5] + 4))
    code, result, _ = _validate(CHECKPOINTS / "llama-bnb8", out)
    failed = [r for r in result["layers"] if not r["ok"]]
    assert code == 1 and [r["module"] for r in failed] == ["model.layers.0.mlp.gate_proj"]
    assert failed[0]["weights_checked"] == "every weight" and failed[0]["first_weight_over_bound"][0] == 5


def test_kernels_sampled_by_default_every_layer_on_request(monkeypatch):
    """Default: the first layer of each distinct (format, kernel, shape) plus KERNEL_SAMPLE drawn with the
    seed; kernels="all": every layer. The summary counts both, per side and kernel."""
    from qconv import cli, validation

    monkeypatch.setattr(validation, "KERNEL_SAMPLE", 2)
    a = b = CHECKPOINTS / "llama-bnb8"
    full = validation.validate(a, b, device="cpu", kernels="all")
    assert [(k["side"], k["kernel"], k["layers"], k["checked"]) for k in full["components"][0]["kernels"]] == \
        [("a", "bnb8", 14, 14), ("b", "bnb8", 14, 14)]
    sampled = validation.validate(a, b, device="cpu", seed=3)
    checked = [r for r in sampled["layers"] if "kernels" in r]
    shapes = {tuple(read_header(a / "model.safetensors").tensors[r["module"] + ".weight"].shape)
              for r in full["layers"] if r["module"].startswith("model.layers.")}
    assert len(checked) == len(shapes) + 2 < 14
    assert {tuple(read_header(a / "model.safetensors").tensors[r["module"] + ".weight"].shape)
            for r in checked} == shapes
    assert [r["module"] for r in checked] == [r["module"] for r in validation.validate(a, b, device="cpu", seed=3)["layers"]
                                              if "kernels" in r]                    # seeded: the same again
    assert all(k["checked"] == len(checked) and k["layers"] == 14 for k in sampled["components"][0]["kernels"])
    text = cli._validate_table(sampled)
    assert f"own kernel bnb8 on A: checked {len(checked)} of 14 layers (each shape once" in text
    assert sampled["ok"] and all(r["ok"] for r in sampled["layers"])


def test_torch_is_imported_only_for_a_kernel():
    import subprocess
    import sys

    probe = ("import sys; from qconv.validation import validate; r = validate(sys.argv[1], sys.argv[1], device='cpu'); "
             "print(r['ok'], 'torch' in sys.modules, 'bitsandbytes' in sys.modules)")
    for name, expected in (("llama-fp16", "True False False"), ("llama-bnb8", "True True True")):
        proc = subprocess.run([sys.executable, "-c", probe, CHECKPOINTS / name], capture_output=True, text=True,
                              timeout=300)
        assert proc.stdout.split() == expected.split(), proc.stderr[-2000:]


def test_shards_of_layers_add_up_to_the_whole(monkeypatch, tmp_path):
    """Layers are independent: validating disjoint shards of them (what one task of a distributed run
    does) gives, together, exactly the reports of one run over all, kernel sample included."""
    from qconv import validation
    from qconv.formats.storage.checkpoint import open_target

    monkeypatch.setattr(validation, "KERNEL_SAMPLE", 2)
    out = tmp_path / "gptq"
    run_qconv("bnb8-to-gptq", CHECKPOINTS / "llama-bnb8", out, check=0)
    ca, cb = open_target(CHECKPOINTS / "llama-bnb8").components[0], open_target(out).components[0]
    whole = validation.validate_components(ca, cb, device="cpu", seed=5)
    names = [r["module"] for r in whole["layers"]]
    shards = [validation.validate_components(ca, cb, device="cpu", seed=5, modules=set(names[i::3]),
                                             shard_first=i == 0) for i in range(3)]
    merged = sorted((r for s in shards for r in s["layers"]), key=lambda r: names.index(r["module"]))
    assert merged == whole["layers"] and all(s["ok"] for s in shards)
    # the tensors that are not Linear weights (norms, embeddings' neighbours...) are compared once
    assert shards[0]["tensors"] == whole["tensors"] and whole["tensors"]["compared"] > 0
    assert [s["tensors"]["compared"] for s in shards[1:]] == [0, 0]
    for i, k in enumerate(whole["kernels"]):
        assert sum(s["kernels"][i]["checked"] for s in shards) == k["checked"] < k["layers"]




def test_a_nan_stored_alike_on_both_sides_still_fails(tmp_path):
    """Weights stored bit for bit alike need no product to be equal, but a NaN among them must still fail
    the layer (the shortcut looks at the stored bits)."""
    import shutil

    bad = copy_checkpoint("llama-fp16", tmp_path)
    _patch(bad / "model.safetensors", "model.layers.1.self_attn.o_proj.weight",
           lambda raw: raw.view(np.uint16).__setitem__(1234, 0x7C00))           # float16 +inf
    twin = tmp_path / "twin"
    shutil.copytree(bad, twin)
    code, result, _ = _validate(bad, twin)
    failed = [r for r in result["layers"] if not r["ok"]]
    assert code == 1 and [r["module"] for r in failed] == ["model.layers.1.self_attn.o_proj"]
    assert all(r["weights_checked"] == "stored weights identical" and r["cosine"] == 1.0
               for r in result["layers"] if r["ok"])


@pytest.mark.parametrize("name", ["llama-bnb8", "llama-gptq-w4g64-asym", "llama-gptq-w8g128"])
def test_one_product_for_both_sides_is_each_sides_product(name):
    """Same codes under close scales are multiplied once for both sides (_factored_outputs): each side's Y
    must be that side's own X W^T (W from the reference dequantization, the product in float64) within
    float32 accumulation, per output channel, on per-row scales and on groups."""
    from dataclasses import replace

    from qconv.formats.storage.checkpoint import open_target
    from qconv.formats.core.reader import read_module
    from qconv.validation import _activations, _factored_outputs, Side

    side = Side(open_target(CHECKPOINTS / name).components[0])
    grouped = 0
    for e in side.entries.values():
        if e.module is None:
            continue
        qa = read_module(side.comp, side.det, e.module, side.dtype)
        qb = replace(qa, scales=(qa.scales * np.float32(1 + 2.0**-12)).astype(np.float32))
        out, inp = qa.shape
        x = _activations(8, inp, 0)
        xt = np.ascontiguousarray(x.T)
        r0, r1 = 3, out - 5
        ys = _factored_outputs(qa, qb, r0, r1, xt)
        assert ys is not None
        for q, y in zip((qa, qb), ys):
            w = q.dequantize_rows(r0, r1).astype(np.float64)
            exact = w @ xt.astype(np.float64)
            bound = inp * 2.0**-23 * (np.abs(w) @ np.abs(xt).astype(np.float64)) + 1e-30
            assert y.shape == exact.shape and np.all(np.abs(y - exact) <= bound)
        grouped += qa.zeros.shape[1] > 1
    assert (grouped > 0) == (name != "llama-bnb8")
