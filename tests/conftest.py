import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from qconv.formats.storage.safetensors_header import encode_header

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
CHECKPOINTS = FIXTURES / "checkpoints"
QCONV = str(Path(sys.executable).parent / "qconv")

QUANTIZED = sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "oracle").is_dir())
ALL_CHECKPOINTS = sorted(p.name for p in CHECKPOINTS.iterdir() if p.is_dir())


TERMINATING = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP"))


def child_signals(*ignored: signal.Signals):
    """A preexec_fn that gives the child the signal dispositions a test means, whatever this suite
    inherited: pytest started in the background by a non-interactive shell (CI, `cmd &` in a script) has
    SIGINT ignored, `nohup` SIGHUP, and a child keeps what it inherits. Every one of SIGINT, SIGTERM and
    SIGHUP is set to its default, those in ``ignored`` to SIG_IGN."""
    def preexec():
        for sig in TERMINATING:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    return preexec


# Variables that would change what a qconv child prints or does, whatever the test means: Python's warning
# switches (PYTHONWARNINGS=default prints torch's DeprecationWarnings beside qconv's one error line) and
# qconv's own debug and test hooks (QCONV_DEBUG, QCONV_TEST_SIGNAL). A test that wants one sets it.
_SCRUBBED = ("PYTHONWARNINGS", "PYTHONDEVMODE", "TORCHINDUCTOR_CACHE_DIR")


def is_card(path) -> bool:
    """A model card qconv writes with every output (convert/card.py: README.md and its picture): it names
    the run's SRC, DST and command and hashes their files, so outputs of different runs compare without it."""
    return Path(path).name in ("README.md", "qconv-error.png")


