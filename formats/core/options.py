"""The conversion's options: one model (``Options``) that the Python API (``qconv.ConvertOptions``), the
command line and every writer read, built from what the targets declare.

A target declares the options it takes (``Target.options``, ``FileTarget.options``: tuples of ``Option``):
the keyword and field name, the command line's flag, the help text, and the check that turns a value as
given (a keyword's or a flag's text) into what its writer reads. ``qconv convert``'s flags, the API's
keywords and the refusal of an option a target does not take (exit 2, naming both) all come from these
declarations: a new target's option is declared in its folder, nowhere else. Two targets may declare the
same name with their own check (``block_size``: bitsandbytes 4-bit's 1-D block, FP8's 2-D block), under
one flag. The run settings every target shares (validate, overwrite, max_shard_size, jobs, search) are
the model's own fields."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import UsageError

FLOAT_TARGETS = ("float16", "bfloat16", "float32")
SCALE_DTYPES = FLOAT_TARGETS
DEFAULT_MAX_SHARD = "5GB"


# --- the checks a declaration uses: each raises UsageError naming the keyword and the flag -------------

def what(name: str) -> str:
    """An option as both spellings name it: the keyword and the command line's flag."""
    return f"{name} (--{name.replace('_', '-')})"


def parse_size(value: int | str, name: str = "max_shard_size") -> int:
    """Bytes from 5_000_000_000, "5GB", "500MB", "2GiB", ...; a usage error for anything else (0, negative,
    nan, inf, unknown units)."""
    bad = UsageError(f"{what(name)} {value!r} is not a size like 5GB or 500MB")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        if value >= 1:
            return value
        raise bad
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "B": 1}
    t = str(value).strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            try:
                number = float(t[: -len(unit)])
            except ValueError:
                break
            if math.isfinite(number) and number * factor >= 1:     # not nan, inf, 0 or negative
                return int(number * factor)
            break
    raise bad


def check_choice(name: str, value, choices) -> None:
    """One of choices, or None ("not given")."""
    if value is not None and value not in choices:
        raise UsageError(f"{what(name)} {value!r} is not one of {', '.join(map(str, choices))}")


def check_name(name: str, value, choices) -> None:
    """A required choice: a str naming one of choices (None, a number or a list is not one)."""
    if not isinstance(value, str) or value not in choices:
        raise UsageError(f"{what(name)} {value!r} is not one of {', '.join(map(str, choices))}")


def check_int(name: str, value, lo: int, hi: int | None = None, *, optional: bool = True) -> None:
    """An int in lo..hi (not a bool, a float or a str); None where optional ("not given")."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise UsageError(f"{what(name)} {value!r} is not an integer in {bound}")


def check_flag(name: str, value, *, optional: bool = False) -> None:
    """A yes/no option: True or False (None too where it means "the source's"); "no" is not False."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise UsageError(f"{what(name)} {value!r} is not True or False")


def check_jobs(value: int | None) -> int:
    """--jobs: worker processes that write output shards (convert/parallel.py); None: the machine's cores."""
    from .threads import machine_cores

    check_int("jobs", value, 1)
    return machine_cores() if value is None else value


def integer(name: str, lo: int, hi: int | None = None) -> Callable:
    """A check: an int in lo..hi (the command line's digits too)."""
    def check(value):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        check_int(name, value, lo, hi)
        return value
    return check


def one_of(name: str, choices: tuple, convert: Callable = lambda v: v) -> Callable:
    """A check: one of choices (each as the command line spells it), then convert(value)."""
    def check(value):
        if isinstance(value, str) and value not in choices and any(isinstance(c, int) for c in choices) \
                and value.strip().isdigit():
            value = int(value)
        check_choice(name, value, choices)
        return convert(value)
    return check


def yes_no(name: str) -> Callable:
    def check(value):
        check_flag(name, value)
        return value
    return check


# --- declarations ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Option:
    """One target option: the keyword of ``qconv.convert`` (and ``Options``' attribute) and the flag of
    ``qconv convert``."""
    name: str                        # keyword and attribute (group_size)
    flag: str                        # its flag: "--group-size"; a yes/no pair "--sym/--asym"
    help: str                        # --help's text: which targets, what it does, its default
    check: Callable[[Any], Any]      # value as given (a keyword's, or a flag's text) -> as the writer reads it
    default: Any = None              # what the writer reads when it is not given (None: the source's)
    choices: tuple = ()              # the values the command line offers (click.Choice), where they are few
    metavar: str | None = None
    kind: str = "value"              # "value"; "pair" (--x/--no-x: True, False, None); "flag" (given: True)
    number: bool = False             # the command line's text is an integer (click checks it)
    deprecated: tuple = ()           # older keyword spellings, accepted with a DeprecationWarning (and their
                                     # flags, --blocksize, with a warning on stderr)

    def value(self, given):
        """The value the writer reads: given, checked, or the declared default."""
        return self.check(given) if given is not None else (None if self.default is None else self.check(self.default))


