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
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from .layout import QuantModule

_FORMATS = __package__.rsplit(".", 1)[0]   # qconv.formats: codec names are relative to it


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
    rows: int | str = 32             # a row window's ends: multiples of this (or a codec function of m)
    scale_tensor: str | None = None  # its modules' scale tensor (m.name + this), read alone where the
                                     # data decides a target's scale dtype (convert._kept_scale_dtype)
    # (m, tensors, qc) -> QuantSpec | FloatSpec: a module's spec where the headers alone do not say it
    # (MLX: integer zero points, or none, decided from its scales and biases); a codec function name.
    # None: convert derives it from the module's headers.
    source_spec: str | None = None

    def read(self, m: QuantModule, tensors: Mapping, qc: Mapping | None, dtype: str,
             rows: tuple[int, int] | None = None):
        """The module, or only its output rows r0:r1 (ends on multiples of row_step(m), or the last
        row), as a QuantTensor: the reader reads only those rows' bytes, so a caller holding one window
        at a time holds a bounded part of any layer."""
        fn = getattr(importlib.import_module(f"{_FORMATS}.{self.codec}"), self.reader)
        return fn(m, tensors, qc, dtype) if rows is None else fn(m, tensors, qc, dtype, rows)

    def spec(self, m: QuantModule, tensors: Mapping, qc: Mapping | None):
        """The module's spec from its family's own rule (source_spec), else None."""
        if self.source_spec is None:
            return None
        return getattr(importlib.import_module(f"{_FORMATS}.{self.codec}"), self.source_spec)(m, tensors, qc)

    def row_step(self, m: QuantModule) -> int:
        if isinstance(self.rows, int):
            return self.rows
        return getattr(importlib.import_module(f"{_FORMATS}.{self.codec}"), self.rows)(m)


@dataclass(frozen=True)
class Dialect:
    """A quantization_config language (bitsandbytes, GPTQ / auto-round, AWQ, compressed-tensors): what
    inspect checks of a config against the tensors. One dialect can describe several families
    (bitsandbytes: int8 and 4-bit; auto-round: GPTQ and AWQ packings)."""
    name: str
    config_methods: frozenset
    lint: Callable                   # (qc, modules, all_modules, comp, warnings) -> None
    # (qc) -> (error class, message) for a config under which nothing can be decoded (a block size that
    # is not one, a field of the wrong type), refused naming the config file; None: no such check
    refuse: Callable | None = None
    # (doc) -> whether a stand-alone config without quant_method is this dialect's (ModelOpt's
    # hf_quant_config.json); detect.config_method then names the method config_methods' first
    bare: Callable | None = None


_FAMILIES: dict[str, Family] = {}
_DIALECTS: dict[str, Dialect] = {}


def register(entry):
    (_FAMILIES if isinstance(entry, Family) else _DIALECTS)[entry.name] = entry
    return entry


