"""validate's two sides: each component's Linears (quantized modules and float weights, fused experts
split where the other side holds them per expert), paired by name, and a window of a layer's rows as the
host holds it (HostWeight: decoded on a reader thread, its float32 block computed where the comparison
runs)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .bounds import ULP
from .device import dequantize_block
from ..formats.storage.checkpoint import Component
from ..formats.core.detect import Detection
from ..formats.core.experts import TRANSPOSED, fused_layout, is_fused_name, split_module, split_names, why_not_split
from ..formats.core.source import float_fused
from ..formats.core.ir import QuantTensor
from ..formats.core.layout import UNQUANTIZED, QuantModule
from ..formats.core.reader import model_dtype, read_module, require_decodable
from ..formats.core.registry import family
from ..formats.storage.safetensors_header import DTYPES, FLOAT_DTYPES, TensorInfo
from ..formats.storage.tensor_io import read_array, to_float32


@dataclass(frozen=True)
class Entry:
    name: str
    module: QuantModule | None
    info: TensorInfo | None

    @property
    def representation(self) -> tuple:
        """How the weight's scales are stored: equal representations must give identical weights."""
        m = self.module
        if self.is_float:
            return ("float", self.info.dtype)
        return (m.family, m.details.get("scales_dtype"))

    @property
    def is_float(self) -> bool:
        """A float weight: a tensor as stored, or a float view of fused experts (its parent's info)."""
        return self.module is None or self.module.family == UNQUANTIZED

    @property
    def floor(self) -> float:
        """Absolute rounding of the stored weight below the normal range: float16 subnormals (2^-25)."""
        return 2.0**-25 if self.is_float and self.info.dtype == "F16" else 0.0

    @property
    def eps(self) -> float:
        """The rounding of the stored weight or scales: their dtype's unit roundoff (float32 where a
        format says nothing, as bitsandbytes' float32 SCB and absmax), or the rounding of the product
        where the producer rounds it through a narrower float (compressed-tensors' NVFP4: bfloat16)."""
        m = self.module
        if self.is_float:
            return ULP.get(self.info.dtype, 0.0)
        return max(ULP.get(m.details.get("scales_dtype"), ULP["F32"]), ULP.get(m.details.get("product_dtype"), 0.0))


# transformers 5's fused expert tensors (layout.QuantModule.experts): compared as their stacked rows.
FUSED_EXPERTS = ("gate_up_proj", "down_proj")


