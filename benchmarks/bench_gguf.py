"""Benchmark: `qconv convert SRC out.gguf --to gguf` on a ~1.1B-parameter model (TinyLlama shapes, random
weights, LLM.int8 by transformers + bitsandbytes on CPU: make_tinyllama_bnb8.py), from three sources:

  - the bitsandbytes LLM.int8 model (Q8_0, codes kept, d = SCB / 127 rounded to float16);
  - the same as GPTQ 8-bit (`qconv bnb8-to-gptq`, per-row, made once and cached: Q8_0, codes kept);
  - a GPTQ 4-bit group-128 model (`qconv convert --to gptq --bits 4 --group-size 128 --no-search` of
    the int8 model, made once and cached: Q4_0, codes kept);

next to

  (a) raw bytes: a process that reads the source's safetensors bytes and writes as many bytes as the
      GGUF holds, with plain file I/O (the disk floor of bench_convert.py);
  (b) llama.cpp's own path for the same model: `qconv dequantize` of the int8 model to float16, then
      llama.cpp's `convert_hf_to_gguf.py FLOAT --outtype q8_0` (its converter refuses bitsandbytes
      checkpoints), each step timed alone and both in one shell process.

    .venv/bin/python benchmarks/bench_gguf.py [--runs 3] [--skip-4bit] [--skip-llamacpp] [--skip-error]

The converter is the one vendored in llama-cpp-python 0.3.36's sdist (`bin/setup llamacpp` extracts it
to the cache folder, ~/.cache/qconv/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp; --llamacpp DIR for
another), run with this venv's Python (torch, numpy, transformers, safetensors) and its own gguf-py first
on PYTHONPATH. Its llama path imports sentencepiece before it looks for tokenizer.model, so sentencepiece
is installed once with pip --target into ~/.cache/qconv/pylib-sentencepiece (never into .venv) and put
on PYTHONPATH.

Tokenizer. The benchmark model has none (random weights, no tokenizer.model), and a GGUF needs one: the
sources here are the cached int8 model's files
hard-linked into tinyllama-bnb8-tok/ beside the fixtures' 143-token byte-level BPE tokenizer
(fixtures/checkpoints/llama-bnb8/tokenizer.json, padded by both tools to the 32,000 ids with [PADn]).
llama.cpp's converter identifies a BPE pre-tokenizer by hashing what it makes of a test string, and knows
only the hashes of released models' tokenizers, so it refuses this one ("BPE pre-tokenizer was not
recognized"); its own remedy is to add the model to convert_hf_to_gguf_update.py, which downloads the
model's tokenizer from the Hub. The converter is therefore run through a small wrapper (LLAMACPP below)
that replaces TextModel.get_vocab_base_pre with one returning "gpt-2", the name qconv writes for this
tokenizer (a plain GPT-2 ByteLevel pre-tokenizer). Nothing else of the converter is changed: the weights
take its ordinary path. The tokenizer is a few kB of metadata in either file and no part of the timing.

Each figure is a whole process: best wall time of N runs (warm page cache for reads, dirty pages flushed
with sync before each run, after a warm-up run), and its peak RSS from wait4() (for the two llama.cpp
steps run as one shell process, the larger of the two). GB/s counts source bytes read plus output bytes
written. Then, for each GGUF, the relative Frobenius error ||W_gguf - W|| / ||W|| of every Linear: the
GGUF's tensor read with gguf-py's GGUFReader, decoded with gguf.quants.dequantize (llama.cpp's reference
decoder) and its q / k rows put back in Hugging Face order, against W, qconv's dequantization of that
GGUF's source in float32 (`qconv dequantize --dtype float32`: the source's exact weights; llama.cpp's
path starts from the float16 dequantization, as a user's would). Prints figures only.
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
import time
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
TOKENIZER = HERE.parent / "fixtures" / "checkpoints" / "llama-bnb8"
LLAMACPP_DIR = Path.home() / ".cache" / "qconv" / "sdist" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
SENTENCEPIECE = Path.home() / ".cache" / "qconv" / "pylib-sentencepiece"

RAW = r"""
import sys
from pathlib import Path
src, ref, out = map(Path, sys.argv[1:4])
buf = bytearray(16 << 20)
for f in sorted(src.glob("*.safetensors")):
    with open(f, "rb", buffering=0) as h:
        while h.readinto(buf):
            pass
left = ref.stat().st_size
with open(out / ref.name, "wb", buffering=0) as h:
    while left:
        left -= h.write(memoryview(buf)[:min(left, len(buf))])
"""

# llama.cpp's converter, its BPE pre-tokenizer check answered with the name qconv writes (see above).
LLAMACPP = r"""
import runpy, sys
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

