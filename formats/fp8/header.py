"""transformers' fine-grained FP8 (``quant_method: "fp8"``: DeepSeek-V3/R1, Qwen3-*-FP8, MiniMax, ...),
described from headers and config. Stdlib only, so `inspect` stays light; the data is codec.py.

Per quantized Linear ``P`` (FORMATS.md §10.2)::

    P.weight             F8_E4M3               [out, in]
    P.weight_scale_inv   F32 | BF16 | F16      [ceil(out/B0), ceil(in/B1)]   (F8_E8M0 with scale_fmt ue8m0)
    P.activation_scale   static activations only (activation_scheme "static"; also spelled input_scale)

    w[o, i] = e4m3(q[o, i]) * s[o // B0, i // B1]

Despite its name ``weight_scale_inv`` is a multiplier (amax / 448 of the block). B = the config's
``weight_block_size``, never the shapes divided (transformers' own ``_dequantize_one`` derives it as
rows // scale_rows, which raises on DeepSeek's 576-row kv_a_proj_with_mqa and silently picks a wrong
block elsewhere); a dimension that is not a multiple of the block has a last, partial block. No
``weight_block_size``: one scale per tensor. ``modules_to_not_convert`` (MiniMax: ``ignored_layers``)
names Linears left in float.

MoE checkpoints that transformers 5 saves with FUSED expert scales (``experts.gate_up_proj_scale_inv``
[E, ...]) or fused e4m3 experts are not decoded yet: their tensors are claimed by no module, so every
writing verb refuses them (detect.unaccounted_tensors), never copying e4m3 bytes as if they were floats.
"""

from __future__ import annotations

from typing import Mapping

from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..awq.header import not_converted_by
from ..core.layout import QuantModule, common
from ..storage.safetensors_header import DTYPES, TensorInfo

WEIGHT_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
ACTIVATION_LEAVES = ("activation_scale", "input_scale")
METHOD = "fp8"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def parse_config(qc: Mapping | None) -> dict:
    """{"block": [B0, B1] | None, "scale_fmt", "activation_scheme", "modules_to_not_convert": [str],
    "unsupported": [str], "problems": [str]} of a ``quant_method: fp8`` config."""
    qc = qc or {}
    unsupported, problems = [], []
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        problems.append(f"weight_block_size is {block!r}, expected two positive integers")
        block = None
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        unsupported.append(f"fmt {fmt!r}: qconv decodes e4m3 FP8 only")
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        unsupported.append(f"scale_fmt {scale_fmt!r} is not float or ue8m0")
    activation = qc.get("activation_scheme", "dynamic")
    skip = qc.get("modules_to_not_convert")
    if skip is None:
        skip = qc.get("ignored_layers")
    if skip is None:
        skip = []
    elif not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        problems.append(f"modules_to_not_convert is {skip!r}, expected a list of module names")
        skip = []
    return {"block": block, "scale_fmt": scale_fmt, "activation_scheme": activation,
            "modules_to_not_convert": list(skip), "unsupported": unsupported, "problems": problems}


def find_modules(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """One QuantModule per 2-D e4m3 ``*.weight``, from headers and the config alone; ``problems``
    lists what stops an exact decode (``details["unsupported"]`` the part qconv does not decode)."""
    cfg = parse_config(qc)
    block = cfg["block"]
    modules = []
    for name, info in tensors.items():
        if not name.endswith(".weight") or info.dtype != WEIGHT_DTYPE or len(info.shape) != 2:
            continue
        prefix = name[: -len(".weight")]
        out, inp = info.shape
        unsupported, problems = list(cfg["unsupported"]), list(cfg["problems"])
        key = not_converted_by(prefix, cfg["modules_to_not_convert"])
        if key is not None:
            problems.append(f"modules_to_not_convert lists {key!r}, but the module is stored as e4m3: loaders "
                            f"build it as a plain Linear and read the codes as weights")
        scale = tensors.get(prefix + ".weight_scale_inv")
        if scale is None:
            problems.append("e4m3 weight without weight_scale_inv (fused expert scales are not decoded yet)")
        else:
            if scale.dtype not in SCALE_DTYPES:
                unsupported.append(f"weight_scale_inv is {scale.dtype}; fine-grained FP8 stores "
                                   f"{', '.join(SCALE_DTYPES)} scales")
            elif scale.dtype == "F8_E8M0" and cfg["scale_fmt"] != "ue8m0":
                problems.append("weight_scale_inv is F8_E8M0 but the config's scale_fmt is not ue8m0")
            want = ([_ceil(out, block[0]), _ceil(inp, block[1])] if block else None)
            shape = list(scale.shape)
            if want is not None and shape != want:
                problems.append(f"weight_scale_inv has shape {shape}; weight_block_size {block} over a "
                                f"{out} x {inp} weight gives {want}")
            elif want is None and _numel(shape) != 1:
                problems.append(f"weight_scale_inv has shape {shape} but the config has no weight_block_size "
                                f"(one scale per tensor)")
        state = tuple(t for t in (prefix + ".weight_scale_inv",) + tuple(f"{prefix}.{a}" for a in ACTIVATION_LEAVES)
                      if t in tensors)
        details = {"block": list(block) if block else None, "block_rows": block[0] if block else 0,
                   "scale_fmt": cfg["scale_fmt"],
                   "activation_scheme": cfg["activation_scheme"],
                   "scales_dtype": scale.dtype if scale is not None else None,
                   "unsupported": tuple(unsupported)}
        modules.append(QuantModule(prefix, "fp8", "e4m3", 8, out, inp, (name,), state,
                                   group_size=block[1] if block else -1, details=details,
                                   problems=tuple(unsupported + problems)))
    return modules


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> None:
    """Refuse, from headers and config, a module codec.read could not decode exactly: its first
    problem, UnsupportedFormat or CorruptCheckpoint, naming the file and the weight."""
    if not m.problems:
        return
    first = m.problems[0]
    cls = UnsupportedFormat if first in m.details.get("unsupported", ()) else CorruptCheckpoint
    raise cls(first + "; cannot decode it", file=m.file(tensors), tensor=m.weight_tensors[0])


def settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of a fine-grained FP8 checkpoint."""
    cfg = parse_config(qc) if qc else {}
    block = common(tuple(m.details["block"]) if m.details.get("block") else None for m in modules)
    return {"weight_block_size": list(block) if isinstance(block, tuple) else (block or cfg.get("block")),
            "scale_fmt": cfg.get("scale_fmt"), "activation_scheme": cfg.get("activation_scheme"),
            "modules_to_not_convert": cfg.get("modules_to_not_convert"),
            "scales_dtype": common(DTYPES[m.details["scales_dtype"]][1] for m in modules
                                   if m.details.get("scales_dtype") in DTYPES)}


def lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str], comp, warnings: list[str]) -> None:
    """modules_to_not_convert entries that name nothing (vLLM matches them by substring)."""
    for entry in parse_config(qc)["modules_to_not_convert"]:
        if not any(entry in name for name in all_modules):
            warnings.append(f"modules_to_not_convert entry {entry!r} matches no module of this checkpoint")
