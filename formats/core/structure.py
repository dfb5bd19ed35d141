"""A model's structural config keys against the tensors it holds (issue 35).

Loaders build a model from config.json (vocab_size rows of embeddings, num_hidden_layers layers,
num_attention_heads x head_dim query rows, ...) and then load the tensors into it; llama.cpp sizes its
graph from the GGUF's metadata the same way; and qconv sizes what it writes from them (a GGUF's token
list is vocab_size long, its hyperparameters are the config's). A config that disagrees with the tensors
makes a model no loader builds, or makes qconv allocate what the config claims rather than what the
files hold (a vocab_size of 200,000,000 beside 512 embedding rows). So every writing verb refuses a
component whose structural keys disagree with its tensors (reader.require_decodable), naming the key,
the tensor and both sizes, and ``inspect`` reports the same disagreements as warnings (``--strict``
fails on them).

The checks use only what every loader agrees on, and only where the tensor they compare with is there:
- the text decoder's ``embed_tokens`` ([vocab_size, hidden_size]) and ``lm_head`` ([vocab_size, ...]);
- its layers ``layers.0`` .. ``layers.{num_hidden_layers - 1}``, every one present and no other
  (DeepSeek's multi-token-prediction layers, ``num_nextn_predict_layers``, may follow them);
- per-expert layers (``experts.0`` .. ``experts.{num_experts - 1}``) in every layer that has experts;
- for the architectures whose attention and MLP shapes follow the config alone (ATTENTION_TYPES:
  llama, mistral, qwen2/3 and their MoE and VL text decoders, ...; and those a family declares,
  declare_attention_types: each GGUF architecture its own): q / k / v / o rows and columns from
  the head counts and head_dim, the dense MLP's from intermediate_size, each expert's from
  moe_intermediate_size. Other architectures (DeepSeek's MLA, Qwen3-Next's gated attention) size these
  with keys of their own, and are compared on the universal checks only.

Stdlib only: inspect imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

# Model types whose attention rows are heads x head_dim (head_dim: the config's, else hidden // heads),
# whose dense MLP is gate / up [intermediate_size, hidden] and down [hidden, intermediate_size], and
# whose experts are the same with moe_intermediate_size (where the config has it).
ATTENTION_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen2_vl", "qwen2_5_vl",
    "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "phi3", "starcoder2", "cohere",
})
_DECLARED: set[str] = set()       # more of them, declared by a family (a GGUF architecture: gguf/archs/)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_VISION = ("vision", "visual", "audio")
_LAYER = re.compile(r"^(.*?)layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")
_FUSED = re.compile(r"^(.*\.)?experts\.[A-Za-z_]+$")
_INT_LIMIT = 1 << 31          # what GGUF's u32 hyperparameters and every loader's int32 sizes hold


def declare_attention_types(*model_types: str) -> None:
    """Model types whose attention and MLP shapes follow the config alone, as ATTENTION_TYPES': a family
    declares those it knows (each GGUF architecture its own model types), so core names no family."""
    _DECLARED.update(model_types)


def attention_follows_config(model_type) -> bool:
    """Whether the attention and MLP checks apply to a config's model_type (ATTENTION_TYPES, or declared)."""
    return str(model_type) in ATTENTION_TYPES or str(model_type) in _DECLARED


@dataclass(frozen=True)
class Disagreement:
    keys: tuple[str, ...]     # the config keys (a VL model's: its text_config's); several: their product
    values: tuple             # what the config says of each
    tensor: str | None        # the tensor they disagree with (None: found says where)
    found: str                # what the tensors hold instead: what TENSOR "has ...", else a whole clause

    @property
    def key(self) -> str:
        return self.keys[0]

    def message(self, name=lambda key: key, *, tensor_named: bool = False) -> str:
        """One line; ``name`` renames a key as the source names it (a GGUF's metadata keys);
        tensor_named: the line already names the tensor, so it is "it" here."""
        found = self.found if self.tensor is None else f"{'it' if tensor_named else self.tensor} {self.found}"
        if len(self.keys) == 1:
            return f"{name(self.keys[0])} is {self.values[0]!r}, but {found}"
        product = 1
        for v in self.values:
            product *= v
        said = " x ".join(f"{name(k)} ({v})" for k, v in zip(self.keys, self.values))
        return f"{said} is {product}, but {found}"


