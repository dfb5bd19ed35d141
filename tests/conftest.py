import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qconv.formats.safetensors_header import encode_header

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
CHECKPOINTS = FIXTURES / "checkpoints"
QCONV = str(Path(sys.executable).parent / "qconv")

QUANTIZED = sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "oracle").is_dir())
ALL_CHECKPOINTS = sorted(p.name for p in CHECKPOINTS.iterdir() if p.is_dir())


def run_qconv(*args, check=None):
    """Run the installed console script, as a user does."""
    proc = subprocess.run([QCONV, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


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


def copy_checkpoint(name, dst: Path) -> Path:
    target = dst / name
    shutil.copytree(CHECKPOINTS / name, target, ignore=shutil.ignore_patterns("oracle"))
    return target


def write_sparse_safetensors(path: Path, tensors, metadata=None) -> int:
    """A real safetensors header followed by a hole of the right size: no disk blocks for the data."""
    header, data_size = encode_header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(header)
    os.truncate(path, len(header) + data_size)
    return len(header) + data_size


@pytest.fixture
def tmp_checkpoint(tmp_path):
    return lambda name: copy_checkpoint(name, tmp_path)
