"""bitsandbytes' own matmuls (registry Family.kernel): LLM.int8 (int8 activations, outlier columns beyond
the 6.0 threshold in 16-bit) and the 4-bit matmul, run by validate against qconv's decoding and by
convert's activation cost as the source's own output. torch and bitsandbytes are imported only when a
kernel runs (probes.import_bitsandbytes: its CPU backend, never a probe that crashes the process)."""

from __future__ import annotations

import importlib.util

import numpy as np

from ...probes import import_bitsandbytes
from ..core.registry import Kernel
from ..storage.tensor_io import read_array

THRESHOLD = 6.0                     # LLM.int8's outlier threshold, as transformers loads it


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _window(tensors, m, whole: bool):
    def read(leaf: str, n: int | None):
        info = tensors[f"{m.name}.{leaf}"]
        return read_array(info) if whole or n is None else read_array(info, rows=(0, n))
    return read


def _int8_inputs(m, tensors, k: int) -> dict:
    read = _window(tensors, m, k == m.out_features)
    return {"weight": read("weight", k), "SCB": read("SCB", k)}


def _int8_output(m, raw: dict, X, k: int, device):
    import torch

    if not import_bitsandbytes():
        raise ImportError("bitsandbytes cannot be imported")
    import bitsandbytes as bnb

    t = {name: torch.from_numpy(np.ascontiguousarray(v)).to(device) for name, v in raw.items()}
    state = bnb.MatmulLtState()
    cb, scb = t["weight"][:k].contiguous(), t["SCB"][:k].float().contiguous()
    state.CB, state.SCB, state.threshold, state.has_fp16_weights = cb, scb, THRESHOLD, False
    return bnb.matmul(X.half(), cb, state=state).float()


def _four_bit_inputs(m, tensors, k: int) -> dict:
    """The first k * in codes of the flattened weight and the absmax of their blocks."""
    read = _window(tensors, m, k == m.out_features)
    weight = tensors[m.name + ".weight"]
    n, item = k * m.in_features, weight.nbytes // max(weight.shape[0], 1)
    blocks = _ceil(n, m.group_size)
    nested = m.details["quant_state"].get("nested_blocksize", 256)
    rows = {"weight": _ceil(_ceil(n, 2), item), "weight.absmax": blocks, "weight.nested_absmax": _ceil(blocks, nested)}
    return {leaf: read(leaf, rows.get(leaf)) for leaf in (t[len(m.name) + 1:] for t in m.weight_tensors + m.state_tensors)}


def _four_bit_output(m, raw: dict, X, k: int, device):
    import torch

    if not import_bitsandbytes():
        raise ImportError("bitsandbytes cannot be imported")
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    t = {name: torch.from_numpy(np.ascontiguousarray(v)).to(device) for name, v in raw.items()}
    qs = F.QuantState.from_dict({n[len("weight."):]: v for n, v in t.items() if n.startswith("weight.")}, device=device)
    qs.dtype = torch.float32
    qs.shape = torch.Size([k, m.in_features])      # the first k rows (their codes and blocks were read)
    # The packed bytes in whatever storage dtype they came in: bitsandbytes views them as uint8.
    return bnb.matmul_4bit(X, t["weight"].t(), quant_state=qs).float()


# LLM.int8 quantizes activations to int8 (1/127 steps); the 4-bit kernel computes in float32 here.
INT8 = Kernel("bnb8", 0.05, _int8_inputs, _int8_output, source_output=f"bitsandbytes LLM.int8 (threshold {THRESHOLD})")
FOUR_BIT = Kernel("bnb4", 1e-4, _four_bit_inputs, _four_bit_output)


def kernel(m, qc):
    """The module's bitsandbytes kernel, where bitsandbytes is installed (None: it is not)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    return INT8 if m.family == "bnb8" else FOUR_BIT