def dialects() -> tuple[Dialect, ...]:
    return tuple(_DIALECTS.values())


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
    from ..awq import header as awq
    from ..bnb import header as bnb
    from ..compressed_tensors import header as compressed_tensors
    from ..fp8 import header as fp8
    from ..gguf import header as gguf
    from ..gptq import header as gptq
    from ..mlx import header as mlx
    from ..modelopt import header as modelopt
    from ..mxfp4 import header as mxfp4

    def awq_packed(qc) -> bool:                 # auto-round's AWQ packing (auto_round:auto_awq)
        return bool(qc) and awq.is_auto_round(qc) and gptq.normalise_packing_format(qc) == awq.AUTO_ROUND_AWQ

    def lazy_check(codec: str, fn: str):
        def check(m, tensors, qc):
            getattr(importlib.import_module(f"{_FORMATS}.{codec}"), fn)(m, tensors, qc)
        return check

    always = lambda method, qc: True          # noqa: E731 - bitsandbytes' tensor names are its own
    register(Family("bnb8", "bitsandbytes LLM.int8", frozenset({"bnb8", "bitsandbytes"}), always,
                    lambda tensors, qc: bnb.find_int8_modules(tensors),
                    lazy_check("bnb.codec", "check_int8_module"), "bnb.codec", bnb.int8_settings,
                    "read_int8_module", needs_config=False, rows=1, scale_tensor=".SCB"))
    register(Family("bnb4", "bitsandbytes 4-bit", frozenset({"bnb4", "bitsandbytes"}), always,
                    lambda tensors, qc: bnb.find_4bit_modules(tensors),
                    lazy_check("bnb.codec", "check_4bit_module"), "bnb.codec", bnb.four_bit_settings,
                    "read_4bit_module", needs_config=False, rows="four_bit_row_step"))
    register(Family("gptq", "GPTQ", frozenset({"gptq", "auto-round"}),
                    lambda method, qc: method in (None, "gptq") or (method == "auto-round"
                                                                    and not awq_packed(qc)),
                    gptq.find_in_checkpoint, lazy_check("gptq.codec", "check"), "gptq.codec",
                    gptq.settings, scale_tensor=".scales", symmetric=lambda m, qc: bool((gptq.per_module_settings(qc, m.name) or {}).get(
                        "sym", True)) if qc else True))
    register(Family("awq", "AWQ", frozenset({"awq", "auto-round"}),
                    lambda method, qc: method == "awq" or (method == "auto-round" and awq_packed(qc)),
                    awq.find_modules, awq.check, "awq.codec", awq.settings, scale_tensor=".scales",
                    symmetric=lambda m, qc: not m.details.get("zero_point", True)))
    register(Family("ct", "compressed-tensors", frozenset({"compressed-tensors"}),
                    lambda method, qc: method == "compressed-tensors",
                    compressed_tensors.find_modules, compressed_tensors.check, "compressed_tensors.codec",
                    compressed_tensors.settings, scale_tensor=".weight_scale",
                    symmetric=lambda m, qc: bool(m.details.get("symmetric", True))))
    register(Family("fp8", "fine-grained FP8", frozenset({"fp8"}), lambda method, qc: method == "fp8",
                    fp8.find_modules, fp8.check, "fp8.codec", fp8.settings, scale_tensor=".weight_scale_inv",
                    symmetric=lambda m, qc: True, rows=1))
    register(Family("modelopt", "ModelOpt", frozenset({"modelopt"}), lambda method, qc: method == "modelopt",
                    modelopt.find_modules, modelopt.check, "modelopt.codec", modelopt.settings,
                    scale_tensor=".weight_scale", symmetric=lambda m, qc: True, rows=1))
    # gpt-oss MXFP4: fused 3-D experts (*_blocks / *_scales), one module per fused tensor; mxfp4/.
    register(Family("mxfp4", "gpt-oss MXFP4", frozenset({"mxfp4"}), lambda method, qc: method == "mxfp4",
                    mxfp4.find_modules, mxfp4.check, "mxfp4.codec", mxfp4.settings, scale_tensor="_scales",
                    symmetric=lambda m, qc: True, rows=1))
    # llama.cpp's GGUF opened as a source (gguf/source.py): Q8_0 / Q4_0 / Q5_0 / MXFP4 block tensors; a
    # permuted llama q / k is read whole (codec.row_step)
    register(Family("gguf", "GGUF", frozenset({"gguf"}), lambda method, qc: method == "gguf", gguf.find_modules,
                    gguf.check, "gguf.codec", gguf.settings, symmetric=lambda m, qc: True, rows="row_step"))
    # Apple MLX (mlx-lm): affine codes, scales and biases; its config has no quant_method (Dialect bare)
    register(Family("mlx", "MLX", frozenset({"mlx"}), lambda method, qc: method == "mlx", mlx.find_modules,
                    mlx.check, "mlx.codec", mlx.settings, rows=1, scale_tensor=".scales", source_spec="source_spec",
                    symmetric=lambda m, qc: False))
    register(Dialect("bitsandbytes", frozenset({"bnb8", "bnb4", "bitsandbytes"}), bnb.lint))
    register(Dialect("gptq", frozenset({"gptq", "auto-round"}), gptq.lint))
    register(Dialect("awq", frozenset({"awq"}), awq.lint))
    register(Dialect("compressed-tensors", frozenset({"compressed-tensors"}), compressed_tensors.lint))
    register(Dialect("fp8", frozenset({"fp8"}), fp8.lint, refuse=fp8.refuse))
    register(Dialect("modelopt", frozenset({"modelopt"}), modelopt.lint, bare=modelopt.is_side_config))
    register(Dialect("mxfp4", frozenset({"mxfp4"}), mxfp4.lint, refuse=mxfp4.refuse))
    register(Dialect("gguf", frozenset({"gguf"}), gguf.lint))
    register(Dialect("mlx", frozenset({"mlx"}), mlx.lint, refuse=mlx.refuse, bare=mlx.is_config))


