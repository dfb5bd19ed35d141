"""Apple MLX's quantized checkpoints (mlx-lm's ``mlx_lm.convert -q``, ``nn.quantize``), described from
headers and config. Stdlib only, so `inspect` stays light; the data is codec.py.

Per quantized Linear ``P``, mode ``affine`` (mlx ``mx.quantize``; mlx-lm 0.32, checked with mlx 0.32.4)::

    P.weight  uint32     [out, in * bits / 32]   each row one continuous stream of codes, code i at bit
                                                 i * bits from the start, low bits first, over little-endian
                                                 words (3-, 5- and 6-bit codes cross words)
    P.scales  f16/bf16/f32 [out, in / group]
    P.biases  same       [out, in / group]

    w[o, i] = scales[o, g] * q[o, i] + biases[o, g],   g = i // group,   q unsigned

``mx.dequantize`` computes the product and the sum each in the scales' dtype (two roundings; in float32
``fl(fl(s * q) + b)``). Bits 1-6 and 8 (no 7), groups of 32, 64 or 128. ``mx.quantize`` writes negative
scales in about half its groups, so no sign is assumed. MoE experts are stacked ``[E, out, ...]`` under
``switch_mlp`` (SwitchLinear).

Mode ``mxfp4`` (the OCP microscaling format, as mlx 0.32.4's ``mx.quantize(..., mode="mxfp4")`` writes and
``mx.dequantize`` reads it, checked)::

    P.weight  uint32  [out, in / 8]    e2m1 codes, 8 a word, low nibble first (the bytes of
                                       compressed-tensors' weight_packed, two codes a byte, even one low)
    P.scales  uint8   [out, in / 32]   e8m0: 2^(b - 127)

    w[o, i] = e2m1(q[o, i]) * 2^(scales[o, g] - 127),   g = i // 32

config.json (mlx-lm ``save_config``): ``"quantization": {"group_size", "bits", "mode"}`` and an identical
``"quantization_config"`` (no ``quant_method``); a module's own settings under its path (``{"group_size",
"bits"}``), or ``false`` for a module left in float. mlx-lm reads ``quantization`` first and infers a
module's settings from its shapes where the config does not name it. The other modes (``nvfp4``,
``mxfp8``) are named and refused.
"""

from __future__ import annotations

from typing import Mapping

from ...errors import CorruptCheckpoint, NotStorable
from ..core.layout import QuantModule, common, int_scheme, refuse_problems
from ..storage.safetensors_header import DTYPES, TensorInfo

METHOD = "mlx"
BITS = (1, 2, 3, 4, 5, 6, 8)         # what mx.quantize packs in mode affine
GROUPS = (32, 64, 128)               # group sizes mx.quantize takes
SCALE_DTYPES = ("F16", "BF16", "F32")
SETTING_KEYS = ("group_size", "bits", "mode")
AFFINE = "affine"
MXFP4 = "mxfp4"                      # e2m1 codes in groups of 32 under e8m0 scales (no biases)
MXFP4_GROUP = 32
DEFAULT_GROUP = 64                   # mode affine's group size where a config gives none or null (mx.quantize)
DEFAULT_BITS = 4                     # modes affine's and mxfp4's bits where a config gives null (mx.quantize)
# config keys of quantize_config.json / quantization_config dialects that are never MLX module paths
_FOREIGN_KEYS = ("quant_method", "desc_act", "sym", "zero_point", "w_bit", "q_group_size", "version",
                 "checkpoint_format", "damp_percent", "true_sequential", "static_groups", "format")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_config(qc) -> bool:
    """Whether a quantization config without quant_method is MLX's: ``bits`` and ``group_size`` (their
    values checked by refuse), perhaps ``mode``, and otherwise only module paths (dotted names, or lm_head) holding a dict or false;
    AutoGPTQ's bare quantize_config.json (``desc_act``, ``sym``, ...) is not."""
    if not isinstance(qc, Mapping) or "quant_method" in qc or any(k in qc for k in _FOREIGN_KEYS):
        return False
    if "bits" not in qc and "group_size" not in qc:     # their values are refuse's to judge (null: the default)
        return False
    return all(k in SETTING_KEYS or (("." in k or k == "lm_head") and (isinstance(v, Mapping) or v is False))
               for k, v in qc.items())


