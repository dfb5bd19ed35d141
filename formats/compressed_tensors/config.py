"""compressed-tensors' quantization_config (stdlib): the formats and leaves every part of the family
names, and which config group quantizes a module, with what weight arguments and in which format.

Which config group quantizes a module follows compressed_tensors/utils/match.py and
quantization/lifecycle/apply.py: a target or ignore entry matches by exact name, by ``re:<regex>``
with re.match (anchored at the start only), or by class name ("Linear"); ``ignore`` wins; among the
targets that match, exact names come first, then regexes, then class names (each kind sorted), and
a target named by two groups belongs to the later one.
"""

from __future__ import annotations

import re
from typing import Mapping

QUANT_METHOD = "compressed-tensors"
PACKED = "pack-quantized"
INT = "int-quantized"
NAIVE = "naive-quantized"
READABLE_FORMATS = (PACKED, INT, NAIVE)    # integer formats: read and written
FLOAT = "float-quantized"
NVFP4 = "nvfp4-pack-quantized"
MXFP4 = "mxfp4-pack-quantized"
FLOAT_FORMATS = (FLOAT, NVFP4, MXFP4)      # floating-point formats: read (FLOAT also written)
MIXED = "mixed-precision"
# The release whose layout config_for describes (dense sub-byte packing, no act-order g_idx).
LAYOUT_VERSION = "0.19.0"

# Written beside a module's weight by other schemes (static activations, nvfp4): claimed, not decoded.
EXTRA_STATE_LEAVES = ("weight_global_scale", "input_scale", "input_zero_point", "input_global_scale",
                      "output_scale", "output_zero_point")
_SCALE_DTYPES = ("F16", "BF16", "F32")
_INT_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")


def _targets(entry) -> list[str]:
    if entry is None:
        return []
    if isinstance(entry, str):
        return [entry]
    return [t for t in entry if isinstance(t, str)]


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' match_name: ``re:`` + re.match (anchored at the start, not the end), else
    the exact name. An invalid regex matches nothing."""
    if target.startswith("re:"):
        try:
            return re.match(target[3:], name) is not None
        except re.error:
            return False
    return target == name


def _class_names(class_name) -> tuple[str, ...]:
    if class_name is None:
        return ()
    if isinstance(class_name, str):
        return (class_name,)
    return tuple(class_name)


def _matches(name: str, classes: tuple[str, ...], target: str) -> bool:
    return match_name(name, target) or target in classes


def is_ignored(qc: Mapping, module_name: str, class_name="Linear") -> bool:
    classes = _class_names(class_name)
    return any(_matches(module_name, classes, t) for t in _targets(qc.get("ignore")))


def scheme_for(qc: Mapping | None, module_name: str, class_name="Linear") -> tuple[str, dict] | None:
    """(group name, group dict) of the config group that quantizes ``module_name``, or None when no
    group targets it or ``ignore`` names it. ``class_name`` is the module's class name (or the names
    of its classes, most derived first); headers cannot tell, so a module with quantized tensors is
    taken to be a Linear."""
    if not qc:
        return None
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        return None
    classes = _class_names(class_name)
    if is_ignored(qc, module_name, classes):
        return None
    target_to_group: dict[str, str] = {}
    for gname, group in groups.items():
        if isinstance(group, Mapping):
            for target in _targets(group.get("targets")):
                target_to_group[target] = gname          # a later group takes a repeated target
    ordered = sorted(target_to_group, key=lambda t: (t.startswith("re:"), t))
    matched = [t for t in ordered if match_name(module_name, t)]
    matched += [t for t in ordered if t in classes and t not in matched]
    if not matched:
        return None
    gname = target_to_group[matched[0]]
    return gname, groups[gname]


def weight_args(group: Mapping) -> dict:
    """The group's ``weights`` QuantizationArgs with compressed-tensors' defaults and its strategy
    inference (group_size None -> tensor, > 0 -> group, -1 -> channel)."""
    w = group.get("weights")
    if not isinstance(w, Mapping):
        return {}
    args = {"num_bits": w.get("num_bits", 8), "type": str(w.get("type") or "int").lower(),
            "symmetric": w.get("symmetric", True), "group_size": w.get("group_size"),
            "strategy": w.get("strategy"), "actorder": w.get("actorder"),
            "dynamic": w.get("dynamic", False), "block_structure": w.get("block_structure"),
            "scale_dtype": w.get("scale_dtype")}
    strategy = args["strategy"]
    gs = args["group_size"]
    if strategy is None:
        strategy = ("tensor" if gs is None else "group" if isinstance(gs, int) and gs > 0
                    else "channel" if gs == -1 else None)
    args["strategy"] = str(strategy).lower() if strategy is not None else None
    if args["actorder"] is True:                    # before 0.19: True meant "group"
        args["actorder"] = "group"
    if args["actorder"] == "dynamic":
        args["actorder"] = "group"
    if args["actorder"] == "static":
        args["actorder"] = "weight"
    return args


def group_format(qc: Mapping, group: Mapping) -> str:
    """The format a group's modules are stored in: the group's own ``format``, else the top-level one
    (unless it is "mixed-precision"), else what compressed-tensors infers from the scheme
    (compressors/format.py: int weights with activations -> int-quantized, 1..8-bit int weights ->
    pack-quantized, 4-bit float weights in groups of 32 -> mxfp4-pack-quantized, of 16 ->
    nvfp4-pack-quantized, 8-bit float weights -> float-quantized, otherwise naive-quantized)."""
    fmt = group.get("format")
    if fmt:
        return str(fmt)
    top = qc.get("format")
    if top and top != MIXED:
        return str(top)
    args = weight_args(group)
    acts = group.get("input_activations")
    if args.get("type") == "int" and isinstance(acts, Mapping):
        return INT if str(acts.get("type") or "int").lower() == "int" else "float-quantized"
    if args.get("type") == "int" and isinstance(args.get("num_bits"), int) and 1 <= args["num_bits"] <= 8:
        return PACKED
    if args.get("type") == "float" and args.get("num_bits") == 4:
        return {32: MXFP4, 16: NVFP4}.get(args.get("group_size"), NAIVE)
    if args.get("type") == "float" and args.get("num_bits") == 8:
        return FLOAT
    return NAIVE


def parse_version(version) -> tuple[int, ...] | None:
    """(major, minor, patch) of a compressed-tensors version string ("0.17.1", "0.12.3.a2025...")."""
    if not isinstance(version, str):
        return None
    parts = []
    for piece in version.split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
    return tuple(parts) if parts else None
