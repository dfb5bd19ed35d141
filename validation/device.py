"""validate's device: where the blocks are computed (numpy on the host, or CUDA through torch, asked for
only where a GPU can exist) and the weights decoded there: dequantize_block, bit for bit numpy's reference
decoding (QuantTensor.dequantize_rows). Every import of torch in validate's comparison is here, inside
the functions that need it (validation/__init__.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..formats.core.ir import QuantTensor


def dequantize_block(qt: QuantTensor, r0: int, r1: int, device):
    """QuantTensor.dequantize_rows(r0, r1) in torch on ``device``, operation for operation (float32
    subtract and multiply are exact IEEE operations on every device, so the result is bit for bit the
    same; tested against the numpy path). Only the codes, zero points and scales travel to the device."""
    import torch

    def dev(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    inp, rows = qt.shape[1], r1 - r0
    if qt.spec.scheme == "float":                   # decoded weights (FloatWeight): the values travel
        return dev(qt.values[r0:r1])
    if not qt.spec.flat:
        codes = qt.codes[r0:r1]
        if codes.flags.c_contiguous:
            c = dev(codes)
        else:                           # a transposed view: transposed on the device
            c = dev(codes.T).T.contiguous()
        if qt.biases is not None:                   # float offsets: fl(fl(q * s) + b)
            w = c.to(torch.float32)
            s, b = dev(qt.scales[r0:r1]).to(torch.float32), dev(qt.biases[r0:r1]).to(torch.float32)
            if qt.g_idx is None and qt.spec.group_size > 0 and s.shape[1] * qt.spec.group_size == inp:
                w3 = w.view(rows, s.shape[1], qt.spec.group_size)
                w3.mul_(s[:, :, None]).add_(b[:, :, None])
            else:
                g = dev(qt.groups.astype(np.int64))
                w.mul_(s[:, g]).add_(b[:, g])
            return _product_rounded(qt, w)
        if qt.spec.scheme == "int":
            w = c.to(torch.float32)
            z = dev(qt.zeros[r0:r1]).to(torch.float32)
        else:
            w = torch.tensor(np.asarray(qt.spec.codebook, dtype=np.float32), device=device)[c.long()]
            z = None
        s = dev(qt.scales[r0:r1]).to(torch.float32)
        n_groups, gs = s.shape[1], qt.spec.group_size
        if n_groups == 1:
            w = w if z is None else w.sub_(z)
            w.mul_(s)
        elif qt.g_idx is None and gs > 0 and n_groups * gs == inp:
            w3 = w.view(rows, n_groups, gs)
            w3 = w3 if z is None else w3.sub_(z[:, :, None])
            w3.mul_(s[:, :, None])
        else:
            g = dev(qt.groups.astype(np.int64))
            w = w if z is None else w.sub_(z[:, g])
            w.mul_(s[:, g])
        if qt.spec.scale_divisor != 1:
            w.mul_(torch.tensor(np.float32(1.0 / qt.spec.scale_divisor), device=device))
        return _product_rounded(qt, w)
    book = torch.tensor(np.asarray(qt.spec.codebook, dtype=np.float32), device=device)
    bs = qt.spec.group_size
    j0, j1 = r0 * inp, r1 * inp
    w = book[dev(qt.codes[j0:j1]).long()]
    if j0 % bs == 0 and (j1 - j0) % bs == 0:
        w.view(-1, bs).mul_(dev(qt.scales[j0 // bs:j1 // bs])[:, None])
    else:
        b0 = j0 // bs
        w.mul_(dev(qt.scales[b0:(j1 - 1) // bs + 1])[torch.arange(j0, j1, device=device) // bs - b0])
    return _product_rounded(qt, w.view(rows, inp))


def _product_rounded(qt: QuantTensor, w):
    """The float32 product as the producer leaves it: rounded through bfloat16 where QuantTensor
    .product_dtype says so (the same round to nearest even as numpy's round_to_bfloat16)."""
    if qt.product_dtype is None:
        return w
    import torch

    return w.to(torch.bfloat16).to(torch.float32)


def _compute_device(device: str):
    """None for numpy on the host (cpu, or auto without a GPU), else the CUDA torch device. auto asks
    torch only where a GPU can exist (Linux with no NVIDIA device node has none), so a CPU-only
    validation never imports torch unless a producer's kernel is used."""
    if device == "cpu":
        return None
    if device == "auto" and sys.platform == "linux" and not any(Path("/dev").glob("nvidia[0-9]*")):
        return None
    if importlib.util.find_spec("torch") is None:
        if device == "auto":
            return None
        raise UsageError("--device cuda needs torch, which is not installed; use --device cpu")
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if device == "cuda":
        raise UsageError("--device cuda, but torch sees no CUDA device; use --device auto or cpu")
    return None


def _on_device(arrays, dev) -> tuple:
    if dev is None:
        return tuple(arrays)
    import torch

    return tuple(torch.from_numpy(v).to(dev) for v in arrays)


@contextlib.contextmanager
def _highest_precision():
    """float32 matmuls in full float32 (no TF32 on CUDA), whatever the process had set; the previous
    setting is restored afterwards."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _host64(t) -> np.ndarray:
    return t.astype(np.float64) if isinstance(t, np.ndarray) else t.double().cpu().numpy()
