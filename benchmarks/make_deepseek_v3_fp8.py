"""Build a DeepSeek-V3-shaped fine-grained FP8 checkpoint for the speed benchmarks: DeepSeek-V3's own
config.json (671 B parameters, 61 layers, ``quant_method: fp8``, ``weight_block_size`` [128, 128]) and
its real tensor names, dtypes and shapes, for a few decoder layers only (default: layers 0-2, dense, and
layer 3, MoE, with 16 routed experts and the shared expert), so the files are a few GB. The config says
what the files hold, as loaders and qconv's structure check require: num_hidden_layers = dense + MoE
layers (numbered from 0), first_k_dense_replace = the dense count, n_routed_experts = --experts (the
router's rows; top-k and groups shrunk to fit). Tensor data is random: e4m3 codes uniform over every finite byte,
float32 ``weight_scale_inv`` in [1e-4, 1e-3] per 128 x 128 block (partial last blocks, as
``kv_a_proj_with_mqa`` [576, 7168] with its [5, 56] scale), bfloat16 norms, router and biases.

    .venv/bin/python benchmarks/make_deepseek_v3_fp8.py OUT [--dense 3] [--moe 1] [--experts 16]
                                                         [--max-shard-size 1GB] [--seed 0]

Shards are written by safetensors' own save_file, planned as transformers plans them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), the fields transformers' DeepseekV3Config reads.
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "rope_theta": 10000, "attention_bias": False, "attention_dropout": 0.0,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
BLOCK = 128


def linears(layer: int, experts: int, c: dict = CONFIG) -> list[tuple[str, int, int]]:
    """(name, out, in) of one decoder layer's FP8 Linears, as DeepSeek-V3 names and shapes them."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    p = f"model.layers.{layer}"
    out = [(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], h),
           (f"{p}.self_attn.q_b_proj", heads * qk, c["q_lora_rank"]),
           (f"{p}.self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
           (f"{p}.self_attn.kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
           (f"{p}.self_attn.o_proj", h, heads * c["v_head_dim"])]

    def mlp(prefix: str, inter: int):
        return [(f"{prefix}.gate_proj", inter, h), (f"{prefix}.up_proj", inter, h), (f"{prefix}.down_proj", h, inter)]

    if layer < c["first_k_dense_replace"]:
        return out + mlp(f"{p}.mlp", c["intermediate_size"])
    inter = c["moe_intermediate_size"]
    for e in range(experts):
        out += mlp(f"{p}.mlp.experts.{e}", inter)
    return out + mlp(f"{p}.mlp.shared_experts", inter * c["n_shared_experts"])


def tensors(layers: list[int], experts: int, rng: np.random.Generator, c: dict = CONFIG):
    """(name, tensor) in the checkpoint's order, made one at a time."""
    h = c["hidden_size"]
    finite = np.setdiff1d(np.arange(256, dtype=np.uint8), np.array([0x7F, 0xFF], dtype=np.uint8))
    for layer in layers:
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield f"{p}.post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield f"{p}.self_attn.q_a_layernorm.weight", torch.ones(c["q_lora_rank"], dtype=torch.bfloat16)
        yield f"{p}.self_attn.kv_a_layernorm.weight", torch.ones(c["kv_lora_rank"], dtype=torch.bfloat16)
        if layer >= c["first_k_dense_replace"]:
            yield f"{p}.mlp.gate.weight", torch.randn(c["n_routed_experts"], h, dtype=torch.bfloat16) * 0.02
            yield f"{p}.mlp.gate.e_score_correction_bias", torch.zeros(c["n_routed_experts"], dtype=torch.float32)
        for name, out, inp in linears(layer, experts, c):
            codes = torch.from_numpy(finite[rng.integers(0, finite.size, size=(out, inp), dtype=np.int64)
                                     .astype(np.uint8, copy=False)])
            yield f"{name}.weight", codes.view(torch.float8_e4m3fn)
            scale = rng.uniform(1e-4, 1e-3, size=(math.ceil(out / BLOCK), math.ceil(inp / BLOCK)))
            yield f"{name}.weight_scale_inv", torch.from_numpy(scale.astype(np.float32))


def build(out: Path, *, dense: int = 3, moe: int = 1, experts: int = 16, max_shard: int = 10**9,
          seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=False)
    layers = list(range(dense + moe))
    config = dict(CONFIG, num_hidden_layers=dense + moe, first_k_dense_replace=dense)
    if moe:
        config.update(n_routed_experts=experts, num_experts_per_tok=min(8, experts), n_group=1, topk_group=1)
    rng = np.random.default_rng(seed)
    shards, current, size = [], {}, 0
    for name, t in tensors(layers, experts, rng, config):
        n = t.numel() * t.element_size()
        if current and size + n > max_shard:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
        if size >= max_shard:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _size(text: str) -> int:
    units = {"GB": 10**9, "MB": 10**6}
    return int(float(text[:-2]) * units[text[-2:].upper()]) if text[-2:].upper() in units else int(text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dense", type=int, default=3)
    ap.add_argument("--moe", type=int, default=1)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--max-shard-size", default="1GB")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    build(a.out, dense=a.dense, moe=a.moe, experts=a.experts, max_shard=_size(a.max_shard_size), seed=a.seed)
