"""The architecture docs/layout.md describes, checked from the imports (the source read, nothing imported):
core and storage import no family, no generic module imports a family or compares against a family's
name, no two parts of qconv import each other round a circle, and no two files do either (lazy imports
included: a function-local import that only dodges a circle at run time is still one). A family is any
folder of formats/ besides core/ and storage/ (formats/__init__.py loads each one; it declares itself)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = {"tests", "benchmarks", "bin", "fixtures", "docs"}
SHARED = {"core", "storage"}
FAMILIES = sorted(p.name for p in (ROOT / "formats").iterdir()
                  if p.is_dir() and (p / "__init__.py").exists() and p.name not in SHARED)
# Generic modules allowed to name a family, and why: none.
NAMES_A_FAMILY: dict[str, set[str]] = {}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or rel.parts[0].startswith(".") or any(p.endswith(".egg-info") for p in rel.parts):
            continue
        yield ".".join(rel.with_suffix("").parts), path


def _room(mod: str) -> str:
    p = mod.split(".")
    return f"{p[0]}/{p[1]}" if p[0] in ("formats", "convert") and len(p) > 1 and p[1] != "__init__" else p[0]


def _sites(mod: str, path: Path):
    """Each import of qconv, at any depth: (the module named, the names taken from it, whether it is
    ``from . import a``: no module after the dots)."""
    pkg = mod.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[: len(pkg) - node.level + 1]
            yield ".".join(base + (node.module.split(".") if node.module else [])), [a.name for a in node.names], \
                not node.module
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qconv."):
            yield node.module[len("qconv."):], [a.name for a in node.names], False
        elif isinstance(node, ast.Import):
            yield from ((a.name[len("qconv."):], [], False) for a in node.names if a.name.startswith("qconv."))


def _imports(mod: str, path: Path) -> set[str]:
    found = set()
    for module, names, bare in _sites(mod, path):
        found |= {".".join(filter(None, (module, a))) for a in names} if bare else {module}
    return found


def _file_graph() -> dict[str, set[str]]:
    """file -> the files it takes names from: ``from .x import a`` is x.py (or x/a.py where a is a module of
    the package x), ``from . import a`` is a.py or the package's __init__.py."""
    files = {mod: path for mod, path in _modules()}

    def file_of(name):
        return next((k for k in (name, ".".join(filter(None, (name, "__init__")))) if k in files), None)

    edges = {}
    for mod, path in files.items():
        out = set()
        for module, names, _ in _sites(mod, path):
            for a in names or [None]:
                out.add((a and a != "*" and file_of(".".join(filter(None, (module, a))))) or file_of(module))
        edges[str(path.relative_to(ROOT))] = {str(files[t].relative_to(ROOT)) for t in out if t and t != mod}
    return edges


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod, path in _modules():
        room = _room(mod)
        edges.setdefault(room, set()).update(r for r in map(_room, _imports(mod, path)) if r != room)
    return {a: {b for b in bs if b in edges} for a, bs in edges.items()}


def _is_family(room: str) -> bool:
    return room.startswith("formats/") and room.split("/")[1] in FAMILIES


def test_the_families_are_found():
    assert {"bnb", "gptq", "awq", "compressed_tensors", "fp8", "gguf", "mlx", "modelopt", "mxfp4"} <= set(FAMILIES)
    from qconv.formats.core.registry import families

    assert {f.codec.split(".")[0] for f in families()} == set(FAMILIES)   # every folder declared itself


def _circles(edges) -> list[tuple[str, ...]]:
    seen_from = {a: _reach(edges, a) for a in edges}
    return sorted({tuple(sorted(b for b in seen_from[a] if a in seen_from[b])) for a in edges if a in seen_from[a]})


def test_no_circles():
    circles = _circles(_graph())
    assert circles == [], circles


def test_no_file_circles():
    """Files, not only rooms: formats/core/options.py (the declarations) stands below registry.py, which
    request.py (the model built from the registered targets) stands above; gguf's writer.py and source.py
    import mmproj.py, which takes what it shares with writer.py (Rounding, add_key) from codec.py and
    arch.py below them."""
    circles = _circles(_file_graph())
    assert circles == [], circles


