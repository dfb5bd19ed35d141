"""bitsandbytes LLM.int8 (``Linear8bitLt``) and 4-bit (``Linear4bit``) checkpoints, from headers
(stdlib only, so `inspect` stays light; decoding the data is bnb/codec.py), and what the writers
(the registry targets bnb8, bnb4-nf4, bnb4-fp4) store and configure, from specs alone.

LLM.int8, per quantized Linear ``P`` (docs/formats.md, bitsandbytes LLM.int8)::

    P.weight         int8    [out, in]   CB, row-wise symmetric codes
    P.SCB            float32 [out]       row absmax;  W = CB * SCB / 127
    P.weight_format  uint8   []          0 = row-major (the only layout bitsandbytes >= 0.46 loads)

4-bit, per quantized Linear ``P`` (docs/formats.md, bitsandbytes 4-bit)::

    P.weight                          storage dtype [ceil(out*in/2) / itemsize, 1]  two codes a byte,
                                                                                   first in the HIGH nibble
    P.weight.absmax                   float32 [n_blocks]   (uint8 codes with double quant)
    P.weight.quant_map                float32 [16]
    P.weight.nested_absmax            float32 [ceil(n_blocks/256)]   double quant only
    P.weight.nested_quant_map         float32 [256]                   double quant only
    P.weight.quant_state.bitsandbytes__<nf4|fp4>  uint8 [len]  JSON: quant_type, blocksize, dtype,
                                                               shape, nested_* (the only data read)
"""

from __future__ import annotations

import json
import math
import re
from typing import Mapping

from ...errors import CorruptCheckpoint, NotStorable
from ..core.layout import QuantModule, common, examples, natural_key
from ..storage.safetensors_header import FLOAT_DTYPES, TensorInfo, read_small_tensors

QS_PREFIX = ".weight.quant_state.bitsandbytes__"

STATE_4BIT = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}
FLOAT_NAMES = ("float16", "bfloat16", "float32")
STORAGE_NAMES = {"U8": "uint8", "I8": "int8", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
                 "F64": "float64"}


def find_int8_modules(tensors: Mapping[str, TensorInfo]) -> list[QuantModule]:
    modules = []
    formats = read_small_tensors(info for name, info in tensors.items()
                                 if name.endswith(".weight_format") and name[:-14] + ".SCB" in tensors)
    for name, scb in tensors.items():
        if not name.endswith(".SCB"):
            continue
        prefix = name[:-4]
        weight = tensors.get(prefix + ".weight")
        fmt = tensors.get(prefix + ".weight_format")
        problems = []
        if weight is None:
            problems.append("has SCB but no int8 weight tensor")
            out, inp = (scb.shape[0] if scb.shape else 0), 0
        else:
            if weight.dtype != "I8" or len(weight.shape) != 2:
                problems.append(f"weight is {weight.dtype} {list(weight.shape)}, expected int8 [out, in]")
            out = weight.shape[0] if weight.shape else 0
            inp = weight.shape[1] if len(weight.shape) == 2 else 0
            if scb.shape != (out,):
                problems.append(f"SCB has shape {list(scb.shape)}, expected [{out}] (one per output row)")
        if scb.dtype != "F32":           # bitsandbytes keeps row stats in float32; others lose digits
            problems.append(f"SCB is {scb.dtype}, expected float32")
        details = {}
        if fmt is not None:
            code = formats[fmt.name]
            value = code[0] if len(code) == 1 else None
            details["weight_format"] = WEIGHT_FORMATS.get(value, f"unknown ({value})")
            if value != 0:
                problems.append(f"weight_format is {details['weight_format']!r}: bitsandbytes >= 0.46 "
                                f"only loads row-major int8 weights")
        state = tuple(n for n in (name, prefix + ".weight_format") if n in tensors)
        modules.append(QuantModule(prefix, "bnb8", "int8", 8, out, inp,
                                   (prefix + ".weight",) if weight is not None else (), state,
                                   details=details, problems=tuple(problems)))
    return modules


