"""The `qconv` command line: a thin layer over the Python API (api.py), which parses options into the
same frozen options models, prints tables or the results' --json documents, and draws progress on a
terminal. Every command is deterministic, never prompts, and maps each failure to one line on stderr and
a documented exit code (errors.py). Heavy imports happen inside the verbs, so `qconv inspect` never
loads torch."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import click
from click.core import ParameterSource

from . import __version__, api
from .errors import EXIT_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, CheckFailed, QconvError
from .formats.core.options import SCALE_DTYPE
from .formats.core.request import declared
from .formats.core.registry import dialects, families
from .progress import ProgressEvent

EXIT_CODES_HELP = """\b
Exit codes:
  0    success
  1    the check failed (inspect --strict: warnings were found)
  2    bad command line
  3    PATH missing, empty, without safetensors weights, or pickle-only
  4    corrupt or inconsistent checkpoint (header, offsets, index, config JSON)
  5    a layout or method qconv does not handle
  6    the output cannot be written
  70   internal error (a bug in qconv; QCONV_DEBUG=1 shows the traceback)
  130  interrupted
"""


def _formats_help() -> str:
    """`qconv --help`'s formats, from the registry, so it names every one qconv holds: the formats it reads
    (each quantized family's report name, and a config language reported under its own name, auto-round,
    after the family it decodes to) and the --to targets it writes, quantized, file and float."""
    reads: list[str] = []
    for f in families():
        if f.quantized:
            reads += [f.method] + sorted(name for d in dialects() for name in d.reported_as_itself
                                         if name in f.config_methods and name not in reads)

    def paragraph(text: str) -> str:          # unwrapped by click (\b), never broken at a name's hyphen
        return "\b\n" + textwrap.fill(text, 76, subsequent_indent="  ", break_on_hyphens=False,
                                       break_long_words=False)

    return (paragraph(f"Reads float checkpoints and {', '.join(reads)}.") + "\n\n"
            + paragraph(f"Writes (convert --to): {', '.join(api.targets())}."))


@click.group(help="Inspect, convert, dequantize and validate quantized LLM/VLM checkpoints.\n\n" + _formats_help(),
             epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qconv")
def cli() -> None:
    pass


@cli.command("inspect", epilog=EXIT_CODES_HELP)
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
@click.option("--all-modules", is_flag=True,
              help="List every quantized module instead of folding numbered layers.")
@click.option("--strict", is_flag=True, help="Exit 1 when any warning is reported.")
def inspect_cmd(path: Path, as_json: bool, all_modules: bool, strict: bool) -> int:
    """Describe the checkpoint at PATH from its headers and configs alone.

    PATH is a model folder (one safetensors file, or shards with an index), a single .safetensors
    file, a diffusers-style pipeline folder (model_index.json), whose weight-holding components
    are each reported under their folder name, or a GGUF file (its header: model, ggml types,
    tokenizer). Tensor data is never read (but for bitsandbytes' few-byte quant_state and
    weight_format tensors) and torch is never imported.
    """
    from .inspection import render_text

    try:
        result, code = api.inspect(path, strict=strict), EXIT_OK
    except CheckFailed as failed:            # --strict: the report is printed, then exit 1
        result, code = failed.result, EXIT_FAILED
    click.echo(result.to_json() if as_json else render_text(result.data, all_modules=all_modules))
    return code


class _TerminalProgress:
    """Progress events drawn as one rewritten line on stderr, only when stderr is a terminal."""

    def __init__(self):
        self.started: dict[str, float] = {}

    def __call__(self, e: ProgressEvent) -> None:
        t0 = self.started.setdefault(e.task, time.monotonic())
        pct = 100 * e.done / e.total
        if e.unit == "bytes":
            rate = e.done / max(time.monotonic() - t0, 1e-6) / 1e9
            text = f"{e.done / 1e9:.2f}/{e.total / 1e9:.2f} GB  {rate:.2f} GB/s "
        else:
            text = f"{e.done}/{e.total} {e.unit} "
        sys.stderr.write(f"\r{e.task}: {pct:5.1f}%  {text}")
        if e.done >= e.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _progress():
    return _TerminalProgress() if sys.stderr.isatty() else None


def _echo_warnings(result: dict) -> None:
    for comp in result["components"]:
        for w in comp["warnings"]:
            click.echo(f"qconv: warning: {comp['component']}: {w}", err=True)
    for w in result.get("warnings", []):
        click.echo(f"qconv: warning: {w}", err=True)


def _summary_table(result: dict) -> str:
    from tabulate import tabulate

    rows = [(c["component"], c["method"], c["dtype"], c["dequantized_modules"], c["tensors"],
             len(c["shards"]), f"{c['bytes_written'] / 1e9:.3f}") for c in result["components"]]
    text = tabulate(rows, headers=["component", "source method", "dtype", "dequantized modules",
                                   "tensors", "shards", "GB written"])
    return f"{text}\nwrote {result['destination']} in {result['seconds']:.1f} s"


_JOBS = click.option("--jobs", type=click.IntRange(min=1), default=None, metavar="N",
                     help="Worker processes writing the output shards (--to gguf: threads encoding its "
                          "modules; default: the machine's cores); the output is the same bytes whatever N.")


_CARD = [click.option("--card/--no-card", default=True, show_default=True,
                      help="Write the model card (docs/card.md): DST's README.md, or <name>.md beside a GGUF, "
                           "with the Hub's front matter, what was kept and what it cost, and the SHA-256 of every "
                           "source and output file."),
         click.option("--base-model", metavar="ORG/NAME", default=None,
                      help="The Hub repository the output is a quantization of, for the card (default: what the "
                           "source's card, cache folder or config.json says).")]


def _card_options(fn):
    for option in reversed(_CARD):
        fn = option(fn)
    return fn


@cli.command("dequantize", epilog=EXIT_CODES_HELP)
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(api.DEQUANTIZE_DTYPES), default="auto",
              show_default=True, help="Output dtype; auto = the model's own dtype (config.json).")
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists and is not empty.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest output shard, e.g. 5GB, 500MB.")
@_JOBS
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@_card_options
def dequantize_cmd(src: Path, dst: Path, dtype: str, overwrite: bool, max_shard_size: str, jobs: int | None,
                   as_json: bool, card: bool, base_model: str | None) -> int:
    """Write SRC (any format qconv reads: `qconv --help` lists them) to
    DST as a standard unquantized folder: sharded safetensors with an index, config.json without
    quantization_config, and every other file copied. Pipelines: each quantized component is dequantized, the rest copied.

    Output is written to a temporary folder beside DST and renamed at the end; SRC is never written.
    """
    result = api.dequantize(src, dst, dtype=dtype, overwrite=overwrite, max_shard_size=max_shard_size,
                            jobs=jobs, progress=_progress(), card=card, base_model=base_model)
    _echo_warnings(result.data)
    click.echo(result.to_json() if as_json else _summary_table(result.data))
    return EXIT_OK


def _convert_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for c in result["components"]:
        if "to" not in c:                                   # a float target: dequantized
            rows.append((c["component"], c["method"], c["dtype"], c["dequantized_modules"], "-", "-", "-",
                         len(c["shards"]), f"{c['bytes_written'] / 1e9:.3f}"))
            continue
        rounding = (f"{c['scales_rounded']}/{c['scales']} (max rel {c['max_scale_rel_error']:.1e})"
                    if c["scales"] else "-")
        requant = (f"{c['requantized']} (max rel {c['max_rel_frobenius']:.3f}; "
                   f"{c['sq_error_vs_rtn']:.2f}x RTN's sq. error)" if c["requantized"] else "0")
        rows.append((c["component"], c["from"], c["to"], c["modules"], c["codes_kept"], requant, rounding,
                     len(c["shards"]), f"{c['bytes_written'] / 1e9:.3f}"))
    text = tabulate(rows, headers=["component", "from", "to", "modules", "codes kept", "requantized",
                                   "scales rounded", "shards", "GB written"])
    lines = [text]
    for c in result["components"]:
        if "validation" in c:
            v = c["validation"]
            lines.append(f"validated {c['component']}: {v['layers']} layers match the source ({v['device']})")
    if "model_check" in result:
        lines.append(_model_check_line(result["model_check"]))
    for c in result["components"]:
        if len(c.get("scale_dtypes") or {}) > 1:       # a target that picks the dtype per module (MLX: exact)
            stored = ", ".join(f"{code} ({n} modules)" for code, n in c["scale_dtypes"].items())
            lines.append(f"  {c['component']}: scales stored as {stored}")
    for c in result["components"]:
        split = c.get("experts_split")
        if split:
            lines.append(f"  {c['component']}: {split['fused_tensors']} fused expert tensors "
                         f"({', '.join(split['examples'])}, ...) written as {split['modules']} per-expert Linears "
                         f"(experts.N.gate_proj / up_proj / down_proj), the layout {c['to']} loaders read")
    for c in result["components"]:
        for r in c.get("layers", []):
            lines.append(f"  {c['component']}: {r['module']}: {r['reason']}: rel. error {r['rel_frobenius']:.4f}"
                         f" (round-to-nearest {r['rtn_rel_frobenius']:.4f}), max abs {r['max_abs']:.3g}")
    for c in result["components"]:
        v = c.get("mmproj")
        if v:
            types = ", ".join(f"{n} {t}" for t, n in v["gguf_types"].items())
            lines.append(f"  {c['component']}: vision tower -> {v['file']} ({v['projector']}: {v['tensors']} tensors, "
                         f"{types}" + (f"; {v['dequantized_modules']} quantized Linears dequantized exactly"
                                       if v["dequantized_modules"] else "")
                         + (f"; {v['codes_kept_modules']} quantized Linears' codes kept as Q8_0"
                            if v.get("codes_kept_modules") else "") + ")")
            if v.get("validation"):
                lines.append(f"validated {v['file']}: {v['validation']['tensors']} tensors read back as the source")
            for r in v["float_rounded"]:
                lines.append(f"  {c['component']}: {v['file']}: {r['tensor']} ({r['source']}) rounded to {r['to']}: "
                             f"{r['values']} values not exact, max rel. error {r['max_rel_error']:.3g}")
    for c in result["components"]:
        for r in c.get("float_rounded", []):
            lines.append(f"  {c['component']}: {r['tensor']} ({r['source']}): float tensor rounded to {r['to']}: "
                         f"{r['values']} values not exact, max rel. error {r['max_rel_error']:.3g}")
    for c in result["components"]:
        a = c.get("activation_cost")
        if a and a["layers"]:
            lines.append(f"  {c['component']}: run-time {a['activations']} activations (this target's kernels) change "
                         f"the output of the source's own matmul ({', '.join(a['source_matmul'])}) by "
                         f"{a['median_vs_source_matmul']:.2%} (median layer), {a['max_vs_source_matmul']:.2%} at "
                         f"worst ({a['worst_layer']}), on {a['samples']} outlier-shaped activation rows")
    dst = Path(result["destination"])
    shards = [s for c in result["components"] for s in c.get("shards", ())]
    if len(shards) > 1 and dst.suffix == ".gguf":     # --to gguf past --max-shard-size: llama.cpp's split files
        return "\n".join(lines) + (f"\nwrote {dst.parent / shards[0]} ... {shards[-1]} ({len(shards)} split files, "
                                   f"read from the first) in {result['seconds']:.1f} s")
    return "\n".join(lines) + f"\nwrote {result['destination']} in {result['seconds']:.1f} s"


def _show_convert(result: api.ConvertResult, as_json: bool) -> int:
    _echo_warnings(result.data)
    click.echo(result.to_json() if as_json else _convert_table(result.data))
    return EXIT_OK


def _target_option(name: str, decls) -> list:
    """One flag of `qconv convert` for a target option, built from the declarations of the targets that
    take it (formats/core/options.Option; two targets may give one name their own meaning: --block-size),
    and a hidden flag for each older spelling. None is "not given": the options model supplies the
    declared default and refuses an option the chosen target does not take."""
    opt = decls[0][0]
    flags = {o.flag for o, _ in decls}
    if len(flags) > 1:
        raise AssertionError(f"option {name} is declared with several flags: {sorted(flags)}")
    text = " ".join(o.help if o.help.endswith(".") else o.help + "." for o, _ in decls)
    choices = {o.choices for o, _ in decls}
    kw = {"default": None, "help": text}
    if opt.kind == "pair":
        options = [click.option(opt.flag, name, **kw)]
    elif opt.kind == "flag":
        options = [click.option(opt.flag, name, is_flag=True, **kw)]
    else:
        kind = (click.Choice(opt.choices) if len(choices) == 1 and opt.choices and not opt.number
                else int if all(o.number for o, _ in decls) else str)
        options = [click.option(opt.flag, name, type=kind, metavar=opt.metavar, **kw)]
    for o, _ in decls:
        for old in o.deprecated:
            options.append(click.option(f"--{old.replace('_', '-')}", f"_deprecated_{old}", default=None,
                                        hidden=True))
    return options


def _target_options(fn):
    """Every target's options, as declared (api.target_options)."""
    for name, decls in reversed(list(declared().items())):
        for option in reversed(_target_option(name, decls)):
            fn = option(fn)
    return fn


