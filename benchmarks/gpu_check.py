"""The GPU check, for the occasions a CUDA machine is lent (CI never has one):

1. validate's device dequantization is bit for bit the numpy reference, on every module of every
   reference checkpoint (float32 subtract/multiply are exact on the GPU too; this proves it);
2. `qconv validate` on CUDA over a lossless conversion of every reference checkpoint, with the
   producers' own CUDA kernels cross-checked on every layer (bitsandbytes int8 / 4-bit, auto-round);
3. the same over a generated ~1.1B-parameter model (every row checked), timed;
4. one code changed in one layer of that model's conversion fails, and only that layer is named.

    bin/gpu-check                      (CUDA required; under 3 minutes on one GPU)
    python benchmarks/gpu_check.py --device cpu --layers 1      (a quick CPU smoke run, used by the tests)

Runs with whatever Python packages the machine has (click, tabulate, numpy, safetensors, torch; with
bitsandbytes, its kernels are cross-checked too); qconv is imported from this checkout without being
installed. Exit 0 when everything validates, 1 otherwise, 2 when no GPU is there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
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
    from qconv.formats.gptq import codec as gptq_codec
    from qconv.formats.core.ir import QuantSpec, QuantTensor
    from qconv.formats.storage.safetensors_writer import ShardWriter, index_json, plan_shards

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


def _count_kernels(result: dict, runs: dict) -> None:
    """runs: kernel -> {"ran": layers, error message: layers where it could not run}."""
    for layer in result["layers"]:
        for k in layer.get("kernels", {}).values():
            counts = runs.setdefault(k["kernel"], {"ran": 0})
            key = "ran" if k["ok"] is not None else k["error"]
            counts[key] = counts.get(key, 0) + 1


def device_cases():
    """(label, reference QuantTensor, the same with its codes in column-major order) for every quantized
    module of every reference checkpoint (the device path must not depend on the codes' memory order),
    plus an nf4 layer whose code-book blocks straddle rows (mlx-lm's min / max biases: codes with float
    offsets, decoded on the device as fl(fl(q * s) + b)). A module read as its decoded weights (a
    FloatWeight: a GGUF Q6_K) has no codes to decode on a device: its values travel."""
    from dataclasses import replace

    import numpy as np
    from qconv.formats.bnb.codec import NF4
    from qconv.formats.storage.checkpoint import open_target
    from qconv.formats.core.detect import detect
    from qconv.formats.core.ir import QuantSpec, QuantTensor
    from qconv.formats.core.reader import model_dtype, read_module

    for src in sorted(p for p in (REPO / "fixtures" / "checkpoints").iterdir() if (p / "oracle").is_dir()):
        for comp in open_target(src).components:
            det = detect(comp)
            for m in det.modules:
                dtype = model_dtype(comp, det)
                qt = read_module(comp, det, m, dtype)
                if not hasattr(qt, "codes"):
                    continue
                yield (f"{src.name}:{m.name}", qt, replace(qt, codes=np.asfortranarray(qt.codes))
                       if qt.codes.ndim == 2 else qt)
    rng = np.random.default_rng(0)
    qt = QuantTensor(QuantSpec("nf4", 4, 64, True, codebook=tuple(NF4)), (7, 48), "float16",
                     codes=rng.integers(0, 16, 7 * 48, dtype=np.uint8),
                     scales=rng.uniform(0.1, 2, 6).astype(np.float32))
    yield "nf4 [7, 48] in blocks of 64", qt, qt


def device_mismatches(device: str) -> tuple[int, list[str]]:
    """validate's device dequantization against the numpy reference, bit for bit, on whole layers and on
    row blocks that start and end mid-group / mid-block. Returns (blocks checked, those that differ)."""
    import numpy as np
    import torch
    from qconv.validation import dequantize_block

    checked, wrong = 0, []
    for label, qt, device_qt in device_cases():
        ref = qt.dequantize()
        out = qt.shape[0]
        for r0, r1 in ((0, out), (1, min(out, 6)), (out // 2, out)):
            got = dequantize_block(device_qt, r0, r1, torch.device(device)).cpu().numpy()
            checked += 1
            if got.shape != (r1 - r0, qt.shape[1]) or not np.array_equal(
                    got.view(np.uint32), np.ascontiguousarray(ref[r0:r1]).view(np.uint32)):
                wrong.append(f"{label}[{r0}:{r1}]")
    return checked, wrong


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
    ok, rows, kernel_runs = True, [], {}
    t0 = time.perf_counter()
    checked, wrong = device_mismatches(args.device)
    rows.append(("device dequantization == numpy, bit for bit (blocks)", "-", not wrong, checked,
                 time.perf_counter() - t0))
    ok &= not wrong
    for label in wrong[:5]:
        print(f"gpu-check: device dequantization differs: {label}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for src in sorted(p for p in fixtures.iterdir() if (p / "oracle").is_dir()):
            (report,) = inspect_path(src)["components"]
            if report["method"] not in LOSSLESS and report["method"] != "bitsandbytes 4-bit":
                continue                        # a format with no lossless target here yet
            to = LOSSLESS.get(report["method"]) or f"bnb4-{report['quant_type']}"
            opts = Options(to, double_quant=False) if to.startswith("bnb4") else Options(to)
            out = tmp / src.name
            t0 = time.perf_counter()
            convert(src, out, opts)
            result = validate(src, out, device=args.device, kernels="all")
            rows.append((src.name, to, result["ok"], len(result["layers"]), time.perf_counter() - t0))
            ok &= result["ok"]
            _count_kernels(result, kernel_runs)
        gen, back = tmp / "generated-gptq8", tmp / "generated-bnb8"
        t0 = time.perf_counter()
        params = _generated_gptq8(gen, args.layers)
        convert(gen, back, Options("bnb8"))
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = validate(gen, back, device=args.device, kernels="all")
        _count_kernels(result, kernel_runs)
        rows.append((f"generated {params / 1e9:.2f}B (made in {made:.0f} s), rows {result['components'][0]['rows']}",
                     "bnb8", result["ok"], len(result["layers"]), time.perf_counter() - t0))
        ok &= result["ok"]
        # One int8 code of one layer one step off: that layer, and only it, fails.
        from qconv.formats.storage.safetensors_header import read_header
        bad_layer = "model.layers.0.mlp.down_proj"
        for shard in back.glob("*.safetensors"):
            info = read_header(shard).tensors.get(bad_layer + ".weight")
            if info is not None:
                with open(shard, "r+b") as f:
                    f.seek(info.offset + 5007)
                    byte = f.read(1)[0]
                    f.seek(info.offset + 5007)
                    f.write(bytes([(byte + 1) % 256]))
        t0 = time.perf_counter()
        result = validate(gen, back, device=args.device, kernels="all")
        failed = [r["module"] for r in result["layers"] if not r["ok"]]
        rows.append(("same, one code of one layer changed: fails, names it", "bnb8", failed == [bad_layer],
                     len(result["layers"]), time.perf_counter() - t0))
        ok &= failed == [bad_layer]
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print(f"qconv validate on {device}")
    for name, to, passed, layers, seconds in rows:
        print(f"  {'ok  ' if passed else 'FAIL'} {name:55s} -> {to:9s} {layers:4d} layers  {seconds:6.1f} s")
    print("own kernels cross-checked:")
    for kernel, counts in sorted(kernel_runs.items()):
        errors = sorted(e for e in counts if e != "ran")
        print(f"  {kernel:10s} ran on {counts['ran']} layers" + (
            f", could not run on {sum(counts[e] for e in errors)}: " + "; ".join(errors) if errors else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
