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

What the module's config says, whatever its tensors hold, is ``QuantModule.details["activations"]``:
``{"static": True, "tensor": name, "by": where, "one": bool}`` (static activations scaled by that tensor,
one value where ``one``) or ``{"static": False, "activations": "dynamic" | "unquantized", "by": where}``
(no scale is stored). ``check`` holds every module to it before anything is written (reader.require_decodable,
so every writing and comparing verb, whatever its target): a declared scale missing, a scale beside
dynamic activations, or a scale that is not finite and positive (or not one value) is corrupt (exit 4),
never dropped with a "not carried" warning nor written under a config that promises it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ...errors import CorruptCheckpoint
from .layout import examples, natural_key

if TYPE_CHECKING:
    import numpy as np
# numpy and the tensor reader are imported where values are read: inspect, which needs header_problem
# only, imports neither.

LEAVES = ("input_scale", "input_global_scale", "input_zero_point")    # how the formats name them
SCALE_LEAVES = ("input_scale", "input_global_scale")                  # scales: finite and positive
SCALE_DTYPES = ("F16", "BF16", "F32", "F64")
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
        import numpy as np

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
    import numpy as np

    from ..storage.tensor_io import read_array, to_float32

    act = declared(m)
    if act is None or act.get("tensor") not in tensors:
        return None
    info = tensors[act["tensor"]]
    value = to_float32(read_array(info), info.dtype).reshape(-1)       # bfloat16 as its bits: decoded
    v = value if value.size == 1 else None
    if v is None or not (np.isfinite(v[0]) and v[0] > 0):
        raise CorruptCheckpoint(f"holds {value.tolist()!r}, not one finite positive activation scale; cannot "
                                f"carry it", file=info.file, tensor=info.name)
    return StaticActivation(act["scheme"], v[0], act["kind"], info.name, info.dtype, info.file)


def stored(m, tensors: Mapping) -> list[str]:
    """The module's activation tensors (LEAVES) present in ``tensors``."""
    return [f"{m.name}.{leaf}" for leaf in LEAVES if f"{m.name}.{leaf}" in tensors]


def header_problem(m, tensors: Mapping) -> tuple[str, str] | None:
    """(tensor, problem) where the module's tensors contradict what its config declares about its
    activations (details["activations"]), from headers alone: a declared static scale that is missing,
    or an activation scale beside activations declared dynamic; None where they agree or nothing is
    declared. inspect warns of it, check refuses it."""
    said = m.details.get("activations") if m.details else None
    if not isinstance(said, Mapping):
        return None
    if said.get("static"):
        want = said["tensor"]
        if want in tensors:
            return None
        return want, (f"is missing: the config declares static activations for {m.name} ({said['by']}), "
                      f"quantized under this calibrated scale, but no file holds it (an engine would load "
                      f"the module without its scale, and no other module's stands for it)")
    extra = stored(m, tensors)
    if not extra:
        return None
    return extra[0], (f"an activation scale on a module whose config declares "
                      f"{said.get('activations', 'dynamic')} activations ({said['by']}): no engine reads it, "
                      f"and qconv cannot tell whether the config or the tensor is meant")


def check(m, tensors: Mapping) -> None:
    """Refuse (CorruptCheckpoint naming the file and the tensor) a module whose activation tensors
    contradict its config (header_problem), or whose scales (SCALE_LEAVES) are not a float dtype, not
    finite and positive, or not one value where the config declares one per tensor (nor more than one a
    column anywhere). Reads only the scales, whose size the header bounds first."""
    import numpy as np

    from ..storage.tensor_io import read_array, to_float32

    found = header_problem(m, tensors)
    if found is not None:
        name, problem = found
        info = tensors.get(name)
        raise CorruptCheckpoint(problem, file=info.file if info is not None else m.file(tensors), tensor=name)
    said = m.details.get("activations") if m.details else None
    one = isinstance(said, Mapping) and said.get("static") and said.get("one", True)
    for name in stored(m, tensors):
        if name.rsplit(".", 1)[-1] not in SCALE_LEAVES:
            continue                        # a zero point: any integer
        info = tensors[name]
        size = 1
        for d in info.shape:
            size *= d
        if info.dtype not in SCALE_DTYPES:
            raise CorruptCheckpoint(f"is {info.dtype}, not a float activation scale ({', '.join(SCALE_DTYPES)})",
                                    file=info.file, tensor=name)
        if size < 1 or (one and size != 1) or size > max(m.in_features, 1):
            raise CorruptCheckpoint(f"has shape {list(info.shape)}, not one activation scale"
                                    + (f" (the config declares one per tensor: {said['by']})" if one else ""),
                                    file=info.file, tensor=name)
        with np.errstate(over="ignore"):
            values = to_float32(read_array(info), info.dtype).reshape(-1)     # as a target carries it
        bad = ~(np.isfinite(values) & (values > 0))
        if bad.any():
            shown = repr(values.tolist()) if values.size == 1 else f"{int(bad.sum())} of {values.size} values " \
                f"such as {float(values[bad][0])!r}"
            raise CorruptCheckpoint(f"holds {shown}, not a finite positive activation scale (in float32): "
                                    f"the module's activations are quantized under it", file=info.file, tensor=name)


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
