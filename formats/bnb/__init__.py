"""bitsandbytes: LLM.int8 (int8 codes, SCB) and 4-bit nf4 / fp4 (flat code books, absmax blocks, double
quant). Its declarations: the bnb8 and bnb4 families, the bitsandbytes dialect, the bnb8 and bnb4-* targets."""

from ..core.options import BITS, Option, one_of, yes_no
from ..core.registry import Caps, Dialect, Family, Target, lazy, register, register_target
from . import header as bnb

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
QUANT_STORAGES = ("uint8", "bfloat16", "float16", "float32")
# The 4-bit targets' own options (codec.fit_4bit, plan_4bit): the block is --block-size, as FP8's 2-D
# block is (bitsandbytes' own keyword, blocksize, and the flag --blocksize are accepted with a warning).
BNB4_OPTIONS = (BITS,
                Option("block_size", "--block-size", "bnb4-nf4, bnb4-fp4: N, the weights each absmax scales, a "
                       "power of two in 32..4096 (default: the source's, else 64)", one_of("block_size", BLOCKSIZES),
                       metavar="N|ROWSxCOLS", deprecated=("blocksize",)),
                Option("double_quant", "--double-quant/--no-double-quant", "bnb4 targets: keep the source's double "
                       "quantization (default) or drop it.", yes_no("double_quant"), kind="pair"),
                Option("quant_storage", "--quant-storage", "bnb4 targets: storage dtype of the packed weight "
                       "(default: the source's, else uint8).", one_of("quant_storage", QUANT_STORAGES),
                       choices=QUANT_STORAGES))


def _config_method(method, qc):
    """quant_method "bitsandbytes": bnb4 or bnb8 from its load_in_* flags."""
    if method != "bitsandbytes":
        return None
    b = bnb.parse_config(qc)
    return "bnb4" if b["load_in_4bit"] else "bnb8" if b["load_in_8bit"] else "bitsandbytes"


def _always(method, qc) -> bool:        # bitsandbytes' tensor names are its own
    return True


register(Family("bnb8", "bitsandbytes LLM.int8", frozenset({"bnb8", "bitsandbytes"}), _always,
                lambda tensors, qc: bnb.find_int8_modules(tensors), lazy("bnb.codec", "check_int8_module"),
                "bnb.codec", bnb.int8_settings, "read_int8_module", needs_config=False, rows=1, scale_tensor=".SCB",
                source_spec="int8_spec", kernel="bnb.kernel"))
register(Family("bnb4", "bitsandbytes 4-bit", frozenset({"bnb4", "bitsandbytes"}), _always,
                lambda tensors, qc: bnb.find_4bit_modules(tensors), lazy("bnb.codec", "check_4bit_module"),
                "bnb.codec", bnb.four_bit_settings, "read_4bit_module", needs_config=False, rows="four_bit_row_step",
                source_spec="four_bit_spec", kernel="bnb.kernel"))
register(Dialect("bitsandbytes", frozenset({"bnb8", "bnb4", "bitsandbytes"}), bnb.lint, resolve=_config_method))

# LLM.int8 (codes kept from 8-bit symmetric per-row sources, SCB = s * 127) and 4-bit nf4 / fp4 (its own
# options, code books, double quant planned per module): header.py and codec.py.
register_target(Target("bnb8", "bnb8", Caps(frozenset({8}), asym=False, grouped=False,
                                            scale_dtypes=frozenset({"F32"}), divisor_scale="F32"),
                       bnb.int8_leaves, bnb.config_writer(False), "bnb.codec",
                       fit=lazy("bnb.codec", "fit_int8"), retarget=lazy("bnb.codec", "retarget_int8"),
                       dynamic_activations="int8 per token, dynamic (LLM.int8: outlier columns in 16-bit)",
                       options=(BITS,)))
for _name, _quant_type in bnb.FOUR_BIT_TARGETS.items():
    register_target(Target(_name, "bnb4", Caps(frozenset({4}), asym=False, per_row=False, grouped=False,
                                               scale_dtypes=frozenset({"F32"}), divisor_scale="F32"),
                           bnb.four_bit_leaves, bnb.config_writer(True), "bnb.codec",
                           fit=lazy("bnb.codec", "fit_4bit", _quant_type), plan=lazy("bnb.codec", "plan_4bit"),
                           options=BNB4_OPTIONS, requantize=lazy("bnb.codec", "requantize_4bit"),
                           retarget=lazy("bnb.codec", "retarget_4bit")))
