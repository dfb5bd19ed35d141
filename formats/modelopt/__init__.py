"""NVIDIA ModelOpt: FP8 (per-tensor e4m3) and NVFP4 (W4A4) checkpoints. Its declarations: the modelopt
family and dialect (hf_quant_config.json recognised bare), the modelopt-nvfp4 target."""

from ..core.registry import Caps, Dialect, Family, Target, lazy, register, register_target
from . import header as modelopt

register(Family("modelopt", "ModelOpt", frozenset({"modelopt"}), lambda method, qc: method == "modelopt",
                modelopt.find_modules, modelopt.check, "modelopt.codec", modelopt.settings,
                scale_tensor=".weight_scale", symmetric=lambda m, qc: True, rows=1))
register(Dialect("modelopt", frozenset({"modelopt"}), modelopt.lint, bare=modelopt.is_side_config))
# ModelOpt NVFP4 (quant_algo NVFP4, W4A4): codes, e4m3 scales, weight_scale_2 and the calibrated input_scale
# kept from NVFP4 sources that carry a static activation scale (ModelOpt's own, or compressed-tensors W4A4's
# divisors inverted: core/activation.py); every other source is refused in plan, since no data-free path
# makes an input_scale. Its own fit, plan, share (one weight_scale_2 / input_scale per fused q/k/v and
# gate/up group) and retarget.
register_target(Target(modelopt.NVFP4_TARGET, "modelopt",
                       Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"F8_E4M3"})),
                       modelopt.nvfp4_leaves, modelopt.nvfp4_config, "modelopt.codec",
                       fit=lazy("modelopt.codec", "fit_nvfp4"), plan=lazy("modelopt.codec", "plan_nvfp4"),
                       options=(), share=lazy("modelopt.codec", "share_nvfp4"),
                       retarget=lazy("modelopt.codec", "retarget_nvfp4")))
