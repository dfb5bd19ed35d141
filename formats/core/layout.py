"""What a quantized module looks like on disk, described from headers alone.

Each format module (``bnb``, ``gptq``) turns the tensors of a checkpoint into ``QuantModule``
records: which tensors hold the weight codes, which hold quantization state (scales, zero points,
absmax, ...), the logical ``[out, in]`` shape and the scheme. Inspection, and later reading and
writing, start from these records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from ...errors import NotStorable

# Scheme names used in reports: int<bits> for integer codes (bnb int8 and GPTQ 8-bit are both int8),
# nf4 / fp4 for bitsandbytes' 4-bit code books.
def int_scheme(bits: int) -> str:
    return f"int{bits}"


# Siblings that vLLM fuses into one GEMM (q/k/v, gate/up, DeepSeek's q_a / kv_a, Mixtral's w1 / w3), which
# share one NVFP4 global scale: llm-compressor makes theirs one (observers/helpers.py FUSED_LAYER_NAMES),
# ModelOpt shares weight_scale_2 and input_scale across them, and vLLM takes one value for the fused layer.
FUSED_LAYER_NAMES = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"),
                     ("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"))


NVFP4_GROUP = 16          # inputs per e4m3 scale, in every NVFP4 dialect


def check_nvfp4_shape(spec, shape: tuple[int, int], g_idx: bool, dialect: str, global_scale: str) -> None:
    """What every NVFP4 writer's leaves require of a module (ValueError otherwise): e2m1 codes in groups
    of 16 under a global scale of the dialect's kind ("divisor" or "multiplier"), whole groups, no g_idx."""
    if spec.scheme != "e2m1" or spec.group_size != NVFP4_GROUP or spec.global_scale != global_scale:
        raise NotStorable(f"{dialect} NVFP4 stores e2m1 codes in groups of {NVFP4_GROUP} under a global "
                         f"{global_scale}, not {spec.name} in groups of {spec.group_size}")
    if g_idx:
        raise NotStorable(f"{dialect} NVFP4 stores no g_idx")
    if shape[1] % NVFP4_GROUP:
        raise NotStorable(f"{shape[1]} input features are not a whole number of NVFP4 groups of {NVFP4_GROUP}")


def fused_group(name: str) -> str:
    """The key modules sharing one NVFP4 global scale have in common: their parent and their group
    (the module's own name where it is in none)."""
    parent, _, leaf = name.rpartition(".")
    for i, group in enumerate(FUSED_LAYER_NAMES):
        if leaf in group:
            return f"{parent}.<fused {i}>"
    return name


# The family of a float model's Linears, which data-free conversion quantizes (formats/unquantized/).
UNQUANTIZED = "unquantized"


@dataclass(frozen=True)
class QuantModule:
    name: str
    family: str                      # "bnb8", "bnb4", "gptq"
    scheme: str                      # "int8", "nf4", "fp4", "int4", ...
    bits: int
    out_features: int
    in_features: int
    weight_tensors: tuple[str, ...]  # stored codes: counted as parameters
    state_tensors: tuple[str, ...]   # quantization state: scales, zeros, absmax, g_idx, ...
    group_size: int | None = None    # GPTQ group (-1: one group per output channel); bnb4 blocksize
    details: Mapping = field(default_factory=dict)   # the family's; every e4m3 / e2m1 module (core/minifloat.py
                                     # BOOKS) has "scales_dtype", "block_rows" (rows sharing a scale: 1 per
                                     # channel, 0 per tensor; absent: 1) and, with two-level scales (NVFP4),
                                     # "global_scale" ("divisor" | "multiplier"; QuantSpec.global_scale)
    problems: tuple[str, ...] = ()
    # Fused MoE experts (transformers 5's experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I], gpt-oss):
    # one module for the stored 3-D tensor, named as it (no ".weight"), its E experts' rows stacked, so
    # out_features = E * rows of one expert and every row window is plain; 0: an ordinary Linear.
    experts: int = 0

    @property
    def logical_parameters(self) -> int:
        return self.out_features * self.in_features

    @property
    def float_name(self) -> str:
        """The float tensor this module dequantizes to, in the source's own layout."""
        return self.name if self.experts else self.name + ".weight"

    @property
    def float_shape(self) -> tuple[int, ...]:
        if self.experts:
            return (self.experts, self.out_features // self.experts, self.in_features)
        return (self.out_features, self.in_features)

    def file(self, tensors: Mapping):
        """The file holding the module's weight (else its first state tensor), for messages: a module
        whose weight is missing is still named with the file that holds the rest of it."""
        for name in self.weight_tensors + self.state_tensors:
            if name in tensors:
                return tensors[name].file
        return None


def refuse_problems(m: QuantModule, tensors: Mapping, qc: Mapping | None = None) -> None:
    """A family's check for modules whose find lists every problem (fine-grained FP8, ModelOpt, gpt-oss
    MXFP4): the first, as UnsupportedFormat where details["unsupported"] lists it (a layout or width
    qconv does not decode), else CorruptCheckpoint, naming the file and the module's weight."""
    if not m.problems:
        return
    from ...errors import CorruptCheckpoint, UnsupportedFormat

    first = m.problems[0]
    cls = UnsupportedFormat if first in m.details.get("unsupported", ()) else CorruptCheckpoint
    raise cls(first + "; cannot decode it", file=m.file(tensors), tensor=m.weight_tensors[0])


_NUM = re.compile(r"(\d+)")


def natural_key(name: str):
    """Sort key that orders layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in _NUM.split(name)]


def module_of(tensor_name: str) -> str:
    return tensor_name.rpartition(".")[0]


MAX_EXAMPLES = 3


def examples(names) -> str:
    """A few names in natural order, for a warning: 'a, b, c, ... (12 in all)'."""
    names = sorted(names, key=natural_key)
    more = f", ... ({len(names)} in all)" if len(names) > MAX_EXAMPLES else ""
    return ", ".join(names[:MAX_EXAMPLES]) + more


def common(values):
    """The one value all share (None ignored), else the sorted distinct values, else None."""
    values = {v for v in values if v is not None}
    return values.pop() if len(values) == 1 else (sorted(values) if values else None)


def not_converted_list(skip, problems: list[str]) -> list[str]:
    """A config's modules_to_not_convert as read: its module names, [] when absent (None); anything but a
    list of names is appended to ``problems`` and read as []."""
    if skip is None:
        return []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        problems.append(f"modules_to_not_convert is {skip!r}, expected a list of module names")
        return []
    return list(skip)


def not_converted_by(name: str, patterns) -> str | None:
    """The modules_to_not_convert entry that keeps ``name`` unquantized in some loader, if any: vLLM
    matches by substring (``quant_utils.is_layer_skipped``); transformers by prefix up to a module
    boundary, by regex with that boundary, or by suffix (``quantizers_utils.should_convert_module``)."""
    for key in patterns:
        if key and key in name:
            return key
        try:
            if re.match(rf"(?:{key})(?:(?<=\.)|(?=\.|$))", name):
                return key
        except re.error:
            pass
    return None


def block_prefix(name: str) -> str | None:
    """model.layers.3.mlp.up_proj -> model.layers (the stack a module sits in), None outside stacks."""
    match = re.match(r"^(.*?)\.\d+\.", name)
    return match.group(1) if match else None


# Report text (inspect's tables, a container's own report)

def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
