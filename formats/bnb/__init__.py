"""bitsandbytes: LLM.int8 (int8 codes, SCB) and 4-bit nf4 / fp4 (flat code books, absmax blocks, double
quant). Its declarations: the bnb8 and bnb4 families, the bitsandbytes dialect, the bnb8 and bnb4-* targets."""

from ..core.options import BITS, Option, one_of, yes_no
from ..core.registry import Caps, Dialect, Family, Target
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


class _Bitsandbytes(Family):
    """What both bitsandbytes families share: tensor names of their own (claimed whatever the config
    says), decoded without a config, through codec.py."""
    config_methods = frozenset({"bnb8", "bnb4", "bitsandbytes"})
    codec = "bnb.codec"
    needs_config = False

    def claims(self, config_method, qc) -> bool:        # bitsandbytes' tensor names are its own
        return True

    def kernel_for(self, m, qc):
        from .kernel import kernel              # torch: only where validate runs it
        return kernel(m, qc)


class Int8(_Bitsandbytes):
    """LLM.int8: int8 codes and SCB (absmax * 127) per output row."""
    name = "bnb8"
    method = "bitsandbytes LLM.int8"
    config_methods = frozenset({"bnb8", "bitsandbytes"})
    scale_tensor = ".SCB"
    row_multiple = 1

    def find_modules(self, tensors, qc):
        return bnb.find_int8_modules(tensors)

    def settings(self, qc, modules):
        return bnb.int8_settings(qc, modules)

    def check_module(self, m, tensors, qc):
        self.codec_module().check_int8_module(m, tensors, qc)

    def read_module(self, m, tensors, qc, dtype, rows=None):
        return self.codec_module().read_int8_module(m, tensors, qc, dtype, rows)

    def source_spec(self, m, tensors, qc):
        return self.codec_module().int8_spec(m, tensors, qc)


class FourBit(_Bitsandbytes):
    """4-bit nf4 / fp4: flat code books, absmax blocks, double quant."""
    name = "bnb4"
    method = "bitsandbytes 4-bit"
    config_methods = frozenset({"bnb4", "bitsandbytes"})

    def find_modules(self, tensors, qc):
        return bnb.find_4bit_modules(tensors)

    def settings(self, qc, modules):
        return bnb.four_bit_settings(qc, modules)

    def check_module(self, m, tensors, qc):
        self.codec_module().check_4bit_module(m, tensors, qc)

    def read_module(self, m, tensors, qc, dtype, rows=None):
        return self.codec_module().read_4bit_module(m, tensors, qc, dtype, rows)

    def source_spec(self, m, tensors, qc):
        return self.codec_module().four_bit_spec(m, tensors, qc)

    def row_step(self, m) -> int:
        return self.codec_module().four_bit_row_step(m)


class BitsandbytesDialect(Dialect):
    name = "bitsandbytes"
    config_methods = frozenset({"bnb8", "bnb4", "bitsandbytes"})
    header = bnb

    def resolve(self, quant_method, qc):
        """quant_method "bitsandbytes": bnb4 or bnb8 from its load_in_* flags."""
        if quant_method != "bitsandbytes":
            return None
        b = bnb.parse_config(qc)
        return "bnb4" if b["load_in_4bit"] else "bnb8" if b["load_in_8bit"] else "bitsandbytes"


class Int8Target(Target):
    """LLM.int8: codes kept from 8-bit symmetric per-row sources, SCB = s * 127."""
    name = "bnb8"
    family = "bnb8"
    hub_tags = ("bitsandbytes", "8-bit")
    caps = Caps(frozenset({8}), asym=False, grouped=False, scale_dtypes=frozenset({"F32"}), divisor_scale="F32")
    codec = "bnb.codec"
    options = (BITS,)
    dynamic_activations = "int8 per token, dynamic (LLM.int8: outlier columns in 16-bit)"

    def leaves(self, spec, shape, g_idx, **settings):
        return bnb.int8_leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return _INT8_CONFIG(ctx)

    def fit(self, m, source_spec, request, negotiate):
        return self.codec_module().fit_int8(m, source_spec, request, negotiate)

    def retarget(self, qt, spec, settings):
        return self.codec_module().retarget_int8(qt, spec, settings)


class _FourBitTarget(Target):
    """4-bit nf4 / fp4: its own options, code books, double quant planned per module."""
    family = "bnb4"
    hub_tags = ("bitsandbytes", "4-bit")
    caps = Caps(frozenset({4}), asym=False, per_row=False, grouped=False, scale_dtypes=frozenset({"F32"}),
                divisor_scale="F32")
    codec = "bnb.codec"
    options = BNB4_OPTIONS
    quant_type: str

    def leaves(self, spec, shape, g_idx, **settings):
        return bnb.four_bit_leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return _FOUR_BIT_CONFIG(ctx)

    def fit(self, m, source_spec, request, negotiate):
        return self.codec_module().fit_4bit(self.quant_type, m, source_spec, request, negotiate)

    def plan(self, ctx):
        return self.codec_module().plan_4bit(ctx)

    def requantize(self, source, w, spec, settings):
        return self.codec_module().requantize_4bit(source, w, spec, settings)

    def retarget(self, qt, spec, settings):
        return self.codec_module().retarget_4bit(qt, spec, settings)


_INT8_CONFIG = bnb.config_writer(False)
_FOUR_BIT_CONFIG = bnb.config_writer(True)


class Nf4Target(_FourBitTarget):
    name = "bnb4-nf4"
    quant_type = bnb.FOUR_BIT_TARGETS["bnb4-nf4"]


class Fp4Target(_FourBitTarget):
    name = "bnb4-fp4"
    quant_type = bnb.FOUR_BIT_TARGETS["bnb4-fp4"]
