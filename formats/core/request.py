"""The conversion's options: one model (``Options``) that the Python API (``qconv.ConvertOptions``), the
command line and every writer read, built from what the registered targets declare.

A target declares the options it takes (``Target.options``, ``FileTarget.options``: tuples of ``Option``,
options.py): the keyword and field name, the command line's flag, the help text, and the check that turns
a value as given (a keyword's or a flag's text) into what its writer reads. ``qconv convert``'s flags, the
API's keywords and the refusal of an option a target does not take (exit 2, naming both) all come from
these declarations, gathered here from the registry: a new target's option is declared in its folder,
nowhere else. Two targets may declare the same name with their own check (``block_size``: bitsandbytes
4-bit's 1-D block, FP8's 2-D block), under one flag. The run settings every target shares (validate,
overwrite, max_shard_size, jobs, search) are the model's own fields.

Above the registry; options.py, the declarations and the checks they use, is below it (the registry takes
its defaults from there)."""

from __future__ import annotations

from ...errors import UsageError
from .options import (BLOCK_2D, DEFAULT_MAX_SHARD, FLOAT_TARGETS, Option, check_choice, check_flag, check_int,
                      check_jobs, check_name, parse_size, what)
from .registry import families, file_target, file_targets, target, targets


# --- what the registered targets declare ----------------------------------------------------------------

def declared() -> dict[str, list[tuple[Option, tuple[str, ...]]]]:
    """Every option the --to choices declare: name -> [(declaration, the targets declaring it)], in the
    order of first declaration (the command line's and --help's order)."""
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
    return (tuple(t.name for t in targets() if not t.internal) + tuple(t.name for t in file_targets())
            + FLOAT_TARGETS)


def source_families() -> tuple[str, ...]:
    """The names ``source=`` takes (a verb that converts one family only: bnb8-to-gptq's "bnb8")."""
    return tuple(f.name for f in families())


def target_options(to: str) -> tuple[Option, ...]:
    """The options --to takes (the float dtypes: none)."""
    if to in FLOAT_TARGETS:
        return ()
    own = file_target(to)
    return tuple((own or target(to)).options)


# --- the model -----------------------------------------------------------------------------------------

_RUN = ("source", "search", "validate", "overwrite", "max_shard_size", "jobs")


class Options:
    """What ``qconv convert`` / ``qconv.convert`` takes (``qconv.ConvertOptions``): ``to``, the target
    options it declares (each read as an attribute: ``opts.bits``, its declared default where not given,
    None: "the source's"; an option the target does not declare is an AttributeError, or None through
    ``get`` for code that serves every target), and the run settings. Frozen; checked when made: a ``to``
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
        """A target option its target declares (its value, or its declared default: None, "the source's").
        Any other name is an AttributeError: a writer reads only what its target declares."""
        if name.startswith("__"):
            raise AttributeError(name)
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name in declared():
            raise AttributeError(f"--to {object.__getattribute__(self, 'to')} does not declare the option {name!r}; "
                                 f"a writer reads only the options its target declares (Target.options)")
        raise AttributeError(f"Options has no attribute {name!r}")

    def get(self, name: str):
        """A target option's value where the target declares it, else None ("not given"): for the code that
        serves every target alike (convert's negotiation of bits, group size and symmetry against caps)."""
        return self._values.get(name)

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
