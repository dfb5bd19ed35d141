"""qconv's Python API: the command line's verbs for release scripts and notebooks.

    import qconv

    report = qconv.inspect("model/")                       # header-only, no torch, no numpy
    result = qconv.convert("bnb8/", "gptq/", to="gptq", bits=8, group_size=-1, validate=True)
    qconv.dequantize("gptq/", "float/", dtype="bfloat16")
    check = qconv.validate("bnb8/", "gptq/")               # raises ValidationFailed unless every layer passes

Every verb takes its options as explicit keywords, checks them through one frozen options model that the
CLI builds too (``InspectOptions``, ``ConvertOptions``, ``DequantizeOptions``, ``ValidateOptions``), and
returns a typed, frozen result whose ``data`` is exactly the document ``--json`` prints (``to_json()``
gives the text). Failures raise the classes of ``qconv.errors``, each carrying the exit code the CLI
returns for it (``err.exit_code``): ``UsageError`` 2, ``InputNotFound`` 3, ``CorruptCheckpoint`` 4,
``UnsupportedFormat`` 5, ``OutputError`` 6, ``CheckFailed`` / ``ValidationFailed`` 1 (with ``err.result``).
Progress goes to the ``progress`` callback (``ProgressEvent``), never to stdout or stderr; the API prints
nothing. Ctrl-C (and SIGTERM / SIGHUP while a folder is being written, from the main thread) raises
KeyboardInterrupt after the staging folder is removed: DST is either complete or untouched.

Importing qconv loads neither torch nor numpy; each verb imports what it needs when it runs.
"""

from __future__ import annotations

import json
import math
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import convert as _convert_package       # the package; api.convert below is the verb it is called as
from .errors import CheckFailed, UsageError, ValidationFailed
from .formats.core.options import DEFAULT_MAX_SHARD, FLOAT_TARGETS, parse_size
from .formats.core.request import Options, convert_targets, declared
from .formats.core.options import check_flag as _flag, check_int as _int_in, check_name as _name
from .formats.core.options import check_jobs as _jobs, what as _what
from .progress import ProgressCallback, ProgressEvent, reporting

__all__ = ["inspect", "convert", "bnb8_to_gptq", "dequantize", "validate", "check_model",
           "InspectOptions", "ConvertOptions", "DequantizeOptions", "ValidateOptions", "target_options",
           "InspectResult", "ConvertResult", "DequantizeResult", "ValidateResult", "ModelCheckResult",
           "ProgressEvent", "targets", "to_json", "parse_size"]

DEQUANTIZE_DTYPES = ("auto",) + FLOAT_TARGETS
DEVICES = ("auto", "cpu", "cuda")
ROWS = ("all", "sampled")
KERNELS = ("sampled", "all")
MODEL_ENGINES = ("auto", "transformers", "native")      # check_model's engine (model_check.ENGINES)
SAMPLES_RANGE = (1, 4096)
SEED_RANGE = (0, 2**32 - 1)


def targets() -> tuple[str, ...]:
    """The names ``convert(to=...)`` takes: the format registry's quantized targets, then the float ones."""
    return convert_targets()


def target_options(to: str | None = None) -> dict[str, dict]:
    """The target options ``convert`` takes, as the targets declare them: {keyword: [{"flag", "help",
    "targets", "default", "choices", "deprecated"}, ...]}, one entry per declaration (a keyword two targets
    declare with their own meaning, block_size, has one per meaning); to: only the options of that target."""
    if to is not None:
        _name("to", to, convert_targets())
    out = {}
    for name, decls in declared().items():
        for opt, names in decls:
            if to is not None and to not in names:
                continue
            out.setdefault(name, []).append({"flag": opt.flag, "help": opt.help, "targets": list(names),
                                             "default": opt.default, "choices": list(opt.choices),
                                             "deprecated": list(opt.deprecated)})
    return out


def _progress(value: ProgressCallback | None) -> ProgressCallback | None:
    """The progress argument: None, or a callable taking a ProgressEvent."""
    if value is not None and not callable(value):
        raise UsageError(f"progress {value!r} is not a callable taking a ProgressEvent (or None)")
    return value


def _path(name: str, value) -> Path:
    """A path argument: a str or an os.PathLike giving one (bytes paths are not taken)."""
    fspath = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(fspath, str) or not fspath:
        raise UsageError(f"{name} {value!r} is not a path (a non-empty str or os.PathLike)")
    return Path(fspath)


# --- options: one frozen model per verb, built by the CLI and the API alike --------------------------------

