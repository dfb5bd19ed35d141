"""The family contract is the base classes (core/registry.py): a family, dialect or target is a class
that registers itself by its name, a name declared twice is refused at import, every family calls the
same hook by the same name, and a writer reads only the options its target declares."""

import re

import pytest

from qconv.formats.core.registry import Dialect, Family, FileTarget, Target, dialects, families, file_targets, targets
from qconv.formats.core.request import Options, declared

from conftest import REPO as ROOT

# what every Options has besides the target options (and "request.py", as comments name the module)
NOT_OPTIONS = {"to", "source", "search", "validate", "overwrite", "max_shard_size", "jobs", "replace", "given", "get",
               "py"}


@pytest.mark.parametrize("base, name, what", [(Family, "gptq", "format family"), (Dialect, "awq", "dialect"),
                                              (Target, "bnb8", "target"), (FileTarget, "gguf", "file target")])
def test_a_name_declared_twice_is_refused_at_import(base, name, what):
    before = {t.name: t for t in (*families(), *dialects(), *targets(), *file_targets())}
    with pytest.raises(TypeError, match=f"{what} '{name}' is registered twice"):
        type("Again", (base,), {"name": name, "__module__": __name__})
    after = {t.name: t for t in (*families(), *dialects(), *targets(), *file_targets())}
    assert after == before                     # the first declaration stands


def test_every_registered_entry_is_an_instance_of_its_class():
    for base, entries in ((Family, families()), (Dialect, dialects()), (Target, targets()),
                          (FileTarget, file_targets())):
        for entry in entries:
            assert isinstance(entry, base) and type(entry) is not base and entry.name == type(entry).name


@pytest.mark.parametrize("base, entries", [(Family, families), (Dialect, dialects), (Target, targets),
                                           (FileTarget, file_targets)], ids=["family", "dialect", "target", "file"])
def test_every_hook_has_the_base_class_name(base, entries):
    """No family calls a hook by a name of its own (find_in_checkpoint, config_writer, int8_leaves): every
    public method of a registered class is one of its base class's."""
    contract = {n for n in dir(base) if not n.startswith("_")}
    for entry in entries():
        own = {n for n in dir(type(entry)) if not n.startswith("_") and callable(getattr(type(entry), n))}
        assert own <= contract, f"{entry!r} defines {sorted(own - contract)}, which no base class method names"


def test_a_target_answers_only_the_options_it_declares():
    every = set(declared())
    for t in (*targets(), *file_targets()):
        if getattr(t, "internal", False):
            continue
        opts = Options(t.name)
        own = {o.name for o in t.options}
        for name in own:
            getattr(opts, name)                # its default where not given
        for name in every - own:
            with pytest.raises(AttributeError, match=f"--to {re.escape(t.name)} does not declare the option"):
                getattr(opts, name)
            assert opts.get(name) is None


_READ = re.compile(r"\b(?:request|opts|ctx\.request)\.([a-z_]+)\b")


def _reads(paths) -> dict[str, set]:
    out: dict[str, set] = {}
    for p in paths:
        for name in set(_READ.findall(p.read_text())) - NOT_OPTIONS:
            out.setdefault(name, set()).add(p.relative_to(ROOT).as_posix())
    return out


def test_a_writer_reads_only_options_its_targets_declare():
    """Each family folder's code reads (request.X, opts.X) only options one of its targets declares; generic
    code (convert/) reads a target option only through Options.get, which serves every target."""
    by_folder: dict[str, set] = {}
    for t in targets():
        by_folder.setdefault(t.codec.split(".")[0], set()).update(o.name for o in t.options)
    for t in file_targets():
        by_folder.setdefault(t.name, set()).update(o.name for o in t.options)
    for folder, own in sorted(by_folder.items()):
        undeclared = {name: files for name, files in _reads((ROOT / "formats" / folder).glob("*.py")).items()
                      if name not in own}
        assert not undeclared, f"formats/{folder}/ reads options its targets do not declare: {undeclared}"
    generic = {n: f for n, f in _reads((ROOT / "convert").glob("*.py")).items() if n in declared()}
    assert not generic, f"convert/ reads target options as attributes (use Options.get): {generic}"


def test_the_check_sees_an_undeclared_read(tmp_path, monkeypatch):
    """The static check above finds a planted read of an option fp8's target does not declare."""
    planted = tmp_path / "formats" / "fp8" / "codec.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def fit(m, src, request, negotiate):\n    return request.quant_storage\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _reads([planted]) == {"quant_storage": {"formats/fp8/codec.py"}}
    with pytest.raises(AssertionError, match="formats/fp8/ reads options its targets do not declare"):
        test_a_writer_reads_only_options_its_targets_declare()
