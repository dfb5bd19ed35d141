"""Make the ~1.1B-parameter benchmark checkpoint: TinyLlama-1.1B shapes with random fp16 weights,
quantized to LLM.int8 by transformers + bitsandbytes on CPU (the real producer) and saved with
save_pretrained. Cached: does nothing when OUT already holds it.

    .venv/bin/python benchmarks/make_tinyllama_bnb8.py [OUT]      (default benchmarks/.cache)

Writes OUT/tinyllama-fp16 (the random base) and OUT/tinyllama-bnb8. Needs about 2 minutes and 8 GB
of RAM on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def make(out: Path = CACHE) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    base, quant = out / "tinyllama-fp16", out / "tinyllama-bnb8"
    if (quant / "config.json").exists():
        return quant
    config = LlamaConfig(**TINYLLAMA, dtype="float16")
    if not (base / "config.json").exists():
        base.mkdir(parents=True, exist_ok=True)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        gen = torch.Generator().manual_seed(0)
        state = {}
        for name, p in model.state_dict().items():
            if name.endswith("norm.weight"):
                state[name] = torch.ones(p.shape, dtype=torch.float16)
            else:
                state[name] = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.float16)
        save_file(state, base / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(base)
        del state, model
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu")
    model.save_pretrained(quant)
    return quant


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else CACHE))
