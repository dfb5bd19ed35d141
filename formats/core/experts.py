"""Fused MoE experts split into one Linear per expert: the layout every integer format stores and
every loader of them reads (vLLM, transformers' conversion mapping back to its fused modules).

transformers 5 saves MoE experts fused with `save_original_format=False`: `<prefix>.experts.gate_up_proj`
[E, 2I, H] (each expert's gate rows, then its up rows: MergeModulelist(dim=0) + Concatenate(dim=1) of
`experts.N.gate_proj` and `experts.N.up_proj`) and `<prefix>.experts.down_proj` [E, H, I] (`experts.N
.down_proj`). That is transformers' "qwen2_moe" conversion (conversion_mapping.py), which the model types
below share. A split expert is a view: a module whose rows are rows r0:r0+out of its fused parent, read
through the parent (reader.read_module), so its codes and scales are the parent's, row for row.

Released transposed (RELEASED_TRANSPOSED: Qwen3-VL-MoE): the released checkpoints store `gate_up_proj` as
[E, H, 2I] and `down_proj` as [E, I, H], each expert's Linear transposed, gate columns before up columns
(Qwen/Qwen3-VL-30B-A3B-Instruct: [128, 2048, 1536] and [128, 768, 2048]); transformers transposes them when
it loads (conversion_mapping.py "qwen3_vl_moe": Transpose(1, 2, check_dims=True)) and saves its own [E, 2I, H]
only with save_original_format=False, and vLLM (is_fused_checkpoint_transposed), mlx-lm (swapaxes) and
llama.cpp's converter (permute(0, 2, 1)) read the released layout only. Either is split here, told apart by
the shapes against the config (fused_layout); a view of the released layout reads its expert's whole slice
of stored rows and takes its columns (details["columns"], reader.read_module), so memory is bounded by one
expert, never the tensor.

Not split (refused by the writers that need it, with the reason): other model types, whose fused layout
differs (gpt-oss interleaves gate and up rows and has no per-expert layout any loader reads; Mixtral's
per-expert names also rename the block). The one exception is GGUF (gguf/writer.py), whose stacked gate /
up experts llama.cpp's own converter makes from gpt-oss' interleaved rows: split_interleaved.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from ...errors import NotStorable
from .layout import QuantModule
from .registry import family

# model types whose fused experts are transformers' qwen2_moe conversion (conversion_mapping.py's
# _MODEL_TO_CONVERSION_PATTERN entries mapped to "qwen2_moe", and qwen2_moe itself)
PER_EXPERT_TYPES = frozenset((
    "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe_text",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "glm4v_moe",
    "dots1", "ernie4_5_moe", "afmoe", "longcat_flash", "solar_open", "mellum", "beam", "hunyuan_v1_moe",
    "flex_olmo", "olmoe", "exaone_moe", "cohere2_moe"))
FUSED = ("gate_up_proj", "down_proj")
# model types whose released checkpoints store fused experts transposed ([E, H, 2I] / [E, I, H]), which
# transformers transposes on load (conversion_mapping.py: Transpose(1, 2, check_dims=True)); its own saved
# [E, 2I, H] / [E, H, I] is read too, told apart by the shapes (fused_layout)
RELEASED_TRANSPOSED = frozenset(("qwen3_vl_moe",))
ROWS, TRANSPOSED = "rows", "transposed"


def model_type(config: Mapping | None) -> str | None:
    return config.get("model_type") if isinstance(config, Mapping) else None


def why_not_split(config: Mapping | None, m: QuantModule | None = None) -> str | None:
    """None where this model's fused experts (module m, where given) split into experts.N.{gate,up,
    down}_proj, else why not."""
    kind = model_type(config)
    if kind == "gpt_oss" or (m is not None and m.details.get("interleaved")):
        return ("its gate and up rows are interleaved (gpt-oss' layout), and gpt-oss has no per-expert layout "
                "that any loader reads (transformers and vLLM build its experts fused)")
    if kind in PER_EXPERT_TYPES:
        return None
    if kind in RELEASED_TRANSPOSED:
        if m is None:
            return None
        try:
            fused_layout(config, m)
        except NotStorable as exc:
            return f"{exc}"
        return None
    return (f"qconv splits fused experts for the model types whose fused layout is transformers' "
            f"[E, 2I, H] gate-then-up (qwen2_moe, qwen3_moe, deepseek_v3, glm4_moe, ...) or Qwen3-VL-MoE's "
            f"released [E, H, 2I], not {kind or 'an unnamed model type'!r}")


def fused_layout(config: Mapping | None, m: QuantModule) -> str:
    """ROWS (transformers' [E, 2I, H] / [E, H, I]: each expert's Linear rows stacked) or, for a
    RELEASED_TRANSPOSED model, TRANSPOSED (the released [E, H, 2I] / [E, I, H]), from m's stored shape
    against the config's hidden_size and moe_intermediate_size. Raises NotStorable naming both layouts
    where the shape is neither, or is both (a square expert: the shapes cannot tell), and where a
    transposed module's codes do not transpose (only float weights and square 2-D blocks do)."""
    if model_type(config) not in RELEASED_TRANSPOSED:
        return ROWS
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    inter, hidden = text.get("moe_intermediate_size"), text.get("hidden_size")
    leaf = m.name.rsplit(".", 1)[-1]
    got = (m.out_features // max(m.experts, 1), m.in_features)
    if not (isinstance(inter, int) and isinstance(hidden, int)):
        raise NotStorable(f"its config has no integer hidden_size and moe_intermediate_size to tell its {leaf}'s "
                          f"layout by")
    own = (2 * inter, hidden) if leaf == "gate_up_proj" else (hidden, inter)
    released = own[::-1]
    if own == released and got == own:
        raise NotStorable(f"its {leaf} is [{m.experts}, {got[0]}, {got[1]}], square per expert: the shapes cannot tell "
                          f"transformers' own layout from the released, transposed one")
    if got not in (own, released):
        raise NotStorable(f"its {leaf} is stored [{m.experts}, {got[0]}, {got[1]}], neither the released layout "
                          f"[{m.experts}, {released[0]}, {released[1]}] nor transformers' own [{m.experts}, {own[0]}, "
                          f"{own[1]}] (hidden_size {hidden}, moe_intermediate_size {inter})")
    if got == own:
        return ROWS
    if not transposable(m):
        raise NotStorable(f"its {leaf} is stored transposed (the released layout) as {m.scheme} codes in "
                          f"blocks that do not transpose (only float weights and square 2-D blocks do)")
    return TRANSPOSED


def transposable(m: QuantModule) -> bool:
    """Whether a module's codes read transposed stay codes of the same spec: a float weight, or square
    2-D blocks (fine-grained FP8's 128 x 128: a block's transpose is a block with the same scale)."""
    if m.experts and not family(m.family).quantized:
        return True
    block = m.details.get("block_rows")
    return m.scheme == "e4m3" and not m.details.get("fused_scale") and bool(block) and block == m.group_size


def split_names(name: str, experts: int, rows: int) -> list[tuple[str, int, int]]:
    """(per-expert module, first stacked row, rows) of a fused tensor `name` holding `experts` x `rows`
    stacked rows, in expert order: `<prefix>.experts.N.gate_proj` (rows N*2I .. N*2I+I of gate_up_proj's
    [E*2I, H]), `.up_proj` (the next I), `.down_proj` (rows N*H .. N*H+H of down_proj's [E*H, I])."""
    prefix, leaf = name.rsplit(".", 1)
    if leaf == "gate_up_proj":
        if rows % 2:
            raise NotStorable(f"{rows} gate_up_proj rows per expert: not a gate half and an up half")
        parts = [("gate_proj", 0, rows // 2), ("up_proj", rows // 2, rows // 2)]
    else:
        parts = [("down_proj", 0, rows)]
    return [(f"{prefix}.{e}.{sub}", e * rows + r0, n) for e in range(experts) for sub, r0, n in parts]


def split_module(m: QuantModule, config: Mapping | None = None) -> list[QuantModule]:
    """The per-expert views of a fused module (split_names). Each keeps the parent's family, spec
    details and tensors (for messages); details["rows_of"] = (parent, first stored row) routes its reads.
    In the released transposed layout (fused_layout) an expert's Linear is its slice's columns:
    details["columns"] = (stored rows of the expert, first column), and in_features is those rows."""
    if fused_layout(config, m) == ROWS:
        return [replace(m, name=name, out_features=rows, experts=0, details={**m.details, "rows_of": (m, r0)})
                for name, r0, rows in split_names(m.name, m.experts, m.out_features // m.experts)]
    stored = m.out_features // m.experts
    return [replace(m, name=name, out_features=n, in_features=stored, experts=0,
                    details={**m.details, "rows_of": (m, (r0 // m.in_features) * stored), "columns": (stored, r0 % m.in_features)})
            for name, r0, n in split_names(m.name, m.experts, m.in_features)]


def split_interleaved(m: QuantModule) -> list[QuantModule]:
    """The per-expert views of gpt-oss' fused gate_up_proj, whose rows are INTERLEAVED (row 2r of expert N
    is gate_proj's row r, row 2r + 1 up_proj's): `experts.N.gate_proj` reads every other stacked row from
    N*2I, `.up_proj` every other from N*2I + 1 (details["row_step"] = 2, reader.read_module). A row's
    blocks run along the input, so each view's codes and scales are the parent's, row for row. Only
    writers whose target has a per-expert (or stacked gate / up) layout its loader reads use it: llama.cpp's
    converter splits gpt-oss' gate_up the same way (conversion/gpt_oss.py, ``[:, ::2]`` and ``[:, 1::2]``).
    Raises ValueError where the rows do not pair up."""
    rows = m.out_features // m.experts
    if rows % 2:
        raise NotStorable(f"{rows} interleaved gate_up_proj rows per expert: not gate / up pairs")
    prefix = m.name.rsplit(".", 1)[0]
    return [replace(m, name=f"{prefix}.{e}.{sub}", out_features=rows // 2, experts=0,
                    details={**m.details, "rows_of": (m, e * rows + offset), "row_step": 2})
            for e in range(m.experts) for sub, offset in (("gate_proj", 0), ("up_proj", 1))]


def is_fused_name(name: str) -> bool:
    prefix, _, leaf = name.rpartition(".")
    return leaf in FUSED and prefix.endswith(".experts")
