"""The Python API (api.py): the CLI's verbs as functions with explicit keywords, typed frozen results whose
``data`` is what ``--json`` prints, the documented error classes with their exit codes, progress to a
callback and nothing printed."""

import dataclasses
import inspect as pyinspect
import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import qconv
from qconv import api
from conftest import CHECKPOINTS, run_qconv

BNB8 = CHECKPOINTS / "llama-bnb8"


def _without_seconds(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "seconds"}


def test_import_loads_neither_torch_nor_numpy_and_inspect_stays_header_only():
    code = ("import sys, qconv; r = qconv.inspect(sys.argv[1]); "
            "print(r.kind, [m for m in ('torch', 'numpy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, str(BNB8)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["model", "[]"]


def test_inspect_returns_the_json_document_typed(capsys):
    result = qconv.inspect(BNB8)
    assert isinstance(result, qconv.InspectResult)
    assert result.kind == "model" and result.methods == ("bitsandbytes LLM.int8",) and result.warnings == ()
    assert json.loads(result.to_json()) == json.loads(run_qconv("inspect", "--json", BNB8, check=0).stdout)
    assert capsys.readouterr() == ("", "")          # the API prints nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.kind = "pipeline"


def test_inspect_strict_raises_check_failed_with_the_report():
    result = qconv.inspect(CHECKPOINTS / "qwen3vl-bnb8-skipvisual")
    assert result.warnings, "this fixture's skip entry 'visual' is reported (inspect's own tests)"
    with pytest.raises(qconv.CheckFailed) as info:
        qconv.inspect(CHECKPOINTS / "qwen3vl-bnb8-skipvisual", strict=True)
    assert info.value.exit_code == 1 and info.value.result.warnings == result.warnings


def test_convert_keeps_codes_reports_progress_and_matches_the_cli(tmp_path, capsys):
    events = []
    result = qconv.convert(BNB8, tmp_path / "api", to="gptq", bits=8, group_size=-1, sym=True,
                           progress=events.append)
    assert isinstance(result, qconv.ConvertResult) and result.destination == tmp_path / "api"
    assert result.codes_kept == 14 and result.requantized == () and not result.validated
    assert capsys.readouterr() == ("", "")
    # bytes written, increasing, ending at the total
    assert events and all(e.unit == "bytes" and e.task == "converting llama-bnb8" for e in events)
    assert [e.done for e in events] == sorted(e.done for e in events) and events[-1].done == events[-1].total
    cli = json.loads(run_qconv("bnb8-to-gptq", "--json", BNB8, tmp_path / "cli", check=0).stdout)
    doc = json.loads(result.to_json())
    assert _without_seconds(doc) == _without_seconds(cli) | {"destination": str(tmp_path / "api")}
    for shard in ("model.safetensors",):                 # the same bytes as the CLI's output
        assert (tmp_path / "api" / shard).read_bytes() == (tmp_path / "cli" / shard).read_bytes()


def test_the_package_convert_is_the_verb():
    """qconv.convert is both the package convert/ and the verb: calling it is api.convert."""
    assert callable(qconv.convert) and pyinspect.signature(qconv.convert) == pyinspect.signature(api.convert)
    import qconv.convert.engine as engine                  # the package's modules still import
    assert engine.__name__ == "qconv.convert.engine"


def test_convert_lossy_path_reports_its_error_and_validates(tmp_path):
    result = qconv.convert(BNB8, tmp_path / "out", to="gptq", bits=4, group_size=32, validate=True)
    assert result.validated and result.codes_kept == 0 and len(result.requantized) == 14
    for layer in result.requantized:
        assert 0 < layer["rel_frobenius"] <= layer["rtn_rel_frobenius"]


def test_bnb8_to_gptq_refuses_another_method(tmp_path):
    with pytest.raises(qconv.UnsupportedFormat) as info:
        qconv.bnb8_to_gptq(CHECKPOINTS / "llama-gptq-w8g128", tmp_path / "out")
    assert info.value.exit_code == 5 and "not bitsandbytes LLM.int8" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_dequantize_returns_a_typed_result_and_writes_float(tmp_path):
    result = qconv.dequantize(CHECKPOINTS / "llama-gptq-w4g64-asym", tmp_path / "f", dtype="float32")
    assert isinstance(result, qconv.DequantizeResult) and result.dequantized_modules == 14
    (comp,) = result.components
    assert comp["dtype"] == "float32"
    tensors = load_file(tmp_path / "f" / comp["shards"][0])
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == np.float32


def test_validate_passes_fails_and_raises(tmp_path):
    out = tmp_path / "gptq"
    qconv.bnb8_to_gptq(BNB8, out)
    events = []
    ok = qconv.validate(BNB8, out, progress=events.append)
    assert ok.ok and ok.failed == () and len(ok.layers) == 16
    assert events[-1] == qconv.ProgressEvent("validating llama-bnb8", 16, 16, "layers")

    # one code changed: the API raises by default, or returns the failing report with check=False
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in out.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.qweight"
    words = tensors[name].copy()
    words[0, 0] ^= 1
    tensors[name] = words
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(qconv.ValidationFailed) as info:
        qconv.validate(BNB8, bad)
    assert info.value.exit_code == 1 and info.value.result.failed == ("model.layers.1.mlp.up_proj",)
    report = qconv.validate(BNB8, bad, check=False)
    assert not report.ok and report.failed == ("model.layers.1.mlp.up_proj",)
    cli = run_qconv("validate", "--json", BNB8, bad)
    assert cli.returncode == 1 and json.loads(cli.stdout) == json.loads(report.to_json())


@pytest.mark.parametrize("verb, kwargs, needle", [
    ("convert", {"to": "gptq", "group_size": 0}, "group_size (--group-size) 0"),
    ("convert", {"to": "gptq", "bits": 9}, "bits (--bits) 9"),
    ("convert", {"to": "nope"}, "to (--to) 'nope'"),
    ("convert", {"to": "gptq", "max_shard_size": "0GB"}, "max_shard_size (--max-shard-size) '0GB'"),
    ("dequantize", {"dtype": "float8"}, "dtype (--dtype) 'float8'"),
    ("validate", {"tol": float("nan")}, "tol (--tol) nan"),
    ("validate", {"tol": -1.0}, "tol (--tol) -1.0"),
    ("validate", {"samples": 0}, "samples (--samples) 0"),
    ("validate", {"rows": "some"}, "rows (--rows) 'some'"),
])
def test_options_are_checked_by_one_model_for_api_and_cli(tmp_path, verb, kwargs, needle):
    with pytest.raises(qconv.UsageError) as info:
        getattr(qconv, verb)(BNB8, tmp_path / "out", **kwargs)
    assert info.value.exit_code == 2 and needle in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, needle", [
    (["validate", BNB8, BNB8, "--tol", "nan"], "tol (--tol) nan"),
    (["validate", BNB8, BNB8, "--tol", "inf"], "tol (--tol) inf"),
    (["convert", BNB8, "OUT", "--to", "gptq", "--group-size", "0"], "group_size (--group-size) 0"),
    (["dequantize", BNB8, "OUT", "--max-shard-size", "0"], "max_shard_size (--max-shard-size) '0'"),
    (["validate", BNB8, BNB8, "--samples", "0"], "--samples"),     # click's own range check, one line too
])
def test_cli_usage_errors_are_one_line_exit_2(tmp_path, args, needle):
    proc = run_qconv(*[tmp_path / "out" if a == "OUT" else a for a in args])
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("qconv: error: ") and needle in proc.stderr
    assert not (tmp_path / "out").exists()