_NOT_GIVEN = (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)


def _old_spellings(options: dict, warned: list) -> dict:
    """--blocksize and the like: the declared option they were renamed to; the warning for stderr is
    added to warned (printed once the options are accepted: a refusal stays one line)."""
    for key in [k for k in options if k.startswith("_deprecated_")]:
        value, old = options.pop(key), key[len("_deprecated_"):]
        if value is None:
            continue
        new = next(name for name, decls in declared().items() if any(old in o.deprecated for o, _ in decls))
        flag = f"--{new.replace('_', '-')}"
        warned.append(f"qconv: warning: --{old.replace('_', '-')} is deprecated: use {flag}")
        if options.get(new) not in (None, value):
            raise click.UsageError(f"--{old.replace('_', '-')} {value} and {flag} {options[new]} disagree; give {flag}")
        options[new] = value
    return options


_SCALE_DTYPE = _target_option("scale_dtype", [(SCALE_DTYPE, ("gptq",))])[0]    # bnb8-to-gptq's one option
_COMMON = [*_CARD,
           click.option("--overwrite", is_flag=True, help="Replace DST if it exists and is not empty."),
           click.option("--max-shard-size", default=api.DEFAULT_MAX_SHARD, show_default=True,
                        help="Largest output shard, e.g. 5GB, 500MB."),
           _JOBS,
           click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON."),
           click.option("--validate", is_flag=True, help="Check every layer of the result against the "
                        "source (qconv validate) before it is moved to DST; a failing result is never "
                        "left at DST (exit 1)."),
           click.option("--check-model", is_flag=True, help="Run the source and the result on a bundled text "
                        "(qconv validate --model: KL divergence, top-1 agreement, perplexities; the result in its "
                        "own engine where installed) before DST is published; the figures go into the card and "
                        "the report. Where it cannot run (no tokenizer, ...) both say why and DST is written.")]


