"""Benchmark (issue 17, §4): a DeepSeek-V3-shaped fine-grained FP8 checkpoint (make_deepseek_v3_fp8.py:
DeepSeek-V3's config, real names and shapes of its first decoder layers, random e4m3 data) through

  * `qconv dequantize` (-> bfloat16, what people run an FP8 release on older hardware with),
  * `qconv convert --to compressed-tensors-w8a8` (int8 per channel, searched, error and activation cost
    reported), and the same with `--no-search` (plain round-to-nearest, as min-max quantizers do),
  * `qconv convert --to compressed-tensors-fp8` of the dequantized bfloat16 model (FP8_DYNAMIC: the
    data-free job llm-compressor's model_free_ptq does; bench_model_free_ptq.py runs that peer),

each beside a raw byte copy of the same amount of data (plain file reads of the source, plain file
writes of the output's size), so the ratio says how far each is from the disk. Then it extrapolates the
full DeepSeek-V3 (671 B parameters, 688 GB of FP8 + scales) on one machine of --cores cores from the
measured per-GB costs: the I/O part at this machine's raw-copy rate, the compute part scaled by
cores / this machine's cores (qconv's search and decoding run on every core, numpy releasing the GIL).

    .venv/bin/python benchmarks/bench_fp8_scale.py [--dense 1] [--moe 0] [--experts 16] [--runs 1]
                                                   [--cores 64] [--jobs 1,2] [--max-shard-size 200MB]
                                                   [--only no-search,dequantize]

Every qconv job runs once per --jobs value (worker processes writing the output shards, convert/parallel.py;
--max-shard-size makes the several shards they share); peak RSS is that of the largest single process
(wait4() counts the workers qconv reaped).

Each figure is a whole process: best wall time of --runs, peak RSS from wait4(), sync before each
run, warm read cache. Prints figures only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_convert  # noqa: E402 - its raw byte copy (RAW) and whole-process runner
from bench_convert import RAW  # noqa: E402
DEEPSEEK_V3_FP8_BYTES = 688.6e9      # the published checkpoint's 163 shards (FP8 weights, scales, BF16 rest)

def _run(cmd) -> tuple[float, int, float]:
    """(wall s, peak RSS bytes, CPU s) of one child process, as bench_convert runs it."""
    before = os.times()
    wall, rss = bench_convert._run(cmd)
    after = os.times()
    return wall, rss, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def _best(cmd, runs, out: Path):
    results = []
    for _ in range(runs):
        shutil.rmtree(out, ignore_errors=True)
        if cmd[0] == sys.executable:
            out.mkdir()
        results.append(_run(cmd))
    return min(results)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", type=int, default=1)
    ap.add_argument("--moe", type=int, default=0)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--cores", type=int, default=64)
    ap.add_argument("--jobs", default="1,2", help="comma-separated --jobs values to run each job with")
    ap.add_argument("--max-shard-size", default="200MB")
    ap.add_argument("--only", default=None, help="comma-separated pieces of job labels: run only those jobs")
    args = ap.parse_args()
    job_counts = [int(j) for j in args.jobs.split(",")]
    qconv = str(Path(sys.executable).parent / "qconv")
    (HERE / ".cache").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=HERE / ".cache") as tmp:
        tmp = Path(tmp)
        src = tmp / "deepseek-v3-fp8"
        subprocess.run([sys.executable, HERE / "make_deepseek_v3_fp8.py", src, "--dense", str(args.dense),
                        "--moe", str(args.moe), "--experts", str(args.experts)], check=True)
        bf16 = tmp / "bf16"
        subprocess.run([qconv, "dequantize", src, bf16], check=True, capture_output=True)   # warm-up, and fp8's source
        jobs = [("dequantize -> bfloat16", src, [qconv, "dequantize"]),
                ("convert --to compressed-tensors-w8a8", src, [qconv, "convert", "--to", "compressed-tensors-w8a8"]),
                ("convert --to compressed-tensors-w8a8 --no-search", src,
                 [qconv, "convert", "--to", "compressed-tensors-w8a8", "--no-search"]),
                ("convert bf16 --to compressed-tensors-fp8", bf16, [qconv, "convert", "--to", "compressed-tensors-fp8"])]
        if args.only:
            wanted = args.only.split(",")
            jobs = [j for j in jobs if any(w in j[0] for w in wanted)]
        jobs = [(f"{label} --jobs {n}", source, [*cmd, "--jobs", str(n), "--max-shard-size", args.max_shard_size])
                for label, source, cmd in jobs for n in job_counts]
        rows, per_gb = [], {}
        for label, source, cmd in jobs:
            out, raw_out = tmp / "out", tmp / "raw"
            wall, rss, cpu = _best([cmd[0], cmd[1], source, out, *cmd[2:]], args.runs, out)
            label += f" ({len(list(out.glob('*.safetensors')))} shards)"
            moved_in, moved_out = _bytes(source), _bytes(out)
            ref = tmp / "ref"
            shutil.rmtree(ref, ignore_errors=True)
            os.rename(out, ref)
            raw_wall, _, _ = _best([sys.executable, "-c", RAW, source, ref, raw_out], args.runs, raw_out)
            shutil.rmtree(ref)
            shutil.rmtree(raw_out, ignore_errors=True)
            gb = moved_in / 1e9
            rows.append((label, f"{moved_in / 1e9:.2f} -> {moved_out / 1e9:.2f}", f"{wall:.1f}",
                         f"{(moved_in + moved_out) / wall / 1e9:.2f}", f"{raw_wall:.1f}", f"{wall / raw_wall:.1f}x",
                         f"{cpu / wall:.2f}", f"{rss / 2**20:.0f}"))
            per_gb[label] = (raw_wall / gb, max(0.0, wall - raw_wall) / gb, moved_out / moved_in)
    cores = os.cpu_count() or 1
    print(f"DeepSeek-V3-shaped FP8 ({args.dense} dense + {args.moe} MoE layers, {args.experts} experts each), "
          f"random e4m3 data; best of {args.runs}, sync before each run, warm read cache, {cores} CPUs\n")
    print(tabulate(rows, headers=["qconv (whole process)", "GB in -> out", "wall s", "GB/s", "raw copy s",
                                  "vs raw copy", "cores used", "peak RSS MiB"],
                   colalign=("left", "right", "right", "right", "right", "right", "right", "right")))
    print(f"\nExtrapolated to DeepSeek-V3 (671 B, {DEEPSEEK_V3_FP8_BYTES / 1e9:.0f} GB FP8) on one {args.cores}-core "
          f"machine with this machine's disk: I/O at the raw-copy rate measured here, the rest (compute) "
          f"divided by {args.cores} / {cores} cores:")
    for label, (io, compute, _) in per_gb.items():
        if label.startswith("convert bf16") or f"--jobs {job_counts[0]} " not in label:
            continue
        total = DEEPSEEK_V3_FP8_BYTES / 1e9 * (io + compute * cores / args.cores)
        print(f"  {label}: {total / 3600:.1f} h ({io:.2f} s/GB I/O + {compute:.1f} s/GB compute here)")
    print("\nPeer: llm-compressor's model_free_ptq beside the same qconv jobs on a float model of these shapes: "
          "benchmarks/bench_model_free_ptq.py (its environment: bin/setup llmcompressor).")


if __name__ == "__main__":
    main()