def test_bin_structure_measures_the_same_shape():
    """bin/structure (stdlib) reports no circle of rooms or files and no arrow back up through its LAYERS,
    and counts the files this test reads."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "bin" / "structure"), str(ROOT), "--json"], capture_output=True,
                         text=True, check=True, timeout=120)
    m = json.loads(out.stdout)
    assert (m["circles"], m["file_circles"], m["arrows_back_up"]) == ([], [], [])
    assert m["files"] == len(_file_graph())


def _reach(edges, start) -> set[str]:
    out, todo = set(), [start]
    while todo:
        for b in edges.get(todo.pop(), ()):
            if b not in out:
                out.add(b)
                todo.append(b)
    return out


# issue 46's measured shape: a source file a reader holds whole, a function a reader follows at once
FILE_LINES, FUNCTION_LINES, LONG_FUNCTION_LINES, LONG_FUNCTIONS = 700, 100, 80, 3


def test_the_measured_shape():
    """No source file over 700 lines, no function over 100, at most 3 over 80."""
    big, over, long = [], [], []
    for mod, path in _modules():
        text = path.read_text()
        if len(text.splitlines()) > FILE_LINES:
            big.append(f"{mod}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                (over if n > FUNCTION_LINES else long if n > LONG_FUNCTION_LINES else []).append(f"{mod}.{node.name}: {n}")
    assert not big, f"source files over {FILE_LINES} lines: {big}"
    assert not over, f"functions over {FUNCTION_LINES} lines: {over}"
    assert len(long) <= LONG_FUNCTIONS, f"more than {LONG_FUNCTIONS} functions over {LONG_FUNCTION_LINES} lines: {long}"


def test_core_and_storage_import_no_family():
    edges = _graph()
    bad = sorted((a, b) for a in ("formats/core", "formats/storage") for b in edges[a] if _is_family(b))
    assert bad == []


def test_no_generic_module_imports_a_family():
    edges = _graph()
    bad = sorted((a, b) for a, bs in edges.items() if not _is_family(a) and a != "formats" for b in bs
                 if _is_family(b) and b.split("/")[1] not in NAMES_A_FAMILY.get(a, ()))
    assert bad == []


def _family_names() -> set[str]:
    from qconv.formats.core.registry import dialects, families

    return ({f.name for f in families()} | {m for f in families() for m in f.config_methods}
            | {d.name for d in dialects()}) - {None}


def test_no_generic_module_compares_against_a_family_name():
    """`m.family == "bnb8"`, `cfg_method in ("gptq", "auto-round")`: a branch per format in generic code;
    what a family does differently is a hook it declares."""
    names = _family_names()
    bad = []
    for mod, path in _modules():
        room = _room(mod)
        if _is_family(room) or room == "formats":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                hits = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
                hits -= NAMES_A_FAMILY.get(room, set())
                if hits:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(hits)}")
    assert bad == []


@pytest.mark.parametrize("where, planted, expect", [
    ("convert/dequantize.py", "from ..formats.bnb.codec import CODEBOOKS\n", "import"),
    ("convert/dequantize.py", "if m.family == 'gptq':\n    pass\n", "compare"),
    ("formats/core/registry.py", "def _late():\n    from .detect import dialects\n", "file circle"),
])
def test_the_checks_catch_a_planted_branch(tmp_path, monkeypatch, where, planted, expect):
    """The checks above fail on what they exist to catch (a copy of qconv with one planted): a family
    imported or a family's name compared in convert/, and a lazy import that closes a circle of two files
    in one room, which the rooms' check cannot see (formats/core/detect.py imports registry.py)."""
    import shutil
    import sys

    copy = tmp_path / "qconv"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".*", "tests", "fixtures", "benchmarks", "docs",
                                                               "bin", "*.egg-info", "__pycache__"))
    with open(copy / where, "a") as f:
        f.write("\n" + planted)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", copy)
    check = {"import": test_no_generic_module_imports_a_family,
             "compare": test_no_generic_module_compares_against_a_family_name,
             "file circle": test_no_file_circles}[expect]
    with pytest.raises(AssertionError):
        check()
    if expect == "file circle":
        test_no_circles()                 # one room: only the files' check sees it