def _common(fn):
    for option in reversed(_COMMON):
        fn = option(fn)
    return fn


@cli.command("convert", epilog=EXIT_CODES_HELP)
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--to", "to", required=True,
              type=click.Choice(api.targets()),
              help="Target format (compressed-tensors: pack-quantized W{bits}A16; compressed-tensors-w8a8: "
                   "int8 weights per channel with dynamic per-token int8 activations; awq: AWQ GEMM 4-bit).")
@_target_options
@click.option("--search/--no-search", default=True, show_default=True,
              help="Integer targets: requantize with the per-group error-minimising search, or plain "
                   "round-to-nearest (several times faster, a larger error; reported either way).")
@_common
def convert_cmd(src, dst, to, search, card, base_model, overwrite, max_shard_size, jobs, as_json, validate,
                check_model, **options) -> int:
    """Rewrite SRC in another format at DST, keeping every integer code where the arithmetic allows
    (bnb8 <-> GPTQ 8-bit per-row symmetric or compressed-tensors W8A8 / W8A16 per channel; GPTQ v1 <-> v2
    <-> auto-round <-> compressed-tensors <-> AWQ where the bits, groups and zero points fit). W8A8 also
    reports what its run-time int8 activations cost. Where codes cannot be kept (nf4/fp4
    to integers, other bits or group sizes, asym to sym) modules are requantized from the source's exact
    weights with a per-group error search, and each one's error is reported next to plain
    round-to-nearest's. An unquantized SRC is quantized the same way, data-free: the Linears of its
    numbered decoder stacks (4-bit, group 128, symmetric by default). Float targets dequantize.
    The target options are each target's own (qconv.target_options()); one the target does not take
    is refused (exit 2).
    """
    warned: list[str] = []
    # the target options given on the command line, whatever their value (one the target does not take is
    # refused at its default too), never what click filled in
    ctx = click.get_current_context()
    given = _old_spellings({k: v for k, v in options.items() if ctx.get_parameter_source(k) not in _NOT_GIVEN},
                           warned)
    api.ConvertOptions(to, validate=validate, overwrite=overwrite, max_shard_size=max_shard_size, jobs=jobs,
                       search=search, **given)          # refused here (exit 2) before any warning is printed
    for line in warned:
        click.echo(line, err=True)
    result = api.convert(src, dst, to=to, validate=validate, overwrite=overwrite, max_shard_size=max_shard_size,
                         jobs=jobs, search=search, progress=_progress(), card=card, base_model=base_model,
                         check_model=check_model, **given)
    return _show_convert(result, as_json)


