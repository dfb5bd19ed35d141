"""The model card every writing verb leaves with its output (engine.run calls ``Card.write`` after the
result is written and read back, before it is published): a folder's README.md, or ``<name>.md`` beside a
one-file target (a GGUF and its mmproj file). What a release publishes beside the weights, from the run's
own report:

* the Hub's YAML front matter: ``base_model`` (--base-model; else the base a quantized source's own card
  names; else the Hugging Face cache repository SRC is a snapshot of; else config.json's ``_name_or_path``
  where it is a repository id) with ``base_model_relation: quantized``, so the Hub lists the output as a
  quantization of it and not as a fine-tune; ``library_name`` and ``tags`` for the target (its registry
  declaration: Target.hub_library / hub_tags) and bits; the source card's license and pipeline_tag carried;
* the body: source format and target, modules whose codes were kept and those requantized with each one's
  error beside round-to-nearest's, activation scales carried or dropped, --validate's verdict, warnings,
  the qconv version and the command (SRC and DST by their names: the card is the same wherever it runs),
  and the SHA-256 of every source file read or carried and of every output file;
* the source's own card text below it, marked as the source's.

Front matter is written as JSON scalars (YAML's flow style), so no YAML writer is needed; a source card's
front matter is read with yaml.safe_load (gguf's dependency). A source card qconv cannot read (not UTF-8,
its front matter not YAML, over MAX_CARD_BYTES) is not carried: a warning says so, the card is written."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..version import VERSION as __version__
from ..formats.core.threads import threads
from ..formats.storage.checkpoint import SourceRoot, is_pickle, listing
from ..formats.storage.safetensors_header import open_regular

MAX_CARD_BYTES = 4 << 20
CARRIED_KEYS = ("license", "license_name", "license_link", "language", "pipeline_tag")
PICTURE = "qconv-error.png"
MAX_ROWS = 50                  # requantized modules listed one per row (the worst first); --json has all
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Source:
    """What a card takes from SRC: the files the run read or carried (relative name, path), the source
    card's front matter and body, and what could not be read of it."""
    files: list[tuple[str, Path]]
    meta: dict
    body: str | None
    warnings: list[str]


