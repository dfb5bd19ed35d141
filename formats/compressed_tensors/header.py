"""compressed-tensors checkpoints (llm-compressor's ``quant_method: "compressed-tensors"``), described
from tensor headers and the config. Stdlib only, so ``inspect`` stays light; decoding the data is
decode.py, and writing it codec.py.

find_modules finds every module holding compressed-tensors quantization tensors, raises what the config
says of it as problems (no config group, a transform, a status other than "compressed"), and has it
described by its format's part: int_modules.py for the integer formats (pack-quantized, int-quantized,
naive-quantized: their layouts there), float_modules.py for the floating-point ones (float-quantized
FP8, nvfp4- and mxfp4-pack-quantized FP4); check refuses a module with a problem. The config is read
by config.py (which group quantizes a module: compressed-tensors' target matching), inspect's report
is report.py's, and what the targets write is writer.py's (integers) and float_writer.py's.
"""

from __future__ import annotations

import struct
from dataclasses import replace
from typing import Mapping

from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..core.layout import NVFP4_GROUP, QuantModule, natural_key
from ..storage.safetensors_header import TensorInfo, read_small_tensors
from .config import (FLOAT_FORMATS, QUANT_METHOD, READABLE_FORMATS, _INT_DTYPES, group_format,
                     is_ignored, scheme_for, weight_args)
from .float_modules import float_module
from .int_modules import int_module
# Where tests and benchmarks have always found them.
from .report import settings  # noqa: F401
from .writer import INPUT_ACTIVATIONS_INT8_TOKEN, config_for  # noqa: F401


class _Problems:
    """Problems of one module, each with its kind (corrupt / unsupported) and the tensor it is about;
    unsupported ones first, since a layout qconv does not read also makes the shapes look wrong."""

    def __init__(self):
        self.items: list[tuple[str, str | None, str]] = []

    def corrupt(self, tensor: str | None, message: str) -> None:
        self.items.append(("corrupt", tensor, message))

    def unsupported(self, tensor: str | None, message: str) -> None:
        self.items.append(("unsupported", tensor, message))

    def ordered(self):
        return sorted(self.items, key=lambda item: item[0] != "unsupported")

    def details(self) -> dict:
        """The module's details["problem_kinds"] and ["problem_tensors"] (check reads them), in order."""
        ordered = self.ordered()
        return {"problem_kinds": tuple(k for k, _, _ in ordered), "problem_tensors": tuple(tn for _, tn, _ in ordered)}

    def messages(self) -> tuple[str, ...]:
        """The module's problems, in order."""
        return tuple(msg for _, _, msg in self.ordered())


def _prefixes(tensors: Mapping[str, TensorInfo]) -> list[str]:
    found = set()
    for name, info in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix:
            continue
        if leaf in ("weight_packed", "weight_scale"):
            found.add(prefix)
        elif leaf == "weight" and info.dtype in _INT_DTYPES and len(info.shape) == 2:
            found.add(prefix)
    return sorted(found, key=natural_key)


def _transform_groups(qc: Mapping | None) -> list[str]:
    """The transform schemes a config applies (compressed-tensors' TransformConfig: config_groups of
    TransformScheme, e.g. {"type": "hadamard", "apply": [...]}, their online parts stored as
    `<module>.<group>_<location>.weight` tensors): "u (hadamard)", ...; [] when there are none."""
    tc = qc.get("transform_config") if isinstance(qc, Mapping) else None
    if not tc:
        return []
    groups = tc.get("config_groups") if isinstance(tc, Mapping) else None
    if isinstance(groups, Mapping):
        return [f"{name} ({g.get('type', '?') if isinstance(g, Mapping) else '?'})" for name, g in groups.items()]
    return [repr(tc)[:60]]                        # not the documented shape: still a transform, refused


