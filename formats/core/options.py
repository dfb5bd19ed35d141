"""The conversion's options (one model for every writer: the quantized targets of the registry, the
float dtypes and --to gguf) and the check that refuses an option the target does not take."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError

FLOAT_TARGETS = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Options:
    to: str
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None
    scale_dtype: str | None = None      # None: the source's (bnb int8 sources: float16)
    # Options of the targets that take them (their Target.fit / plan: bitsandbytes 4-bit)
    blocksize: int | None = None        # None: the source's, else 64
    double_quant: bool | None = None    # None: the source's, else off
    quant_storage: str | None = None    # None: the source's, else uint8
    block_size: tuple[int, int] | None = None   # FP8 targets' 2-D block (None: the source's, else 128 x 128)
    source: str | None = None           # the only source method accepted (bnb8-to-gptq: "bnb8")
    search: bool = True                 # False: integer requantization is plain round-to-nearest (--no-search)
    gguf_asym: str = "Q5_0"             # --to gguf: the block type of 4-bit asymmetric modules (Q5_0 or Q4_1)
    gguf_float: bool = False            # --to gguf: modules whose codes cannot be kept stored as float
    gguf_float_type: str = "auto"       # --to gguf: embeddings, lm_head, --gguf-float modules (auto|f32|f16|bf16|q8_0)


# Each target option as the command line spells it; the targets that take it say so (Target.options,
# a file target's FileTarget.options; the float dtypes take none): given to any other, it is a usage error (exit 2).
OPTION_FLAGS = {"bits": "--bits", "group_size": "--group-size", "sym": "--sym/--asym",
                "scale_dtype": "--scale-dtype", "blocksize": "--blocksize", "double_quant": "--double-quant",
                "quant_storage": "--quant-storage", "block_size": "--block-size", "gguf_asym": "--gguf-asym",
                "gguf_float": "--gguf-float", "gguf_float_type": "--gguf-float-type"}


def refuse_options(opts: Options, takes: frozenset) -> None:
    """Refuse an option the target does not take (it would be ignored, or misread), naming both (exit 2)."""
    default = Options(opts.to)
    for field_name, flag in OPTION_FLAGS.items():
        if field_name not in takes and getattr(opts, field_name) != getattr(default, field_name):
            own = [OPTION_FLAGS[f] for f in OPTION_FLAGS if f in takes]
            raise UsageError(f"{flag}: --to {opts.to} takes no such option; "
                             + (f"its options are {', '.join(own)}" if own else "it takes no target options"))
