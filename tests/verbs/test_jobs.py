"""--jobs N: output shards written by N worker processes (convert/parallel.py). The same bytes and the same
summary whatever N; a worker's failure is the run's failure, as one process reports it; an interrupted or
killed run leaves no worker and nothing at DST."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CHECKPOINTS, QCONV, child_env, child_signals, copy_checkpoint, one_error, run_qconv

SHARD = "300KB"          # the fixtures are 2-6 MB: 4 to 12 shards each


def _digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _summary(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    data.pop("seconds")
    data.pop("destination")
    return data


CASES = [
    # lossy: requantized layers' errors and W8A8's activation cost in the summary
    ("llama-fp8-block", ["convert", "--to", "compressed-tensors-w8a8"]),
    # codes kept: scale rounding counted per module, once, though a module's tensors span two shards
    ("llama-bnb8", ["bnb8-to-gptq"]),
    # MoE experts, e4m3 -> int4 with the search
    ("qwen3moe-fp8-block", ["convert", "--to", "compressed-tensors"]),
    ("llama-ct-nvfp4a16", ["dequantize", "--dtype", "bfloat16"]),
    # a float source quantized data-free, with the fused-group global scale of NVFP4 (Target.share)
    ("llama-fp16", ["convert", "--to", "compressed-tensors-nvfp4"]),
    # MLX: a scale dtype planned per module, experts stacked into switch_mlp tensors across shards
    ("qwen3moe-fp8-block", ["convert", "--to", "mlx"]),
]


@pytest.mark.parametrize("name,verb", CASES, ids=[c[0] + "-" + c[1][-1] for c in CASES])
def test_same_bytes_and_summary_whatever_the_jobs(tmp_path, name, verb):
    results = {}
    for jobs in (1, 2, 3):
        out = tmp_path / f"jobs{jobs}" / "out"           # one DST name: the model card names it
        proc = run_qconv(verb[0], "--json", CHECKPOINTS / name, out, *verb[1:], "--max-shard-size", SHARD,
                         "--jobs", jobs)
        results[jobs] = (_digests(out), _summary(proc))
    shards = [n for n in results[1][0] if n.endswith(".safetensors")]
    assert len(shards) >= 4, shards                  # the workers really split the work
    assert results[1] == results[2] == results[3]


def test_default_jobs_are_the_cores_and_write_the_same(tmp_path):
    """No --jobs: the machine's cores (here 2 or more in CI; 1 writes in-process), same bytes as --jobs 1."""
    a, b = tmp_path / "a" / "out", tmp_path / "b" / "out"      # one DST name: the model card names it
    run_qconv("dequantize", CHECKPOINTS / "llama-fp8-block", a, "--max-shard-size", SHARD, "--jobs", 1, check=0)
    run_qconv("dequantize", CHECKPOINTS / "llama-fp8-block", b, "--max-shard-size", SHARD, check=0)
    assert _digests(a) == _digests(b)


def _last_shard_module(folder: Path) -> str:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return sorted(index["weight_map"].items(), key=lambda kv: kv[1])[-1][0]


