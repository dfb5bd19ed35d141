"""Shared by the hostile-input sweep (test_sweep.py) and the mutation properties (test_mutations.py):
run qconv in-process as its console script does, snapshot the work folder, check a run's contract
(documented exit, one stderr line naming the file, no traceback or RuntimeWarning, no DST and no litter
after a failure, SRC byte-identical), and check an exit-0 result against the producer's oracle.

The work layout every case uses: ``tmp/work`` holds the (mutated) source and anything beside it that
must stay untouched; DST is ``tmp/made/dst`` (its parent is created by qconv, so a failure must remove it
too); ``tmp/checks`` holds what the checks themselves write (dequantized copies of quantized outputs).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import stat
import struct
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from conftest import CHECKPOINTS, QCONV, child_env, child_signals, copy_checkpoint, load_tensors

DOCUMENTED = {0, 1, 2, 3, 4, 5, 6, 130}
TARGETS = ["gptq", "gptq-v2", "auto-round", "bnb8", "bnb4-nf4", "bnb4-fp4", "float16", "bfloat16", "float32"]
SECRET = "SWEEP-SECRET-MARKER qconv must never carry this"
PICKLE_SUFFIXES = (".bin", ".pkl", ".pt", ".pth", ".ckpt", ".pickle")
# The producer-made oracle of each fixture (the pipeline's text_encoder is qwen3vl-bnb8-skipvisual).
ORACLE_OF = {"pipeline-qwen3vl-bnb8/text_encoder": "qwen3vl-bnb8-skipvisual"}


@dataclass
class Run:
    args: list
    code: int
    out: str
    err: str

    def __str__(self):
        shown = " ".join(str(a) for a in self.args)
        return f"qconv {shown}\n-> exit {self.code}\nstderr: {self.err[-1500:]}\nstdout: {self.out[-800:]}"


def run_inprocess(*args) -> Run:
    """qconv.cli.main in this process: stdout/stderr captured, every warning a subprocess would print
    to stderr recorded and appended to stderr here, SystemExit turned into the exit code.
    An exception escaping main is a bug in main's error mapping and propagates."""
    from qconv.cli import main

    out, err = io.StringIO(), io.StringIO()
    env_debug = os.environ.pop("QCONV_DEBUG", None)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)      # hidden outside __main__ by default
            try:
                main([str(a) for a in args])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if env_debug is not None:
            os.environ["QCONV_DEBUG"] = env_debug
    text = err.getvalue() + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                                    for w in caught)
    return Run(list(args), code, out.getvalue(), text)


def run_subprocess(*args, timeout=120) -> Run:
    """The console script in a child process: for inputs that could hang or read without limit if a
    regression let qconv open them (FIFOs, /dev/zero), which would stall this process."""
    env = child_env()
    try:
        proc = subprocess.run([QCONV, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env,
                              preexec_fn=child_signals())
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"qconv {' '.join(map(str, args))} ran past {timeout} s (hang or unbounded "
                             f"work): stderr {exc.stderr!r}") from None
    return Run(list(args), proc.returncode, proc.stdout, proc.stderr)


# --- the file system ------------------------------------------------------------------------------

def _content(path: str, size: int) -> str:
    """SHA-256 of a file's bytes; above 64 MiB, of its size and data extents, each with its offsets
    (SEEK_DATA / SEEK_HOLE), read 1 MiB at a time: a sparse file (the hostile 1 GiB config.json) costs only
    the bytes it holds, and a write anywhere, into a hole included, allocates data and changes the digest."""
    if size <= 64 << 20:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    h = hashlib.sha256(f"{size};".encode())
    with open(path, "rb") as f:
        fd, pos = f.fileno(), 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:                       # ENXIO: no data past pos
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            h.update(f"{start}:{end};".encode())
            f.seek(start)
            while start < end:
                chunk = f.read(min(1 << 20, end - start))
                if not chunk:
                    break
                h.update(chunk)
                start += len(chunk)
            pos = end
    return h.hexdigest()


def snapshot(root: Path) -> dict:
    """Every entry under root, links not followed: files by content, links by target."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                found[rel] = ("file", _content(p, st.st_size))
            else:
                found[rel] = ("other", stat.S_IFMT(st.st_mode))
    return found


def litter(tmp: Path) -> list[str]:
    """qconv's temporary or old folders anywhere under tmp."""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if ".qconv-" in p.name)


# --- building broken copies of real fixtures ----------------------------------------------------------

