"""GPTQ-packed integer checkpoints (AutoGPTQ, GPTQModel, auto-round), described from headers.

Per quantized Linear ``P`` with ``b``-bit codes in 32-bit words (docs/formats.md, GPTQ)::

    P.qweight  int32 [in*b/32, out]   packed along in (dim 0), LSB-first bitstream
    P.qzeros   int32 [G, out*b/32]    packed along out (dim 1); v1 stores z-1, v2 stores z
    P.scales   fp16  [G, out]         G = ceil(in / group_size), 1 for group_size -1
    P.g_idx    int32 [in]             optional: group of each input channel (act-order)

So ``out`` comes from scales, ``b`` from qzeros' width against out, ``in`` from qweight's rows, and
every module's bit width can be read from its shapes alone, mixed-bit checkpoints included.
Stdlib only, so `inspect` stays light; decoding the data is gptq/codec.py.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import replace
from typing import Mapping

from ...errors import NotStorable
from ..core.layout import QuantModule, block_prefix, common, examples, int_scheme, natural_key  # noqa: F401
from ..storage.safetensors_header import DTYPES, TensorInfo

STATE_LEAVES = ("qzeros", "scales", "g_idx")
_WORD_DTYPES = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}
_SCALE_DTYPES = {"F16", "BF16", "F32"}


def qweight_modules(tensors: Mapping[str, TensorInfo]):
    """(module, qweight, qzeros, scales) of every module with a ``.qweight`` (GPTQ and AWQ name their
    tensors alike; absent ones are None)."""
    for name, qweight in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            yield prefix, qweight, tensors.get(prefix + ".qzeros"), tensors.get(prefix + ".scales")


def find_modules(tensors: Mapping[str, TensorInfo], fallback_bits=None) -> list[QuantModule]:
    """``fallback_bits(module)`` gives the configured width for a module without qzeros."""
    modules = []
    for prefix, qweight, qzeros, scales in qweight_modules(tensors):
        g_idx = tensors.get(prefix + ".g_idx")
        problems = []
        if qweight.dtype not in _WORD_DTYPES or len(qweight.shape) != 2:
            problems.append(f"qweight is {qweight.dtype} {list(qweight.shape)}, expected an integer "
                            f"matrix [in*bits/32, out]")
        word = DTYPES[qweight.dtype][0]
        if scales is None:
            problems.append("quantized module has no scales tensor")
        elif len(scales.shape) != 2:
            problems.append(f"scales has shape {list(scales.shape)}, expected [groups, out]")
        out = (scales.shape[1] if scales is not None and len(scales.shape) == 2
               else (qweight.shape[1] if len(qweight.shape) == 2 else 0))
        groups = scales.shape[0] if scales is not None and len(scales.shape) == 2 else None
        bits = None
        if qzeros is None:
            problems.append("quantized module has no qzeros tensor")
        elif len(qzeros.shape) == 2 and out and (qzeros.shape[1] * word) % out == 0:
            bits = qzeros.shape[1] * word // out
            if groups is not None and qzeros.shape[0] != groups:
                problems.append(f"qzeros has {qzeros.shape[0]} groups but scales has {groups}")
        elif len(qzeros.shape) == 2 and not out and qzeros.shape[1] == 0 and scales is not None:
            # zero output channels: the shapes tell no bit width (the config does, below)
            if groups is not None and qzeros.shape[0] != groups:
                problems.append(f"qzeros has {qzeros.shape[0]} groups but scales has {groups}")
        else:
            problems.append(f"qzeros shape {list(qzeros.shape)} does not fit {out} output channels")
        if bits is None and fallback_bits is not None:
            bits = fallback_bits(prefix)
        if not bits:
            problems.append("cannot tell the bit width from the shapes or the config")
            bits = 0
        elif not 2 <= bits <= 8:         # codes are decoded into uint8: a wider one would be truncated
            problems.append(f"shapes imply {bits}-bit codes; GPTQ and auto-round pack 2- to 8-bit codes")
        inp = 0
        if bits and len(qweight.shape) == 2:
            if (qweight.shape[0] * word) % bits:
                problems.append(f"qweight has {qweight.shape[0]} rows of {word}-bit words, not a whole "
                                f"number of {bits}-bit codes")
            inp = qweight.shape[0] * word // bits
            if out and qweight.shape[1] != out:
                problems.append(f"qweight has {qweight.shape[1]} columns but scales has {out} outputs")
        if g_idx is not None and inp and g_idx.shape != (inp,):
            problems.append(f"g_idx has shape {list(g_idx.shape)}, expected [{inp}]")
        for leaf, info, allowed in (("scales", scales, _SCALE_DTYPES), ("qzeros", qzeros, _WORD_DTYPES),
                                    ("g_idx", g_idx, _WORD_DTYPES)):
            if info is not None and info.dtype not in allowed:
                problems.append(f"{leaf} is {info.dtype}, expected {' or '.join(sorted(allowed))}")
        group_size = None
        if groups:
            group_size = -1 if groups == 1 else (inp // groups if inp % groups == 0 else None)
        state = tuple(prefix + "." + leaf for leaf in STATE_LEAVES if prefix + "." + leaf in tensors)
        details = {"groups": groups, "has_g_idx": g_idx is not None,
                   "scales_dtype": scales.dtype if scales is not None else None}
        modules.append(QuantModule(prefix, "gptq", int_scheme(bits), bits, out, inp, (qweight.name,), state,
                                   group_size=group_size, details=details, problems=tuple(problems)))
    return modules


# ---------------------------------------------------------------------------------------------
# Config

def normalise_packing_format(qc: Mapping) -> str | None:
    """auto-round packing format, with the aliases current loaders accept (docs/formats.md, auto-round)."""
    fmt = qc.get("packing_format")
    if fmt is None and qc.get("quant_method") == "intel/auto-round":
        backend = str(qc.get("backend", ""))
        fmt = ("auto_round:auto_gptq" if "gptq" in backend else
               "auto_round:auto_awq" if "awq" in backend else "auto_round")
    aliases = {None: "auto_round:auto_gptq", "auto": "auto_round:auto_gptq",
               "auto_round:gptq": "auto_round:auto_gptq", "auto_round:awq": "auto_round:auto_awq"}
    return aliases.get(fmt, fmt)


AUTO_ROUND_GPTQ, AUTO_ROUND_PLAIN = "auto_round:auto_gptq", "auto_round"      # the GPTQ layouts auto-round writes
AUTO_ROUND_AWQ = "auto_round:auto_awq"          # ... and its AWQ GEMM packing (awq/ reads and writes it)


def is_auto_round(qc: Mapping) -> bool:
    return qc.get("quant_method") in ("auto-round", "intel/auto-round")


def auto_round_awq_packed(qc: Mapping | None) -> bool:
    """An auto-round config whose packing is AWQ's (auto_round:auto_awq): the awq family's, not this one's."""
    return bool(qc) and is_auto_round(qc) and normalise_packing_format(qc) == AUTO_ROUND_AWQ
