"""compressed-tensors (llm-compressor): pack-quantized and int-quantized integers, float-quantized FP8,
NVFP4 and MXFP4. Its declarations: the ct family, the compressed-tensors dialect and five targets."""

from ..core.options import FP8_OPTIONS
from ..core.registry import Caps, Dialect, Family, Target
from . import float_writer as fw
from .config import INT, PACKED
from .header import check, find_modules
from .report import lint, settings
from .writer import writer_config, writer_leaves


class CompressedTensors(Family):
    """Every compressed-tensors format, a module described by its format's part (int_modules.py,
    float_modules.py), its data read by decode.py."""
    name = "ct"
    method = "compressed-tensors"
    config_methods = frozenset({"compressed-tensors"})
    codec = "compressed_tensors.decode"
    scale_tensor = ".weight_scale"

    def find_modules(self, tensors, qc):
        return find_modules(tensors, qc)

    def settings(self, qc, modules):
        return settings(qc, modules)

    def symmetric(self, m, qc) -> bool:
        return bool(m.details.get("symmetric", True))

    def check_module(self, m, tensors, qc):
        check(m, tensors, qc)


class CompressedTensorsDialect(Dialect):
    name = "compressed-tensors"
    config_methods = frozenset({"compressed-tensors"})

    def lint(self, qc, modules, all_modules, comp, warnings):
        lint(qc, modules, all_modules, comp, warnings)


_INT_2_8 = frozenset(range(2, 9))


class _CompressedTensorsTarget(Target):
    family = "ct"
    hub_tags = ("compressed-tensors",)
    codec = "compressed_tensors.codec"


class _IntTarget(_CompressedTensorsTarget):
    """The integer formats: their leaves and config written by writer.py for one format."""
    format: str

    def leaves(self, spec, shape, g_idx, **settings):
        return _LEAVES[self.format](spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return _CONFIGS[self.format](ctx)


class PackQuantized(_IntTarget):
    name = "compressed-tensors"
    format = PACKED
    caps = Caps(_INT_2_8, divisor_scale="F32")


class W8A8(_IntTarget):
    name = "compressed-tensors-w8a8"
    hub_tags = ("compressed-tensors", "int8", "8-bit")
    format = INT
    caps = Caps(frozenset({8}), asym=False, grouped=False, divisor_scale="F32", fallback_bits=8)
    activations = "int8 per token, dynamic"
    dynamic_activations = "int8 per token, dynamic"


_LEAVES = {fmt: writer_leaves(fmt) for fmt in (PACKED, INT)}
_CONFIGS = {fmt: writer_config(fmt) for fmt in (PACKED, INT)}


class Fp8(_CompressedTensorsTarget):
    """llm-compressor's float-quantized FP8 (FP8 static per tensor with its input_scale carried, FP8_DYNAMIC
    per channel; FP8_BLOCK with --block-size): its own fit, plan (scales in the model dtype), quantizer
    (llm-compressor's arithmetic) and retarget (codes kept from e4m3 sources in the same structure)."""
    name = fw.FP8_TARGET
    hub_tags = ("compressed-tensors", "fp8", "8-bit")
    caps = Caps(frozenset({8}), asym=False, grouped=False, divisor_scale="F32")
    options = FP8_OPTIONS
    dynamic_activations = "e4m3, dynamic (per token; per group of a block's width)"
    requantize_rows = True

    def leaves(self, spec, shape, g_idx, **settings):
        return fw.float_leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return fw.float_config(ctx)

    def fit(self, m, source_spec, request, negotiate):
        return self.codec_module().fit_fp8(m, source_spec, request, negotiate)

    def plan(self, ctx):
        return self.codec_module().plan_fp8(ctx)

    def requantize(self, source, w, spec, settings):
        return self.codec_module().requantize_fp8(source, w, spec, settings)

    def retarget(self, qt, spec, settings):
        return self.codec_module().retarget_fp8(qt, spec, settings)


class Nvfp4(_CompressedTensorsTarget):
    """llm-compressor's NVFP4A16 (nvfp4-pack-quantized; W4A4 where the source's activation global scales are
    carried): its own fit, plan and share (one global scale per fused q/k/v and gate/up group, from the
    data), quantizer (llm-compressor's arithmetic) and retarget (codes kept from NVFP4 in either dialect)."""
    name = fw.NVFP4_TARGET
    hub_tags = ("compressed-tensors", "nvfp4", "4-bit")
    caps = Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"F8_E4M3"}))
    options = ()
    requantize_rows = True

    def leaves(self, spec, shape, g_idx, **settings):
        return fw.nvfp4_leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return fw.nvfp4_config(ctx)

    def fit(self, m, source_spec, request, negotiate):
        return self.codec_module().fit_nvfp4(m, source_spec, request, negotiate)

    def plan(self, ctx):
        return self.codec_module().plan_nvfp4(ctx)

    def share(self, settings):
        return self.codec_module().share_nvfp4(settings)

    def requantize(self, source, w, spec, settings):
        return self.codec_module().requantize_nvfp4(source, w, spec, settings)

    def retarget(self, qt, spec, settings):
        return self.codec_module().retarget_nvfp4(qt, spec, settings)


class Mxfp4(_CompressedTensorsTarget):
    """llm-compressor's MXFP4A16 (mxfp4-pack-quantized): its own fit, quantizer (llm-compressor's
    arithmetic) and retarget (codes and e8m0 scales kept from MXFP4)."""
    name = fw.MXFP4_TARGET
    hub_tags = ("compressed-tensors", "mxfp4", "4-bit")
    caps = Caps(frozenset({4}), asym=False, per_row=False, scale_dtypes=frozenset({"U8"}))
    options = ()
    requantize_rows = True

    def leaves(self, spec, shape, g_idx, **settings):
        return fw.mxfp4_leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return fw.mxfp4_config(ctx)

    def fit(self, m, source_spec, request, negotiate):
        return self.codec_module().fit_mxfp4(m, source_spec, request, negotiate)

    def requantize(self, source, w, spec, settings):
        return self.codec_module().requantize_mxfp4(source, w, spec, settings)

    def retarget(self, qt, spec, settings):
        return self.codec_module().retarget_mxfp4(qt, spec, settings)