@cli.command("bnb8-to-gptq", epilog=EXIT_CODES_HELP)
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@_SCALE_DTYPE
@_common
def bnb8_to_gptq_cmd(src, dst, scale_dtype, card, base_model, overwrite, max_shard_size, jobs, as_json,
                     validate, check_model) -> int:
    """Turn a bitsandbytes LLM.int8 checkpoint into GPTQ 8-bit, one scale per output row, symmetric:
    the layout vLLM's Marlin kernels run. Codes are kept exactly (q = CB + 128); scales are SCB / 127,
    stored as float16 unless --scale-dtype says otherwise (the only rounding, reported).
    """
    result = api.bnb8_to_gptq(src, dst, scale_dtype=scale_dtype, validate=validate, overwrite=overwrite,
                              max_shard_size=max_shard_size, jobs=jobs, progress=_progress(), card=card,
                              base_model=base_model, check_model=check_model)
    return _show_convert(result, as_json)


VALIDATE_HELP = """\b
Pass criterion per layer, without --tol; eps is 0 when both sides store
scales alike (any difference is a defect), else the rounding of the coarser
side's scales or weights (float16 2^-11, bfloat16 2^-8, float32 2^-24):
  every weight:  |W_B - W_A| <= (eps + 2^-21) |W_A|  (+2^-25 for float16
                 subnormals; 0 when eps is 0: identical weights),
  every output channel c:
    ||Y_A[:,c] - Y_B[:,c]|| <= (eps + in * 2^-23) * || |X| |W_A[c]|^T ||,
the output bound that follows, in * 2^-23 covering float32 accumulation.
With --tol: relative Frobenius error of Y <= tol (use it for lossy pairs).
"""


