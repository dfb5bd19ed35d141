"""Benchmark: the seed-000 story end to end. `qconv convert SRC out.gguf --to gguf` on the full-size
Qwen3-VL-8B bitsandbytes int8 layout (fixtures/layouts/qwen3vl-8b-bnb8.json, built by
fixtures/layouts/build.py: 3 shards, 10.0 GB, sparse files, so every weight is zero), which writes the text
model (LLM.int8 -> Q8_0, codes kept; 9.9 GB, llama.cpp split files past --max-shard-size 5GB) and the
vision tower, int8 in this layout as in the real seed-000 checkpoint, as `mmproj-out.gguf` (dequantized to
F32 by default; `--mmproj-type q8_0` keeps its codes), next to

  raw bytes: a process that reads every source safetensors byte and writes as many bytes as that qconv
  run's outputs (text GGUF files + mmproj) with plain file I/O, to the same disk (the disk floor of
  bench_convert.py and bench_gguf.py).

    .venv/bin/python benchmarks/bench_gguf_vl.py [--runs 3] [--mmproj-types auto,q8_0] [--jobs-1] [--work DIR]
    .venv/bin/python benchmarks/bench_gguf_vl.py --layout qwen3vl-30b-a3b --layers 4 --random --mmproj-types auto

The second is Qwen3-VL-30B-A3B as released (fixtures/layouts/qwen3vl-30b-a3b.json, from
make_qwen3vl_30b_a3b.py: bfloat16, every tensor full-size, the fused experts in the released transposed
layout [128, 2048, 1536] / [128, 768, 2048]), its first N decoder layers (the disk holds N of the 48; each
layer is the same 1.2 GB of experts, so memory and GB/s do not depend on N), filled with N(0, 0.02) weights
(--random: written, so reading them costs real I/O, and the Q8_0 encoder sees real values): bfloat16 ->
Q8_0 for the text decoder (every expert read from the transposed fused tensors one expert at a time), the
tower -> mmproj.

What the built folder gets beside the layout. A GGUF needs a tokenizer and an mmproj needs the image
processor's config; the layout holds tensors and config.json only, so the benchmark adds, in its own
copy (fixtures/layouts is not changed):
  - tokenizer.json / tokenizer_config.json: the fixtures' small byte-level BPE tokenizer
    (fixtures/checkpoints/qwen3vl-bnb8-skipvisual's: the same bytes as llama-bnb8's, which bench_gguf.py
    uses), padded by qconv to the 151,936 ids of vocab_size with [PADn]; a few kB, no part of the timing;
  - preprocessor_config.json: Qwen/Qwen3-VL-8B-Instruct's (Qwen2VLImageProcessorFast, patch 16, merge 2,
    temporal patch 2, image_mean / image_std 0.5), which is the same file as the skipvisual fixture's.

Each figure is a whole process, median wall time of N runs (after one warm-up run of each qconv variant,
which also gives the output sizes). Each round runs, for each variant, the raw copy and then qconv back to
back, so both see the same machine load (printed: the 1-minute load average before each run) and the
same page cache (the source's sparse holes, read by both; the page cache cannot be dropped without root,
so it is warm for both). `sync` before each run; "+ sync" adds the time of the sync after it, which
writes back what the run left dirty. Peak RSS from wait4(); cores = (user + sys CPU) / wall. Outputs
are deleted after each run, so the disk holds one run's outputs at a time (about 12 GB). Prints figures
only; nothing here asserts a time.

The source is sparse, so reading it costs no disk I/O (the kernel fills the page cache with zeros): both
sides move the same bytes, but a real checkpoint would add its read from disk to both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIXTURE = REPO / "fixtures" / "checkpoints" / "qwen3vl-bnb8-skipvisual"
PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                "image_processor_type": "Qwen2VLImageProcessorFast"}

RAW = r"""
import sys
from pathlib import Path
src, out, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
buf = bytearray(16 << 20)
for f in sorted(src.glob("*.safetensors")):
    with open(f, "rb", buffering=0) as h:
        while h.readinto(buf):
            pass
left = n
with open(out / "raw.bin", "wb", buffering=0) as h:
    while left:
        left -= h.write(memoryview(buf)[:min(left, len(buf))])