AUTO_ROUND_READABLE = (AUTO_ROUND_GPTQ, "auto_round:gptqmodel", AUTO_ROUND_PLAIN)
GPTQ_FORMATS = ("gptq", "gptq_v2")


def parse_config(qc: Mapping) -> dict:
    method = qc.get("quant_method")
    auto_round = method in ("auto-round", "intel/auto-round")
    out = {"bits": qc.get("bits", qc.get("w_bit")),
           "group_size": qc.get("group_size", qc.get("q_group_size")),
           "sym": qc.get("sym", True),
           "desc_act": bool(qc.get("desc_act", False))}
    if auto_round:
        fmt = normalise_packing_format(qc)
        out["packing_format"] = fmt
        out["zero_point"] = "stored z-1 (v1)" if fmt == "auto_round:auto_gptq" else "stored z (v2)"
        out["data_type"] = qc.get("data_type", "int")
    else:
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if qc.get("is_marlin_format"):
            fmt = "marlin"
        out["checkpoint_format"] = fmt
        out["zero_point"] = "stored z (v2)" if fmt == "gptq_v2" else "stored z-1 (v1)"
    return out


def _is_plain_name(key: str) -> bool:
    return re.fullmatch(r"[\w.]+", key) is not None


def per_module_settings(qc: Mapping, module: str) -> dict | None:
    """The bits/group_size/sym the config asks for at ``module``; None if it says not quantized.

    auto-round ``extra_config`` (exact names first, then patterns applied with re.search) and
    GPTQModel ``dynamic`` (``+:``/no prefix: overrides, ``-:``: not quantized, applied with re.match).
    """
    settings = {"bits": qc.get("bits", qc.get("w_bit")),
                "group_size": qc.get("group_size", qc.get("q_group_size")),
                "sym": qc.get("sym", True)}
    extra = qc.get("extra_config") or {}
    if isinstance(extra, dict):
        override = extra.get(module)
        if override is None:
            for key, value in extra.items():
                if key != module and not _is_plain_name(key) and _safe_search(key, module):
                    override = value
                    break
        if isinstance(override, dict):
            settings.update({k: v for k, v in override.items() if k in settings})
    dynamic = qc.get("dynamic") or {}
    if isinstance(dynamic, dict):
        for key, value in dynamic.items():
            negative = key.startswith("-:")
            pattern = key[2:] if key[:2] in ("+:", "-:") else key
            if _safe_match(pattern, module):
                if negative:
                    return None
                if isinstance(value, dict):
                    settings.update({k: v for k, v in value.items() if k in settings})
                break
    bits = settings["bits"]
    if isinstance(bits, (int, float)) and bits >= 16:
        return None
    return settings


