"""vLLM's CPU build as a consumer of qconv's outputs: does a quantized checkpoint load, and does it compute
what its own float dequantization computes?

    .venv-vllm/bin/python tests/consumers/vllm_logprobs.py --out result.json QUANTIZED FLOAT [QUANTIZED FLOAT ...]

For each pair, QUANTIZED and then FLOAT (the float dequantization of the same file) are loaded by
``vllm.LLM`` (bf16 activations, eager), each in a subprocess of its own (vLLM does not reliably free an
engine, and a crash or refusal of one model must not stop the rest). Each run reads the full next-token
log-distribution at every prompt position (prompt_logprobs over the whole vocabulary, plus the one
generated token). The prompt is the fixture's own: input_ids of oracle/logits.safetensors in QUANTIZED or
FLOAT, else DEFAULT_IDS. A folder named in several pairs is loaded once.

Per position the comparison takes the float run's top-5 tokens and their log-probabilities in the
quantized run; max_abs_logprob_diff is the largest |difference| over positions and those tokens;
top1_agreement is the share of positions whose argmax is the same token. A pair matches when it loaded,
max_abs_logprob_diff <= --tolerance, and every top-1 disagreement is a near-tie (the float run puts the
two tokens within --tolerance of each other). Exit 0 only if every pair matches; 1 otherwise; 2 on a bad
command line.

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


# ---------------------------------------------------------------------------------------------- worker
def _worker(model, ids, out):
    """Load MODEL in vLLM and write {quant_method, load_s, positions: [[logprob per token id] ...]}."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="bfloat16", max_model_len=128, enforce_eager=True, max_logprobs=-1,
              seed=0)
    load_s = time.monotonic() - t0
    quant_method = _quant_method(llm)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1, logprobs=-1)
    t1 = time.monotonic()
    [result] = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
    run_s = time.monotonic() - t1
    # prompt_logprobs[i] is the distribution of token i given tokens < i (None for i = 0); the generated
    # token's logprobs are the distribution after the whole prompt.
    dists = list(result.prompt_logprobs[1:]) + [result.outputs[0].logprobs[0]]
    positions = []
    for d in dists:
        size = max(d) + 1
        row = [None] * size
        for tok, lp in d.items():
            row[tok] = float(lp.logprob)
        positions.append(row)
    # Written whole and renamed, so a result file is complete even if the process dies afterwards.
    Path(out + ".part").write_text(json.dumps({"quant_method": quant_method, "load_s": round(load_s, 2),
                                               "run_s": round(run_s, 3), "positions": positions}))
    os.replace(out + ".part", out)
    try:    # stop the engine process explicitly rather than in interpreter teardown
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def _quant_method(llm):
    try:
        cfg = llm.llm_engine.model_config
        return cfg.quantization
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
    """vLLM's own reason from a failed run's output: the innermost exception line that is not the
    'Engine core initialization failed' wrapper the front end raises after its engine process died."""
    return _errors(log)[0]


def _errors(log: str):
    """(one-line reason, whether any Python exception was logged at all)."""
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
        return real[0], True
    if found:
        return found[-1], True
    tail = [line for line in lines if line.strip()]
    return (tail[-1].strip() if tail else "no output"), False


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


