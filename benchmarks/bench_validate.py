"""Benchmark: `qconv validate` next to a floor, as whole processes, median of N, on the ~1.1B-parameter
conversion (TinyLlama shapes: the bitsandbytes int8 model of make_tinyllama_bnb8.py against its
`qconv bnb8-to-gptq` result) and, with --layout, the full-size Qwen3-VL-8B bitsandbytes int8 layout
(fixtures/layouts; sparse files, so every weight is zero) against its bnb8-to-gptq result, and, with
--large-layer, one decoder layer of Llama-3.1-70B (MLP layers of 28,672 x 8,192: 235 M codes each, the
size at which holding a whole layer per side no longer fits in 1 GiB) built the same way.

    .venv/bin/python benchmarks/bench_validate.py [--runs 3] [--layout] [--large-layer] [--device cpu]

The floor is the least any such check can do, written here: one Python process that reads both sides
layer by layer, dequantizes each layer with numpy (qconv's readers and QuantTensor.dequantize, the
reference decoding), computes X W^T for 32 activation rows on both (as W X^T, the fastest form) and compares the outputs (largest
relative difference). No bound, no per-weight check, no kernel cross-check, no overlap.

Floor and validate runs are interleaved (floor, validate, floor, ...) so that machine load, shared
with other work, falls on both alike; the load average is printed with the figures. Peak RSS is each
process's own (wait4). Prints figures only; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def floor(path_a: str, path_b: str, samples: int = 32) -> None:
    """The floor: plain read + numpy dequantize + matmul of `samples` activation rows + compare."""
    import numpy as np

    from qconv.formats.storage.checkpoint import open_target
    from qconv.formats.core.reader import read_module
    from qconv.formats.storage.tensor_io import read_array, to_float32
    from qconv.validation import Side

    a, b = (Side(open_target(p).components[0]) for p in (path_a, path_b))

    def weight(side: Side, name: str) -> np.ndarray:
        e = side.entries[name]
        if e.module is None:
            return to_float32(read_array(e.info), e.info.dtype)
        return read_module(side.comp, side.det, e.module, side.dtype).dequantize()

    rng = np.random.default_rng(0)
    worst, layers = 0.0, 0
    for name in sorted(set(a.entries) & set(b.entries)):
        wa, wb = weight(a, name), weight(b, name)
        xt = rng.standard_normal((wa.shape[1], samples)).astype(np.float32)    # X^T: W X^T is BLAS's fast form
        ya, yb = wa @ xt, wb @ xt
        worst = max(worst, float(np.abs(ya - yb).max() / max(float(np.abs(ya).max()), 1e-30)))
        layers += 1
    print(f"{layers} layers, largest relative difference {worst:.3g}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layout", action="store_true", help="also the full-size Qwen3-VL-8B layout")
    ap.add_argument("--large-layer", action="store_true", help="also one Llama-3.1-70B decoder layer")
    ap.add_argument("--only-large", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", choices=["cpu", "auto", "cuda"])
    ap.add_argument("--floor", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor:
        floor(*args.floor)
        return
    qconv = str(Path(sys.executable).parent / "qconv")
    src = Path(subprocess.run([sys.executable, HERE / "make_tinyllama_bnb8.py"], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1])
    HERE.joinpath(".cache").mkdir(exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=HERE / ".cache") as tmp:
        pairs = [] if args.only_large else [("TinyLlama-1.1B bnb int8 -> gptq", src, Path(tmp) / "gptq")]
        if args.layout or args.large_layer or args.only_large:
            sys.path.insert(0, str(REPO / "fixtures" / "layouts"))
            from build import build
        if args.large_layer or args.only_large:
            layout = Path(tmp) / "llama70b-layer.json"
            layout.write_text(json.dumps(_llama70b_layer()))
            pairs.append(("Llama-3.1-70B decoder layer bnb int8 -> gptq", build(layout, Path(tmp) / "l70"),
                          Path(tmp) / "l70-gptq"))
        if args.layout:
            layout = build(REPO / "fixtures" / "layouts" / "qwen3vl-8b-bnb8.json", Path(tmp) / "qwen3vl-8b")
            pairs.append(("Qwen3-VL-8B layout bnb int8 -> gptq", layout, Path(tmp) / "qwen3vl-8b-gptq"))
        for label, a, b in pairs:
            subprocess.run([qconv, "bnb8-to-gptq", a, b], check=True, capture_output=True)
            floors, validates = [], []
            load = os.getloadavg()[0]
            for _ in range(args.runs):
                floors.append(_measure([sys.executable, __file__, "--floor", str(a), str(b)]))
                validates.append(_measure([qconv, "validate", "--device", args.device, str(a), str(b)]))
            load = (load + os.getloadavg()[0]) / 2
            f = statistics.median(t for t, _, _ in floors)
            v = statistics.median(t for t, _, _ in validates)
            rows.append((label, f"{f:.1f}", f"{v:.1f}", f"{v / f:.2f}x",
                         f"{max(r for _, r, _ in floors):.2f}", f"{max(r for _, r, _ in validates):.2f}",
                         f"{load:.1f}", validates[-1][2]))
    print(f"qconv validate (--device {args.device}) next to the floor, whole processes, median of {args.runs}, "
          f"{os.cpu_count()} CPUs\n")
    print(tabulate(rows, headers=["pair", "floor s", "validate s", "ratio", "floor GiB", "validate GiB",
                                  "load avg", "validate says"]))


def _llama70b_layer() -> dict:
    """A bitsandbytes int8 layout of Llama-3.1-70B with one decoder layer (its shapes: hidden 8,192,
    intermediate 28,672, 64 heads, 8 key-value heads of 128), as transformers saves LLM.int8."""
    hidden, inter, kv = 8192, 28672, 8 * 128
    qc = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
          "llm_int8_threshold": 6.0, "llm_int8_skip_modules": ["lm_head"], "llm_int8_has_fp16_weight": False,
          "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False,
          "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8"}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 64,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "dtype": "bfloat16",
              "quantization_config": qc}
    tensors = []
    for name, (out, inp) in {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
                             "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
                             "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                             "mlp.down_proj": (hidden, inter)}.items():
        p = f"model.layers.0.{name}"
        tensors += [[p + ".weight", "I8", [out, inp]], [p + ".SCB", "F32", [out]], [p + ".weight_format", "U8", []]]
    tensors += [["model.layers.0.input_layernorm.weight", "BF16", [hidden]],
                ["model.layers.0.post_attention_layernorm.weight", "BF16", [hidden]],
                ["model.norm.weight", "BF16", [hidden]]]
    return {"config": config, "tensors": tensors}


def _measure(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GiB, last line of stdout) of one whole process, its own RSS (wait4)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = out.strip().splitlines() or [f"exit {proc.returncode}"]
    return wall, usage.ru_maxrss / 2**20, lines[-1]


if __name__ == "__main__":
    main()
