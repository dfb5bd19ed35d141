"""The model-level check's one runner protocol, run in the Python that has B's engine (never imports qconv,
which that Python need not have): the family's runner script (formats/core/registry.Engine.script) gives
``run(model, request) -> (result, logits)``; this loads it by path and speaks the protocol.

    PYTHON runner.py SCRIPT MODEL WORKDIR

Reads WORKDIR/request.json ({"ids", "text", "threads"}); writes WORKDIR/logits.npy (float32 [ids, n_vocab])
and WORKDIR/result.json ({"tokens": the engine's own tokenization of the text without special
tokens, "version"}, or {"error": one line}). Exit 0 when it ran, 1 when the engine refused; a crash in the
engine ends the process by a signal, which the caller tells apart from a refusal."""

import importlib.util
import json
import sys
from pathlib import Path


def main() -> int:
    script, model, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    spec = importlib.util.spec_from_file_location("qconv_engine_runner", script)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    try:
        result, logits = runner.run(model, json.loads((work / "request.json").read_text()))
    except Exception as exc:              # a refusal, said in one line: the caller names the file
        (work / "result.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}))
        return 1
    import numpy as np

    np.save(work / "logits.npy", np.asarray(logits, dtype=np.float32))
    (work / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
