"""`qconv inspect`: what a checkpoint holds, from headers and configs alone (safetensors folders and
files; a one-file container such as GGUF is described and rendered by its family: storage's container
hooks, gguf/report.py).

Imports neither torch nor numpy. The only tensor bytes read are bitsandbytes' tiny metadata tensors
(the quant_state JSON of each 4-bit module and the weight_format byte of each int8 module).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from .formats.storage.checkpoint import Component, container_named, container_of, open_target
from .formats.core.activation import header_problem as activation_header_problem
from .formats.core.detect import DECODED_METHODS, METHOD_NAMES, detect
from .formats.core.layout import examples as _examples, human_bytes, human_count, indent, module_of, natural_key
from .formats.core.registry import dialects_for, families
from .formats.core.structure import disagreements, key_namer, logical_shapes


def inspect_path(path: str | Path) -> dict:
    container = container_of(path)
    if container is not None and container.describe is not None:     # a GGUF: its own header-only report
        return {"path": str(path), **container.describe(path)}
    target = open_target(path)
    return {"path": str(path), "kind": target.kind,
            "components": [inspect_component(c) for c in target.components]}


def inspect_component(comp: Component) -> dict:
    det = detect(comp)
    warnings: list[str] = list(comp.warnings) + list(det.warnings)
    tensors, qc, cfg_method = comp.tensors, det.qc, det.cfg_method
    modules = list(det.modules)

    _config_warnings(det, modules, warnings)
    _module_warnings(comp, modules, warnings)
    state = det.state_tensors
    orphans = _unaccounted_warnings(det.unaccounted, tensors, warnings)
    if orphans:
        state |= set(orphans)
    counts = _counts(tensors, modules, state, det.claimed_tensors)

    all_modules = {module_of(t) for t in tensors}
    if qc is not None:
        for dialect in dialects_for(cfg_method):
            dialect.lint(qc, modules, all_modules, comp, warnings)
    report: dict = {"component": comp.name, "method": det.method, **_family_settings(qc, cfg_method, modules)}
    experts = _experts(modules)
    if experts:
        report["experts"] = experts
    report.update(counts)
    report.update({
        "tensors": len(tensors),
        "files": [f.name if comp.path.is_file() else str(f.relative_to(comp.path)) for f in comp.files],
        "bytes_on_disk": comp.bytes_on_disk,
        "config": det.qc_source,
        "warnings": warnings,
    })
    return report


def _config_warnings(det, modules, warnings: list[str]) -> None:
    """The quantization config against the tensors: missing, naming a method no tensor holds, or
    another family than the tensors'."""
    qc, qc_source, cfg_method, method = det.qc, det.qc_source, det.cfg_method, det.method
    if qc is None and modules:
        warnings.append(f"tensors are quantized ({method}) but there is no quantization_config: "
                        f"loaders will treat the packed tensors as plain weights")
    if qc is not None and not modules and cfg_method in DECODED_METHODS:
        warnings.append(f"{qc_source} says {METHOD_NAMES.get(cfg_method, cfg_method)} but no tensor "
                        f"is quantized")
    expected = {f.name for f in families() if cfg_method in f.config_methods}
    if modules and expected:
        found = {m.family for m in modules}
        if not found <= expected:
            warnings.append(f"{qc_source} says {METHOD_NAMES[cfg_method]} but the tensors hold "
                            f"{', '.join(METHOD_NAMES[f] for f in sorted(found - expected))}")


def _module_warnings(comp: Component, modules, warnings: list[str]) -> None:
    """The modules' own problems (one line per problem), activation scales the config contradicts, and
    where the config's shapes disagree with the tensors'."""
    tensors = comp.tensors
    problems = defaultdict(list)
    for m in modules:
        for p in m.problems:
            problems[p].append(m.name)
    for p, names in problems.items():
        warnings.append(f"{len(names)} modules: {p} ({_examples(names)})")
    contradicted = [found for m in modules if (found := activation_header_problem(m, tensors)) is not None]
    if contradicted:              # every writing verb refuses these (activation.check)
        warnings.append(f"{len(contradicted)} activation scales contradict the config "
                        f"({_examples(t for t, _ in contradicted)}); {contradicted[0][0]}: {contradicted[0][1]}")
    warnings += [f"config and tensors disagree: {d.message(key_namer(comp.config, comp.config_names))}"
                 for d in disagreements(comp.config, logical_shapes(tensors, modules))]


