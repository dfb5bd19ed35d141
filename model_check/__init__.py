"""The model-level check (`qconv validate A B --model`, `convert --check-model`): how far B is from A end
to end, as users measure a quant (llama.cpp's `llama-perplexity --kl-divergence`), without a logits file.

Both checkpoints run on one text (the bundled TEXT, public domain, or the caller's), tokenized by A's own
tokenizer (BOS and the model's special tokens as its tokenizer adds them; at most MAX_TOKENS tokens, and no
more than A's context), and at every position B's next-token distribution is compared with A's:

    KL(P_A || P_B) = sum_v P_A(v) (log P_A(v) - log P_B(v))     (mean, 99th percentile and maximum)
    top-1 agreement: the share of positions where both put the same token first
    perplexity of each: exp of the mean negative log-likelihood of the text's next tokens

in float64 from each engine's float32 logits. A always runs in transformers (float32, on qconv's exact
decoding of A: the dequantized folder transformers loads; a GPU where torch has one). B runs in the engine
its format declares (formats/core/registry.Engine: llama.cpp for a GGUF, mlx-lm for an MLX folder) where
that engine imports in ``python`` (default: this Python), so the figure is the one its users will see;
else, or with engine="transformers", in transformers like A. A lossless conversion run in transformers gives
a KL of exactly 0 (the same float32 weights, the same arithmetic); in another engine, that engine's own
arithmetic (llama.cpp quantizes activations for its integer dot products) is part of the figure.

Refused, in one line, before any model runs: a pipeline (the check runs language models), A without a
tokenizer, a text that tokenizes to fewer than MIN_TOKENS tokens, a B whose vocabulary differs from A's
(its tokenizer's vocabulary as transformers loads it, a GGUF's from its header, or, where B has no tokenizer,
its logits' width once it has run). Both sides are given A's token ids; where B's engine tokenizes the text
otherwise (llama.cpp's tokenizers differ from transformers' on some configurations), the report notes it.
B crashing in its engine or refused by it fails the check (exit 1): its users would see that too.

Memory: one side's model at a time, in float32, in transformers (4 bytes a parameter), or B in its engine
in a process of its own; plus two float32 logit arrays of tokens x vocabulary. Disk: one float32 copy of one
side at a time, dequantized into a temporary folder (TMPDIR) and removed when it has run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..errors import QconvError, UnsupportedFormat, UsageError, ValidationFailed
from ..formats.core.detect import detect
from ..formats.core.registry import dialects_for
from ..formats.storage.checkpoint import Component, open_target
from ..progress import report as report_progress

TEXT = Path(__file__).with_name("text.txt")
RUNNER = Path(__file__).with_name("runner.py")       # run in B's engine's Python: the protocol, no qconv
TEXT_NAME = "the Declaration of Independence (1776; public domain), bundled"
MIN_TOKENS = 64
MAX_TOKENS = 512
MAX_TEXT_BYTES = 1 << 20      # a --text larger than this is refused, not read whole
ENGINES = ("auto", "transformers", "native")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "spiece.model")
MEMORY = ("one side at a time: its float32 model in transformers (4 bytes a parameter) or B in its engine's "
          "own process, plus two float32 logit arrays of tokens x vocabulary; on disk, one side's float32 "
          "copy at a time in a temporary folder")


def check_model(a: str | Path, b: str | Path, *, text: str | Path | None = None, engine: str = "auto",
                python: str | None = None) -> dict:
    """The model-level report of B against A (module docstring). text: a UTF-8 file (default: the bundled
    TEXT); engine: auto (B in its format's engine where it imports in ``python``, else transformers),
    transformers, or native (B's engine, refused where it is not installed)."""
    if engine not in ENGINES:
        raise UsageError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    a, b = Path(a), Path(b)
    ca, cb = _component(a), _component(b)
    words, text_name = _text(text)
    with tempfile.TemporaryDirectory(prefix="qconv-model-check-") as work:
        work = Path(work)
        tok_a = _tokenizer(ca, work / "tokenizer-a")
        if tok_a is None:
            raise UnsupportedFormat("has no tokenizer (tokenizer.json, tokenizer.model, ...): the model-level "
                                    "check tokenizes its text with the model's own", file=a)
        plain = list(tok_a(words, add_special_tokens=False)["input_ids"])
        ids = list(tok_a(words, add_special_tokens=True)["input_ids"])[:_context(ca)]
        if len(ids) < MIN_TOKENS:
            raise UsageError(f"the text tokenizes to {len(ids)} tokens with A's tokenizer; the model-level check "
                             f"needs at least {MIN_TOKENS}", file=text or TEXT)
        _same_vocabulary(tok_a, _tokenizer(cb, work / "tokenizer-b"), b)
        python = python or sys.executable
        runner, why = _engine_for(cb, engine, python)
        notes = [why] if why else []
        report_progress("model check", 0, 2, "models")
        if runner is not None:
            logits_b, info = _run_engine(runner, b, ids, words, work / "engine", python)
            if info["tokens"] != plain:     # said, not refused: both sides are fed A's ids
                at = next((i for i, (x, y) in enumerate(zip(info["tokens"], plain)) if x != y),
                          min(len(plain), len(info["tokens"])))
                notes.append(f"{runner[1].name}'s own tokenizer splits the text otherwise than A's transformers "
                             f"tokenizer (from token {at} on); both models were given A's token ids")
            engine_b = info["version"]
        report_progress("model check", 1, 2, "models")
        logits_a, engine_a = _run_transformers(ca, a, ids, work / "a")
        if runner is None:
            logits_b, engine_b = _run_transformers(cb, b, ids, work / "b")
        report_progress("model check", 2, 2, "models")
    if logits_a.shape[-1] != logits_b.shape[-1]:
        raise UnsupportedFormat(f"its vocabulary is not A's: logits over {logits_b.shape[-1]} tokens, A's over "
                                f"{logits_a.shape[-1]}", file=b)
    digest = hashlib.sha256(words.encode("utf-8")).hexdigest()
    return {"a": str(a), "b": str(b), "engine_a": engine_a, "engine_b": engine_b,
            "notes": notes, "text": text_name, "text_sha256": digest,
            "tokens": len(ids), **compare_logits(logits_a, logits_b, ids), "memory": MEMORY}


def compare_logits(logits_a: np.ndarray, logits_b: np.ndarray, ids: list[int]) -> dict:
    """KL(P_A || P_B) at every position (mean, p99, max), top-1 agreement and both perplexities over the
    text's next tokens, in float64."""
    la = _log_softmax(np.asarray(logits_a, dtype=np.float64))
    lb = _log_softmax(np.asarray(logits_b, dtype=np.float64))
    kl = np.maximum((np.exp(la) * (la - lb)).sum(axis=-1), 0.0)       # >= 0; rounding below 0 is 0
    rows, nxt = np.arange(len(ids) - 1), np.asarray(ids[1:])
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).mean()),
            "perplexity_a": float(np.exp(-la[rows, nxt].mean())), "perplexity_b": float(np.exp(-lb[rows, nxt].mean()))}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _component(path: Path) -> Component:
    target = open_target(path)
    if target.kind == "pipeline":
        raise UnsupportedFormat("is a pipeline: the model-level check runs one language model (give the "
                                "component's folder)", file=path)
    return target.components[0]