def child_env(**extra: str) -> dict:
    """The environment of a qconv child: this one without _SCRUBBED and QCONV_* variables, plus extra."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED and not k.startswith("QCONV_")}
    return {**env, **extra}


def run_qconv(*args, check=None):
    """Run the installed console script, as a user does (at a terminal: default signal dispositions, no
    debugging or warning switches)."""
    proc = subprocess.run([QCONV, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=child_env(), preexec_fn=child_signals())
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


SPM = FIXTURES / "tokenizers" / "llama-spm"     # a SentencePiece tokenizer.model (fixtures/make_spm_tokenizer.py)


# Strings a SentencePiece GGUF's tokenizer (llama.cpp's, or the one qconv rebuilds) must split as sentencepiece does: leading / trailing / runs of
# spaces (the dummy prefix, no collapsing), accents and other scripts the fixture's vocabulary has, characters
# it lacks (byte fallback: emoji, a 4-byte letter, rare CJK), digits, newlines and tabs, text that looks like
# a special token (parsed as text, special=False), the empty string.
SPM_STRINGS = ["Hello world", " leading space", "  two leading spaces", "trailing space ", "café naïve Zürich",
               "東京 and 大阪", "emoji 🦙 and 𝔘𝔫𝔦", "rare: ǅ ʬ ⅞ 龘", "digits 0123456789 and 3.14159",
               "line one\nline two\n\nthree", "tabs\tand  double  spaces", "<s> looks special </s>", "", "x"]


def spm_folder(dst: Path, *, tokenizer_json: dict | None = None, model: bytes | None = None, **config) -> Path:
    """llama-gptq-w8g128's weights and config (config.json updated by ``config``) with the SentencePiece
    fixture's tokenizer.model (or ``model``) and tokenizer_config.json instead of its own tokenizer. A
    larger vocab_size pads the embeddings and lm_head with zero rows to it, as producers pad a vocabulary
    (a config whose vocab_size the embeddings contradict is refused: issue 35)."""
    shutil.copytree(CHECKPOINTS / "llama-gptq-w8g128", dst, ignore=shutil.ignore_patterns("tokenizer*", "oracle"))
    (dst / "tokenizer.model").write_bytes(model if model is not None else (SPM / "tokenizer.model").read_bytes())
    shutil.copy(SPM / "tokenizer_config.json", dst)
    if config:
        doc = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**doc, **config}, indent=2))
    if "vocab_size" in config:
        import torch
        from safetensors.torch import load_file, save_file

        tensors = load_file(dst / "model.safetensors")
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = tensors[name]
            tensors[name] = torch.cat([t, t.new_zeros(config["vocab_size"] - t.shape[0], t.shape[1])])
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if tokenizer_json is not None:
        (dst / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    return dst


def one_error(proc, code, *needles):
    """The run exited ``code`` with exactly one ``qconv: error:`` line holding every needle; returns it."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconv: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in proc.stderr and "[(" not in proc.stderr
    return lines[0]


def inspect_json(path):
    proc = run_qconv("inspect", "--json", path, check=0)
    return json.loads(proc.stdout)


def load_tensors(folder: Path) -> dict:
    """Every tensor of a folder's safetensors shards, as torch tensors (safetensors' own loader)."""
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def convert_component(src, dst, target, *args) -> dict:
    """`qconv convert --json SRC DST --to TARGET ARGS...`, which must succeed; its one component's summary."""
    import json

    proc = run_qconv("convert", "--json", src, dst, "--to", target, *args)
    assert proc.returncode == 0, proc.stderr
    (comp,) = json.loads(proc.stdout)["components"]
    return comp


def tensor_bytes(t):
    """A torch tensor's bytes, as a flat uint8 tensor (any dtype, float8 included)."""
    import torch

    return t.contiguous().view(-1).view(torch.uint8)


def assert_same_tensors(ours: Path, theirs: Path, drop=()) -> None:
    """Every tensor of the two folders, byte for byte (names, dtypes, shapes, bytes), but those of theirs
    whose leaf name is in drop."""
    import torch

    a = load_tensors(ours)
    b = {k: v for k, v in load_tensors(theirs).items() if k.rsplit(".", 1)[-1] not in drop}
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
              or not torch.equal(tensor_bytes(a[k]), tensor_bytes(b[k]))]
    assert not differ, differ[:5]


def copy_checkpoint(name, dst: Path) -> Path:
    target = dst / name
    shutil.copytree(CHECKPOINTS / name, target, ignore=shutil.ignore_patterns("oracle"))
    return target


def released_layout(src: Path, dst: Path) -> Path:
    """A copy of a Qwen3-VL-MoE folder saved by transformers (its own fused [E, 2I, H] / [E, H, I]) with its
    experts as the released checkpoints store them (Qwen/Qwen3-VL-30B-A3B-Instruct: gate_up_proj [128, 2048,
    1536], down_proj [128, 768, 2048]): each fused tensor, and an FP8 one's block-scale grid
    (`*_scale_inv`, which vLLM's loader transposes with it), transposed per expert. transformers'
    conversion_mapping.py ("qwen3_vl_moe": Transpose(1, 2, check_dims=True)) is the inverse it applies on
    load (tests/formats/core/test_released_experts.py checks it). A tokenizer is added where the folder has
    none (a GGUF needs one: qwen3vl-bnb8-skipvisual's)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("oracle"))
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for k in tensors:
            if k.endswith(("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_scale_inv",
                           "experts.down_proj_scale_inv")):
                tensors[k] = tensors[k].transpose(1, 2).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    if not (dst / "tokenizer.json").exists():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(CHECKPOINTS / "qwen3vl-bnb8-skipvisual" / name, dst)
    return dst


def write_sparse_safetensors(path: Path, tensors, metadata=None) -> int:
    """A real safetensors header followed by a hole of the right size: no disk blocks for the data."""
    header, data_size = encode_header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(header)
    os.truncate(path, len(header) + data_size)
    return len(header) + data_size


# Consumers that live outside .venv (bin/setup test / vllm build them): a test marked
# @pytest.mark.consumer(PATH, WHAT) needs PATH. Missing, it is skipped with the reason where a developer
# runs pytest by hand, but under bin/test (and so CI), which exports QCONV_REQUIRE_CONSUMERS=1 after
# building them, it FAILS: a consumer check that did not run is never reported as passing.
REQUIRE_CONSUMERS = os.environ.get("QCONV_REQUIRE_CONSUMERS") == "1"


def pytest_runtest_setup(item):
    for mark in item.iter_markers("consumer"):
        path, what = mark.args
        if not Path(path).exists():
            message = f"{what} is not installed ({path} is missing; bin/setup test / bin/setup vllm build it)"
            if REQUIRE_CONSUMERS:
                pytest.fail(message + ", but bin/test requires every consumer check to run", pytrace=False)
            pytest.skip(message)


def compare_logprobs(got, ref, tolerance: float) -> dict:
    """Two runs' logits [positions, vocab] compared as next-token log-probabilities: the max |difference|
    over each position's top 5 tokens in ``ref``; top-1 agreement; and the top-1 flips that are not
    near-ties (``ref``'s gap between its top token and ``got``'s exceeds ``tolerance``: the tiny random
    fixtures have positions whose two best tokens are 0.00x apart)."""
    import numpy as np

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    a, b = log_softmax(got), log_softmax(ref)
    top = np.argsort(-b, axis=1)[:, :5]
    diff = np.abs(np.take_along_axis(a, top, 1) - np.take_along_axis(b, top, 1)).max()
    ours, theirs = a.argmax(1), b.argmax(1)
    rows = np.arange(len(ours))
    gaps = b[rows, theirs] - b[rows, ours]
    return {"max_abs_logprob_diff": float(diff), "top1": float((ours == theirs).mean()),
            "real_flips": int((gaps > tolerance).sum())}


SLOW = REPO / "tests" / "slow.txt"


def _slow_tests() -> set[tuple[str, str]]:
    """(test file relative to the repository, function) of every entry of tests/slow.txt."""
    out = set()
    for line in SLOW.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path, _, function = line.strip().partition("::")
            out.add((path, function))
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark tests/slow.txt's functions `slow` (the unit tier, bin/test unit, leaves them out); an entry
    naming a function its file does not define is an error, so the list cannot go stale silently."""
    slow = _slow_tests()
    modules = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        rel = Path(module.__file__).resolve().relative_to(REPO).as_posix()
        modules[rel] = module
        if (rel, item.originalname) in slow:
            item.add_marker(pytest.mark.slow)
    stale = [f"{path}::{function}" for path, function in sorted(slow)
             if path in modules and not hasattr(modules[path], function)]
    if stale:
        raise pytest.UsageError(f"tests/slow.txt names test functions that do not exist: {', '.join(stale)}")


@pytest.fixture
def tmp_checkpoint(tmp_path):
    return lambda name: copy_checkpoint(name, tmp_path)


class VllmCrashRetried(UserWarning):
    """vLLM's CPU build crashed (a native abort, no Python exception) loading a model and the retry ran:
    a crash is retried once and reported here, never counted as an answer; a wrong answer is never retried."""


def report_crashes(name: str, entry: dict) -> None:
    for side in ("quantized", "float"):
        for crash in entry.get(f"{side}_crashes", []):
            warnings.warn(VllmCrashRetried(f"{name}: vLLM crashed loading the {side} model (exit "
                                           f"{crash['exit_status']}: {crash['error']}); the retry loaded it"))


def requantize_gguf(src: Path, dst: Path, which, qtype_name: str = "Q5_1") -> dict:
    """A copy of the GGUF at src written by gguf-py's own writer and quantizer (llama.cpp's library), the
    tensors which(name, type) picks requantized to qtype_name (a type qconv never writes): its metadata
    and every other tensor as they are. Returns {tensor: gguf-py's decoding of what was written}."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    written = {}
    for t in reader.tensors:
        if which(t.name, t.tensor_type.name):
            q = gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32), qtype)
            writer.add_tensor(t.name, q, raw_dtype=qtype)
            written[t.name] = gguf.quants.dequantize(q, qtype)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def split_gguf(src: str, folder: Path, size: str = "700KB") -> tuple[Path, Path]:
    """The fixture src as one GGUF (folder/one.gguf) and as llama.cpp's split files past --max-shard-size
    (folder/m-0000i-of-0000N.gguf), both written by `qconv convert --to gguf`: (the one file, the first split)."""
    run_qconv("convert", CHECKPOINTS / src, folder / "one.gguf", "--to", "gguf", check=0)
    proc = run_qconv("convert", "--json", CHECKPOINTS / src, folder / "m.gguf", "--to", "gguf", "--max-shard-size",
                     size, check=0)
    (comp,) = json.loads(proc.stdout)["components"]
    assert len(comp["shards"]) > 1 and not (folder / "m.gguf").exists(), comp["shards"]
    return folder / "one.gguf", folder / comp["shards"][0]


def assert_same_tokenizer(folder: Path, fixture: str) -> None:
    """The tokenizer files qconv rebuilt in `folder` (from a GGUF's metadata) give the fixture's own
    tokenizer's ids on test strings, special tokens and unknown characters included, and its bos / eos."""
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(CHECKPOINTS / fixture)
    for text in ["hello world, this is a test 123", "  The quick brown fox\n\njumps!", "<s>ab</s> é 漢字"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)


# ---------------------------------------------------------------------------------------------------
# Helpers shared across folders: by the family tests tests/formats/bnb/test_bnb.py and
# tests/formats/gptq/test_gptq.py, and by tests/formats/core/test_properties.py,
# tests/verbs/test_inspect_fixtures.py and tests/verbs/test_convert.py.

# Property tests: derandomize, no example database: the same examples on every machine and every run,
# whatever the environment (a CI variable would otherwise switch Hypothesis's profile) and the working
# folder hold.
PROPS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def random_weights(out, inp, dtype, seed):
    """A seeded random [out, inp] weight with heavy-tailed columns, as the torch dtype named ``dtype``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[:, torch.randint(0, inp, (max(1, inp // 16),), generator=g)] *= 20     # heavy-tailed columns
    return w.to(getattr(torch, dtype))


def read_only_module(path):
    """qconv's read (float16) of the one quantized module of the checkpoint at path."""
    from qconv.formats.core.detect import detect
    from qconv.formats.core.reader import read_module
    from qconv.formats.storage.checkpoint import open_target

    comp = open_target(path).components[0]
    det = detect(comp)
    (m,) = det.modules
    return read_module(comp, det, m, "float16")


def inspect_report(name):
    """`qconv inspect --json` of the fixture ``name``, which names its path."""
    result = inspect_json(CHECKPOINTS / name)
    assert result["path"] == str(CHECKPOINTS / name)
    return result


def provenance(name):
    """The fixture's oracle/PROVENANCE.json: its producer and the settings it was asked for."""
    return json.loads((CHECKPOINTS / name / "oracle" / "PROVENANCE.json").read_text())


def run_convert(src, dst, *args):
    """`qconv convert SRC DST ARGS...` (`qconv bnb8-to-gptq ARGS... SRC DST` where args start with that
    verb), which must succeed."""
    proc = run_qconv(*args, src, dst, check=0) if args and args[0] == "bnb8-to-gptq" else \
        run_qconv("convert", src, dst, *args, check=0)
    return proc


def model_logits(path, ids, vlm=False, **kwargs):
    """The model at path, loaded by transformers on the CPU, and its float32 logits for ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    model = cls.from_pretrained(path, device_map="cpu", **kwargs)
    with torch.no_grad():
        return model, model(input_ids=ids).logits.float()


# The fixtures are the producers' files and the source of every test: a test that writes beside them (a
# report, a log, a converted folder) changes what later tests and a rerun read. The tree is listed
# (path, size, mtime) when the session starts and compared when it ends; any change fails the session,
# naming the paths. Only the controlling process checks (pytest-xdist's workers share the tree).
def _fixture_listing() -> dict[str, tuple[int, int]]:
    out = {}
    for path in FIXTURES.rglob("*"):
        if "__pycache__" in path.parts:
            continue
        st = path.lstat()
        out[path.relative_to(REPO).as_posix()] = (st.st_size, st.st_mtime_ns) if path.is_file() else (0, 0)
    return out


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        session.config._qconv_fixtures = _fixture_listing()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_qconv_fixtures", None)
    if before is None:
        return
    after = _fixture_listing()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        shown = ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
        session.config.get_terminal_writer().line(
            f"tests changed fixtures/ (tests must write under tmp_path, never beside the fixtures): {shown}",
            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# A llama GGUF of the fixtures' shape (llama-fp16: 4 query, 2 key-value heads) decoded by llama.cpp's own
# decoder, gguf-py (tests/formats/gguf/test_gguf_offsets.py, tests/consumers/test_mlx.py)
GGUF_HEADS = {"attn_q": 4, "attn_k": 2}          # llama-fp16's query and key-value heads
GGUF_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def gguf_hf_name(name):
    """blk.N.<kind>.weight -> model.layers.N.<module>, output.weight -> lm_head (None: not a Linear)."""
    if name == "output.weight":
        return "lm_head"
    parts = name.split(".")
    if parts[0] != "blk" or parts[2] not in GGUF_HF:
        return None
    return f"model.layers.{parts[1]}.{GGUF_HF[parts[2]]}"


def gguf_hf_rows(name, w):
    """llama's q / k rows back in Hugging Face order (the rotary permutation undone)."""
    heads = GGUF_HEADS.get(name.split(".")[2]) if name.startswith("blk.") else None
    if heads is None:
        return w
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_decoding(path):
    """{module: (ggml type, float32 weight in Hugging Face row order)}: llama.cpp's own decoder (gguf-py)."""
    import gguf
    import numpy as np

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        module = gguf_hf_name(t.name)
        if module is not None:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(t.shape[::-1].tolist())
            out[module] = (t.tensor_type.name, gguf_hf_rows(t.name, w))
    return out


def gguf_tensors(path):
    """{tensor: (ggml type, its bytes)} of a GGUF file, as gguf-py reads it."""
    import gguf
    import numpy as np

    return {t.name: (t.tensor_type, np.asarray(t.data).view(np.uint8).tobytes()) for t in gguf.GGUFReader(path).tensors}