def parse_quant_state(info: TensorInfo, raw: bytes) -> dict:
    try:
        qs = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpoint("bitsandbytes quant_state is not valid JSON", file=info.file,
                                tensor=info.name) from None
    shape = qs.get("shape") if isinstance(qs, dict) else None
    if (not isinstance(qs, dict) or not isinstance(qs.get("blocksize"), int)
            or qs["blocksize"] <= 0 or not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise CorruptCheckpoint("bitsandbytes quant_state JSON lacks a positive blocksize or a shape",
                                file=info.file, tensor=info.name)
    # bitsandbytes writes these as an int, a float and a dtype name (docs/formats.md, bitsandbytes 4-bit); anything else
    # would be decoded into wrong numbers, so the JSON is refused as a whole.
    nested_blocksize, offset, dtype = (qs.get(k) for k in ("nested_blocksize", "nested_offset", "dtype"))
    if "nested_blocksize" in qs and (not isinstance(nested_blocksize, int) or isinstance(nested_blocksize, bool)
                                     or nested_blocksize <= 0):
        problem = f"nested_blocksize {nested_blocksize!r} is not a positive integer"
    elif "nested_offset" in qs and (not isinstance(offset, (int, float)) or isinstance(offset, bool)
                                    or not math.isfinite(offset)):
        problem = f"nested_offset {offset!r} is not a finite number"
    elif dtype not in FLOAT_NAMES:                      # bitsandbytes' from_dict needs it too
        problem = (f"dtype {dtype!r} is not one of {', '.join(FLOAT_NAMES)}" if "dtype" in qs
                   else "has no dtype (bitsandbytes cannot load it either)")
    elif "nested_offset" in qs and qs.get("nested_dtype") != "float32":
        # bitsandbytes writes float32 and decodes the nested absmax in nested_dtype; no other is written
        problem = (f"nested_dtype {qs.get('nested_dtype')!r} is not 'float32', the only one bitsandbytes "
                   f"writes" if "nested_dtype" in qs else "double quant without nested_dtype")
    elif "nested_offset" in qs and "nested_blocksize" not in qs:
        problem = "double quant without nested_blocksize (bitsandbytes cannot load it either)"
    else:
        return qs
    raise CorruptCheckpoint(f"bitsandbytes quant_state JSON: {problem}", file=info.file, tensor=info.name)


def find_4bit_modules(tensors: Mapping[str, TensorInfo]) -> list[QuantModule]:
    modules = []
    blobs = read_small_tensors((info for name, info in tensors.items() if QS_PREFIX in name),
                               limit=64 << 10)
    for name, info in tensors.items():
        if QS_PREFIX not in name:
            continue
        prefix, _, qtype = name.partition(QS_PREFIX)
        qs = parse_quant_state(info, blobs[name])
        problems = []
        if qs.get("quant_type") != qtype:
            problems.append(f"quant_state tensor says {qtype} but its JSON says {qs.get('quant_type')!r}")
        shape = qs["shape"]
        out, inp = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (shape[0], 1)
        n = out * inp
        blocksize = qs["blocksize"]
        if blocksize & (blocksize - 1) or not 32 <= blocksize <= 4096:
            problems.append(f"blocksize {blocksize} is not a power of two in 32..4096")
        weight = tensors.get(prefix + ".weight")
        storage = None
        if weight is None:
            problems.append("has a quant_state but no packed weight tensor")
        else:
            storage = STORAGE_NAMES.get(weight.dtype, weight.dtype)
            if weight.nbytes != (n + 1) // 2:
                problems.append(f"packed weight holds {weight.nbytes} bytes; shape {shape} needs "
                                f"{(n + 1) // 2}")
        absmax = tensors.get(prefix + ".weight.absmax")
        double = prefix + ".weight.nested_absmax" in tensors
        for leaf in ("absmax", "quant_map") + (("nested_absmax", "nested_quant_map") if double else ()):
            if prefix + ".weight." + leaf not in tensors:
                problems.append(f"missing {leaf} tensor")
        n_blocks = -(-n // blocksize)
        if absmax is not None:
            if list(absmax.shape) != [n_blocks]:
                problems.append(f"absmax has shape {list(absmax.shape)}; {n} weights in blocks of "
                                f"{blocksize} need [{n_blocks}]")
            if double and absmax.dtype != "U8":
                problems.append(f"double-quant absmax is {absmax.dtype}, expected uint8 codes")
            if not double and absmax.dtype != "F32":
                problems.append(f"absmax is {absmax.dtype}, expected float32")
        if double and "nested_offset" not in qs:
            problems.append("double quant without nested_offset in the quant_state JSON")
        quant_map = tensors.get(prefix + ".weight.quant_map")
        if quant_map is not None and (quant_map.dtype != "F32" or list(quant_map.shape) != [16]):
            problems.append(f"quant_map is {quant_map.dtype} {list(quant_map.shape)}, expected float32 [16]")
        if double:
            problems += _nested_problems(tensors, prefix, n_blocks, qs.get("nested_blocksize", 256))
        state = tuple(t for t in (name, *(prefix + ".weight." + s for s in STATE_4BIT)) if t in tensors)
        details = {"quant_type": qtype, "blocksize": blocksize, "double_quant": double,
                   "quant_storage": storage, "dtype": qs.get("dtype"), "quant_state": qs}
        modules.append(QuantModule(prefix, "bnb4", qtype, 4,
                                   out, inp, (prefix + ".weight",) if weight is not None else (), state,
                                   group_size=blocksize, details=details, problems=tuple(problems)))
    return modules


def _nested_problems(tensors: Mapping[str, TensorInfo], prefix: str, n_blocks: int,
                     nested_blocksize: int) -> list[str]:
    """Double quantization's state against what bitsandbytes writes: float32 nested absmax, one per
    nested block of absmax codes, and the 256-entry float32 dynamic map."""
    problems = []
    nested = tensors.get(prefix + ".weight.nested_absmax")
    if nested is not None:
        need = -(-n_blocks // nested_blocksize)
        if nested.dtype != "F32":
            problems.append(f"nested_absmax is {nested.dtype}, expected float32")
        if list(nested.shape) != [need]:
            problems.append(f"nested_absmax has shape {list(nested.shape)}; {n_blocks} absmax codes in nested "
                            f"blocks of {nested_blocksize} need [{need}]")
    nested_map = tensors.get(prefix + ".weight.nested_quant_map")
    if nested_map is not None and (nested_map.dtype != "F32" or list(nested_map.shape) != [256]):
        problems.append(f"nested_quant_map is {nested_map.dtype} {list(nested_map.shape)}, expected "
                        f"float32 [256]")
    return problems


# ---------------------------------------------------------------------------------------------
# llm_int8_skip_modules matching (docs/formats.md, bitsandbytes LLM.int8)

_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def skipped_by_transformers5(name: str, key: str) -> bool:
    """transformers >= 5 (quantizers_utils.should_convert_module): anchored regex up to a module
    boundary, or a plain suffix."""
    try:
        hit = re.match(rf"(?:{key}){_BOUNDARY}", name) is not None
    except re.error:
        hit = name == key or name.startswith(key + ".")
    return hit or name.endswith(key)


def skipped_by_transformers4(name: str, key: str) -> bool:
    """transformers 4.x (_replace_with_bnb_linear): local name, substring ``key + '.'``, or equal."""
    return name.rpartition(".")[2] == key or (key + ".") in name or key == name


def parse_config(qc: Mapping) -> dict:
    """The bitsandbytes fields of a quantization_config that matter to a reader."""
    eight = bool(qc.get("load_in_8bit") or qc.get("_load_in_8bit"))
    four = bool(qc.get("load_in_4bit") or qc.get("_load_in_4bit"))
    return {"load_in_8bit": eight, "load_in_4bit": four,
            "threshold": qc.get("llm_int8_threshold", 6.0),
            "skip_modules": qc.get("llm_int8_skip_modules"),
            "quant_type": qc.get("bnb_4bit_quant_type", "fp4"),
            "double_quant": bool(qc.get("bnb_4bit_use_double_quant", False)),
            "quant_storage": qc.get("bnb_4bit_quant_storage", "uint8"),
            "compute_dtype": qc.get("bnb_4bit_compute_dtype")}


def int8_settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of an LLM.int8 checkpoint: the keys of the hand-made report users already write
    (threshold, skip_modules, linear8bit_modules, int8_parameters: out x in of the int8 Linears)."""
    cfg = parse_config(qc) if qc else {"threshold": None, "skip_modules": None}
    int8 = [m for m in modules if m.scheme == "int8"]
    return {"threshold": cfg["threshold"], "skip_modules": cfg["skip_modules"],
            "linear8bit_modules": [m.name for m in int8],
            "int8_parameters": sum(m.logical_parameters for m in int8)}


def four_bit_settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of a bitsandbytes 4-bit checkpoint."""
    cfg = parse_config(qc) if qc else {}
    return {"quant_type": common(m.scheme for m in modules),
            "blocksize": common(m.group_size for m in modules),
            "double_quant": common(m.details["double_quant"] for m in modules),
            "quant_storage": common(m.details["quant_storage"] for m in modules),
            "original_dtype": common(m.details["dtype"] for m in modules),
            "compute_dtype": cfg.get("compute_dtype"),
            "skip_modules": cfg.get("skip_modules")}


# ---------------------------------------------------------------------------------------------
# Config lint (inspect)

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


def lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str], comp, warnings: list[str]) -> None:
    """What a bitsandbytes quantization_config gets wrong against its tensors, as warnings."""
    cfg = parse_config(qc)
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
        skipped_quantized = [m for m in quantized if skipped_by_transformers5(m, key)]
        if skipped_quantized:
            warnings.append(
                f"config and tensors disagree: llm_int8_skip_modules entry {key!r} tells "
                f"transformers >= 5 not to quantize {len(skipped_quantized)} modules that are stored "
                f"quantized ({examples(skipped_quantized)})")
        if any(skipped_by_transformers5(m, key) for m in all_modules):
            continue
        meant = [m for m in quantized if skipped_by_transformers4(m, key)]
        if meant:
            prefix = _suggest_prefix(meant, key)
            warnings.append(
                f"llm_int8_skip_modules entry {key!r} matches no module under transformers >= 5 rules "
                f"(entries match from the start of the module name, or as a suffix), yet "
                f"{len(meant)} quantized modules contain {key!r} ({examples(meant)}): they were "
                f"quantized, probably against intent (transformers 4.x skipped them). To keep them "
                f"unquantized, requantize with the full prefix {prefix!r}")
    if skip is not None and "lm_head" in all_modules and "lm_head" not in quantized:
        head = comp.tensors.get("lm_head.weight")
        if head is not None and head.dtype in FLOAT_DTYPES and not any(
                isinstance(k, str) and skipped_by_transformers5("lm_head", k) for k in skip):
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


# ---------------------------------------------------------------------------------------------
# Writers: the registry targets bnb8, bnb4-nf4 and bnb4-fp4 (formats/core/registry.py). What they store and
# their quantization_config, from specs alone (stdlib); fitting specs, planning double quant and encoding
# the data are bnb/codec.py's.

FOUR_BIT_TARGETS = {"bnb4-nf4": "nf4", "bnb4-fp4": "fp4"}     # --to name -> bnb_4bit_quant_type
_ITEMSIZE = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def int8_leaves(spec, shape: tuple[int, int], g_idx: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What bnb.codec.encode_int8 stores (docs/formats.md, bitsandbytes LLM.int8): CB, SCB, a row-major weight_format."""
    out, inp = shape
    return {"weight": ("I8", (out, inp)), "SCB": ("F32", (out,)), "weight_format": ("U8", ())}


def packed_items(n: int, storage: str) -> int:
    """Items of the quant storage dtype that hold n 4-bit codes (two a byte); ValueError where the packed
    bytes are not a whole number of them."""
    nbytes = (n + 1) // 2
    if nbytes % _ITEMSIZE[storage]:
        raise NotStorable(f"{nbytes} packed bytes cannot be stored as {storage}")
    return nbytes // _ITEMSIZE[storage]


def quant_state_json(quant_type: str, blocksize: int, dtype: str, shape, nested_offset=None,
                     nested_blocksize: int = 256) -> bytes:
    """The packed quant_state exactly as bitsandbytes writes it: json.dumps of QuantState.as_dict's
    non-tensor items, in that order (docs/formats.md, bitsandbytes 4-bit). Known before any data is read, so a writer can
    plan its header (the nested offset of a double-quantized source comes from the source's JSON)."""
    state = {"quant_type": quant_type, "blocksize": blocksize, "dtype": dtype, "shape": list(shape)}
    if nested_offset is not None:
        state.update({"nested_blocksize": nested_blocksize, "nested_dtype": "float32",
                      "nested_offset": float(nested_offset)})
    return json.dumps(state).encode("utf-8")


def four_bit_leaves(spec, shape: tuple[int, int], g_idx: bool, *, dtype: str = "float16",
                    double_quant: bool = False, nested_blocksize: int = 256,
                    nested_offset=None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What bnb.codec.encode_4bit stores (docs/formats.md, bitsandbytes 4-bit), given the module's write settings
    (bnb.codec.plan_4bit; the defaults: a float16 weight without double quantization): the packed weight
    in spec.storage, the block absmax (uint8 codes under double quant), the code book, the nested state,
    and the quant_state JSON, whose length depends on the dtype, the shape and the nested offset."""
    out, inp = shape
    n, bs = out * inp, spec.group_size
    storage = spec.storage or "U8"
    n_blocks = -(-n // bs)
    blob = quant_state_json(spec.scheme, bs, dtype, (out, inp), nested_offset if double_quant else None,
                            nested_blocksize)
    leaves = {"weight": (storage, (packed_items(n, storage), 1)),
              "weight.absmax": ("U8" if double_quant else "F32", (n_blocks,)),
              "weight.quant_map": ("F32", (16,))}
    if double_quant:
        leaves["weight.nested_absmax"] = ("F32", (-(-n_blocks // nested_blocksize),))
        leaves["weight.nested_quant_map"] = ("F32", (256,))
    leaves[f"weight.quant_state.bitsandbytes__{spec.scheme}"] = ("U8", (len(blob),))
    return leaves


def skip_prefixes(unquantized, quantized) -> list[str]:
    """The shortest dotted prefixes covering the unquantized Linears and no quantized one: what
    transformers 5 (anchored match up to a dot) and 4 (substring `key.`) both skip as intended."""
    out = set()
    for name in unquantized:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if not any(q == prefix or q.startswith(prefix + ".") for q in quantized):
                out.add(prefix)
                break
    return sorted(out, key=natural_key)


def config_writer(four_bit: bool):
    """The quantization_config transformers saves for LLM.int8 (four_bit False) or 4-bit: every field
    BitsAndBytesConfig.to_dict writes, the unquantized Linears as llm_int8_skip_modules prefixes. 4-bit:
    the quant type and storage of the (uniform) specs, the source's compute dtype (else float32), double
    quant where a module is written with it (WriteContext.settings: kept from the source or added by
    --double-quant), as the nested tensors beside it say."""
    def config(ctx) -> dict:
        skip = skip_prefixes(ctx.unquantized, sorted(ctx.specs, key=natural_key))
        if not four_bit:
            return {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
                    "_load_in_8bit": True, "_load_in_4bit": False, "llm_int8_threshold": 6.0,
                    "llm_int8_skip_modules": skip, "llm_int8_enable_fp32_cpu_offload": False,
                    "llm_int8_has_fp16_weight": False, "bnb_4bit_compute_dtype": "float32",
                    "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False,
                    "bnb_4bit_quant_storage": "uint8"}
        spec = next(iter(ctx.specs.values()))
        compute = (ctx.source_qc or {}).get("bnb_4bit_compute_dtype") or "float32"
        written_dq = any(ctx.settings.get(n, {}).get("double_quant", False) for n in ctx.specs)
        return {"quant_method": "bitsandbytes", "load_in_8bit": False, "load_in_4bit": True,
                "_load_in_8bit": False, "_load_in_4bit": True, "llm_int8_threshold": 6.0,
                "llm_int8_skip_modules": skip, "llm_int8_enable_fp32_cpu_offload": False,
                "llm_int8_has_fp16_weight": False, "bnb_4bit_compute_dtype": compute,
                "bnb_4bit_quant_type": spec.scheme, "bnb_4bit_use_double_quant": written_dq,
                "bnb_4bit_quant_storage": STORAGE_NAMES[spec.storage]}
    return config
