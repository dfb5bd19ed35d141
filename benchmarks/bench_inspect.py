"""Benchmark: `qconv inspect` on a full-size layout, as whole processes, next to its floors.

    .venv/bin/python benchmarks/bench_inspect.py [--runs 15]

Builds the Qwen3-VL-8B bitsandbytes int8 text_encoder of seed 000 (3 shards, 9.3 GiB of sparse
files, 1,486 tensors; fixtures/layouts) and times, each as a fresh process, best and median of N:

  python -c pass                      the interpreter's own start-up
  bare header read                    a python process that opens the 3 shards and parses their
                                      headers with struct + json, nothing else
  qconv inspect --json                the full report (configs, headers, quant state, lint)
  qconv inspect                       the same with tabulate's human tables

Prints figures only; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "fixtures" / "layouts"))
from build import build  # noqa: E402

BARE = r"""
import json, struct, sys, glob
for p in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        json.loads(f.read(n))
"""


def _time(cmd, runs):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    qconv = str(Path(sys.executable).parent / "qconv")
    with tempfile.TemporaryDirectory() as tmp:
        pipe = build(REPO / "fixtures" / "layouts" / "qwen3vl-8b-bnb8.json", Path(tmp) / "pipe",
                     pipeline=True)
        comp = pipe / "text_encoder"
        size = sum(p.stat().st_size for p in comp.glob("*.safetensors"))
        rows = []
        for label, cmd in [
            ("python -c pass", [sys.executable, "-c", "pass"]),
            ("bare header read (struct + json)", [sys.executable, "-c", BARE, str(comp)]),
            ("qconv inspect --json", [qconv, "inspect", "--json", str(pipe)]),
            ("qconv inspect (tables)", [qconv, "inspect", str(pipe)]),
        ]:
            best, median = _time(cmd, args.runs)
            rows.append((label, f"{best * 1000:.0f}", f"{median * 1000:.0f}"))
        base = float(rows[1][2])
        rows = [r + (f"{float(r[2]) / base:.2f}x",) for r in rows]
    print(f"Qwen3-VL-8B bnb int8 text_encoder: 3 shards, {size / 2**30:.2f} GiB, 1,486 tensors; "
          f"{args.runs} runs each, warm page cache\n")
    print(tabulate(rows, headers=["whole process", "best ms", "median ms", "vs bare read"],
                   colalign=("left", "right", "right", "right")))


if __name__ == "__main__":
    main()