@dataclass(frozen=True)
class InspectOptions:
    strict: bool = False           # a warning fails the check (CheckFailed, exit 1)

    def __post_init__(self):
        _flag("strict", self.strict)


# What ``qconv convert`` / ``qconv.convert`` takes: the one options model every writer reads
# (formats/core/request.Options): ConvertOptions(to, *, validate, overwrite, max_shard_size, jobs, search,
# **the target's options). None means "the source's" (see ``qconv convert --help``).
ConvertOptions = Options


@dataclass(frozen=True)
class DequantizeOptions:
    dtype: str = "auto"                    # auto: the model's own dtype (config.json)
    overwrite: bool = False
    max_shard_size: int | str = DEFAULT_MAX_SHARD
    jobs: int | None = None                # worker processes for the output shards (None: the machine's cores)

    def __post_init__(self):
        _name("dtype", self.dtype, DEQUANTIZE_DTYPES)
        _flag("overwrite", self.overwrite)
        object.__setattr__(self, "jobs", _jobs(self.jobs))
        object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size))


@dataclass(frozen=True)
class ValidateOptions:
    device: str = "auto"
    tol: float | None = None               # relative Frobenius tolerance per layer (lossy pairs)
    samples: int = 32
    seed: int = 0
    rows: str = "all"
    kernels: str = "sampled"

    def __post_init__(self):
        _name("device", self.device, DEVICES)
        _name("rows", self.rows, ROWS)
        _name("kernels", self.kernels, KERNELS)
        _int_in("samples", self.samples, *SAMPLES_RANGE, optional=False)
        _int_in("seed", self.seed, *SEED_RANGE, optional=False)
        if self.tol is not None and (isinstance(self.tol, bool) or not isinstance(self.tol, (int, float))
                                     or not math.isfinite(self.tol) or self.tol <= 0):
            raise UsageError(f"{_what('tol')} {self.tol!r} is not a positive finite number")


# --- results: typed, frozen; ``data`` is what --json prints ---------------------------------------------

