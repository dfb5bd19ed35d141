"""AWQ GEMM checkpoints (AutoAWQ ``WQLinear_GEMM``, GPTQModel's AWQ, auto-round's ``auto_awq`` export),
described from headers and config. Stdlib only, so `inspect` stays light; the data is awq/codec.py.

Per quantized Linear ``P`` (docs/formats.md, AWQ GEMM)::

    P.qweight  int32      [in, out/8]    4-bit codes packed along OUT, nibble i of word c holding
                                         output column 8c + AWQ_ORDER[i], AWQ_ORDER = [0,2,4,6,1,3,5,7]
    P.qzeros   int32      [in/gs, out/8] the zero points, same packing and interleave, stored as is
    P.scales   fp16/bf16  [in/gs, out]   AutoAWQ writes fp16, GPTQModel 7.x bf16

    w[i, o] = (q[i, o] - z[g, o]) * s[g, o],   g = i // gs

4-bit only, no g_idx, no act-order. ``out`` comes from scales, ``in`` from qweight's rows, the code width
from qweight's width against out (a 5-7-bit auto-round stream shows up as such and is refused).

Config spellings accepted (parse_config):

* config.json ``quantization_config`` (AutoAWQ ``to_transformers_dict``, transformers ``AwqConfig``,
  GPTQModel): ``quant_method: "awq"``, ``bits``, ``group_size``, ``zero_point``, ``version`` and/or
  ``format`` (GPTQModel also ``checkpoint_format``), ``modules_to_not_convert``;
* AutoAWQ ``quant_config.json`` (``AwqConfig.to_dict``, no quant_method): ``w_bit``, ``q_group_size``,
  ``zero_point``, ``version`` (possibly upper case: AutoAWQ lowercases it on load);
* auto-round ``quant_method: "auto-round"`` with ``packing_format: "auto_round:auto_awq"`` (aliases
  ``auto_round:awq`` and, before 0.5, ``intel/auto-round`` + an awq ``backend``). auto-round
  (``export_to_autoround/export.py``, ``save_quantized_as_autoround``) writes ``bits``, ``group_size``,
  ``sym``, ``data_type``, ``block_name_to_quantize`` and ``extra_config`` there, but no ``zero_point``, no
  ``version`` and no ``modules_to_not_convert``: the layout is GEMM (``export_to_awq/utils.py``
  ``WQLinear_GEMM``), zero_point is ``not sym``, and unquantized layers are ``extra_config`` entries with
  ``bits >= 16``. (auto-round's ``format="auto_awq"`` export instead writes ``quant_method: "awq"``,
  ``zero_point = not sym``, ``version: "gemm"``, ``modules_to_not_convert`` and ``provider: "auto-round"``.)

Zero points when ``zero_point`` is false: every producer still stores qzeros (GPTQModel fills them with
2^(bits-1) = 8, auto-round tiles its scalar symmetric zero point 8; AutoAWQ cannot pack GEMM without
zeros at all), and every loader subtracts the *stored* qzeros whatever zero_point says (AutoAWQ
``dequantize_gemm``, GPTQModel's AWQ kernels, vLLM ``AWQLinearMethod``). So qzeros are required and
decoded as stored, for symmetric files too (awq.codec.read).
"""

from __future__ import annotations

from typing import Mapping

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from ..core.layout import QuantModule, common, int_scheme, natural_key, not_converted_by, not_converted_list
from ..gptq import header as gptq
from ..gptq.header import AUTO_ROUND_AWQ, is_auto_round
from ..storage.safetensors_header import DTYPES, TensorInfo

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
BITS = 4
PACK = 32 // BITS                     # codes per int32 word
STATE_LEAVES = ("qzeros", "scales")
SCALE_DTYPES = ("F16", "BF16")
EXTENDED_BITS = (5, 6, 7)             # auto-round 0.16's AWQ bit stream (export_to_awq/utils.py)
LAYOUT = "gemm"
# Other AWQ layouts under the same tensor names (or a config naming them): not GEMM's.
OTHER_LAYOUTS = {
    "gemv": "AutoAWQ GEMV: qweight [out, in/8] packed along in, zeros and scales padded per out row",
    "gemv_fast": "AutoAWQ GEMV_FAST: interleaved [out/4, in*4/8] tiles for its fused kernel",
    "marlin": "AutoAWQ Marlin: qweight re-tiled for the Marlin kernel, no qzeros",
    "exllama": "exllama: GPTQ-style packing along in with z - 1",
    "ipex": "IPEX: repacked for intel-extension-for-pytorch",
    "llm-awq": "llm-awq (MIT): its own interleaved layout",
}