def fixture_copy(name: str, work: Path, as_name: str = "model") -> Path:
    """A copy of fixtures/checkpoints/NAME (without its oracle) at work/AS_NAME."""
    return copy_checkpoint(name, work).rename(work / as_name)


def read_raw_header(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def write_raw_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def edit_header(path: Path, fn) -> None:
    """Apply fn to the parsed safetensors header, keeping the data bytes as they are."""
    header, data = read_raw_header(path)
    fn(header)
    write_raw_header(path, header, data)


def edit_tensors(path: Path, fn) -> None:
    """Apply fn to the file's tensors (name -> torch tensor) and save them back as one valid file."""
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_json(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def quant_state_name(tensors: dict, module: str) -> str:
    return next(k for k in tensors if k.startswith(module + ".weight.quant_state."))


def edit_quant_state(path: Path, module: str, fn) -> None:
    """Apply fn to MODULE's bitsandbytes quant_state JSON and store it back as its uint8 tensor."""
    def edit(ts):
        name = quant_state_name(ts, module)
        state = json.loads(bytes(ts[name].numpy()))
        fn(state)
        ts[name] = torch.frombuffer(bytearray(json.dumps(state).encode()), dtype=torch.uint8)
    edit_tensors(path, edit)


def reshard(folder: Path) -> None:
    """Re-save model.safetensors as two shards with a standard index."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --- the run's contract ---------------------------------------------------------------------------------

def check_contract(run: Run, *, names=(), refusal_only=False) -> None:
    """What every run must satisfy, whatever it decided."""
    assert run.code in DOCUMENTED, f"undocumented exit code\n{run}"
    assert "Traceback" not in run.err + run.out, f"traceback\n{run}"
    assert "Warning" not in run.err, f"a Python warning reached stderr\n{run}"
    lines = run.err.splitlines()
    if run.code == 0:
        assert not refusal_only, f"exit 0 on an input no verb may vouch for\n{run}"
        assert all(line.startswith("qconv: warning: ") for line in lines), f"stray stderr\n{run}"
        return
    if run.code == 2 and "Error: " in run.err:          # click's usage errors: its own few lines
        return
    if run.code == 1 and run.args[0] == "validate" and not lines:
        assert "FAILED" in run.out, f"validate exit 1 without FAILED\n{run}"
        return
    assert len(lines) == 1 and lines[0].startswith("qconv: error: "), f"not one 'qconv: error:' line\n{run}"
    for name in names:
        assert name in lines[0], f"the error line does not name {name!r}\n{run}"


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which are not JSON."""
    def bad(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=bad)


# --- exit 0: the result against the producer's oracle ----------------------------------------------------

def _as_f32(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy() if t.is_floating_point() else t.numpy()


def _component_dirs(root: Path) -> dict[str, Path]:
    """'' -> root for a model folder; component name -> folder for a pipeline."""
    if (root / "model_index.json").is_file():
        return {p.name: p for p in sorted(root.iterdir())
                if p.is_dir() and any(p.glob("*.safetensors"))}
    return {"": root}



def _is_quantized_folder(folder: Path) -> bool:
    config = folder / "config.json"
    return config.is_file() and "quantization_config" in json.loads(config.read_text())


def expected_weights(fixture: str) -> dict[str, dict[str, np.ndarray]]:
    """component -> tensor name -> float32 values an exact decoding of the intact fixture gives: the
    producer's own dequantization (oracle/dequant.safetensors) for every quantized module, the stored
    values for every other floating tensor (norms, embeddings, lm_head, biases, unquantized sources)."""
    root = CHECKPOINTS / fixture
    out = {}
    for comp, folder in _component_dirs(root).items():
        key = f"{fixture}/{comp}" if comp else fixture
        oracle_dir = CHECKPOINTS / ORACLE_OF.get(key, key.split("/")[0]) / "oracle"
        oracle = {k: _as_f32(v) for k, v in load_file(oracle_dir / "dequant.safetensors").items()} \
            if oracle_dir.is_dir() else {}
        modules = {k[: -len(".weight")] for k in oracle}
        plain = {k: _as_f32(v) for k, v in load_tensors(folder).items()
                 if v.is_floating_point() and (k.endswith(".bias") or
                                               not any(k.startswith(m + ".") for m in modules))}
        out[comp] = {**plain, **oracle}
    return out


def output_weights(dst: Path, checks: Path) -> dict[str, dict[str, np.ndarray]]:
    """component -> tensor name -> float32 weights of a result folder: as stored for float folders,
    dequantized at float32 by qconv for quantized ones (a decoder the suite checks against every
    producer's oracle), with every integer tensor kept (a float folder must hold none)."""
    out = {}
    for comp, folder in _component_dirs(dst).items():
        if _is_quantized_folder(folder):
            plain = checks / f"dq-{len(list(checks.iterdir())) if checks.exists() else 0}"
            checks.mkdir(exist_ok=True)
            r = run_inprocess("dequantize", "--dtype", "float32", folder, plain)
            assert r.code == 0, f"qconv cannot read back its own output {folder}\n{r}"
            folder = plain
        out[comp] = {k: _as_f32(v) for k, v in load_tensors(folder).items()}
    return out


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    with np.errstate(all="ignore"):
        d = float(np.linalg.norm((got.astype(np.float64) - want.astype(np.float64)).ravel()))
        n = float(np.linalg.norm(want.astype(np.float64).ravel()))
    return d / n if n else (0.0 if d == 0 else math.inf)


LOSSLESS_REL = 4e-3        # code kept: only scale storage (bf16 2^-9 on average) and the oracle's fp16
LOSSLESS_ELEMENT = 2**-9  # per element, of |w| plus its row's max |w|: one int8 step (2^-7 of it) is above
LOSSY_MARGIN = 0.02        # a requantized module may differ by what convert reported, plus this
LOSSY_CAP = 0.6            # above this a "requantized" module is not the source's layer any more


def requantized_errors(run: Run, dst: Path) -> dict[str, dict[str, float]]:
    """component -> module -> the relative error convert reported for each requantized module."""
    if run.args[0] not in ("convert", "bnb8-to-gptq"):
        return {}
    pipeline = (dst / "model_index.json").is_file()
    return {(c["component"] if pipeline else ""): {r["module"]: r["rel_frobenius"] for r in c.get("layers", [])}
            for c in strict_json(run.out)["components"]}


def check_output(run: Run, fixture: str, dst: Path, checks: Path, *, expected=None) -> None:
    """An exit-0 result of a writing verb: every tensor of the intact fixture is in it with the values
    the producer's oracle gives (within the scale storage rounding, or the error convert reported for a
    requantized module), nothing integer is left in a float folder, every file is a regular file,
    no pickle and nothing from outside SRC was carried."""
    for p in dst.rglob("*"):
        assert stat.S_ISREG(os.lstat(p).st_mode) or stat.S_ISDIR(os.lstat(p).st_mode), f"{p} is not a file\n{run}"
        assert not p.name.lower().endswith(PICKLE_SUFFIXES), f"pickle {p} carried\n{run}"
        if p.is_file() and p.stat().st_size < 1 << 20:
            assert SECRET.encode() not in p.read_bytes(), f"{p} holds a file from outside SRC\n{run}"
    lossy = requantized_errors(run, dst)
    want_all = expected if expected is not None else expected_weights(fixture)
    got_all = output_weights(dst, checks)
    assert sorted(got_all) == sorted(want_all), f"components {sorted(got_all)} != {sorted(want_all)}\n{run}"
    for comp, want in want_all.items():
        got = got_all[comp]
        ints = [k for k, v in got.items() if not np.issubdtype(v.dtype, np.floating)]
        assert not ints, f"{comp}: integer tensors in a float result: {ints[:5]}\n{run}"
        missing = sorted(set(want) - set(got))
        assert not missing, f"{comp}: tensors missing from the result: {missing[:5]}\n{run}"
        for name, w in want.items():
            g = got[name]
            assert g.shape == w.shape, f"{comp}: {name}: shape {g.shape} != {w.shape}\n{run}"
            assert np.isfinite(g).all() == np.isfinite(w).all(), f"{comp}: {name}: non-finite values\n{run}"
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            reported = lossy.get(comp, {}).get(module)
            bound = LOSSLESS_REL if reported is None else min(LOSSY_CAP, reported + LOSSY_MARGIN)
            err = rel_error(g, w)
            assert err <= bound, (f"{comp}: {name}: exit 0 but relative error {err:.3g} against the "
                                  f"oracle (bound {bound:.3g}{'' if reported is None else ', requantized'})\n{run}")
            if reported is None and w.size:             # kept codes: every element, not just the norm
                with np.errstate(all="ignore"):
                    row_max = np.abs(w).max(axis=-1, keepdims=True) if w.ndim else np.abs(w)
                    off = np.abs(g - w) > LOSSLESS_ELEMENT * (np.abs(w) + row_max)
                assert not off.any(), (f"{comp}: {name}: exit 0 but {int(off.sum())} elements off the oracle, "
                                       f"first at {np.argwhere(off)[0].tolist()}\n{run}")

