"""NVIDIA ModelOpt exports (``export_hf_checkpoint``: ``quant_method: "modelopt"`` in config.json's
quantization_config, and the same settings in ``hf_quant_config.json``), described from headers and
config. Stdlib only, so `inspect` stays light; the data is codec.py.

Per quantized Linear ``P`` (docs/formats.md, NVFP4)::

  quant_algo "FP8"
    P.weight           F8_E4M3   [out, in]
    P.weight_scale     F32       []            a multiplier, amax / 448, one per tensor
    P.input_scale      F32       []            static activations: carried, not decoded
    w = e4m3(q) * weight_scale                 (FP8QTensor.dequantize, float32)

  quant_algo "NVFP4" (group_size 16)
    P.weight           U8        [out, in/2]   e2m1 codes, element 2i in the LOW nibble
    P.weight_scale     F8_E4M3   [out, in/16]
    P.weight_scale_2   F32       []            a MULTIPLIER, amax / (6 * 448), one per tensor
    P.input_scale      F32       []
    w = e2m1(q) * (float32(weight_scale) * weight_scale_2)   (NVFP4QTensor.dequantize, float32)

ModelOpt gives q/k/v one shared ``weight_scale_2`` and gate/up another (a fused kernel needs one); FP8
keeps one ``weight_scale`` each. ``weight_scale_2`` is the inverse of compressed-tensors' NVFP4
``weight_global_scale`` (a divisor), which vLLM inverts on load. With ``kv_cache_quant_algo`` the
attention projections also carry ``k_scale`` / ``v_scale``: claimed with their module, not decoded.

The two configs spell things differently: config.json's quantization_config is flat (``quant_algo``,
``kv_cache_quant_algo``, ``ignore``, compressed-tensors-like ``config_groups`` holding the group size),
hf_quant_config.json nests them under ``quantization`` (``quant_algo``, ``group_size``,
``exclude_modules``). qconv reads config.json's where there is one, else hf_quant_config.json (as vLLM
does); the excluded entries are wildcards matched against the whole module name, or exact names
(vLLM's ``ModelOptQuantConfigBase.is_layer_excluded``).

Other quant_algos (INT4_AWQ, W4A8_AWQ, NVFP4_AWQ, MXFP8, FP8_PB_WO, MIXED_PRECISION, ...) are found
and refused (UnsupportedFormat naming the algo), never misread as one of the two above. transformers
has no loader for ``quant_method: modelopt``: it loads FP8 files as the raw e4m3 codes, silently wrong
(fixtures/checkpoints/README.md); a qconv-dequantized folder is how such a checkpoint runs there.

The target ``modelopt-nvfp4`` writes NVFP4 as above (nvfp4_leaves and nvfp4_config here, the data in
codec.py), from NVFP4 sources that carry a calibrated static activation scale only.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Mapping

from ...errors import NotStorable
from ..core.layout import NVFP4_GROUP, QuantModule, check_nvfp4_shape, common, natural_key, refuse_problems
from ..storage.safetensors_header import DTYPES, TensorInfo

METHOD = "modelopt"
SIDE_CONFIG = "hf_quant_config.json"
DECODED = {"FP8": ("e4m3", 8), "NVFP4": ("e2m1", 4)}      # quant_algo -> (scheme, bits)
# Other ModelOpt algos (modelopt/torch/export/model_config.py), by the codes they store: named in
# inspect's report under that scheme, refused by every writing verb.
REFUSED = {"FP8_PB_WO": ("e4m3", 8), "FP8_PB_REAL": ("e4m3", 8), "FP8_PC_PT": ("e4m3", 8),
           "FP8_PER_CHANNEL_PER_TOKEN": ("e4m3", 8), "MXFP8": ("e4m3", 8),
           "NVFP4_AWQ": ("e2m1", 4), "NVFP4_SVDQUANT": ("e2m1", 4), "W4A8_NVFP4_FP8": ("e2m1", 4),
           "MXFP4": ("e2m1", 4), "W4A8_MXFP4_FP8": ("e2m1", 4),
           "INT4_AWQ": ("int4", 4), "W4A8_AWQ": ("int4", 4), "INT8_SQ": ("int8", 8), "INT8_WO": ("int8", 8)}
WEIGHT_DTYPES = {"e4m3": "F8_E4M3", "e2m1": "U8"}           # what each decoded scheme stores
FP8_SCALE_DTYPES = ("F32", "BF16", "F16")
STATE_LEAVES = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale", "pre_quant_scale")


def is_side_config(doc: Mapping | None) -> bool:
    """A bare hf_quant_config.json (no quant_method; its settings under ``quantization``)."""
    return bool(doc) and isinstance(doc.get("quantization"), dict) and "quant_algo" in doc["quantization"]


def _group_size(qc: Mapping, flat: Mapping) -> tuple[object, str | None]:
    """The NVFP4 group size the config states (None: it states none) and where: ``group_size`` itself
    (hf_quant_config.json), else the one every config_groups' weights give (config.json)."""
    if "group_size" in flat:
        return flat["group_size"], "group_size"
    groups = qc.get("config_groups")
    sizes = []
    for g in (groups.values() if isinstance(groups, Mapping) else ()):
        weights = g.get("weights") if isinstance(g, Mapping) else None
        if isinstance(weights, Mapping) and "group_size" in weights and weights["group_size"] not in sizes:
            sizes.append(weights["group_size"])
    if not sizes:
        return None, None
    return (sizes[0] if len(sizes) == 1 else sizes), "config_groups' weights group_size"