def text_config(config: Mapping | None) -> dict:
    """The decoder's config: a VL config's text_config over its top level."""
    config = dict(config or {})
    if isinstance(config.get("text_config"), Mapping):
        config = {**config, **config["text_config"]}
    return config


def _is_vision(name: str) -> bool:
    return any(v in name for v in _VISION)


def _decoder_prefix(shapes: Mapping[str, tuple]) -> str | None:
    """The text decoder's prefix (``model.``, ``model.language_model.``): the one beside its
    embed_tokens, else the only one whose layers are not a vision or audio tower's; None if unclear."""
    prefixes = set()
    for name in shapes:
        m = _LAYER.match(name)
        if m and not _is_vision(m[1]) and m[3].startswith(("self_attn.", "mlp.", "input_layernorm",
                                                             "block_sparse_moe.", "post_attention_layernorm")):
            prefixes.add(m[1])
    embedded = [p for p in prefixes if p + "embed_tokens.weight" in shapes]
    if len(embedded) == 1:
        return embedded[0]
    return next(iter(prefixes)) if len(prefixes) == 1 else None


def _embedding(shapes: Mapping[str, tuple], prefix: str | None) -> str | None:
    if prefix is not None and prefix + "embed_tokens.weight" in shapes:
        return prefix + "embed_tokens.weight"
    found = [n for n in shapes if n.endswith("embed_tokens.weight") and not _is_vision(n)]
    return found[0] if len(found) == 1 else None


class _Checker:
    def __init__(self, config: Mapping):
        self.config = config
        self.found: list[Disagreement] = []
        self._bad: set[str] = set()

    def value(self, key: str, default=None) -> int | None:
        """The key as a positive integer, None where it is absent (or already found wrong)."""
        if key in self._bad:
            return None
        v = self.config.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < _INT_LIMIT:
            self._bad.add(key)
            self.found.append(Disagreement((key,), (v,), None, "a size must be a positive integer below 2^31"))
            return None
        return v

    def same(self, keys, values, tensor: str, got: int, what: str) -> None:
        """KEYS (one, or several whose VALUES multiply) against ``got`` of TENSOR; each key said once."""
        keys, values = (keys, values) if isinstance(keys, tuple) else ((keys,), (values,))
        if any(v is None for v in values) or any(k in self._bad for k in keys):
            return
        want = 1
        for v in values:
            want *= v
        if got != want:
            self._bad.update(keys)
            self.found.append(Disagreement(keys, values, tensor, f"has {got} {what}"))


def disagreements(config: Mapping | None, shapes: Mapping[str, tuple]) -> list[Disagreement]:
    """Every structural key of CONFIG that the tensors contradict. SHAPES: tensor name -> its logical
    shape (a quantized Linear's [out, in], not its packed one; fused experts [E, rows, in])."""
    cfg = text_config(config)
    c = _Checker(cfg)
    prefix = _decoder_prefix(shapes)
    embed = _embedding(shapes, prefix)
    hidden, vocab = c.value("hidden_size"), c.value("vocab_size")
    if embed is not None and len(shapes[embed]) == 2:
        c.same("vocab_size", vocab, embed, shapes[embed][0], "rows")
        c.same("hidden_size", hidden, embed, shapes[embed][1], "columns")
    if "lm_head.weight" in shapes and len(shapes["lm_head.weight"]) == 2:
        c.same("vocab_size", vocab, "lm_head.weight", shapes["lm_head.weight"][0], "rows")
    if prefix is None:
        return c.found
    layers: dict[int, dict[str, tuple]] = {}
    for name, shape in shapes.items():
        m = _LAYER.match(name)
        if m and m[1] == prefix:
            layers.setdefault(int(m[2]), {})[m[3]] = shape
    n = c.value("num_hidden_layers")
    if n is not None and layers:
        extra = cfg.get("num_nextn_predict_layers")
        extra = extra if isinstance(extra, int) and not isinstance(extra, bool) and 0 <= extra < 64 else 0
        have = sorted(layers)
        missing = next((i for i in range(n) if i not in layers), None)     # lazily: n may be 2^31 - 1
        if missing is not None or have[-1] >= n + extra:
            c.found.append(Disagreement(("num_hidden_layers",), (n,), None,
                                        f"the tensors hold {len(have)} layers ({prefix}layers.{have[0]} .. "
                                        f"{prefix}layers.{have[-1]}"
                                        + (f", layer {missing} missing)" if missing is not None else ")")))
    _experts(c, cfg, layers, prefix)
    if attention_follows_config(cfg.get("model_type")):
        _attention_and_mlp(c, layers, prefix, hidden)
    return c.found