class Side:
    def __init__(self, comp: Component):
        self.comp = comp
        self.det: Detection = require_decodable(comp)
        self.dtype = model_dtype(comp, self.det)
        self.entries: dict[str, Entry] = {m.name: Entry(m.name, m, None) for m in self.det.modules}
        for name, info in comp.tensors.items():
            if info.dtype not in FLOAT_DTYPES or name in self.det.claimed_tensors:
                continue
            if name.endswith(".weight") and len(info.shape) == 2:
                self.entries.setdefault(name[: -len(".weight")], Entry(name[: -len(".weight")], None, info))
            elif len(info.shape) == 3 and name.rsplit(".", 1)[-1] in FUSED_EXPERTS:
                # fused experts [E, R, in], as a quantized fused module reads them: E * R rows of in
                flat = replace(info, shape=(info.shape[0] * info.shape[1], info.shape[2]))
                self.entries.setdefault(name, Entry(name, None, flat))

    def split_experts_like(self, other: "Side") -> None:
        """Fused experts compared with the other side's one Linear per expert (convert's split,
        formats/core/experts.py): each fused entry whose split names the other side holds, and whose
        own name it does not, becomes its per-expert views."""
        if why_not_split(self.comp.config) is not None:
            return
        for name, e in list(self.entries.items()):
            if not is_fused_name(name) or (name in other.entries and not self._transposed(name)
                                            and not other._transposed(name)):
                continue
            try:
                if e.module is not None and e.module.experts:
                    if why_not_split(self.comp.config, e.module) is not None:
                        continue
                    views = [Entry(v.name, v, None) for v in split_module(e.module, self.comp.config)]
                elif e.module is None and fused_layout(self.comp.config, float_fused(self.comp.tensors[name])) == TRANSPOSED:
                    # the released transposed layout: float views read through the fused tensor
                    views = [Entry(v.name, v, e.info)
                             for v in split_module(float_fused(self.comp.tensors[name]), self.comp.config)]
                elif e.module is None:
                    experts, rows, inp = self.comp.tensors[name].shape
                    size = DTYPES[e.info.dtype][0] // 8
                    views = [Entry(v, None, replace(e.info, shape=(n, inp), offset=e.info.offset + r0 * inp * size,
                                                    nbytes=n * inp * size))
                             for v, r0, n in split_names(name, experts, rows)]
                else:
                    continue
            except ValueError:           # an odd number of gate_up rows, or a layout fused_layout refuses:
                                         # left fused, reported unpaired
                continue
            # a released (transposed) fused tensor against the other side's: both compared per expert
            if all(v.name in other.entries for v in views) or name in other.entries:
                del self.entries[name]
                self.entries.update((v.name, v) for v in views)

    def _transposed(self, name: str) -> bool:
        """Whether a fused experts entry is in the released transposed layout (experts.fused_layout)."""
        e, info = self.entries.get(name), self.comp.tensors.get(name)
        if e is not None and e.module is not None:
            m = e.module
        elif info is not None and len(info.shape) == 3 and info.dtype in FLOAT_DTYPES:
            m = float_fused(info)
        else:
            return False
        try:
            return bool(m.experts) and fused_layout(self.comp.config, m) == TRANSPOSED
        except ValueError:
            return False

    def shape(self, name: str) -> tuple[int, int]:
        e = self.entries[name]
        return (e.module.out_features, e.module.in_features) if e.module else tuple(e.info.shape)

    def row_step(self, name: str) -> int:
        """Rows a window of this layer's reads starts on (1: a float weight, read by rows)."""
        m = self.entries[name].module
        return 1 if m is None else family(m.family).row_step(m)

    def host(self, name: str, rows: tuple[int, int]) -> HostWeight:
        """Rows r0:r1 of the layer as the host holds them: decoded on a reader thread when quantized (a
        QuantTensor of those rows, read from only their bytes); a float weight is read a block of rows
        at a time, when a block asks for it, so memory stays bounded by a window even for a float
        lm_head."""
        e = self.entries[name]
        if e.module is None:
            return HostWeight(None, e.info)
        window = None if rows == (0, e.module.out_features) else rows
        return HostWeight(read_module(self.comp, self.det, e.module, self.dtype, window), None, rows[0])


@dataclass(frozen=True, eq=False)
class HostWeight:
    qt: QuantTensor | None               # a window's rows (its row 0 is the layer's row ``origin``)
    info: TensorInfo | None
    origin: int = 0

    def stored(self, r0: int, r1: int) -> np.ndarray | None:
        """Rows r0:r1 of a float weight as stored; None for a quantized one."""
        return None if self.info is None else read_array(self.info, rows=(r0, r1))

    def block(self, r0: int, r1: int, device, raw: np.ndarray | None = None):
        """Rows r0:r1 of the float32 weight (a float one from its stored rows ``raw``): numpy's reference
        decoding on the host (device None), else computed on the torch device."""
        if self.qt is None and raw is None:
            raw = self.stored(r0, r1)
        l0, l1 = r0 - self.origin, r1 - self.origin
        if device is None:
            return self.qt.dequantize_rows(l0, l1) if self.qt is not None else to_float32(raw, self.info.dtype)
        import torch

        if self.qt is not None:
            return dequantize_block(self.qt, l0, l1, device)
        if self.info.dtype == "BF16":
            return torch.from_numpy(raw.view(np.int16)).to(device).view(torch.bfloat16).float()
        return torch.from_numpy(raw).to(device).float()