def module_settings(qc: Mapping | None, name: str) -> dict | bool:
    """(bits, group_size, mode) a module is written with: its own entry (a dict, or False: left in
    float), else the config's defaults."""
    qc = qc or {}
    own = qc.get(name)
    if own is False:
        return False
    base = {k: qc.get(k) for k in SETTING_KEYS}
    if isinstance(own, Mapping):            # mlx-lm's mixed recipes write "group_size": null: the mode's default
        base.update({k: own[k] for k in SETTING_KEYS if k in own})
    base["mode"] = base.get("mode") or AFFINE
    if base["group_size"] is None:          # null: the mode's default (mx.quantize's)
        base["group_size"] = MXFP4_GROUP if base["mode"] == MXFP4 else DEFAULT_GROUP if base["mode"] == AFFINE else None
    if base["bits"] is None and base["mode"] in (AFFINE, MXFP4):
        base["bits"] = DEFAULT_BITS
    return base


def find_modules(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """One QuantModule per ``P.scales`` beside an integer ``P.weight``, from headers and the config; every
    such module is listed (a malformed one is refused by check, never copied as a plain weight).
    ``problems`` lists what stops an exact decode, ``details["unsupported"]`` the part qconv does not
    decode (another mode, a width mx.quantize does not pack)."""
    modules = []
    for name, scales in tensors.items():
        if not name.endswith(".scales"):
            continue
        prefix = name[: -len(".scales")]
        weight, biases = tensors.get(prefix + ".weight"), tensors.get(prefix + ".biases")
        if weight is None or weight.dtype not in ("U32", "I32", "U8"):
            continue
        problems, unsupported = [], []
        cfg = module_settings(qc, prefix)
        if cfg is False:
            problems.append("the config leaves this module in float (false), but it is stored packed")
            cfg = module_settings(qc, "")
        bits, group, mode = cfg["bits"], cfg["group_size"], cfg["mode"]
        fp4 = mode == MXFP4
        if mode not in (AFFINE, MXFP4):
            unsupported.append(f"MLX mode {mode!r}: qconv reads modes affine and mxfp4")
        elif fp4 and (bits, group) != (4, MXFP4_GROUP):
            problems.append(f"mode mxfp4 with bits {bits!r} and group_size {group!r}: mxfp4 is 4-bit in groups of 32")
        if not _int(bits) or bits not in BITS:
            unsupported.append(f"bits {bits!r}: MLX affine packs {', '.join(map(str, BITS))}-bit codes")
            bits = 4
        if not _int(group) or group <= 0:
            problems.append(f"group_size {group!r} is not a positive integer")
            group = 64
        if weight.dtype != "U32":
            problems.append(f"weight is {weight.dtype}; MLX packs codes in uint32 words")
        shape = list(weight.shape)
        lead = shape[:-2]
        experts = lead[0] if len(lead) == 1 else 0
        if len(shape) not in (2, 3):
            problems.append(f"weight has shape {shape}, expected [out, in*bits/32] (or [experts, out, ...])")
            shape = [0, 0]
        elif experts and ".switch_mlp." not in prefix:
            stacked = prefix.rpartition(".")[0].endswith(".experts")    # mlx-lm's gpt-oss SwitchGLU
            (unsupported if stacked else problems).append(
                f"weight is stacked {shape} outside a switch_mlp block: "
                + ("qconv reads mlx-lm's stacked experts as SwitchLinear under switch_mlp (Qwen, Mixtral, "
                   "DeepSeek), not this model's" if stacked else
                   "mlx-lm stacks experts only under switch_mlp (SwitchLinear); a Linear holds [out, in*bits/32]"))
        out, words = shape[-2], shape[-1]
        inp = words * 32 // bits if (words * 32) % bits == 0 else 0
        if (words * 32) % bits:
            problems.append(f"{words} words per row do not hold a whole number of {bits}-bit codes")
        if biases is None and not fp4:
            (unsupported if mode != AFFINE else problems).append(
                "has no biases tensor (MLX affine stores P.scales and P.biases)")
        elif biases is not None and fp4:
            problems.append("has a biases tensor, which mode mxfp4 does not store")
        groups = None
        if len(scales.shape) != len(shape) or list(scales.shape[:-1]) != shape[:-1]:
            problems.append(f"scales has shape {list(scales.shape)}, which does not fit weight {shape}")
        else:
            groups = scales.shape[-1]
            if inp and group and (inp % group or inp // group != groups):
                problems.append(f"{groups} scale groups for {inp} inputs, but the config's group_size is {group}")
        if fp4 and scales.dtype not in ("U8", "F8_E8M0"):
            problems.append(f"scales is {scales.dtype}; mode mxfp4 stores e8m0 exponents (uint8)")
        elif not fp4 and scales.dtype not in SCALE_DTYPES:
            (unsupported if mode != AFFINE else problems).append(
                f"scales is {scales.dtype}; MLX affine stores {'/'.join(SCALE_DTYPES)} scales")
        if biases is not None and not fp4 and (biases.shape != scales.shape or biases.dtype != scales.dtype):
            problems.append(f"biases {biases.dtype} {list(biases.shape)} do not match scales "
                            f"{scales.dtype} {list(scales.shape)}")
        if _int(group) and group not in GROUPS and not problems and not fp4:
            unsupported.append(f"group_size {group}: MLX affine takes groups of 32, 64 or 128")
        state = tuple(t for t in (prefix + ".scales", prefix + ".biases") if t in tensors)
        details = {"mode": mode, "groups": groups, "scales_dtype": scales.dtype, "unsupported": tuple(unsupported)}
        m = QuantModule(prefix, "mlx", "e2m1" if fp4 else int_scheme(bits), bits, out * max(experts, 1), inp,
                        (weight.name,),
                        state, group_size=group, details=details, problems=tuple(unsupported + problems),
                        experts=experts)
        modules.extend(expert_views(m, out) if experts else [m])
    return modules


# SwitchLinear projections of the MoE blocks whose per-expert Linears have another name (Mixtral)
_PER_EXPERT = {"block_sparse_moe": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}}


def expert_views(m: QuantModule, rows: int) -> list[QuantModule]:
    """A stacked SwitchLinear module ``<block>.switch_mlp.<proj>`` [E, rows, ...] as its E experts, each a
    view of its rows (details["rows_of"], read through the stacked module: reader.read_module) named as
    the per-expert Linear transformers' checkpoints hold, ``<block>.experts.<e>.<proj>`` (Mixtral:
    ``w1`` / ``w2`` / ``w3``): the layout every other format stores and every loader reads."""
    from dataclasses import replace

    block, _, proj = m.name.rpartition(".switch_mlp.")
    if not block:
        return [m]
    leaf = _PER_EXPERT.get(block.rsplit(".", 1)[-1], {}).get(proj, proj)
    return [replace(m, name=f"{block}.experts.{e}.{leaf}", out_features=rows, experts=0,
                    details={**m.details, "rows_of": (m, e * rows), "stacked": m.name})
            for e in range(m.experts)]


def stacked_name(name: str) -> tuple[str, int] | None:
    """(``<block>.switch_mlp.<proj>``, e) for a per-expert Linear ``<block>.experts.<e>.<proj>`` (Mixtral's
    w1 / w2 / w3 as gate / down / up), the inverse of expert_views; None for any other module."""
    head, sep, tail = name.rpartition(".experts.")
    number, _, proj = tail.partition(".")
    if not sep or not number.isdigit() or not proj or "." in proj:
        return None
    leaf = {v: k for k, v in _PER_EXPERT.get(head.rsplit(".", 1)[-1], {}).items()}.get(proj, proj)
    return f"{head}.switch_mlp.{leaf}", int(number)


def check(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> None:
    refuse_problems(m, tensors, qc)


def settings(qc: Mapping | None, modules: list[QuantModule]) -> dict:
    """inspect's settings of an MLX checkpoint."""
    qc = qc or {}
    return {"bits": common(m.bits for m in modules), "group_size": common(m.group_size for m in modules),
            "mode": common(m.details.get("mode") for m in modules) or qc.get("mode"),
            "per_module_overrides": sum(1 for k in qc if k not in SETTING_KEYS),
            "scales_dtype": common(DTYPES[m.details["scales_dtype"]][1] for m in modules
                                   if m.details.get("scales_dtype") in DTYPES)}


def lint(qc: Mapping, modules: list[QuantModule], all_modules: set[str], comp, warnings: list[str]) -> None:
    """Per-module entries that name no module (mlx-lm matches them by exact path)."""
    for key in qc:
        if key not in SETTING_KEYS and key not in all_modules:
            warnings.append(f"quantization entry {key!r} names no module of this checkpoint")


def refuse(qc: Mapping) -> tuple[type, str] | None:
    """A config under which nothing can be decoded: defaults that are neither positive integers nor null
    (null: the mode's default, as mx.quantize takes it), named by key."""
    for key in ("bits", "group_size"):
        value = qc.get(key)
        if value is not None and (not _int(value) or value <= 0):
            return CorruptCheckpoint, (f"quantization.{key} is {value!r}, not a positive integer or null: qconv "
                                       f"reads each module's {key} from it where the config names none")
    mode = qc.get("mode")
    if mode is not None and not isinstance(mode, str):
        return CorruptCheckpoint, f"quantization.mode is {mode!r}, not a mode's name"
    return None


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks (target mlx)

def writer_leaves(spec, shape: tuple[int, int], g_idx: bool, scale_dtype: str | None = None
                  ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode stores (stdlib, predicted before any data): scale_dtype is the module's plan
    (codec.plan: the model's 16-bit dtype where it holds scales and biases exactly, else F32)."""
    out, inp = shape
    if spec.scheme == "e2m1":                # mode mxfp4: codes and e8m0 exponents, no biases
        if spec.group_size != MXFP4_GROUP or spec.global_scale is not None or inp % MXFP4_GROUP or g_idx:
            raise NotStorable(f"MLX mxfp4 stores e2m1 in groups of 32 under one power-of-two scale each, not "
                             f"groups of {spec.group_size} over {inp} inputs")
        return {"weight": ("U32", (out, inp // 8)), "scales": ("U8", (out, inp // MXFP4_GROUP))}
    if spec.scheme != "int" or spec.bits not in BITS:
        raise NotStorable(f"MLX affine stores {', '.join(map(str, BITS))}-bit integer codes, not {spec.name}")
    if spec.group_size not in GROUPS or inp % spec.group_size:
        raise NotStorable(f"MLX affine takes groups of 32, 64 or 128 inputs that divide {inp}, not {spec.group_size}")
    if g_idx:
        raise NotStorable("MLX stores no g_idx")
    code = scale_dtype or spec.scale_dtype
    groups = inp // spec.group_size
    return {"weight": ("U32", (out, inp * spec.bits // 32)), "scales": (code, (out, groups)),
            "biases": (code, (out, groups))}


def writer_config(ctx) -> dict:
    """mlx-lm's quantization dict: the most common (bits, group_size) as the defaults, mode affine, and
    each module that differs under its own path (a stacked expert's: its switch_mlp module's)."""
    settings = {(stacked_name(n) or (n, 0))[0]: (spec.bits, spec.group_size, MXFP4 if spec.scheme == "e2m1" else AFFINE)
                for n, spec in ctx.specs.items()}
    if not settings:
        raise NotStorable("no quantized module")
    counts: dict = {}
    for key in settings.values():
        counts[key] = counts.get(key, 0) + 1
    default = max(sorted(counts), key=lambda k: counts[k])
    cfg = {"group_size": default[1], "bits": default[0], "mode": default[2]}
    for name, key in settings.items():
        if key != default:
            cfg[name] = {"group_size": key[1], "bits": key[0], "mode": key[2]}
    return cfg


def fit(m, src, request, negotiate):
    """MXFP4 sources (e2m1 in groups of 32 under power-of-two scales alone: compressed-tensors', gpt-oss',
    GGUF's) keep their codes and scales in mode mxfp4, unless --bits or --group-size asks for affine codes;
    every other module: None, the caps negotiation (integer codes kept, or requantized)."""
    from ..core.minifloat import E2M1_BOOK

    if getattr(request, "bits", None) or getattr(request, "group_size", None) is not None:
        return None
    if src.scheme == "e2m1" and src.group_size == MXFP4_GROUP and getattr(src, "global_scale", None) is None \
            and src.scale_dtype in ("U8", "F8_E8M0"):
        from ..core.ir import QuantSpec

        return QuantSpec("e2m1", 4, MXFP4_GROUP, True, codebook=E2M1_BOOK, scale_dtype="U8"), None
    return None


def model_config(config: dict) -> dict:
    """The model config as mlx-lm reads it: ``quantization`` beside an identical ``quantization_config``;
    rope_theta at the top level (mlx-lm's Llama ignores transformers 5's nested ``rope_parameters`` and
    defaults to 10000); num_experts for Qwen MoE models. Applied to a VLM's text_config too."""
    config = dict(config)
    config["quantization"] = dict(config["quantization_config"])
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        rope = cfg.get("rope_parameters")
        if isinstance(rope, Mapping) and "rope_theta" not in cfg and isinstance(rope.get("rope_theta"), (int, float)):
            cfg["rope_theta"] = rope["rope_theta"]
        if "num_experts" not in cfg:
            for key in ("num_local_experts", "n_routed_experts"):
                if _int(cfg.get(key)):
                    cfg["num_experts"] = cfg[key]
    return config


def share(settings: Mapping) -> dict:
    """One scale dtype for the experts stacked into one switch_mlp tensor: float32 where any needs it."""
    out = {name: dict(v) for name, v in settings.items()}
    stacks: dict = {}
    for name in out:
        key = stacked_name(name)
        if key is not None:
            stacks.setdefault(key[0], []).append(name)
    for names in stacks.values():
        codes = {out[n].get("scale_dtype") for n in names}
        if len(codes) > 1:
            for n in names:
                out[n]["scale_dtype"] = "F32"
    return out


def arrange(outputs: Mapping) -> dict:
    """The output tensors as mlx-lm loads them: each per-expert Linear's weight / scales / biases
    (``<block>.experts.<e>.<proj>.<leaf>``) stacked into ``<block>.switch_mlp.<proj>.<leaf>`` [E, ...]
    (SwitchLinear; mlx-lm's sanitize stacks only float weights of most models), its bytes the experts'
    in order, each expert encoded when its turn comes. Every other tensor as it is. Raises ValueError
    where the experts of one stack are not 0..E-1 of one dtype and shape."""
    from dataclasses import replace

    out, stacks = {}, {}
    for name, t in outputs.items():
        module, _, leaf = name.rpartition(".")
        key = stacked_name(module) if leaf in ("weight", "scales", "biases") else None
        if key is None:
            out[name] = t
        else:
            stacks.setdefault(f"{key[0]}.{leaf}", {})[key[1]] = t
    for name, parts in stacks.items():
        if sorted(parts) != list(range(len(parts))):
            raise NotStorable(f"{name}: experts {sorted(parts)} are not 0..{len(parts) - 1}")
        ordered = [parts[e] for e in range(len(parts))]
        if len({(t.dtype, tuple(t.shape)) for t in ordered}) != 1:
            raise NotStorable(f"{name}: its experts differ in dtype or shape, so they cannot be stacked")
        out[name] = replace(ordered[0], name=name, shape=(len(ordered), *ordered[0].shape),
                            chunks=lambda ts=tuple(ordered): (c for t in ts for c in t.chunks()))
    return out
