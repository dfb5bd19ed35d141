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
LAYOUT = REPO / "fixtures" / "layouts" / "qwen3vl-8b-bnb8.json"
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


def make_source(work: Path) -> Path:
    """The layout built (in a child process: this one must stay small, since a forked child's peak RSS
    starts from its parent's), with the tokenizer and the image processor's config described above."""
    src = work / "src"
    subprocess.run([sys.executable, REPO / "fixtures" / "layouts" / "build.py", LAYOUT, src], check=True)
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
    args = ap.parse_args()
    qconv = str(Path(sys.executable).parent / "qconv")
    variants = [(t, ()) for t in args.mmproj_types.split(",")]     # (--mmproj-type, other flags)
    if args.jobs_1:
        variants.append((variants[0][0], ("--jobs", "1")))
    work = Path(tempfile.mkdtemp(dir=args.work or "/tmp", prefix="bench-gguf-vl-"))
    try:
        src = make_source(work)
        src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        out, log = work / "out", work / "log.txt"
        cmds, sizes, summaries = {}, {}, {}
        for v in variants:
            t, extra = v
            cmds[v] = [qconv, "convert", src, out / "out.gguf", "--to", "gguf", "--mmproj-type", t, *extra]
            clear(out)
            r = measure(cmds[v], log)                                   # warm-up; the output sizes
            sizes[v] = outputs(out)
            summaries[v] = [line.strip() for line in r["stdout"].splitlines() if "mmproj" in line]
        results = {v: {"qconv": [], "raw": []} for v in variants}
        for _ in range(args.runs):
            for v in variants:
                clear(out)
                results[v]["raw"].append(measure([sys.executable, "-c", RAW, src, out, str(sum(sizes[v].values()))],
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

    table = []
    for v in variants:
        t, extra = v
        raw, base = row("raw bytes: read the source, write as many bytes (same disk)", results[v]["raw"])
        q, _ = row(f"`qconv convert --to gguf --mmproj-type {t}{' ' + ' '.join(extra) if extra else ''}`",
                   results[v]["qconv"], base)
        table += [q, raw]
    print(f"Qwen3-VL-8B bitsandbytes int8 layout ({src_bytes / 1e9:.2f} GB of safetensors, sparse) -> GGUF + mmproj: "
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
        table.append((f"--mmproj-type {v[0]}{' ' + ' '.join(v[1]) if v[1] else ''}", f"{src_bytes / 1e9:.3f}",
                      f"{sum(text.values()) / 1e9:.3f} ({len(text)} files)", f"{mmproj / 1e9:.3f}",
                      f"{sum(files.values()) / 1e9:.3f}", " / ".join(summaries[v])))
    print(tabulate(table, headers=["qconv", "source GB", "text GGUF GB", "mmproj GB", "total GB", "qconv says"],
                   colalign=("left", "right", "right", "right", "right", "left"), disable_numparse=True))


if __name__ == "__main__":
    main()