TOY = '''"""A format family that exists only in this test: one folder, nothing else changed."""

from ..core.options import BITS, Option, integer
from ..core.registry import Caps, Dialect, Family, Target


class Toy(Family):
    name = "toy"
    method = "Toy"
    config_methods = frozenset({"toy"})
    codec = "toy.codec"


class ToyDialect(Dialect):
    name = "toy"
    config_methods = frozenset({"toy"})


class ToyTarget(Target):
    name = "toy"
    family = "toy"
    caps = Caps(frozenset({4}))
    codec = "toy.codec"
    options = (BITS, Option("toy_level", "--toy-level", "toy: its level, 1..3.", integer("toy_level", 1, 3),
                            number=True))

    def leaves(self, spec, shape, g_idx, **settings):
        return {}

    def quantization_config(self, ctx):
        return {}
'''


def test_a_new_family_is_one_folder(tmp_path):
    """A copy of qconv with one more folder under formats/ and no other change: the family, its dialect and
    its target are registered, the target is a --to choice of the API and the command line, and a config
    naming its method is decoded by it (inspect reports the method); the option it declares is a flag of
    `qconv convert`, a keyword of qconv.convert, checked, and refused for any other target."""
    import json
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "qconv"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".*", "tests", "fixtures", "benchmarks", "docs", "bin",
                                                               "*.egg-info", "__pycache__"))
    (copy / "formats" / "toy").mkdir()
    (copy / "formats" / "toy" / "__init__.py").write_text(TOY)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "toy"}}))
    shutil.copy(ROOT / "fixtures" / "checkpoints" / "llama-fp16" / "model.safetensors", folder)
    script = ("import json, sys, qconv\n"
              "from qconv.formats.core.registry import family, target\n"
              "from qconv.cli import main\n"
              "assert qconv.__file__.startswith(sys.argv[1]), qconv.__file__\n"
              "import inspect\n"
              "from click.testing import CliRunner\n"
              "from qconv.cli import cli\n"
              "def refusal(to, **kw):\n"
              "    try:\n"
              "        qconv.ConvertOptions(to, **kw)\n"
              "    except qconv.UsageError as exc:\n"
              "        return exc.message\n"
              "print(json.dumps({'family': family('toy').method, 'target': target('toy').family,\n"
              "                  'api': 'toy' in qconv.api.targets(),\n"
              "                  'inspect': qconv.inspect(sys.argv[2]).methods,\n"
              "                  'flag': '--toy-level' in CliRunner().invoke(cli, ['convert', '--help']).output,\n"
              "                  'keyword': 'toy_level' in inspect.signature(qconv.convert).parameters,\n"
              "                  'options': list(qconv.target_options('toy')),\n"
              "                  'value': qconv.ConvertOptions('toy', toy_level='2').toy_level,\n"
              "                  'bad': refusal('toy', toy_level=7), 'other': refusal('gptq', toy_level=2)}))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(copy), str(folder)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got == {"family": "Toy", "target": "toy", "api": True, "inspect": ["unquantized"], "flag": True,
                   "keyword": True, "options": ["bits", "toy_level"], "value": 2,
                   "bad": "toy_level (--toy-level) 7 is not an integer in 1..3",
                   "other": "--toy-level: --to gptq takes no such option; its options are --bits, --group-size, "
                            "--sym/--asym, --scale-dtype"}, got


TOY_ARCH = '''"""GGUF architectures that exist only in this test: one module, nothing else changed."""

from .base import Arch, Vision, register

TOWER = Vision("toy_merger", lambda rest, config: None, lambda config, vision, pre, where: [],
               lambda vision: [], lambda vision: [], lambda meta, shapes, where: {}, "toy_vl_text",
               {"processor_class": "ToyProcessor"}, {"image_token_id": ("<|toy_image|>", 7)},
               prefixes=("model.toy_tower.",))
register(Arch("toylm", "toy_lm", "ToyLMForCausalLM", qk_norm=True))
register(Arch("toyvl", "toy_vl", "ToyVLForConditionalGeneration", qk_norm=True, text_of="toylm", vision=TOWER))
'''