ERROR = r"""
import json, sys
import numpy as np
import gguf
from pathlib import Path
from safetensors import safe_open
path, ref = Path(sys.argv[1]), Path(sys.argv[2])
names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
reader = gguf.GGUFReader(path)
field = lambda key: int(reader.fields[key].parts[-1][0])
heads = {"attn_q": field("llama.attention.head_count"), "attn_k": field("llama.attention.head_count_kv")}
handles = {}
for f in sorted(ref.glob("*.safetensors")):
    h = safe_open(f, framework="numpy")
    handles.update((k, h) for k in h.keys())
errors, types = [], {}
for t in reader.tensors:
    types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    parts = t.name.split(".")
    if parts[0] != "blk" or parts[2] not in names:
        continue
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    rows, cols = w.shape
    if parts[2] in heads:
        n = heads[parts[2]]
        w = w.reshape(n, rows // n // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    hf = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
    r = handles[hf].get_tensor(hf).astype(np.float64)
    errors.append(float(np.linalg.norm(w - r) / np.linalg.norm(r)))
print(json.dumps({"layers": len(errors), "max": max(errors), "median": float(np.median(errors)), "types": types}))
"""


def _run(cmd, env=None) -> tuple[float, int]:
    os.sync()                      # start every run with no dirty pages left by the previous one
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{cmd[:3]} failed: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def _best(cmd, runs, before=None, env=None):
    results = []
    for _ in range(runs):
        if before:
            before()
        results.append(_run(cmd, env))
    return min(r[0] for r in results), max(r[1] for r in results)


def _sources(qconv: str, with_4bit: bool) -> dict[str, Path]:
    """The int8 model (with the fixtures' tokenizer) and its GPTQ versions, made once and cached beside
    make_tinyllama_bnb8.py's model. Made in child processes: this process must stay small, since a
    forked child's peak RSS (wait4) starts from its parent's."""
    bnb8 = Path(subprocess.run([sys.executable, HERE / "make_tinyllama_bnb8.py"], check=True,
                               capture_output=True, text=True).stdout.strip().splitlines()[-1])
    tok = CACHE / "tinyllama-bnb8-tok"
    if not (tok / "tokenizer.json").exists():
        tok.mkdir(exist_ok=True)
        for f in [*bnb8.iterdir(), TOKENIZER / "tokenizer.json", TOKENIZER / "tokenizer_config.json"]:
            (tok / f.name).unlink(missing_ok=True)
            try:
                os.link(f, tok / f.name)          # the same bytes as the cached model, no copy
            except OSError:
                shutil.copy2(f, tok / f.name)
    sources = {"bnb8": tok, "gptq8": CACHE / "tinyllama-gptq8"}
    if not (sources["gptq8"] / "config.json").exists():
        subprocess.run([qconv, "bnb8-to-gptq", tok, sources["gptq8"]], check=True, capture_output=True)
    if with_4bit:
        sources["gptq4"] = CACHE / "tinyllama-gptq4-g128"
        if not (sources["gptq4"] / "config.json").exists():
            subprocess.run([qconv, "convert", tok, sources["gptq4"], "--to", "gptq", "--bits", "4",
                            "--group-size", "128", "--no-search"], check=True, capture_output=True)
    return sources


def _llamacpp_env(llamacpp: Path) -> dict:
    if not (SENTENCEPIECE / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                        SENTENCEPIECE, "sentencepiece"], check=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [llamacpp / "gguf-py", llamacpp, SENTENCEPIECE]))}


