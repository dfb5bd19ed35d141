"""Benchmark: `qconv validate` on the ~1.1B-parameter conversion (TinyLlama shapes: the bitsandbytes int8
model of make_tinyllama_bnb8.py against its `qconv bnb8-to-gptq` result), whole process, on the CPU and,
where torch sees one, on CUDA.

    .venv/bin/python benchmarks/bench_validate.py [--samples 32]

Prints figures only. `--rows all` (the default) checks every output row; `--rows sampled` checks layers
above 4,096 rows on 8 evenly spread windows of 512 rows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    args = ap.parse_args()
    src = Path(subprocess.run([sys.executable, HERE / "make_tinyllama_bnb8.py"], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1])
    qconv = str(Path(sys.executable).parent / "qconv")
    devices = ["cpu"]
    probe = "import torch; print(torch.cuda.is_available())"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "True":
        devices.append("cuda")
    rows = []
    with tempfile.TemporaryDirectory(dir=HERE / ".cache") as tmp:
        out = Path(tmp) / "gptq"
        subprocess.run([qconv, "bnb8-to-gptq", src, out], check=True, capture_output=True)
        for device, mode in [("cpu", "all"), ("cpu", "sampled")] + [("cuda", "all")] * (len(devices) > 1):
            t0 = time.perf_counter()
            proc = subprocess.run([qconv, "validate", "--device", device, "--rows", mode, "--samples",
                                   str(args.samples), src, out], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            rows.append((device, mode, f"{wall:.1f}", proc.stdout.strip().splitlines()[-1]))
    print(f"qconv validate, TinyLlama-1.1B bnb int8 vs its bnb8-to-gptq result, {args.samples} activation rows, "
          f"{os.cpu_count()} CPUs\n")
    print(tabulate(rows, headers=["device", "rows", "wall s", "result"]))


if __name__ == "__main__":
    main()
