"""What inspect reports of a compressed-tensors checkpoint (stdlib): its config groups, the modules each
quantizes, and the config's lints.
"""

from __future__ import annotations

import re
from typing import Mapping

from ..core.layout import natural_key
from ..storage.safetensors_header import DTYPES
from .config import _targets, group_format, weight_args

_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*")


def _common(values):
    values = set(values)
    return values.pop() if len(values) == 1 else (sorted(values, key=str) if values else None)


def settings(qc: Mapping | None, modules, all_modules=(), comp=None, warnings: list | None = None) -> dict:
    """Report fields for a compressed-tensors component (stdlib only), and its lints, appended to
    ``warnings``: a name or ``re:`` target that matches no module of the checkpoint (compressed-tensors
    warns "Could not match" and quantizes nothing there), an invalid regex, kv-cache quantization whose
    scales qconv does not carry over. Static activation scales are a fact of a group
    (``activation_scales``), not a warning: convert carries them (core/activation.py)."""
    qc = qc or {}
    warnings = warnings if warnings is not None else []
    ours = [m for m in modules if m.family == "ct"]
    names = sorted(set(all_modules) | {m.name for m in ours}, key=natural_key)
    groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), Mapping) else {}
    described = {}
    for gname, group in groups.items():
        if not isinstance(group, Mapping):
            warnings.append(f"config_groups.{gname} is not an object")
            continue
        args = weight_args(group)
        acts = group.get("input_activations")
        entry = {"targets": _targets(group.get("targets")), "format": group_format(qc, group),
                 "num_bits": args.get("num_bits"), "type": args.get("type"), "strategy": args.get("strategy"),
                 "group_size": args.get("group_size"), "symmetric": args.get("symmetric")}
        for key in ("block_structure", "scale_dtype"):       # set by the floating-point presets only
            if args.get(key) is not None:
                entry[key] = args[key]
        dynamic = acts.get("dynamic") if isinstance(acts, Mapping) else None
        how = " dynamic (static global scale)" if dynamic == "local" else " dynamic" if dynamic else " static"
        entry["input_activations"] = (None if not isinstance(acts, Mapping) else
                                      f"{acts.get('type', 'int')}{acts.get('num_bits', 8)} {acts.get('strategy')}{how}")
        entry["modules"] = sum(1 for m in ours if m.details.get("group") == gname)
        described[gname] = entry
        for target in _targets(group.get("targets")):
            if target.startswith("re:"):
                try:
                    rx = re.compile(target[3:])
                except re.error as exc:
                    warnings.append(f"config_groups.{gname} target {target!r} is not a valid regex ({exc})")
                    continue
                if not any(rx.match(n) for n in names):
                    warnings.append(f"config_groups.{gname} target {target!r} matches no module of this "
                                    f"checkpoint")
            elif not _CLASS_NAME.fullmatch(target) and target not in names:
                warnings.append(f"config_groups.{gname} target {target!r} names no module of this checkpoint")
        members = [m for m in ours if m.details.get("group") == gname]
        static = [m for m in members if m.details.get("activation")]
        if static:                # a fact, not a risk: convert carries them where the target holds the scheme
            leaf = static[0].details["activation"]["tensor"].rsplit(".", 1)[-1]
            entry["activation_scales"] = (f"{leaf} on {len(static)} of {len(members)} modules (static, "
                                          f"calibrated; carried by targets that hold them)")
    for target in _targets(qc.get("ignore")):
        if target.startswith("re:"):
            try:
                re.compile(target[3:])
            except re.error as exc:
                warnings.append(f"ignore entry {target!r} is not a valid regex ({exc})")
    if qc.get("kv_cache_scheme"):
        warnings.append("kv_cache_scheme is set: the attention's k/v scales are not converted by qconv")
    scale_dtypes = [m.details["scale_dtype"] for m in ours if m.details.get("scale_dtype") in DTYPES]
    two_level = _common(m.details["global_scale"] for m in ours if m.details.get("global_scale"))
    extra = {"global_scale": f"{two_level} (weight_global_scale, float32 per tensor)"} if two_level else {}
    return {"format": qc.get("format"), "version": qc.get("version"),
            "quantization_status": qc.get("quantization_status"), "config_groups": described,
            "ignore": _targets(qc.get("ignore")),
            "bits": _common(m.bits for m in ours),
            "group_size": _common(None if m.details.get("block_rows") == 0 else m.group_size  # per tensor: none
                                  for m in ours),
            "scales_dtype": _common(DTYPES[d][1] for d in scale_dtypes), **extra}


def lint(qc: Mapping, modules, all_modules, comp, warnings: list) -> None:
    """The config's lints (settings' warnings) for inspect."""
    settings(qc, modules, all_modules, comp, warnings)