# ---------------------------------------------------------------------------------------------
# Config

def _lower(value):
    return value.lower() if isinstance(value, str) else value


def parse_config(qc: Mapping | None) -> dict:
    """The AWQ settings a config asks for, in one spelling::

        {"method": "awq" | "auto-round", "bits", "group_size", "zero_point": bool, "version": layout,
         "packing_format": auto-round's (else None), "modules_to_not_convert": [str],
         "lm_head": bool | None, "unsupported": [str], "problems": [str]}

    ``unsupported`` names layouts or settings qconv does not decode (a version other than gemm, bits
    other than 4, a non-AWQ auto-round packing format, non-integer data); ``problems`` are
    contradictions inside the config. Both are strings for messages; find_modules attaches them to
    every module.
    """
    qc = qc or {}
    unsupported: list[str] = []
    problems: list[str] = []
    auto_round = is_auto_round(qc)
    out = {"method": "auto-round" if auto_round else "awq",
           "bits": qc.get("bits", qc.get("w_bit")),
           "group_size": qc.get("group_size", qc.get("q_group_size")),
           "packing_format": None, "lm_head": qc.get("lm_head")}
    for a, b in (("bits", "w_bit"), ("group_size", "q_group_size")):
        if a in qc and b in qc and qc[a] != qc[b]:
            problems.append(f"config says {a}={qc[a]!r} but {b}={qc[b]!r}")

    sym = qc.get("sym")
    if auto_round:
        fmt = gptq.normalise_packing_format(qc)
        out["packing_format"] = fmt
        if fmt != AUTO_ROUND_AWQ:
            unsupported.append(f"auto-round packing_format {fmt!r} is not AWQ's ({AUTO_ROUND_AWQ!r})")
        if qc.get("data_type", "int") != "int":
            unsupported.append(f"data_type {qc.get('data_type')!r}: qconv decodes integer codes only")
        zero_point = qc.get("zero_point", None if sym is None else not sym)
        if zero_point is None:
            zero_point = False               # auto-round's default is sym=True
        layout = LAYOUT
    else:
        zero_point = qc.get("zero_point", True)       # AutoAWQ / transformers default
        names = {k: _lower(qc[k]) for k in ("version", "format", "checkpoint_format") if qc.get(k) is not None}
        if len(set(names.values())) > 1:
            problems.append("config.json names different AWQ layouts: " +
                            ", ".join(f"{k}={v!r}" for k, v in names.items()))
        # transformers' AwqConfig: version (legacy) wins over format; AutoAWQ reads version only.
        layout = names.get("version", names.get("format", names.get("checkpoint_format", LAYOUT)))
        if layout != LAYOUT:
            what = OTHER_LAYOUTS.get(layout, "not a layout qconv knows")
            unsupported.append(f"config.json's AWQ version/format {layout!r} ({what}); qconv decodes only "
                               f"the {LAYOUT!r} layout")
    if not isinstance(zero_point, bool):
        problems.append(f"zero_point is {zero_point!r}, expected true or false")
        zero_point = bool(zero_point)
    if sym is not None and isinstance(sym, bool) and "zero_point" in qc and sym == zero_point:
        problems.append(f"config says sym={sym} but zero_point={zero_point}")
    out["zero_point"] = zero_point
    out["version"] = layout

    bits = out["bits"]
    if bits is not None and bits != BITS:
        unsupported.append(f"config asks for {bits}-bit codes; AWQ GEMM packs 4-bit codes only")
    out["modules_to_not_convert"] = not_converted_list(qc.get("modules_to_not_convert"), problems)
    out["unsupported"] = unsupported
    out["problems"] = problems
    return out


