"""`qconv convert` and `qconv bnb8-to-gptq`: rewrite a checkpoint in another format through the
canonical representation (read with the source's codec, write with the target's), keeping codes
exactly wherever the arithmetic allows.

Lossless paths (each module's codes carried over unchanged):

* bitsandbytes int8 -> GPTQ / auto-round 8-bit, one group per output row, symmetric:
  q = CB + 128, z = 128, s = SCB / 127 stored in --scale-dtype (the only rounding; reported per run);
* GPTQ 8-bit, one group per row, symmetric -> bitsandbytes int8: CB = q - 128, SCB recovered exactly
  (bnb.codec.scb_from_scales), so both round trips are byte-identical;
* GPTQ v1 <-> v2 <-> auto-round (auto_round:auto_gptq): codes, scales and zero points repacked, zero
  points re-encoded one field at a time; bitsandbytes 4-bit repacks (storage dtype, double quant).

Every other path requantizes each module from the source's exact weights (formats/core/requantize.py for integers,
bnb.codec.quantize_4bit for nf4/fp4) and reports the error it adds next to round-to-nearest's. An
unquantized source is quantized the same way, data-free, from its float weights (data_free_modules).

This file plans a component (every module planned from headers before any is laid out, then the target's
share and arrange hooks, the new config), reports it, and checks the result with --validate; each
module's spec in the target is target_spec.py's, its writing module_writer.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import NotStorable, UnsupportedFormat, UsageError
from ..formats.core.activation import activation_report
from ..formats.core.detect import Detection, without_quantization
from ..formats.core.ir import QuantSpec
from ..formats.core.layout import QuantModule, examples, natural_key
from ..formats.core.reader import model_dtype, require_decodable
from ..formats.core.registry import WriteContext, file_target, target as registered_target
from ..formats.storage.checkpoint import Component
from .card import Card
from .dequantize import dequantize_component
from .engine import DEFAULT_MAX_SHARD, OutTensor, made_warnings, passthrough, run, write_component
from .sink import FolderSink
from ..formats.core.options import FLOAT_TARGETS
from ..formats.core.request import Options
from .module_writer import Writing, _module_writer, _ModuleCache, _Stream  # noqa: F401 - tests patch _Stream here
from .parallel import Replan
from .target_spec import PACKED_TARGETS, _one_group_size, _target_spec, _written_target
from ..formats.core.source import check_source, linear_modules, source_spec
from ..formats.core.tally import Tally

TARGETS = PACKED_TARGETS + FLOAT_TARGETS
# Weights of a row-separable target requantizer's window (16 MiB of float32), and of a requantized module's
# window of rows written at a time: read here when a component is planned (module_writer.Writing).
REQUANTIZE_WINDOW = 1 << 22
STREAM_WINDOW = 1 << 22


def _quant_config(comp: Component, opts: Options, specs: dict[str, QuantSpec], desc_act: bool,
                  settings: dict[str, dict] | None = None, requantized: frozenset = frozenset()) -> dict:
    src_qc = comp.config.get("quantization_config") if comp.config else None
    unquantized = tuple(n for n in linear_modules(comp) if n not in specs)
    try:
        return registered_target(opts.to).quantization_config(WriteContext(specs, unquantized, desc_act, src_qc,
                                                              settings or {}, requantized))
    except NotStorable as exc:
        raise UnsupportedFormat(f"cannot be written as {opts.to}: {exc}", file=comp.path) from None


@dataclass
class _Planned:
    """A component's conversion planned from headers (and what a target's plan / share hooks read):
    the output tensors in order, the new config, and the Tally that writing them fills."""
    det: Detection
    modules: list[QuantModule]
    opts: Options                                    # the target that writes them (Target.written_by)
    outputs: dict[str, OutTensor]
    config: dict
    tally: Tally
    bits: tuple[int, ...] = ()                       # the bits its modules are written with

    @property
    def tensors(self) -> list[OutTensor]:
        """The output tensors in the order they are written."""
        return [self.outputs[k] for k in sorted(self.outputs, key=natural_key)]


def _check_block_size(comp: Component, modules: list[QuantModule], opts: Options) -> None:
    """A 2-D --block-size (fp8, compressed-tensors-fp8) larger than every module it would write, in rows or
    in input columns, is refused (exit 2) before anything is written: a block no module has is a typo, and
    the config's weight_block_size would describe blocks the checkpoint does not hold (transformers'
    kernels and its dequantization are sized by it). One larger than some modules only is a partial
    block, as the producers allow: one block over those modules' rows or columns."""
    block = opts.get("block_size")
    if not isinstance(block, tuple) or len(block) != 2 or not modules:
        return
    rows = max(m.out_features // m.experts if m.experts else m.out_features for m in modules)
    cols = max(m.in_features for m in modules)
    over = ([f"{block[0]} rows (the most any module has: {rows})"] if block[0] > rows else []) \
        + ([f"{block[1]} columns (the most input columns any module has: {cols})"] if block[1] > cols else [])
    if over:
        raise UsageError(f"--block-size {block[0]}x{block[1]}: a block of {' and '.join(over)} is larger than "
                         f"every module --to {opts.to} would write; use at most {rows}x{cols} (a module smaller "
                         f"than the block is one block over its rows or columns)", file=comp.path)


def _plan(comp: Component, opts: Options) -> _Planned:
    det = require_decodable(comp)
    modules = check_source(comp, det, opts)
    _check_block_size(comp, modules, opts)
    claimed = det.claimed_tensors | {t for m in modules for t in m.weight_tensors}
    src_dtype = model_dtype(comp, det)
    tally, cache = Tally(), _ModuleCache()
    specs: dict[str, QuantSpec] = {}
    outputs: dict[str, OutTensor] = {}
    # A module is act-order where its g_idx permutes the groups; its family says so from headers and config
    # (details["act_order"]: GPTQ's desc_act, compressed-tensors' weight_g_idx).
    act_orders = {m.name: bool(m.details.get("act_order")) for m in modules}
    desc_act = any(act_orders.values()) and opts.to in PACKED_TARGETS and registered_target(opts.to).caps.act_order
    act_order_kept, lossy_of, settings = [], {}, {}
    planned = {}
    for m in modules:
        src_spec = source_spec(comp, det, m, src_dtype)
        act_order = act_orders[m.name]
        planned[m.name] = (src_spec, act_order, *_target_spec(m, src_spec, opts, comp, act_order, src_dtype))
    if opts.to in PACKED_TARGETS and registered_target(opts.to).caps.one_group_size:
        planned = _one_group_size(comp, modules, planned, opts, src_dtype)
    opts, planned = _written_target(comp, modules, planned, opts, src_dtype)
    writing = Writing(comp, det, opts, src_dtype, tally, cache, REQUANTIZE_WINDOW, STREAM_WINDOW)
    writers = {}
    for m in modules:
        src_spec, act_order, spec, lossy = planned[m.name]
        specs[m.name] = spec
        lossy_of[m.name] = lossy
        with_g_idx = desc_act and act_order and not lossy
        if with_g_idx:
            act_order_kept.append(m.name)
        settings[m.name], writers[m.name] = _module_writer(writing, m, spec, with_g_idx, lossy, src_spec)
    tgt = registered_target(opts.to)
    try:
        settings = tgt.share(settings)
    except NotStorable as exc:
        raise UnsupportedFormat(f"cannot be written as {opts.to}: {exc}", file=comp.path) from None
    for m in modules:
        for t in writers[m.name](settings[m.name]):
            outputs[t.name] = t
    for name, info in comp.tensors.items():
        if name not in claimed:
            outputs[name] = passthrough(info)
    try:                                        # as its loaders name and shape them (MLX: stacked experts)
        outputs = tgt.arrange(outputs)
    except NotStorable as exc:
        raise UnsupportedFormat(f"cannot be written as {opts.to}: {exc}", file=comp.path) from None
    config = without_quantization(comp.config) if comp.config is not None else {}
    config["quantization_config"] = _quant_config(comp, opts, specs, bool(act_order_kept), settings,
                                                  frozenset(n for n, why in lossy_of.items() if why))
    config = tgt.model_config(config)           # the keys its loaders read beyond quantization_config
    return _Planned(det, modules, opts, outputs, config, tally, tuple(sorted({s.bits for s in specs.values()})))


def _replan(comp: Component, opts: Options):
    """A --jobs worker's plan (parallel.Replan): the same tensors, and the Tally its shards fill."""
    p = _plan(comp, opts)
    return p.tensors, p.tally


def convert_component(comp: Component, out_dir: Path, opts: Options, max_shard: int, jobs: int = 1) -> dict:
    if opts.to in FLOAT_TARGETS:
        check_source(comp, require_decodable(comp), opts)
        return dequantize_component(comp, out_dir, opts.to, max_shard, jobs)
    p = _plan(comp, opts)
    written = write_component(comp, out_dir, p.tensors, p.config, max_shard, f"converting {comp.name}",
                              jobs=jobs, replan=Replan(_replan, (opts,)), state=p.tally)
    det, modules, opts = p.det, p.modules, p.opts
    if opts.to in PACKED_TARGETS and registered_target(opts.to).activations:
        from ..formats.storage.checkpoint import open_component
        from .activation_cost import activation_cost
        written["activation_cost"] = activation_cost(comp, det, modules, open_component(out_dir, comp.name))
    summary = p.tally.summary()
    views = [m for m in modules if "rows_of" in m.details]
    if views:           # fused experts written as one Linear per expert (split_experts)
        fused = sorted({m.details["rows_of"][0].name for m in views}, key=natural_key)
        summary["experts_split"] = {"fused_tensors": len(fused), "modules": len(views), "examples": fused[:2]}
    tgt = registered_target(opts.to)
    activations, lost = activation_report(modules, p.outputs, opts.to, tgt.dynamic_activations)
    if any(activations.values()):
        summary["static_activation_scales"] = activations
    return {"component": comp.name, "from": det.method, "to": opts.to, "search": opts.search, "bits": list(p.bits),
            **summary, **written,
            "warnings": list(det.warnings) + made_warnings(comp) + _v1_zero_warning(summary["v1_zero_points"])
            + lost}


def _v1_zero_warning(names: list[str]) -> list[str]:
    """GPTQ v1 stores z - 1, so a zero point of 0 is written as 2^b - 1: readers that add 1 field by field
    (AutoGPTQ, vLLM's exllama path, transformers) get 0 back, GPTQModel's word-wise addition carries
    into the next field and does not. Said per module, with the way out."""
    if not names:
        return []
    return [f"{len(names)} modules have zero points of 0, which GPTQ v1 (stored z-1) writes as 2^bits-1: "
            f"field-wise readers get 0 back, GPTQModel's word-wise decoding does not; --to gptq-v2 stores them "
            f"exactly ({examples(names)})"]


def validation_tolerances(report: dict) -> dict[str, tuple]:
    """Requantized layers are held to the weight error convert measured and reported; every other layer
    to the bound its scale rounding implies (validation/__init__.py)."""
    return {r["module"]: ("weights", r["rel_frobenius"]) for r in report.get("layers", [])}


def check_results(written, *, samples: int = 32, seed: int = 0) -> list[dict]:
    from ..errors import ValidationFailed
    from ..formats.storage.checkpoint import open_component
    from ..validation import validate_components

    results = []
    for comp, out, report in written:
        if report.get("v1_zero_points"):
            # Stored as 2^b - 1, what GPTQModel and auto-round's kernel (transformers' CPU path) add 1 to
            # word-wise, carrying into the next field: the same file is two models to its readers.
            names = report["v1_zero_points"]
            raise ValidationFailed(f"{len(names)} modules have zero points of 0, which GPTQ v1 (stored z-1) "
                                   f"writes as 2^bits-1: field-wise readers get 0 back, GPTQModel's and "
                                   f"auto-round's word-wise decoding another value, so the result cannot be "
                                   f"vouched for; --to gptq-v2 stores them exactly ({examples(names)})",
                                   file=comp.files[0] if comp.files else comp.path)
        tolerances = validation_tolerances(report)
        if "to" not in report:                           # float target: the dequantized weights
            tolerances = None
        result = validate_components(comp, open_component(out, comp.name), samples=samples, seed=seed,
                                     tolerances=tolerances)
        results.append(result)
        failed = [r for r in result["layers"] if not r["ok"]]
        missing = result["only_in_a"] or result["only_in_b"]
        differ = result["tensors"]["differ"]
        if failed or missing or differ or not result["layers"]:      # nothing compared proves nothing
            if differ:
                detail = f"{len(differ)} other tensors differ (first: {differ[0]['tensor']}, {differ[0]['problem']})"
            elif failed:
                first = failed[0]
                kernel = next((k for k in first.get("kernels", {}).values() if k["ok"] is False), None)
                if "problem" in first:
                    why = first["problem"]
                elif kernel and first["rel_frobenius"] == 0 and not first.get("weights_over_bound"):
                    # qconv's decoding matches; only the producer's kernel reads the result otherwise
                    why = f"{kernel['kernel']}'s own kernel reads it differently: relative error " \
                          f"{kernel['rel_frobenius']:.3g}"
                else:
                    why = f"relative error {first['rel_frobenius']:.3g}"
                detail = f"{len(failed)} layers differ (first: {first['module']}, {why})"
            else:
                detail = (f"modules missing from the result: {', '.join(missing)}" if missing else
                          "no layer of the result could be compared with the source")
            # `out` is the staging folder; staging names it as DST in the message
            raise ValidationFailed(f"validation failed, nothing written: {detail}", file=out)
        # each layer's output error (relative Frobenius of Y = X W^T against the source's), for the card's picture
        report["validation"] = {"ok": True, "layers": len(result["layers"]), "device": result["device"],
                                "output_errors": {r["module"]: r["rel_frobenius"] for r in result["layers"]
                                                  if "rel_frobenius" in r}}
    return results


def convert(src: Path, dst: Path, opts: Options, *, overwrite: bool = False,
            max_shard_size: int = DEFAULT_MAX_SHARD, validate: bool = False, jobs: int = 1,
            card: Card | None = None, check=None) -> dict:
    own = file_target(opts.to)
    if own is not None:                         # one file, not a folder: its family's sink (gguf/sink.py)
        sink = own.sink(opts, max_shard=max_shard_size, jobs=jobs, validate=validate)
    elif opts.to in TARGETS:
        sink = FolderSink(lambda comp, out: convert_component(comp, out, opts, max_shard_size, jobs),
                          check_results if validate else None)
    else:
        raise ValueError(opts.to)
    return run(src, dst, sink, overwrite=overwrite, card=card, check=check)
