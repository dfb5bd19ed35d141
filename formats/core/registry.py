"""The contract a format family declares itself with, and the lookup: core holds these and imports no
family. Each family's package (formats/<family>/__init__.py) defines its classes: a subclass of
``Family`` (a reader: how its modules are found, refused and read), of ``Dialect`` (the config language
inspect checks) and of ``Target`` for each writer (`--to NAME`). A class with a ``name`` registers itself
when it is defined, and a name declared twice is refused at import; qconv.formats imports every family
folder it holds, so a new format is one folder (its __init__ with its classes, a header module, stdlib
only, and a codec, numpy), never a branch in detect, reader, inspection, validation or convert.

The base classes' docstrings are the contract: what each method receives and returns, which ones run on
headers alone (stdlib: `inspect` imports the registry and every declaration, never numpy), and what the
default does where a family leaves a method out. A lookup by a name that is not registered lists the
names that are.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Callable, ClassVar, Mapping

from .layout import QuantModule
from .options import INTEGER_OPTIONS

_FORMATS = __package__.rsplit(".", 1)[0]   # qconv.formats: codec names are relative to it


def _duplicate(table: dict, what: str, name: str) -> None:
    if name in table:
        raise TypeError(f"{what} {name!r} is registered twice ({type(table[name]).__module__}."
                        f"{type(table[name]).__qualname__} and another): each name is declared once")


class _Registered:
    """A class that declares a ``name`` registers one instance of itself when it is defined (its
    package's __init__, which qconv.formats imports for every folder it holds): core imports no family,
    a family's classes find core. A class without a name of its own is a base for others (bitsandbytes'
    4-bit targets share one). A name declared twice is refused at import."""
    _table: ClassVar[dict]
    _what: ClassVar[str]
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            _duplicate(cls._table, cls._what, cls.name)
            cls._table[cls.name] = cls()

    def __repr__(self) -> str:
        return f"<{self._what} {self.name!r}>"


def _import(module: str):
    """A module relative to qconv.formats ("bnb.codec"), imported on first use: numpy-side code stays
    out of `inspect`, which imports the registry and every family's declarations."""
    return importlib.import_module(f"{_FORMATS}.{module}")


