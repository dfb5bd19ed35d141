"""auto-round's CPU kernel for GPTQ v1 / auto_round:auto_gptq (registry Family.kernel), run by validate
against qconv's decoding: auto_round_extension's torch_zp QuantLinear, what transformers loads those
checkpoints with on the CPU. It reads v1 zero points as stored + 1 and rounds the dequantized weight to
float16 before the matmul (2^-11: its tolerance)."""

from __future__ import annotations

import importlib.util

import numpy as np

from ...probes import producer_imports
from ..core.registry import Kernel
from ..storage.tensor_io import read_array


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _inputs(m, tensors, k: int) -> dict:
    """The first k columns of words, zero words and scales (GPTQ's [in/8, out] layout)."""
    whole = k == m.out_features

    def read(leaf: str, n: int):
        info = tensors[f"{m.name}.{leaf}"]
        return read_array(info) if whole else read_array(info, cols=(0, n))

    return {"qweight": read("qweight", k), "qzeros": read("qzeros", _ceil(k * m.bits, 32)),
            "scales": read("scales", k)}


def _output(m, raw: dict, X, k: int, device):
    import torch

    t = {name: torch.from_numpy(np.ascontiguousarray(v)).to(device) for name, v in raw.items()}
    with producer_imports():
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    layer = QuantLinear(m.bits, m.group_size if m.group_size and m.group_size > 0 else -1, m.in_features, k, bias=False)
    layer.qweight = t["qweight"][:, :k].contiguous()
    layer.qzeros = t["qzeros"][:, : k * m.bits // 32].contiguous()
    layer.scales = t["scales"][:, :k].contiguous()
    with torch.no_grad():
        return layer(X).float()


AUTO_ROUND = Kernel("auto-round", 2e-3, _inputs, _output)


def kernel(m, qc):
    """auto-round's kernel for what transformers + auto-round load: v1 zeros, float16 scales, no act-order
    g_idx, no GPTQModel ``meta`` (which that loader refuses); None otherwise or where it is not installed."""
    from .codec import zero_decoding

    qc = qc or {}
    if (zero_decoding(qc)[0] != "v1" or "meta" in qc or qc.get("desc_act") or m.bits not in (2, 3, 4, 8)
            or m.details.get("scales_dtype") != "F16"):
        return None
    return AUTO_ROUND if importlib.util.find_spec("auto_round_extension") else None
