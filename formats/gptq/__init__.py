"""GPTQ (AutoGPTQ / GPTQModel, v1 and v2 zero points) and auto-round's GPTQ packings. Its declarations: the
gptq family, the gptq dialect (auto-round's configs too), the gptq, gptq-v2 and auto-round targets (the
AWQ packing auto-round picks for asymmetric 4-bit modules is declared by awq/)."""

from ...errors import NotStorable
from ..core.registry import Caps, Dialect, Family, Target, lazy, register, register_target, target
from . import header as gptq

AUTO_ROUND_AWQ_TARGET = "auto-round:auto_awq"
AUTO_ROUND_PLAIN_TARGET = "auto-round:plain"


def _config_method(method, qc):
    return "auto-round" if method in ("auto-round", "intel/auto-round") else None


def _claims(method, qc) -> bool:
    return method in (None, "gptq") or (method == "auto-round" and not gptq.auto_round_awq_packed(qc))


def _symmetric(m, qc) -> bool:
    return bool((gptq.per_module_settings(qc, m.name) or {}).get("sym", True)) if qc else True


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


register(Family("gptq", "GPTQ", frozenset({"gptq", "auto-round"}), _claims, gptq.find_in_checkpoint,
                lazy("gptq.codec", "check"),
                "gptq.codec", gptq.settings, scale_tensor=".scales", symmetric=_symmetric, kernel="gptq.kernel"))
# a bare AutoGPTQ quantize_config.json (no quant_method, "bits"): tried after every other bare config
register(Dialect("gptq", frozenset({"gptq", "auto-round"}), gptq.lint, bare=lambda doc: "bits" in doc,
                 bare_last=True, resolve=_config_method, reported_as_itself=frozenset({"auto-round"})))

_INT_2_8 = frozenset(range(2, 9))
for _name in ("gptq", "gptq-v2"):
    register_target(Target(_name, "gptq", Caps(_INT_2_8, act_order=True), gptq.leaves, gptq.config_writer(_name),
                           "gptq.codec", g_idx="always", zero_encoding="v2" if _name == "gptq-v2" else "v1"))
# auto-round: one --to name, three packings, picked from the negotiated specs as auto-round's own export
# picks them (auto_round_packing). auto_gptq (z - 1) for symmetric modules, as before; the asymmetric
# packings store zero points as they are.
register_target(Target("auto-round", "gptq", Caps(_INT_2_8), gptq.leaves,
                       gptq.config_writer("auto-round", gptq.AUTO_ROUND_GPTQ), "gptq.codec",
                       zero_encoding="v1", packing=auto_round_packing))
register_target(Target(AUTO_ROUND_PLAIN_TARGET, "gptq", Caps(_INT_2_8), gptq.leaves,
                       gptq.config_writer(AUTO_ROUND_PLAIN_TARGET, gptq.AUTO_ROUND_PLAIN), "gptq.codec",
                       zero_encoding="v2", internal=True))
