"""Benchmark: `qconv dequantize` of one large 4-bit module, compressed-tensors beside AWQ (the peer: the
same codes and scales in another family), as whole processes: wall time and peak RSS.

    .venv/bin/python benchmarks/bench_dequantize_large_module.py [--size 16384] [--runs 3]

Builds, from one seeded QuantTensor (4-bit, group 128, symmetric), a compressed-tensors W4A16 folder and
an AWQ GEMM folder holding a single SIZE x SIZE down_proj (134 MiB of codes at 16384), then times
`qconv dequantize --dtype float16` of each, median of N runs. Both read the module a window of output
rows at a time (convert/dequantize.read_windows), so peak memory is a window plus the output slabs, not
the module. Issue 20 measured 2.4 GiB / 14 s for the compressed-tensors module read whole, 0.87 GiB /
2.3 s for AWQ.

Prints figures only; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
QCONV = str(Path(sys.executable).parent / "qconv")
MODULE = "model.layers.0.mlp.down_proj"
PEAK = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); " \
       "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"


def build(root: Path, size: int) -> dict[str, Path]:
    from safetensors.numpy import save_file

    from qconv.formats.awq import header as awq
    from qconv.formats.awq import codec as awq_codec
    from qconv.formats.compressed_tensors import header as compressed_tensors
    from qconv.formats.compressed_tensors import codec as ct_codec
    from qconv.formats.core.ir import QuantSpec, QuantTensor

    rng = np.random.default_rng(0)
    spec = QuantSpec("int", 4, 128, True, scale_dtype="F16")
    qt = QuantTensor(spec, (size, size), "float16", codes=rng.integers(0, 16, (size, size), dtype=np.uint8),
                     scales=(rng.random((size, size // 128)) * 0.01 + 0.001).astype(np.float16).astype(np.float32),
                     zeros=np.full((size, size // 128), 8, np.uint8))
    base = json.loads((REPO / "fixtures" / "checkpoints" / "llama-ct-w4a16" / "config.json").read_text())
    folders = {}
    for name, tensors, qc in (
            ("compressed-tensors", ct_codec.encode(qt), compressed_tensors.config_for({MODULE: spec})),
            ("awq", awq_codec.encode(qt, "F16"), awq.config_for(spec))):
        folder = root / name
        folder.mkdir()
        save_file({f"{MODULE}.{leaf}": np.ascontiguousarray(values) for leaf, (_, values) in tensors.items()},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**base, "quantization_config": qc}))
        folders[name] = folder
    return folders


def run(folder: Path, out: Path) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PEAK, QCONV, "dequantize", "--dtype", "float16", str(folder),
                           str(out)], capture_output=True, text=True, check=True)
    return time.monotonic() - t0, int(proc.stdout.strip().splitlines()[-1]) / 2**20      # GiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = build(Path(tmp), args.size)
        rows = []
        for name, folder in folders.items():
            results = [run(folder, Path(tmp) / f"out-{name}") for _ in range(args.runs)]
            rows.append((name, f"{args.size} x {args.size}", f"{statistics.median(r[0] for r in results):.1f} s",
                         f"{statistics.median(r[1] for r in results):.2f} GiB"))
    print(tabulate(rows, headers=["family", "module", f"median of {args.runs}", "peak RSS"]))


if __name__ == "__main__":
    main()
