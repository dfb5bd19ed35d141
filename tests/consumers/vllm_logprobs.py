"""vLLM's CPU build as a consumer of qconv's outputs: does a quantized checkpoint load, and does it compute
what its own float dequantization computes?

    .venv-vllm/bin/python tests/consumers/vllm_logprobs.py --out result.json QUANTIZED FLOAT [QUANTIZED FLOAT ...]

For each pair, QUANTIZED and then FLOAT (the float dequantization of the same file) are loaded by
``vllm.LLM`` (bf16 activations, eager). Every model is loaded by ONE worker process, one after another,
with vLLM's engine in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0): importing vLLM and its first model's
warm-up cost about 40 s on 2 cores, every later model about 2 s, where a process per model paid the 40 s
each time. A model vLLM refuses (a Python exception) is recorded and the worker goes on; a worker that dies
without a Python exception (the CPU build's occasional native abort) is a crash: a new worker takes over
at that model, which is tried once more. Each run reads the full next-token log-distribution at every
prompt position (prompt_logprobs over the whole vocabulary, plus the one generated token). The prompt is
the fixture's own: input_ids of oracle/logits.safetensors in QUANTIZED or FLOAT, else DEFAULT_IDS. Folders
with the same files (a float dequantization two pairs share) are loaded once.

What this CPU's vLLM can run. vLLM's CPU wheel ships three kernel libraries and loads one by the CPU's
flags (vllm/platforms/cpu.py: `_C` for AVX-512 with BF16, `_C_AVX512`, `_C_AVX2`); only the AVX-512 ones
have the weight-only int4 GEMM (`torch.ops._C.cpu_gemm_wna16`) that every W4A16 / GPTQ / AWQ checkpoint
needs. The worker probes that once (the report's "probe") before any model. A pair whose quantized model
vLLM refuses for want of that op, on a build the probe found without it, is "cannot_run_here": an
expected outcome named as such, neither a match nor a wrong answer nor a crash. `--isa avx2` makes vLLM
load its AVX2 library on any x86-64 CPU (every AVX-512 CPU runs AVX2 code), so that outcome is tested on
every machine (tests/consumers/test_vllm_cpu.py).

Per position the comparison takes the float run's top-5 tokens and their log-probabilities in the
quantized run; max_abs_logprob_diff is the largest |difference| over positions and those tokens;
top1_agreement is the share of positions whose argmax is the same token. A pair matches when it loaded,
max_abs_logprob_diff <= --tolerance, and every top-1 disagreement is a near-tie (the float run puts the
two tokens within --tolerance of each other). Exit 0 only if every pair matches; 3 if every pair that
did not match is cannot_run_here; 1 otherwise; 2 on a bad command line.

Why the default tolerance is 0.1. Both runs use bf16 activations; they differ in what multiplies them.
The quantized run takes (q - z) * scale with exact codes, in its own kernel's blocking and accumulation
order (CPUWNA16 "vec" for 4-bit weight-only; for W8A8 int8 GEMMs on activations quantized per token at
run time, which the float run does not do). The float run takes the fp16 dequantized weight rounded to
bf16, in torch's GEMM. Measured on the tiny fixtures (2 layers, vocab 512, 12 positions x the float run's
top 5; vLLM is deterministic here, the same numbers on every rerun): 4-bit weight-only pairs differ by
0.008 to 0.031 (GPTQ channel and g128, compressed-tensors sym and asym, AWQ; producers' files and
qconv's), W8A8 by 0.034 to 0.035. A real layout or convention error is far larger: the zero point off by
one in ONE of the 14 Linears gives 0.41 (0.59 in another), in all of them 2.6, AWQ's interleave ignored
3.4. 0.1 lies between the two, about 3x above the worst legitimate difference (room for other CPUs'
kernels: AMX, oneDNN builds) and 4x below the smallest error measured. Top-1 flips happen at near-ties
of this tiny random model (float gaps 0 to 0.016 seen), so a flip counts only where the float run's gap
between the two tokens exceeds the tolerance.
"""

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_IDS = [1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]   # < 512, the fixtures' vocabulary; same as their oracles
TOP_K = 5
DEFAULT_TOLERANCE = 0.1
DEFAULT_TIMEOUT_S = 600
W4A16_OP = "cpu_gemm_wna16"             # vLLM CPU's weight-only int4 GEMM (csrc/cpu), AVX-512 builds only
MARKER = "=== vllm_logprobs: model "     # the worker's log line before each model, so a crash is told by model


