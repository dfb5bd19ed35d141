"""The format families qconv reads, declared in one place: a new format is one entry here plus its own
modules (a header module, stdlib only, and a codec, numpy), never a branch in detect, reader,
inspection, validation or convert.

A family says:
* which quantization configs it reads (``claims``: a config method, and for auto-round the packing);
* how its modules are recognised from headers and config (``find``), and refused from headers
  (``check``), both stdlib only, so `inspect` imports neither numpy nor torch;
* where its data is decoded (``codec``: a module with ``read(m, tensors, qc, dtype) -> QuantTensor``,
  imported only when data is touched);
* what inspect reports of its settings and lints (``settings``, stdlib only);
* the dtype its scales are stored in (``QuantModule.details["scales_dtype"]``, absent: float32), which
  is what validate's bound needs to know of it.

A lookup by a name that is not registered lists the names that are.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Mapping

from .layout import QuantModule


@dataclass(frozen=True)
class Family:
    name: str                        # QuantModule.family
    method: str                      # report name
    config_methods: frozenset        # config methods (detect.config_method) whose files it decodes
    claims: Callable[[str | None, Mapping | None], bool]   # (config method, qc): look for its modules?
    find: Callable[[Mapping, Mapping | None], list[QuantModule]]
    check: Callable[[QuantModule, Mapping, Mapping | None], None]
    codec: str                       # module (relative to qconv.formats) holding the reader
    settings: Callable | None = None  # (qc or None, its modules) -> inspect's report fields
    reader: str = "read"             # codec function (m, tensors, qc, dtype) -> QuantTensor
    needs_config: bool = True        # its tensors alone do not say how to decode them (packed words)
    symmetric: Callable | None = None  # (m, qc) -> whether its zero points are 2^(b-1), from headers/config

    def read(self, m: QuantModule, tensors: Mapping, qc: Mapping | None, dtype: str):
        return getattr(importlib.import_module(f"{__package__}.{self.codec}"), self.reader)(m, tensors, qc, dtype)


@dataclass(frozen=True)
class Dialect:
    """A quantization_config language (bitsandbytes, GPTQ / auto-round, AWQ, compressed-tensors): what
    inspect checks of a config against the tensors. One dialect can describe several families
    (bitsandbytes: int8 and 4-bit; auto-round: GPTQ and AWQ packings)."""
    name: str
    config_methods: frozenset
    lint: Callable                   # (qc, modules, all_modules, comp, warnings) -> None


_FAMILIES: dict[str, Family] = {}
_DIALECTS: dict[str, Dialect] = {}


def register(entry):
    (_FAMILIES if isinstance(entry, Family) else _DIALECTS)[entry.name] = entry
    return entry


def dialects_for(config_method: str | None) -> tuple[Dialect, ...]:
    return tuple(d for d in _DIALECTS.values() if config_method in d.config_methods)


def _lookup(table: dict, what: str, name: str):
    """table[name]; a miss lists what is registered."""
    if name not in table:
        raise KeyError(f"no {what} {name!r}; registered: {', '.join(sorted(table))}")
    return table[name]


def family(name: str) -> Family:
    return _lookup(_FAMILIES, "format family", name)


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def decoded_config_methods() -> frozenset:
    """Config methods qconv decodes (None: no quantization config)."""
    return frozenset({None}).union(*(f.config_methods for f in _FAMILIES.values()))


def _register_builtin() -> None:
    from . import awq, bnb, compressed_tensors, gptq

    def awq_packed(qc) -> bool:                 # auto-round's AWQ packing (auto_round:auto_awq)
        return bool(qc) and awq.is_auto_round(qc) and gptq.normalise_packing_format(qc) == awq.AUTO_ROUND_AWQ

    def lazy_check(codec: str, fn: str):
        def check(m, tensors, qc):
            getattr(importlib.import_module(f"{__package__}.{codec}"), fn)(m, tensors, qc)
        return check

    always = lambda method, qc: True          # noqa: E731 - bitsandbytes' tensor names are its own
    register(Family("bnb8", "bitsandbytes LLM.int8", frozenset({"bnb8", "bitsandbytes"}), always,
                    lambda tensors, qc: bnb.find_int8_modules(tensors),
                    lazy_check("bnb_codec", "check_int8_module"), "bnb_codec", bnb.int8_settings,
                    "read_int8_module", needs_config=False))
    register(Family("bnb4", "bitsandbytes 4-bit", frozenset({"bnb4", "bitsandbytes"}), always,
                    lambda tensors, qc: bnb.find_4bit_modules(tensors),
                    lazy_check("bnb_codec", "check_4bit_module"), "bnb_codec", bnb.four_bit_settings,
                    "read_4bit_module", needs_config=False))
    register(Family("gptq", "GPTQ", frozenset({"gptq", "auto-round"}),
                    lambda method, qc: method in (None, "gptq") or (method == "auto-round"
                                                                    and not awq_packed(qc)),
                    gptq.find_in_checkpoint, lazy_check("gptq_codec", "check"), "gptq_codec",
                    gptq.settings, symmetric=lambda m, qc: bool((gptq.per_module_settings(qc, m.name) or {}).get(
                        "sym", True)) if qc else True))
    register(Family("awq", "AWQ", frozenset({"awq", "auto-round"}),
                    lambda method, qc: method == "awq" or (method == "auto-round" and awq_packed(qc)),
                    awq.find_modules, awq.check, "awq_codec", awq.settings,
                    symmetric=lambda m, qc: not m.details.get("zero_point", True)))
    register(Family("ct", "compressed-tensors", frozenset({"compressed-tensors"}),
                    lambda method, qc: method == "compressed-tensors",
                    compressed_tensors.find_modules, compressed_tensors.check, "ct_codec",
                    compressed_tensors.settings,
                    symmetric=lambda m, qc: bool(m.details.get("symmetric", True))))
    register(Dialect("bitsandbytes", frozenset({"bnb8", "bnb4", "bitsandbytes"}), bnb.lint))
    register(Dialect("gptq", frozenset({"gptq", "auto-round"}), gptq.lint))
    register(Dialect("awq", frozenset({"awq"}), awq.lint))
    register(Dialect("compressed-tensors", frozenset({"compressed-tensors"}), compressed_tensors.lint))


_register_builtin()


# ---------------------------------------------------------------------------------------------
# Writers of integer-coded formats (`qconv convert --to NAME`)

@dataclass(frozen=True)
class Caps:
    """What a target stores without touching codes: the one description spec negotiation
    (convert._target_spec) fits every source module to."""
    bits: frozenset                  # code widths it stores
    asym: bool = True                # zero points other than 2^(b-1)
    per_row: bool = True             # one group per output row (group size -1)
    grouped: bool = True             # groups along in
    act_order: bool = False          # a non-trivial g_idx
    scale_dtypes: frozenset = frozenset({"F16", "BF16", "F32"})
    divisor_scale: str = "F16"       # scale dtype for SCB / 127 (a bitsandbytes int8 source)
    fallback_bits: int | None = None  # width a module gets when its own is not storable (None: refuse)
    asym_refusal: str | None = None  # asym not storable: refuse with this (None: requantize symmetric)
    one_group_size: bool = False     # its config holds one group size for every module


@dataclass(frozen=True)
class WriteContext:
    """What a target's quantization_config is written from."""
    specs: Mapping                   # module -> QuantSpec, as written
    unquantized: tuple               # float Linear modules left unquantized
    act_order: bool                  # some module keeps its act-order g_idx
    source_qc: Mapping | None