def _group_size(value):
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (value != -1 and value < 1):
        raise UsageError(f"{what('group_size')} {value!r} is not a group size: use -1 (one group per output row) "
                         f"or a positive number")
    return value


BLOCK_MAX = 1 << 16     # a side of a 2-D block: no Linear has more rows or input columns than this


def _block_2d(value) -> tuple[int, int]:
    """An FP8 block: "128x128" (or "128,128"), or a pair of positive ints, each side at most BLOCK_MAX
    (convert refuses a side larger than every module it writes: _check_block_size)."""
    given = value
    if isinstance(value, str):
        parts = value.lower().replace(",", "x").split("x")
        try:
            value = tuple(int(p) for p in parts)
        except ValueError:
            value = None
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise UsageError(f"{what('block_size')} {given!r} is not a 2-D block size for this target: use ROWSxCOLS, "
                         f"e.g. 128x128")
    if max(value) > BLOCK_MAX:
        raise UsageError(f"{what('block_size')} {given!r}: a side of {max(value)} is beyond {BLOCK_MAX}; a block "
                         f"is at most a module's rows x input columns (128x128 is the producers' default)")
    return tuple(value)


# The options of the integer targets (Caps negotiates them against the source), and the FP8 targets' block.
BITS = Option("bits", "--bits", "Target bits (default: the source's).", integer("bits", 2, 8), number=True)
GROUP_SIZE = Option("group_size", "--group-size", "Target group size, -1 per output row (default: the source's); "
                    "must divide the in_features of every quantized module.", _group_size, number=True)
SYM = Option("sym", "--sym/--asym", "Symmetric zero points (default: the source's).", yes_no("sym"), kind="pair")
SCALE_DTYPE = Option("scale_dtype", "--scale-dtype", "Stored dtype of the scales (default: the source's; from "
                     "bitsandbytes int8: float16 for GPTQ and auto-round, float32 for compressed-tensors; AWQ "
                     "stores float16 or bfloat16).", one_of("scale_dtype", SCALE_DTYPES), choices=SCALE_DTYPES)
BLOCK_2D = Option("block_size", "--block-size", "fp8, compressed-tensors-fp8: ROWSxCOLS, the 2-D block of each "
                  "scale (default: the source's FP8 block, else 128x128 for fp8 and one scale per channel for "
                  "compressed-tensors-fp8; no side above 65536 or larger than every module's rows or input columns)",
                  _block_2d, metavar="N|ROWSxCOLS")
INTEGER_OPTIONS = (BITS, GROUP_SIZE, SYM, SCALE_DTYPE)
FP8_OPTIONS = (BLOCK_2D,)


def declared() -> dict[str, list[tuple[Option, tuple[str, ...]]]]:
    """Every option the --to choices declare: name -> [(declaration, the targets declaring it)], in the
    order of first declaration (the command line's and --help's order)."""
    from .registry import file_targets, targets

    out: dict[str, list] = {}
    for t in [t for t in targets() if not t.internal] + list(file_targets()):
        for opt in t.options:
            decls = out.setdefault(opt.name, [])
            for i, (o, names) in enumerate(decls):
                if o == opt:
                    decls[i] = (o, names + (t.name,))
                    break
            else:
                decls.append((opt, (t.name,)))
    return out


def convert_targets() -> tuple[str, ...]:
    """The --to choices: the registry's quantized targets, its file targets (gguf), then the float dtypes."""
    from .registry import file_targets, targets

    return (tuple(t.name for t in targets() if not t.internal) + tuple(t.name for t in file_targets())
            + FLOAT_TARGETS)


def source_families() -> tuple[str, ...]:
    """The names ``source=`` takes (a verb that converts one family only: bnb8-to-gptq's "bnb8")."""
    from .registry import families

    return tuple(f.name for f in families())


