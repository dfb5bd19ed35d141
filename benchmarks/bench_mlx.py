"""Benchmark: `qconv convert SRC DST --to mlx` on the ~1.1B-parameter model of bench_gguf.py (TinyLlama
shapes, random weights, LLM.int8 by transformers + bitsandbytes on CPU: make_tinyllama_bnb8.py), from the
same three sources (LLM.int8; its GPTQ 8-bit per-row version; a GPTQ 4-bit group-128 version), next to

  (a) raw bytes: a process that reads the source's safetensors bytes and writes as many bytes as the MLX
      folder holds, with plain file I/O (the disk floor);
  (b) mlx-lm's own path for the same model: its converter quantizes only from float (it cannot read
      bitsandbytes, and reads GPTQ words as AWQ's), so `qconv dequantize` of the int8 model to float16, then
      `mlx_lm.convert --quantize --q-bits 8` (mlx 0.32.4 / mlx-lm 0.32.2 on CPU, .venv-mlx: bin/setup mlx),
      each step timed alone and both in one shell process.

    .venv/bin/python benchmarks/bench_mlx.py [--runs 3] [--skip-4bit] [--skip-mlx-lm] [--skip-error]

Each figure is a whole process: best wall time of N runs (warm page cache, sync before each run, after a
warm-up run) and its peak RSS from wait4(). GB/s counts source bytes read plus output bytes written. Then,
for each MLX folder, the relative Frobenius error ||W_mlx - W|| / ||W|| of every Linear: W_mlx qconv's
reading of the folder (bit for bit mx.dequantize's, float32 scales and biases: tests/consumers/test_mlx.py),
W the source's exact weights (qconv's float32 decoding of it). Prints figures only.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf import CACHE, RAW, _best, _size, _sources, clear  # noqa: E402  (the same model, sources, timing)

MLX_PYTHON = Path(__file__).resolve().parent.parent / ".venv-mlx" / "bin" / "python"

ERROR = r"""
import json, sys
import numpy as np
from qconv.formats.core.detect import detect
from qconv.formats.core.reader import read_module
from qconv.formats.storage.checkpoint import open_target
def weights(path):
    comp = open_target(path).components[0]
    det = detect(comp)
    return comp, det, {m.name: m for m in det.modules}
ca, da, ma = weights(sys.argv[1])
cb, db, mb = weights(sys.argv[2])
errors, dtypes = [], {}
for name, m in ma.items():
    if name not in mb or "embed" in name or name == "lm_head":
        continue
    a = read_module(ca, da, m, "float32")
    b = read_module(cb, db, mb[name], "float32")
    wa, wb = a.dequantize_rows(0, a.shape[0]).astype(np.float64), b.dequantize_rows(0, b.shape[0]).astype(np.float64)
    errors.append(float(np.linalg.norm(wa - wb) / np.linalg.norm(wb)))
    code = ca.tensors[name + ".scales"].dtype
    dtypes[code] = dtypes.get(code, 0) + 1