@cli.command("validate", epilog=VALIDATE_HELP + "\n" + EXIT_CODES_HELP.replace(
    "1    the check failed (inspect --strict: warnings were found)",
    "1    a layer failed (a NaN or inf included), or nothing was compared"))
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--device", type=click.Choice(api.DEVICES), default="auto", show_default=True)
@click.option("--tol", type=float, default=None, help="Relative Frobenius tolerance per layer (lossy pairs).")
@click.option("--samples", type=click.IntRange(*api.SAMPLES_RANGE), default=32, show_default=True,
              help="Rows of the activation batch.")
@click.option("--seed", type=click.IntRange(*api.SEED_RANGE), default=0, show_default=True)
@click.option("--rows", type=click.Choice(api.ROWS), default="all", show_default=True,
              help="Output rows checked: every one, or (sampled, faster on a CPU) layers above 4096 rows "
                   "on 8 evenly spread windows of 512 rows.")
@click.option("--kernels", type=click.Choice(api.KERNELS), default="sampled", show_default=True,
              help="Layers the producers' own kernels are cross-checked on: each distinct (format, kernel, "
                   "shape) once plus 16 layers drawn with --seed, or every layer.")
@click.option("--model", "model", is_flag=True,
              help="Instead, the model-level check: both models run on a text (KL divergence of B's next-token "
                   "distribution from A's, mean / p99 / max, top-1 agreement, both perplexities); A in "
                   "transformers, B in its own engine (llama.cpp, mlx-lm) where installed.")
@click.option("--text", type=click.Path(path_type=Path), default=None,
              help="--model: a UTF-8 text of at least 64 tokens (default: the bundled public-domain text).")