class Family(_Registered):
    """A format family: how qconv finds, refuses and reads one format's quantized modules. This class is
    the contract: a family subclasses it with the class attributes below and the methods it needs (the
    others keep the defaults here). The methods marked stdlib read headers and config only and import
    neither numpy nor torch (`inspect` runs them); the others may, importing the family's ``codec``
    module (``self.codec_module()``) when data is touched."""
    _table: ClassVar[dict] = {}
    _what: ClassVar[str] = "format family"

    name: ClassVar[str]                  # QuantModule.family
    method: ClassVar[str]                # the name reports give it ("bitsandbytes LLM.int8")
    config_methods: ClassVar[frozenset] = frozenset()   # config methods (detect.config_method) it decodes
    codec: ClassVar[str]                 # its data module, relative to qconv.formats ("bnb.codec")
    # its stdlib header module where that defines find_modules(tensors, qc), settings(qc, modules) and
    # check(m, tensors, qc) as the methods below take them: their defaults call those (None: none)
    header: ClassVar[ModuleType | None] = None
    needs_config: ClassVar[bool] = True  # its tensors alone do not say how to decode them (packed words)
    row_multiple: ClassVar[int] = 32     # a row window's ends are multiples of this (row_step's default)
    scale_tensor: ClassVar[str | None] = None   # its modules' scale tensor (m.name + this), read alone where
                                         # the data decides a target's scale dtype (convert/target_spec.py)
    quantized: ClassVar[bool] = True     # its modules hold codes (False: "unquantized", a float model's
                                         # Linears, which data-free conversion quantizes)
    state_leaves: ClassVar[tuple] = ()   # tensor-name endings only its quantization writes beyond
                                         # detect.QUANT_LEAVES (MLX: .scales, .biases): one no module of it
                                         # accounts for is refused, never carried

    def codec_module(self):
        """Its ``codec`` module, imported on first use (numpy)."""
        return _import(self.codec)

    # --- from headers and config (stdlib) ---------------------------------------------------------------

    def claims(self, config_method: str | None, qc: Mapping | None) -> bool:
        """Whether to look for its modules in a checkpoint whose config names ``config_method`` (qc: its
        quantization_config, or None). Default: config_method is one of config_methods."""
        return config_method in self.config_methods

    def find_modules(self, tensors: Mapping, qc: Mapping | None) -> list[QuantModule]:
        """Its modules, from the tensors' headers (name -> TensorInfo) and qc. Stdlib. Default: its header's
        find_modules, else none."""
        return self.header.find_modules(tensors, qc) if self.header is not None else []

    def settings(self, qc: Mapping | None, modules: list[QuantModule]) -> dict:
        """What `inspect` reports of its settings for these modules of it (qc: the config where its own
        dialect wrote it, else None). Stdlib. Default: its header's settings, else nothing."""
        return self.header.settings(qc, modules) if self.header is not None else {}

    def symmetric(self, m: QuantModule, qc: Mapping | None) -> bool:
        """Whether m's zero points are 2^(b-1), from headers and config (an integer module whose spec
        source_spec does not give). Stdlib. Default: True."""
        return True

    def row_step(self, m: QuantModule) -> int:
        """A row window's ends for m are multiples of this (or the last row): the unit a reader reads
        rows in, which validate's and convert's bounded memory rest on. Default: row_multiple."""
        return self.row_multiple

    # --- where data is touched (may import numpy, torch) ---------------------------------------------------

    def check_module(self, m: QuantModule, tensors: Mapping, qc: Mapping | None) -> None:
        """Refuse m (CorruptCheckpoint / UnsupportedFormat naming file and tensor) where its tensors
        cannot be decoded as found; run by every verb before m's data is read. Default: its header's check,
        else nothing to check."""
        if self.header is not None:
            self.header.check(m, tensors, qc)

    def read_module(self, m: QuantModule, tensors: Mapping, qc: Mapping | None, dtype: str,
                    rows: tuple[int, int] | None = None):
        """m, or only its output rows r0:r1 (ends on multiples of row_step(m), or the last row), as a
        QuantTensor (or a FloatWeight): only those rows' bytes are read, so a caller holding one window
        at a time holds a bounded part of any layer. dtype: the weight's original float dtype. Default:
        its codec's ``read(m, tensors, qc, dtype, rows)``."""
        return self.codec_module().read(m, tensors, qc, dtype, rows)

    def source_spec(self, m: QuantModule, tensors: Mapping, qc: Mapping | None):
        """m's spec (QuantSpec / FloatSpec) where its headers alone do not say it (MLX: integer zero
        points, or none, decided from its scales and biases); None: convert derives it from the headers."""
        return None

    def kernel_for(self, m: QuantModule, qc: Mapping | None) -> "Kernel | None":
        """The producer's own matmul for m where it can run here (validate cross-checks it, convert's
        activation cost reads it), or None: the family has none."""
        return None


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
class Engine:
    """The engine users run a format's models in, for the model-level check (``qconv validate --model``,
    model_check/): its name as the report says it, the module that must import in the engine's Python, and
    its runner: a script beside the family's __init__ (the engine, numpy and the standard library; never
    qconv, which that Python need not have) defining ``run(model, request) -> (result, logits)``: request
    {"ids": [...], "text": "...", "threads": N}; logits float32, one row of next-token logits per id; result
    {"tokens": the engine's own tokenization of the text without special tokens, "version"}; an
    exception is the engine's refusal. model_check/runner.py loads it in the engine's Python."""
    name: str
    module: str
    script: str