def _text(text: str | Path | None) -> tuple[str, str]:
    if text is None:
        return TEXT.read_text(encoding="utf-8"), TEXT_NAME
    path = Path(text)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TEXT_BYTES + 1)
        if len(raw) > MAX_TEXT_BYTES:
            raise UsageError(f"the text is over {MAX_TEXT_BYTES >> 10} KiB; the check reads at most {MAX_TOKENS} "
                             f"tokens of it: give a shorter text", file=path)
        return raw.decode("utf-8"), path.name
    except FileNotFoundError:
        raise UsageError("no such text file", file=path) from None
    except IsADirectoryError:
        raise UsageError("is a folder, not a text file", file=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the text as UTF-8: {exc}", file=path) from None


def _tokenizer(comp: Component, where: Path):
    """The model's own tokenizer as transformers loads it: from its folder, or from the files a container
    makes (a GGUF's tokenizer.json); None where it has none."""
    folder = comp.path if comp.path.is_dir() else None
    if comp.made_files is not None:
        made = comp.made_files()
        if "tokenizer.json" in made:
            where.mkdir(parents=True)
            for name, doc in made.items():
                (where / name).write_text(json.dumps(doc, ensure_ascii=False))
            folder = where
    if folder is None or not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:           # transformers' own refusal, in one line
        raise UnsupportedFormat(f"its tokenizer does not load in transformers: "
                                f"{type(exc).__name__}: {exc}".splitlines()[0], file=comp.path) from None


def _same_vocabulary(tok_a, tok_b, b: Path) -> None:
    if tok_b is None:                  # B's logits' width is compared once it has run
        return
    va, vb = tok_a.get_vocab(), tok_b.get_vocab()
    if va != vb:
        first = min(t for t in set(va) | set(vb) if va.get(t) != vb.get(t))
        raise UnsupportedFormat(f"its vocabulary is not A's ({len(vb)} tokens, A's {len(va)}; first difference: "
                                f"{first!r})", file=b)


def _context(comp: Component) -> int:
    config = comp.config or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    positions = text.get("max_position_embeddings")
    return min(MAX_TOKENS, positions) if isinstance(positions, int) and positions > 0 else MAX_TOKENS


def _engine_for(comp: Component, engine: str, python: str):
    """((dialect, Engine), note) for B's own engine, or (None, note) where B runs in transformers."""
    if engine == "transformers":
        return None, None
    det = detect(comp)
    found = next(((d, d.engine) for d in dialects_for(det.cfg_method) if d.engine is not None), None)
    if found is None:
        return None, None              # a transformers format: its engine is transformers
    if _imports(python, found[1].module):
        return found, None
    why = f"{found[1].name} ({found[1].module}) does not import in {python}"
    if engine == "native":
        raise UsageError(f"cannot run B in its engine: {why}")
    return None, f"{why}: B ran in transformers on qconv's decoding"


def _imports(python: str, module: str) -> bool:
    try:
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=300,
                              stdin=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _run_engine(runner, path: Path, ids: list[int], text: str, work: Path, python: str):
    dialect, engine = runner
    script = Path(sys.modules[type(dialect).__module__].__file__).with_name(engine.script)
    work.mkdir()
    (work / "request.json").write_text(json.dumps({"ids": ids, "text": text, "threads": os.cpu_count()}))
    proc = subprocess.run([python, str(RUNNER), str(script), str(path), str(work)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else -proc.returncode
        raise ValidationFailed(f"{engine.name} crashed running it ({name})", file=path)
    result_file = work / "result.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else \
        {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    if "error" in result:
        raise ValidationFailed(f"{engine.name} could not run it: {result['error']}", file=path)
    return np.load(work / "logits.npy"), result


def _run_transformers(comp: Component, path: Path, ids: list[int], work: Path) -> tuple[np.ndarray, str]:
    """The logits of ids in transformers, float32, on qconv's exact decoding of the checkpoint (dequantized
    into work, removed when it has run)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from transformers.utils import logging as hf_logging

    from ..convert.dequantize import dequantize

    dequantize(path, work, dtype="float32", card=None)
    hf_logging.disable_progress_bar()             # one line of progress is qconv's (progress.report)
    try:
        config = json.loads((work / "config.json").read_text())
        model_class = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            model = model_class.from_pretrained(work, dtype=torch.float32).to(device).eval()
        except Exception as exc:       # transformers' own refusal, in one line
            raise UnsupportedFormat(f"does not load in transformers ({model_class.__name__}): "
                                    f"{type(exc).__name__}: {exc}".splitlines()[0], file=path) from None
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
        del model
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return logits, f"transformers {transformers.__version__} (float32, {device}, qconv's exact decoding)"


def check_or_refusal(a: Path, b: Path, **kwargs) -> dict:
    """check_model for convert --check-model: a refusal (no tokenizer, a crash in B's engine, ...) is
    reported as {"ok": False, "refused": message} so the output and its card are still written, saying so."""
    try:
        return {"ok": True, **check_model(a, b, **kwargs)}
    except QconvError as exc:
        return {"ok": False, "refused": exc.message, "a": str(a), "b": str(b)}