@click.option("--engine", type=click.Choice(api.MODEL_ENGINES), default="auto", show_default=True,
              help="--model: where B runs: its format's engine where it imports (auto), transformers, or its "
                   "engine only (native: refused where it is not installed).")
@click.option("--engine-python", type=click.Path(path_type=Path), default=None,
              help="--model: the Python that has B's engine (default: this one).")
@click.option("--max-kl", type=float, default=None,
              help="--model: fail (exit 1) when the mean KL divergence is above this.")
@click.option("--json", "as_json", is_flag=True, help='Print {"ok", "layers": [...]} as JSON.')
def validate_cmd(a, b, device, tol, samples, seed, rows, kernels, model, text, engine, engine_python, max_kl,
                 as_json) -> int:
    """Check layer by layer that checkpoints A and B compute the same thing: the same seeded
    activations through both sides' exact weights (and through the producer's own kernel where it is
    installed: bitsandbytes int8 and 4-bit, auto-round's CPU kernel; by default on each distinct
    format, kernel and shape once plus a seeded sample of layers), on the GPU when there is one.
    Modules on one side only are reported and fail. With --model, how far B is from A end to end
    instead (docs/validate.md)."""
    ctx = click.get_current_context()
    per_layer = [n for n in ("device", "tol", "samples", "seed", "rows", "kernels")
                 if ctx.get_parameter_source(n) not in _NOT_GIVEN]
    per_model = [n for n in ("text", "engine", "engine_python", "max_kl") if ctx.get_parameter_source(n) not in _NOT_GIVEN]
    if model and per_layer:
        raise click.UsageError(f"--{per_layer[0]} is a per-layer option; --model runs the model-level check")
    if not model and per_model:
        raise click.UsageError(f"--{per_model[0].replace('_', '-')} needs --model")
    if model:
        checked = api.check_model(a, b, text=text, engine=engine, python=engine_python, max_kl=max_kl, check=False,
                                  progress=_progress())
        click.echo(checked.to_json() if as_json else _model_check_line(checked.data))
        return EXIT_OK if checked.ok else EXIT_FAILED
    result = api.validate(a, b, device=device, tol=tol, samples=samples, seed=seed, rows=rows, kernels=kernels,
                          check=False, progress=_progress())
    click.echo(result.to_json() if as_json else _validate_table(result.data))
    return EXIT_OK if result.ok else EXIT_FAILED


def _model_check_line(m: dict) -> str:
    if "refused" in m:
        return f"model check: could not run: {m['refused']}"
    line = (f"model check ({m['tokens']} tokens; B in {m['engine_b']}): KL mean {m['kl_mean']:.4g}, "
            f"p99 {m['kl_p99']:.4g}, max {m['kl_max']:.4g}; top-1 agreement {m['top1_agreement']:.2%}; "
            f"perplexity A {m['perplexity_a']:.6g}, B {m['perplexity_b']:.6g}")
    if "max_kl" in m:
        line += f"; {'within' if m['ok'] else 'FAIL: above'} --max-kl {m['max_kl']:g}"
    return "\n".join([line] + [f"  note: {n}" for n in m["notes"]])


