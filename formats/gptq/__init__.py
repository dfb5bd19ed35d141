"""GPTQ (AutoGPTQ / GPTQModel, v1 and v2 zero points) and auto-round's GPTQ packings. Its declarations: the
gptq family, the gptq dialect (auto-round's configs too), the gptq, gptq-v2 and auto-round targets (the
AWQ packing auto-round picks for asymmetric 4-bit modules is declared by awq/)."""

from ...errors import NotStorable
from ..core.registry import Caps, Dialect, Family, Target, target
from . import header as gptq

AUTO_ROUND_AWQ_TARGET = "auto-round:auto_awq"
AUTO_ROUND_PLAIN_TARGET = "auto-round:plain"


def auto_round_packing(modules) -> str | None:
    """The packing `--to auto-round` writes, as auto-round's own ``format="auto_round"`` export picks it
    (auto_round/export/formats/backends/autoround.py, ``AutoRoundFormat.__init__``):

    * every module symmetric: ``auto_round:auto_gptq`` (None: the auto-round target itself);
    * some module asymmetric, and every module 4-bit in whole groups that AWQ GEMM holds (in a multiple
      of the group size, out of 8): ``auto_round:auto_awq`` (AWQ GEMM tensors, zero points as they are;
      symmetric modules among them keep their zero points 2^(b-1) and an extra_config ``sym: true``);
    * some module asymmetric otherwise (another width, one group per row): plain ``auto_round`` (GPTQ
      layout, zero points as they are, no g_idx), which auto-round writes for asymmetric schemes that
      are not all 4-bit and qconv's GPTQ reader reads back (docs/formats.md, auto-round).

    auto-round's auto_gptq stores z - 1 clamped at 0 and its loaders read asymmetric auto_gptq as
    symmetric, so an asymmetric module is never written there."""
    if all(spec.symmetric for spec, _ in modules.values()):
        return None
    awq_target = target(AUTO_ROUND_AWQ_TARGET)

    def awq_holds(spec, shape) -> bool:
        if spec.bits not in awq_target.caps.bits:
            return False
        try:
            awq_target.leaves(spec, shape, False)
        except NotStorable:
            return False
        return True

    if all(awq_holds(spec, shape) for spec, shape in modules.values()):
        return AUTO_ROUND_AWQ_TARGET
    return AUTO_ROUND_PLAIN_TARGET


class Gptq(Family):
    """GPTQ's packed int32 words (qweight, qzeros, scales, g_idx), AutoGPTQ's v1 zero points or GPTQModel's
    v2, and auto-round's GPTQ packings."""
    name = "gptq"
    method = "GPTQ"
    config_methods = frozenset({"gptq", "auto-round"})
    codec = "gptq.codec"
    scale_tensor = ".scales"

    def claims(self, config_method, qc) -> bool:
        return config_method in (None, "gptq") or (config_method == "auto-round"
                                                   and not gptq.auto_round_awq_packed(qc))

    def find_modules(self, tensors, qc):
        return gptq.find_in_checkpoint(tensors, qc)

    def settings(self, qc, modules):
        return gptq.settings(qc, modules)

    def symmetric(self, m, qc) -> bool:
        return bool((gptq.per_module_settings(qc, m.name) or {}).get("sym", True)) if qc else True

    def check_module(self, m, tensors, qc):
        self.codec_module().check(m, tensors, qc)

    def kernel_for(self, m, qc):
        from .kernel import kernel              # torch and auto-round: only where validate runs it
        return kernel(m, qc)


class GptqDialect(Dialect):
    """GPTQ's and auto-round's configs; a bare AutoGPTQ quantize_config.json (no quant_method, "bits"),
    tried after every other bare config."""
    name = "gptq"
    config_methods = frozenset({"gptq", "auto-round"})
    bare_last = True
    reported_as_itself = frozenset({"auto-round"})
    header = gptq

    def bare(self, doc) -> bool:
        return "bits" in doc

    def resolve(self, quant_method, qc):
        return "auto-round" if quant_method in ("auto-round", "intel/auto-round") else None


_INT_2_8 = frozenset(range(2, 9))


class _GptqLayout(Target):
    """GPTQ's tensors (gptq.leaves), each writer with its own quantization_config."""
    family = "gptq"
    caps = Caps(_INT_2_8)
    codec = "gptq.codec"

    def leaves(self, spec, shape, g_idx, **settings):
        return gptq.leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return _CONFIGS[self.name](ctx)


class GptqTarget(_GptqLayout):
    """AutoGPTQ's v1 (z - 1), g_idx always written as GPTQModel and AutoGPTQ write it."""
    name = "gptq"
    caps = Caps(_INT_2_8, act_order=True)
    g_idx = "always"
    zero_encoding = "v1"


class GptqV2Target(_GptqLayout):
    """GPTQModel's v2 (z as it is)."""
    name = "gptq-v2"
    caps = Caps(_INT_2_8, act_order=True)
    g_idx = "always"
    zero_encoding = "v2"


class AutoRoundTarget(_GptqLayout):
    """auto-round: one --to name, three packings, picked from the negotiated specs as auto-round's own export
    picks them (auto_round_packing). auto_gptq (z - 1) for symmetric modules; the asymmetric packings store
    zero points as they are."""
    name = "auto-round"
    zero_encoding = "v1"

    def packing(self, modules):
        return auto_round_packing(modules)


class AutoRoundPlainTarget(_GptqLayout):
    """auto-round's plain packing (GPTQ layout, zero points as they are, no g_idx): internal."""
    name = AUTO_ROUND_PLAIN_TARGET
    zero_encoding = "v2"
    internal = True


_CONFIGS = {"gptq": gptq.config_writer("gptq"), "gptq-v2": gptq.config_writer("gptq-v2"),
            "auto-round": gptq.config_writer("auto-round", gptq.AUTO_ROUND_GPTQ),
            AUTO_ROUND_PLAIN_TARGET: gptq.config_writer(AUTO_ROUND_PLAIN_TARGET, gptq.AUTO_ROUND_PLAIN)}
