"""AWQ GEMM (AutoAWQ, and auto-round's auto_round:auto_awq packing). Its declarations: the awq family and
dialect, the awq target and auto-round's AWQ packing (an internal target --to auto-round picks)."""

from ..core.registry import Caps, Dialect, Family, Target, register, register_target
from ..gptq import AUTO_ROUND_AWQ_TARGET
from ..gptq import header as gptq
from . import header as awq

register(Family("awq", "AWQ", frozenset({"awq", "auto-round"}),
                lambda method, qc: method == "awq" or (method == "auto-round" and gptq.auto_round_awq_packed(qc)),
                awq.find_modules, awq.check, "awq.codec", awq.settings, scale_tensor=".scales",
                symmetric=lambda m, qc: not m.details.get("zero_point", True)))
register(Dialect("awq", frozenset({"awq"}), awq.lint))
register_target(Target(AUTO_ROUND_AWQ_TARGET, "awq",
                       Caps(frozenset({4}), per_row=False, scale_dtypes=frozenset({"F16"})), awq.writer_leaves,
                       gptq.config_writer(AUTO_ROUND_AWQ_TARGET, awq.AUTO_ROUND_AWQ), "awq.codec", internal=True,
                       scale_hint="auto_round:auto_awq (what --to auto-round writes for this source) stores float16 "
                                  "scales only: use --to gptq-v2, or --to compressed-tensors --scale-dtype bfloat16"))
register_target(Target("awq", "awq", Caps(frozenset({4}), per_row=False, scale_dtypes=frozenset({"F16", "BF16"}),
                                          fallback_bits=4, one_group_size=True),
                       awq.writer_leaves, awq.writer_config, "awq.codec"))