def _unaccounted_warnings(unaccounted, tensors, warnings: list[str]) -> list[str]:
    """Warn of quantization tensors no module claims: int8 weights without their SCB scale, and the
    rest (returned: the orphans, which count as state, not parameters)."""
    unscaled = [t for t in unaccounted if tensors[t].dtype == "I8" and t.endswith(".weight")
                and module_of(t) + ".SCB" not in tensors]
    if unscaled:
        warnings.append(f"{len(unscaled)} int8 weights have no SCB scale tensor, so they cannot be "
                        f"dequantized ({_examples(module_of(t) for t in unscaled)})")
    orphans = [t for t in unaccounted if t not in unscaled]
    if orphans:
        warnings.append(f"{len(orphans)} quantization tensors belong to no quantized module "
                        f"({_examples(orphans)}); qconv will not convert this folder")
    return orphans


def _counts(tensors, modules, state: set[str], claimed: set[str]) -> dict:
    """The report's counts: parameters (state tensors left out) and tensors by dtype, per scheme the
    quantized modules, their parameters and bits per weight, and the totals."""
    parameter_dtypes: dict[str, int] = defaultdict(int)
    tensor_dtypes: dict[str, int] = defaultdict(int)
    for t, info in tensors.items():
        tensor_dtypes[info.torch_dtype] += info.numel
        if t not in state:
            parameter_dtypes[info.torch_dtype] += info.numel
    quantized_modules, quantized_parameters, quantized_bytes = _quantized(tensors, modules)
    schemes = sorted(quantized_modules, key=natural_key)
    logical = sum(quantized_parameters.values()) + sum(
        tensors[t].numel for t in tensors if t not in claimed and t not in state)
    tensor_bytes = sum(i.nbytes for i in tensors.values())
    return {
        "parameter_dtypes": dict(sorted(parameter_dtypes.items())),
        "tensor_dtypes": dict(sorted(tensor_dtypes.items())),
        "quantized_modules": {s: quantized_modules[s] for s in schemes},
        "quantized_parameters": {s: quantized_parameters[s] for s in schemes},
        "quantized_bits_per_weight": {s: round(8 * quantized_bytes[s] / quantized_parameters[s], 3)
                                      for s in schemes if quantized_parameters[s]},
        "logical_parameters": logical,
        "bits_per_weight": round(8 * tensor_bytes / logical, 3) if logical else None,
    }


def _quantized(tensors, modules) -> tuple[dict[str, list[str]], dict[str, int], dict[str, int]]:
    """Per scheme: the module names, their logical parameters, and their stored bytes."""
    quantized_modules: dict[str, list[str]] = defaultdict(list)
    quantized_parameters: dict[str, int] = defaultdict(int)
    quantized_bytes: dict[str, int] = defaultdict(int)
    counted: set[str] = set()              # a tensor several modules share (fused expert scales) counts once
    for m in modules:
        quantized_modules[m.scheme].append(m.name)
        quantized_parameters[m.scheme] += m.logical_parameters
        own = [t for t in m.weight_tensors + m.state_tensors if t not in counted]
        counted.update(own)
        quantized_bytes[m.scheme] += sum(tensors[t].nbytes for t in own)
    return quantized_modules, quantized_parameters, quantized_bytes


def _family_settings(qc, cfg_method, modules) -> dict:
    """Each family's own settings, the config's where that family's dialect wrote it."""
    settings: dict = {}
    for f in families():
        own = [m for m in modules if m.family == f.name]
        if own:
            settings.update(f.settings(qc if cfg_method in f.config_methods else None, own))
    return settings


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.")


def _experts(modules) -> dict[str, int]:
    """MoE experts of the quantized modules, compactly: {experts block (numbered siblings folded, as
    compress_names does): experts in each}, from per-expert Linears (experts.N.gate_proj) and fused
    3-D experts alike, so a 256-expert, 58-layer model reads as one line."""
    count: dict[str, int] = {}
    for m in modules:
        if m.experts:
            block, n = m.name.rsplit(".", 1)[0], m.experts
        elif (match := _EXPERT.match(m.name)):
            block, n = match.group(1), int(match.group(2)) + 1
        else:
            continue
        count[block] = max(count.get(block, 0), n)
    by_count: dict[int, list[str]] = defaultdict(list)
    for block, n in count.items():
        by_count[n].append(block)
    return {name: n for n, blocks in sorted(by_count.items()) for name in compress_names(blocks)}