def parse_config(qc: Mapping | None) -> dict:
    """{"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules": [str], "exclude_key",
    "unsupported": [str], "problems": [str]} of config.json's quantization_config or of a bare
    hf_quant_config.json."""
    qc = qc or {}
    flat = qc["quantization"] if is_side_config(qc) else qc
    exclude_key = "exclude_modules" if is_side_config(qc) else "ignore"
    unsupported, problems = [], []
    algo = flat.get("quant_algo")
    if algo is None:
        problems.append("the ModelOpt config has no quant_algo, so nothing says how the weights were quantized")
    elif algo not in DECODED:
        unsupported.append(f"quant_algo {algo!r} is not a ModelOpt format qconv decodes (it decodes "
                           f"{' and '.join(DECODED)})")
    group, where = _group_size(qc, flat)
    if algo == "NVFP4":
        if group is None:
            group = NVFP4_GROUP
        elif not (isinstance(group, int) and not isinstance(group, bool) and group > 0):
            problems.append(f"{where} is {group!r}, expected a positive integer")
            group = NVFP4_GROUP
    exclude = flat.get(exclude_key)
    if exclude is None:
        exclude = flat.get("exclude_modules" if exclude_key == "ignore" else "ignore", [])
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        problems.append(f"{exclude_key} is {exclude!r}, expected a list of module names")
        exclude = []
    return {"quant_algo": algo, "kv_cache_quant_algo": flat.get("kv_cache_quant_algo"),
            "group_size": group if algo == "NVFP4" else None, "exclude_modules": list(exclude),
            "exclude_key": exclude_key, "unsupported": unsupported, "problems": problems}


def excluded_by(name: str, patterns) -> str | None:
    """The exclude entry that keeps ``name`` unquantized in vLLM, if any: an exact name, or a wildcard
    pattern (``*``, ``?``) matching the whole name (fnmatch, as vLLM's ModelOpt config matches them)."""
    for p in patterns:
        if p == name or fnmatch.fnmatchcase(name, p):
            return p
    return None


def _scheme_of(algo, weight: TensorInfo) -> tuple[str, int]:
    """(scheme, bits) a module's codes are reported under: the config's algo where qconv knows it, else
    what the weight's dtype holds (e4m3; a byte of two 4-bit codes; anything else 8-bit)."""
    if algo in DECODED:
        return DECODED[algo]
    if algo in REFUSED:
        return REFUSED[algo]
    return ("e4m3", 8) if weight.dtype == "F8_E4M3" else (weight.dtype.lower(), DTYPES[weight.dtype][0])


def _check_scalar(tensors, name: str, what: str, dtypes, problems: list) -> TensorInfo | None:
    info = tensors.get(name)
    if info is None:
        problems.append(f"no {what} beside the weight")
    elif info.dtype not in dtypes:
        problems.append(f"{what} is {info.dtype}, expected {' or '.join(dtypes)}")
    elif math.prod(info.shape) != 1:
        problems.append(f"{what} has shape {list(info.shape)}; ModelOpt stores one per tensor (shape [])")
    return info