class Dialect(_Registered):
    """A quantization_config language (bitsandbytes, GPTQ / auto-round, AWQ, compressed-tensors): what
    inspect checks of a config against the tensors, and how a config names its method. One dialect can
    describe several families (bitsandbytes: int8 and 4-bit; auto-round: GPTQ and AWQ packings). Every
    method is stdlib (inspect runs them)."""
    _table: ClassVar[dict] = {}
    _what: ClassVar[str] = "dialect"

    name: ClassVar[str]
    config_methods: ClassVar[frozenset]
    header: ClassVar[ModuleType | None] = None   # its stdlib header module, where that defines lint (below)
    bare_last: ClassVar[bool] = False    # its bare check is tried after every other dialect's (a loose one)
    # config methods reported under their own name, not the family's that decodes a module (auto-round:
    # one config language over GPTQ's and AWQ's packings)
    reported_as_itself: ClassVar[frozenset] = frozenset()
    # the engine its models are run in by the model-level check (None: transformers, on qconv's decoding)
    engine: ClassVar[Engine | None] = None

    def lint(self, qc: Mapping, modules: list, all_modules: set, comp, warnings: list) -> None:
        """Append to warnings what the config says that its modules (all_modules: every module name in
        the checkpoint) contradict or that a loader reads otherwise. Default: its header's lint, else nothing."""
        if self.header is not None:
            self.header.lint(qc, modules, all_modules, comp, warnings)

    def refuse(self, qc: Mapping) -> tuple | None:
        """(error class, message) for a config under which nothing can be decoded (a block size that is not
        one, a field of the wrong type), refused naming the config file; None: nothing to refuse."""
        return None

    def bare(self, doc: Mapping) -> bool:
        """Whether a stand-alone config without quant_method is this dialect's (ModelOpt's
        hf_quant_config.json, MLX's config); detect.config_method then names the dialect. Default: no."""
        return False

    def resolve(self, quant_method, qc: Mapping) -> str | None:
        """The config method a config of this dialect names (bitsandbytes: bnb8 or bnb4 from its load_in_*
        flags; auto-round: either spelling of its quant_method); None: not this dialect's own spelling."""
        return None


_FAMILIES: dict[str, Family] = Family._table
_DIALECTS: dict[str, Dialect] = Dialect._table


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
    float_offsets: bool = False      # holds float offsets w = s * q + b (QuantSpec.offset "float") as they are
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