def run_model(model, ids, log_dir, tag, timeout, worker=None):
    """One model in a subprocess of its own: (result dict or None, error line or None, seconds).

    A run that dies without any Python exception (the CPU build's occasional native abort, e.g.
    "terminate called without an active exception" or SIGABRT, exit -6, seen about once in 5 to 40 loads)
    is a crash, not an answer: it is tried once more, and the result says so ("attempts": 2, "crashes":
    [{"exit_status", "error"}]). A refusal (a Python exception) is never retried, and neither is a wrong
    answer: the comparison only ever sees a run that completed."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # On CPUs with AMX, vLLM would run 4-bit weights with int8 activations (W4A8); the same W4A16 kernel
    # on every machine keeps the measured noise, and so the tolerance, the same. Set, not defaulted: an
    # inherited VLLM_CPU_INT4_W4A8=1 must not change what is measured. No usage reports, no hub look-ups.
    env.update(VLLM_CPU_INT4_W4A8="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    t0 = time.monotonic()
    crashes = []
    for attempt in (1, 2):
        suffix = "" if attempt == 1 else f"-attempt{attempt}"
        out = Path(log_dir) / f"{tag}{suffix}.json"
        log = Path(log_dir) / f"{tag}{suffix}.log"
        out.unlink(missing_ok=True)
        # worker: the command that loads one model (tests/consumers/test_consumer_harness.py passes stand-ins)
        cmd = [*(worker or [sys.executable, os.path.abspath(__file__), "--worker"]), str(model), "--ids",
               ",".join(map(str, ids)), "--worker-out", str(out)]
        with open(log, "w") as f:
            # A session of its own, so a timeout ends the worker's engine processes too (by group id).
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        seconds = round(time.monotonic() - t0, 1)
        if out.is_file():           # complete (renamed into place); a crash in teardown does not spoil it
            result = json.loads(out.read_text())
            result["attempts"] = attempt
            result["crashes"] = crashes
            if rc != 0:
                result["exit_status"] = rc
            return result, None, seconds
        if rc is None:
            return None, f"timed out after {timeout} s", seconds
        error, python_error = _errors(log.read_text(errors="replace"))
        if python_error or attempt == 2:
            return None, (error if attempt == 1 else f"crashed twice (exit {crashes[0]['exit_status']}, "
                                                     f"then {rc}): {error}"), seconds
        crashes.append({"exit_status": rc, "error": error})


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"largest allowed |logprob difference| (default {DEFAULT_TOLERANCE})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per model load+run")
    p.add_argument("--logs", help="folder for each model's vLLM log (default: beside --out)")
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("models", nargs="*", metavar="QUANTIZED FLOAT")
    args = p.parse_args(argv)

    if args.worker:
        _worker(args.worker, [int(x) for x in args.ids.split(",")], args.worker_out)
        return 0
    if not args.out or not args.models or len(args.models) % 2:
        p.error("needs --out and an even number of folders: QUANTIZED FLOAT [QUANTIZED FLOAT ...]")

    out = Path(args.out)
    log_dir = Path(args.logs) if args.logs else out.with_name(out.stem + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    pairs = []
    runs = {}   # (folder, prompt) -> run_model's answer: a folder named in several pairs is loaded once

    def run_once(folder, ids, tag):
        key = (os.path.realpath(folder), tuple(ids))
        if key not in runs:
            runs[key] = run_model(folder, ids, log_dir, tag, args.timeout)
        return runs[key]

    for i in range(0, len(args.models), 2):
        qpath, fpath = args.models[i], args.models[i + 1]
        ids = _prompt_ids(qpath, fpath)
        entry = {"quantized": qpath, "float": fpath, "loaded": False, "error": None,
                 "max_abs_logprob_diff": None, "top1_agreement": None,
                 "quant_method": _config_quant_method(qpath), "matched": False, "prompt_ids": ids}
        q, q_err, q_s = run_once(qpath, ids, f"{i // 2:02d}-quantized")
        entry["quantized_seconds"] = q_s
        if q is None:
            entry["error"] = q_err
        else:
            entry["quant_method"] = q["quant_method"] or entry["quant_method"]
            entry["quantized_load_s"] = q["load_s"]
            entry["quantized_run_s"] = q["run_s"]
            entry["quantized_attempts"] = q["attempts"]
            entry["quantized_crashes"] = q["crashes"]
            if "exit_status" in q:
                entry["quantized_exit_status"] = q["exit_status"]
            f, f_err, f_s = run_once(fpath, ids, f"{i // 2:02d}-float")
            entry["float_seconds"] = f_s
            if f is None:
                entry["error"] = f"float model: {f_err}"
            else:
                entry["loaded"] = True
                entry["float_load_s"] = f["load_s"]
                entry["float_run_s"] = f["run_s"]
                entry["float_attempts"] = f["attempts"]
                entry["float_crashes"] = f["crashes"]
                if "exit_status" in f:
                    entry["float_exit_status"] = f["exit_status"]
                diff, top1, mismatches = compare(q["positions"], f["positions"], args.tolerance)
                entry["max_abs_logprob_diff"] = round(diff, 6)
                entry["top1_agreement"] = round(top1, 4)
                entry["top1_mismatches"] = mismatches
                entry["matched"] = diff <= args.tolerance and all(m["near_tie"] for m in mismatches)
        pairs.append(entry)
        status = ("match" if entry["matched"] else "MISMATCH") if entry["loaded"] else "NOT LOADED"
        flips = entry.get("top1_mismatches") or []
        print(f"{status}: {qpath} vs {fpath}: quant_method={entry['quant_method']} "
              f"max|dlogprob|={entry['max_abs_logprob_diff']} top1={entry['top1_agreement']}"
              + (f" (flips at float gaps {[m['float_gap'] for m in flips]})" if flips else "")
              + f" load s: quantized={entry.get('quantized_load_s')} float={entry.get('float_load_s')}"
              + (f" error={entry['error']}" if entry["error"] else "")
              + "".join(f" RETRIED: the {side} run crashed (exit {c['exit_status']}: {c['error']})"
                        for side in ("quantized", "float") for c in entry.get(f"{side}_crashes", [])), flush=True)
        out.write_text(json.dumps({"tolerance": args.tolerance, "pairs": pairs}, indent=2) + "\n")
    out.write_text(json.dumps({"tolerance": args.tolerance, "pairs": pairs}, indent=2) + "\n")
    return 0 if all(e["matched"] for e in pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