_register_builtin()


# ---------------------------------------------------------------------------------------------
# Writers of quantized formats (`qconv convert --to NAME`)

@dataclass(frozen=True)
class Caps:
    """What a target stores without touching codes: the one description spec negotiation
    (convert._target_spec) fits every source module to. A target with its own fit (Target.fit) fits
    modules itself; its caps still describe it, and act_order and one_group_size are read for it too."""
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
    fused_experts: bool = False      # holds fused 3-D MoE experts (QuantModule.experts) as they are
    tiles_rows: bool = False         # without per_row: a one-group-per-row source keeps its codes, its scale
                                     # and zero point repeated in every group (its retarget tiles them)
    group_sizes: frozenset | None = None  # the only group sizes it stores (None: any that divides in);
                                     # another is requantized to the first of 128, 64, 32 that divides in


@dataclass(frozen=True)
class WriteContext:
    """What a target's quantization_config is written from."""
    specs: Mapping                   # module -> QuantSpec, as written
    unquantized: tuple               # float Linear modules left unquantized
    act_order: bool                  # some module keeps its act-order g_idx
    source_qc: Mapping | None
    settings: Mapping = field(default_factory=dict)  # module -> its write settings (Target.plan; absent: {})
    requantized: frozenset = frozenset()            # modules whose codes were not kept


@dataclass(frozen=True)
class ModuleContext:
    """What a target's per-module planning (Target.plan) sees of one module, before any tensor of the
    component is written."""
    module: QuantModule              # the source module, from headers and config
    spec: object                     # the QuantSpec it is written with (Target.fit, or the caps negotiation)
    reason: str | None               # why it is requantized (None: its codes are kept)
    request: object                  # the conversion's options (convert.Options: to, bits, group_size, sym,
                                     # scale_dtype, blocksize, double_quant, quant_storage)
    dtype: str                       # the weight's original dtype ("float16", ...), as its QuantTensor has it
    encode: Callable                 # (settings) -> {leaf: (dtype, array)}: the module read and encoded with
                                     # these settings, statistics discarded (for a setting only the data decides)
    weights: Callable | None = None  # () -> the module's exact float32 weights [out, in] (a requantized
                                     # module's statistics: NVFP4's absolute maximum)
    tensors: Mapping | None = None   # the source component's tensors (name -> TensorInfo), for a plan that
                                     # reads a module's small state (ModelOpt NVFP4: the per-tensor scales)
    source_spec: object = None       # the module's spec in the source (QuantSpec or FloatSpec: its scale divisor)
    activation: object = None        # the source's static activation scale (core/activation.StaticActivation),
                                     # which a target that holds its scheme carries (None: none)


# convert's options of the integer targets (bits, groups, zero points, scale dtype: Caps negotiates them)
INTEGER_OPTIONS = frozenset({"bits", "group_size", "sym", "scale_dtype"})
BNB4_OPTIONS = frozenset({"bits", "blocksize", "double_quant", "quant_storage"})
FP8_OPTIONS = frozenset({"block_size"})