def to_json(data: Mapping[str, Any]) -> str:
    """The --json document: strict JSON (RFC 8259 has no NaN or Infinity), so a non-finite number, which
    only a failed check can produce, is written as null."""
    return json.dumps(_finite(data), indent=2, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _component_warnings(data: Mapping) -> tuple[str, ...]:
    return tuple(f"{c['component']}: {w}" for c in data.get("components", []) for w in c.get("warnings", [])) \
        + tuple(data.get("warnings", []))


@dataclass(frozen=True)
class _Result:
    data: Mapping[str, Any] = field(repr=False)

    def to_json(self) -> str:
        return to_json(self.data)


@dataclass(frozen=True)
class InspectResult(_Result):
    path: str
    kind: str                              # "model", "pipeline", "file" or "gguf" (then data["gguf"])
    components: tuple[Mapping[str, Any], ...] = field(repr=False)
    methods: tuple[str, ...]               # per component: bnb8, gptq, compressed-tensors, unquantized, ...
    warnings: tuple[str, ...]              # "component: warning"


@dataclass(frozen=True)
class _Written(_Result):
    source: Path
    destination: Path
    seconds: float
    components: tuple[Mapping[str, Any], ...] = field(repr=False)
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class ConvertResult(_Written):
    codes_kept: int                        # modules whose codes were carried over unchanged
    requantized: tuple[Mapping[str, Any], ...] = field(repr=False)  # per requantized module: error, RTN error
    validated: bool                        # every layer was checked against SRC before DST was published


@dataclass(frozen=True)
class DequantizeResult(_Written):
    dequantized_modules: int


@dataclass(frozen=True)
class ValidateResult(_Result):
    a: str
    b: str
    ok: bool
    layers: tuple[Mapping[str, Any], ...] = field(repr=False)
    failed: tuple[str, ...]                # modules that failed (or could not be compared), then other tensors
                                           # (biases, norms, buffers) that differ
    only_in_a: tuple[str, ...]             # modules / components on one side only (they fail the check)
    only_in_b: tuple[str, ...]


@dataclass(frozen=True)
class ModelCheckResult(_Result):
    a: str
    b: str
    ok: bool                               # max_kl not given, or the mean KL divergence within it
    kl_mean: float                         # KL(P_A || P_B) of the next-token distributions, per position
    kl_p99: float
    top1_agreement: float
    perplexity_a: float
    perplexity_b: float
    engine_b: str                          # where B ran (llama.cpp, mlx-lm, transformers) and its version


def _written(cls, data: dict, **extra):
    return cls(data=data, source=Path(data["source"]), destination=Path(data["destination"]),
               seconds=data["seconds"], components=tuple(data["components"]),
               warnings=_component_warnings(data), **extra)


# --- the verbs --------------------------------------------------------------------------------------------

def inspect(path: str | os.PathLike[str], *, strict: bool = False) -> InspectResult:
    """Describe the checkpoint at ``path`` (model folder, .safetensors file or pipeline folder) from its
    headers and configs alone: method and settings, quantized modules by scheme, parameters per dtype, bytes,
    bits per weight and warnings. A GGUF file is described from its header: ``data["gguf"]``. Imports
    neither torch nor numpy.

    strict: raise ``CheckFailed`` (exit 1, ``err.result`` the report) when any warning is found."""
    opts = InspectOptions(strict=strict)
    from .inspection import inspect_path

    _path("path", path)
    data = inspect_path(path)
    components = tuple(data.get("components", ()))          # a GGUF file's report has none: data["gguf"]
    result = InspectResult(data=data, path=data["path"], kind=data["kind"], components=components,
                           methods=tuple(c["method"] for c in components),
                           warnings=_component_warnings(data))
    if opts.strict and result.warnings:
        raise CheckFailed(f"{len(result.warnings)} warning(s): {result.warnings[0]}", file=path, result=result)
    return result


def _card(card: bool, base_model: str | None) -> None:
    """The model card arguments: card a bool; base_model None or a Hub repository id (org/name)."""
    from .convert.card import is_repo_id

    _flag("card", card)
    if base_model is not None and not is_repo_id(base_model):
        raise UsageError(f"base_model {base_model!r} is not a Hugging Face repository id (org/name)")


def _run_convert(src, dst, opts: ConvertOptions, progress: ProgressCallback | None, card: bool,
                 base_model: str | None, verb: str = "convert", check_model: bool = False) -> ConvertResult:
    from .convert.card import for_convert
    from .convert.convert import convert as run_convert

    _card(card, base_model)
    _flag("check_model", check_model)
    src, dst, progress = _path("src", src), _path("dst", dst), _progress(progress)
    with reporting(progress):
        data = run_convert(src, dst, opts, overwrite=opts.overwrite,
                           max_shard_size=opts.max_shard_size, validate=opts.validate, jobs=opts.jobs,
                           card=for_convert(opts, src, dst, base_model, verb, check_model) if card else None,
                           check=_model_check if check_model else None)
    packed = [c for c in data["components"] if "to" in c]
    return _written(ConvertResult, data, codes_kept=sum(c["codes_kept"] for c in packed),
                    requantized=tuple(r for c in packed for r in c.get("layers", [])),
                    validated=bool(data["components"]) and all("validation" in c for c in data["components"]))


def _model_check(src: Path, out: Path) -> dict:
    """convert --check-model: the staged result against its source (model_check/), or why it could not run."""
    from .model_check import check_or_refusal

    return check_or_refusal(src, out)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, to: str, validate: bool = False,
            overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD, jobs: int | None = None,
            search: bool = True, progress: ProgressCallback | None = None, card: bool = True,
            base_model: str | None = None, check_model: bool = False, **options) -> ConvertResult:
    """Rewrite ``src`` as ``to`` (``targets()``: gptq, gptq-v2, auto-round, compressed-tensors,
    compressed-tensors-w8a8, -fp8, -nvfp4, -mxfp4, awq, fp8, modelopt-fp8, -nvfp4, mlx, bnb8, bnb4-nf4,
    bnb4-fp4, gguf, float16, bfloat16, float32) at ``dst``, keeping every code where the arithmetic allows
    and requantizing (error reported in ``result.requantized``) where it does not.

    ``options`` are the target's own, as it declares them (``target_options(to)`` lists them with their
    flags and help): bits, group_size (-1: one group per row), sym, scale_dtype for the integer targets
    (None: the source's); block_size for bnb4 (N, its absmax block) and fp8 ((rows, cols) or "128x128", no
    side larger than 65536 or than every module's); double_quant, quant_storage for bnb4; gguf_asym
    ("q5_0", exact; "q4_1"), gguf_float, gguf_float_type ("auto", "f32", "f16", "bf16", "q8_0") for gguf
    ([gguf.md](docs/gguf.md)); None (each one's default here) is "not given": the target's declared
    default. An option the target does not take is a ``UsageError`` given with any value but None, its
    default included, never ignored; an argument of the wrong type (``to=None``, ``progress=3``) is a
    ``UsageError`` too; ``blocksize=`` is the old spelling of bnb4's block_size (a DeprecationWarning).
    validate=True checks every layer against ``src`` before ``dst`` is published
    (``ValidationFailed`` otherwise, nothing written). ``dst`` must not exist or be empty unless
    overwrite=True. max_shard_size: bytes or "5GB". jobs: worker processes writing the output shards
    (None: the machine's cores); the bytes are the same whatever it is. search=False: modules requantized to
    an integer target are plain round-to-nearest (no error-minimising search: several times faster, a larger
    error, reported as ever). to="gguf" writes ``dst`` as one llama.cpp GGUF file (and its split files past
    max_shard_size). card=True (the default) writes the model card (docs/card.md): DST's README.md, or
    ``<name>.md`` beside a GGUF; base_model names the Hub repository it quantizes where the source does not.
    check_model=True runs the model-level check (``check_model``: KL divergence, top-1 agreement, perplexities)
    of the result against ``src`` before it is published, into ``result.data["model_check"]`` and the card;
    where it cannot run (no tokenizer, ...) the result is still written and both say why."""
    opts = ConvertOptions(to, validate=validate, overwrite=overwrite, max_shard_size=max_shard_size, jobs=jobs,
                          search=search, **options)
    return _run_convert(src, dst, opts, progress, card, base_model, check_model=check_model)


