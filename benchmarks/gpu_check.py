"""The GPU check, for the occasions a CUDA machine is lent (CI never has one): `qconv validate` on CUDA
over a lossless conversion of every reference checkpoint and over a generated ~1B-parameter model.

    bin/gpu-check                      (CUDA required; under 3 minutes on one GPU)
    python benchmarks/gpu_check.py --device cpu --layers 1      (a quick CPU smoke run, used by the tests)

Runs with whatever Python packages the machine has (click, tabulate, numpy, safetensors, torch; with
bitsandbytes, its kernels are cross-checked too); qconv is imported from this checkout without being
installed. Exit 0 when everything validates, 1 otherwise, 2 when no GPU is there.
"""

from __future__ import annotations

import argparse
import zlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _import_qconv():
    try:
        import qconv  # noqa: F401
    except ImportError:                       # not installed: the checkout itself is the package
        link_dir = Path(tempfile.mkdtemp(prefix="qconv-import-"))
        (link_dir / "qconv").symlink_to(REPO)
        sys.path.insert(0, str(link_dir))


# Lossless target per source format: codes kept, so every layer must meet validate's derived bound.
LOSSLESS = {"bitsandbytes LLM.int8": "gptq", "GPTQ": "gptq-v2", "auto-round": "gptq"}


def _generated_gptq8(folder: Path, layers: int, seed: int = 0) -> int:
    """A TinyLlama-shaped model of random GPTQ int8 per-row symmetric Linears (the layout bnb8-to-gptq
    writes), plus fp16 embeddings and norms, written with qconv's own writer. Returns parameters."""
    import numpy as np

    from qconv.convert.engine import OutTensor
    from qconv.formats import gptq_codec
    from qconv.formats.ir import QuantSpec, QuantTensor
    from qconv.formats.safetensors_writer import ShardWriter, index_json, plan_shards

    hidden, inter, kv, vocab = 2048, 5632, 256, 32000
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    rng = np.random.default_rng(seed)
    tensors, params = [], 0

    def module(name, out, inp):
        def make():
            r = np.random.default_rng(zlib.crc32(name.encode()))
            qt = QuantTensor(QuantSpec("int", 8, -1, True, scale_dtype="F16"), (out, inp), "float16",
                             codes=r.integers(1, 256, size=(out, inp), dtype=np.uint8),
                             scales=(r.uniform(1e-4, 1e-3, size=(out, 1))).astype(np.float16).astype(np.float32),
                             zeros=np.full((out, 1), 128, np.uint8))
            return {k: v for k, v in gptq_codec.encode(qt).items() if k != "g_idx"}
        cache = {}
        for leaf, dtype, shape in (("qweight", "I32", (inp // 4, out)), ("qzeros", "I32", (1, out // 4)),
                                   ("scales", "F16", (1, out))):
            tensors.append(OutTensor(f"{name}.{leaf}", dtype, shape,
                                     lambda leaf=leaf: [cache.setdefault("v", make())[leaf][1]]))
        return out * inp

    for i in range(layers):
        for leaf, (out, inp) in shapes.items():
            params += module(f"model.layers.{i}.{leaf}", out, inp)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors.append(OutTensor(f"model.layers.{i}.{norm}.weight", "F16", (hidden,),
                                     lambda: [np.ones(hidden, np.float16)]))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors.append(OutTensor(name, "F16", (vocab, hidden),
                                 lambda: [(rng.standard_normal((vocab, hidden)) * 0.02).astype(np.float16)]))
        params += vocab * hidden
    tensors.append(OutTensor("model.norm.weight", "F16", (hidden,), lambda: [np.ones(hidden, np.float16)]))
    folder.mkdir(parents=True)
    shards = plan_shards([(t.name, t.dtype, t.shape) for t in tensors], 2 * 10**9)
    by_name = {t.name: t for t in tensors}
    for shard in shards:
        writer = ShardWriter(folder, shard)
        for name, _, _ in shard.tensors:
            writer.write_tensor(name, by_name[name].chunks())
        writer.close()
    if (index := index_json(shards)) is not None:
        (folder / "model.safetensors.index.json").write_text(index)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 32,
              "num_key_value_heads": 4, "vocab_size": vocab, "dtype": "float16",
              "quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True,
                                      "desc_act": False, "checkpoint_format": "gptq"}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return params


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=22, help="decoder layers of the generated model (22: ~1.1B)")
    args = ap.parse_args()
    _import_qconv()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device", file=sys.stderr)
        return 2
    from qconv.convert.convert import Options, convert
    from qconv.inspection import inspect_path
    from qconv.validation import validate

    fixtures = REPO / "fixtures" / "checkpoints"
    ok, rows = True, []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for src in sorted(p for p in fixtures.iterdir() if (p / "oracle").is_dir()):
            (report,) = inspect_path(src)["components"]
            to = LOSSLESS.get(report["method"]) or f"bnb4-{report['quant_type']}"
            opts = Options(to, double_quant=False) if to.startswith("bnb4") else Options(to)
            out = tmp / src.name
            t0 = time.perf_counter()
            convert(src, out, opts)
            result = validate(src, out, device=args.device)
            rows.append((src.name, to, result["ok"], len(result["layers"]), time.perf_counter() - t0))
            ok &= result["ok"]
        gen, back = tmp / "generated-gptq8", tmp / "generated-bnb8"
        t0 = time.perf_counter()
        params = _generated_gptq8(gen, args.layers)
        convert(gen, back, Options("bnb8"))
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = validate(gen, back, device=args.device)
        rows.append((f"generated {params / 1e9:.2f}B (made in {made:.0f} s)", "bnb8", result["ok"],
                     len(result["layers"]), time.perf_counter() - t0))
        ok &= result["ok"]
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print(f"qconv validate on {device}")
    for name, to, passed, layers, seconds in rows:
        print(f"  {'ok  ' if passed else 'FAIL'} {name:45s} -> {to:9s} {layers:4d} layers  {seconds:6.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
