"""A full-size Qwen3-VL-8B bitsandbytes int8 text_encoder (the checkpoint of seed 000), as real
sharded safetensors headers over sparse files: qconv must print the user's numbers exactly, read
only headers, and never import torch."""

import json
import subprocess
import sys

import pytest

from conftest import FIXTURES, REPO

sys.path.insert(0, str(FIXTURES / "layouts"))
from build import build  # noqa: E402

SEED = json.loads((FIXTURES / "seeds" / "000_int8_report_qwen3vl_text_encoder.json").read_text())

# Runs qconv in-process and reports what it loaded and how many bytes it read (/proc/self/io rchar).
PROBE = r"""
import json, sys
def report():
    io = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
    heavy = sorted(m for m in ("torch", "numpy", "transformers", "safetensors", "bitsandbytes")
                   if m in sys.modules)
    print(json.dumps({"rchar": int(io["rchar"]), "heavy": heavy}), file=sys.stderr)
import atexit; atexit.register(report)
from qconv.cli import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return build(FIXTURES / "layouts" / "qwen3vl-8b-bnb8.json", tmp_path_factory.mktemp("q8b") / "pipe",
                 pipeline=True)


def _run(*args):
    proc = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True,
                          text=True, cwd=REPO.parent, timeout=120)
    probe = json.loads(proc.stderr.strip().splitlines()[-1])
    return proc, probe


def test_layout_is_full_size_and_sharded(pipeline):
    shards = sorted((pipeline / "text_encoder").glob("*.safetensors"))
    assert len(shards) == 3
    total = sum(p.stat().st_size for p in shards)
    assert total > 9 * 10**9                                     # 8.8 GB of int8 + bf16 data
    assert sum(p.stat().st_blocks * 512 for p in shards) < 10**7  # ... held as holes


def test_reproduces_seed_000_exactly(pipeline):
    proc, probe = _run("inspect", "--json", pipeline)
    assert proc.returncode == 0, proc.stderr
    (report,) = json.loads(proc.stdout)["components"]
    for key in ("component", "method", "threshold", "skip_modules", "parameter_dtypes", "int8_parameters"):
        assert report[key] == SEED[key], key
    assert sorted(report["linear8bit_modules"]) == sorted(SEED["linear8bit_modules"])
    assert len(report["linear8bit_modules"]) == 368
    assert report["quantized_parameters"] == {"int8": 7_517_270_016}
    # The user's lesson from seed 000: "visual" did not keep the vision tower unquantized.
    assert any("'visual'" in w and "116 quantized modules" in w and "'model.visual'" in w
               for w in report["warnings"])
    assert report["files"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_reads_headers_only_and_never_imports_torch(pipeline):
    proc, probe = _run("inspect", pipeline)
    assert proc.returncode == 0, proc.stderr
    assert "7,517,270,016" in proc.stdout
    assert probe["heavy"] == []
    # Python's own imports read a few MB; the tensor data is 8.8 GB.
    assert probe["rchar"] < 32 * 2**20, probe
