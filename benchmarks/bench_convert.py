"""Benchmark: `qconv dequantize` (or, with --verb bnb8-to-gptq, `qconv bnb8-to-gptq`) on a ~1.1B-parameter
bitsandbytes int8 model (TinyLlama shapes, made by
transformers + bitsandbytes on CPU: make_tinyllama_bnb8.py), next to

  (a) the I/O floor: a process that reads every source tensor and writes the same output bytes (same
      names, dtypes, shapes) with safetensors and nothing else;
      For scale, also the raw disk floor: the same bytes read and written with plain file I/O;
  (b) what users do today: transformers from_pretrained (bitsandbytes) + model.dequantize() + a manual
      safetensors save of the state dict (save_pretrained refuses after dequantize in transformers 5.23).

    .venv/bin/python benchmarks/bench_convert.py [--runs 3] [--skip-transformers]
    .venv/bin/python benchmarks/bench_convert.py --verb bnb8-to-gptq     (no transformers baseline)

Each figure is a whole process: best wall time of N runs (warm page cache for reads, dirty pages
flushed with sync before each run), and its peak RSS from wait4(). GB/s counts source bytes read plus output bytes written. Prints figures only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent

FLOOR = r"""
import sys, torch
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
src, ref, out = map(Path, sys.argv[1:4])
for f in sorted(src.glob("*.safetensors")):
    with safe_open(f, framework="pt") as h:
        for k in h.keys():
            h.get_tensor(k)
for f in sorted(ref.glob("*.safetensors")):
    with safe_open(f, framework="pt") as h:
        spec = {k: (h.get_slice(k).get_shape(), h.get_slice(k).get_dtype()) for k in h.keys()}
    dt = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
          "I8": torch.int8, "U8": torch.uint8}
    save_file({k: torch.empty(s, dtype=dt[d]) for k, (s, d) in spec.items()}, out / f.name,
              metadata={"format": "pt"})
"""

RAW = r"""
import sys
from pathlib import Path
src, ref, out = map(Path, sys.argv[1:4])
buf = bytearray(16 << 20)
for f in sorted(src.glob("*.safetensors")):
    with open(f, "rb", buffering=0) as h:
        while h.readinto(buf):
            pass
for f in sorted(ref.glob("*.safetensors")):
    left = f.stat().st_size
    with open(out / f.name, "wb", buffering=0) as h:
        while left:
            left -= h.write(memoryview(buf)[:min(left, len(buf))])
"""

TRANSFORMERS = r"""
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
src, out = map(Path, sys.argv[1:3])
model = AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
model.dequantize()
state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
save_file(state, out / "model.safetensors", metadata={"format": "pt"})
model.config.save_pretrained(out)
"""


def _run(cmd) -> tuple[float, int]:
    os.sync()                      # start every run with no dirty pages left by the previous one
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{cmd[:3]} failed: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def _best(cmd, runs, before=None):
    results = []
    for _ in range(runs):
        if before:
            before()
        results.append(_run(cmd))
    return min(r[0] for r in results), max(r[1] for r in results)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--verb", choices=["dequantize", "bnb8-to-gptq"], default="dequantize")
    args = ap.parse_args()
    # Made in a child process: this process must stay small, since a forked child's peak RSS
    # (wait4) starts from its parent's.
    src = Path(subprocess.run([sys.executable, HERE / "make_tinyllama_bnb8.py"], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1])
    qconv = str(Path(sys.executable).parent / "qconv")
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    with tempfile.TemporaryDirectory(dir=HERE / ".cache") as tmp:
        tmp = Path(tmp)
        out, floor_out, tf_out = tmp / "qconv", tmp / "floor", tmp / "tf"

        def clear(path):
            return lambda: (shutil.rmtree(path, ignore_errors=True), path.mkdir())

        subprocess.run([qconv, args.verb, src, out], check=True, capture_output=True)   # warm-up
        out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        ref = tmp / "ref"
        os.rename(out, ref)
        rows = []
        qc = _best([qconv, args.verb, src, out], args.runs, clear(out))
        fl = _best([sys.executable, "-c", FLOOR, src, ref, floor_out], args.runs, clear(floor_out))
        rows.append((f"qconv {args.verb}", *qc))
        rows.append(("(a) I/O floor: safetensors read + write", *fl))
        rows.append(("    raw bytes: plain file read + write", *_best([sys.executable, "-c", RAW, src, ref, floor_out],
                                                                args.runs, clear(floor_out))))
        if not args.skip_transformers and args.verb == "dequantize":
            rows.append(("(b) transformers load + dequantize() + save",
                         *_best([sys.executable, "-c", TRANSFORMERS, src, tf_out], 1, clear(tf_out))))
    moved = src_bytes + out_bytes
    table = [(label, f"{wall:.2f}", f"{moved / wall / 1e9:.2f}", f"{rss / 2**20:.0f}",
              f"{wall / qc[0]:.2f}x") for label, wall, rss in rows]
    target = "float16" if args.verb == "dequantize" else "GPTQ int8"
    print(f"TinyLlama-1.1B bnb int8 -> {target}: reads {src_bytes / 1e9:.2f} GB, writes {out_bytes / 1e9:.2f} GB; "
          f"best of {args.runs} (transformers: 1 run), warm read cache, sync before each run, "
          f"{os.cpu_count()} CPUs\n")
    print(tabulate(table, headers=["whole process", "wall s", "GB/s", "peak RSS MiB", "time vs qconv"],
                   colalign=("left", "right", "right", "right", "right")))


if __name__ == "__main__":
    main()