def test_a_new_gguf_architecture_is_one_module(tmp_path):
    """A copy of qconv with one more module under formats/gguf/archs/ and no other change: its text model
    and its VL model are mapped (arch_of, a config read back from a GGUF's metadata, its tensors' names),
    its tower is an mmproj tower with its token ids and where its tensors lie, and the structural checks
    hold its model types' attention to the config; a model type it does not declare is still refused,
    and declaring one of its names again is refused."""
    import json
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "qconv"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".*", "tests", "fixtures", "benchmarks", "docs", "bin",
                                                               "*.egg-info", "__pycache__"))
    (copy / "formats" / "gguf" / "archs" / "toy.py").write_text(TOY_ARCH)
    script = ("import json, sys, qconv\n"
              "assert qconv.__file__.startswith(sys.argv[1]), qconv.__file__\n"
              "from qconv.errors import UnsupportedFormat\n"
              "from qconv.formats.core.structure import disagreements\n"
              "from qconv.formats.gguf import arch, archs, mmproj\n"
              "def refused(call, *args):\n"
              "    try:\n"
              "        call(*args)\n"
              "    except (UnsupportedFormat, ValueError) as exc:\n"
              "        return str(exc)\n"
              "meta = {'general.architecture': 'toylm', 'toylm.attention.head_count': 4,\n"
              "        'toylm.embedding_length': 64, 'toylm.feed_forward_length': 128, 'toylm.block_count': 1,\n"
              "        'tokenizer.ggml.tokens': ['a', 'b']}\n"
              "config = arch.config_from(meta, 'toy.gguf')\n"
              "q = {'model.layers.0.self_attn.q_proj.weight': (48, 64)}\n"
              "print(json.dumps({'text': arch.arch_of({'model_type': 'toy_lm'}, 'c').name,\n"
              "                  'vl': arch.arch_of({'model_type': 'toy_vl'}, 'c').text_of,\n"
              "                  'back': [config['model_type'], config['architectures'], config['vocab_size']],\n"
              "                  'names': arch.hf_tensor_names({'model_type': 'toy_vl', 'num_hidden_layers': 1},\n"
              "                                                archs.ARCHS['toy_vl'])[3:5],\n"
              "                  'tower': [mmproj.MODELS['toy_vl'].projector, mmproj.MODELS['toy_vl'].tokens],\n"
              "                  'vision': arch.is_vision('model.toy_tower.blocks.0.weight'),\n"
              "                  'checked': [d.key for d in disagreements(config, q)],\n"
              "                  'unchecked': disagreements({**config, 'model_type': 'toy_other'}, q),\n"
              "                  'undeclared': refused(arch.arch_of, {'model_type': 'toy_other'}, 'c'),\n"
              "                  'twice': refused(archs.register, archs.ARCHS['toy_lm'])}))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(copy)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got == {"text": "toylm", "vl": "toylm", "back": ["toy_lm", ["ToyLMForCausalLM"], 2],
                   "names": ["model.language_model.layers.0.self_attn.q_proj.weight",
                             "model.language_model.layers.0.self_attn.k_proj.weight"],
                   "tower": ["toy_merger", {"image_token_id": ["<|toy_image|>", 7]}], "vision": True,
                   "checked": ["num_attention_heads"], "unchecked": [],
                   "undeclared": "c: model_type 'toy_other' has no GGUF mapping in qconv (mapped: llama, qwen2, "
                                 "qwen2_5_vl, qwen3, qwen3_moe, qwen3_vl, qwen3_vl_moe, toy_lm, toy_vl); nothing "
                                 "written",
                   "twice": "GGUF architecture 'toylm' (toy_lm) is declared twice"}, got
