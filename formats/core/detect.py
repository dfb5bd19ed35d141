"""Which method a component uses and which modules are quantized: from its configs and tensor
headers. Shared by `inspect` (which reports it) and the readers (which decode it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from collections.abc import Mapping as MappingABC, Set

from ..storage.checkpoint import Component
from ..storage.safetensors_header import TensorInfo
from .layout import QuantModule, natural_key
from .registry import decoded_config_methods, dialects, families, family


class _MethodNames(MappingABC):
    """Report names: a family's method, "unquantized" for None, and any other config method its own name
    (auto-round, compressed-tensors), read from the registry when asked: the families register themselves."""
    def _table(self) -> dict:
        return {**{f.name: f.method for f in families()}, None: "unquantized"}

    def __getitem__(self, key):
        table = self._table()
        return table[key] if key in table else str(key)

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())


class _DecodedMethods(Set):
    """Config methods qconv reads (registry.decoded_config_methods), when asked."""
    def __contains__(self, item):
        return item in decoded_config_methods()

    def __iter__(self):
        return iter(decoded_config_methods())

    def __len__(self):
        return len(decoded_config_methods())


METHOD_NAMES = _MethodNames()
DECODED_METHODS = _DecodedMethods()

# Leaves only quantization writes: packed codes and their state, in bitsandbytes, GPTQ / AWQ,
# compressed-tensors and fp8 checkpoints. One that no decoded module claims is data no writer can
# account for; so is an integer Linear weight, which no float checkpoint stores.
QUANT_LEAVES = (".qweight", ".qzeros", ".g_idx", ".SCB", ".CB", ".weight_format", ".weight.absmax",
                ".weight.quant_map", ".weight.nested_absmax", ".weight.nested_quant_map",
                ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx",
                ".weight_scale_inv", ".weight_global_scale", "_scale_inv")
INTEGER_DTYPES = frozenset({"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"})
# FP8 values are quantized data wherever they are (an e4m3 weight, fused e4m3 experts, e8m0 scales).
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F8_E8M0"})


@dataclass(frozen=True)
class Detection:
    qc: dict | None                  # the quantization config in force
    qc_source: str | None            # the file it came from
    cfg_method: str | None           # "bnb8", "bnb4", "gptq", "auto-round", or another quant_method
    method: str                      # report name ("bitsandbytes LLM.int8", "GPTQ", "unquantized", ...)
    modules: tuple[QuantModule, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)
    unaccounted: tuple[str, ...] = ()    # quantization tensors no module claims (unaccounted_tensors)

    @property
    def state_tensors(self) -> set[str]:
        return {t for m in self.modules for t in m.state_tensors}

    @property
    def claimed_tensors(self) -> set[str]:
        return self.state_tensors | {t for m in self.modules for t in m.weight_tensors}


def config_method(qc: Mapping | None) -> str | None:
    if not qc:
        return None
    method = qc.get("quant_method")
    for dialect in dialects():                   # a dialect's own spelling (bitsandbytes: bnb8 / bnb4)
        resolved = dialect.resolve(method, qc)
        if resolved is not None:
            return resolved
    if method is None:                           # a bare config a dialect recognises (ModelOpt's, MLX's; a
        for dialect in sorted(dialects(), key=lambda d: d.bare_last):   # loose check such as GPTQ's last)
            if dialect.bare(qc):
                return dialect.name
    return str(method)


def unaccounted_tensors(tensors: Mapping[str, TensorInfo], claimed: set[str],
                        leaves: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Tensors that hold quantized data (QUANT_LEAVES and LEAVES, the state leaves of the families that
    read this checkpoint; a bitsandbytes quant_state, an integer weight matrix) but belong to no decoded
    module, in natural order."""
    leaves = QUANT_LEAVES + tuple(leaves)
    return tuple(sorted((n for n, info in tensors.items() if n not in claimed and (
        n.endswith(leaves) or ".weight.quant_state." in n or info.dtype in FP8_DTYPES
        or (n.endswith(".weight") and len(info.shape) == 2 and info.dtype in INTEGER_DTYPES))),
        key=natural_key))


# The model config keys loaders read a quantization from: transformers' quantization_config, and mlx-lm's
# quantization (which mlx-lm reads first). A writer drops both before writing its own (or none).
QUANT_CONFIG_KEYS = ("quantization_config", "quantization")


def without_quantization(config: Mapping) -> dict:
    """The model config with no quantization any loader would read (QUANT_CONFIG_KEYS)."""
    return {k: v for k, v in config.items() if k not in QUANT_CONFIG_KEYS}


def quant_config(comp: Component, warnings: list[str]) -> tuple[dict | None, str | None]:
    qc = (comp.config or {}).get("quantization_config")
    own = (comp.config or {}).get("quantization")
    if isinstance(own, dict) and any(d.bare(own) for d in dialects()):
        # mlx-lm's own key, which it reads first (older mlx-lm writes only this one); its mirror in
        # quantization_config is no loader's, so where the two differ, what differs is said
        if qc and qc != own:
            key = next((k for k in sorted({*own, *qc}, key=str) if own.get(k) != qc.get(k)), None)
            warnings.append(f"config.json's quantization_config.{key} is {qc.get(key)!r} but its quantization."
                            f"{key} is {own.get(key)!r}; mlx-lm reads quantization, and so does qconv")
        qc = own
    if qc:
        for name, side in comp.side_configs.items():
            for key in ("bits", "group_size", "sym", "desc_act"):
                if key in side and key in qc and side[key] != qc[key]:
                    warnings.append(f"{name} says {key}={side[key]!r} but config.json says "
                                    f"{qc[key]!r}; loaders read config.json")
        return dict(qc), "config.json"
    for name, side in comp.side_configs.items():
        return dict(side), name
    return None, None


def detect(comp: Component) -> Detection:
    warnings: list[str] = []
    tensors = comp.tensors
    qc, qc_source = quant_config(comp, warnings)
    cfg_method = config_method(qc)

    claiming = [f for f in families() if f.claims(cfg_method, qc)]
    modules = [m for f in claiming for m in f.find_modules(tensors, qc)]
    modules.sort(key=lambda m: natural_key(m.name))
    unaccounted = unaccounted_tensors(
        tensors, {t for m in modules for t in m.weight_tensors + m.state_tensors},
        tuple(leaf for f in claiming for leaf in f.state_leaves))
    if cfg_method not in DECODED_METHODS and unaccounted:
        warnings.append(f"quant_method {cfg_method!r} is not a format qconv decodes; its packed "
                        f"tensors are listed as stored, not as quantized modules")

    # A config method a dialect reports under its own name (auto-round: one config language over GPTQ's
    # and AWQ's packings) names the modules of the families that decode it.
    own = {name for d in dialects() for name in d.reported_as_itself}
    found = {(cfg_method if cfg_method in own and cfg_method in family(m.family).config_methods else m.family)
             for m in modules}
    if len(found) > 1:
        method = "mixed: " + ", ".join(METHOD_NAMES[f] for f in sorted(found))
        warnings.append(f"modules of several methods in one checkpoint ({method[7:]}); no loader "
                        f"reads that")
    elif found:
        method = METHOD_NAMES[found.pop()]
    elif cfg_method in DECODED_METHODS:
        method = "unquantized"
    else:
        method = cfg_method  # a method qconv does not decode (fp8, ...)
    return Detection(qc, qc_source, cfg_method, method, tuple(modules), tuple(warnings), unaccounted)