@dataclass(frozen=True)
class Target:
    """A writer. convert plans every module (fit or the caps negotiation: spec and reason; then plan: its
    settings; then leaves: the tensors and their header entries), writes the config, and only then
    encodes each module's data: requantized from its exact weights (requantize, else convert's integer
    requantizer) or kept and re-expressed (retarget, else scales / divisor in spec.scale_dtype), then
    encode. The hooks below default to None, which is what the integer formats need; a format with its
    own options, code books or header state that depends on the data (bitsandbytes) sets them. Hooks
    that need numpy are given lazily (_lazy), so importing the registry stays stdlib only."""
    name: str                        # the --to name
    family: str                      # the family that reads what it writes
    caps: Caps
    leaves: Callable                 # (spec, (out, in), g_idx: bool, **settings) -> {leaf: (dtype, shape)}; stdlib
                                     # (settings: the module's from plan; their defaults: a plain module)
    config: Callable                 # (WriteContext) -> quantization_config; stdlib
    codec: str                       # module holding encode_for(name, qt, spec, g_idx) -> {leaf: (dtype, array)}
    g_idx: str = "never"             # "always" (GPTQ's writers), "act-order" (only a kept act-order), "never"
    activations: str | None = None   # what its kernels do to activations at run time (convert reports the cost)
    # what its kernels do to activations for which it stores no static scale (a source's that it cannot
    # hold: convert's report says so); None: nothing, its kernels multiply 16-bit activations
    dynamic_activations: str | None = None
    zero_encoding: str | None = None  # what its qzeros hold: "v1" (z - 1), "v2" (z), None (its codec's own)
    packing: Callable | None = None  # ({module: (QuantSpec, (out, in))}) -> name of the target that writes them
    internal: bool = False           # written only when another target's packing picks it; not a --to choice
    # (module, source spec, request, negotiate) -> (QuantSpec, reason | None) or None (this module: the caps
    # negotiation, as for a target without fit): the spec a module is
    # written with and why its codes cannot be kept, for a target whose settings are not bits / groups /
    # zero points (code books, its own options such as --blocksize or --quant-storage); request: as
    # ModuleContext.request; negotiate(caps=None) -> (bits, group, sym, reason) is convert's negotiation
    # of the request against the source (fitted to caps where given; None: unfitted). Refusals raise
    # UsageError / UnsupportedFormat. None: convert fits the module to caps.
    fit: Callable | None = None
    # (ModuleContext) -> settings: what the spec does not say about how one module is written, settled
    # before any tensor is (the header comes first): a dict of keyword arguments of leaves, also given
    # to requantize, retarget and config (WriteContext.settings); it may encode the module once for a
    # value only the data decides (bitsandbytes: the nested double-quant offset, which sizes the
    # quant_state JSON). Refusals raise UnsupportedFormat. None: no settings ({}).
    plan: Callable | None = None
    # ({module: settings}) -> {module: settings}: settings some modules share, settled from every module's
    # plan before any tensor is written (NVFP4: one global scale for the modules a serving engine fuses,
    # q/k/v and gate/up, from their joint maximum). None: each module's plan stands.
    share: Callable | None = None
    # (source, w, spec, settings) -> (qt, rtn): a module whose codes cannot be kept, quantized to spec from
    # its exact weights w (source.dequantize()), with plain round-to-nearest beside it for the report,
    # both QuantTensors in the target's terms. None: convert's integer requantizer (requantize.py).
    requantize: Callable | None = None
    # requantize is row-separable (each row, or each spec.block_rows rows, quantized on its own given the
    # settings): convert calls it on windows of rows and stacks the parts (ir.stack_rows), so a module's
    # exact float32 weight is never held whole. False: it is given the whole weight.
    requantize_rows: bool = False
    # (qt, spec, settings) -> (qt, exact | None): a module in the target's terms: its codes kept, scales
    # re-expressed where the target stores them differently, target-held state kept or dropped; exact:
    # the values its stored scales round, for the report (None: nothing rounded). convert's integer
    # requantizer's result goes through it too (rounding not reported). None: scales / divisor stored
    # in spec.scale_dtype.
    retarget: Callable | None = None
    # the convert options (convert.Options' fields) it takes; any other one given is a usage error (exit 2)
    options: frozenset = INTEGER_OPTIONS
    # (config) -> config: the model config's keys its loaders read beyond quantization_config (MLX: the
    # same dict as "quantization", rope_theta at the top level). None: the config as convert makes it.
    model_config: Callable | None = None
    # ({name: OutTensor}) -> {name: OutTensor}: the output tensors as its loaders name and shape them, made
    # from the planned ones (MLX: per-expert Linears stacked into switch_mlp tensors). None: as planned.
    arrange: Callable | None = None

    def module_leaves(self, spec, shape: tuple[int, int], g_idx: bool, settings: Mapping | None = None) -> dict:
        """leaves for one module, given the settings plan gave it (targets without plan take none)."""
        return self.leaves(spec, shape, g_idx, **(settings or {}))

    def encode(self, qt, spec, g_idx: bool) -> dict:
        """The module's tensors, zero points stored in this target's own convention."""
        spec = replace(spec, zero_encoding=self.zero_encoding)
        return importlib.import_module(f"{_FORMATS}.{self.codec}").encode_for(self.name, qt, spec, g_idx)

    def written_by(self, modules: Mapping) -> "Target":
        """The target that writes these negotiated modules ({name: (spec, (out, in))}), decided before any
        data is read: this one, or the one its packing hook picks from the specs (auto-round: the
        packing_format auto-round's own export would pick for them)."""
        name = self.packing(modules) if self.packing else None
        return self if name is None or name == self.name else target(name)