# ---------------------------------------------------------------------------------------------- worker
def _cpu_flags():
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return sorted(f for f in (m.group(1).split() if m else []) if f.startswith(("avx", "amx")))


def _probe(isa):
    """What this vLLM can run here: its kernel library (the one vllm.platforms.cpu loaded) and whether it
    has the W4A16 op. Taken once, before any model, from the ops vLLM registered, not from the CPU's name."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    libraries = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            name = line.rsplit("/", 1)[-1]
            if re.fullmatch(r"_C(_AVX2|_AVX512)?\.abi3\.so", name):
                libraries.add(name.split(".")[0])
    except OSError:
        pass
    return {"library": ",".join(sorted(libraries)) or None, "forced_isa": isa,
            "ops": {W4A16_OP: hasattr(torch.ops._C, W4A16_OP)}, "cpu_flags": _cpu_flags()}


def _batch_worker(plan_path, isa):
    """Load every model of the plan, one after another, in this process; each result (or refusal) is
    written whole and renamed into place, so the parent sees exactly the models that completed."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # the engine in this process: one import, one warm-up
    plan = json.loads(Path(plan_path).read_text())
    if isa == "avx2":
        # vllm/platforms/cpu.py picks _C_AVX2 when torch says the CPU lacks AVX-512; every x86-64 CPU
        # of this kind runs AVX2 code, so the AVX2 build's behaviour is reproduced on any of them.
        import torch
        torch.cpu._is_avx512_supported = lambda: False
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _write_whole(plan["probe"], _probe(isa))
    for job in plan["jobs"]:
        print(f"{MARKER}{job['tag']}: {job['model']}", flush=True)
        t0 = time.monotonic()
        llm = None
        try:
            llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=128, enforce_eager=True,
                      max_logprobs=-1, seed=0)
            load_s = time.monotonic() - t0
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1, logprobs=-1)
            t1 = time.monotonic()
            [result] = llm.generate([TokensPrompt(prompt_token_ids=list(job["ids"]))], params, use_tqdm=False)
            run_s = time.monotonic() - t1
        except Exception as exc:           # vLLM refused the model: said, never retried
            chain = _exception_chain(exc)
            print(f"refused: {chain[-1]}", flush=True)
            _write_whole(job["out"], {"error": chain[-1], "error_chain": chain})
            llm = None
            continue
        # prompt_logprobs[i] is the distribution of token i given tokens < i (None for i = 0); the
        # generated token's logprobs are the distribution after the whole prompt.
        dists = list(result.prompt_logprobs[1:]) + [result.outputs[0].logprobs[0]]
        positions = []
        for d in dists:
            row = [None] * (max(d) + 1)
            for tok, lp in d.items():
                row[tok] = float(lp.logprob)
            positions.append(row)
        _write_whole(job["out"], {"quant_method": _quant_method(llm), "load_s": round(load_s, 2),
                                  "run_s": round(run_s, 3), "positions": positions})
        llm = result = None


