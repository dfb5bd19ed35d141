"""bitsandbytes: LLM.int8 (int8 codes, SCB) and 4-bit nf4 / fp4 (flat code books, absmax blocks, double
quant). Its declarations: the bnb8 and bnb4 families, the bitsandbytes dialect, the bnb8 and bnb4-* targets."""

from ..core.registry import BNB4_OPTIONS, Caps, Dialect, Family, Target, lazy, register, register_target
from . import header as bnb


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
                       options=frozenset({"bits"})))
for _name, _quant_type in bnb.FOUR_BIT_TARGETS.items():
    register_target(Target(_name, "bnb4", Caps(frozenset({4}), asym=False, per_row=False, grouped=False,
                                               scale_dtypes=frozenset({"F32"}), divisor_scale="F32"),
                           bnb.four_bit_leaves, bnb.config_writer(True), "bnb.codec",
                           fit=lazy("bnb.codec", "fit_4bit", _quant_type), plan=lazy("bnb.codec", "plan_4bit"),
                           options=BNB4_OPTIONS, requantize=lazy("bnb.codec", "requantize_4bit"),
                           retarget=lazy("bnb.codec", "retarget_4bit")))
