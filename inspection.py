"""`qconv inspect`: what a checkpoint holds, from headers and configs alone.

Imports neither torch nor numpy. The only tensor bytes read are bitsandbytes' tiny metadata tensors
(the quant_state JSON of each 4-bit module and the weight_format byte of each int8 module).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Mapping

from .formats import bnb, gptq
from .formats.checkpoint import Component, open_target
from .formats.detect import METHOD_NAMES, detect
from .formats.layout import QuantModule, module_of, natural_key
from .formats.safetensors_header import DTYPES, FLOAT_DTYPES

MAX_EXAMPLES = 3


def inspect_path(path: str | Path) -> dict:
    target = open_target(path)
    return {"path": str(path), "kind": target.kind,
            "components": [inspect_component(c) for c in target.components]}


def _examples(names) -> str:
    names = sorted(names, key=natural_key)
    more = f", ... ({len(names)} in all)" if len(names) > MAX_EXAMPLES else ""
    return ", ".join(names[:MAX_EXAMPLES]) + more


def _suggest_prefix(names, key: str) -> str:
    """The shortest dotted prefix ending in ``key`` among the names (``model.visual``)."""
    best = None
    for n in names:
        parts = n.split(".")
        for i, p in enumerate(parts):
            if p == key:
                cand = ".".join(parts[: i + 1])
                if best is None or len(cand) < len(best):
                    best = cand
                break
    return best or key


def _lint_bnb(qc: Mapping, modules: list[QuantModule], all_modules: set[str],
              comp: Component, warnings: list[str]) -> None:
    cfg = bnb.parse_config(qc)
    threshold = cfg["threshold"]
    if not isinstance(threshold, float):
        fix = (f" (write {float(threshold)!r})" if isinstance(threshold, int) and not isinstance(threshold, bool)
               else "")
        warnings.append(f"llm_int8_threshold is {threshold!r}, not a float: transformers raises TypeError "
                        f"when it loads this config{fix}")
    skip = cfg["skip_modules"]
    quantized = [m.name for m in modules]
    if skip is not None and not isinstance(skip, list):
        warnings.append(f"llm_int8_skip_modules is {type(skip).__name__}, transformers needs a list")
        skip = None
    for key in skip or []:
        if not isinstance(key, str):
            warnings.append(f"llm_int8_skip_modules entry {key!r} is not a string")
            continue
        skipped_quantized = [m for m in quantized if bnb.skipped_by_transformers5(m, key)]
        if skipped_quantized:
            warnings.append(
                f"config and tensors disagree: llm_int8_skip_modules entry {key!r} tells "
                f"transformers >= 5 not to quantize {len(skipped_quantized)} modules that are stored "
                f"quantized ({_examples(skipped_quantized)})")
        if any(bnb.skipped_by_transformers5(m, key) for m in all_modules):
            continue
        meant = [m for m in quantized if bnb.skipped_by_transformers4(m, key)]
        if meant:
            prefix = _suggest_prefix(meant, key)
            warnings.append(
                f"llm_int8_skip_modules entry {key!r} matches no module under transformers >= 5 rules "
                f"(entries match from the start of the module name, or as a suffix), yet "
                f"{len(meant)} quantized modules contain {key!r} ({_examples(meant)}): they were "
                f"quantized, probably against intent (transformers 4.x skipped them). To keep them "
                f"unquantized, requantize with the full prefix {prefix!r}")
    if skip is not None and "lm_head" in all_modules and "lm_head" not in quantized:
        head = comp.tensors.get("lm_head.weight")
        if head is not None and head.dtype in FLOAT_DTYPES and not any(
                isinstance(k, str) and bnb.skipped_by_transformers5("lm_head", k) for k in skip):
            warnings.append("lm_head is stored unquantized but llm_int8_skip_modules does not list it; "
                            "with an explicit list transformers does not add lm_head itself and will "
                            "try to quantize it on load: add 'lm_head'")
    fours = [m for m in modules if m.family == "bnb4"]
    if fours:
        types = sorted({m.scheme for m in fours})
        if cfg["quant_type"] not in types:
            warnings.append(f"config bnb_4bit_quant_type is {cfg['quant_type']!r} but the tensors are "
                            f"{'/'.join(types)}")
        dq = {m.details["double_quant"] for m in fours}
        if dq != {cfg["double_quant"]}:
            warnings.append(f"config bnb_4bit_use_double_quant is {cfg['double_quant']} but the "
                            f"tensors {'mix both' if len(dq) > 1 else 'say ' + str(dq.pop())}")
        storages = {m.details["quant_storage"] for m in fours}
        if storages != {cfg["quant_storage"]}:
            warnings.append(f"config bnb_4bit_quant_storage is {cfg['quant_storage']!r} but the packed "
                            f"weights are stored as {'/'.join(sorted(map(str, storages)))}")


def _lint_gptq(qc: Mapping, modules: list[QuantModule], all_modules: set[str],
               settings: Mapping, warnings: list[str]) -> None:
    by_kind: dict[str, list[str]] = defaultdict(list)
    for m in modules:
        want = gptq.per_module_settings(qc, m.name)
        if want is None:
            by_kind["the config says not to quantize, but they are stored quantized"].append(m.name)
            continue
        if isinstance(want["bits"], int) and m.bits and want["bits"] != m.bits:
            by_kind[f"the config asks for {want['bits']}-bit but the shapes hold {m.bits}-bit codes"
                    ].append(m.name)
        gs = want["group_size"]
        groups = m.details.get("groups")
        if isinstance(gs, int) and groups and m.in_features:
            expected = 1 if gs <= 0 else -(-m.in_features // gs)
            if groups != expected:
                found = f"group size {m.group_size}" if m.group_size else f"{groups} groups"
                by_kind[f"the config's group_size {gs} does not fit the scales, which hold {found}"
                        ].append(m.name)
    for kind, names in by_kind.items():
        warnings.append(f"config and tensors disagree on {len(names)} modules: {kind} "
                        f"({_examples(names)})")
    warnings.extend(gptq.unmatched_extra_config(qc, sorted(all_modules)))
    if settings.get("desc_act"):
        missing = [m.name for m in modules if not m.details.get("has_g_idx")]
        if missing:
            warnings.append(f"desc_act is true but {len(missing)} modules have no g_idx "
                            f"({_examples(missing)})")
    fmt = settings.get("checkpoint_format")
    if fmt is not None and fmt not in gptq.GPTQ_FORMATS:
        warnings.append(f"checkpoint_format {fmt!r} is a kernel-specific repack; qconv reads gptq and "
                        f"gptq_v2")
    pf = settings.get("packing_format")
    if pf is not None and pf not in gptq.AUTO_ROUND_READABLE:
        warnings.append(f"packing_format {pf!r} is not a GPTQ layout; qconv reads "
                        f"{', '.join(gptq.AUTO_ROUND_READABLE)}")
    if settings.get("sym") is False and settings.get("zero_point") == "stored z-1 (v1)":
        warnings.append("asymmetric with v1 zero points (stored z-1): a zero point of 0 cannot be "
                        "stored exactly, and vLLM >= 0.33 runs no asymmetric GPTQ")


def _common(values):
    values = {v for v in values if v is not None}
    return values.pop() if len(values) == 1 else (sorted(values) if values else None)


def inspect_component(comp: Component) -> dict:
    det = detect(comp)
    warnings: list[str] = list(comp.warnings) + list(det.warnings)
    tensors = comp.tensors
    qc, qc_source, cfg_method, method = det.qc, det.qc_source, det.cfg_method, det.method
    modules = list(det.modules)

    # Config against tensors.
    if qc is None and modules:
        warnings.append(f"tensors are quantized ({method}) but there is no quantization_config: "
                        f"loaders will treat the packed tensors as plain weights")
    if qc is not None and not modules and cfg_method in ("bnb8", "bnb4", "gptq", "auto-round",
                                                         "bitsandbytes"):
        warnings.append(f"{qc_source} says {METHOD_NAMES.get(cfg_method, cfg_method)} but no tensor "
                        f"is quantized")
    if modules and cfg_method in ("bnb8", "bnb4", "gptq", "auto-round"):
        expected = {"bnb8": {"bnb8"}, "bnb4": {"bnb4"}, "gptq": {"gptq"}, "auto-round": {"gptq"}}
        found = {m.family for m in modules}
        if not found <= expected[cfg_method]:
            warnings.append(f"{qc_source} says {METHOD_NAMES[cfg_method]} but the tensors hold "
                            f"{', '.join(METHOD_NAMES[f] for f in sorted(found - expected[cfg_method]))}")

    problems = defaultdict(list)
    for m in modules:
        for p in m.problems:
            problems[p].append(m.name)
    for p, names in problems.items():
        warnings.append(f"{len(names)} modules: {p} ({_examples(names)})")

    state = det.state_tensors
    claimed = det.claimed_tensors
    unscaled = [t for t in det.unaccounted if tensors[t].dtype == "I8" and t.endswith(".weight")
                and module_of(t) + ".SCB" not in tensors]
    if unscaled:
        warnings.append(f"{len(unscaled)} int8 weights have no SCB scale tensor, so they cannot be "
                        f"dequantized ({_examples(module_of(t) for t in unscaled)})")
    orphans = [t for t in det.unaccounted if t not in unscaled]
    if orphans:
        warnings.append(f"{len(orphans)} quantization tensors belong to no quantized module "
                        f"({_examples(orphans)}); qconv will not convert this folder")
        state |= set(orphans)

    parameter_dtypes: dict[str, int] = defaultdict(int)
    tensor_dtypes: dict[str, int] = defaultdict(int)
    for t, info in tensors.items():
        tensor_dtypes[info.torch_dtype] += info.numel
        if t not in state:
            parameter_dtypes[info.torch_dtype] += info.numel

    quantized_modules: dict[str, list[str]] = defaultdict(list)
    quantized_parameters: dict[str, int] = defaultdict(int)
    quantized_bytes: dict[str, int] = defaultdict(int)
    for m in modules:
        quantized_modules[m.scheme].append(m.name)
        quantized_parameters[m.scheme] += m.logical_parameters
        quantized_bytes[m.scheme] += sum(tensors[t].nbytes for t in m.weight_tensors + m.state_tensors)
    schemes = sorted(quantized_modules, key=natural_key)

    all_modules = {module_of(t) for t in tensors}
    settings: dict = {}
    if qc is not None and cfg_method in ("bnb8", "bnb4", "bitsandbytes"):
        _lint_bnb(qc, modules, all_modules, comp, warnings)
    if any(m.family == "gptq" for m in modules):
        gq = [m for m in modules if m.family == "gptq"]
        settings = gptq.parse_config(qc) if qc and cfg_method in ("gptq", "auto-round") else {}
        if not settings:
            group_sizes = {m.group_size for m in gq}
            settings = {"bits": _common(m.bits for m in gq),
                        "group_size": group_sizes.pop() if len(group_sizes) == 1 else None}
        if qc and cfg_method in ("gptq", "auto-round"):
            _lint_gptq(qc, gq, all_modules, settings, warnings)
        settings["act_order_modules"] = sum(1 for m in gq if m.details.get("has_g_idx")) if \
            settings.get("desc_act") else 0
        settings["scales_dtype"] = _common(DTYPES[m.details["scales_dtype"]][1]
                                           for m in gq if m.details.get("scales_dtype"))

    logical = sum(quantized_parameters.values()) + sum(
        tensors[t].numel for t in tensors if t not in claimed and t not in state)
    tensor_bytes = sum(i.nbytes for i in tensors.values())
    report: dict = {"component": comp.name, "method": method}
    if method == "bitsandbytes LLM.int8":
        cfg = bnb.parse_config(qc) if qc else {"threshold": None, "skip_modules": None}
        report.update({
            "threshold": cfg["threshold"],
            "skip_modules": cfg["skip_modules"],
            "linear8bit_modules": list(quantized_modules.get("int8", [])),
        })
    elif method == "bitsandbytes 4-bit":
        fours = [m for m in modules if m.family == "bnb4"]
        cfg = bnb.parse_config(qc) if qc else {}
        report.update({
            "quant_type": _common(m.scheme for m in fours),
            "blocksize": _common(m.group_size for m in fours),
            "double_quant": _common(m.details["double_quant"] for m in fours),
            "quant_storage": _common(m.details["quant_storage"] for m in fours),
            "original_dtype": _common(m.details["dtype"] for m in fours),
            "compute_dtype": cfg.get("compute_dtype"),
            "skip_modules": cfg.get("skip_modules"),
        })
    elif method in ("GPTQ", "auto-round"):
        report.update(settings)
    report["parameter_dtypes"] = dict(sorted(parameter_dtypes.items()))
    if method == "bitsandbytes LLM.int8":
        report["int8_parameters"] = quantized_parameters.get("int8", 0)
    report.update({
        "tensor_dtypes": dict(sorted(tensor_dtypes.items())),
        "quantized_modules": {s: quantized_modules[s] for s in schemes},
        "quantized_parameters": {s: quantized_parameters[s] for s in schemes},
        "quantized_bits_per_weight": {s: round(8 * quantized_bytes[s] / quantized_parameters[s], 3)
                                      for s in schemes if quantized_parameters[s]},
        "logical_parameters": logical,
        "bits_per_weight": round(8 * tensor_bytes / logical, 3) if logical else None,
        "tensors": len(tensors),
        "files": [str(f.relative_to(comp.path)) if f != comp.path else f.name for f in comp.files],
        "bytes_on_disk": comp.bytes_on_disk,
        "config": qc_source,
        "warnings": warnings,
    })
    return report


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


def _human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


_HEADLINE_KEYS = {"component", "method", "parameter_dtypes", "tensor_dtypes", "quantized_modules",
                  "quantized_parameters", "quantized_bits_per_weight", "logical_parameters",
                  "bits_per_weight", "tensors", "files", "bytes_on_disk", "config", "warnings",
                  "linear8bit_modules", "int8_parameters"}


def render_text(result: dict, *, all_modules: bool = False) -> str:
    from tabulate import tabulate

    blocks = []
    for r in result["components"]:
        lines = [f"{r['component']}: {r['method']}",
                 f"  {len(r['files'])} file(s), {_human_bytes(r['bytes_on_disk'])} on disk, "
                 f"{r['tensors']} tensors, {_human_count(r['logical_parameters'])} logical parameters"
                 + (f", {r['bits_per_weight']} bits/weight overall" if r["bits_per_weight"] else "")
                 + (f"; quantization config from {r['config']}" if r["config"] else "")]
        settings = [(k, ", ".join(map(str, v)) if isinstance(v, list) else v)
                    for k, v in r.items() if k not in _HEADLINE_KEYS]
        if settings:
            lines += ["", _indent(tabulate(settings, headers=["setting", "value"]))]
        if r["quantized_modules"]:
            rows = [(s, len(r["quantized_modules"][s]), f"{r['quantized_parameters'][s]:,}",
                     r["quantized_bits_per_weight"].get(s)) for s in r["quantized_modules"]]
            lines += ["", _indent(tabulate(rows, headers=["scheme", "modules", "logical params",
                                                          "bits/weight"], colalign=("left", "right", "right", "right")))]
            for s, names in r["quantized_modules"].items():
                shown = names if all_modules else compress_names(names)
                lines += [f"  {s} modules:"] + [f"    {n}" for n in shown]
        dtypes = sorted(set(r["parameter_dtypes"]) | set(r["tensor_dtypes"]))
        rows = [(d, f"{r['parameter_dtypes'].get(d, 0):,}", f"{r['tensor_dtypes'].get(d, 0):,}")
                for d in dtypes]
        lines += ["", _indent(tabulate(rows, headers=["dtype", "parameters", "all tensors"],
                                       colalign=("left", "right", "right")))]
        if r["warnings"]:
            lines += ["", f"  warnings ({len(r['warnings'])}):"] + [f"  ! {w}" for w in r["warnings"]]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
