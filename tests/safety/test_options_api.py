"""Never silently wrong, round 5 (issue 47, items 7-9): option values that size an allocation, options
given to a target that does not take them at their default value, and the Python API's arguments of the
wrong type.

7. A --block-size (fp8, compressed-tensors-fp8) is at most 65536 a side, refused at parse time beyond,
   and at most the largest rows / input columns of any module converted, refused (exit 2) before
   anything is written beyond: a block no module has is a typo, and the config's weight_block_size would
   describe blocks no module holds (transformers' kernels and its dequantization are sized by it). A
   block larger than some modules (a partial block, as the producers allow) is one block over their
   rows or columns, computed without an allocation sized by the option.
8. An option the target does not take is refused when it is given, whatever its value (its default
   included): a flag on the command line, a keyword (not None) in the API.
9. Every argument of the API's verbs is type-checked to a UsageError (exit 2, one line): ``to=None`` was
   a bare KeyError, ``source=3`` an exit 5 "is GPTQ, not 3", ``progress=3`` a TypeError after the work.

Every refusal here satisfies the sweep's contract (sweep_cases.check_contract: a documented exit, one
``qconv: error:`` line, no traceback), leaves SRC byte-identical and no DST or litter."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CHECKPOINTS, QCONV, child_env, child_signals, copy_checkpoint
from sweep_cases import Run, check_contract, litter, run_inprocess, snapshot

MEMORY_LIMIT = 4 << 30          # a run refused before it allocates fits well inside this; a bomb does not

FP16 = "llama-fp16"           # hidden 256, intermediate 512: its Linears are at most 512 x 512


def _limited():
    """preexec_fn: default signals and an address-space limit (test_structure's), so an allocation sized
    by an option fails here instead of exhausting the machine."""
    signals = child_signals()

    def preexec():
        signals()
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    return preexec


def run_limited(*args) -> Run:
    proc = subprocess.run([QCONV, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=child_env(), preexec_fn=_limited())
    return Run(list(args), proc.returncode, proc.stdout, proc.stderr)


def _work(tmp_path: Path, fixture: str = FP16) -> tuple[Path, Path, dict]:
    work = tmp_path / "work"
    work.mkdir()
    src = copy_checkpoint(fixture, work)
    return work, src, snapshot(work)


def _refused(run, tmp_path: Path, work: Path, before: dict, code: int, *names: str) -> None:
    check_contract(run, names=names, refusal_only=True)
    assert run.code == code, str(run)
    assert snapshot(work) == before, f"SRC changed\n{run}"
    assert not (tmp_path / "made").exists() and not litter(tmp_path), f"DST or litter left\n{run}"


# ------------------------------------------------------------------------ 7. a block sized beyond the model
BLOCK_BOMBS = [("fp8", "100000x100000"), ("fp8", "1x1000000000"), ("compressed-tensors-fp8", "100000x100000"),
               ("compressed-tensors-fp8", "1000000000x1")]


@pytest.mark.parametrize("to,block", BLOCK_BOMBS, ids=[f"{t}-{b}" for t, b in BLOCK_BOMBS])
def test_an_absurd_block_size_is_refused_before_it_allocates(tmp_path, to, block):
    """--block-size 100000x100000 tried to allocate 40 GB to 4 EB (exit 70, or a machine out of memory):
    a side above 65536 is a usage error before anything is read, within an address space of 4 GiB."""
    work, src, before = _work(tmp_path)
    run = run_limited("convert", "--to", to, "--block-size", block, src, tmp_path / "made" / "dst")
    _refused(run, tmp_path, work, before, 2, "--block-size", "65536")


BEYOND_EVERY_MODULE = [("fp8", "1024x128", "1024 rows"), ("fp8", "128x1024", "1024 columns"),
                       ("compressed-tensors-fp8", "1024x1024", "1024 rows")]


@pytest.mark.parametrize("to,block,name", BEYOND_EVERY_MODULE, ids=[f"{t}-{b}" for t, b, _ in BEYOND_EVERY_MODULE])
def test_a_block_larger_than_every_module_is_refused(tmp_path, to, block, name):
    """A block no module has (every Linear of the fixture is at most 512 x 512) wrote a config whose
    weight_block_size describes nothing it holds; refused, naming the largest module's size."""
    work, src, before = _work(tmp_path)
    run = run_inprocess("convert", "--to", to, "--block-size", block, src, tmp_path / "made" / "dst")
    _refused(run, tmp_path, work, before, 2, "--block-size", name, "512")


def test_a_block_larger_than_some_modules_is_one_block_over_them(tmp_path):
    """512x512 fits the largest modules (512 x 256 and 256 x 512) and is larger than the attention's
    256 x 256: each of those is one block, one scale, as transformers' FP8Linear sizes its scale
    (ceil(rows / 512) x ceil(cols / 512)), and the run fits in MEMORY_LIMIT."""
    from safetensors.torch import load_file

    work, src, before = _work(tmp_path)
    dst = tmp_path / "made" / "dst"
    run = run_limited("convert", "--to", "fp8", "--block-size", "512x512", src, dst)
    check_contract(run)
    assert run.code == 0, str(run)
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"] == [512, 512]
    tensors = load_file(dst / "model.safetensors")
    assert tuple(tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == (1, 1)
    assert tuple(tensors["model.layers.0.mlp.up_proj.weight_scale_inv"].shape) == (1, 1)
    assert snapshot(work) == before


_ONE_BLOCK = """
import numpy as np
from qconv.formats.compressed_tensors.codec import quantize_fp8
from qconv.formats.fp8.codec import quantize_e4m3

w = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
for big in ((65536, 65536), (1, 65536), (65536, 1)):
    rows, cols = min(big[0], 3), min(big[1], 5)
    for got, want in ((quantize_e4m3(w, *big), quantize_e4m3(w, rows, cols)),
                      (quantize_fp8(w, "bfloat16", *big), quantize_fp8(w, "bfloat16", rows, cols))):
        assert all(np.array_equal(g, h) for g, h in zip(got, want)), big
print("ok")
"""


def test_no_allocation_is_sized_by_the_block():
    """The quantizers padded a module to whole blocks: a 3 x 5 weight in 65536 x 65536 blocks was a 16 GiB
    buffer. A block larger than a module is one block over its rows or columns (the same codes and
    scales as a block of exactly its size), within an address space of 4 GiB."""
    proc = subprocess.run([sys.executable, "-c", _ONE_BLOCK], capture_output=True, text=True, timeout=300,
                          env=child_env(), preexec_fn=_limited())
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ------------------------------------------------------------------------ 8. an option given at its default
GIVEN_AT_DEFAULT = [("mlx", ["--mmproj"], "--mmproj/--no-mmproj"),
                    ("gptq", ["--gguf-float-type", "auto"], "--gguf-float-type"),
                    ("mlx", ["--mmproj-type", "auto"], "--mmproj-type"),
                    ("bnb8", ["--gguf-asym", "q5_0"], "--gguf-asym")]


@pytest.mark.parametrize("to,args,flag", GIVEN_AT_DEFAULT, ids=[f"{t}{a[0]}" for t, a, _ in GIVEN_AT_DEFAULT])
def test_an_option_the_target_does_not_take_is_refused_at_its_default(tmp_path, to, args, flag):
    work, src, before = _work(tmp_path, "llama-gptq-w4g128-actorder")
    run = run_inprocess("convert", "--to", to, *args, src, tmp_path / "made" / "dst")
    _refused(run, tmp_path, work, before, 2, f"{flag}: --to {to} takes no such option")


@pytest.mark.parametrize("to,options", [("mlx", {"mmproj": True}), ("gptq", {"gguf_float_type": "auto"}),
                                        ("gptq", {"gguf_asym": "q5_0", "gguf_float": False})],
                         ids=["mlx-mmproj", "gptq-gguf-float-type", "gptq-gguf-asym"])
def test_an_api_keyword_the_target_does_not_take_is_refused_at_its_default(tmp_path, to, options):
    import qconv
    from qconv.errors import UsageError

    work, src, before = _work(tmp_path, "llama-gptq-w4g128-actorder")
    with pytest.raises(UsageError, match=f"--to {to} takes no such option") as err:
        qconv.convert(src, tmp_path / "made" / "dst", to=to, **options)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    assert snapshot(work) == before and not (tmp_path / "made").exists()


def test_an_option_not_given_is_not_refused():
    """None is "not given" (the target's default): a script may pass every keyword as None."""
    from qconv.formats.core.request import Options, declared

    opts = Options("mlx", **{name: None for name in declared()})
    assert opts.to == "mlx"


# ------------------------------------------------------------------------ 9. the API's arguments, type-checked
def _src():
    return CHECKPOINTS / FP16


API_CASES = {
    "convert-to-none": lambda q, d: q.convert(_src(), d, to=None),
    "convert-to-int": lambda q, d: q.convert(_src(), d, to=3),
    "convert-to-list": lambda q, d: q.convert(_src(), d, to=["gptq"]),
    "convert-source-int": lambda q, d: q.convert(_src(), d, to="gptq", source=3),
    "convert-source-unknown": lambda q, d: q.convert(_src(), d, to="gptq", source="gptq-v9"),
    "convert-progress-int": lambda q, d: q.convert(_src(), d, to="gptq", progress=3),
    "convert-progress-str": lambda q, d: q.convert(_src(), d, to="float16", progress="print"),
    "bnb8-to-gptq-progress": lambda q, d: q.bnb8_to_gptq(CHECKPOINTS / "llama-bnb8", d, progress=[]),
    "dequantize-dtype-none": lambda q, d: q.dequantize(_src(), d, dtype=None),
    "dequantize-progress": lambda q, d: q.dequantize(_src(), d, progress=1.5),
    "validate-device-none": lambda q, d: q.validate(_src(), _src(), device=None),
    "validate-rows-none": lambda q, d: q.validate(_src(), _src(), rows=None),
    "validate-kernels-none": lambda q, d: q.validate(_src(), _src(), kernels=None),
    "validate-samples-none": lambda q, d: q.validate(_src(), _src(), samples=None),
    "validate-seed-none": lambda q, d: q.validate(_src(), _src(), seed=None),
    "validate-progress": lambda q, d: q.validate(_src(), _src(), progress=object()),
    "target-options-int": lambda q, d: q.target_options(3),
    "options-to-none": lambda q, d: q.ConvertOptions(None),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_every_api_argument_of_the_wrong_type_is_a_usage_error(tmp_path, case):
    import qconv
    from qconv.errors import UsageError

    dst = tmp_path / "made" / "dst"
    with pytest.raises(UsageError) as err:
        API_CASES[case](qconv, dst)
    assert err.value.exit_code == 2 and "\n" not in str(err.value) and str(err.value)
    assert not (tmp_path / "made").exists() and not litter(tmp_path)