class Target(_Registered):
    """A writer (`qconv convert --to NAME`). This class is the contract: a target subclasses it with the
    class attributes below and the methods it needs; the others keep the defaults here.

    convert plans every module first: its spec (fit, else convert's negotiation of the request against
    caps) and why its codes cannot be kept; then plan (its write settings), share (settings modules hold
    in common) and leaves (its tensors and their header entries, predicted before any data); then the
    quantization_config and model_config. Only then is each module's data encoded: requantized from its
    exact weights (requantize where the target defines it, else convert's integer requantizer) or kept and
    re-expressed (retarget where defined, else scales / divisor stored in spec.scale_dtype), then encode.
    leaves, quantization_config, packing, model_config and arrange are stdlib; the others may import numpy
    (the target's ``codec`` module, through ``self.codec_module()``). A target reads only the
    options it declares (``options``): ``request.bits`` of a target that does not declare bits is an
    AttributeError."""
    _table: ClassVar[dict] = {}
    _what: ClassVar[str] = "target"

    name: ClassVar[str]                  # the --to name
    family: ClassVar[str]                # the family that reads what it writes
    caps: ClassVar[Caps]                 # what it stores without touching codes
    codec: ClassVar[str]                 # its data module, relative to qconv.formats, holding
                                         # encode_for(name, qt, spec, g_idx) -> {leaf: (dtype, array)}
    options: ClassVar[tuple] = INTEGER_OPTIONS   # the convert options it takes (core/options.Option); any
                                         # other one given is a usage error (exit 2)
    g_idx: ClassVar[str] = "never"       # "always" (GPTQ's writers), "act-order" (only a kept act-order), "never"
    zero_encoding: ClassVar[str | None] = None   # what its qzeros hold: "v1" (z - 1), "v2" (z), None (its codec's)
    internal: ClassVar[bool] = False     # written only where another target's packing picks it; no --to choice
    requantize_rows: ClassVar[bool] = False   # its requantize is row-separable (each row, or each
                                         # spec.block_rows rows, on its own): convert gives it windows of rows
                                         # and stacks the parts, never the whole float32 weight
    activations: ClassVar[str | None] = None  # what its kernels do to activations (convert reports the cost)
    # what its kernels do to activations for which it stores no static scale (a source's that it cannot
    # hold: convert's report says so); None: nothing, its kernels multiply 16-bit activations
    dynamic_activations: ClassVar[str | None] = None
    # what a user does where a scale does not fit the dtype it would be stored in (convert's refusal ends
    # with it); None: the --scale-dtype choice
    scale_hint: ClassVar[str | None] = None
    # its output's names on the Hugging Face Hub, for the model card (convert/card.py): the library that
    # loads it and its tags (empty: the family's name; the bits are added from the options)
    hub_library: ClassVar[str | None] = "transformers"
    hub_tags: ClassVar[tuple[str, ...]] = ()

    def codec_module(self):
        """Its ``codec`` module, imported on first use (numpy)."""
        return _import(self.codec)

    def overrides(self, hook) -> bool:
        """Whether this target defines ``hook`` (a method of Target: ``Target.plan``) itself, where convert
        has a generic way for the targets that do not (plan, requantize, retarget)."""
        return getattr(type(self), hook.__name__) is not hook

    # --- planned from headers (stdlib) -------------------------------------------------------------------

    def leaves(self, spec, shape: tuple[int, int], g_idx: bool, **settings) -> dict:
        """{leaf: (dtype, shape)}: the tensors one module of ``shape`` (out, in) is written as, with a g_idx
        or not, given the settings plan gave it (their defaults: a plain module). NotStorable where its
        layout cannot hold the module."""
        raise NotImplementedError(f"target {self.name!r} declares no leaves")

    def quantization_config(self, ctx: WriteContext) -> dict:
        """The quantization_config it writes for these modules."""
        raise NotImplementedError(f"target {self.name!r} declares no quantization_config")

    def fit(self, m: QuantModule, source_spec, request, negotiate) -> tuple | None:
        """(QuantSpec, reason | None): the spec m is written with and why its codes cannot be kept, for a
        target whose settings are not bits / groups / zero points (code books, --block-size,
        --quant-storage); None: convert's negotiation against caps. request: core/request.Options;
        negotiate(caps=None) -> (bits, group, sym, reason) is that negotiation (fitted to caps where given).
        Refusals raise UsageError / UnsupportedFormat. Default: None."""
        return None

    def share(self, settings: dict) -> dict:
        """{module: settings} -> {module: settings}: settings some modules share, settled from every
        module's plan before any tensor is written (NVFP4: one global scale for the modules a serving
        engine fuses, q/k/v and gate/up). Default: each module's plan stands."""
        return settings

    def packing(self, modules: Mapping) -> str | None:
        """The name of the target that writes these negotiated modules ({name: (spec, (out, in))}), where
        one --to name has several packings (auto-round); None: this one."""
        return None

    def model_config(self, config: dict) -> dict:
        """The model config with the keys its loaders read beyond quantization_config (MLX: the same dict as
        "quantization", rope_theta at the top level). Default: as convert makes it."""
        return config

    def arrange(self, outputs: dict) -> dict:
        """{name: OutTensor} -> {name: OutTensor}: the output tensors as its loaders name and shape them,
        made from the planned ones (MLX: per-expert Linears stacked into switch_mlp tensors). NotStorable
        where they cannot be. Default: as planned."""
        return outputs

    # --- where data is touched (may import numpy) --------------------------------------------------------

    def plan(self, ctx: ModuleContext) -> dict:
        """What the spec does not say about how one module is written, settled before any tensor is (the
        header comes first): keyword arguments of leaves, also given to requantize, retarget and
        quantization_config (WriteContext.settings); it may encode the module once (ctx.encode) for a value
        only the data decides (bitsandbytes: the nested double-quant offset). Refusals raise
        UnsupportedFormat. Default (convert does not call it): {}."""
        return {}

    def requantize(self, source, w, spec, settings: dict) -> tuple:
        """(qt, rtn): a module whose codes cannot be kept quantized to spec from its exact weights w
        (float32 rows: a window of them where requantize_rows), with plain round-to-nearest beside it for
        the report, both QuantTensors in the target's terms. Default (convert does not call it): convert's
        integer requantizer (core/requantize.py)."""
        raise NotImplementedError(f"target {self.name!r} has no requantizer of its own")

    def retarget(self, qt, spec, settings: dict) -> tuple:
        """(qt, exact | None): a module in the target's terms, its codes kept, scales re-expressed where the
        target stores them differently, target-held state kept or dropped; exact: the values its stored
        scales round, for the report (a tuple (exact, stored) pairs several; None: nothing rounded).
        convert's integer requantizer's result goes through it too. Default (convert does not call it):
        scales / divisor stored in spec.scale_dtype."""
        raise NotImplementedError(f"target {self.name!r} has no retarget of its own")

    def encode(self, qt, spec, g_idx: bool) -> dict:
        """{leaf: (dtype, array)}: the module's tensors, zero points stored in this target's own convention.
        Default: its codec's encode_for(name, qt, spec, g_idx)."""
        spec = replace(spec, zero_encoding=self.zero_encoding)
        return self.codec_module().encode_for(self.name, qt, spec, g_idx)

    # --- used by convert ---------------------------------------------------------------------------------

    def module_leaves(self, spec, shape: tuple[int, int], g_idx: bool, settings: Mapping | None = None) -> dict:
        """leaves for one module, given the settings plan gave it (targets without plan take none)."""
        return self.leaves(spec, shape, g_idx, **(settings or {}))

    def written_by(self, modules: Mapping) -> "Target":
        """The target that writes these negotiated modules ({name: (spec, (out, in))}), decided before any
        data is read: this one, or the one its packing picks from the specs (auto-round: the packing_format
        auto-round's own export would pick for them)."""
        name = self.packing(modules)
        return self if name is None or name == self.name else target(name)