@dataclass(frozen=True)
class Target:
    name: str                        # the --to name
    family: str                      # the family that reads what it writes
    caps: Caps
    leaves: Callable                 # (spec, (out, in), g_idx: bool) -> {leaf: (dtype, shape)}; stdlib
    config: Callable                 # (WriteContext) -> quantization_config; stdlib
    codec: str                       # module holding encode_for(name, qt, spec, g_idx) -> {leaf: (dtype, array)}
    g_idx: str = "never"             # "always" (GPTQ's writers), "act-order" (only a kept act-order), "never"
    activations: str | None = None   # what its kernels do to activations at run time (convert reports the cost)

    def encode(self, qt, spec, g_idx: bool) -> dict:
        return importlib.import_module(f"{__package__}.{self.codec}").encode_for(self.name, qt, spec, g_idx)


_TARGETS: dict[str, Target] = {}


def register_target(entry: Target) -> Target:
    _TARGETS[entry.name] = entry
    return entry


def target(name: str) -> Target:
    return _lookup(_TARGETS, "target", name)


def targets() -> tuple[Target, ...]:
    return tuple(_TARGETS.values())


def _register_targets() -> None:
    from . import awq, compressed_tensors, gptq

    int_2_8 = frozenset(range(2, 9))
    for name in ("gptq", "gptq-v2", "auto-round"):
        auto_round = name == "auto-round"
        caps = Caps(int_2_8, asym=not auto_round, act_order=not auto_round, asym_refusal=(
            "auto-round stores asymmetric integers as auto_round:auto_awq, a layout qconv does not write "
            "yet (its auto_gptq packing is loaded as symmetric); use --sym, --to gptq-v2 or --to awq")
            if auto_round else None)
        register_target(Target(name, "gptq", caps, gptq.leaves, gptq.config_writer(name), "gptq_codec",
                               g_idx="never" if auto_round else "always"))
    register_target(Target("compressed-tensors", "ct", Caps(int_2_8, divisor_scale="F32"),
                           compressed_tensors.writer_leaves(compressed_tensors.PACKED),
                           compressed_tensors.writer_config(compressed_tensors.PACKED), "ct_codec"))
    register_target(Target("compressed-tensors-w8a8", "ct",
                           Caps(frozenset({8}), asym=False, grouped=False, divisor_scale="F32", fallback_bits=8),
                           compressed_tensors.writer_leaves(compressed_tensors.INT),
                           compressed_tensors.writer_config(compressed_tensors.INT), "ct_codec",
                           activations="int8 per token, dynamic"))
    register_target(Target("awq", "awq", Caps(frozenset({4}), per_row=False, scale_dtypes=frozenset({"F16", "BF16"}),
                                              fallback_bits=4, one_group_size=True),
                           awq.writer_leaves, awq.writer_config, "awq_codec"))


_register_targets()