def _module_settings(qc: Mapping, settings: dict, prefix: str) -> tuple[dict | None, str | None]:
    """(bits/group_size for this module or None if the config says it is not quantized, the reason)."""
    if settings["method"] == "auto-round":
        per = gptq.per_module_settings(qc, prefix)
        if per is None:
            return None, "the config's extra_config leaves it unquantized (bits >= 16)"
        return per, None
    key = not_converted_by(prefix, settings["modules_to_not_convert"])
    if key is not None:
        return None, f"modules_to_not_convert lists {key!r}"
    lm = settings.get("lm_head")
    if lm is False and (prefix == "lm_head" or prefix.endswith(".lm_head")):
        return None, "the config says lm_head false"
    return {"bits": settings["bits"], "group_size": settings["group_size"]}, None


# ---------------------------------------------------------------------------------------------
# Layout from headers

def find_modules(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """One QuantModule per ``*.qweight``, from headers and the config alone. ``problems`` lists, config
    problems first, everything that stops an exact decode; ``details["unsupported"]`` holds the subset
    that is a layout or width qconv does not decode (check raises UnsupportedFormat for those,
    CorruptCheckpoint for the rest)."""
    settings = parse_config(qc)
    config_unsupported = list(settings["unsupported"])
    config_problems = list(settings["problems"])
    modules = []
    for prefix, qweight, qzeros, scales in gptq.qweight_modules(tensors):
        unsupported = list(config_unsupported)
        problems: list[str] = []
        per = _config_checks(tensors, qc, settings, prefix, unsupported, problems)
        _tensor_checks(qweight, qzeros, scales, unsupported, problems)
        inp, out, groups, bits = _dimensions(qweight, qzeros, scales, unsupported, problems)
        group_size = _group_size(inp, groups, per, settings, problems)
        all_problems = tuple(unsupported + config_problems + problems)
        state = tuple(prefix + "." + leaf for leaf in STATE_LEAVES if prefix + "." + leaf in tensors)
        details = {"version": settings["version"], "format": settings["version"],
                   "zero_point": settings["zero_point"], "groups": groups,
                   "scales_dtype": scales.dtype if scales is not None else None,
                   "unsupported": tuple(unsupported)}
        if settings["packing_format"]:
            details["packing_format"] = settings["packing_format"]
        modules.append(QuantModule(prefix, "awq", int_scheme(bits), bits, out, inp, (qweight.name,), state,
                                   group_size=group_size, details=details, problems=all_problems))
    return modules


def _config_checks(tensors: Mapping[str, TensorInfo], qc: Mapping | None, settings: dict, prefix: str,
                   unsupported: list[str], problems: list[str]) -> dict | None:
    """What the config says of this module (returned), and where that contradicts its packed tensors."""
    per, skipped = _module_settings(qc or {}, settings, prefix)
    if skipped:
        problems.append(f"{skipped}, but the module is stored packed: loaders build it as a plain "
                        f"Linear and find no weight for it")
    if per and per.get("bits") is not None and per["bits"] != BITS and per["bits"] != settings["bits"]:
        unsupported.append(f"the config asks for {per['bits']}-bit codes here; AWQ GEMM packs 4-bit "
                           f"codes only")
    if prefix + ".g_idx" in tensors:
        problems.append("has a g_idx tensor, which AWQ GEMM never writes (a GPTQ module?)")
    return per


def _tensor_checks(qweight: TensorInfo, qzeros: TensorInfo | None, scales: TensorInfo | None,
                   unsupported: list[str], problems: list[str]) -> None:
    """Each tensor's presence, rank and dtype on its own."""
    if qweight.dtype != "I32":
        unsupported.append(f"qweight is {qweight.dtype}; AWQ GEMM packs codes in int32 words")
    if len(qweight.shape) != 2:
        problems.append(f"qweight has shape {list(qweight.shape)}, expected [in, out/8]")
    if scales is None:
        problems.append("quantized module has no scales tensor")
    elif len(scales.shape) != 2:
        problems.append(f"scales has shape {list(scales.shape)}, expected [in/group_size, out]")
    elif scales.dtype not in SCALE_DTYPES:
        unsupported.append(f"scales is {scales.dtype}; AWQ GEMM stores {' or '.join(SCALE_DTYPES)} "
                           f"scales (loaders cast others, so their weights are not the stored ones)")
    if qzeros is None:
        problems.append("quantized module has no qzeros tensor (AWQ loaders read qzeros even with "
                        "zero_point false)")
    elif qzeros.dtype != "I32":
        unsupported.append(f"qzeros is {qzeros.dtype}; AWQ GEMM packs zero points in int32 words")


def _dimensions(qweight: TensorInfo, qzeros: TensorInfo | None, scales: TensorInfo | None,
                unsupported: list[str], problems: list[str]) -> tuple[int, int, int | None, int]:
    """(in, out, groups, code width) from the shapes, and where the shapes disagree with each other."""
    two_d = len(qweight.shape) == 2
    inp = qweight.shape[0] if two_d else 0
    out = (scales.shape[1] if scales is not None and len(scales.shape) == 2
           else (qweight.shape[1] * PACK if two_d else 0))
    groups = scales.shape[0] if scales is not None and len(scales.shape) == 2 else None
    bits = BITS
    if two_d and out:
        width = qweight.shape[1]
        implied = width * 32 // out if (width * 32) % out == 0 else None
        if implied in EXTENDED_BITS:
            bits = implied
            unsupported.append(f"qweight is {width} words wide for {out} outputs: {implied}-bit codes "
                               f"(auto-round's extended AWQ bit stream); qconv decodes 4-bit AWQ GEMM only")
        elif implied != BITS:
            problems.append(f"qweight has shape {list(qweight.shape)}, which does not fit scales' {out} "
                            f"outputs (4-bit AWQ GEMM needs {out / PACK:g} words per row)")
    if out % PACK:
        problems.append(f"{out} output channels are not a multiple of {PACK}, which AWQ GEMM packing needs")
    if qzeros is not None and len(qzeros.shape) == 2 and groups is not None and out:
        if qzeros.shape[0] != groups or qzeros.shape[1] * PACK != out:
            problems.append(f"qzeros has shape {list(qzeros.shape)}, expected [{groups}, {out // PACK}] "
                            f"to fit scales {list(scales.shape)}")
    elif qzeros is not None and len(qzeros.shape) != 2:
        problems.append(f"qzeros has shape {list(qzeros.shape)}, expected [in/group_size, out/8]")
    return inp, out, groups, bits


def _group_size(inp: int, groups: int | None, per: dict | None, settings: dict,
                problems: list[str]) -> int | None:
    """The group size: the config's where it fits the shapes, else the one the shapes imply (a problem)."""
    if (groups == 0 and inp) or (groups and inp and inp % groups):
        problems.append(f"{inp} input channels cannot be split into the {groups} groups scales has")
        return None
    if not groups:
        return None
    shape_gs = -1 if groups == 1 else inp // groups
    cfg_gs = (per or {}).get("group_size", settings["group_size"])
    if isinstance(cfg_gs, int) and not isinstance(cfg_gs, bool) and cfg_gs > 0:
        if inp % cfg_gs == 0 and inp // cfg_gs == groups:
            return cfg_gs
        problems.append(f"the config's group_size {cfg_gs} gives {inp / cfg_gs:g} groups for "
                        f"{inp} inputs, but scales has {groups}")
    elif cfg_gs == -1 and groups != 1:
        problems.append(f"the config's group_size -1 means one group, but scales has {groups}")
    elif cfg_gs is not None and cfg_gs != -1:      # 0, a negative number, a string: not a size
        problems.append(f"the config's group_size {cfg_gs!r} is not a group size (a positive number, "
                        f"or -1 for one group)")
    return shape_gs


def check(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> None:
    """Refuse, from headers and config, a module awq.codec.read could not decode exactly: the first of
    its problems, as UnsupportedFormat (a layout or width qconv does not decode) or CorruptCheckpoint
    (shapes or config that contradict each other), naming the file and the module's qweight."""
    qweight = tensors.get(m.name + ".qweight")
    file = qweight.file if qweight is not None else m.file(tensors)
    tensor = qweight.name if qweight is not None else m.name
    if not m.problems:
        return
    first = m.problems[0]
    cls = UnsupportedFormat if first in m.details.get("unsupported", ()) else CorruptCheckpoint
    raise cls(first + "; cannot decode it", file=file, tensor=tensor)


# ---------------------------------------------------------------------------------------------
# Writing

def config_for(spec, modules_to_not_convert=None, group_size=None, zero_point=None, scale_dtype=None,
               *, lm_head: bool = False) -> dict:
    """The ``quantization_config`` an AWQ GEMM writer emits, as transformers' AwqConfig (which reads
    ``version`` as the legacy alias of ``format`` and writes both) and vLLM's awq / awq_marlin loaders
    (bits or w_bit, group_size or q_group_size, zero_point, modules_to_not_convert, lm_head) read it.

    ``group_size`` defaults to spec.group_size, ``zero_point`` to ``not spec.symmetric``; scales are
    F16 or BF16 (checked here, not written: AWQ configs carry no scale dtype). ``lm_head`` is written
    only when true (vLLM's awq_marlin then quantizes ParallelLMHead)."""
    if getattr(spec, "scheme", None) != "int" or spec.bits != BITS:
        raise NotStorable(f"AWQ GEMM stores 4-bit integer codes, not {getattr(spec, 'name', spec)!r}")
    if getattr(spec, "scale_divisor", 1) != 1:
        raise NotStorable("AWQ GEMM stores plain scales (no scale divisor)")
    if group_size is None:
        group_size = spec.group_size
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size > 0):
        raise NotStorable(f"group_size {group_size!r} is not a positive integer or -1")
    if zero_point is None:
        zero_point = not spec.symmetric
    code = scale_dtype or spec.scale_dtype
    if code not in SCALE_DTYPES:
        raise NotStorable(f"AWQ GEMM stores F16 or BF16 scales, not {code!r}")
    cfg = {"quant_method": "awq", "bits": BITS, "group_size": group_size, "zero_point": bool(zero_point),
           "version": LAYOUT, "format": LAYOUT,
           "modules_to_not_convert": None if modules_to_not_convert is None else list(modules_to_not_convert)}
    if lm_head:
        cfg["lm_head"] = True
    return cfg


# ---------------------------------------------------------------------------------------------
# inspect

def settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of an AWQ GEMM checkpoint: the config's, else what the shapes say."""
    cfg = parse_config(qc) if qc else {}
    return {"bits": common(m.bits for m in modules),
            "group_size": common(m.group_size for m in modules),
            "zero_point": cfg.get("zero_point", common(m.details.get("zero_point") for m in modules)),
            "version": cfg.get("version"),
            "packing_format": cfg.get("packing_format"),
            "modules_to_not_convert": cfg.get("modules_to_not_convert"),
            "scales_dtype": common(DTYPES[m.details["scales_dtype"]][1] for m in modules
                                   if m.details.get("scales_dtype") in DTYPES)}


def lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str], comp, warnings: list[str]) -> None:
    """An AWQ config against its tensors: modules_to_not_convert entries that name nothing (vLLM matches
    them by substring, so a typo quantizes what was meant to stay float)."""
    cfg = parse_config(qc)
    for entry in cfg["modules_to_not_convert"]:
        if not any(entry in name for name in all_modules):
            warnings.append(f"modules_to_not_convert entry {entry!r} matches no module of this checkpoint")


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks (target awq)