class FileTarget(_Registered):
    """A writer of one file rather than a folder (llama.cpp's GGUF). A family subclasses it with the class
    attributes below and ``sink``; defining the class registers it, a name declared twice is refused."""
    _table: ClassVar[dict] = {}
    _what: ClassVar[str] = "file target"

    name: ClassVar[str]                  # --to NAME
    family: ClassVar[str]                # the family that reads its output back
    options: ClassVar[tuple] = ()        # core/options.Option declarations: the convert options it takes
                                         # (any other is exit 2)
    hub_library: ClassVar[str | None] = None     # the model card's library_name and tags (Target's)
    hub_tags: ClassVar[tuple[str, ...]] = ()

    def sink(self, opts, *, max_shard: int, jobs: int, validate: bool):
        """The one-file container convert's engine writes into (a convert/sink.py Sink: the engine plans,
        stages, writes, checks, publishes and reports it as it does a folder). May import numpy."""
        raise NotImplementedError


def file_target(name: str) -> FileTarget | None:
    return FileTarget._table.get(name)


def file_targets() -> tuple[FileTarget, ...]:
    return tuple(FileTarget._table.values())


def lazy(module: str, fn: str, *bound):
    """A hook that imports module (relative to qconv.formats) on its first call and calls fn with the
    bound arguments first: numpy-side hooks without numpy at registration (a family's codec, named relative to
    qconv.formats: "bnb.codec")."""
    def hook(*args, **kwargs):
        return getattr(importlib.import_module(f"{_FORMATS}.{module}"), fn)(*bound, *args, **kwargs)
    hook.__name__ = hook.__qualname__ = f"{module}.{fn}"
    return hook


_TARGETS: dict[str, Target] = Target._table


def target(name: str) -> Target:
    return _lookup(_TARGETS, "target", name)


def targets() -> tuple[Target, ...]:
    return tuple(_TARGETS.values())