def _validate_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for layer in result["layers"]:
        if "problem" in layer:
            rows.append((layer["module"], "FAIL", layer["problem"], "", "", "", ""))
            continue
        kernels = ", ".join(f"{k['kernel']} could not run" if k["ok"] is None else
                            f"{k['kernel']} {k['rel_frobenius']:.1e}{'' if k['ok'] else ' FAIL'}"
                            for k in layer.get("kernels", {}).values())
        result_cell = "ok" if layer["ok"] else "FAIL"
        if layer.get("weights_over_bound"):
            row, col = layer["first_weight_over_bound"]
            result_cell += f" ({layer['weights_over_bound']} weights off, first [{row}, {col}])"
        rows.append((layer["module"], result_cell, f"{layer['max_abs']:.3g}",
                     f"{layer['rel_frobenius']:.2e}", f"{layer['cosine']:.8f}", layer["worst_channel"], kernels))
    lines = [tabulate(rows, headers=["module", "result", "max abs", "rel. error", "cosine", "worst channel",
                                     "own kernels"])]
    for c in result["components"]:
        where = f" ({c['component']})" if len(result["components"]) > 1 else ""
        t = c.get("tensors", {"compared": 0, "differ": []})
        for d in t["differ"]:
            lines.append(f"FAIL tensor {d['tensor']}{where} ({d['dtypes'][0]} vs {d['dtypes'][1]}): {d['problem']}")
        lines.append(f"other tensors{where} (biases, norms, buffers...): {t['compared'] - len(t['differ'])}/"
                     f"{t['compared']} identical or within their dtype change's rounding")
        for side in ("a", "b"):
            if c[f"only_in_{side}"]:
                lines.append(f"only in {side.upper()} ({c['component']}): {', '.join(c[f'only_in_{side}'])}")
    for side in ("a", "b"):
        if result.get(f"components_only_in_{side}"):
            lines.append(f"components only in {side.upper()}: {', '.join(result[f'components_only_in_{side}'])}")
    if not result["layers"]:
        lines.append("no layer in common: nothing was compared, which proves nothing")
    for c in result["components"]:
        where = f" ({c['component']})" if len(result["components"]) > 1 else ""
        for k in c.get("kernels", []):
            line = f"own kernel {k['kernel']} on {k['side'].upper()}{where}: checked {k['checked']} of {k['layers']} layers"
            if k["mode"] == "sampled" and k["checked"] + k["could_not_run"] < k["layers"]:
                line += f" (each shape once + a sample drawn with --seed {k['seed']}; --kernels all checks every layer)"
            if k["could_not_run"]:
                line += f", could not run on {k['could_not_run']}"
            if k["failed"]:
                line += f", {k['failed']} FAILED"
            lines.append(line)
    errors = sorted({f"{k['kernel']}: {k['error']}" for layer in result["layers"]
                     for k in layer.get("kernels", {}).values() if k["ok"] is None})
    for error in errors:
        lines.append(f"warning: kernel cross-check could not run ({error}); those layers rest on qconv's decoding")
    failed = sum(not layer["ok"] for layer in result["layers"])
    sampled = sum(bool(layer.get("sampled")) for layer in result["layers"])
    differ = sum(len(c.get("tensors", {}).get("differ", [])) for c in result["components"])
    one_side = sum(len(c[f"only_in_{s}"]) for c in result["components"] for s in ("a", "b"))
    lines.append(f"{'OK' if result['ok'] else 'FAILED'}: {len(result['layers']) - failed}/{len(result['layers'])} "
                 f"layers pass" + (f", {differ} other tensors differ" if differ else "")
                 + (f", {one_side} on one side only" if one_side else "")
                 + f" on {result['components'][0]['device'] if result['components'] else '-'}"
                 + (f" ({sampled} large layers on sampled rows; --rows all checks every row)" if sampled else ""))
    return "\n".join(lines)


def _interrupted(exc: BaseException) -> bool:
    """Whether an interrupt (Ctrl-C, SIGTERM, SIGHUP) is behind the exception: a signal can arrive inside
    code that wraps what it raises (Python's class creation does: "Error calling __set_name__")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv: list[str] | None = None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="qconv", standalone_mode=False)
    except click.exceptions.Exit as exc:          # --help, --version
        sys.exit(exc.exit_code)
    except click.ClickException as exc:           # usage errors: exit 2, one line like every error
        hint = f" (qconv {exc.ctx.info_name} --help)" if getattr(exc, "ctx", None) is not None \
            and exc.ctx.info_name != "qconv" else " (qconv --help)"
        click.echo(f"qconv: error: {exc.format_message()}{hint}".replace("\n", " "), err=True)
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo("qconv: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except QconvError as exc:
        click.echo(f"qconv: error: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    except BrokenPipeError:                       # `qconv inspect ... | head`
        sys.stderr.close()
        sys.exit(EXIT_OK)
    except Exception as exc:
        if _interrupted(exc):                     # a signal surfacing through code that wrapped it
            click.echo("qconv: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        if os.environ.get("QCONV_DEBUG"):
            raise
        click.echo(f"qconv: internal error: {type(exc).__name__}: {exc} (a bug in qconv; rerun "
                   f"with QCONV_DEBUG=1 for the traceback and report it)", err=True)
        sys.exit(EXIT_INTERNAL)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)
