"""The architecture docs/layout.md describes, checked from the imports (the source read, nothing imported):
core and storage import no family, no generic module imports a family or compares against a family's
name, and no two parts of qconv import each other round a circle. A family is any folder of formats/
besides core/ and storage/ (formats/__init__.py loads each one; it declares itself)."""

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


def _imports(mod: str, path: Path) -> set[str]:
    pkg = mod.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[: len(pkg) - node.level + 1]
            found |= ({".".join(base + node.module.split("."))} if node.module
                      else {".".join(base + [a.name]) for a in node.names})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qconv."):
            found.add(node.module[len("qconv."):])
        elif isinstance(node, ast.Import):
            found |= {a.name[len("qconv."):] for a in node.names if a.name.startswith("qconv.")}
    return found


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


def test_no_circles():
    edges = _graph()
    seen_from = {a: _reach(edges, a) for a in edges}
    circles = sorted({tuple(sorted(b for b in seen_from[a] if a in seen_from[b])) for a in edges if a in seen_from[a]})
    assert circles == [], circles


def _reach(edges, start) -> set[str]:
    out, todo = set(), [start]
    while todo:
        for b in edges.get(todo.pop(), ()):
            if b not in out:
                out.add(b)
                todo.append(b)
    return out


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


@pytest.mark.parametrize("planted, expect", [
    ("from ..formats.bnb.codec import CODEBOOKS\n", "import"),
    ("if m.family == 'gptq':\n    pass\n", "compare"),
])
def test_the_checks_catch_a_planted_branch(tmp_path, monkeypatch, planted, expect):
    """The two checks above fail on the branch they exist to catch (a copy of convert/ with one planted)."""
    import shutil
    import sys

    copy = tmp_path / "qconv"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".*", "tests", "fixtures", "benchmarks", "docs",
                                                               "bin", "*.egg-info", "__pycache__"))
    with open(copy / "convert" / "dequantize.py", "a") as f:
        f.write("\n" + planted)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", copy)
    check = test_no_generic_module_imports_a_family if expect == "import" else \
        test_no_generic_module_compares_against_a_family_name
    with pytest.raises(AssertionError):
        check()


TOY = '''"""A format family that exists only in this test: one folder, nothing else changed."""

from ..core.options import BITS, Option, integer
from ..core.registry import Caps, Dialect, Family, Target, register, register_target

register(Family("toy", "Toy", frozenset({"toy"}), lambda method, qc: method == "toy", lambda tensors, qc: [],
                lambda m, tensors, qc: None, "toy.codec"))
register(Dialect("toy", frozenset({"toy"}), lambda qc, modules, all_modules, comp, warnings: None))
register_target(Target("toy", "toy", Caps(frozenset({4})), lambda spec, shape, g_idx: {}, lambda ctx: {}, "toy.codec",
                       options=(BITS, Option("toy_level", "--toy-level", "toy: its level, 1..3.",
                                             integer("toy_level", 1, 3), number=True))))
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
