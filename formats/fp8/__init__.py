"""Fine-grained FP8 (transformers / DeepSeek): e4m3 weights in 2-D blocks with float32 weight_scale_inv.
Its declarations: the fp8 family and dialect, the fp8 target."""

from ..core.options import FP8_OPTIONS
from ..core.registry import Caps, Dialect, Family, Target
from . import header as fp8


class Fp8(Family):
    name = "fp8"
    method = "fine-grained FP8"
    config_methods = frozenset({"fp8"})
    codec = "fp8.codec"
    header = fp8
    scale_tensor = ".weight_scale_inv"
    row_multiple = 1


class Fp8Dialect(Dialect):
    name = "fp8"
    config_methods = frozenset({"fp8"})
    header = fp8

    def refuse(self, qc):
        return fp8.refuse(qc)


class Fp8Target(Target):
    """Its own fit (--block-size), quantizer (Fp8Quantize's arithmetic) and retarget (codes kept from e4m3
    sources in the same blocks)."""
    name = "fp8"
    family = "fp8"
    hub_tags = ("fp8", "8-bit")
    caps = Caps(frozenset({8}), asym=False, per_row=False, scale_dtypes=frozenset({"F32"}), divisor_scale="F32")
    codec = "fp8.codec"
    options = FP8_OPTIONS
    dynamic_activations = "e4m3 per group of 128, dynamic"
    requantize_rows = True

    def leaves(self, spec, shape, g_idx, **settings):
        return fp8.writer_leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return fp8.writer_config(ctx)

    def fit(self, m, source_spec, request, negotiate):
        return self.codec_module().fit(m, source_spec, request, negotiate)

    def requantize(self, source, w, spec, settings):
        return self.codec_module().requantize(source, w, spec, settings)

    def retarget(self, qt, spec, settings):
        return self.codec_module().retarget(qt, spec, settings)