def _safe_search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def _safe_match(pattern: str, name: str) -> bool:
    try:
        return re.match(pattern, name) is not None
    except re.error:
        return False


def _pattern_problem(field: str, key: str, pattern: str, names, anchored: bool) -> str | None:
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        return f"{field} key {key!r} is not a valid regex ({exc})"
    find = rx.match if anchored else rx.search
    if not any(find(n) for n in names):
        return f"{field} pattern {key!r} matches no module of this checkpoint"
    return None


def unmatched_extra_config(qc: Mapping, module_names) -> list[str]:
    """extra_config / dynamic keys that name no module of the checkpoint."""
    names = list(module_names)
    bad = []
    extra = qc.get("extra_config") or {}
    for key in (extra if isinstance(extra, dict) else {}):
        if _is_plain_name(key):
            if key not in names:
                bad.append(f"extra_config names {key!r}, which is not a module of this checkpoint")
        else:
            bad.append(_pattern_problem("extra_config", key, key, names, anchored=False))
    dynamic = qc.get("dynamic") or {}
    for key in (dynamic if isinstance(dynamic, dict) else {}):
        pattern = key[2:] if key[:2] in ("+:", "-:") else key
        bad.append(_pattern_problem("dynamic", key, pattern, names, anchored=True))
    return [b for b in bad if b]


def find_in_checkpoint(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """find_modules with the config's bit width as the fallback for modules without qzeros; a module is
    act-order (details["act_order"]) where it stores g_idx and the config says desc_act."""
    fallback = (lambda name: (per_module_settings(qc, name) or {}).get("bits")) if qc else None
    desc_act = bool(parse_config(qc).get("desc_act")) if qc else False
    return [replace(m, details={**m.details, "act_order": desc_act and bool(m.details.get("has_g_idx"))})
            for m in find_modules(tensors, fallback)]


def settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of a GPTQ-packed checkpoint (GPTQ, auto-round): the config's, else what the
    shapes say; act-order modules and the scales' dtype."""
    out = parse_config(qc) if qc else {}
    if not out:
        group_sizes = {m.group_size for m in modules}
        out = {"bits": common(m.bits for m in modules),
               "group_size": group_sizes.pop() if len(group_sizes) == 1 else None}
    out["act_order_modules"] = sum(1 for m in modules if m.details.get("has_g_idx")) if out.get("desc_act") else 0
    out["scales_dtype"] = common(DTYPES[m.details["scales_dtype"]][1] for m in modules
                                 if m.details.get("scales_dtype"))
    return out


def lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str], comp, warnings: list[str]) -> None:
    """What a GPTQ / auto-round quantization_config gets wrong against its packed modules."""
    packed = [m for m in modules if m.family == "gptq"]
    if packed:
        _lint(qc, packed, all_modules, settings(qc, packed), warnings)


def _lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str],
          settings: Mapping, warnings: list[str]) -> None:
    by_kind: dict[str, list[str]] = defaultdict(list)
    for m in modules:
        want = per_module_settings(qc, m.name)
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
                        f"({examples(names)})")
    warnings.extend(unmatched_extra_config(qc, sorted(all_modules)))
    if settings.get("desc_act"):
        missing = [m.name for m in modules if not m.details.get("has_g_idx")]
        if missing:
            warnings.append(f"desc_act is true but {len(missing)} modules have no g_idx "
                            f"({examples(missing)})")
    fmt = settings.get("checkpoint_format")
    if fmt is not None and fmt not in GPTQ_FORMATS:
        warnings.append(f"checkpoint_format {fmt!r} is a kernel-specific repack; qconv reads gptq and "
                        f"gptq_v2")
    pf = settings.get("packing_format")
    if pf is not None and pf not in AUTO_ROUND_READABLE:
        warnings.append(f"packing_format {pf!r} is not a GPTQ layout; qconv reads "
                        f"{', '.join(AUTO_ROUND_READABLE)}")
    if settings.get("sym") is False and settings.get("zero_point") == "stored z-1 (v1)":
        warnings.append("asymmetric with v1 zero points (stored z-1): a zero point of 0 cannot be "
                        "stored exactly, and vLLM >= 0.33 runs no asymmetric GPTQ")


