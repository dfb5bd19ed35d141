"""An mmproj file's clip keys against its vision tower's tensors: the vision side of what
formats/core/structure.py checks of a text model's config. llama.cpp's clip.cpp builds the tower's graph
from these keys and qconv's read-back (mmproj.read_back) builds transformers' vision_config from them, so
every verb that reads an mmproj file refuses one whose keys its tensors contradict (exit 4, naming the file
and the key), and inspect warns of it. Stdlib only, from headers alone."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Mapping

from ...errors import UnsupportedFormat
from ..core.structure import Disagreement, refuse
from .header import Elided

_INT_LIMIT = 1 << 31          # what GGUF's u32 keys and llama.cpp's int32 hparams hold
_BLOCK = re.compile(r"v\.blk\.(\d+)\.(.+)")
_DEEPSTACK = re.compile(r"v\.deepstack\.(\d+)\.")
PROJECTORS = ("qwen2.5vl_merger", "qwen3vl_merger")      # those whose keys clip_disagreements knows


def clip_disagreements(meta: Mapping, shapes: Mapping[str, tuple]) -> list:
    """Every clip key of a qwen2.5vl_merger / qwen3vl_merger mmproj file that its tensors contradict
    (structure.Disagreement, as a config's structural keys: formats/core/structure.py). llama.cpp's clip.cpp
    builds the tower's graph from these keys and read_back builds vision_config from them, so one that lies
    makes a model no loader builds. SHAPES: GGUF tensor name -> numpy shape (the header's, reversed). From
    headers alone (inspect), stdlib only, and bounded by the tensors' names: nothing is sized by a key.

    Sizes: positive integers below 2^31 (block_count, embedding_length, feed_forward_length,
    attention.head_count, projection_dim, patch_size, image_size, spatial_merge_size, n_wa_pattern), and
    patch_size the patch kernels' pixels; embedding_length their output channels, every block's attention,
    norm and MLP width, the position embedding's; feed_forward_length the MLP rows; block_count the v.blk.N
    held (each of 0 .. n-1, no other); head_count a divisor of embedding_length leaving heads of a multiple
    of 4 (the 2-D rotary embedding's four sections, in transformers and llama.cpp alike); projection_dim the
    projector's output rows; embedding_length x spatial_merge_size^2 its input columns; image_size a
    multiple of patch_size; n_wa_pattern at most block_count; is_deepstack_layers one flag per block, set
    where the v.deepstack.L mergers are; image_mean / image_std three finite numbers (std positive); the
    norms' epsilon positive and finite; has_vision_encoder true."""
    qwen3 = meta.get("clip.projector_type") == "qwen3vl_merger"
    found: list = []
    bad: set = set()

    def lie(key: str, value, tensor, what: str) -> None:
        bad.add(key)
        found.append(Disagreement((key,), (value,), tensor, what))

    def size(name: str, default=None) -> int | None:
        key = "clip.vision." + name
        value = meta.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < _INT_LIMIT:
            lie(key, value, None, "a size llama.cpp builds the tower with must be a positive integer below 2^31")
            return None
        return value

    def same(keys, values, tensor: str, dim: int, what: str) -> None:
        """KEYS (one, or several whose VALUES multiply) against dimension DIM of TENSOR, where it is held."""
        shape = shapes.get(tensor)
        keys, values = (keys, values) if isinstance(keys, tuple) else ((keys,), (values,))
        if shape is None or dim >= len(shape) or any(v is None for v in values) or any(k in bad for k in keys):
            return
        want = math.prod(values)
        if shape[dim] != want:
            bad.update(keys)
            found.append(Disagreement(keys, values, tensor, f"has {shape[dim]} {what}"))

    if meta.get("clip.has_vision_encoder") is not True:
        lie("clip.has_vision_encoder", meta.get("clip.has_vision_encoder"), None,
            "the file holds a vision tower (v.* tensors), which llama.cpp loads only where it is true")
    E, P, F = "clip.vision.embedding_length", "clip.vision.patch_size", "clip.vision.feed_forward_length"
    depth, hidden, ff = size("block_count"), size("embedding_length"), size("feed_forward_length")
    heads, proj, patch, image = size("attention.head_count"), size("projection_dim"), size("patch_size"), \
        size("image_size")
    merge = size("spatial_merge_size", 2)             # llama.cpp's default for Qwen
    window = size("n_wa_pattern") if not qwen3 or "clip.vision.n_wa_pattern" in meta else None

    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):       # [hidden, 3, p, p]
        shape = shapes.get(name)
        if shape is None or len(shape) != 4:
            continue
        same(E, hidden, name, 0, "output channels")
        if patch is not None and P not in bad and (shape[2], shape[3]) != (patch, patch):
            lie(P, patch, name, f"has patches of {shape[2]} x {shape[3]} pixels")
    same(E, hidden, "v.patch_embd.bias", 0, "elements")
    same(E, hidden, "v.position_embd.weight", 1, "columns")

    blocks: dict[int, set] = {}
    for name in shapes:
        m = _BLOCK.fullmatch(name)
        if m:
            blocks.setdefault(int(m[1]), set()).add(m[2])
    if depth is not None:
        have = sorted(blocks)
        missing = next((i for i in range(depth) if i not in blocks), None)      # lazily: depth may be 2^31 - 1
        if not have:
            lie("clip.vision.block_count", depth, None, "the file holds no v.blk.N tensors")
        elif missing is not None or have[-1] >= depth:
            lie("clip.vision.block_count", depth, None,
                f"the tensors hold {len(have)} blocks (v.blk.{have[0]} .. v.blk.{have[-1]}"
                + (f", block {missing} missing)" if missing is not None else ")"))
    for n in sorted(blocks):
        p = f"v.blk.{n}."
        if qwen3:
            same((E, "q, k and v"), (hidden, 3), p + "attn_qkv.weight", 0, "rows")
            same(E, hidden, p + "attn_qkv.weight", 1, "columns")
        for x in "qkv":
            same(E, hidden, p + f"attn_{x}.weight", 0, "rows")
            same(E, hidden, p + f"attn_{x}.weight", 1, "columns")
        same(E, hidden, p + "attn_out.weight", 0, "rows")
        same(E, hidden, p + "attn_out.weight", 1, "columns")
        for norm in ("ln1.weight", "ln2.weight"):
            same(E, hidden, p + norm, 0, "elements")
        for leaf in ("ffn_gate.weight", "ffn_up.weight"):
            same(F, ff, p + leaf, 0, "rows")
            same(E, hidden, p + leaf, 1, "columns")
        same(E, hidden, p + "ffn_down.weight", 0, "rows")
        same(F, ff, p + "ffn_down.weight", 1, "columns")
    same(E, hidden, "v.post_ln.weight", 0, "elements")

    merged = ((E, "clip.vision.spatial_merge_size", "clip.vision.spatial_merge_size"), (hidden, merge, merge))
    deepstack = sorted({int(m[1]) for m in map(_DEEPSTACK.match, shapes) if m})
    same(*merged, "mm.0.weight", 1, "columns")
    same("clip.vision.projection_dim", proj, "mm.2.weight", 0, "rows")
    for i in deepstack:
        same(*merged, f"v.deepstack.{i}.fc1.weight", 1, "columns")
        same("clip.vision.projection_dim", proj, f"v.deepstack.{i}.fc2.weight", 0, "rows")

    if heads is not None and hidden is not None and E not in bad:
        if hidden % heads:
            lie("clip.vision.attention.head_count", heads, None, f"that does not divide {E} ({hidden})")
        elif (hidden // heads) % 4:
            lie("clip.vision.attention.head_count", heads, None,
                f"that leaves {hidden // heads} of {E} ({hidden}) a head, not a multiple of 4 (the vision "
                f"rotary embedding's four sections)")
    if image is not None and patch is not None and P not in bad and image % patch:
        lie("clip.vision.image_size", image, None, f"that is not a multiple of {P} ({patch})")
    if window is not None and depth is not None and "clip.vision.block_count" not in bad and window > depth:
        lie("clip.vision.n_wa_pattern", window, None,
            f"that is more than clip.vision.block_count ({depth}): a window pattern longer than the tower")
    if qwen3:
        key, flags = "clip.vision.is_deepstack_layers", meta.get("clip.vision.is_deepstack_layers")
        count = flags.count if isinstance(flags, Elided) else None     # a long array (inspect): its length only
        if count is None and not (isinstance(flags, list) and all(isinstance(f, bool) for f in flags)):
            lie(key, flags, None, "it must be a list of flags, one per vision block")
        elif depth is not None and "clip.vision.block_count" not in bad \
                and (len(flags) if count is None else count) != depth:
            lie(key, flags, None, f"that is {len(flags) if count is None else count} flags, not one for each of "
                                  f"clip.vision.block_count ({depth}) blocks")
        elif count is None and [i for i, f in enumerate(flags) if f] != deepstack:
            lie(key, flags, None, "the tensors hold the deepstack mergers "
                + (", ".join(f"v.deepstack.{i}" for i in deepstack) or "of no layer"))
    for name in ("image_mean", "image_std"):
        key, value = f"clip.vision.{name}", meta.get(f"clip.vision.{name}")
        if not isinstance(value, list) or len(value) != 3 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value) \
                or (name == "image_std" and not all(v > 0 for v in value)):
            lie(key, value, None, "an image is normalized by three finite numbers, one per RGB channel"
                + (", each positive" if name == "image_std" else ""))
    key = "clip.vision.attention.layer_norm_epsilon"
    eps = meta.get(key)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        lie(key, eps, None, "a norm's epsilon must be a positive finite number")
    return found


def checked(meta: Mapping, shapes: Mapping[str, tuple], projector: str, path: Path) -> None:
    """read_back's refusal of an mmproj file whose clip keys contradict its tensors (exit 4, naming the
    first key and tensor), or that says llama.cpp computes another activation than the model's (exit 5)."""
    refuse(clip_disagreements(meta, shapes), file=path, whose="its",
           why="llama.cpp builds the vision tower from the clip keys (and qconv its vision_config), so no loader "
               "builds this one; nothing written")
    own, other = ("clip.use_gelu", "clip.use_silu") if projector == "qwen3vl_merger" else \
        ("clip.use_silu", "clip.use_gelu")
    if meta.get(own) is not True or meta.get(other):
        raise UnsupportedFormat(f"its {own} is {meta.get(own)!r} ({other} {meta.get(other)!r}): llama.cpp then "
                                f"computes the vision MLP with another activation than the {projector} "
                                f"tower's ({'GELU' if own == 'clip.use_gelu' else 'SiLU'}), which qconv does not "
                                f"read back", file=path)
