"""compressed-tensors (llm-compressor): pack-quantized and int-quantized integers, float-quantized FP8,
NVFP4 and MXFP4. Its declarations: the ct family, the compressed-tensors dialect and five targets."""

from ..core.options import FP8_OPTIONS
from ..core.registry import Caps, Dialect, Family, Target, lazy, register, register_target
from . import float_writer as fw
from .config import INT, PACKED
from .header import check, find_modules
from .report import lint, settings
from .writer import writer_config, writer_leaves

register(Family("ct", "compressed-tensors", frozenset({"compressed-tensors"}),
                lambda method, qc: method == "compressed-tensors", find_modules, check,
                "compressed_tensors.decode", settings, scale_tensor=".weight_scale",
                symmetric=lambda m, qc: bool(m.details.get("symmetric", True))))
register(Dialect("compressed-tensors", frozenset({"compressed-tensors"}), lint))

_INT_2_8 = frozenset(range(2, 9))
register_target(Target("compressed-tensors", "ct", Caps(_INT_2_8, divisor_scale="F32"), writer_leaves(PACKED),
                       writer_config(PACKED), "compressed_tensors.codec"))
register_target(Target("compressed-tensors-w8a8", "ct",
                       Caps(frozenset({8}), asym=False, grouped=False, divisor_scale="F32", fallback_bits=8),
                       writer_leaves(INT), writer_config(INT), "compressed_tensors.codec",
                       activations="int8 per token, dynamic", dynamic_activations="int8 per token, dynamic"))
# llm-compressor's float-quantized FP8 (FP8 static per tensor with its input_scale carried, FP8_DYNAMIC per
# channel; FP8_BLOCK with --block-size): its own fit, plan (scales in the model dtype), quantizer
# (llm-compressor's arithmetic) and retarget (codes kept from e4m3 sources in the same structure).
register_target(Target(fw.FP8_TARGET, "ct", Caps(frozenset({8}), asym=False, grouped=False, divisor_scale="F32"),
                       fw.float_leaves, fw.float_config, "compressed_tensors.codec",
                       fit=lazy("compressed_tensors.codec", "fit_fp8"), options=FP8_OPTIONS,
                       dynamic_activations="e4m3, dynamic (per token; per group of a block's width)",
                       plan=lazy("compressed_tensors.codec", "plan_fp8"),
                       requantize=lazy("compressed_tensors.codec", "requantize_fp8"), requantize_rows=True,
                       retarget=lazy("compressed_tensors.codec", "retarget_fp8")))
# llm-compressor's NVFP4A16 (nvfp4-pack-quantized; W4A4 where the source's activation global scales are
# carried): its own fit, plan and share (one global scale per fused q/k/v and gate/up group, from the data),
# quantizer (llm-compressor's arithmetic) and retarget (codes kept from NVFP4 in either dialect).
register_target(Target(fw.NVFP4_TARGET, "ct",
                       Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"F8_E4M3"})),
                       fw.nvfp4_leaves, fw.nvfp4_config, "compressed_tensors.codec",
                       fit=lazy("compressed_tensors.codec", "fit_nvfp4"), options=(),
                       plan=lazy("compressed_tensors.codec", "plan_nvfp4"),
                       share=lazy("compressed_tensors.codec", "share_nvfp4"),
                       requantize=lazy("compressed_tensors.codec", "requantize_nvfp4"), requantize_rows=True,
                       retarget=lazy("compressed_tensors.codec", "retarget_nvfp4")))
# llm-compressor's MXFP4A16 (mxfp4-pack-quantized): its own fit, quantizer (llm-compressor's arithmetic)
# and retarget (codes and e8m0 scales kept from MXFP4).
register_target(Target(fw.MXFP4_TARGET, "ct",
                       Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"U8"})),
                       fw.mxfp4_leaves, fw.mxfp4_config, "compressed_tensors.codec",
                       fit=lazy("compressed_tensors.codec", "fit_mxfp4"), options=(),
                       requantize=lazy("compressed_tensors.codec", "requantize_mxfp4"), requantize_rows=True,
                       retarget=lazy("compressed_tensors.codec", "retarget_mxfp4")))
