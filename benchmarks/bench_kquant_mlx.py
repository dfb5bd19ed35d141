"""Benchmark: a Q4_K_M GGUF of a ~1.1B-parameter model -> Apple MLX (issue 49), beside the path users have
today and a raw copy, in one run.

The model is bench_gguf.py's (TinyLlama-1.1B shapes, random float16 weights: make_tinyllama_bnb8.py's
base, the fixtures' tokenizer), written as a float16 GGUF by `qconv convert --to gguf --gguf-float` and
quantized by llama.cpp's own quantizer to Q4_K_M (llama_model_quantize in .venv-llamacpp: bin/setup
llamacpp), made once and cached in benchmarks/.cache. Timed, whole processes, best of N (sync before each
run, warm page cache):

  (a) `qconv convert Q4_K_M.gguf DST --to mlx`: every Q4_K module's codes, d * sc and -dmin * m kept as
      MLX codes, scales and biases (groups of 32), the Q6_K ones requantized to 8 bits;
  (b) raw bytes: a process that reads the GGUF's bytes and writes as many bytes as qconv's MLX folder holds;
  (c) the users' path today (mlx-lm reads no K-quants): `qconv dequantize` to float16 (any GGUF -> HF
      tool does this step), then `mlx_lm.convert --quantize` with its defaults (4-bit, groups of 64; mlx
      0.32.4 / mlx-lm 0.32.2 on CPU, .venv-mlx: bin/setup mlx), each step alone and both in one shell.

Then each MLX folder's relative Frobenius error per Linear against llama.cpp's own decoding of the GGUF
(qconv's reading of it, bit for bit gguf-py's: tests/formats/gguf/test_gguf_offsets.py). Prints figures only.

    .venv/bin/python benchmarks/bench_kquant_mlx.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gguf import CACHE, RAW, TOKENIZER, _best, clear  # noqa: E402  (the same model cache and timing)
from bench_mlx import ERROR, MLX_PYTHON  # noqa: E402

LLAMA_PYTHON = HERE.parent / ".venv-llamacpp" / "bin" / "python"
QUANTIZE = r"""
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = 15                    # LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.glob("*.safetensors"))


def source(qconv: str) -> Path:
    """The Q4_K_M GGUF of TinyLlama's shapes, made once (in child processes: this one stays small)."""
    q4km = CACHE / "tinyllama-Q4_K_M.gguf"
    if q4km.exists():
        return q4km
    subprocess.run([sys.executable, HERE / "make_tinyllama_bnb8.py"], check=True, capture_output=True)
    base, tok = CACHE / "tinyllama-fp16", CACHE / "tinyllama-fp16-tok"
    if not (tok / "tokenizer.json").exists():
        tok.mkdir(exist_ok=True)
        for f in [*base.iterdir(), TOKENIZER / "tokenizer.json", TOKENIZER / "tokenizer_config.json"]:
            (tok / f.name).unlink(missing_ok=True)
            try:
                os.link(f, tok / f.name)
            except OSError:
                shutil.copy2(f, tok / f.name)
    f16 = CACHE / "tinyllama-f16.gguf"
    subprocess.run([qconv, "convert", tok, f16, "--to", "gguf", "--gguf-float", "--no-card"], check=True,
                   capture_output=True)
    subprocess.run([str(LLAMA_PYTHON), "-c", QUANTIZE, f16, q4km], check=True, capture_output=True)
    f16.unlink()
    return q4km


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    qconv = str(Path(sys.executable).parent / "qconv")
    src = source(qconv)
    rows, folders = [], {}
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        tmp = Path(tmp)
        ours, out, raw_out = tmp / "qconv-mlx", tmp / "out", tmp / "raw"
        subprocess.run([qconv, "convert", src, ours, "--to", "mlx", "--no-card"], check=True, capture_output=True)
        folders["(a) qconv convert --to mlx"] = ours
        wall, rss = _best([qconv, "convert", src, out / "x", "--to", "mlx", "--no-card"], args.runs, clear(out))
        rows.append(("(a) `qconv convert Q4_K_M.gguf --to mlx` (--jobs: every core)", wall, rss, _size(src) + _size(ours)))
        biggest = max(ours.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        raw_src = tmp / "src"                   # RAW reads a folder's *.safetensors: the GGUF under that name
        raw_src.mkdir()
        os.link(src, raw_src / "model.safetensors")
        wall, rss = _best([sys.executable, "-c", RAW, raw_src, biggest, raw_out], args.runs, clear(raw_out))
        rows.append(("(b) raw bytes: plain read of the GGUF + write of the MLX folder's bytes", wall, rss,
                     _size(src) + biggest.stat().st_size))
        flt, ml = tmp / "float", tmp / "mlx-lm"
        deq = [qconv, "dequantize", src, flt, "--no-card"]
        subprocess.run(deq, check=True, capture_output=True)
        convert = [str(MLX_PYTHON), "-m", "mlx_lm", "convert", "--hf-path", str(flt), "--quantize"]
        subprocess.run([*convert, "--mlx-path", str(ml)], check=True, capture_output=True)
        folders["(c) qconv dequantize + mlx_lm.convert --quantize"] = ml
        float_out = tmp / "float2"
        wall, rss = _best([qconv, "dequantize", src, float_out, "--no-card"], args.runs, clear(float_out))
        rows.append(("(c) users' path, 1: `qconv dequantize` to float16", wall, rss, _size(src) + _size(flt)))
        target = tmp / "x-mlx"
        wall, rss = _best([*convert, "--mlx-path", str(target)], args.runs, lambda: shutil.rmtree(target, ignore_errors=True))
        rows.append(("    2: `mlx_lm.convert --quantize` (4-bit, groups of 64)", wall, rss, _size(flt) + _size(ml)))
        both = ["sh", "-c", " && ".join(shlex.join(map(str, c)) for c in
                                       ([qconv, "dequantize", src, float_out, "--no-card"], [*convert, "--mlx-path", str(target)]))]

        def fresh():
            shutil.rmtree(float_out, ignore_errors=True)
            shutil.rmtree(target, ignore_errors=True)
        wall, rss = _best(both, args.runs, fresh)
        rows.append(("    1 + 2 in one shell process", wall, rss, _size(src) + _size(ml)))
        errors = {label: json.loads(subprocess.run([sys.executable, "-c", ERROR, path, src], check=True,
                                                   capture_output=True, text=True).stdout)
                  for label, path in folders.items()}
        sizes = {label: _size(path) for label, path in folders.items()}
    raw = rows[1][1]
    print(f"TinyLlama-1.1B shapes (random weights), llama.cpp's Q4_K_M ({_size(src) / 1e9:.3f} GB) -> MLX: best of "
          f"{args.runs}, warm read cache, sync before each run\n")
    print(tabulate([(label, f"{wall:.2f}", f"{wall / raw:.1f}x", f"{moved / wall / 1e9:.2f}", f"{rss / 2**20:.0f}")
                    for label, wall, rss, moved in rows],
                   headers=["whole process", "wall s", "vs raw", "GB/s", "peak RSS MiB"],
                   colalign=("left", "right", "right", "right", "right"), disable_numparse=True))
    print()
    print(tabulate([(label, f"{sizes[label] / 1e9:.3f}", errors[label]["layers"], f"{errors[label]['max']:.2e}",
                     f"{errors[label]['median']:.2e}", json.dumps(errors[label]["scales"])) for label in folders],
                   headers=["MLX folder", "GB", "Linears", "max rel. error vs llama.cpp's decoding", "median",
                            "scales (Linears)"], disable_numparse=True))


if __name__ == "__main__":
    main()