# a MoE layer's router: one row per routed expert (transformers' Qwen / DeepSeek / GLM mlp.gate, Mixtral's
# block_sparse_moe.gate; mlx-lm keeps the names)
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")


def _experts(c: _Checker, cfg: Mapping, layers: dict, prefix: str) -> None:
    """Every expert-count key the config holds (loaders read different ones: transformers' Mixtral
    num_local_experts, Qwen's and mlx-lm's num_experts, DeepSeek's n_routed_experts) against every MoE
    layer's experts (per-expert, stacked or fused) and its router's rows."""
    for key in EXPERT_COUNT_KEYS:
        count = c.value(key) if key in cfg else None
        if count is not None:
            _expert_count(c, key, count, layers, prefix)


def _expert_count(c: _Checker, key: str, count: int, layers: dict, prefix: str) -> None:
    for i in sorted(layers):
        stems: dict[str, set[int]] = {}
        for leaf, shape in layers[i].items():
            m = _EXPERT.match(leaf)
            if m:
                stems.setdefault(m[1], set()).add(int(m[2]))
            elif _FUSED.match(leaf) and len(shape) == 3:       # transformers 5's [E, rows, in], gpt-oss'
                c.same(key, count, f"{prefix}layers.{i}.{leaf}", shape[0], "experts")
        for stem, have in sorted(stems.items()):
            if have != set(range(count)):
                missing = sorted(set(range(count)) - have)
                c.found.append(Disagreement((key,), (count,), None,
                                            f"{prefix}layers.{i}.{stem} holds {len(have)} experts ("
                                            + (f"expert {missing[0]} missing)" if missing else
                                               f"up to expert {max(have)})")))
                return
        if stems or any(_FUSED.match(leaf) and len(shape) == 3 for leaf, shape in layers[i].items()):
            for router in ROUTERS:
                shape = layers[i].get(router)
                if shape is not None and len(shape) == 2:
                    c.same(key, count, f"{prefix}layers.{i}.{router}", shape[0], "rows (one a routed expert)")


