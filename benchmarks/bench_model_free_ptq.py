"""Benchmark (issue 17, §3): `qconv convert` of a float checkpoint to compressed-tensors FP8 / W8A8 beside
llm-compressor's `model_free_ptq`, its peer for "quantize a big checkpoint without loading it" (data-free
PTQ straight on the safetensors files), same model, same machine, one run each:

  * `qconv convert SRC OUT --to compressed-tensors-fp8`                 vs model_free_ptq scheme FP8_DYNAMIC
  * `qconv convert SRC OUT --to compressed-tensors-w8a8`                vs model_free_ptq scheme W8A8
  * `qconv convert SRC OUT --to compressed-tensors-fp8 --block-size 128x128` vs model_free_ptq FP8_BLOCK

(model_free_ptq takes all three: its validate_config refuses only schemes with static activations, and
these quantize activations dynamically.) Each job is a whole process, qconv by .venv's `qconv`,
model_free_ptq by the llm-compressor environment's python (llmcompressor 0.14.0.1, compressed-tensors
0.19.0, torch 2.13.0+cpu), with ``max_workers`` = the CPU count, ``device="cpu"`` and the ignore list of
llm-compressor's own DeepSeek / GLM / Kimi model_free_ptq examples (lm_head, embed_tokens and the MoE router
``re:.*mlp\\.gate$``; qconv leaves the router in float by itself). Note that on CPU model_free_ptq runs its
shards one after another whatever ``max_workers`` is (compressed-tensors' exec_jobs_dynamic runs CPU jobs
sequentially; the workers only spread shards over GPUs). Printed for each: wall seconds, the share of the
CPUs used, peak RSS (wait4), the ratios qconv / model_free_ptq, and the raw copy of the same bytes (plain
file reads of the source, plain writes of the output's size: bench_convert's RAW) as a floor. Then the two
outputs are compared tensor by tensor: every name on either side, byte-equal or not; for the quantized
modules, how many weight codes and scales differ, the largest difference of the dequantized weights
relative to the module's largest weight, and each side's error against the float source (relative
Frobenius norm); and the two quantization_configs key by key.

The model: a float checkpoint (any safetensors folder). Without SRC the benchmark makes one: the
DeepSeek-V3-shaped FP8 checkpoint of make_deepseek_v3_fp8.py (real names and shapes; default one dense
layer and one MoE layer with one routed expert, the shared expert and the router: 0.86 B parameters,
random e4m3 codes, every finite byte) dequantized by qconv to bfloat16 (1.72 GB, one shard). Setup, once
per machine (the llm-compressor environment lives in the machine cache, outside the repository)::

    bin/setup test              # .venv
    bin/setup llmcompressor     # ${QCONV_CACHE:-~/.cache/qconv}/venv-llmcompressor

    .venv/bin/python benchmarks/bench_model_free_ptq.py [SRC] [--work DIR] [--jobs fp8,w8a8,fp8-block]
                                                       [--dense 1] [--moe 1] [--experts 1]
                                                       [--qconv-jobs 1,2] [--max-shard-size 200MB]

--qconv-jobs adds a row per value: qconv with --jobs N, its output in shards of --max-shard-size written
by N worker processes (peak RSS: the largest process). The comparison counts the modules whose error
against the float source is at or below the peer's (model_free_ptq quantizes by min-max: its error is
round-to-nearest's).

--work keeps the outputs there (default: a temporary folder under benchmarks/.cache, removed). Sync
before each run, the source in the page cache (read once before the first run). Prints figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_fp8_scale  # noqa: E402 - its whole-process runner (wall, peak RSS, CPU s), bench_convert's RAW
from bench_convert import RAW  # noqa: E402

CACHE = Path(os.environ.get("QCONV_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qconv")
PEER_PYTHON = CACHE / "venv-llmcompressor" / "bin" / "python"
IGNORE = ["lm_head", r"re:.*mlp\.gate$", "model.embed_tokens"]

# (label, qconv convert options, model_free_ptq scheme)
JOBS = {"fp8": ("FP8 per channel", ["--to", "compressed-tensors-fp8"], "FP8_DYNAMIC"),
        "w8a8": ("int8 W8A8 per channel", ["--to", "compressed-tensors-w8a8"], "W8A8"),
        "fp8-block": ("FP8 128x128 blocks", ["--to", "compressed-tensors-fp8", "--block-size", "128x128"], "FP8_BLOCK")}

# model_free_ptq in its own environment. Its log (loguru, tqdm) goes to a file, not to a pipe nobody reads.
PEER = r"""
import json, os, sys
src, out, scheme, log, workers, ignore = sys.argv[1:7]
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(fd, 2)
from llmcompressor import model_free_ptq
model_free_ptq(src, out, scheme=scheme, ignore=json.loads(ignore), max_workers=int(workers), device="cpu")
"""


def _run(cmd, out: Path, log: Path | None = None):
    """(wall s, peak RSS bytes, CPU s) of one whole process writing ``out`` (removed first)."""
    shutil.rmtree(out, ignore_errors=True)
    try:
        return bench_fp8_scale._run([str(c) for c in cmd])
    except SystemExit:
        if log is not None and log.exists():
            print(log.read_text()[-4000:], file=sys.stderr)
        raise


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _make_model(work: Path, qconv: str, dense: int, moe: int, experts: int) -> Path:
    fp8, bf16 = work / "deepseek-v3-fp8", work / "deepseek-v3-bf16"
    if not (bf16 / "config.json").exists():
        shutil.rmtree(fp8, ignore_errors=True)
        shutil.rmtree(bf16, ignore_errors=True)
        subprocess.run([sys.executable, HERE / "make_deepseek_v3_fp8.py", fp8, "--dense", str(dense),
                        "--moe", str(moe), "--experts", str(experts)], check=True)
        subprocess.run([qconv, "dequantize", fp8, bf16, "--dtype", "bfloat16"], check=True, capture_output=True)
        shutil.rmtree(fp8)
    return bf16


# ---------------------------------------------------------------------------------------------------
# Comparing two outputs (imported only after every timed run: this process stays small while it forks)

def _tensors(folder: Path) -> dict:
    from qconv.formats.storage.safetensors_header import read_header

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(read_header(f).tensors)
    return out


def _equal_count(a, b, chunk: int = 1 << 26) -> tuple[bool, int]:
    """(bytes equal, how many elements differ) of two tensors of one dtype and shape, read in chunks."""
    import numpy as np
    from qconv.formats.storage.tensor_io import NUMPY

    dtype = np.dtype(NUMPY.get(a.dtype, np.uint8))
    differ, pos = 0, 0
    with open(a.file, "rb", buffering=0) as fa, open(b.file, "rb", buffering=0) as fb:
        fa.seek(a.offset)
        fb.seek(b.offset)
        while pos < a.nbytes:
            n = min(chunk, a.nbytes - pos)
            x, y = np.frombuffer(fa.read(n), dtype=dtype), np.frombuffer(fb.read(n), dtype=dtype)
            differ += int(np.count_nonzero(x != y))
            pos += n
    return differ == 0, differ


def _block(config: dict) -> tuple[int, int] | None:
    for group in config.get("config_groups", {}).values():
        block = (group.get("weights") or {}).get("block_structure")
        if block:
            return int(block[0]), int(block[1])
    return None


def _dequant(codes, scale_info, rows: tuple[int, int], block):
    """float32 rows r0:r1 of a module: codes (e4m3 bytes or int8) x its per-channel or per-block scale."""
    import numpy as np
    from qconv.formats.storage.tensor_io import read_array, to_float32

    r0, r1 = rows
    if block is None:
        s = to_float32(read_array(scale_info, rows=rows), scale_info.dtype).reshape(r1 - r0, 1)
    else:
        b0, b1 = block
        s = to_float32(read_array(scale_info, rows=(r0 // b0, -(-r1 // b0))), scale_info.dtype)
        s = s[np.arange(r0, r1) // b0 - r0 // b0][:, np.arange(codes.shape[1]) // b1]
    if codes.dtype == np.int8:
        w = codes.astype(np.float32)
    else:
        w = to_float32(codes, "F8_E4M3")
    return w * s


def _value_count(a, b) -> int:
    """How many values of two float tensors of one shape (scales, here) differ, whatever their dtypes."""
    import numpy as np
    from qconv.formats.storage.tensor_io import read_array, to_float32

    return int(np.count_nonzero(to_float32(read_array(a), a.dtype) != to_float32(read_array(b), b.dtype)))


def _module_diff(src, mine, peer, block_q, block_p) -> tuple[float, float, float, int]:
    """(max |qconv - peer| / max |peer| of the dequantized weights, rel. error of qconv, of the peer,
    how many differing codes decode to the same value) of one module, by windows of rows (a multiple of
    the block height)."""
    import numpy as np
    from qconv.formats.storage.tensor_io import read_array, to_float32

    w_info, s_q, s_p = src, mine, peer
    out, inp = w_info.shape
    step = max(128, ((1 << 24) // max(inp, 1)) // 128 * 128)
    diffs, refs = [], []
    err_q = err_p = norm = 0.0
    same_value = 0
    for r0 in range(0, out, step):
        r1 = min(out, r0 + step)
        w = to_float32(read_array(w_info, rows=(r0, r1)), w_info.dtype)
        cq, cp = read_array(s_q["weight"], rows=(r0, r1)), read_array(s_p["weight"], rows=(r0, r1))
        q = _dequant(cq, s_q["weight_scale"], (r0, r1), block_q)
        p = _dequant(cp, s_p["weight_scale"], (r0, r1), block_p)
        same_value += int(np.count_nonzero((cq != cp) & (q == p)))
        diffs.append(np.max(np.abs(q - p)))            # NaN, if any, propagates
        refs.append(np.max(np.abs(p)))
        err_q += float(np.sum((q.astype(np.float64) - w) ** 2))
        err_p += float(np.sum((p.astype(np.float64) - w) ** 2))
        norm += float(np.sum(w.astype(np.float64) ** 2))
    max_diff, max_ref = float(np.max(diffs)), float(np.max(refs))
    return (max_diff / max_ref if max_ref else max_diff), (err_q / norm) ** 0.5, (err_p / norm) ** 0.5, same_value


def _flat(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, d


def compare(src: Path, mine: Path, peer: Path) -> None:
    from tabulate import tabulate

    a, b, s = _tensors(mine), _tensors(peer), _tensors(src)
    qc_q = json.loads((mine / "config.json").read_text()).get("quantization_config", {})
    qc_p = json.loads((peer / "config.json").read_text()).get("quantization_config", {})
    only_q, only_p = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    both = [n for n in a if n in b]
    equal, rows = 0, []
    modules: dict[str, dict] = {}
    for name in both:
        x, y = a[name], b[name]
        module, _, leaf = name.rpartition(".")
        quantized = (leaf in ("weight", "weight_scale") and f"{module}.weight_scale" in a
                     and f"{module}.weight_scale" in b)
        if x.shape != y.shape or (x.dtype != y.dtype and not (quantized and leaf == "weight_scale")):
            rows.append((name, f"{x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}", "", ""))
            continue
        if x.dtype == y.dtype:
            same, differ = _equal_count(x, y)
            equal += same
        else:                                            # scales stored in other dtypes: compare values
            differ = _value_count(x, y)
            modules.setdefault(module, {})["dtypes"] = f"{x.dtype} vs {y.dtype}"
        if quantized:
            modules.setdefault(module, {})[leaf] = differ
        elif not same:
            rows.append((name, f"{differ:,} of {x.numel:,} differ", "", ""))
    print(f"  tensors: {len(a)} (qconv) / {len(b)} (model_free_ptq); {len(both)} on both sides, "
          f"{equal} byte-identical" + (f"; only qconv: {only_q}" if only_q else "")
          + (f"; only model_free_ptq: {only_p}" if only_p else ""))
    block_q, block_p = _block(qc_q), _block(qc_p)
    table, worst, at_or_below = [], (0.0, ""), 0
    codes_total = codes_differ = scales_total = scales_differ = same_total = 0
    dtypes = set()
    for module, leaves in modules.items():
        wq, sq = a[f"{module}.weight"], a[f"{module}.weight_scale"]
        codes_total += wq.numel
        scales_total += sq.numel
        codes_differ += leaves.get("weight", 0)
        scales_differ += leaves.get("weight_scale", 0)
        if "dtypes" in leaves:
            dtypes.add(leaves["dtypes"])
        if not any(leaves.get(k) for k in ("weight", "weight_scale", "dtypes")):
            continue
        rel, err_q, err_p, same_value = _module_diff(s[f"{module}.weight"],
                                         {"weight": wq, "weight_scale": sq},
                                         {"weight": b[f"{module}.weight"], "weight_scale": b[f"{module}.weight_scale"]},
                                         block_q, block_p)
        same_total += same_value
        worst = max(worst, (rel, module))
        at_or_below += err_q <= err_p
        table.append((module, f"{leaves.get('weight', 0):,} / {wq.numel:,}", f"{same_value:,}",
                      f"{leaves.get('weight_scale', 0):,} / {sq.numel:,}", f"{rel:.3g}", f"{err_q:.5f}", f"{err_p:.5f}"))
    print(f"  quantized modules: {len(modules)}, byte-identical: {len(modules) - len(table)}; codes differing: "
          f"{codes_differ:,} of {codes_total:,} ({same_total:,} of them decode to the same value); "
          f"scale values differing: {scales_differ:,} of {scales_total:,}"
          + (f"; scale dtypes {', '.join(sorted(dtypes))} (qconv vs model_free_ptq)" if dtypes else ""))
    if table:
        print(f"  largest |qconv - peer| / max |W| (dequantized): {worst[0]:.3g} ({worst[1]}); modules whose error "
              f"against the float source is at or below the peer's: {at_or_below} of {len(table)}")
        print(tabulate(table, headers=["module", "codes differing", "same value", "scales differing", "max |dW|/max|W|",
                                       "rel. err qconv", "rel. err peer"], disable_numparse=True))
    for row in rows:
        print(f"  {row[0]}: {row[1]}")
    fq, fp = dict(_flat(qc_q)), dict(_flat(qc_p))
    for group in (qc_q.get("config_groups") or {}):       # group names are labels: compare by position
        fq = {k.replace(f"config_groups.{group}.", "config_groups.<0>."): v for k, v in fq.items()}
    for group in (qc_p.get("config_groups") or {}):
        fp = {k.replace(f"config_groups.{group}.", "config_groups.<0>."): v for k, v in fp.items()}
    diff = [(k, fq.get(k, "(absent)"), fp.get(k, "(absent)")) for k in sorted(set(fq) | set(fp))
            if fq.get(k, "(absent)") != fp.get(k, "(absent)")]
    groups = (list(qc_q.get("config_groups") or {}), list(qc_p.get("config_groups") or {}))
    print(f"  quantization_config: group names {groups[0]} vs {groups[1]}; other keys that differ:"
          + ("" if diff else " none"))
    for k, x, y in diff:
        print(f"    {k}: {json.dumps(x)} (qconv) vs {json.dumps(y)} (model_free_ptq)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", nargs="?", type=Path, help="float checkpoint folder (default: made, see above)")
    ap.add_argument("--work", type=Path, help="keep the made model and the outputs here")
    ap.add_argument("--jobs", default="fp8,w8a8,fp8-block")
    ap.add_argument("--dense", type=int, default=1)
    ap.add_argument("--moe", type=int, default=1)
    ap.add_argument("--experts", type=int, default=1)
    ap.add_argument("--qconv-jobs", default="1", help="comma-separated qconv --jobs values, one row each (>1: "
                                                      "output shards of --max-shard-size written by worker processes)")
    ap.add_argument("--max-shard-size", default="200MB", help="qconv's output shards where --jobs > 1")
    args = ap.parse_args()
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    for j in jobs:
        if j not in JOBS:
            ap.error(f"--jobs: {j!r} is not one of {', '.join(JOBS)}")
    qconv = str(Path(sys.executable).parent / "qconv")
    have_peer = PEER_PYTHON.exists()
    if not have_peer:
        print(f"model_free_ptq: {PEER_PYTHON} is missing (bin/setup llmcompressor makes it); qconv only\n")
    (HERE / ".cache").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=HERE / ".cache") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        src = args.src or _make_model(work, qconv, args.dense, args.moe, args.experts)
        cores = os.cpu_count() or 1
        raw_out = work / "raw"
        results = {}
        # Warm-up: the source into the page cache (one untimed raw read + write).
        shutil.rmtree(raw_out, ignore_errors=True)
        raw_out.mkdir()
        bench_fp8_scale._run([sys.executable, "-c", RAW, str(src), str(src), str(raw_out)])
        for job in jobs:
            label, options, scheme = JOBS[job]
            mine, peer = work / f"qconv-{job}", work / f"model_free_ptq-{job}"
            parallel = {}
            for n in [int(v) for v in args.qconv_jobs.split(",") if int(v) > 1]:
                out_n = work / f"qconv-{job}-jobs{n}"
                parallel[n] = _run([qconv, "convert", src, out_n, *options, "--jobs", n,
                                    "--max-shard-size", args.max_shard_size], out_n)
                shutil.rmtree(out_n)
            q = _run([qconv, "convert", src, mine, *options], mine)
            p = None
            if have_peer:
                log = work / f"model_free_ptq-{job}.log"
                p = _run([PEER_PYTHON, "-c", PEER, src, peer, scheme, log, str(cores), json.dumps(IGNORE)], peer, log)
            shutil.rmtree(raw_out, ignore_errors=True)
            raw_out.mkdir()
            raw = bench_fp8_scale._run([sys.executable, "-c", RAW, str(src), str(mine), str(raw_out)])
            shutil.rmtree(raw_out, ignore_errors=True)
            results[job] = (q, p, raw, _bytes(src), _bytes(mine), _bytes(peer) if p else 0, parallel)
        from tabulate import tabulate

        print(f"{src.name}: {_bytes(src) / 1e9:.2f} GB of float safetensors; one run each, sync before each run, "
              f"warm read cache, {cores} CPUs; model_free_ptq: llmcompressor in {PEER_PYTHON.parent.parent}, "
              f"max_workers={cores}, device cpu, ignore {IGNORE}\n")
        table = []
        for job, (q, p, raw, gb_in, gb_q, gb_p, parallel) in results.items():
            label, options, scheme = JOBS[job]
            for n, run in [(1, q), *parallel.items()]:
                table.append((f"qconv convert {' '.join(options)}" + (f" --jobs {n}" if parallel else ""),
                              f"{gb_in / 1e9:.2f} -> {gb_q / 1e9:.2f}", f"{run[0]:.1f}", f"{run[0] / raw[0]:.1f}x",
                              f"{run[2] / run[0]:.2f}", f"{run[1] / 2**20:,.0f}",
                              f"{run[0] / p[0]:.2f}x" if p else "", f"{run[1] / p[1]:.2f}x" if p else ""))
            if p:
                table.append((f"model_free_ptq scheme={scheme}", f"{gb_in / 1e9:.2f} -> {gb_p / 1e9:.2f}",
                              f"{p[0]:.1f}", f"{p[0] / raw[0]:.1f}x", f"{p[2] / p[0]:.2f}", f"{p[1] / 2**20:,.0f}",
                              "", ""))
            table.append(("  raw copy of the same bytes", "", f"{raw[0]:.1f}", "1.0x", "", f"{raw[1] / 2**20:,.0f}",
                          "", ""))
        print(tabulate(table, headers=["whole process", "GB in -> out", "wall s", "vs raw copy", "cores used",
                                       "peak RSS MiB", "time qconv/peer", "RSS qconv/peer"],
                       colalign=("left", "right", "right", "right", "right", "right", "right", "right"),
                       disable_numparse=True))
        if have_peer:
            for job in results:
                label, options, scheme = JOBS[job]
                print(f"\n{label}: qconv {' '.join(options)} vs model_free_ptq {scheme}")
                compare(src, work / f"qconv-{job}", work / f"model_free_ptq-{job}")


if __name__ == "__main__":
    main()