def _exception_chain(exc):
    """'Type: message' of an exception and its causes, outermost first (first lines only)."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).strip().splitlines()
        chain.append(f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    return chain


def _write_whole(path, doc):
    Path(path + ".part").write_text(json.dumps(doc))
    os.replace(path + ".part", path)


def _quant_method(llm):
    try:
        return llm.llm_engine.model_config.quantization
    except Exception:   # the attribute path moves between vLLM releases; the config file is the fallback
        return None


# ---------------------------------------------------------------------------------------------- parent
# "(Worker pid=17505) ERROR 12-03 11:53:39 [multiproc_executor.py:953] ValueError: Marlin does not ..."
_LOG_PREFIX = re.compile(r"^(?:\([^)]*pid=\d+\)\s*)?"
                         r"(?:(?:ERROR|WARNING|INFO|DEBUG|CRITICAL)\s+[\d-]+\s+[\d:.]+\s+\[[^\]]*\]\s*)?")
_ERROR_LINE = re.compile(r"^((?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception))(?::\s*(.*))?$")
_WRAPPERS = ("Engine core initialization failed", "EngineCore failed to start", "See root cause above",
             "WorkerProc initialization failed")


def one_line_error(log: str) -> str:
    """The innermost exception line of a log that is not a wrapper of vLLM's front end; else its last line."""
    found = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = _ERROR_LINE.match(_LOG_PREFIX.sub("", line.strip()))
        if m:
            name, message = m.group(1), (m.group(2) or "").strip()
            if re.search(r"validation errors? for", message) and i + 1 < len(lines):
                message += ": " + _LOG_PREFIX.sub("", lines[i + 1].strip())    # pydantic: the reason is next
            found.append(f"{name.rsplit('.', 1)[-1]}: {message}" if message else name.rsplit(".", 1)[-1])
    real = [e for e in found if not any(w in e for w in _WRAPPERS)]
    if real:
        return real[0]
    if found:
        return found[-1]
    tail = [line for line in lines if line.strip()]
    return tail[-1].strip() if tail else "no output"


def _config_quant_method(folder):
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (cfg.get("quantization_config") or {}).get("quant_method")


def _prompt_ids(*folders):
    for folder in folders:
        oracle = Path(folder) / "oracle" / "logits.safetensors"
        if oracle.is_file():
            from safetensors.numpy import load_file
            return [int(x) for x in load_file(str(oracle))["input_ids"].reshape(-1)]
    return list(DEFAULT_IDS)


