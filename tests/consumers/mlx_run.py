"""Runs in .venv-mlx (bin/setup mlx), never imports qconv: mlx-lm loads each folder as its users do
(``mlx_lm.load``: model and tokenizer), generates 4 tokens greedily in the folder's own dtypes, then
with every parameter cast to float32 computes the logits of a fixed prompt, and writes every quantized
module's weight as ``mx.dequantize`` decodes it with its scales and biases in float32 (mode mxfp4: its e8m0
scales, exact in any float) (a SwitchLinear's
[E, out, in] split per expert under ``<block>.experts.<e>.<proj>``, the names qconv reads them by).

    python mlx_run.py --ids 1,5,7 --out OUT_DIR FOLDER...

OUT_DIR/<i>/: weights.safetensors, logits.safetensors; OUT_DIR/result.json: {folder: {"dir", "generated"}
or {"error"}} (a folder that fails is reported, the others still run).
"""
import argparse
import json
import traceback
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map


def dequantized(model) -> dict:
    """{module: float32 weight} of every quantized module as mx.dequantize decodes it: scales and biases
    in float32 (mode mxfp4: its e8m0 scales, exact in any float); a SwitchLinear's [E, out, in] per expert,
    named as transformers' per-expert Linears (Mixtral: w1 / w2 / w3). Also fixtures/make_mlx.py's oracle."""
    weights = {}
    for name, m in model.named_modules():
        if not hasattr(m, "scales") or not hasattr(m, "mode"):
            continue
        if m.mode == "mxfp4":              # e8m0 scales, no biases: the product is exact in any float
            w = mx.dequantize(m.weight, m.scales, None, group_size=m.group_size, bits=m.bits,
                              mode="mxfp4").astype(mx.float32)
        else:
            w = mx.dequantize(m.weight, m.scales.astype(mx.float32), m.biases.astype(mx.float32),
                              group_size=m.group_size, bits=m.bits)
        block, _, proj = name.rpartition(".switch_mlp.")
        if block:
            leaf = {"block_sparse_moe": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}}.get(
                block.rsplit(".", 1)[-1], {}).get(proj, proj)
            weights.update((f"{block}.experts.{e}.{leaf}", w[e]) for e in range(w.shape[0]))
        else:
            weights[name] = w
    return weights


def run(folder: Path, ids: list[int], out: Path) -> dict:
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(folder))
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt="The capital of", max_tokens=4)]
    weights = dequantized(model)
    model.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
                          model.parameters()))
    logits = model(mx.array([ids])).astype(mx.float32)[0]
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "weights.safetensors"), weights)
    mx.save_safetensors(str(out / "logits.safetensors"), {"logits": logits})
    return {"dir": str(out), "generated": tokens, "modules": len(weights)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ids", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args()
    ids = [int(i) for i in args.ids.split(",")]
    result = {}
    for i, folder in enumerate(args.folders):
        try:
            result[folder] = run(Path(folder), ids, Path(args.out) / str(i))
        except Exception as exc:     # reported per folder: the test says which one and why
            result[folder] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    (Path(args.out) / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