# ---------------------------------------------------------------------------------------------
# Human output

def compress_names(names) -> list[str]:
    """Fold numbered siblings: layers.0.mlp.up_proj ... layers.35.mlp.up_proj -> layers.{0-35}.mlp.up_proj."""
    groups: dict[tuple, list[tuple[int, ...]]] = defaultdict(list)
    for n in names:
        parts = n.split(".")
        shape = tuple("#" if p.isdigit() else p for p in parts)
        groups[shape].append(tuple(int(p) for p in parts if p.isdigit()))
    out = []
    for shape, numbers in groups.items():
        positions = list(zip(*numbers)) if numbers and numbers[0] else []
        sets = [sorted(set(col)) for col in positions]
        product = 1
        for s in sets:
            product *= len(s)
        if product != len(set(numbers)):        # not a full grid: list each name
            out.extend(".".join(_fill(shape, nums)) for nums in sorted(set(numbers)))
            continue
        ranges = iter(_ranges(s) for s in sets)
        out.append(".".join(next(ranges) if p == "#" else p for p in shape))
    return sorted(out, key=natural_key)


def _fill(shape, numbers):
    it = iter(numbers)
    return [str(next(it)) if p == "#" else p for p in shape]


def _ranges(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    spans, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return "{" + ",".join(spans) + "}"


_HEADLINE_KEYS = {"component", "method", "parameter_dtypes", "tensor_dtypes", "quantized_modules",
                  "quantized_parameters", "quantized_bits_per_weight", "logical_parameters",
                  "bits_per_weight", "tensors", "files", "bytes_on_disk", "config", "warnings",
                  "linear8bit_modules", "int8_parameters"}


def render_text(result: dict, *, all_modules: bool = False) -> str:
    from tabulate import tabulate

    own = container_named(result["kind"])
    if own is not None and own.render is not None:
        return own.render(result)
    blocks = []
    for r in result["components"]:
        lines = [f"{r['component']}: {r['method']}",
                 f"  {len(r['files'])} file(s), {human_bytes(r['bytes_on_disk'])} on disk, "
                 f"{r['tensors']} tensors, {human_count(r['logical_parameters'])} logical parameters"
                 + (f", {r['bits_per_weight']} bits/weight overall" if r["bits_per_weight"] else "")
                 + (f"; quantization config from {r['config']}" if r["config"] else "")]
        settings = [(k, _setting_text(v)) for k, v in r.items() if k not in _HEADLINE_KEYS]
        if settings:
            lines += ["", indent(tabulate(settings, headers=["setting", "value"]))]
        if r["quantized_modules"]:
            rows = [(s, len(r["quantized_modules"][s]), f"{r['quantized_parameters'][s]:,}",
                     r["quantized_bits_per_weight"].get(s)) for s in r["quantized_modules"]]
            lines += ["", indent(tabulate(rows, headers=["scheme", "modules", "logical params",
                                                          "bits/weight"], colalign=("left", "right", "right", "right")))]
            for s, names in r["quantized_modules"].items():
                shown = names if all_modules else compress_names(names)
                lines += [f"  {s} modules:"] + [f"    {n}" for n in shown]
        dtypes = sorted(set(r["parameter_dtypes"]) | set(r["tensor_dtypes"]))
        rows = [(d, f"{r['parameter_dtypes'].get(d, 0):,}", f"{r['tensor_dtypes'].get(d, 0):,}")
                for d in dtypes]
        lines += ["", indent(tabulate(rows, headers=["dtype", "parameters", "all tensors"],
                                       colalign=("left", "right", "right")))]
        if r["warnings"]:
            lines += ["", f"  warnings ({len(r['warnings'])}):"] + [f"  ! {w}" for w in r["warnings"]]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _setting_text(value) -> str:
    """A setting for the table: lists comma-joined, a mapping one `key: value` line per entry (nested
    mappings as `k=v` pairs), so compressed-tensors' config groups read as one line each."""
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return "\n".join(f"{k}: " + (", ".join(f"{ik}={_setting_text(iv)}" for ik, iv in v.items() if iv is not None)
                                      if isinstance(v, dict) else str(_setting_text(v))) for k, v in value.items())
    return value