def find_modules(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """One QuantModule per ``*.weight`` that is stored quantized: an F8_E4M3 or U8 matrix, or any
    weight with a ``weight_scale`` beside it (so an algo qconv does not decode is found and refused,
    not copied). ``problems`` lists what stops an exact decode, ``details["unsupported"]`` the part
    qconv does not decode."""
    cfg = parse_config(qc)
    algo, group = cfg["quant_algo"], cfg["group_size"]
    declared = declared_activations(qc, algo)
    modules = []
    for name, info in tensors.items():
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        prefix = name[: -len(".weight")]
        if info.dtype not in ("F8_E4M3", "U8") and prefix + ".weight_scale" not in tensors:
            continue
        scheme, bits = _scheme_of(algo, info)
        out, width = info.shape
        packed = bits == 4 and info.dtype in ("U8", "I8")
        inp = width * 2 if packed else width
        unsupported, problems = list(cfg["unsupported"]), list(cfg["problems"])
        key = excluded_by(prefix, cfg["exclude_modules"])
        if key is not None:
            problems.append(f"{cfg['exclude_key']} lists {key!r}, but the module is stored quantized: loaders "
                            f"build it as a plain Linear and read the codes as weights")
        if algo in DECODED and info.dtype != WEIGHT_DTYPES[scheme]:
            problems.append(f"the weight is {info.dtype}, but quant_algo {algo} stores {WEIGHT_DTYPES[scheme]} "
                            f"weights")
        if prefix + ".pre_quant_scale" in tensors and not unsupported:
            unsupported.append("pre_quant_scale (AWQ's per-input scaling of activations) is not decoded")
        scale = tensors.get(prefix + ".weight_scale")
        if algo == "FP8":
            _check_scalar(tensors, prefix + ".weight_scale", "weight_scale", FP8_SCALE_DTYPES, problems)
        elif algo == "NVFP4":
            if scale is None:
                problems.append("no weight_scale beside the weight")
            elif scale.dtype != "F8_E4M3":
                problems.append(f"weight_scale is {scale.dtype}; NVFP4 stores F8_E4M3 group scales")
            else:
                want = [out, -(-inp // group)]
                if list(scale.shape) != want:
                    problems.append(f"weight_scale has shape {list(scale.shape)}; a {out} x {inp} NVFP4 weight "
                                    f"({width} bytes a row) in groups of {group} needs {want}")
            _check_scalar(tensors, prefix + ".weight_scale_2", "weight_scale_2", ("F32",), problems)
        state = tuple(f"{prefix}.{leaf}" for leaf in STATE_LEAVES if f"{prefix}.{leaf}" in tensors)
        details = {"quant_algo": algo, "block_rows": 0 if scheme == "e4m3" else 1,
                   "scales_dtype": scale.dtype if scale is not None else None,
                   "static_activations": prefix + ".input_scale" in tensors,
                   "unsupported": tuple(unsupported)}
        if scheme == "e2m1":
            details["global_scale"] = "multiplier"
        if details["static_activations"]:       # core/activation.py: amax / 448 (FP8), amax / (448 * 6) (NVFP4)
            details["activation"] = {"scheme": "fp8" if algo == "FP8" else "nvfp4",
                                     "tensor": prefix + ".input_scale", "kind": "multiplier"}
        if declared is not None:
            details["activations"] = ({"static": True, "tensor": prefix + ".input_scale", "by": declared[1],
                                       "one": True} if declared[0] else
                                      {"static": False, "activations": declared[2], "by": declared[1]})
        modules.append(QuantModule(prefix, "modelopt", scheme, bits, out, inp, (name,), state,
                                   group_size=group if scheme == "e2m1" and group else -1, details=details,
                                   problems=tuple(unsupported + problems)))
    return modules


def declared_activations(qc: Mapping | None, algo) -> tuple[bool, str, str] | None:
    """(static, where it is said, what they are) of every module's activations (core/activation.py,
    details["activations"]), None for an algo qconv does not decode. ModelOpt's FP8 and NVFP4 are W8A8
    and W4A4 with a static per-tensor ``input_scale`` on every quantized Linear (vLLM's
    ModelOptFp8LinearMethod and ModelOptNvFp4LinearMethod register one for each, whatever the files
    hold), unless config.json's config_groups say input_activations null (or dynamic)."""
    if algo not in DECODED:
        return None
    groups = (qc or {}).get("config_groups") if not is_side_config(qc) else None
    acts = [g["input_activations"] for g in groups.values() if isinstance(g, Mapping) and "input_activations" in g] \
        if isinstance(groups, Mapping) else []      # a group that does not say is the algo's
    if acts and not any(isinstance(a, Mapping) and a.get("dynamic") is False for a in acts):
        dynamic = any(isinstance(a, Mapping) for a in acts)
        return (False, f"config.json's config_groups (quant_algo {algo}): input_activations {'dynamic' if dynamic else 'null'}",
                "dynamic" if dynamic else "unquantized")
    return True, f"quant_algo {algo}, a static per-tensor input_scale on every quantized Linear", "static"


check = refuse_problems      # the first problem find listed, naming the file and the weight


def settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of a ModelOpt checkpoint: the algo, NVFP4's group size, what the config
    excludes (under either spelling), whether the activations carry a static per-tensor input_scale,
    and the stored scales' dtype."""
    cfg = parse_config(qc) if qc else {}
    static = {bool(m.details.get("static_activations")) for m in modules}
    input_scale = "per tensor (static)" if static == {True} else "on some modules" if len(static) > 1 else None
    return {"quant_algo": cfg.get("quant_algo", common(m.details.get("quant_algo") for m in modules)),
            "group_size": common(m.group_size for m in modules if m.scheme == "e2m1"),
            "kv_cache_quant_algo": cfg.get("kv_cache_quant_algo"),
            "exclude_modules": cfg.get("exclude_modules"),
            "input_scale": input_scale,
            "scales_dtype": common(DTYPES[m.details["scales_dtype"]][1] for m in modules
                                   if m.details.get("scales_dtype") in DTYPES)}


def _flat(doc: Mapping) -> Mapping:
    return doc["quantization"] if is_side_config(doc) else doc


def lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str], comp, warnings: list[str]) -> None:
    """Exclude entries that name nothing; config.json and hf_quant_config.json that disagree (vLLM
    reads config.json's where there is one, and a loader that reads only one file gets another model)."""
    cfg = parse_config(qc)
    for entry in cfg["exclude_modules"]:
        if not any(excluded_by(name, [entry]) for name in all_modules):
            warnings.append(f"{cfg['exclude_key']} entry {entry!r} matches no module of this checkpoint")
    side = (getattr(comp, "side_configs", None) or {}).get(SIDE_CONFIG)
    if side is None or not is_side_config(side) or is_side_config(qc):
        return
    other = parse_config(side)
    keys = ("quant_algo", "kv_cache_quant_algo") + (("group_size",) if other["quant_algo"] == cfg["quant_algo"] else ())
    for key in keys:
        if other[key] != cfg[key]:
            warnings.append(f"{SIDE_CONFIG} says {key}={other[key]!r} but config.json says {cfg[key]!r}; "
                            f"loaders that read config.json follow it")
    if sorted(other["exclude_modules"]) != sorted(cfg["exclude_modules"]):
        warnings.append(f"{SIDE_CONFIG} excludes {other['exclude_modules']!r} but config.json's ignore is "
                        f"{cfg['exclude_modules']!r}; loaders that read config.json follow it")


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks of target modelopt-nvfp4: ModelOpt's NVFP4 (W4A4) as export_hf_checkpoint
# writes it (codec.fit_nvfp4 / plan_nvfp4 / share_nvfp4 / retarget_nvfp4 decide and compute the data)

NVFP4_TARGET = "modelopt-nvfp4"


def nvfp4_leaves(spec, shape: tuple[int, int], g_idx: bool = False,
                 **settings) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode_nvfp4 stores (stdlib, before any data), as ModelOpt exports it: e2m1 codes two
    a byte ``weight`` U8 [out, in/2], e4m3 ``weight_scale`` [out, in/16], and two float32 scalars (shape
    []), ``weight_scale_2`` (the weight's global multiplier) and ``input_scale`` (the static activation
    scale, a multiplier too)."""
    check_nvfp4_shape(spec, shape, g_idx, "ModelOpt", "multiplier")
    out, inp = shape
    return {"weight": ("U8", (out, inp // 2)), "weight_scale": ("F8_E4M3", (out, inp // NVFP4_GROUP)),
            "weight_scale_2": ("F32", ()), "input_scale": ("F32", ())}


def nvfp4_config(ctx) -> dict:
    """config.json's quantization_config as ModelOpt 0.47's export_hf_checkpoint writes it for NVFP4
    (fixtures/checkpoints/llama-modelopt-nvfp4): one config group of 4-bit float weights and input
    activations in groups of 16 targeting "Linear", ``ignore`` every 2-D weight left unquantized by exact
    name (embeddings included, as ModelOpt lists them), ``quant_algo`` NVFP4. ModelOpt's ``producer``
    (its name and version) is not claimed. vLLM reads this flat form (ModelOptQuantConfigBase.from_config),
    as qconv's reader does; hf_quant_config.json, which only repeats it, is not written."""
    for name, spec in ctx.specs.items():
        if spec.scheme != "e2m1":
            raise NotStorable(f"{name}: {NVFP4_TARGET} stores e2m1 codes, not {spec.name}")
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
    return {"config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4),
                                          "targets": ["Linear"]}},
            "ignore": sorted(ctx.unquantized, key=natural_key), "quant_algo": "NVFP4", "quant_method": METHOD}