@dataclass(frozen=True)
class Card:
    """A writing verb's card request: the command that reproduces the run (SRC and DST by name), the hub
    names of its target, and --base-model where given."""
    command: str
    library: str | None
    tags: tuple[str, ...]
    base_model: str | None = None

    def path(self, dst: Path, files: bool) -> Path:
        """Where the card lands: DST/README.md, or <DST's stem>.md beside a one-file DST."""
        return dst.with_suffix(".md") if files else dst / "README.md"

    def picture(self, dst: Path, files: bool) -> Path | None:
        """Where its picture of the per-layer error lands (DST/qconv-error.png, or <DST's stem>-error.png
        beside a one-file DST); None where matplotlib (the plot extra) is not installed."""
        if importlib.util.find_spec("matplotlib") is None:
            return None
        return dst.with_name(f"{dst.stem}-error.png") if files else dst / PICTURE

    def source(self, src: Path, pipeline: bool, read: list[Path]) -> "Source":
        """What the card takes from SRC, read before any work (engine.run): a hostile file the hashes would
        open is refused before DST is touched. read: the files of a file SRC (a GGUF's split set)."""
        warnings: list[str] = []
        meta, body = _source_card(src, warnings)
        return Source(_source_files(src, pipeline, read), meta, body, warnings)

    def write(self, tmp: Path, src: Path, dst: Path, files: bool, source: "Source", result: dict) -> dict:
        """The card written into the staging folder tmp (a carried README.md replaced: its text is kept in
        the card); what the result reports of it."""
        name = self.path(dst, files).name
        warnings = list(source.warnings)
        carried = tmp / name
        if carried.is_file() and not files:           # the source's README.md, carried: its text goes below
            carried.unlink()
        picture = self.picture(dst, files)
        drawn = _draw(tmp / picture.name, result) if picture is not None else None
        outputs = sorted((str(p.relative_to(tmp)), p) for p in tmp.rglob("*") if p.is_file())
        hashes = _sha256({**{f"source/{rel}": p for rel, p in source.files},
                          **{f"output/{rel}": p for rel, p in outputs}})
        meta = self._front_matter(src, source.meta, result)
        text = _render(meta, self, src, dst, result, hashes, source.body, warnings, drawn)
        fd = os.open(carried, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return {"file": name, "picture": drawn, "base_model": meta.get("base_model"), "warnings": warnings}

    def _front_matter(self, src: Path, source_meta: dict, result: dict) -> dict:
        meta: dict = {}
        base = self.base_model or _base_model(src, source_meta, result)
        if base:
            meta["base_model"] = base
            meta["base_model_relation"] = "quantized"
        for key in CARRIED_KEYS:
            if key in source_meta and _scalar_or_list(source_meta[key]):
                meta[key] = source_meta[key]
        if self.library:
            meta["library_name"] = self.library
        bits = sorted({b for c in result["components"] for b in c.get("bits", ())})
        meta["tags"] = list(dict.fromkeys(("qconv",) + self.tags + tuple(f"{b}-bit" for b in bits)))
        return meta


def _command(verb: str, src: Path, dst: Path, flags: list[str]) -> str:
    """The command line that reproduces a run: SRC and DST by their names."""
    return " ".join(["qconv", verb, shlex.quote(Path(src).name), shlex.quote(Path(dst).name)]
                    + [shlex.quote(f) for f in flags])


def _flags(opts) -> list[str]:
    """The target options as the writer read them (defaults filled in), as flags: the run reproduced
    whatever the defaults become."""
    from ..formats.core.request import target_options

    flags = []
    for opt in target_options(opts.to):
        value = opts.get(opt.name)
        if value is None:
            continue
        if opt.kind == "flag":
            flags += [opt.flag] if value else []
        elif opt.kind == "pair":
            yes, no = opt.flag.split("/")
            flags.append(yes if value else no)
        else:
            flags += [opt.flag, "x".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return flags


def for_convert(opts, src: Path, dst: Path, base_model: str | None = None, verb: str = "convert",
                check_model: bool = False) -> Card:
    """convert's (and bnb8-to-gptq's: its one option, --scale-dtype) card, its hub names from the target's
    registration (Target.hub_library, hub_tags: the family's name where it declares none)."""
    from ..formats.core.options import FLOAT_TARGETS
    from ..formats.core.registry import file_target, target

    if opts.to in FLOAT_TARGETS:                    # convert --to float16: dequantized
        library, tags = "transformers", ("dequantized",)
    else:
        tgt = file_target(opts.to) or target(opts.to)
        library, tags = tgt.hub_library, tuple(tgt.hub_tags or (tgt.family,))
    if verb == "convert":
        flags = ["--to", opts.to] + _flags(opts) + ([] if opts.search else ["--no-search"])
    else:
        flags = ["--scale-dtype", opts.get("scale_dtype")] if opts.get("scale_dtype") else []
    flags += ["--validate"] if opts.validate else []
    flags += ["--check-model"] if check_model else []
    return Card(_command(verb, src, dst, flags), library, tags, base_model)


def for_dequantize(dtype: str | None, src: Path, dst: Path, base_model: str | None = None) -> Card:
    return Card(_command("dequantize", src, dst, ["--dtype", dtype or "auto"]), "transformers",
                ("dequantized",), base_model)


def is_repo_id(value) -> bool:
    """A Hugging Face repository id (org/name): what --base-model takes and the card writes as base_model."""
    return isinstance(value, str) and _REPO_ID.match(value) is not None


def _scalar_or_list(value) -> bool:
    return isinstance(value, (str, int, float)) or (
        isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value))


def _source_card(src: Path, warnings: list[str]) -> tuple[dict, str | None]:
    """(front matter, body) of SRC's README.md; ({}, None) where it has none (a file SRC: nothing beside it
    is read)."""
    path = src / "README.md"
    if not src.is_dir() or not os.path.lexists(path) or SourceRoot.of(src).check(path) != "file":
        return {}, None
    try:
        with open_regular(path) as f:
            raw = f.read(MAX_CARD_BYTES + 1)
    except OSError as exc:
        warnings.append(f"{path}: cannot be read ({exc.strerror or exc}); the source's card is not carried")
        return {}, None
    if len(raw) > MAX_CARD_BYTES:
        warnings.append(f"{path}: over {MAX_CARD_BYTES >> 20} MiB; the source's card is not carried")
        return {}, None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        warnings.append(f"{path}: not UTF-8; the source's card is not carried")
        return {}, None
    hit = re.match(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|\Z)", text, re.S)
    if not hit:
        return {}, text
    import yaml

    try:
        meta = yaml.safe_load(hit[1])
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        warnings.append(f"{path}: its front matter is not YAML ({getattr(exc, 'problem', None) or 'unreadable'}"
                        f"{f' at line {where.line + 2}' if where else ''}); its metadata is not carried")
        return {}, text[hit.end():]
    if meta is not None and not isinstance(meta, dict):
        warnings.append(f"{path}: its front matter is not a mapping; its metadata is not carried")
        meta = {}
    return meta or {}, text[hit.end():]


def _quantized_source(result: dict) -> bool:
    from ..formats.core.layout import UNQUANTIZED
    from ..formats.core.registry import family

    float_method = family(UNQUANTIZED).method
    return any((c.get("from") or c.get("method")) not in (None, float_method) for c in result["components"])


def _base_model(src: Path, source_meta: dict, result: dict) -> str | None:
    """The model this output is a quantization of, where the source says it."""
    named = source_meta.get("base_model")
    if isinstance(named, list) and len(named) == 1:
        named = named[0]
    if is_repo_id(named) and _quantized_source(result):
        return named                                 # a quantized source: both quantize its base
    blobs = SourceRoot.of(src).blobs                 # a snapshot in the Hugging Face cache: models--org--name
    if blobs is not None and blobs.parent.name.startswith("models--"):
        repo = blobs.parent.name[len("models--"):].replace("--", "/", 1)
        if is_repo_id(repo):
            return repo
    config = src / "config.json"
    if src.is_dir() and config.is_file():
        try:
            name = json.loads(config.read_text(encoding="utf-8")).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            name = None
        if is_repo_id(name) and not os.path.isabs(name):
            return name
    return None


def _source_files(src: Path, pipeline: bool, read: list[Path]) -> list[tuple[str, Path]]:
    """The files of SRC the run read or carried: a file SRC and the files it names (a GGUF's split set);
    a model folder's top-level files; a pipeline's every file. Pickles are never read."""
    if not src.is_dir():
        return sorted({(p.name, p) for p in read} | {(src.name, src)})
    root = SourceRoot.of(src)
    found: list[tuple[str, Path]] = []

    def walk(folder: Path, rel: str) -> None:
        for p in listing(folder):
            if is_pickle(p.name) or p.name.startswith("."):
                continue
            kind = root.check(p)
            if kind == "file":
                found.append((f"{rel}{p.name}", p))
            elif kind == "dir" and pipeline:
                walk(p, f"{rel}{p.name}/")
    walk(src, "")
    return sorted(found)


def _sha256(files: dict[str, Path]) -> dict[str, str]:
    """SHA-256 of each file, on every core (hashlib releases the GIL on large buffers)."""
    def one(path: Path) -> str:
        h = hashlib.sha256()
        with open_regular(path) as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        return h.hexdigest()

    with ThreadPoolExecutor(max(1, threads())) as pool:
        digests = list(pool.map(one, files.values()))
    return dict(zip(files, digests))


def _yaml(meta: dict) -> str:
    lines = []
    for key, value in meta.items():
        if isinstance(value, list):
            lines.append(f"{key}:")
            lines += [f"- {json.dumps(v, ensure_ascii=False)}" for v in value]
        else:
            lines.append(f"{key}: {json.dumps(value, ensure_ascii=False)}")
    return "\n".join(lines)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _component_lines(c: dict) -> list[str]:
    name = c["component"]
    if "to" not in c:                                # dequantized
        return [f"- `{name}`: {c['dequantized_modules']} quantized modules ({c['method']}) dequantized exactly "
                f"to {c['dtype']}"]
    lines = [f"- `{name}`: {c['from']} -> {c['to']}: {c['modules']} quantized modules, **{c['codes_kept']} with "
             f"their codes kept** exactly, {c['requantized']} requantized"
             + (f" (max relative error {c['max_rel_frobenius']:.4g}; {c['sq_error_vs_rtn']:.3g}x round-to-nearest's "
                f"squared error)" if c["requantized"] and c.get("sq_error_vs_rtn") is not None else "")]
    if c.get("scales"):
        lines.append(f"  - scales: {c['scales_rounded']} of {c['scales']} rounded to the stored dtype (max relative "
                     f"error {c['max_scale_rel_error']:.3g})")
    if c.get("static_activation_scales"):
        kept = ", ".join(f"{k}: {v}" for k, v in c["static_activation_scales"].items() if v)
        lines.append(f"  - static activation scales: {kept}")
    split = c.get("experts_split")
    if split:
        lines.append(f"  - {split['fused_tensors']} fused expert tensors written as {split['modules']} per-expert "
                     f"Linears")
    if c.get("gguf_types"):
        lines.append("  - tensor types: " + ", ".join(f"{n} {t}" for t, n in c["gguf_types"].items()))
    if c.get("mmproj"):
        v = c["mmproj"]
        types = ", ".join(f"{n} {t}" for t, n in v.get("gguf_types", {}).items())
        lines.append(f"  - vision tower: `{v['file']}` ({v.get('projector')}: {v.get('tensors')} tensors, {types})")
    a = c.get("activation_cost")
    if a and a.get("layers"):
        lines.append(f"  - run-time {a['activations']} activations change the source matmul's output by "
                     f"{a['median_vs_source_matmul']:.2%} (median layer), {a['max_vs_source_matmul']:.2%} at worst")
    return lines


def _validation_lines(result: dict) -> list[str]:
    lines = []
    for c in result["components"]:
        v = c.get("validation")
        if isinstance(v, dict) and v.get("ok", True):
            what = f"{v['layers']} layers" if "layers" in v else "every tensor"
            lines.append(f"- `{c['component']}`: passed: {what} of the result read back and checked against "
                         f"the source before it was published" + (f" ({v['device']})" if v.get("device") else ""))
    if lines:
        return lines
    if all("to" in c for c in result["components"]):
        return ["- not run (`--validate` checks every layer of the result against the source before it is "
                "published; `qconv validate SRC DST` checks it afterwards)"]
    return ["- not run here: `qconv validate SRC DST` checks every layer of the result against the source"]


def _model_check_lines(result: dict) -> list[str]:
    """--check-model's figures (model_check/): KL divergence of the output's next-token distribution from the
    source's on a text, top-1 agreement and both perplexities, with the engines each side ran in."""
    m = result.get("model_check")
    if m is None:
        return ["- not run (`--check-model` runs the source and the result on a bundled text and reports KL "
                "divergence, top-1 agreement and perplexities; `qconv validate SRC DST --model` afterwards)"]
    if not m["ok"]:
        return [f"- could not run: {_cell(m['refused'])}"]
    lines = [f"The source and this output on {_cell(m['text'])} ({m['tokens']} tokens, SHA-256 `{m['text_sha256']}`), "
             f"the source in {_cell(m['engine_a'])}, this output in {_cell(m['engine_b'])}:", "",
             "| KL divergence, mean | KL, 99th percentile | KL, max | top-1 agreement | perplexity, source | "
             "perplexity, output |", "|---|---|---|---|---|---|",
             f"| {m['kl_mean']:.4g} | {m['kl_p99']:.4g} | {m['kl_max']:.4g} | {m['top1_agreement']:.2%} | "
             f"{m['perplexity_a']:.6g} | {m['perplexity_b']:.6g} |"]
    return lines + [""] + [f"- {_cell(n)}" for n in m["notes"]] if m["notes"] else lines


def _requantized_table(result: dict) -> list[str]:
    rows = [(c["component"], r) for c in result["components"] for r in c.get("layers", [])]
    if not rows:
        return []
    worst = sorted(rows, key=lambda cr: (-cr[1]["rel_frobenius"], cr[1]["module"]))[:MAX_ROWS]
    out = ["", "## Requantized modules", "",
           "Relative Frobenius error of each requantized weight against the source's exact dequantization, beside "
           "plain round-to-nearest's onto the same grid" + (f" (the worst {MAX_ROWS} of {len(rows)}; `--json` lists "
                                                             f"every one)" if len(rows) > MAX_ROWS else "") + ".",
           "", "| component | module | why | error | round-to-nearest |", "|---|---|---|---|---|"]
    out += [f"| {_cell(c)} | `{_cell(r['module'])}` | {_cell(r['reason'])} | {r['rel_frobenius']:.4g} | "
            f"{r['rtn_rel_frobenius']:.4g} |" for c, r in worst]
    return out


def _requantized(result: dict) -> list[dict]:
    """Every requantized module's row of the report, in model order."""
    from ..formats.core.layout import natural_key

    return sorted((r for c in result["components"] for r in c.get("layers", [])), key=lambda r: natural_key(r["module"]))


def _output_errors(result: dict) -> dict[str, float]:
    """--validate's per-layer output error (relative Frobenius of Y = X W^T against the source's), by module."""
    return {m: e for c in result["components"] for m, e in
            ((c.get("validation") or {}).get("output_errors") or {}).items()}


def _draw(path: Path, result: dict) -> str | None:
    """The per-layer error as a PNG at path: each requantized module's relative weight error (bars) beside
    round-to-nearest's (dots), and where --validate ran, every validated layer's output error (crosses; the
    x axis is then every validated layer, a kept one's bar 0), in model order; its name, or None where no
    module was requantized and no output differs (every code kept: the error is 0 everywhere, the card says
    so). Rendered by matplotlib's Agg into pixels and encoded here with the standard library's zlib, so the
    bytes are the same on every machine with the same matplotlib."""
    from ..formats.core.layout import natural_key

    requantized = {r["module"]: r for r in _requantized(result)}
    outputs = _output_errors(result)
    if not requantized and not any(outputs.values()):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg      # no pyplot: the caller's backend untouched
    from matplotlib.figure import Figure

    names = sorted(set(requantized) | set(outputs), key=natural_key)
    fig = Figure(figsize=(9, 3.2), dpi=100)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = list(range(len(names)))
    weights = [requantized[n]["rel_frobenius"] if n in requantized else 0.0 for n in names]
    rtn = [requantized[n]["rtn_rel_frobenius"] if n in requantized else float("nan") for n in names]
    ax.bar(x, weights, width=0.8, color="#d9534f", label="requantized: relative weight error")
    ax.plot(x, rtn, "k.", label="round-to-nearest onto the same grid")
    if outputs:
        ax.plot(x, [outputs.get(n, float("nan")) for n in names], "x", color="#1f5fa8",
                label="--validate: relative output error")
    kept = sum(c.get("codes_kept", 0) for c in result["components"])
    ax.set_xlabel(f"validated layer ({len(names)}, in model order)" if outputs else
                  f"requantized module ({len(names)}, in model order)"
                  + (f"; {kept} more kept their codes (error 0)" if kept else ""))
    ax.set_ylabel("relative Frobenius error")
    ax.set_xlim(-1, len(names))
    top = max([*weights, *(v for v in rtn if v == v), *outputs.values()])
    ax.set_ylim(0, 1.1 * top or 1.0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    canvas.draw()
    buf = canvas.buffer_rgba()
    width, height = int(buf.shape[1]), int(buf.shape[0])
    path.write_bytes(_png(bytes(buf), width, height))
    return path.name


def _png(rgba: bytes, width: int, height: int) -> bytes:
    """RGBA pixels as a PNG (8-bit RGBA, no filter), deflated by the standard library's zlib."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    stride = width * 4
    raw = b"".join(b"\0" + rgba[y * stride:(y + 1) * stride] for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _render(meta: dict, card: Card, src: Path, dst: Path, result: dict, hashes: dict[str, str],
            source_body: str | None, warnings: list[str], picture: str | None) -> str:
    comps = result["components"]
    targets = sorted({c.get("to") or c.get("dtype") for c in comps})
    methods = sorted({c.get("from") or c.get("method") for c in comps})
    base = meta.get("base_model")
    lines = ["---", _yaml(meta), "---", "", f"# {dst.name}", "",
             f"{'A quantization of [' + base + '](https://huggingface.co/' + base + '), c' if base else 'C'}"
             f"onverted from **{', '.join(methods)}** to **{', '.join(targets)}** by qconv {__version__}"
             + ("" if base else " (base model not known: `--base-model ORG/NAME` names it)") + ".",
             "", "## What was kept and what it cost", ""]
    for c in comps:
        lines += _component_lines(c)
    if picture:
        lines += ["", f"![per-layer relative error of the conversion]({picture})"]
    elif any(c.get("layers") for c in comps) or any(_output_errors(result).values()):
        lines += ["", "(The picture of the per-layer error needs matplotlib: `pip install qconv[plot]`.)"]
    lines += _requantized_table(result)
    lines += ["", "## Validation", ""] + _validation_lines(result)
    lines += ["", "## Model-level check", ""] + _model_check_lines(result)
    said = [w for c in comps for w in c.get("warnings", [])] + list(result.get("warnings", [])) + warnings
    if said:
        lines += ["", "## Warnings", ""] + [f"- {_cell(w)}" for w in dict.fromkeys(said)]
    lines += ["", "## Provenance", "", f"qconv {__version__}:", "", "```sh", card.command, "```", "",
              "SHA-256 of every source file read or carried and of every output file:", "",
              "| file | sha256 |", "|---|---|"]
    lines += [f"| `{_cell(name)}` | `{digest}` |" for name, digest in sorted(hashes.items())]
    if source_body is not None and source_body.strip():
        lines += ["", "---", "", f"## The source's model card ({src.name}/README.md, as it was)", "",
                  source_body.strip("\n")]
    return "\n".join(lines) + "\n"