def writer_leaves(spec, shape: tuple[int, int], g_idx: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What awq.codec.encode stores (stdlib, predicted before any data)."""
    out, inp = shape
    if spec.scheme != "int" or spec.bits != BITS or spec.group_size <= 0 or inp % spec.group_size:
        raise NotStorable(f"AWQ GEMM stores 4-bit codes in whole groups along in, not {spec.name} in groups "
                         f"of {spec.group_size} over {inp} inputs")
    if out % PACK:
        raise NotStorable(f"{out} output channels are not a multiple of {PACK} (AWQ packs along out)")
    groups = inp // spec.group_size
    return {"qweight": ("I32", (inp, out // PACK)), "qzeros": ("I32", (groups, out // PACK)),
            "scales": (spec.scale_dtype, (groups, out))}


def writer_config(ctx) -> dict:
    """One group size for the whole checkpoint (AWQ configs have no per-module overrides); zero_point
    true unless every module is symmetric (loaders subtract the stored zeros either way); the
    unquantized Linears in modules_to_not_convert (vLLM matches by substring, transformers by name)."""
    specs = list(ctx.specs.values())
    groups = sorted({s.group_size for s in specs})
    if len(groups) != 1:
        raise NotStorable(f"AWQ stores one group size per checkpoint; these modules have {groups}")
    not_converted = sorted((n for n in ctx.unquantized if "embed" not in n.rsplit(".", 1)[-1]), key=natural_key)
    return config_for(specs[0], modules_to_not_convert=not_converted, group_size=groups[0],
                      zero_point=not all(s.symmetric for s in specs))