print(json.dumps({"layers": len(errors), "max": max(errors), "median": float(np.median(errors)), "scales": dtypes}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-4bit", action="store_true", help="leave out the GPTQ 4-bit source")
    ap.add_argument("--skip-mlx-lm", action="store_true", help="leave out mlx-lm's own path")
    ap.add_argument("--skip-error", action="store_true", help="leave out the error of each folder")
    args = ap.parse_args()
    qconv = str(Path(sys.executable).parent / "qconv")
    sources = _sources(qconv, not args.skip_4bit)
    labels = {"bnb8": "LLM.int8", "gptq8": "GPTQ 8-bit", "gptq4": "GPTQ 4-bit g128"}
    rows, folders = [], {}
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        tmp = Path(tmp)
        out, raw_out = tmp / "out", tmp / "raw"

        for key, src in sources.items():
            kept = tmp / f"{key}-mlx"
            subprocess.run([qconv, "convert", src, kept, "--to", "mlx"], check=True, capture_output=True)  # warm-up
            folders[f"qconv --to mlx, {labels[key]}"] = (kept, key)
            moved = _size(src) + _size(kept)
            wall, rss = _best([qconv, "convert", src, out / "x", "--to", "mlx"], args.runs, clear(out))
            rows.append((f"`qconv convert --to mlx`, {labels[key]} (--jobs: every core)", wall, rss, moved))
            biggest = max(kept.glob("*.safetensors"), key=lambda p: p.stat().st_size)
            wall, rss = _best([sys.executable, "-c", RAW, src, biggest, raw_out], args.runs, clear(raw_out))
            rows.append(("    (a) raw bytes: plain file read + write of its largest shard", wall, rss,
                         _size(src) + biggest.stat().st_size))
        if not args.skip_mlx_lm:
            src, flt, ml = sources["bnb8"], tmp / "float", tmp / "mlx-lm"
            subprocess.run([qconv, "dequantize", src, flt], check=True, capture_output=True)          # warm-up
            convert = [str(MLX_PYTHON), "-m", "mlx_lm", "convert", "--hf-path", str(flt), "--quantize",
                       "--q-bits", "8"]
            subprocess.run([*convert, "--mlx-path", str(ml)], check=True, capture_output=True)
            folders["(b) mlx-lm: dequantize + mlx_lm.convert --q-bits 8"] = (ml, "bnb8")
            float_out = tmp / "float2"
            deq = [qconv, "dequantize", src, float_out]
            wall, rss = _best(deq, args.runs, clear(float_out))
            rows.append(("(b) mlx-lm's path, 1: `qconv dequantize` to float16", wall, rss, _size(src) + _size(flt)))
            target = tmp / "x-mlx"
            wall, rss = _best([*convert, "--mlx-path", str(target)], args.runs,
                              lambda: shutil.rmtree(target, ignore_errors=True))
            rows.append(("    2: `mlx_lm.convert --quantize --q-bits 8`", wall, rss, _size(flt) + _size(ml)))
            steps = (deq, [*convert, "--mlx-path", str(target)])
            both = ["sh", "-c", " && ".join(shlex.join(map(str, c)) for c in steps)]

            def fresh():
                clear(float_out)()
                shutil.rmtree(target, ignore_errors=True)
            wall, rss = _best(both, args.runs, fresh)
            rows.append(("    1 + 2 in one shell process", wall, rss, _size(src) + _size(ml)))
        errors = {}
        for label, (path, key) in ({} if args.skip_error else folders).items():
            res = subprocess.run([sys.executable, "-c", ERROR, path, sources[key]], check=True, capture_output=True,
                                 text=True)
            errors[label] = json.loads(res.stdout)
        sizes = {label: (_size(path), _size(sources[key])) for label, (path, key) in folders.items()}
    table = [(label, f"{wall:.2f}", f"{moved / wall / 1e9:.2f}", f"{rss / 2**20:.0f}") for label, wall, rss, moved in rows]
    print(f"TinyLlama-1.1B shapes (random weights) -> MLX: best of {args.runs}, warm read cache, sync before each run\n")
    print(tabulate(table, headers=["whole process", "wall s", "GB/s", "peak RSS MiB"],
                   colalign=("left", "right", "right", "right"), disable_numparse=True))
    print()
    table = [(label, f"{src / 1e9:.3f}", f"{size / 1e9:.3f}",
              *((f"{errors[label]['max']:.2e}", f"{errors[label]['median']:.2e}", json.dumps(errors[label]["scales"]))
                if label in errors else ("-", "-", "-")))
             for label, (size, src) in sizes.items()]
    print(tabulate(table, headers=["MLX folder", "source GB", "MLX GB", "max rel. error", "median rel. error",
                                   "scales (Linears)"], disable_numparse=True))


if __name__ == "__main__":
    main()