def target_options(to: str) -> tuple[Option, ...]:
    """The options --to takes (the float dtypes: none)."""
    from .registry import file_target, target

    if to in FLOAT_TARGETS:
        return ()
    own = file_target(to)
    return tuple((own or target(to)).options)


# --- the model -----------------------------------------------------------------------------------------

_RUN = ("source", "search", "validate", "overwrite", "max_shard_size", "jobs")


class Options:
    """What ``qconv convert`` / ``qconv.convert`` takes (``qconv.ConvertOptions``): ``to``, the target
    options it declares (each read as an attribute: ``opts.bits``; one it does not declare reads as its
    declared default, None: "the source's"), and the run settings. Frozen; checked when made: a ``to``
    that is not a str naming a target, an option the target does not take given with any value but None
    (its default included: what was given is refused, not what differs from a default), an argument of
    the wrong type or a value its check refuses is a UsageError (exit 2)."""

    __slots__ = ("to", "source", "search", "validate", "overwrite", "max_shard_size", "jobs", "_values")

    def __init__(self, to: str, *, source: str | None = None, search: bool = True, validate: bool = False,
                 overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD, jobs: int | None = None,
                 **options):
        import warnings

        check_name("to", to, convert_targets())
        if source is not None and (not isinstance(source, str) or source not in source_families()):
            raise UsageError(f"source {source!r} (the one method a verb converts: bnb8-to-gptq's 'bnb8') is "
                             f"not one of {', '.join(source_families())}")
        for name, flag in (("search", search), ("validate", validate), ("overwrite", overwrite)):
            check_flag(name, flag)
        every = declared()
        for opt in {o for decls in every.values() for o, _ in decls}:   # older spellings: warned, then mapped
            for old in opt.deprecated:
                if old in options:
                    value = options.pop(old)
                    warnings.warn(f"{old}= is deprecated: use {opt.name}=", DeprecationWarning, stacklevel=3)
                    if options.get(opt.name) not in (None, value):
                        raise UsageError(f"{what(old)} and {what(opt.name)} disagree; give {opt.name} only")
                    options[opt.name] = value
        own = {o.name: o for o in target_options(to)}
        for name, value in options.items():
            if name not in every:
                raise UsageError(f"{name!r} is not an option of qconv.convert; the target options are "
                                 f"{', '.join(every)} (qconv.target_options())")
            if name not in own and value is not None:      # given (None: not given), whatever its value
                takes = ", ".join(o.flag for o in own.values())
                raise UsageError(f"{every[name][0][0].flag}: --to {to} takes no such option; "
                                 + (f"its options are {takes}" if takes else "it takes no target options"))
        set_ = object.__setattr__
        set_(self, "to", to)
        set_(self, "source", source)
        set_(self, "search", search)
        set_(self, "validate", validate)
        set_(self, "overwrite", overwrite)
        set_(self, "max_shard_size", parse_size(max_shard_size))
        set_(self, "jobs", check_jobs(jobs))
        set_(self, "_values", {name: own[name].value(options.get(name)) for name in own})

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        for decls in declared().get(name, ()):              # an option of another target: its default
            return None if decls[0].default is None else decls[0].check(decls[0].default)
        raise AttributeError(f"Options has no attribute {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError("Options is frozen: use replace()")

    def replace(self, **changes) -> "Options":
        """A copy with some values changed as they are (convert's own: a negotiated group size, the target
        a packing picked), not checked again."""
        new = object.__new__(Options)
        for slot in self.__slots__:
            object.__setattr__(new, slot, dict(self._values) if slot == "_values" else getattr(self, slot))
        for name, value in changes.items():
            if name in ("to",) + _RUN:
                object.__setattr__(new, name, value)
            else:
                new._values[name] = value
        return new

    def given(self) -> dict:
        """The target options as the writer reads them (name -> value)."""
        return dict(self._values)

    def __reduce__(self):                    # pickled for the --jobs workers
        return _restore, ({slot: getattr(self, slot) for slot in self.__slots__},)

    def __eq__(self, other):
        return isinstance(other, Options) and all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    def __hash__(self):
        return hash((self.to, tuple(sorted((k, repr(v)) for k, v in self._values.items()))))

    def __repr__(self):
        values = ", ".join(f"{k}={v!r}" for k, v in self._values.items() if v is not None)
        return f"Options({self.to!r}{', ' + values if values else ''})"


def _restore(state: dict) -> Options:
    new = object.__new__(Options)
    for slot, value in state.items():
        object.__setattr__(new, slot, value)
    return new