def _lazy(module: str, fn: str, *bound):
    """A hook that imports module (relative to qconv.formats) on its first call and calls fn with the
    bound arguments first: numpy-side hooks without numpy at registration."""
    def hook(*args, **kwargs):
        return getattr(importlib.import_module(f"{_FORMATS}.{module}"), fn)(*bound, *args, **kwargs)
    hook.__name__ = hook.__qualname__ = f"{module}.{fn}"
    return hook


_TARGETS: dict[str, Target] = {}


def register_target(entry: Target) -> Target:
    _TARGETS[entry.name] = entry
    return entry


def target(name: str) -> Target:
    return _lookup(_TARGETS, "target", name)


def targets() -> tuple[Target, ...]:
    return tuple(_TARGETS.values())


AUTO_ROUND_AWQ_TARGET = "auto-round:auto_awq"
AUTO_ROUND_PLAIN_TARGET = "auto-round:plain"


def auto_round_packing(modules: Mapping) -> str | None:
    """The packing `--to auto-round` writes, as auto-round's own ``format="auto_round"`` export picks it
    (auto_round/export/formats/backends/autoround.py, ``AutoRoundFormat.__init__``):

    * every module symmetric: ``auto_round:auto_gptq`` (None: the auto-round target itself);
    * some module asymmetric, and every module 4-bit in whole groups that AWQ GEMM holds (in a multiple
      of the group size, out of 8): ``auto_round:auto_awq`` (AWQ GEMM tensors, zero points as they are;
      symmetric modules among them keep their zero points 2^(b-1) and an extra_config ``sym: true``);
    * some module asymmetric otherwise (another width, one group per row): plain ``auto_round`` (GPTQ
      layout, zero points as they are, no g_idx), which auto-round writes for asymmetric schemes that
      are not all 4-bit and qconv's GPTQ reader reads back (FORMATS.md §4.2).

    auto-round's auto_gptq stores z - 1 clamped at 0 and its loaders read asymmetric auto_gptq as
    symmetric, so an asymmetric module is never written there."""
    if all(spec.symmetric for spec, _ in modules.values()):
        return None
    awq_target = target(AUTO_ROUND_AWQ_TARGET)

    def awq_holds(spec, shape) -> bool:
        if spec.bits not in awq_target.caps.bits:
            return False
        try:
            awq_target.leaves(spec, shape, False)
        except ValueError:
            return False
        return True

    if all(awq_holds(spec, shape) for spec, shape in modules.values()):
        return AUTO_ROUND_AWQ_TARGET
    return AUTO_ROUND_PLAIN_TARGET


