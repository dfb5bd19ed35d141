"""AWQ GEMM (AutoAWQ, and auto-round's auto_round:auto_awq packing). Its declarations: the awq family and
dialect, the awq target and auto-round's AWQ packing (an internal target --to auto-round picks)."""

from ..core.registry import Caps, Dialect, Family, Target
from ..gptq import AUTO_ROUND_AWQ_TARGET
from ..gptq import header as gptq
from . import header as awq


class Awq(Family):
    """AWQ GEMM's packed words (qweight, qzeros interleaved along the output, scales)."""
    name = "awq"
    method = "AWQ"
    config_methods = frozenset({"awq", "auto-round"})
    codec = "awq.codec"
    header = awq
    scale_tensor = ".scales"

    def claims(self, config_method, qc) -> bool:
        return config_method == "awq" or (config_method == "auto-round" and gptq.auto_round_awq_packed(qc))

    def symmetric(self, m, qc) -> bool:
        return not m.details.get("zero_point", True)


class AwqDialect(Dialect):
    name = "awq"
    config_methods = frozenset({"awq"})
    header = awq


class _AwqLayout(Target):
    family = "awq"
    codec = "awq.codec"

    def leaves(self, spec, shape, g_idx, **settings):
        return awq.writer_leaves(spec, shape, g_idx, **settings)


class AutoRoundAwqTarget(_AwqLayout):
    """auto-round's auto_round:auto_awq packing, which --to auto-round picks for asymmetric 4-bit modules."""
    name = AUTO_ROUND_AWQ_TARGET
    caps = Caps(frozenset({4}), per_row=False, scale_dtypes=frozenset({"F16"}))
    internal = True
    scale_hint = ("auto_round:auto_awq (what --to auto-round writes for this source) stores float16 scales only: "
                  "use --to gptq-v2, or --to compressed-tensors --scale-dtype bfloat16")

    def quantization_config(self, ctx):
        return _AUTO_ROUND_AWQ_CONFIG(ctx)


class AwqTarget(_AwqLayout):
    """AutoAWQ's GEMM checkpoints: one group size for every module (its config holds one)."""
    name = "awq"
    caps = Caps(frozenset({4}), per_row=False, scale_dtypes=frozenset({"F16", "BF16"}), fallback_bits=4,
                one_group_size=True)

    def quantization_config(self, ctx):
        return awq.writer_config(ctx)


_AUTO_ROUND_AWQ_CONFIG = gptq.config_writer(AUTO_ROUND_AWQ_TARGET, awq.AUTO_ROUND_AWQ)