def test_errors_carry_their_exit_codes(tmp_path):
    cases = [(qconv.InputNotFound, 3, lambda: qconv.inspect(tmp_path / "missing")),
             (qconv.OutputError, 6, lambda: qconv.dequantize(BNB8, BNB8))]
    for cls, code, call in cases:
        with pytest.raises(cls) as info:
            call()
        assert info.value.exit_code == code and isinstance(info.value, qconv.QconvError)
    assert {c.exit_code for c in (qconv.UsageError, qconv.InputNotFound, qconv.CorruptCheckpoint,
                                  qconv.UnsupportedFormat, qconv.OutputError, qconv.CheckFailed,
                                  qconv.ValidationFailed)} == {2, 3, 4, 5, 6, 1}


def test_every_verb_is_documented_with_keyword_only_options():
    for name in ("inspect", "convert", "bnb8_to_gptq", "dequantize", "validate", "check_model"):
        fn = getattr(api, name)
        assert fn.__doc__ and len(fn.__doc__) > 100, name
        params = list(pyinspect.signature(fn).parameters.values())
        positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert len(positional) in (1, 2), name             # paths only
        assert all(p.kind is p.KEYWORD_ONLY for p in params[len(positional):]), name
        assert not any(p.kind is p.VAR_KEYWORD for p in params), name


def test_the_documented_example_runs(tmp_path, monkeypatch, capsys):
    """docs/python-api.md's example, executed as written from the repository root."""
    import re

    from conftest import REPO

    text = (REPO / "docs" / "python-api.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("tempfile.mkdtemp", lambda: str(tmp_path))
    exec(compile(block, "docs/python-api.md", "exec"), {})
    assert capsys.readouterr().out.splitlines()[-1] == "1 14 layers differ"


def test_the_documented_verbs_are_the_api():
    """docs/python-api.md lists every verb with its real signature and every result's typed fields."""
    import re

    from conftest import REPO

    text = (REPO / "docs" / "python-api.md").read_text()
    for name in ("inspect", "convert", "bnb8_to_gptq", "dequantize", "validate", "check_model"):
        sig = pyinspect.signature(getattr(api, name))
        shown = ", ".join(["src, dst" if "src" in sig.parameters else ("a, b" if "a" in sig.parameters else "path"), "*"]
                          + [p.name + ("" if p.default is p.empty else f"={p.default!r}".replace("'", '"'))
                             for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY])
        assert f"`qconv.{name}({shown})`" in text, name
    for cls in (qconv.InspectResult, qconv.ConvertResult, qconv.DequantizeResult, qconv.ValidateResult,
                qconv.ModelCheckResult):
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{cls.__name__}` |")]
        documented = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", row.split("|")[2])))
        assert documented == {f.name for f in dataclasses.fields(cls)} - {"data"}, cls.__name__
