"""Static activation quantization stored beside a weight: a per-tensor scale calibrated on data (FP8
static, NVFP4 W4A4), which no data-free conversion can make and every target that can hold it carries.

A family declares a module's scale from headers and config in ``QuantModule.details["activation"]``:
``{"scheme": ..., "tensor": name, "kind": "multiplier" | "divisor"}``, with the schemes

* ``"fp8"``: activations rounded to e4m3 under one static scale per tensor (compressed-tensors FP8 with
  static tensor input_activations, ModelOpt FP8): x ~ q * scale;
* ``"nvfp4"``: activations in e2m1 groups of 16 whose e4m3 group scales are computed at run time under
  one static global scale (compressed-tensors NVFP4 W4A4's ``input_global_scale``, a divisor:
  448 * 6 / amax; ModelOpt NVFP4's ``input_scale``, a multiplier: amax / (448 * 6)).

``static_activation`` reads the value; a target's plan (registry.ModuleContext.activation) decides
whether it holds it, in its own convention (``StaticActivation.as_kind``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ...errors import CorruptCheckpoint
from ..storage.tensor_io import read_array
from .layout import examples, natural_key

LEAVES = ("input_scale", "input_global_scale", "input_zero_point")    # how the formats name them
SCHEMES = {"fp8": "float8 per tensor, static", "nvfp4": "NVFP4 under a static global scale"}
KINDS = ("multiplier", "divisor")


@dataclass(frozen=True)
class StaticActivation:
    scheme: str                      # SCHEMES' key
    value: np.float32                # as stored (float32)
    kind: str                        # "multiplier" | "divisor"
    tensor: str                      # the source tensor
    dtype: str                       # its safetensors dtype
    file: str | None = None          # the file holding it

    def __post_init__(self):
        if self.scheme not in SCHEMES or self.kind not in KINDS:
            raise ValueError(f"static activation {self.scheme!r} / {self.kind!r}: schemes {', '.join(SCHEMES)}, "
                             f"kinds {', '.join(KINDS)}")

    def as_kind(self, kind: str) -> np.float32:
        """The scale as a target stores it: as it is, or float32(1 / it) (a divisor for a multiplier, or
        the reverse; one float32 rounding, which a change of convention cannot avoid)."""
        if kind not in KINDS:
            raise ValueError(f"activation scale kind {kind!r}: one of {', '.join(KINDS)}")
        if kind == self.kind:
            return self.value
        with np.errstate(over="ignore"):
            out = np.float32(1) / self.value
        if not np.isfinite(out):
            raise CorruptCheckpoint(f"holds {float(self.value)!r}, whose reciprocal ({kind}) is beyond float32; "
                                    f"cannot carry it", file=self.file, tensor=self.tensor)
        return out


def declared(m) -> Mapping | None:
    """The module's declaration (QuantModule.details["activation"]), or None."""
    act = m.details.get("activation") if m.details else None
    return act if isinstance(act, Mapping) else None


def static_activation(m, tensors: Mapping) -> StaticActivation | None:
    """The module's static activation scale, read from its tensor (None: its activations are dynamic
    or unquantized). Refused (CorruptCheckpoint naming file and tensor): not one finite positive value."""
    act = declared(m)
    if act is None or act.get("tensor") not in tensors:
        return None
    info = tensors[act["tensor"]]
    value = read_array(info).reshape(-1)
    v = value.astype(np.float32) if value.size == 1 else None
    if v is None or not (np.isfinite(v[0]) and v[0] > 0):
        raise CorruptCheckpoint(f"holds {value.tolist()!r}, not one finite positive activation scale; cannot "
                                f"carry it", file=info.file, tensor=info.name)
    return StaticActivation(act["scheme"], v[0], act["kind"], info.name, info.dtype, info.file)


def activation_report(modules, written: Mapping, target: str, dynamic: str | None) -> tuple[dict, list[str]]:
    """({"carried": n, "dropped": n}, warnings) of a conversion: the modules whose static activation scale
    the output holds (a LEAVES tensor of the module among ``written``, the output's tensor names), and a
    warning naming the source's scale tensors it does not hold, with what the target's kernels do to those
    activations (``dynamic``, the target's; None: nothing, they stay 16-bit)."""
    carried = {m.name for m in modules if any(f"{m.name}.{leaf}" in written for leaf in LEAVES)}
    dropped = sorted((t for m in modules if m.name not in carried for t in m.state_tensors
                      if t.rsplit(".", 1)[-1] in LEAVES and t not in written), key=natural_key)
    counts = {"carried": len(carried), "dropped": len(dropped)}
    if not dropped:
        return counts, []
    return counts, [f"{len(dropped)} static activation scales are not carried ({examples(dropped)}): {target} "
                    f"holds none for these modules, so their activations become "
                    f"{dynamic or 'unquantized (its kernels multiply 16-bit activations)'}"]
