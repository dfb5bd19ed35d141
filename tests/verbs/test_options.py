"""The one options model (formats/core/request.py; its declarations formats/core/options.py): the targets' declarations are `qconv convert`'s flags,
`qconv.convert`'s keywords and `qconv.target_options()`; --block-size is one spelling with each target's
own meaning; --blocksize / blocksize= still work, with a warning."""

from __future__ import annotations

import inspect as pyinspect
import pickle
import warnings

import pytest

import qconv
from conftest import CHECKPOINTS
from qconv.errors import UsageError
from qconv.formats.core.request import Options, declared
from qconv.formats.core.registry import file_targets, targets

SRC = CHECKPOINTS / "llama-bnb4-fp4"


def _cli(capsys, *args) -> tuple[int, str, str]:
    from qconv.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def _files(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_every_declared_option_is_a_flag_a_keyword_and_listed(capsys):
    code, out, _ = _cli(capsys, "convert", "--help")
    assert code == 0
    params = pyinspect.signature(qconv.convert).parameters
    listed = qconv.target_options()
    for name, decls in declared().items():
        assert decls[0][0].flag.split("/")[0] in out, name
        assert params[name].kind is params[name].KEYWORD_ONLY and params[name].default is None    # not given
        assert [d["default"] for d in listed[name]] == [o.default for o, _ in decls]
        assert sorted(t for d in listed[name] for t in d["targets"]) == sorted(t for _, names in decls for t in names)
    for t in [t for t in targets() if not t.internal] + list(file_targets()):
        assert list(qconv.target_options(t.name)) == [o.name for o in t.options], t.name
    assert qconv.target_options("float16") == {}


def test_block_size_is_each_targets_own_block():
    assert Options("bnb4-nf4", block_size="128").block_size == 128
    assert Options("bnb4-nf4", block_size=256).block_size == 256
    assert Options("fp8", block_size="64x128").block_size == (64, 128)
    assert Options("compressed-tensors-fp8", block_size=(128, 128)).block_size == (128, 128)
    with pytest.raises(UsageError, match=r"block_size \(--block-size\) '128x128' is not one of 32, 64, "):
        Options("bnb4-nf4", block_size="128x128")
    with pytest.raises(UsageError, match="is not a 2-D block size for this target: use ROWSxCOLS"):
        Options("fp8", block_size=64)
    with pytest.raises(UsageError, match="--block-size: --to gptq takes no such option"):
        Options("gptq", block_size=64)


def test_the_old_spelling_blocksize_works_and_warns(tmp_path, capsys):
    code, _, err = _cli(capsys, "convert", SRC, tmp_path / "new" / "out", "--to", "bnb4-nf4", "--block-size", "128")
    assert code == 0 and "deprecated" not in err
    code, _, err = _cli(capsys, "convert", SRC, tmp_path / "old" / "out", "--to", "bnb4-nf4", "--blocksize", "128")
    assert code == 0
    assert [line for line in err.splitlines() if "blocksize" in line] == [
        "qconv: warning: --blocksize is deprecated: use --block-size"]
    with pytest.warns(DeprecationWarning, match="blocksize= is deprecated: use block_size="):
        qconv.convert(SRC, tmp_path / "api" / "out", to="bnb4-nf4", blocksize=128)
    want = _files(tmp_path / "new" / "out")              # one DST name: the model card names it
    assert _files(tmp_path / "old" / "out") == want and _files(tmp_path / "api" / "out") == want
    assert qconv.inspect(SRC).components[0]["blocksize"] == 64
    assert qconv.inspect(tmp_path / "new" / "out").components[0]["blocksize"] == 128     # the option took effect
    # the old and the new spelling disagreeing is refused, one line, nothing written
    code, _, err = _cli(capsys, "convert", SRC, tmp_path / "both", "--to", "bnb4-nf4", "--blocksize", "64",
                        "--block-size", "128")
    assert code == 2 and err.count("\n") == 1 and "disagree" in err and not (tmp_path / "both").exists()


def test_a_refused_option_is_one_line_even_in_its_old_spelling(tmp_path, capsys):
    code, _, err = _cli(capsys, "convert", SRC, tmp_path / "x.gguf", "--to", "gguf", "--blocksize", "64")
    assert code == 2 and err.splitlines() == [
        "qconv: error: --block-size: --to gguf takes no such option; its options are --bits, --gguf-asym, "
        "--gguf-float, --gguf-float-type, --mmproj/--no-mmproj, --mmproj-type"]


def test_the_model_checks_names_and_values():
    with pytest.raises(UsageError, match="'bitz' is not an option of qconv.convert"):
        Options("gptq", bitz=4)
    with pytest.raises(UsageError, match=r"to \(--to\) 'gptq-v9' is not one of"):
        Options("gptq-v9")
    with pytest.raises(UsageError, match=r"--bits 5: --to gguf requantizes to Q4_0 \(--bits 4\) or Q8_0"):
        Options("gguf", bits=5)
    with pytest.raises(UsageError, match=r"group_size \(--group-size\) 0 is not a group size"):
        Options("gptq", group_size=0)
    # an option another target declares is refused when given, its default value included (issue 47);
    # None is "not given" (a script may pass every keyword as None)
    with pytest.raises(UsageError, match="--gguf-asym: --to gptq takes no such option"):
        Options("gptq", gguf_asym="q5_0", gguf_float=False)
    assert Options("gptq", gguf_asym=None, gguf_float=None).bits is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = Options("gguf", bits=4, gguf_asym="q4_1")
    assert (opts.bits, opts.gguf_asym, opts.gguf_float, opts.gguf_float_type) == (4, "Q4_1", False, "auto")
    # another target's option is no attribute of this one (issue 46: a writer reads only what its target
    # declares); code serving every target reads it as "not given"
    for other in ("double_quant", "block_size"):
        with pytest.raises(AttributeError, match=f"--to gguf does not declare the option '{other}'"):
            getattr(opts, other)
        assert opts.get(other) is None
    with pytest.raises(AttributeError):
        opts.bits = 8


def test_the_model_travels_to_the_jobs_workers():
    opts = Options("bnb4-nf4", block_size=128, double_quant=False, jobs=2)
    back = pickle.loads(pickle.dumps(opts))
    assert back == opts and (back.block_size, back.double_quant, back.jobs, back.to) == (128, False, 2, "bnb4-nf4")
    changed = opts.replace(to="bnb4-fp4", block_size=64)
    assert (changed.to, changed.block_size, opts.block_size) == ("bnb4-fp4", 64, 128)