def _attention_and_mlp(c: _Checker, layers: dict, prefix: str, hidden: int | None) -> None:
    heads = c.value("num_attention_heads")
    kv = c.value("num_key_value_heads", heads)
    head_dim = c.value("head_dim")
    if head_dim is None and heads and hidden and "head_dim" not in c._bad:
        head_dim = hidden // heads
    if heads and kv and heads % kv:
        c.found.append(Disagreement(("num_attention_heads",), (heads,), None,
                                    f"that is not a multiple of num_key_value_heads ({kv})"))
    inter, moe_inter = c.value("intermediate_size"), c.value("moe_intermediate_size")
    # q rows are num_attention_heads x head_dim (the config's, else hidden_size // num_attention_heads)
    dim_key = "head_dim" if "head_dim" in c.config else "hidden_size // num_attention_heads"
    kv_key = "num_key_value_heads" if "num_key_value_heads" in c.config else "num_attention_heads"
    q, kvs = (("num_attention_heads", dim_key), (heads, head_dim)), ((kv_key, dim_key), (kv, head_dim))
    for i in sorted(layers):
        leaves = layers[i]
        p = f"{prefix}layers.{i}."

        def check(leaf: str, keys, values, dim: int) -> None:
            shape = leaves.get(leaf)
            if shape is not None and len(shape) == 2:
                c.same(keys, values, p + leaf, shape[dim], "rows" if dim == 0 else "columns")

        check("self_attn.q_proj.weight", *q, 0)
        check("self_attn.k_proj.weight", *kvs, 0)
        check("self_attn.v_proj.weight", *kvs, 0)
        check("self_attn.o_proj.weight", *q, 1)
        for leaf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            check(leaf, "hidden_size", hidden, 1)
        check("self_attn.o_proj.weight", "hidden_size", hidden, 0)
        check("mlp.down_proj.weight", "hidden_size", hidden, 0)
        check("mlp.gate_proj.weight", "intermediate_size", inter, 0)
        check("mlp.up_proj.weight", "intermediate_size", inter, 0)
        check("mlp.down_proj.weight", "intermediate_size", inter, 1)
        if moe_inter is None:
            continue
        for leaf, shape in leaves.items():
            m = _EXPERT.match(leaf)
            if m and m[1] == "mlp.experts" and len(shape) == 2:
                part = m[3]
                if part in ("gate_proj.weight", "up_proj.weight"):
                    c.same("moe_intermediate_size", moe_inter, p + leaf, shape[0], "rows")
                elif part == "down_proj.weight":
                    c.same("moe_intermediate_size", moe_inter, p + leaf, shape[1], "columns")
            elif leaf == "mlp.experts.gate_up_proj" and len(shape) == 3 and shape[2] == hidden:
                c.same(("moe_intermediate_size", "its gate and up halves"), (moe_inter, 2), p + leaf, shape[1],
                       "rows per expert")
            elif leaf == "mlp.experts.down_proj" and len(shape) == 3 and shape[1] == hidden:
                c.same("moe_intermediate_size", moe_inter, p + leaf, shape[2], "columns")


def logical_shapes(tensors: Mapping, modules) -> dict[str, tuple]:
    """Tensor name -> logical shape: each quantized module's weight as [out, in] (fused experts
    [E, rows, in]), every other tensor as stored."""
    shapes = {name: tuple(info.shape) for name, info in tensors.items()}
    for m in modules:
        for t in m.weight_tensors + m.state_tensors:
            shapes.pop(t, None)
        if m.details.get("rows_of") is not None:
            # a view of a stacked tensor's rows (MLX's switch_mlp experts): the per-expert Linear it is
            if m.details.get("stacked"):
                shapes[m.name + ".weight"] = (m.out_features, m.in_features)
            continue
        if m.experts:
            shapes[m.name] = (m.experts, m.out_features // m.experts, m.in_features)
        else:
            shapes[m.name + ".weight"] = (m.out_features, m.in_features)
    return shapes


def key_namer(config: Mapping | None, names: Mapping[str, str] | None = None):
    """How a key is said: as the source names it (NAMES: a GGUF's metadata keys), else config.json's
    (a VL model's decoder keys under text_config)."""
    text = (config or {}).get("text_config") if isinstance(config, Mapping) else None

    def name(key: str) -> str:
        if " // " in key:
            return " // ".join(name(k) for k in key.split(" // "))
        if names:
            return names.get(key, key)
        return f"text_config.{key}" if isinstance(text, Mapping) and key in text else key
    return name


def check(config: Mapping | None, shapes: Mapping[str, tuple], *, file, names: Mapping[str, str] | None = None,
          source: str = "config.json") -> None:
    """Refuse (CorruptCheckpoint, naming FILE, the tensor and the key) a config whose structural keys the
    tensors contradict: no loader builds such a model, and nothing qconv writes may be sized by it."""
    refuse(disagreements(config, shapes), file=file, whose=f"{source}'s", name=key_namer(config, names),
           why=f"loaders build the model from {source}, so no loader reads these tensors into it; nothing written")


def refuse(found: list[Disagreement], *, file, whose: str, why: str, name=lambda key: key) -> None:
    """Refuse (CorruptCheckpoint naming FILE and the tensor) the first of FOUND, counting the others:
    "WHOSE <key> is <value>, but <tensor> has ...: WHY"."""
    from ...errors import CorruptCheckpoint

    if found:
        d = found[0]
        more = f" (and {len(found) - 1} more such disagreements)" if len(found) > 1 else ""
        raise CorruptCheckpoint(f"{whose} {d.message(name, tensor_named=True)}{more}: {why}", file=file,
                                tensor=d.tensor)