def folder_key(folder) -> str:
    """A digest of every file vLLM reads from a folder (its oracle/ and qconv's model card, which vLLM never
    reads, left out): two folders with the same files are the same model, loaded once."""
    h = hashlib.sha256()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "oracle" not in p.relative_to(root).parts
                       and p.name not in ("README.md", "qconv-error.png")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def run_models(jobs, log_dir, timeout, isa=None, worker=None):
    """Run jobs [(tag, model, ids)] in one worker process, a new one after a crash. Returns
    ({tag: (result or None, error or None, seconds)}, probe or None).

    A worker that dies without writing its model's result, with no Python exception (vLLM's occasional
    native abort, "terminate called without an active exception", exit -6, about once in 5 to 40 loads),
    crashed: a new worker starts at that model, which is tried once more, and the result says so
    ("attempts": 2, "crashes": [{"exit_status", "error"}]). A refusal (a Python exception, written by the
    worker as the model's result) is never retried, and neither is a wrong answer: the comparison only
    ever sees a run that completed. A model that runs past `timeout` seconds is killed with its worker and
    reported as timed out; the rest go on in a new worker."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    pending = list(jobs)
    results, crashes, probe = {}, {tag: [] for tag, _, _ in jobs}, None
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # On CPUs with AMX, vLLM would run 4-bit weights with int8 activations (W4A8); the same W4A16 kernel
    # on every machine keeps the measured noise, and so the tolerance, the same. Set, not defaulted: an
    # inherited VLLM_CPU_INT4_W4A8=1 must not change what is measured. No usage reports, no hub look-ups.
    env.update(VLLM_CPU_INT4_W4A8="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    launch = 0
    while pending:
        launch += 1
        plan = {"probe": str(log_dir / f"probe-{launch}.json"),
                "jobs": [{"tag": tag, "model": str(model), "ids": list(ids), "out": str(log_dir / f"{tag}.json")}
                         for tag, model, ids in pending]}
        for job in plan["jobs"]:
            Path(job["out"]).unlink(missing_ok=True)
        plan_path = log_dir / f"plan-{launch}.json"
        plan_path.write_text(json.dumps(plan, indent=1))
        log = log_dir / f"worker-{launch}.log"
        # worker: the command that runs a plan (tests/consumers/test_consumer_harness.py passes stand-ins)
        cmd = [*(worker or [sys.executable, os.path.abspath(__file__)]), "--batch", str(plan_path)]
        if isa:
            cmd += ["--isa", isa]
        done, timed_out = 0, False
        since = time.monotonic()
        with open(log, "w") as f:
            # A session of its own, so a timeout ends the worker's engine processes too (by group id).
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            while True:
                rc = proc.poll()
                while done < len(pending) and Path(plan["jobs"][done]["out"]).is_file():
                    tag = pending[done][0]
                    now = time.monotonic()
                    result = json.loads(Path(plan["jobs"][done]["out"]).read_text())
                    results[tag] = _settle(result, crashes[tag], round(now - since, 1))
                    since, done = now, done + 1
                if rc is not None or done == len(pending):
                    break
                if time.monotonic() - since > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    timed_out = True
                    break
                time.sleep(0.1)
            if done == len(pending) and proc.poll() is None:
                try:
                    proc.wait(timeout=60)           # the worker ends after its last model
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if probe is None and Path(plan["probe"]).is_file():
            probe = json.loads(Path(plan["probe"]).read_text())
        if done == len(pending):
            break
        tag = pending[done][0]
        seconds = round(time.monotonic() - since, 1)
        if timed_out:
            results[tag] = (None, f"timed out after {timeout:g} s", seconds)
            pending = pending[done + 1:]
            continue
        text = log.read_text(errors="replace")
        error = one_line_error(text[text.rfind(MARKER):] if MARKER in text else text)
        crashes[tag].append({"exit_status": proc.returncode, "error": error})
        if len(crashes[tag]) == 2:
            first, second = crashes[tag]
            results[tag] = (None, f"crashed twice (exit {first['exit_status']}, then {second['exit_status']}): "
                                  f"{error}", seconds)
            pending = pending[done + 1:]
        else:
            pending = pending[done:]            # the crashed model first, in a new worker
    return results, probe


def _settle(result, crashes, seconds):
    if "error" in result:
        return None, result["error"], seconds
    return {**result, "attempts": len(crashes) + 1, "crashes": list(crashes)}, None, seconds


def cannot_run_here(error, probe):
    """The reason vLLM cannot run a model on this CPU, when its own error is the missing W4A16 op and the
    probe found its build without it; else None."""
    if not error or W4A16_OP not in error or not probe or probe["ops"].get(W4A16_OP, True):
        return None
    forced = " (forced with --isa avx2)" if probe.get("forced_isa") else ""
    return (f"vLLM CPU cannot run W4A16 on this CPU: its {probe['library']} kernel library{forced} has no "
            f"torch.ops._C.{W4A16_OP}, which only its AVX-512 builds have")


def compare(quant_positions, float_positions, tolerance):
    max_diff = 0.0
    agree = 0
    mismatches = []
    for pos, (q, f) in enumerate(zip(quant_positions, float_positions)):
        fq = [(lp, tok) for tok, lp in enumerate(f) if lp is not None]
        top = sorted(fq, reverse=True)[:TOP_K]
        for lp, tok in top:
            qlp = q[tok] if tok < len(q) and q[tok] is not None else float("-inf")
            max_diff = max(max_diff, abs(qlp - lp))
        q_top1 = max((lp, tok) for tok, lp in enumerate(q) if lp is not None)[1]
        f_top1 = top[0][1]
        if q_top1 == f_top1:
            agree += 1
        else:
            gap = top[0][0] - (f[q_top1] if q_top1 < len(f) and f[q_top1] is not None else float("-inf"))
            mismatches.append({"position": pos, "float_top1": f_top1, "quantized_top1": q_top1,
                               "float_gap": round(gap, 5), "near_tie": gap <= tolerance})
    n = min(len(quant_positions), len(float_positions))
    return max_diff, (agree / n if n else 0.0), mismatches


def compare_pairs(pairs, log_dir, tolerance, timeout, isa=None, worker=None):
    """pairs [(quantized, float)] -> (report entries, probe). Every distinct model is loaded once, in
    one worker, in pair order (each quantized model, then its float twin)."""
    ids = [_prompt_ids(q, f) for q, f in pairs]
    keys, jobs = {}, []

    def tag_of(folder, prompt, side, i):
        key = (folder_key(folder), tuple(prompt))
        if key not in keys:
            keys[key] = f"{i:02d}-{side}"
            jobs.append((keys[key], folder, prompt))
        return keys[key]

    tags = [(tag_of(q, p, "quantized", i), tag_of(f, p, "float", i)) for i, ((q, f), p) in enumerate(zip(pairs, ids))]
    runs, probe = run_models(jobs, log_dir, timeout, isa, worker)
    entries = []
    for (qpath, fpath), prompt, (qt, ft) in zip(pairs, ids, tags):
        entry = {"quantized": str(qpath), "float": str(fpath), "loaded": False, "error": None,
                 "cannot_run_here": None, "max_abs_logprob_diff": None, "top1_agreement": None,
                 "quant_method": _config_quant_method(qpath), "matched": False, "prompt_ids": prompt}
        q, q_err, q_s = runs[qt]
        entry["quantized_seconds"] = q_s
        if q is None:
            entry["error"] = q_err
            entry["cannot_run_here"] = cannot_run_here(q_err, probe)
        else:
            entry["quant_method"] = q["quant_method"] or entry["quant_method"]
            entry.update(quantized_load_s=q["load_s"], quantized_run_s=q["run_s"],
                         quantized_attempts=q["attempts"], quantized_crashes=q["crashes"])
            f, f_err, f_s = runs[ft]
            entry["float_seconds"] = f_s
            if f is None:
                entry["error"] = f"float model: {f_err}"
            else:
                entry.update(loaded=True, float_load_s=f["load_s"], float_run_s=f["run_s"],
                             float_attempts=f["attempts"], float_crashes=f["crashes"])
                diff, top1, mismatches = compare(q["positions"], f["positions"], tolerance)
                entry["max_abs_logprob_diff"] = round(diff, 6)
                entry["top1_agreement"] = round(top1, 4)
                entry["top1_mismatches"] = mismatches
                entry["matched"] = diff <= tolerance and all(m["near_tie"] for m in mismatches)
        entries.append(entry)
    return entries, probe


def _status(entry):
    if entry["loaded"]:
        return "match" if entry["matched"] else "MISMATCH"
    return "CANNOT RUN HERE" if entry["cannot_run_here"] else "NOT LOADED"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"largest allowed |logprob difference| (default {DEFAULT_TOLERANCE})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds one model may take to load and run (the first includes importing vLLM)")
    p.add_argument("--logs", help="folder for the workers' logs and results (default: beside --out)")
    p.add_argument("--isa", choices=["avx2"], help="make vLLM load its AVX2 kernel library on this CPU")
    p.add_argument("--batch", help=argparse.SUPPRESS)
    p.add_argument("models", nargs="*", metavar="QUANTIZED FLOAT")
    args = p.parse_args(argv)

    if args.batch:
        _batch_worker(args.batch, args.isa)
        return 0
    if not args.out or not args.models or len(args.models) % 2:
        p.error("needs --out and an even number of folders: QUANTIZED FLOAT [QUANTIZED FLOAT ...]")

    out = Path(args.out)
    log_dir = Path(args.logs) if args.logs else out.with_name(out.stem + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    pairs = [(args.models[i], args.models[i + 1]) for i in range(0, len(args.models), 2)]
    t0 = time.monotonic()
    entries, probe = compare_pairs(pairs, log_dir, args.tolerance, args.timeout, args.isa)
    for entry in entries:
        flips = entry.get("top1_mismatches") or []
        print(f"{_status(entry)}: {entry['quantized']} vs {entry['float']}: quant_method={entry['quant_method']} "
              f"max|dlogprob|={entry['max_abs_logprob_diff']} top1={entry['top1_agreement']}"
              + (f" (flips at float gaps {[m['float_gap'] for m in flips]})" if flips else "")
              + f" load s: quantized={entry.get('quantized_load_s')} float={entry.get('float_load_s')}"
              + (f" error={entry['error']}" if entry["error"] else "")
              + "".join(f" RETRIED: the {side} run crashed (exit {c['exit_status']}: {c['error']})"
                        for side in ("quantized", "float") for c in entry.get(f"{side}_crashes") or []))
    print(f"probe: {json.dumps(probe)}; {len(pairs)} pairs in {time.monotonic() - t0:.0f} s")
    out.write_text(json.dumps({"tolerance": args.tolerance, "probe": probe, "pairs": entries}, indent=2) + "\n")
    if all(e["matched"] for e in entries):
        return 0
    return 3 if all(e["matched"] or e["cannot_run_here"] for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