def _weight_shapes(tensors: Mapping[str, TensorInfo]) -> dict[str, tuple[int, int]]:
    """The value of every well-formed `weight_shape` tensor (I64 [2], 16 bytes: read like bitsandbytes'
    few-byte metadata, one open per file): a packed row of ceil(in*b/32) words pins in_features only to
    a range when in*b is not a multiple of 32 (compressed-tensors pads each row), and this says which."""
    infos = [i for n, i in tensors.items() if n.endswith(".weight_shape") and i.dtype == "I64"
             and tuple(i.shape) == (2,)]
    out = {}
    for name, raw in read_small_tensors(infos, limit=16).items():
        a, b = struct.unpack("<qq", raw)
        out[name] = (a, b)
    return out


def find_modules(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """Every module that holds compressed-tensors quantization tensors (``weight_packed``,
    ``weight_scale`` or an integer ``weight`` matrix), described from headers and config alone.

    ``in_features`` is exact for int-quantized weights and for grouped ones with more than one
    group (in = groups x group_size: compressed-tensors quantizes whole groups only). Otherwise
    (channel strategy, pack-quantized) the packed width pins it only to a range; ``in_features`` is
    the widest value of it (the true one whenever in*b is a multiple of 32), ``details["in_range"]``
    the range, and ``weight_shape`` (data, read by decode.read) decides.
    """
    qc = qc or {}
    version = qc.get("version")
    modules = []
    shapes = _weight_shapes(tensors)
    for prefix in _prefixes(tensors):
        p = _Problems()
        match = scheme_for(qc, prefix) if qc else None
        group_name, group = (match if match else (None, {}))
        args = weight_args(group) if match else {}
        fmt = group_format(qc, group) if match else qc.get("format")
        _config_problems(p, qc, prefix, match, args)
        if fmt in FLOAT_FORMATS:
            modules.append(float_module(prefix, tensors, p, group_name, args, fmt, version))
            continue
        if match and fmt not in READABLE_FORMATS:
            p.unsupported(None, f"config group {group_name!r} is stored as format {fmt!r}, which qconv "
                                f"does not decode (it reads {', '.join(READABLE_FORMATS + FLOAT_FORMATS)})")
        modules.append(int_module(prefix, tensors, p, group_name, args, fmt, version, shapes))
    return [_with_activation(m, tensors, qc) for m in modules]


def _config_problems(p: _Problems, qc: Mapping, prefix: str, match: tuple[str, dict] | None, args: Mapping) -> None:
    """What the config alone says is wrong with the module at ``prefix``: no config, another quant_method,
    no group (or ``ignore``) for it, a group without weights, a transform, a status other than compressed."""
    if not qc:
        p.corrupt(None, "holds compressed-tensors quantization tensors but the checkpoint has no "
                        "quantization_config")
    elif qc.get("quant_method") not in (None, QUANT_METHOD):
        p.unsupported(None, f"holds compressed-tensors tensors but quant_method is "
                            f"{qc.get('quant_method')!r}")
    elif match is None:
        if is_ignored(qc, prefix):
            p.corrupt(None, "the config's ignore list names this module, but it holds quantized "
                            "tensors")
        else:
            p.corrupt(None, "no config group targets this module, but it holds quantized tensors")
    elif not args:
        p.corrupt(None, f"config group {match[0]!r} quantizes no weights (weights: null), but "
                        f"the module holds quantized weight tensors")
    transforms = _transform_groups(qc)
    if transforms:
        p.unsupported(None, f"the config's transform_config applies {', '.join(transforms)} (rotations "
                            f"llm-compressor's SpinQuant / QuIP transforms fuse into the weights and apply "
                            f"to activations at run time); qconv does not apply them, so anything it "
                            f"wrote would compute something else")
    status = qc.get("quantization_status")
    if qc and status not in (None, "compressed"):
        p.unsupported(None, f"quantization_status is {status!r}: the weights are stored "
                            f"{'fake-quantized in float' if status == 'frozen' else 'uncompressed'},"
                            f" not compressed; qconv reads compressed checkpoints")


def _static_activation(group: Mapping, prefix: str, tensors: Mapping[str, TensorInfo]) -> dict | None:
    """The module's static activation scale (core/activation.py) its config group declares and its
    tensors hold: FP8 static per tensor (``input_scale``, a multiplier) or NVFP4 W4A4
    (``input_global_scale``, a divisor: 448 * 6 / amax); None for dynamic or unquantized activations, and
    for schemes no target holds (static int8, zero points)."""
    acts = group.get("input_activations") if isinstance(group, Mapping) else None
    if not isinstance(acts, Mapping) or acts.get("type") != "float":
        return None
    if acts.get("dynamic") is False and acts.get("num_bits") == 8 and acts.get("strategy") == "tensor":
        scheme, leaf, kind = "fp8", "input_scale", "multiplier"
    elif acts.get("dynamic") == "local" and acts.get("num_bits") == 4 and acts.get("group_size") == NVFP4_GROUP:
        scheme, leaf, kind = "nvfp4", "input_global_scale", "divisor"
    else:
        return None
    name = f"{prefix}.{leaf}"
    return {"scheme": scheme, "tensor": name, "kind": kind} if name in tensors else None


def _declared_activations(gname: str, group: Mapping, prefix: str) -> dict | None:
    """What the module's config group says of its activations, whatever its tensors hold
    (core/activation.py, details["activations"]): static (dynamic false: ``input_scale``; NVFP4's
    dynamic "local" tensor_group: ``input_global_scale``, the static global scale its run-time group
    scales are under), dynamic (dynamic true) or unquantized (no input_activations): none stored. None
    where the group says something else (qconv then holds the tensors to nothing)."""
    acts = group.get("input_activations") if isinstance(group, Mapping) else None
    label = f"config group {gname!r}"
    if acts is None:
        return {"static": False, "activations": "unquantized", "by": f"{label}: no input_activations, weights only"}
    if not isinstance(acts, Mapping):
        return None
    dynamic = acts.get("dynamic")
    if dynamic is False:
        return {"static": True, "tensor": f"{prefix}.input_scale", "by": f"{label}: input_activations dynamic false",
                "one": acts.get("strategy") == "tensor"}
    if dynamic == "local" and acts.get("strategy") == "tensor_group":
        return {"static": True, "tensor": f"{prefix}.input_global_scale",
                "by": f"{label}: input_activations dynamic \"local\", strategy tensor_group", "one": True}
    if dynamic is True:
        return {"static": False, "activations": "dynamic", "by": f"{label}: input_activations dynamic true"}
    return None


def _with_activation(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> QuantModule:
    match = scheme_for(qc, m.name) if qc else None
    if match is None:
        return m
    act = _static_activation(match[1], m.name, tensors)
    said = _declared_activations(match[0], match[1], m.name)
    details = {**m.details, **({"activation": act} if act is not None else {}),
               **({"activations": said} if said is not None else {})}
    return replace(m, details=details)


def check(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> None:
    """Refuse, from headers and config, a module decode.read could not decode exactly:
    UnsupportedFormat for a layout or scheme qconv does not read, CorruptCheckpoint for files that
    disagree with themselves. Names the file and the tensor concerned."""
    if not m.problems:
        return
    kinds = m.details.get("problem_kinds") or ("corrupt",) * len(m.problems)
    names = m.details.get("problem_tensors") or (None,) * len(m.problems)
    kind, tensor, problem = kinds[0], names[0], m.problems[0]
    info = tensors.get(tensor) if tensor else None
    file = info.file if info is not None else m.file(tensors)
    if kind == "unsupported":
        raise UnsupportedFormat(problem, file=file, tensor=tensor or m.name)
    raise CorruptCheckpoint(problem + "; cannot decode it", file=file, tensor=tensor or m.name)
