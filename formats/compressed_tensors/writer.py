"""What compressed-tensors' integer targets write (stdlib, predicted before any data): the leaves of a
pack-quantized or int-quantized module and llm-compressor's quantization_config, and the registry's writer
hooks of targets compressed-tensors and compressed-tensors-w8a8 (codec.encode stores the data).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Mapping

from ...errors import NotStorable
from ..core.layout import natural_key
from .config import INT, LAYOUT_VERSION, PACKED, QUANT_METHOD, READABLE_FORMATS

if TYPE_CHECKING:                    # numpy-backed; only read by attribute here
    from ..core.ir import QuantSpec


# ---------------------------------------------------------------------------------------------
# What a writer stores

def _groups(group_size: int, inp: int) -> int:
    return 1 if group_size <= 0 else -(-inp // group_size)


def leaves(spec: "QuantSpec", shape: tuple[int, int], fmt: str = PACKED, *, scale_dtype: str | None = None,
           g_idx: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Leaf name -> (safetensors dtype, shape) of what compressed_tensors.codec.encode stores for a ``spec`` weight of
    ``shape`` [out, in] in ``fmt``, predicted before any data exists."""
    if fmt not in READABLE_FORMATS:
        raise NotStorable(f"compressed-tensors format {fmt!r} is not one qconv writes "
                         f"({', '.join(READABLE_FORMATS)})")
    if spec.scheme != "int" or not 1 <= spec.bits <= 8:
        raise NotStorable(f"compressed-tensors stores 1- to 8-bit integer codes, not {spec.name}")
    out, inp = shape
    bits = spec.bits
    g = _groups(spec.group_size, inp)
    sdt = scale_dtype or spec.scale_dtype
    if fmt == PACKED:
        res = {"weight_packed": ("I32", (out, math.ceil(inp * bits / 32))),
               "weight_scale": (sdt, (out, g)),
               "weight_shape": ("I64", (2,))}
        if not spec.symmetric:
            res["weight_zero_point"] = ("I32", (math.ceil(out * bits / 32), g))
    else:
        res = {"weight": ("I8", (out, inp)), "weight_scale": (sdt, (out, g))}
        if not spec.symmetric:
            res["weight_zero_point"] = ("I8", (out, g))
    if g_idx:
        res["weight_g_idx"] = ("I32", (inp,))
    return res


# ---------------------------------------------------------------------------------------------
# The quantization_config a writer emits

def _args(spec: "QuantSpec") -> dict:
    channel = spec.group_size <= 0
    return {"actorder": None, "block_structure": None, "dynamic": False,
            "group_size": None if channel else int(spec.group_size), "num_bits": int(spec.bits),
            "observer": None, "observer_kwargs": {}, "scale_dtype": None,
            "strategy": "channel" if channel else "group", "symmetric": bool(spec.symmetric),
            "type": "int", "zp_dtype": None if spec.symmetric else "torch.int8"}


# W8A8's activations: 8-bit int, symmetric, per token, computed at run time (nothing stored).
INPUT_ACTIVATIONS_INT8_TOKEN = {"actorder": None, "block_structure": None, "dynamic": True,
                                "group_size": None, "num_bits": 8, "observer": None,
                                "observer_kwargs": {}, "scale_dtype": None, "strategy": "token",
                                "symmetric": True, "type": "int", "zp_dtype": None}


def config_for(specs_by_module: Mapping[str, "QuantSpec"], ignore: Iterable[str] = ("lm_head",),
               fmt: str = PACKED, *, class_targets: bool = False, version: str = LAYOUT_VERSION) -> dict:
    """The ``quantization_config`` for a compressed-tensors checkpoint holding ``specs_by_module``
    (module name -> QuantSpec), with llm-compressor's field set (update_config / QuantizationArgs).

    One config group per distinct (bits, group size, symmetric), named group_0, group_1, ... in the
    modules' natural order; targets are the exact module names, or ``["Linear"]`` with
    ``class_targets=True`` when there is one group and every other Linear is in ``ignore``.
    ``fmt`` "int-quantized" adds W8A8's dynamic per-token int8 ``input_activations``. ``version`` is
    the compressed-tensors release whose layout compressed_tensors.codec.encode writes (dense sub-byte packing).
    """
    if fmt not in READABLE_FORMATS:
        raise NotStorable(f"compressed-tensors format {fmt!r} is not one qconv writes "
                         f"({', '.join(READABLE_FORMATS)})")
    by_key: dict[tuple, list[str]] = {}
    for name in sorted(specs_by_module, key=natural_key):
        spec = specs_by_module[name]
        if spec.scheme != "int" or not 1 <= spec.bits <= 8:
            raise NotStorable(f"{name}: compressed-tensors stores 1- to 8-bit integer codes, not {spec.name}")
        if spec.scale_divisor != 1:
            raise NotStorable(f"{name}: compressed-tensors scales are plain multipliers (scale_divisor 1)")
        key = (int(spec.bits), int(spec.group_size) if spec.group_size > 0 else -1, bool(spec.symmetric))
        by_key.setdefault(key, []).append(name)
    if class_targets and len(by_key) > 1:
        raise NotStorable("a 'Linear' class target needs one config group; these modules need "
                         f"{len(by_key)}")
    groups = {}
    for i, names in enumerate(by_key.values()):
        group = {"format": fmt,
                 "input_activations": dict(INPUT_ACTIVATIONS_INT8_TOKEN) if fmt == INT else None,
                 "output_activations": None,
                 "targets": ["Linear"] if class_targets else list(names),
                 "weights": _args(specs_by_module[names[0]])}
        groups[f"group_{i}"] = group
    return {"config_groups": groups, "format": fmt, "global_compression_ratio": None,
            "ignore": list(ignore), "kv_cache_scheme": None, "quant_method": QUANT_METHOD,
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": version}


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks (targets compressed-tensors and compressed-tensors-w8a8)

def writer_leaves(fmt: str):
    def target_leaves(spec, shape, g_idx: bool):
        return leaves(spec, shape, fmt, g_idx=g_idx)
    return target_leaves


def _ignorable(name: str) -> bool:
    """An unquantized 2-D weight that is an nn.Linear in transformers' models (embeddings are not)."""
    return "embed" not in name.rsplit(".", 1)[-1]


def writer_config(fmt: str):
    """llm-compressor's config: one group targeting the class "Linear" with every unquantized Linear
    in ``ignore`` (by exact name), or, for several (bits, group, sym), one group per spec targeting
    exact names."""
    def config(ctx) -> dict:
        ignore = sorted((n for n in ctx.unquantized if _ignorable(n)), key=natural_key)
        distinct = {(s.bits, s.group_size if s.group_size > 0 else -1, s.symmetric) for s in ctx.specs.values()}
        return config_for(ctx.specs, ignore=ignore, fmt=fmt, class_targets=len(distinct) == 1)
    return config
