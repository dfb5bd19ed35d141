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
from .archs import VISION
from .header import Elided

_INT_LIMIT = 1 << 31          # what GGUF's u32 keys and llama.cpp's int32 hparams hold
_BLOCK = re.compile(r"v\.blk\.(\d+)\.(.+)")
_DEEPSTACK = re.compile(r"v\.deepstack\.(\d+)\.")
PROJECTORS = tuple(dict.fromkeys(v.projector for v in VISION.values()))   # the declared towers' (archs/)


def _tower(projector):
    """The declared tower (archs.Vision) of a projector type, else None."""
    return next((v for v in VISION.values() if v.projector == projector), None)


def clip_disagreements(meta: Mapping, shapes: Mapping[str, tuple]) -> list:
    """Every clip key of a declared tower's mmproj file (qwen2.5vl_merger, qwen3vl_merger) that its tensors contradict
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
    c = _Clip(meta, shapes)
    if meta.get("clip.has_vision_encoder") is not True:
        c.lie("clip.has_vision_encoder", meta.get("clip.has_vision_encoder"), None,
              "the file holds a vision tower (v.* tensors), which llama.cpp loads only where it is true")
    _patches(c)
    _blocks(c)
    _projector(c)
    _heads_image_window(c)
    if c.tower is not None and c.tower.deepstack:
        _deepstack_flags(c)
    _normalization(c)
    return c.found


E, P, F = "clip.vision.embedding_length", "clip.vision.patch_size", "clip.vision.feed_forward_length"
DEPTH, MERGE = "clip.vision.block_count", "clip.vision.spatial_merge_size"


class _Clip:
    """The keys as sizes (each said wrong once), and their comparisons with the tensors' dimensions."""

    def __init__(self, meta: Mapping, shapes: Mapping[str, tuple]):
        self.meta, self.shapes = meta, shapes
        self.tower = _tower(meta.get("clip.projector_type"))
        self.found: list = []
        self.bad: set = set()
        self.depth, self.hidden, self.ff = self.size("block_count"), self.size("embedding_length"), \
            self.size("feed_forward_length")
        self.heads, self.proj = self.size("attention.head_count"), self.size("projection_dim")
        self.patch, self.image = self.size("patch_size"), self.size("image_size")
        self.merge = self.size("spatial_merge_size", 2)             # llama.cpp's default for Qwen
        windowed = self.tower is None or self.tower.windowed
        self.window = self.size("n_wa_pattern") if windowed or "clip.vision.n_wa_pattern" in meta else None
        self.blocks: dict[int, set] = {}
        for name in shapes:
            m = _BLOCK.fullmatch(name)
            if m:
                self.blocks.setdefault(int(m[1]), set()).add(m[2])
        self.deepstack = sorted({int(m[1]) for m in map(_DEEPSTACK.match, shapes) if m})

    def lie(self, key: str, value, tensor, what: str) -> None:
        self.bad.add(key)
        self.found.append(Disagreement((key,), (value,), tensor, what))

    def size(self, name: str, default=None) -> int | None:
        key = "clip.vision." + name
        value = self.meta.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < _INT_LIMIT:
            self.lie(key, value, None, "a size llama.cpp builds the tower with must be a positive integer below 2^31")
            return None
        return value

    def same(self, keys, values, tensor: str, dim: int, what: str) -> None:
        """KEYS (one, or several whose VALUES multiply) against dimension DIM of TENSOR, where it is held."""
        shape = self.shapes.get(tensor)
        keys, values = (keys, values) if isinstance(keys, tuple) else ((keys,), (values,))
        if shape is None or dim >= len(shape) or any(v is None for v in values) or any(k in self.bad for k in keys):
            return
        want = math.prod(values)
        if shape[dim] != want:
            self.bad.update(keys)
            self.found.append(Disagreement(keys, values, tensor, f"has {shape[dim]} {what}"))


def _patches(c: _Clip) -> None:
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):       # [hidden, 3, p, p]
        shape = c.shapes.get(name)
        if shape is None or len(shape) != 4:
            continue
        c.same(E, c.hidden, name, 0, "output channels")
        if c.patch is not None and P not in c.bad and (shape[2], shape[3]) != (c.patch, c.patch):
            c.lie(P, c.patch, name, f"has patches of {shape[2]} x {shape[3]} pixels")
    c.same(E, c.hidden, "v.patch_embd.bias", 0, "elements")
    c.same(E, c.hidden, "v.position_embd.weight", 1, "columns")