def _convert_signature():
    """convert's signature as ``inspect.signature`` (and help()) shows it: the run settings, and between
    ``to`` and them every target option the registry's targets declare, each None: not given (the
    target's declared default, which ``target_options()`` lists; a target that does not take the option
    refuses it given with any other value, its default included)."""
    import inspect as pyinspect

    sig = pyinspect.signature(convert)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    at = [p.name for p in params].index("to") + 1
    declared_params = [pyinspect.Parameter(name, pyinspect.Parameter.KEYWORD_ONLY, default=None)
                       for name in declared()]
    return sig.replace(parameters=params[:at] + declared_params + params[at:])


convert.__signature__ = _convert_signature()


class _CallablePackage(types.ModuleType):
    """The package ``qconv.convert`` as the verb: a verb and the package that implements it share the name
    (convert/__init__.py says why), so the package is made callable here, where the verb is, and imports
    nothing above it."""

    __signature__ = convert.__signature__

    def __call__(self, src, dst, *, to, **options):
        return convert(src, dst, to=to, **options)


_convert_package.__class__ = _CallablePackage


def bnb8_to_gptq(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, scale_dtype: str | None = None,
                 validate: bool = False, overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD,
                 jobs: int | None = None, progress: ProgressCallback | None = None, card: bool = True,
                 base_model: str | None = None, check_model: bool = False) -> ConvertResult:
    """A bitsandbytes LLM.int8 checkpoint as GPTQ 8-bit, one scale per output row, symmetric, every code kept
    (q = CB + 128); scales SCB / 127 stored as float16 unless scale_dtype says otherwise. Any other source
    method is refused (``UnsupportedFormat``)."""
    opts = ConvertOptions("gptq", bits=8, group_size=-1, sym=True, scale_dtype=scale_dtype, validate=validate,
                          overwrite=overwrite, max_shard_size=max_shard_size, source="bnb8", jobs=jobs)
    return _run_convert(src, dst, opts, progress, card, base_model, "bnb8-to-gptq", check_model)


def dequantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, dtype: str = "auto",
               overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD, jobs: int | None = None,
               progress: ProgressCallback | None = None, card: bool = True,
               base_model: str | None = None) -> DequantizeResult:
    """Write ``src`` (any format qconv reads) at ``dst`` as a plain float folder that transformers loads:
    sharded safetensors, config.json without quantization_config, every other file copied. dtype: auto (the
    model's own), float16, bfloat16 or float32."""
    opts = DequantizeOptions(dtype, overwrite, max_shard_size, jobs)
    _card(card, base_model)
    src, dst, progress = _path("src", src), _path("dst", dst), _progress(progress)
    from .convert.card import for_dequantize
    from .convert.dequantize import dequantize as run_dequantize

    with reporting(progress):
        data = run_dequantize(src, dst, dtype=None if opts.dtype == "auto" else opts.dtype,
                              overwrite=opts.overwrite, max_shard_size=opts.max_shard_size, jobs=opts.jobs,
                              card=for_dequantize(None if opts.dtype == "auto" else opts.dtype, src, dst, base_model)
                              if card else None)
    return _written(DequantizeResult, data,
                    dequantized_modules=sum(c["dequantized_modules"] for c in data["components"]))