def _register_targets() -> None:
    from ..awq import header as awq
    from ..bnb import header as bnb
    from ..compressed_tensors import header as compressed_tensors
    from ..fp8 import header as fp8
    from ..gptq import header as gptq
    from ..mlx import header as mlx
    from ..modelopt import header as modelopt

    int_2_8 = frozenset(range(2, 9))
    for name in ("gptq", "gptq-v2"):
        register_target(Target(name, "gptq", Caps(int_2_8, act_order=True), gptq.leaves, gptq.config_writer(name),
                               "gptq.codec", g_idx="always", zero_encoding="v2" if name == "gptq-v2" else "v1"))
    # auto-round: one --to name, three packings, picked from the negotiated specs as auto-round's own
    # export picks them (auto_round_packing). auto_gptq (z - 1) for symmetric modules, as before;
    # the asymmetric packings store zero points as they are.
    register_target(Target("auto-round", "gptq", Caps(int_2_8), gptq.leaves,
                           gptq.config_writer("auto-round", gptq.AUTO_ROUND_GPTQ), "gptq.codec",
                           zero_encoding="v1", packing=auto_round_packing))
    register_target(Target(AUTO_ROUND_AWQ_TARGET, "awq",
                           Caps(frozenset({4}), per_row=False, scale_dtypes=frozenset({"F16"})), awq.writer_leaves,
                           gptq.config_writer(AUTO_ROUND_AWQ_TARGET, awq.AUTO_ROUND_AWQ), "awq.codec",
                           internal=True))
    register_target(Target(AUTO_ROUND_PLAIN_TARGET, "gptq", Caps(int_2_8), gptq.leaves,
                           gptq.config_writer(AUTO_ROUND_PLAIN_TARGET, gptq.AUTO_ROUND_PLAIN), "gptq.codec",
                           zero_encoding="v2", internal=True))
    register_target(Target("compressed-tensors", "ct", Caps(int_2_8, divisor_scale="F32"),
                           compressed_tensors.writer_leaves(compressed_tensors.PACKED),
                           compressed_tensors.writer_config(compressed_tensors.PACKED), "compressed_tensors.codec"))
    register_target(Target("compressed-tensors-w8a8", "ct",
                           Caps(frozenset({8}), asym=False, grouped=False, divisor_scale="F32", fallback_bits=8),
                           compressed_tensors.writer_leaves(compressed_tensors.INT),
                           compressed_tensors.writer_config(compressed_tensors.INT), "compressed_tensors.codec",
                           activations="int8 per token, dynamic", dynamic_activations="int8 per token, dynamic"))
    # llm-compressor's float-quantized FP8 (FP8_DYNAMIC per channel; FP8_BLOCK with --block-size): its own
    # fit, plan (scales in the model dtype), quantizer (llm-compressor's arithmetic) and retarget (codes
    # kept from e4m3 sources in the same structure); compressed_tensors/.
    register_target(Target(compressed_tensors.FP8_TARGET, "ct",
                           Caps(frozenset({8}), asym=False, grouped=False, divisor_scale="F32"),
                           compressed_tensors.float_leaves, compressed_tensors.float_config, "compressed_tensors.codec",
                           fit=_lazy("compressed_tensors.codec", "fit_fp8"), options=FP8_OPTIONS,
                           dynamic_activations="e4m3, dynamic (per token; per group of a block's width)",
                           plan=_lazy("compressed_tensors.codec", "plan_fp8"),
                           requantize=_lazy("compressed_tensors.codec", "requantize_fp8"), requantize_rows=True,
                           retarget=_lazy("compressed_tensors.codec", "retarget_fp8")))
    # llm-compressor's NVFP4A16 (nvfp4-pack-quantized): its own fit, plan and share (one global scale per
    # fused q/k/v and gate/up group, from the data), quantizer (llm-compressor's arithmetic) and retarget
    # (codes kept from NVFP4 in either dialect); compressed_tensors/.
    register_target(Target(compressed_tensors.NVFP4_TARGET, "ct",
                           Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"F8_E4M3"})),
                           compressed_tensors.nvfp4_leaves, compressed_tensors.nvfp4_config, "compressed_tensors.codec",
                           fit=_lazy("compressed_tensors.codec", "fit_nvfp4"), options=frozenset(),
                           plan=_lazy("compressed_tensors.codec", "plan_nvfp4"),
                           share=_lazy("compressed_tensors.codec", "share_nvfp4"),
                           requantize=_lazy("compressed_tensors.codec", "requantize_nvfp4"), requantize_rows=True,
                           retarget=_lazy("compressed_tensors.codec", "retarget_nvfp4")))
    # llm-compressor's MXFP4A16 (mxfp4-pack-quantized): its own fit, quantizer (llm-compressor's
    # arithmetic) and retarget (codes and e8m0 scales kept from MXFP4); compressed_tensors/.
    register_target(Target(compressed_tensors.MXFP4_TARGET, "ct",
                           Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"U8"})),
                           compressed_tensors.mxfp4_leaves, compressed_tensors.mxfp4_config, "compressed_tensors.codec",
                           fit=_lazy("compressed_tensors.codec", "fit_mxfp4"), options=frozenset(),
                           requantize=_lazy("compressed_tensors.codec", "requantize_mxfp4"), requantize_rows=True,
                           retarget=_lazy("compressed_tensors.codec", "retarget_mxfp4")))
    # ModelOpt NVFP4 (quant_algo NVFP4, W4A4): codes, e4m3 scales, weight_scale_2 and the calibrated
    # input_scale kept from NVFP4 sources that carry a static activation scale (ModelOpt's own, or
    # compressed-tensors W4A4's divisors inverted); every other source is refused in plan, since no data-free
    # path makes an input_scale. Its own fit, plan, share (one weight_scale_2 / input_scale per fused
    # q/k/v and gate/up group) and retarget; modelopt/.
    register_target(Target(modelopt.NVFP4_TARGET, "modelopt",
                           Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"F8_E4M3"})),
                           modelopt.nvfp4_leaves, modelopt.nvfp4_config, "modelopt.codec",
                           fit=_lazy("modelopt.codec", "fit_nvfp4"), plan=_lazy("modelopt.codec", "plan_nvfp4"),
                           options=frozenset(),
                           share=_lazy("modelopt.codec", "share_nvfp4"),
                           retarget=_lazy("modelopt.codec", "retarget_nvfp4")))
    register_target(Target("awq", "awq", Caps(frozenset({4}), per_row=False, scale_dtypes=frozenset({"F16", "BF16"}),
                                              fallback_bits=4, one_group_size=True),
                           awq.writer_leaves, awq.writer_config, "awq.codec"))
    # bitsandbytes: LLM.int8 (codes kept from 8-bit symmetric per-row sources, SCB = s * 127) and 4-bit
    # nf4 / fp4 (its own options, code books, double quant planned per module); bnb.py and bnb_codec.py.
    register_target(Target("bnb8", "bnb8", Caps(frozenset({8}), asym=False, grouped=False,
                                                scale_dtypes=frozenset({"F32"}), divisor_scale="F32"),
                           bnb.int8_leaves, bnb.config_writer(False), "bnb.codec",
                           fit=_lazy("bnb.codec", "fit_int8"), retarget=_lazy("bnb.codec", "retarget_int8"),
                           dynamic_activations="int8 per token, dynamic (LLM.int8: outlier columns in 16-bit)",
                           options=frozenset({"bits"})))
    # Fine-grained FP8 (transformers / DeepSeek): e4m3 in 2-D blocks; its own fit (--block-size), quantizer
    # (Fp8Quantize's arithmetic) and retarget (codes kept from e4m3 sources in the same blocks); fp8/.
    register_target(Target("fp8", "fp8", Caps(frozenset({8}), asym=False, per_row=False,
                                              scale_dtypes=frozenset({"F32"}), divisor_scale="F32"),
                           fp8.writer_leaves, fp8.writer_config, "fp8.codec", fit=_lazy("fp8.codec", "fit"),
                           dynamic_activations="e4m3 per group of 128, dynamic",
                           options=FP8_OPTIONS,
                           requantize=_lazy("fp8.codec", "requantize"), requantize_rows=True, retarget=_lazy("fp8.codec", "retarget")))
    for name, quant_type in bnb.FOUR_BIT_TARGETS.items():
        register_target(Target(name, "bnb4", Caps(frozenset({4}), asym=False, per_row=False, grouped=False,
                                                  scale_dtypes=frozenset({"F32"}), divisor_scale="F32"),
                               bnb.four_bit_leaves, bnb.config_writer(True), "bnb.codec",
                               fit=_lazy("bnb.codec", "fit_4bit", quant_type), plan=_lazy("bnb.codec", "plan_4bit"),
                               options=BNB4_OPTIONS,
                               requantize=_lazy("bnb.codec", "requantize_4bit"),
                               retarget=_lazy("bnb.codec", "retarget_4bit")))
    # Apple MLX affine (mlx-lm): integer codes kept with b = -s * z, scales and biases in a dtype that holds
    # them exactly (plan), groups of 32 / 64 / 128, mlx-lm's config keys (model_config); mlx/.
    register_target(Target("mlx", "mlx", Caps(frozenset(mlx.BITS) - {1}, per_row=False, tiles_rows=True, fallback_bits=8,
                                              divisor_scale="F16", group_sizes=frozenset(mlx.GROUPS)),
                           mlx.writer_leaves, mlx.writer_config, "mlx.codec", fit=mlx.fit, plan=_lazy("mlx.codec", "plan"),
                           retarget=_lazy("mlx.codec", "retarget"), share=mlx.share, model_config=mlx.model_config,
                           arrange=mlx.arrange))


_register_targets()