def clear(*paths):
    """A before-run hook for _best: the output folders emptied."""
    def f():
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
            p.mkdir()
    return f


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-4bit", action="store_true", help="leave out the GPTQ 4-bit source")
    ap.add_argument("--skip-llamacpp", action="store_true", help="leave out llama.cpp's own path")
    ap.add_argument("--skip-error", action="store_true", help="leave out the error of each GGUF")
    ap.add_argument("--llamacpp", type=Path, default=LLAMACPP_DIR, help="llama.cpp source tree (its converter)")
    args = ap.parse_args()
    qconv = str(Path(sys.executable).parent / "qconv")
    sources = _sources(qconv, not args.skip_4bit)
    labels = {"bnb8": "LLM.int8 -> Q8_0", "gptq8": "GPTQ 8-bit -> Q8_0", "gptq4": "GPTQ 4-bit g128 -> Q4_0"}
    rows, files = [], {}     # rows: (label, wall, peak RSS, bytes moved)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        tmp = Path(tmp)
        out, raw_out = tmp / "out", tmp / "raw"

        for key, src in sources.items():
            kept = tmp / f"{key}.gguf"
            subprocess.run([qconv, "convert", src, kept, "--to", "gguf"], check=True, capture_output=True)  # warm-up
            files[f"qconv convert --to gguf, {labels[key]}"] = (kept, key)
            moved = _size(src) + _size(kept)
            wall, rss = _best([qconv, "convert", src, out / "x.gguf", "--to", "gguf"], args.runs, clear(out))
            rows.append((f"`qconv convert --to gguf`, {labels[key]} (--jobs: every core)", wall, rss, moved))
            wall, rss = _best([qconv, "convert", src, out / "x.gguf", "--to", "gguf", "--jobs", "1"], args.runs,
                              clear(out))
            rows.append(("    the same, `--jobs 1` (one thread)", wall, rss, moved))
            wall, rss = _best([sys.executable, "-c", RAW, src, kept, raw_out], args.runs, clear(raw_out))
            rows.append(("    (a) raw bytes: plain file read + write", wall, rss, moved))
        if not args.skip_llamacpp:
            env = _llamacpp_env(args.llamacpp)
            src, flt, lc = sources["bnb8"], tmp / "float", tmp / "llamacpp.gguf"
            converter = [sys.executable, "-c", LLAMACPP, args.llamacpp / "convert_hf_to_gguf.py"]
            subprocess.run([qconv, "dequantize", src, flt], check=True, capture_output=True)       # warm-up
            subprocess.run([*converter, flt, "--outtype", "q8_0", "--outfile", lc], check=True,
                           capture_output=True, env=env)
            files["(b) llama.cpp: dequantize + convert_hf_to_gguf.py --outtype q8_0"] = (lc, "bnb8")
            float_out = tmp / "float2"
            deq = [qconv, "dequantize", src, float_out]
            conv = [*converter, flt, "--outtype", "q8_0", "--outfile", out / "x.gguf"]
            wall, rss = _best(deq, args.runs, clear(float_out))
            rows.append(("(b) llama.cpp's path, 1: `qconv dequantize` to float16", wall, rss, _size(src) + _size(flt)))
            wall, rss = _best(conv, args.runs, clear(out), env)
            rows.append(("    2: `convert_hf_to_gguf.py --outtype q8_0`", wall, rss, _size(flt) + _size(lc)))
            steps = (deq, [*converter, float_out, "--outtype", "q8_0", "--outfile", out / "x.gguf"])
            both = ["sh", "-c", " && ".join(shlex.join(map(str, c)) for c in steps)]
            wall, rss = _best(both, args.runs, clear(float_out, out), env)
            rows.append(("    1 + 2 in one shell process", wall, rss, _size(src) + _size(lc)))
        errors = {}
        for key in [] if args.skip_error else dict.fromkeys(k for _, k in files.values()):
            ref = tmp / "ref"          # the source's exact weights: qconv dequantize --dtype float32
            subprocess.run([qconv, "dequantize", sources[key], ref, "--dtype", "float32"], check=True,
                           capture_output=True)
            for label, (path, k) in files.items():
                if k == key:
                    res = subprocess.run([sys.executable, "-c", ERROR, path, ref], check=True, capture_output=True,
                                         text=True)
                    errors[label] = json.loads(res.stdout)
            shutil.rmtree(ref)
        sizes = {label: (path.stat().st_size, _size(sources[key])) for label, (path, key) in files.items()}
    base = rows[0][1]
    table = [(label, f"{wall:.2f}", f"{moved / wall / 1e9:.2f}", f"{rss / 2**20:.0f}", f"{wall / base:.2f}x")
             for label, wall, rss, moved in rows]
    print(f"TinyLlama-1.1B shapes (random weights) -> GGUF: best of {args.runs}, warm read cache, sync before each "
          f"run, {os.cpu_count()} CPUs\n")
    print(tabulate(table, headers=["whole process", "wall s", "GB/s", "peak RSS MiB", "time vs first row"],
                   colalign=("left", "right", "right", "right", "right"), disable_numparse=True))
    print()
    table = []
    for label, (size, src_size) in sizes.items():
        e = errors.get(label)
        table.append((label, f"{src_size / 1e9:.3f}", f"{size / 1e9:.3f}",
                      ", ".join(f"{n} {k}" for k, n in sorted(e["types"].items())) if e else "",
                      f"{e['max']:.2e}" if e else "", f"{e['median']:.2e}" if e else ""))
    print(tabulate(table, headers=["GGUF", "source GB", "GGUF GB", "tensors", "max rel. error", "median rel. error"],
                   colalign=("left", "right", "right", "left", "right", "right"), disable_numparse=True))
    if errors:
        print("\nrel. error: ||W_gguf - W|| / ||W|| over the 154 Linears, W = qconv dequantize --dtype float32 "
              "of the GGUF's source; "
              "embeddings, lm_head and norms not counted")


if __name__ == "__main__":
    main()