# ---------------------------------------------------------------------------------------------
# Writing (the GPTQ, GPTQ v2 and auto-round targets; encoding is gptq.codec.encode_for)

def _words(n_codes: int, bits: int, what: str) -> int:
    """32-bit words for n_codes along a packed axis (ValueError where the layout cannot hold them)."""
    if 32 % bits == 0:
        if n_codes % (32 // bits):
            raise NotStorable(f"{n_codes} {what} of {bits} bits do not fill whole 32-bit words")
        return n_codes * bits // 32
    if n_codes % 32:
        raise NotStorable(f"{bits}-bit packing needs a multiple of 32 {what}, got {n_codes}")
    return n_codes // 32 * bits


def leaves(spec, shape: tuple[int, int], g_idx: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """leaf -> (dtype, shape) of what gptq.codec.encode stores: qweight packed along in, qzeros along out."""
    out, inp = shape
    groups = 1 if spec.group_size <= 0 else -(-inp // spec.group_size)
    res = {"qweight": ("I32", (_words(inp, spec.bits, "input features"), out)),
           "qzeros": ("I32", (groups, _words(out, spec.bits, "output features"))),
           "scales": (spec.scale_dtype, (groups, out))}
    if g_idx:
        res["g_idx"] = ("I32", (inp,))
    return res


def config_writer(target: str, packing_format: str | None = None):
    """The quantization_config writer of a GPTQ-family target: GPTQModel's dialect (checkpoint_format,
    dynamic overrides) for gptq / gptq-v2, auto-round's (packing_format, extra_config) when a
    packing_format is given: auto_round:auto_gptq (the auto-round target), and auto_round:auto_awq and
    plain auto_round (the packings auto-round writes for asymmetric modules, gptq/__init__.py: auto_round_packing).
    The most common (bits, group, sym) is the default, taken among the asymmetric modules in an
    auto-round file that has any (auto-round writes its asymmetric packings for an asymmetric scheme,
    sym: false on top); other modules and the unquantized Linears of the decoder stacks are listed by
    exact name."""
    def config(ctx) -> dict:
        specs = ctx.specs
        quantized = sorted(specs, key=natural_key)
        pool = [s for s in specs.values() if not s.symmetric] if packing_format else []
        common_spec = Counter((s.bits, s.group_size, s.symmetric)
                              for s in (pool or specs.values())).most_common(1)[0][0]
        bits, group, sym = common_spec
        blocks = sorted({b for n in quantized if (b := block_prefix(n))}, key=natural_key)
        in_block = lambda n: any(n.startswith(b + ".") for b in blocks)  # noqa: E731
        overrides = {n: {k: v for k, v in (("bits", s.bits), ("group_size", s.group_size), ("sym", s.symmetric))
                         if (k, v) not in (("bits", bits), ("group_size", group), ("sym", sym)) or not in_block(n)}
                     for n, s in specs.items()}
        overrides = {n: o for n, o in overrides.items() if o}
        skipped = [n for n in ctx.unquantized if in_block(n)]
        cfg = {"bits": bits, "group_size": group, "sym": sym, "desc_act": ctx.act_order}
        if packing_format:
            extra = {n: {**{"bits": bits, "group_size": group, "sym": sym, "data_type": "int"}, **o}
                     if not in_block(n) else o for n, o in overrides.items()}
            extra.update({n: {"bits": 16} for n in skipped})
            cfg.update({"quant_method": "auto-round", "packing_format": packing_format,
                        "data_type": "int", "block_name_to_quantize": ",".join(blocks)})
            if extra:
                cfg["extra_config"] = dict(sorted(extra.items(), key=lambda kv: natural_key(kv[0])))
            return cfg
        dynamic = {f"+:^{re.escape(n)}$": o for n, o in overrides.items()}
        dynamic.update({f"-:^{re.escape(n)}$": {} for n in skipped})
        cfg.update({"quant_method": "gptq", "checkpoint_format": "gptq_v2" if target == "gptq-v2" else "gptq",
                    "block_name_to_quantize": ",".join(blocks)})
        if dynamic:
            cfg["dynamic"] = dict(sorted(dynamic.items(), key=lambda kv: natural_key(kv[0])))
        return cfg
    return config
