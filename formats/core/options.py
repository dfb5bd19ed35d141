"""One option a target takes, as the target declares it (``Option``: the keyword, the command line's flag,
the help text and the check that turns a value as given into what its writer reads), the checks a
declaration uses (each a UsageError naming the keyword and the flag), and the declarations several
targets share (the integer targets' bits, group size, sym and scale dtype; the FP8 targets' block).

A leaf of core: it imports nothing of the registry, which takes its defaults from here
(``Target.options``); ``request.py``, above the registry, builds the conversion's one model (``Options``)
and the command line's flags from what the registered targets declare."""

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