def check_model(a: str | os.PathLike[str], b: str | os.PathLike[str], *, text: str | os.PathLike[str] | None = None,
                engine: str = "auto", python: str | os.PathLike[str] | None = None, max_kl: float | None = None,
                check: bool = True, progress: ProgressCallback | None = None) -> ModelCheckResult:
    """How far ``b`` is from ``a`` end to end (``qconv validate A B --model``; docs/validate.md): both run on
    ``text`` (a UTF-8 file; default: the bundled public-domain text) tokenized by A's tokenizer; the mean,
    99th percentile and maximum KL divergence of B's next-token distribution from A's, top-1 agreement and
    both perplexities. A runs in transformers (float32, on qconv's exact decoding), B in its format's own
    engine (llama.cpp for a GGUF, mlx-lm for MLX) where it imports in ``python`` (default: this one) unless
    engine="transformers"; engine="native" refuses where it does not. max_kl: with check=True (default),
    ``CheckFailed`` (exit 1, ``err.result``) when the mean KL is above it."""
    _name("engine", engine, MODEL_ENGINES)
    _flag("check", check)
    _path("a", a), _path("b", b)
    if text is not None:
        _path("text", text)
    if python is not None:
        _path("python", python)
    if max_kl is not None and (isinstance(max_kl, bool) or not isinstance(max_kl, (int, float))
                               or not math.isfinite(max_kl) or max_kl < 0):
        raise UsageError(f"{_what('max_kl')} {max_kl!r} is not a finite number >= 0")
    from .model_check import check_model as run_check

    with reporting(_progress(progress)):
        data = run_check(a, b, text=text, engine=engine, python=None if python is None else str(python))
    data["ok"] = max_kl is None or data["kl_mean"] <= max_kl
    if max_kl is not None:
        data["max_kl"] = max_kl
    result = ModelCheckResult(data=data, a=data["a"], b=data["b"], ok=data["ok"], kl_mean=data["kl_mean"],
                              kl_p99=data["kl_p99"], top1_agreement=data["top1_agreement"],
                              perplexity_a=data["perplexity_a"], perplexity_b=data["perplexity_b"],
                              engine_b=data["engine_b"])
    if check and not result.ok:
        raise CheckFailed(f"mean KL divergence {result.kl_mean:.4g} is above --max-kl {max_kl:g}", file=b,
                          result=result)
    return result


def validate(a: str | os.PathLike[str], b: str | os.PathLike[str], *, device: str = "auto",
             tol: float | None = None, samples: int = 32, seed: int = 0, rows: str = "all",
             kernels: str = "sampled", check: bool = True,
             progress: ProgressCallback | None = None) -> ValidateResult:
    """Check layer by layer that checkpoints ``a`` and ``b`` compute the same thing (seeded activations
    through both sides' exact weights, and the producers' own kernels where installed; bounds in
    docs/validate.md). tol: a relative Frobenius tolerance per layer for lossy pairs. check=True (default)
    raises ``ValidationFailed`` (exit 1, ``err.result`` the report) unless every layer passes; check=False
    returns the failing report instead."""
    opts = ValidateOptions(device, tol, samples, seed, rows, kernels)
    _flag("check", check)
    _path("a", a), _path("b", b)
    from .validation import validate as run_validate

    with reporting(_progress(progress)):
        data = run_validate(a, b, samples=opts.samples, seed=opts.seed, tol=opts.tol, device=opts.device,
                            rows=opts.rows, kernels=opts.kernels)
    only_a = tuple(m for c in data["components"] for m in c["only_in_a"]) + tuple(data["components_only_in_a"])
    only_b = tuple(m for c in data["components"] for m in c["only_in_b"]) + tuple(data["components_only_in_b"])
    result = ValidateResult(data=data, a=data["a"], b=data["b"], ok=data["ok"], layers=tuple(data["layers"]),
                            failed=tuple(layer["module"] for layer in data["layers"] if not layer["ok"])
                            + tuple(d["tensor"] for c in data["components"] for d in c["tensors"]["differ"]),
                            only_in_a=only_a, only_in_b=only_b)
    if check and not result.ok:
        if result.failed:
            why = f"{len(result.failed)} layers or tensors differ (first: {result.failed[0]})"
        elif only_a or only_b:
            why = f"on one side only: {', '.join((only_a + only_b)[:5])}"
        else:
            why = "no layer in common: nothing was compared, which proves nothing"
        raise ValidationFailed(f"{a} and {b} do not compute the same thing: {why}", result=result)
    return result
