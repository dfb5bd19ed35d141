"""The types a format family declares itself with, and the lookup: core holds these and imports no
family. Each family's package (formats/<family>/__init__.py) registers its Family, Dialect and Target
entries; qconv.formats imports every family folder it holds, so a new format is one folder (its
__init__ with its declarations, a header module, stdlib only, and a codec, numpy), never a branch in
detect, reader, inspection, validation or convert.

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
from .options import INTEGER_OPTIONS

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
                                     # data decides a target's scale dtype (convert/target_spec.py)
    # (m, tensors, qc) -> QuantSpec | FloatSpec: a module's spec where the headers alone do not say it
    # (MLX: integer zero points, or none, decided from its scales and biases); a codec function name.
    # None: convert derives it from the module's headers.
    source_spec: str | None = None
    # (m, qc) -> Kernel | None: the producer's own matmul for a module, where it can run here (a module,
    # relative to qconv.formats, holding ``kernel``: "bnb.kernel"); None: the family has none
    kernel: str | None = None
    # whether its modules hold codes (False: the "unquantized" family, a float model's Linears, which
    # data-free conversion quantizes and no config names)
    quantized: bool = True
    # tensor-name endings only this format's quantization writes beyond detect.QUANT_LEAVES (MLX: .scales,
    # .biases): in a checkpoint it claims, one no module of it accounts for is refused, never carried
    state_leaves: tuple = ()

    def kernel_for(self, m: QuantModule, qc: Mapping | None):
        """The producer's kernel for this module (Kernel), or None."""
        if self.kernel is None:
            return None
        return importlib.import_module(f"{_FORMATS}.{self.kernel}").kernel(m, qc)

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
class Kernel:
    """A producer's own matmul (Family.kernel): validate runs it on the same activations as qconv's
    decoding and holds it to ``tolerance`` (its own arithmetic: LLM.int8's int8 activations, auto-round's
    float16 weights); convert's activation cost takes its output as the source's where ``source_output``
    names it (a kernel that quantizes activations at run time)."""
    name: str
    tolerance: float
    inputs: Callable                 # (m, tensors, k) -> {leaf: array}: the stored tensors of output rows 0..k-1
    output: Callable                 # (m, inputs, X torch, k, device) -> torch float32 [rows of X, k]
    source_output: str | None = None


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
    bare_last: bool = False          # its bare check is tried after every other dialect's (a loose one)
    # (quant_method, qc) -> the config method a config of this dialect names (bitsandbytes: bnb8 or bnb4
    # from its load_in_* flags; auto-round: either spelling of its quant_method), None: not this dialect's
    resolve: Callable | None = None
    # config methods reported under their own name, not the family's that decodes a module (auto-round:
    # one config language over GPTQ's and AWQ's packings)
    reported_as_itself: frozenset = frozenset()


_FAMILIES: dict[str, Family] = {}
_DIALECTS: dict[str, Dialect] = {}


def register(entry):
    """A family or dialect declares itself (from its package's __init__, which qconv.formats imports for
    every folder it holds: core imports no family)."""
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




# ---------------------------------------------------------------------------------------------
# Writers of quantized formats (`qconv convert --to NAME`)

@dataclass(frozen=True)
class Caps:
    """What a target stores without touching codes: the one description spec negotiation
    (convert/target_spec.py) fits every source module to. A target with its own fit (Target.fit) fits
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
    request: object                  # the conversion's options (core/request.Options: to, and the options the
                                     # target declares: bits, group_size, sym, scale_dtype, block_size, ...)
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


@dataclass(frozen=True)
class Target:
    """A writer. convert plans every module (fit or the caps negotiation: spec and reason; then plan: its
    settings; then leaves: the tensors and their header entries), writes the config, and only then
    encodes each module's data: requantized from its exact weights (requantize, else convert's integer
    requantizer) or kept and re-expressed (retarget, else scales / divisor in spec.scale_dtype), then
    encode. The hooks below default to None, which is what the integer formats need; a format with its
    own options, code books or header state that depends on the data (bitsandbytes) sets them. Hooks
    that need numpy are given lazily (registry.lazy), so importing the registry stays stdlib only."""
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
    # what a user does where a scale does not fit the dtype it would be stored in (convert's refusal ends
    # with it); None: the --scale-dtype choice
    scale_hint: str | None = None
    zero_encoding: str | None = None  # what its qzeros hold: "v1" (z - 1), "v2" (z), None (its codec's own)
    packing: Callable | None = None  # ({module: (QuantSpec, (out, in))}) -> name of the target that writes them
    internal: bool = False           # written only when another target's packing picks it; not a --to choice
    # (module, source spec, request, negotiate) -> (QuantSpec, reason | None) or None (this module: the caps
    # negotiation, as for a target without fit): the spec a module is
    # written with and why its codes cannot be kept, for a target whose settings are not bits / groups /
    # zero points (code books, its own options such as --block-size or --quant-storage); request: as
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
    # the convert options it takes (core/options.Option declarations: its --flags, keywords and checks);
    # any other one given is a usage error (exit 2)
    options: tuple = INTEGER_OPTIONS
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


@dataclass(frozen=True)
class FileTarget:
    """A writer of one file rather than a folder (llama.cpp's GGUF): the family that reads it back, the
    convert options it takes (any other is exit 2), and ``convert(src, dst, opts, *, overwrite, jobs,
    max_shard_size, validate) -> report``, which plans, writes, stages and publishes the file, as convert
    does a folder."""
    name: str
    family: str
    options: tuple                   # core/options.Option declarations
    convert: Callable


_FILE_TARGETS: dict[str, FileTarget] = {}


def register_file_target(entry: FileTarget) -> FileTarget:
    _FILE_TARGETS[entry.name] = entry
    return entry


def file_target(name: str) -> FileTarget | None:
    return _FILE_TARGETS.get(name)


def file_targets() -> tuple[FileTarget, ...]:
    return tuple(_FILE_TARGETS.values())


def lazy(module: str, fn: str, *bound):
    """A hook that imports module (relative to qconv.formats) on its first call and calls fn with the
    bound arguments first: numpy-side hooks without numpy at registration (a family's codec, named relative to
    qconv.formats: "bnb.codec")."""
    def hook(*args, **kwargs):
        return getattr(importlib.import_module(f"{_FORMATS}.{module}"), fn)(*bound, *args, **kwargs)
    hook.__name__ = hook.__qualname__ = f"{module}.{fn}"
    return hook


_TARGETS: dict[str, Target] = {}


def register_target(entry: Target) -> Target:
    """A writer declares itself (from its family's package __init__, as register)."""
    _TARGETS[entry.name] = entry
    return entry


def target(name: str) -> Target:
    return _lookup(_TARGETS, "target", name)


def targets() -> tuple[Target, ...]:
    return tuple(_TARGETS.values())
