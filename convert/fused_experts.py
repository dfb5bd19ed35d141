"""Per-expert float weights written fused, for the model types whose loaders read fused experts only
(formats/core/experts.py RELEASED_TRANSPOSED: Qwen3-VL-MoE, whose transformers class has no per-expert
conversion). A float folder of such a model made from per-expert modules (a GGUF's stacked experts, a
compressed-tensors checkpoint llm-compressor unfused) gets each layer's experts back as the released
checkpoints store them: `<prefix>.experts.gate_up_proj` [E, H, 2I] (each expert's gate rows, then its up
rows, transposed) and `<prefix>.experts.down_proj` [E, I, H]: the layout vLLM, mlx-lm and llama.cpp's
converter read, and transformers reads through its conversion mapping (Transpose, check_dims).

Streaming: a fused tensor is written one expert at a time (its gate and up weights, or its down weight,
read whole, transposed), so memory is bounded by one expert's Linears."""

from __future__ import annotations

import re

import numpy as np

from ..errors import UnsupportedFormat
from ..formats.core.experts import RELEASED_TRANSPOSED, model_type
from .engine import OutTensor

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(outs: dict[str, OutTensor], config, file) -> dict[str, OutTensor]:
    """outs with each layer's per-expert weights replaced by the two fused tensors, for a
    RELEASED_TRANSPOSED model; any other model's outs as they are. Refused (nothing written) where a
    layer's experts are not a complete set 0..E-1 of gate, up and down of one dtype and agreeing shapes."""
    if model_type(config) not in RELEASED_TRANSPOSED:
        return outs
    layers: dict[str, dict[tuple[int, str], OutTensor]] = {}
    for name, t in outs.items():
        hit = _PER_EXPERT.match(name)
        if hit:
            layers.setdefault(hit["prefix"], {})[(int(hit["e"]), hit["part"])] = t
    fused = dict(outs)
    for prefix, parts in layers.items():
        experts = 1 + max(e for e, _ in parts)
        gate, up, down = ([parts.get((e, p)) for e in range(experts)] for p in ("gate_proj", "up_proj", "down_proj"))
        _check(prefix, gate, up, down, file)
        for t in gate + up + down:
            del fused[t.name]
        inter, hidden = gate[0].shape
        code = gate[0].dtype
        fused[f"{prefix}.gate_up_proj"] = OutTensor(
            f"{prefix}.gate_up_proj", code, (experts, hidden, 2 * inter),
            lambda g=gate, u=up: (np.ascontiguousarray(np.concatenate([_whole(a), _whole(b)]).T) for a, b in zip(g, u)))
        fused[f"{prefix}.down_proj"] = OutTensor(
            f"{prefix}.down_proj", code, (experts, inter, hidden),
            lambda d=down: (np.ascontiguousarray(_whole(t).T) for t in d))
    return fused


def _whole(t: OutTensor) -> np.ndarray:
    """One expert's Linear, its slabs put together: [out, in]."""
    return np.concatenate([np.asarray(c).reshape(-1, t.shape[1]) for c in t.chunks()])


def _check(prefix: str, gate: list, up: list, down: list, file) -> None:
    missing = [f"{e}.{p}" for p, ts in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))
               for e, t in enumerate(ts) if t is None]
    if missing:
        raise UnsupportedFormat(f"holds experts without {', '.join(missing[:4])}: not a whole set of gate, up and down "
                                f"Linears to fuse as its model's loaders read them (fused experts only)",
                                file=file, tensor=prefix)
    inter, hidden = gate[0].shape
    want = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    for part, ts in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        for e, t in enumerate(ts):
            if tuple(t.shape) != want[part] or t.dtype != gate[0].dtype:
                raise UnsupportedFormat(f"holds experts.{e}.{part} of {list(t.shape)} {t.dtype}, not "
                                        f"{list(want[part])} {gate[0].dtype} as experts.0's: its experts do not fuse",
                                        file=file, tensor=prefix)