def _blocks(c: _Clip) -> None:
    if c.depth is not None:
        have = sorted(c.blocks)
        missing = next((i for i in range(c.depth) if i not in c.blocks), None)     # lazily: may be 2^31 - 1
        if not have:
            c.lie(DEPTH, c.depth, None, "the file holds no v.blk.N tensors")
        elif missing is not None or have[-1] >= c.depth:
            c.lie(DEPTH, c.depth, None, f"the tensors hold {len(have)} blocks (v.blk.{have[0]} .. v.blk.{have[-1]}"
                  + (f", block {missing} missing)" if missing is not None else ")"))
    hidden, ff = c.hidden, c.ff
    for n in sorted(c.blocks):
        p = f"v.blk.{n}."
        if c.tower is not None and c.tower.fused_qkv:
            c.same((E, "q, k and v"), (hidden, 3), p + "attn_qkv.weight", 0, "rows")
            c.same(E, hidden, p + "attn_qkv.weight", 1, "columns")
        for leaf in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_out.weight"):
            c.same(E, hidden, p + leaf, 0, "rows")
            c.same(E, hidden, p + leaf, 1, "columns")
        for norm in ("ln1.weight", "ln2.weight"):
            c.same(E, hidden, p + norm, 0, "elements")
        for leaf in ("ffn_gate.weight", "ffn_up.weight"):
            c.same(F, ff, p + leaf, 0, "rows")
            c.same(E, hidden, p + leaf, 1, "columns")
        c.same(E, hidden, p + "ffn_down.weight", 0, "rows")
        c.same(F, ff, p + "ffn_down.weight", 1, "columns")
    c.same(E, hidden, "v.post_ln.weight", 0, "elements")


def _projector(c: _Clip) -> None:
    merged = ((E, MERGE, MERGE), (c.hidden, c.merge, c.merge))
    c.same(*merged, "mm.0.weight", 1, "columns")
    c.same("clip.vision.projection_dim", c.proj, "mm.2.weight", 0, "rows")
    for i in c.deepstack:
        c.same(*merged, f"v.deepstack.{i}.fc1.weight", 1, "columns")
        c.same("clip.vision.projection_dim", c.proj, f"v.deepstack.{i}.fc2.weight", 0, "rows")


def _heads_image_window(c: _Clip) -> None:
    heads, hidden = c.heads, c.hidden
    if heads is not None and hidden is not None and E not in c.bad:
        if hidden % heads:
            c.lie("clip.vision.attention.head_count", heads, None, f"that does not divide {E} ({hidden})")
        elif (hidden // heads) % 4:
            c.lie("clip.vision.attention.head_count", heads, None,
                  f"that leaves {hidden // heads} of {E} ({hidden}) a head, not a multiple of 4 (the vision "
                  f"rotary embedding's four sections)")
    if c.image is not None and c.patch is not None and P not in c.bad and c.image % c.patch:
        c.lie("clip.vision.image_size", c.image, None, f"that is not a multiple of {P} ({c.patch})")
    if c.window is not None and c.depth is not None and DEPTH not in c.bad and c.window > c.depth:
        c.lie("clip.vision.n_wa_pattern", c.window, None,
              f"that is more than {DEPTH} ({c.depth}): a window pattern longer than the tower")


def _deepstack_flags(c: _Clip) -> None:
    key, flags = "clip.vision.is_deepstack_layers", c.meta.get("clip.vision.is_deepstack_layers")
    count = flags.count if isinstance(flags, Elided) else None     # a long array (inspect): its length only
    if count is None and not (isinstance(flags, list) and all(isinstance(f, bool) for f in flags)):
        c.lie(key, flags, None, "it must be a list of flags, one per vision block")
    elif c.depth is not None and DEPTH not in c.bad and (len(flags) if count is None else count) != c.depth:
        c.lie(key, flags, None, f"that is {len(flags) if count is None else count} flags, not one for each of "
                                f"{DEPTH} ({c.depth}) blocks")
    elif count is None and [i for i, f in enumerate(flags) if f] != c.deepstack:
        c.lie(key, flags, None, "the tensors hold the deepstack mergers "
              + (", ".join(f"v.deepstack.{i}" for i in c.deepstack) or "of no layer"))


def _normalization(c: _Clip) -> None:
    for name in ("image_mean", "image_std"):
        key, value = f"clip.vision.{name}", c.meta.get(f"clip.vision.{name}")
        if not isinstance(value, list) or len(value) != 3 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value) \
                or (name == "image_std" and not all(v > 0 for v in value)):
            c.lie(key, value, None, "an image is normalized by three finite numbers, one per RGB channel"
                  + (", each positive" if name == "image_std" else ""))
    key = "clip.vision.attention.layer_norm_epsilon"
    eps = c.meta.get(key)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        c.lie(key, eps, None, "a norm's epsilon must be a positive finite number")


def checked(meta: Mapping, shapes: Mapping[str, tuple], projector: str, path: Path) -> None:
    """read_back's refusal of an mmproj file whose clip keys contradict its tensors (exit 4, naming the
    first key and tensor), or that says llama.cpp computes another activation than the model's (exit 5)."""
    refuse(clip_disagreements(meta, shapes), file=path, whose="its",
           why="llama.cpp builds the vision tower from the clip keys (and qconv its vision_config), so no loader "
               "builds this one; nothing written")
    tower = _tower(projector)
    own = tower.activation if tower is not None else "clip.use_silu"
    other = "clip.use_silu" if own == "clip.use_gelu" else "clip.use_gelu"
    if meta.get(own) is not True or meta.get(other):
        raise UnsupportedFormat(f"its {own} is {meta.get(own)!r} ({other} {meta.get(other)!r}): llama.cpp then "
                                f"computes the vision MLP with another activation than the {projector} "
                                f"tower's ({'GELU' if own == 'clip.use_gelu' else 'SiLU'}), which qconv does not "
                                f"read back", file=path)