def test_a_worker_failure_is_the_runs_one_line_error(tmp_path):
    """A scale that is NaN in a module that only a worker decodes (the last shard's): the same one-line
    error, exit code and nothing written, as with one process."""
    import torch
    from safetensors.torch import load_file, save_file

    src = copy_checkpoint("llama-fp8-block", tmp_path)
    f = next(src.glob("*.safetensors"))
    tensors = load_file(f)
    name = sorted(k for k in tensors if k.endswith("weight_scale_inv"))[-1]   # the last module's
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = torch.nan
    save_file(tensors, f, metadata={"format": "pt"})
    lines = {}
    for jobs in (1, 3):
        out = tmp_path / f"out{jobs}"
        proc = run_qconv("convert", src, out, "--to", "compressed-tensors-w8a8", "--max-shard-size", SHARD,
                         "--jobs", jobs)
        lines[jobs] = one_error(proc, 4, name.rsplit(".", 1)[0])
        assert not out.exists()
    assert lines[1] == lines[3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-fp8-block"]


def _state(pid: int) -> str | None:
    """A process's state letter (R, S, T, Z, ...), None when it is gone (Linux /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _live_workers(mark: str) -> list[int]:
    """The live qconv worker processes (their command line runs parallel.child_main) of the run started
    with JOBS_TEST_MARK=mark in its environment, which workers inherit: not another run's on the machine."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline, environ = (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()
            except OSError:
                continue
            if b"parallel import child_main" in cmdline and f"JOBS_TEST_MARK={mark}".encode() in environ.split(b"\0") \
                    and _state(int(entry.name)) not in (None, "Z"):
                out.append(int(entry.name))
    return out


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_interrupted_run_stops_its_workers(tmp_path, sig):
    """The signal reaches qconv once a worker has written its first tensor (QCONV_TEST_SIGNAL fires in the
    parent on the first tensor a worker reports): exit 130, no worker left, nothing at DST."""
    out = tmp_path / "out"
    proc = subprocess.Popen([QCONV, "convert", CHECKPOINTS / "qwen3moe-fp8-block", out, "--to",
                             "compressed-tensors", "--max-shard-size", "100KB", "--jobs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(QCONV_TEST_SIGNAL=f"tensor-written:{sig}", JOBS_TEST_MARK=str(tmp_path)),
                            preexec_fn=child_signals())
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and err.strip() == "qconv: interrupted", err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert _live_workers(str(tmp_path)) == []


def test_workers_die_with_a_killed_qconv(tmp_path):
    """SIGKILL cannot be caught: the workers die with qconv (PR_SET_PDEATHSIG; without it, at their next
    message into the closed pipe, after the tensor they are writing) instead of writing on into its
    staging folder, which the next run to the same DST removes."""
    out = tmp_path / "out"
    proc = subprocess.Popen([QCONV, "convert", CHECKPOINTS / "qwen3moe-fp8-block", out, "--to",
                             "compressed-tensors", "--max-shard-size", "100KB", "--jobs", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env(QCONV_TEST_SIGNAL="tensor-written:SIGSTOP", JOBS_TEST_MARK=str(tmp_path)),
                            preexec_fn=child_signals())
    deadline = time.monotonic() + 120
    while _state(proc.pid) != "T" and time.monotonic() < deadline:   # stopped at a worker's first tensor
        time.sleep(0.05)
    workers = _live_workers(str(tmp_path))
    assert workers, "no worker process was running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while _live_workers(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_workers(str(tmp_path)) == []
    assert not out.exists()
    run_qconv("convert", CHECKPOINTS / "llama-bnb8", out, "--to", "gptq", check=0)   # the stale folder goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _killed(comp):
    """A worker's plan function that dies as the OOM killer kills (pickled by name: this module)."""
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_is_named(tmp_path):
    """A worker that dies without a word (the kernel's OOM killer) fails the run, naming its shards."""
    from qconv.convert.engine import write_shard
    from qconv.convert.parallel import Replan, write_shards
    from qconv.errors import OutputError
    from qconv.formats.storage.checkpoint import open_target
    from qconv.formats.storage.safetensors_writer import plan_shards

    comp = open_target(CHECKPOINTS / "llama-bnb8").components[0]
    shards = plan_shards([(n, i.dtype, i.shape) for n, i in comp.tensors.items()], 300_000)
    assert len(shards) >= 2
    with pytest.raises(OutputError, match=r"the worker process writing model-0000\d-of-0000\d\.safetensors.* "
                                          r"was killed by SIGKILL \(out of memory\? try fewer --jobs\); nothing written"):
        write_shards(comp, tmp_path, shards, Replan(_killed), 2, lambda n: None, None, write_shard)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_jobs_must_be_a_positive_integer(tmp_path, value):
    proc = run_qconv("dequantize", CHECKPOINTS / "llama-bnb8", tmp_path / "out", "--jobs", value)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


def test_api_jobs_usage_error():
    import qconv
    from qconv.errors import UsageError

    with pytest.raises(UsageError, match=r"jobs \(--jobs\) 0 is not an integer in >= 1"):
        qconv.dequantize(CHECKPOINTS / "llama-bnb8", "/nonexistent/out", jobs=0)
