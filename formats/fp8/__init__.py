"""Fine-grained FP8 (transformers / DeepSeek): e4m3 weights in 2-D blocks with float32 weight_scale_inv.
Its declarations: the fp8 family and dialect, the fp8 target."""

from ..core.options import FP8_OPTIONS
from ..core.registry import Caps, Dialect, Family, Target, lazy, register, register_target
from . import header as fp8

register(Family("fp8", "fine-grained FP8", frozenset({"fp8"}), lambda method, qc: method == "fp8",
                fp8.find_modules, fp8.check, "fp8.codec", fp8.settings, scale_tensor=".weight_scale_inv",
                symmetric=lambda m, qc: True, rows=1))
register(Dialect("fp8", frozenset({"fp8"}), fp8.lint, refuse=fp8.refuse))
# its own fit (--block-size), quantizer (Fp8Quantize's arithmetic) and retarget (codes kept from e4m3
# sources in the same blocks)
register_target(Target("fp8", "fp8", Caps(frozenset({8}), asym=False, per_row=False,
                                          scale_dtypes=frozenset({"F32"}), divisor_scale="F32"),
                       fp8.writer_leaves, fp8.writer_config, "fp8.codec", fit=lazy("fp8.codec", "fit"),
                       dynamic_activations="e4m3 per group of 128, dynamic", options=FP8_OPTIONS,
                       requantize=lazy("fp8.codec", "requantize"), requantize_rows=True,
                       retarget=lazy("fp8.codec", "retarget")))
