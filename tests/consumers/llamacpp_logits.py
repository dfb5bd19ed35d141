"""llama.cpp (llama-cpp-python, built for a generic CPU by `bin/setup llamacpp`) as a consumer of qconv's
GGUF files: load each file and write its next-token logits at every position of a prompt of token ids.

    .venv-llamacpp/bin/python tests/consumers/llamacpp_logits.py --ids 1,5,7 --out result.json A.gguf [B.gguf ...]
    .venv-llamacpp/bin/python tests/consumers/llamacpp_logits.py --quantize Q4_K_M SRC.gguf DST.gguf

The second form is llama.cpp's own quantizer (llama_model_quantize, what `llama-quantize` runs): a
producer of the K-quant files qconv reads.

Each file is loaded in a subprocess of its own, so a crash (a segfault in a kernel) is told apart from a
refusal and from a wrong answer: the result has, per file, either "logits" ([positions][vocab]) or
"error" (the exception's one line, or "crashed: signal N"). Exit 0 when every file loaded and ran.
The token ids go in as they are (llama_eval), so the comparison does not depend on the tokenizer.
"""

import argparse
import json
import subprocess
import sys


def run_one(path: str, ids: list[int]) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=max(32, len(ids)), logits_all=True, verbose=False, n_threads=2,
                          seed=0)
    llm.eval(ids)
    return {"logits": [[float(x) for x in llm.scores[i]] for i in range(len(ids))],
            "n_vocab": llm.n_vocab(), "arch": llm.metadata.get("general.architecture")}


FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q3_K_M": 12, "IQ4_NL": 25}     # llama_ftype


def quantize(kind: str, src: str, dst: str) -> int:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = 2
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--quantize":
        return quantize(*sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args()
    ids = [int(x) for x in args.ids.split(",")]
    if args.one:
        try:
            result = run_one(args.paths[0], ids)
        except Exception as exc:                  # a refusal: said, not raised
            result = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    results = {}
    for path in args.paths:
        one = args.out + ".one.json"
        proc = subprocess.run([sys.executable, __file__, "--one", "--ids", args.ids, "--out", one, path],
                              capture_output=True, text=True)
        if proc.returncode < 0:
            results[path] = {"error": f"crashed: signal {-proc.returncode}", "stderr": proc.stderr[-2000:]}
        elif proc.returncode:
            results[path] = {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-2000:]}
        else:
            with open(one) as f:
                results[path] = json.load(f)
    with open(args.out, "w") as f:
        json.dump(results, f)
    return 0 if all("logits" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