"""


FILL = r"""
import json, struct, sys
from pathlib import Path
import numpy as np
rng = np.random.default_rng(0)
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with open(f, "r+b") as h:
        (n,) = struct.unpack("<Q", h.read(8))
        header = json.loads(h.read(n))
        if any(v["dtype"] != "BF16" for k, v in header.items() if k != "__metadata__"):
            raise SystemExit(f"{f}: --random fills bfloat16 layouts only")
        h.seek(0, 2)
        left = h.tell() - 8 - n
        h.seek(8 + n)
        while left:
            k = min(left // 2, 1 << 22)
            w = (rng.standard_normal(k, np.float32) * np.float32(0.02)).view(np.uint32) >> 16
            h.write(w.astype(np.uint16).tobytes())
            left -= 2 * k
"""


def layout_of(name: str, layers: int, work: Path) -> Path:
    """The layout JSON, or a copy of it keeping only its first `layers` decoder layers (the config's
    num_hidden_layers set to match): every tensor keeps its full size."""
    path = REPO / "fixtures" / "layouts" / f"{name}.json"
    if not layers:
        return path
    layout = json.loads(path.read_text())
    text = layout["config"].get("text_config", layout["config"])
    if layers > text["num_hidden_layers"]:
        raise SystemExit(f"{name} has {text['num_hidden_layers']} layers, not {layers}")
    text["num_hidden_layers"] = layers
    layout["tensors"] = [t for t in layout["tensors"] if ".layers." not in t[0] or "visual" in t[0]
                         or int(t[0].split(".layers.")[1].split(".")[0]) < layers]
    out = work / f"{name}-{layers}-layers.json"
    out.write_text(json.dumps(layout))
    return out


def own_layout(layout: Path, work: Path) -> Path:
    """The same layout with its fused experts in transformers' own saved shapes ([E, 2I, H] / [E, H, I],
    the transpose of the released ones): --own-too times both."""
    data = json.loads(layout.read_text())
    data["tensors"] = [[n, d, [s[0], s[2], s[1]] if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else s]
                       for n, d, s in data["tensors"]]
    out = work / f"own-{layout.name}"
    out.write_text(json.dumps(data))
    return out


def make_source(work: Path, layout: Path, random: bool, name: str = "src") -> Path:
    """The layout built (in a child process: this one must stay small, since a forked child's peak RSS
    starts from its parent's), with the tokenizer and the image processor's config described above;
    --random fills a bfloat16 layout's data with N(0, 0.02) weights (written, so the disk holds them)."""
    src = work / name
    subprocess.run([sys.executable, REPO / "fixtures" / "layouts" / "build.py", layout, src], check=True)
    if random:
        subprocess.run([sys.executable, "-c", FILL, src], check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURE / name, src / name)
    (src / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    return src


def measure(cmd: list, log: Path) -> dict:
    """One whole process after a sync: wall seconds, the sync after it, peak RSS, CPU, load before."""
    os.sync()
    load = os.getloadavg()[0]
    with open(log, "w+") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        os.sync()
        flush = time.perf_counter() - t0 - wall
        f.seek(0)
        text = f.read()
    if status != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... failed ({status}):\n{text[-3000:]}")
    return {"wall": wall, "flush": flush, "load": load, "stdout": text, "rss": usage.ru_maxrss * 1024,
            "cpu": usage.ru_utime + usage.ru_stime}


def outputs(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def clear(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mmproj-types", default="auto,q8_0", help="comma-separated --mmproj-type values")
    ap.add_argument("--jobs-1", action="store_true", help="also the first type with --jobs 1")
    ap.add_argument("--work", type=Path, help="work folder (default: a temporary folder in /tmp)")
    ap.add_argument("--layout", default="qwen3vl-8b-bnb8", choices=("qwen3vl-8b-bnb8", "qwen3vl-30b-a3b"),
                    help="fixtures/layouts/<name>.json (qwen3vl-30b-a3b: Qwen3-VL-30B-A3B bfloat16 as released)")
    ap.add_argument("--layers", type=int, default=0, help="only the first N decoder layers (0: all)")
    ap.add_argument("--random", action="store_true", help="fill a bfloat16 layout with random weights")
    ap.add_argument("--own-too", action="store_true",
                    help="qwen3vl-30b-a3b: also the same model with its experts in transformers' own layout")
    args = ap.parse_args()
    qconv = str(Path(sys.executable).parent / "qconv")
    variants = [(t, (), "src") for t in args.mmproj_types.split(",")]     # (--mmproj-type, other flags, source)
    if args.jobs_1:
        variants.append((variants[0][0], ("--jobs", "1"), "src"))
    if args.own_too:
        variants.append((variants[0][0], (), "own"))
    work = Path(tempfile.mkdtemp(dir=args.work or "/tmp", prefix="bench-gguf-vl-"))
    try:
        layout = layout_of(args.layout, args.layers, work)
        sources = {"src": make_source(work, layout, args.random)}
        if args.own_too:
            sources["own"] = make_source(work, own_layout(layout, work), args.random, "own")
        src = sources["src"]
        src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        out, log = work / "out", work / "log.txt"
        cmds, sizes, summaries = {}, {}, {}
        for v in variants:
            t, extra, key = v
            cmds[v] = [qconv, "convert", sources[key], out / "out.gguf", "--to", "gguf", "--mmproj-type", t, *extra]
            clear(out)
            r = measure(cmds[v], log)                                   # warm-up; the output sizes
            sizes[v] = outputs(out)
            summaries[v] = [line.strip() for line in r["stdout"].splitlines() if "mmproj" in line]
        results = {v: {"qconv": [], "raw": []} for v in variants}
        for _ in range(args.runs):
            for v in variants:
                clear(out)
                results[v]["raw"].append(measure([sys.executable, "-c", RAW, sources[v[2]], out,
                                                  str(sum(sizes[v].values()))],
                                                  log))
                clear(out)
                results[v]["qconv"].append(measure(cmds[v], log))
        clear(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def row(label, rs, base=None):
        wall = statistics.median(r["wall"] for r in rs)
        both = statistics.median(r["wall"] + r["flush"] for r in rs)
        loads = [r["load"] for r in rs]
        return ([label, f"{wall:.1f}", f"{min(r['wall'] for r in rs):.1f}-{max(r['wall'] for r in rs):.1f}",
                 f"{both:.1f}", f"{src_bytes / wall / 1e9:.2f}", f"{max(r['rss'] for r in rs) / 2**20:,.0f}",
                 f"{statistics.median(r['cpu'] / r['wall'] for r in rs):.2f}",
                 f"{wall / base:.2f}x" if base else "", f"{min(loads):.1f}-{max(loads):.1f}"], wall)

    def label(v):
        t, extra, key = v
        return (f"--mmproj-type {t}{' ' + ' '.join(extra) if extra else ''}"
                + (", experts in transformers' own layout" if key == "own" else ""))

    table = []
    for v in variants:
        raw, base = row("raw bytes: read the source, write as many bytes (same disk)", results[v]["raw"])
        q, _ = row(f"`qconv convert --to gguf {label(v)}`", results[v]["qconv"], base)
        table += [q, raw]
    what = f"{args.layout} layout" + (f", its first {args.layers} decoder layers" if args.layers else "")
    print(f"{what} ({src_bytes / 1e9:.2f} GB of safetensors, {'random' if args.random else 'sparse'}) -> GGUF + mmproj: "
          f"median of {args.runs}, each qconv run right after its raw copy, sync before each run, "
          f"{os.cpu_count()} CPUs\n")
    print(tabulate(table, headers=["whole process", "wall s", "min-max s", "+ sync s", "source GB/s", "peak RSS MiB",
                                   "cores", "vs raw", "load avg"],
                   colalign=("left", *["right"] * 8), disable_numparse=True))
    print()
    table = []
    for v in variants:
        files = sizes[v]
        text = {k: s for k, s in files.items() if not k.startswith("mmproj-")}
        mmproj = sum(s for k, s in files.items() if k.startswith("mmproj-"))
        table.append((label(v), f"{src_bytes / 1e9:.3f}",
                      f"{sum(text.values()) / 1e9:.3f} ({len(text)} files)", f"{mmproj / 1e9:.3f}",
                      f"{sum(files.values()) / 1e9:.3f}", " / ".join(summaries[v])))
    print(tabulate(table, headers=["qconv", "source GB", "text GGUF GB", "mmproj GB", "total GB", "qconv says"],
                   colalign=("left", "right", "right", "right", "right", "left"), disable_numparse=True))


if __name__ == "__main__":
    main()
