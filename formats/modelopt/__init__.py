"""NVIDIA ModelOpt: FP8 (per-tensor e4m3) and NVFP4 (W4A4) checkpoints. Its declarations: the modelopt
family and dialect (hf_quant_config.json recognised bare), the modelopt-nvfp4 target."""

from ..core.registry import Caps, Dialect, Family, Target
from . import header as modelopt


class ModelOpt(Family):
    name = "modelopt"
    method = "ModelOpt"
    config_methods = frozenset({"modelopt"})
    codec = "modelopt.codec"
    header = modelopt
    scale_tensor = ".weight_scale"
    row_multiple = 1


class ModelOptDialect(Dialect):
    name = "modelopt"
    config_methods = frozenset({"modelopt"})
    header = modelopt

    def bare(self, doc) -> bool:
        return modelopt.is_side_config(doc)


class Nvfp4Target(Target):
    """ModelOpt NVFP4 (quant_algo NVFP4, W4A4): codes, e4m3 scales, weight_scale_2 and the calibrated
    input_scale kept from NVFP4 sources that carry a static activation scale (ModelOpt's own, or
    compressed-tensors W4A4's divisors inverted: core/activation.py); every other source is refused in plan,
    since no data-free path makes an input_scale. Its own fit, plan, share (one weight_scale_2 / input_scale
    per fused q/k/v and gate/up group) and retarget."""
    name = modelopt.NVFP4_TARGET
    family = "modelopt"
    hub_tags = ("modelopt", "nvfp4", "4-bit")
    caps = Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"F8_E4M3"}))
    codec = "modelopt.codec"
    options = ()

    def leaves(self, spec, shape, g_idx, **settings):
        return modelopt.nvfp4_leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return modelopt.nvfp4_config(ctx)

    def fit(self, m, source_spec, request, negotiate):
        return self.codec_module().fit_nvfp4(m, source_spec, request, negotiate)

    def plan(self, ctx):
        return self.codec_module().plan_nvfp4(ctx)

    def share(self, settings):
        return self.codec_module().share_nvfp4(settings)

    def retarget(self, qt, spec, settings):
        return self.codec_module().retarget_nvfp4(qt, spec, settings)
