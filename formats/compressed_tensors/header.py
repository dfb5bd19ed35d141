"""compressed-tensors checkpoints (llm-compressor's ``quant_method: "compressed-tensors"``), described
from tensor headers and the config. Stdlib only, so ``inspect`` stays light; decoding the data is
compressed_tensors/codec.py.

Per quantized Linear ``P``, in nn.Linear orientation ``[out, in]``, with ``b = num_bits`` (1..8) and
``G`` scale groups along in (``ceil(in / group_size)``, 1 for strategy "channel")::

  format "pack-quantized" (compressed_tensors/compressors/pack_quantized/)
    P.weight_packed      I32  [out, ceil(in*b/32)]   codes q + 2^(b-1), LSB-first bitstream along in
    P.weight_scale       F16 / BF16 / F32 [out, G]   the model dtype
    P.weight_shape       I64  [2]                    its VALUE is (out, in); its header shape is [2]
    P.weight_zero_point  I32  [ceil(out*b/32), G]    asymmetric only: zp + 2^(b-1), packed along OUT
    P.weight_g_idx       I32  [in]                   actorder "group" only (written up to 0.18)

  format "int-quantized" (W8A8) / "naive-quantized" (compressors/naive_quantized/)
    P.weight             I8   [out, in]              signed codes q, no offset
    P.weight_scale       [out, G]
    P.weight_zero_point  I8   [out, G]               asymmetric only, signed

Signed codes q lie in [-2^(b-1), 2^(b-1)-1] and dequantize as ``w = (q - zp) * scale`` in the scale's
dtype. The bitstream is the one of pack_to_int32: 32 codes fill exactly b words, codes cross word
edges, a row is padded with zero codes to a multiple of 32 and then cut to ceil(in*b/32) words::

    b = 3:  word 0 = | c10.lo2 | c9 | ... | c1 | c0 |       (c0 in bits 0-2)
            word 1 = | c21.lo1 | c20 | ... | c11 | c10.hi1 |
            word 2 = | c31 | ... | c22 | c21.hi2 |

Before 0.18.0 (commit 66e631f6) a word held 32//b whole codes and left its high bits zero, so 3-, 5-,
6- and 7-bit files of the two eras differ (in=256, 3-bit: 26 words a row padded, 24 dense); 1/2/4/8-bit
layouts are the same in every release. qconv reads the dense layout and refuses the padded one.

Floating-point formats (docs/formats.md, compressed-tensors FP8 to MXFP4), symmetric only; float-quantized FP8 per channel and
in blocks is also written (target compressed-tensors-fp8: float_leaves / float_config, codec.*_fp8)::

  format "float-quantized" (llm-compressor FP8, FP8_DYNAMIC, FP8_BLOCK)
    P.weight             F8_E4M3 [out, in]
    P.weight_scale       the model dtype (F16 / BF16; F32 read too):  strategy "tensor" [1],
                         "channel" [out, 1], "block" [ceil(out/B0), ceil(in/B1)] with the group's
                         ``block_structure`` [B0, B1] (last blocks partial: padded, then cut)
    P.input_scale        [1], static activations only (FP8): carried, not decoded
    w = float(q) * scale, rounded once to the scale's dtype

  format "nvfp4-pack-quantized" (NVFP4A16, NVFP4: strategy "tensor_group", group_size 16)
    P.weight_packed        U8 [out, in/2]   e2m1 codes, element 2i in the LOW nibble
    P.weight_scale         F8_E4M3 [out, in/16]
    P.weight_global_scale  F32 [1]          a DIVISOR (2688 / amax)
    P.input_global_scale   F32 [1]          NVFP4 (activations): carried, not decoded
    w = bf16(e2m1 * (float32(scale) / global)): compressed-tensors unpacks FP4 into bfloat16 for any
    model dtype, so a float16 model's weight is rounded twice (QuantTensor.product_dtype)

  format "mxfp4-pack-quantized" (MXFP4A16: strategy "group", group_size 32)
    P.weight_packed      U8 [out, in/2]     as NVFP4
    P.weight_scale       U8 [out, in/32]    e8m0 bytes b: 2^(b - 127) (255 is NaN)
    w = e2m1 * 2^(b - 127), exact in bfloat16 and in every model dtype that holds it

Which config group quantizes a module follows compressed_tensors/utils/match.py and
quantization/lifecycle/apply.py: a target or ignore entry matches by exact name, by ``re:<regex>``
with re.match (anchored at the start only), or by class name ("Linear"); ``ignore`` wins; among the
targets that match, exact names come first, then regexes, then class names (each kind sorted), and
a target named by two groups belongs to the later one.
"""

from __future__ import annotations

import math
import struct
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Mapping

from ...errors import CorruptCheckpoint, NotStorable, UnsupportedFormat
from ..core.layout import (FUSED_LAYER_NAMES, NVFP4_GROUP, QuantModule, check_nvfp4_shape, fused_group,  # noqa: F401
                           int_scheme, natural_key)
from ..storage.safetensors_header import DTYPES, TensorInfo, read_small_tensors

if TYPE_CHECKING:                    # numpy-backed; only read by attribute here
    from ..core.ir import QuantSpec

QUANT_METHOD = "compressed-tensors"
PACKED = "pack-quantized"
INT = "int-quantized"
NAIVE = "naive-quantized"
READABLE_FORMATS = (PACKED, INT, NAIVE)    # integer formats: read and written
FLOAT = "float-quantized"
NVFP4 = "nvfp4-pack-quantized"
MXFP4 = "mxfp4-pack-quantized"
FLOAT_FORMATS = (FLOAT, NVFP4, MXFP4)      # floating-point formats: read (FLOAT also written)
MIXED = "mixed-precision"
# The release whose layout config_for describes (dense sub-byte packing, no act-order g_idx).
LAYOUT_VERSION = "0.19.0"
DENSE_SINCE = (0, 18)

WEIGHT_LEAVES = ("weight_packed", "weight")
STATE_LEAVES = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
# Written beside a module's weight by other schemes (static activations, nvfp4): claimed, not decoded.
EXTRA_STATE_LEAVES = ("weight_global_scale", "input_scale", "input_zero_point", "input_global_scale",
                      "output_scale", "output_zero_point")
_SCALE_DTYPES = ("F16", "BF16", "F32")
_FP8_STRATEGIES = ("tensor", "channel", "block")
# format -> (scheme, bits, strategy, group size, scale dtype) of the FP4 formats (compressors/nvfp4,
# compressors/mxfp4: each compressor takes exactly this scheme, can_compress).
_FP4 = {NVFP4: ("e2m1", 4, "tensor_group", 16, "F8_E4M3"), MXFP4: ("e2m1", 4, "group", 32, "U8")}
_INT_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
_PADDED_BITS = (3, 5, 6, 7)              # the widths whose layout changed in 0.18


# ---------------------------------------------------------------------------------------------
# Config

def _targets(entry) -> list[str]:
    if entry is None:
        return []
    if isinstance(entry, str):
        return [entry]
    return [t for t in entry if isinstance(t, str)]


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' match_name: ``re:`` + re.match (anchored at the start, not the end), else
    the exact name. An invalid regex matches nothing."""
    if target.startswith("re:"):
        try:
            return re.match(target[3:], name) is not None
        except re.error:
            return False
    return target == name


def _class_names(class_name) -> tuple[str, ...]:
    if class_name is None:
        return ()
    if isinstance(class_name, str):
        return (class_name,)
    return tuple(class_name)


def _matches(name: str, classes: tuple[str, ...], target: str) -> bool:
    return match_name(name, target) or target in classes


def is_ignored(qc: Mapping, module_name: str, class_name="Linear") -> bool:
    classes = _class_names(class_name)
    return any(_matches(module_name, classes, t) for t in _targets(qc.get("ignore")))


def scheme_for(qc: Mapping | None, module_name: str, class_name="Linear") -> tuple[str, dict] | None:
    """(group name, group dict) of the config group that quantizes ``module_name``, or None when no
    group targets it or ``ignore`` names it. ``class_name`` is the module's class name (or the names
    of its classes, most derived first); headers cannot tell, so a module with quantized tensors is
    taken to be a Linear."""
    if not qc:
        return None
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        return None
    classes = _class_names(class_name)
    if is_ignored(qc, module_name, classes):
        return None
    target_to_group: dict[str, str] = {}
    for gname, group in groups.items():
        if isinstance(group, Mapping):
            for target in _targets(group.get("targets")):
                target_to_group[target] = gname          # a later group takes a repeated target
    ordered = sorted(target_to_group, key=lambda t: (t.startswith("re:"), t))
    matched = [t for t in ordered if match_name(module_name, t)]
    matched += [t for t in ordered if t in classes and t not in matched]
    if not matched:
        return None
    gname = target_to_group[matched[0]]
    return gname, groups[gname]


def weight_args(group: Mapping) -> dict:
    """The group's ``weights`` QuantizationArgs with compressed-tensors' defaults and its strategy
    inference (group_size None -> tensor, > 0 -> group, -1 -> channel)."""
    w = group.get("weights")
    if not isinstance(w, Mapping):
        return {}
    args = {"num_bits": w.get("num_bits", 8), "type": str(w.get("type") or "int").lower(),
            "symmetric": w.get("symmetric", True), "group_size": w.get("group_size"),
            "strategy": w.get("strategy"), "actorder": w.get("actorder"),
            "dynamic": w.get("dynamic", False), "block_structure": w.get("block_structure"),
            "scale_dtype": w.get("scale_dtype")}
    strategy = args["strategy"]
    gs = args["group_size"]
    if strategy is None:
        strategy = ("tensor" if gs is None else "group" if isinstance(gs, int) and gs > 0
                    else "channel" if gs == -1 else None)
    args["strategy"] = str(strategy).lower() if strategy is not None else None
    if args["actorder"] is True:                    # before 0.19: True meant "group"
        args["actorder"] = "group"
    if args["actorder"] == "dynamic":
        args["actorder"] = "group"
    if args["actorder"] == "static":
        args["actorder"] = "weight"
    return args


def group_format(qc: Mapping, group: Mapping) -> str:
    """The format a group's modules are stored in: the group's own ``format``, else the top-level one
    (unless it is "mixed-precision"), else what compressed-tensors infers from the scheme
    (compressors/format.py: int weights with activations -> int-quantized, 1..8-bit int weights ->
    pack-quantized, 4-bit float weights in groups of 32 -> mxfp4-pack-quantized, of 16 ->
    nvfp4-pack-quantized, 8-bit float weights -> float-quantized, otherwise naive-quantized)."""
    fmt = group.get("format")
    if fmt:
        return str(fmt)
    top = qc.get("format")
    if top and top != MIXED:
        return str(top)
    args = weight_args(group)
    acts = group.get("input_activations")
    if args.get("type") == "int" and isinstance(acts, Mapping):
        return INT if str(acts.get("type") or "int").lower() == "int" else "float-quantized"
    if args.get("type") == "int" and isinstance(args.get("num_bits"), int) and 1 <= args["num_bits"] <= 8:
        return PACKED
    if args.get("type") == "float" and args.get("num_bits") == 4:
        return {32: MXFP4, 16: NVFP4}.get(args.get("group_size"), NAIVE)
    if args.get("type") == "float" and args.get("num_bits") == 8:
        return FLOAT
    return NAIVE


def parse_version(version) -> tuple[int, ...] | None:
    """(major, minor, patch) of a compressed-tensors version string ("0.17.1", "0.12.3.a2025...")."""
    if not isinstance(version, str):
        return None
    parts = []
    for piece in version.split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
    return tuple(parts) if parts else None


# ---------------------------------------------------------------------------------------------
# Modules from headers

def _dense_range(cols: int, bits: int) -> tuple[int, int]:
    """in_features for which ceil(in*b/32) == cols."""
    return (cols - 1) * 32 // bits + 1, cols * 32 // bits


def _padded_range(cols: int, bits: int) -> tuple[int, int]:
    """in_features for which the pre-0.18 layout, ceil(in / (32//b)) words, has cols words."""
    per_word = 32 // bits
    return (cols - 1) * per_word + 1, cols * per_word


def _meet(a: tuple[int, int], b: tuple[int, int] | None) -> tuple[int, int] | None:
    if b is None:
        return a if a[0] <= a[1] else None
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo <= hi else None


def padded_layout_message(bits: int, version, evidence: str) -> str:
    return (f"weight_packed is in the padded {bits}-bit layout of compressed-tensors before 0.18 "
            f"({32 // bits} codes per int32 word, high bits unused; {evidence}); qconv reads only the "
            f"dense layout of compressed-tensors 0.18 and later. Load the checkpoint with the "
            f"compressed-tensors release that wrote it"
            f"{f' ({version})' if isinstance(version, str) else ''} and save it again with 0.18 or "
            f"later")


class _Problems:
    """Problems of one module, each with its kind (corrupt / unsupported) and the tensor it is about;
    unsupported ones first, since a layout qconv does not read also makes the shapes look wrong."""

    def __init__(self):
        self.items: list[tuple[str, str | None, str]] = []

    def corrupt(self, tensor: str | None, message: str) -> None:
        self.items.append(("corrupt", tensor, message))

    def unsupported(self, tensor: str | None, message: str) -> None:
        self.items.append(("unsupported", tensor, message))

    def ordered(self):
        return sorted(self.items, key=lambda item: item[0] != "unsupported")


def _prefixes(tensors: Mapping[str, TensorInfo]) -> list[str]:
    found = set()
    for name, info in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix:
            continue
        if leaf in ("weight_packed", "weight_scale"):
            found.add(prefix)
        elif leaf == "weight" and info.dtype in _INT_DTYPES and len(info.shape) == 2:
            found.add(prefix)
    return sorted(found, key=natural_key)


def _transform_groups(qc: Mapping | None) -> list[str]:
    """The transform schemes a config applies (compressed-tensors' TransformConfig: config_groups of
    TransformScheme, e.g. {"type": "hadamard", "apply": [...]}, their online parts stored as
    `<module>.<group>_<location>.weight` tensors): "u (hadamard)", ...; [] when there are none."""
    tc = qc.get("transform_config") if isinstance(qc, Mapping) else None
    if not tc:
        return []
    groups = tc.get("config_groups") if isinstance(tc, Mapping) else None
    if isinstance(groups, Mapping):
        return [f"{name} ({g.get('type', '?') if isinstance(g, Mapping) else '?'})" for name, g in groups.items()]
    return [repr(tc)[:60]]                        # not the documented shape: still a transform, refused


def _weight_shapes(tensors: Mapping[str, TensorInfo]) -> dict[str, tuple[int, int]]:
    """The value of every well-formed `weight_shape` tensor (I64 [2], 16 bytes: read like bitsandbytes'
    few-byte metadata, one open per file): a packed row of ceil(in*b/32) words pins in_features only to
    a range when in*b is not a multiple of 32 (compressed-tensors pads each row), and this says which."""
    infos = [i for n, i in tensors.items() if n.endswith(".weight_shape") and i.dtype == "I64"
             and tuple(i.shape) == (2,)]
    out = {}
    for name, raw in read_small_tensors(infos, limit=16).items():
        a, b = struct.unpack("<qq", raw)
        out[name] = (a, b)
    return out


def find_modules(tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> list[QuantModule]:
    """Every module that holds compressed-tensors quantization tensors (``weight_packed``,
    ``weight_scale`` or an integer ``weight`` matrix), described from headers and config alone.

    ``in_features`` is exact for int-quantized weights and for grouped ones with more than one
    group (in = groups x group_size: compressed-tensors quantizes whole groups only). Otherwise
    (channel strategy, pack-quantized) the packed width pins it only to a range; ``in_features`` is
    the widest value of it (the true one whenever in*b is a multiple of 32), ``details["in_range"]``
    the range, and ``weight_shape`` (data, read by compressed_tensors.codec.read) decides.
    """
    qc = qc or {}
    version = qc.get("version")
    modules = []
    shapes = _weight_shapes(tensors)
    for prefix in _prefixes(tensors):
        p = _Problems()
        t = {leaf: tensors.get(f"{prefix}.{leaf}") for leaf in WEIGHT_LEAVES + STATE_LEAVES}
        tname = {leaf: f"{prefix}.{leaf}" for leaf in WEIGHT_LEAVES + STATE_LEAVES}
        packed, weight, scale = t["weight_packed"], t["weight"], t["weight_scale"]
        zp, shape_t, g_idx = t["weight_zero_point"], t["weight_shape"], t["weight_g_idx"]

        match = scheme_for(qc, prefix) if qc else None
        group_name, group = (match if match else (None, {}))
        args = weight_args(group) if match else {}
        fmt = group_format(qc, group) if match else qc.get("format")
        if not qc:
            p.corrupt(None, "holds compressed-tensors quantization tensors but the checkpoint has no "
                            "quantization_config")
        elif qc.get("quant_method") not in (None, QUANT_METHOD):
            p.unsupported(None, f"holds compressed-tensors tensors but quant_method is "
                                f"{qc.get('quant_method')!r}")
        elif match is None:
            if is_ignored(qc, prefix):
                p.corrupt(None, "the config's ignore list names this module, but it holds quantized "
                                "tensors")
            else:
                p.corrupt(None, "no config group targets this module, but it holds quantized tensors")
        elif not args:
            p.corrupt(None, f"config group {group_name!r} quantizes no weights (weights: null), but "
                            f"the module holds quantized weight tensors")

        transforms = _transform_groups(qc)
        if transforms:
            p.unsupported(None, f"the config's transform_config applies {', '.join(transforms)} (rotations "
                                f"llm-compressor's SpinQuant / QuIP transforms fuse into the weights and apply "
                                f"to activations at run time); qconv does not apply them, so anything it "
                                f"wrote would compute something else")
        status = qc.get("quantization_status")
        if qc and status not in (None, "compressed"):
            p.unsupported(None, f"quantization_status is {status!r}: the weights are stored "
                                f"{'fake-quantized in float' if status == 'frozen' else 'uncompressed'},"
                                f" not compressed; qconv reads compressed checkpoints")
        if fmt in FLOAT_FORMATS:
            modules.append(_float_module(prefix, tensors, p, group_name, args, fmt, version))
            continue
        if match and fmt not in READABLE_FORMATS:
            p.unsupported(None, f"config group {group_name!r} is stored as format {fmt!r}, which qconv "
                                f"does not decode (it reads {', '.join(READABLE_FORMATS + FLOAT_FORMATS)})")
        if args and args["type"] != "int":
            p.unsupported(None, f"config group {group_name!r} quantizes weights to type "
                                f"{args['type']!r} in format {fmt!r}; qconv reads float weights in the "
                                f"formats {', '.join(FLOAT_FORMATS)} only")
        bits = args.get("num_bits") if args else None
        if args and (not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8):
            p.unsupported(None, f"config group {group_name!r} has num_bits {bits!r}; compressed-tensors "
                                f"packs 1- to 8-bit integer codes")
            bits = None
        strategy = args.get("strategy") if args else None
        if args and strategy not in ("group", "channel"):
            p.unsupported(None, f"config group {group_name!r} uses weight strategy {strategy!r}; qconv "
                                f"reads strategies 'group' and 'channel'")
        gs = args.get("group_size") if strategy == "group" else (-1 if strategy == "channel" else None)
        if strategy == "group" and not (isinstance(gs, int) and gs > 0):
            p.corrupt(None, f"config group {group_name!r} has strategy 'group' but group_size {gs!r}")
            gs = None
        symmetric = bool(args.get("symmetric", True)) if args else True
        actorder = args.get("actorder") if args else None

        # Layout: which tensors hold the codes.
        layout = None
        if packed is not None:
            layout = "pack"
            if weight is not None:
                p.corrupt(tname["weight"], "the module holds both weight and weight_packed")
        elif weight is not None and weight.dtype in _INT_DTYPES:
            layout = "int"
        elif weight is not None and scale is not None:
            p.unsupported(tname["weight"], f"weight is {weight.dtype} beside a weight_scale: stored "
                                           f"fake-quantized (or as float8), not as integer codes qconv "
                                           f"decodes")
        else:
            p.corrupt(tname["weight_scale"], "weight_scale has no weight_packed or weight tensor "
                                             "beside it")
        if layout == "pack" and fmt in (INT, NAIVE):
            p.corrupt(tname["weight_packed"], f"the module is stored packed (weight_packed) but its "
                                              f"config group's format is {fmt!r}")
        if layout == "int" and fmt == PACKED:
            p.corrupt(tname["weight"], f"the module stores an unpacked {weight.dtype} weight but its "
                                       f"config group's format is {fmt!r}")

        # Scales give out and the number of groups.
        out = groups = None
        if scale is None:
            p.corrupt(tname["weight_scale"], "quantized module has no weight_scale tensor")
        elif len(scale.shape) != 2:
            p.corrupt(tname["weight_scale"], f"weight_scale has shape {list(scale.shape)}, expected "
                                             f"[out, groups]")
        else:
            out, groups = scale.shape
            if scale.dtype not in _SCALE_DTYPES:
                p.unsupported(tname["weight_scale"], f"weight_scale is {scale.dtype}; qconv reads "
                                                     f"{', '.join(_SCALE_DTYPES)} scales")
            if strategy == "channel" and groups != 1:
                p.corrupt(tname["weight_scale"], f"weight_scale has {groups} columns but strategy "
                                                 f"'channel' has one scale per output row")
        code_t = packed if layout == "pack" else weight if layout == "int" else None
        code_name = tname["weight_packed"] if layout == "pack" else tname["weight"]
        if code_t is not None and len(code_t.shape) != 2:
            p.corrupt(code_name, f"{code_name.rpartition('.')[2]} has shape {list(code_t.shape)}, "
                                 f"expected a matrix")
            code_t = None
        if code_t is not None and out is None:
            out = code_t.shape[0]
        if code_t is not None and code_t.shape[0] != out:
            p.corrupt(code_name, f"{code_name.rpartition('.')[2]} has {code_t.shape[0]} rows but "
                                 f"weight_scale has {out}")

        # compressed-tensors refuses a row wider than one group that is not whole groups
        # (forward_helpers._process_group): G > 1 groups pin in to G * group_size.
        group_range = None
        if strategy == "group" and gs and groups:
            group_range = (groups * gs, groups * gs) if groups > 1 else (1, gs)
        inp, in_range = 0, None
        if layout == "int" and code_t is not None:
            inp = code_t.shape[1]
            in_range = (inp, inp)
            if weight.dtype != "I8":
                p.unsupported(code_name, f"weight is {weight.dtype}; compressed-tensors stores integer "
                                         f"codes of up to 8 bits as I8")
            if group_range and _meet((inp, inp), group_range) is None:
                p.corrupt(tname["weight_scale"], f"weight_scale has {groups} groups of {gs}, which do "
                                                 f"not divide {inp} input channels")
        elif layout == "pack" and code_t is not None and bits:
            cols = code_t.shape[1]
            if packed.dtype != "I32":
                p.corrupt(code_name, f"weight_packed is {packed.dtype}, expected I32 words")
            older = parse_version(version)
            pre_dense = older is not None and older[:2] < DENSE_SINCE
            in_range = _meet(_dense_range(cols, bits), group_range)
            if bits in _PADDED_BITS and pre_dense:
                p.unsupported(code_name, padded_layout_message(bits, version, f"the config says it was "
                                                               f"written by compressed-tensors {version}"))
            elif (in_range is None and bits in _PADDED_BITS
                  and _meet(_padded_range(cols, bits), group_range)):
                p.unsupported(code_name, padded_layout_message(
                    bits, version, f"{cols} words a row fit {groups} groups of {gs} only that way"))
            elif in_range is None:
                lo, hi = _dense_range(cols, bits)
                p.corrupt(code_name, f"weight_packed has {cols} words a row ({lo}..{hi} {bits}-bit codes), "
                                     f"but weight_scale's {groups} groups of {gs} make "
                                     f"{'..'.join(map(str, sorted(set(group_range))))} input channels")
            if in_range is not None:
                inp = in_range[1]
                told = shapes.get(tname["weight_shape"])
                if told is not None and told[0] == out and in_range[0] <= told[1] <= in_range[1]:
                    inp = told[1]                    # weight_shape, where it agrees with the headers
            if shape_t is None:
                p.corrupt(tname["weight_shape"], "pack-quantized module has no weight_shape tensor")
            elif shape_t.dtype not in _INT_DTYPES or shape_t.shape != (2,):
                p.corrupt(tname["weight_shape"], f"weight_shape is {shape_t.dtype} "
                                                 f"{list(shape_t.shape)}, expected I64 [2]")

        # Zero points.
        if zp is not None and symmetric:
            p.corrupt(tname["weight_zero_point"], "weight_zero_point is stored but the config says "
                                                  "symmetric")
        if not symmetric and args:
            if zp is None:
                p.corrupt(tname["weight_zero_point"], "asymmetric module has no weight_zero_point "
                                                      "tensor")
            elif layout == "pack" and out and groups and bits:
                want = (math.ceil(out * bits / 32), groups)
                if zp.dtype != "I32" or zp.shape != want:
                    p.corrupt(tname["weight_zero_point"], f"weight_zero_point is {zp.dtype} "
                                                          f"{list(zp.shape)}, expected I32 {list(want)} "
                                                          f"(packed along out)")
            elif layout == "int" and out and groups:
                if zp.dtype not in _INT_DTYPES or zp.shape != (out, groups):
                    p.corrupt(tname["weight_zero_point"], f"weight_zero_point is {zp.dtype} "
                                                          f"{list(zp.shape)}, expected an integer "
                                                          f"[{out}, {groups}]")
        if g_idx is not None:
            if strategy != "group":
                p.corrupt(tname["weight_g_idx"], f"weight_g_idx is stored but the weight strategy is "
                                                 f"{strategy!r}, not 'group'")
            fits = in_range is None or (len(g_idx.shape) == 1
                                        and in_range[0] <= g_idx.shape[0] <= in_range[1])
            if g_idx.dtype not in _INT_DTYPES or len(g_idx.shape) != 1 or not fits:
                p.corrupt(tname["weight_g_idx"], f"weight_g_idx is {g_idx.dtype} {list(g_idx.shape)}, "
                                                 f"expected an integer [{inp}]")
            elif in_range is not None:               # one entry per input channel: in, exactly
                inp = g_idx.shape[0]
                in_range = (inp, inp)

        ordered = p.ordered()
        weight_tensors = tuple(tname[leaf] for leaf in WEIGHT_LEAVES if t[leaf] is not None)
        state = tuple(tname[leaf] for leaf in STATE_LEAVES if t[leaf] is not None)
        state += tuple(f"{prefix}.{leaf}" for leaf in EXTRA_STATE_LEAVES if f"{prefix}.{leaf}" in tensors)
        details = {"format": fmt, "strategy": strategy, "symmetric": symmetric, "group": group_name,
                   "scale_dtype": scale.dtype if scale is not None else None,
                   "scales_dtype": scale.dtype if scale is not None else None,      # registry's key
                   "actorder": actorder,
                   "layout": layout, "in_range": in_range, "version": version,
                   "has_g_idx": g_idx is not None,
                   "act_order": g_idx is not None,      # weight_g_idx is stored for act-order only
                   "problem_kinds": tuple(k for k, _, _ in ordered),
                   "problem_tensors": tuple(tn for _, tn, _ in ordered)}
        modules.append(QuantModule(prefix, "ct", int_scheme(bits or 0), bits or 0, out or 0, inp,
                                   weight_tensors, state, group_size=gs, details=details,
                                   problems=tuple(msg for _, _, msg in ordered)))
    return [_with_activation(m, tensors, qc) for m in modules]


def _static_activation(group: Mapping, prefix: str, tensors: Mapping[str, TensorInfo]) -> dict | None:
    """The module's static activation scale (core/activation.py) its config group declares and its
    tensors hold: FP8 static per tensor (``input_scale``, a multiplier) or NVFP4 W4A4
    (``input_global_scale``, a divisor: 448 * 6 / amax); None for dynamic or unquantized activations, and
    for schemes no target holds (static int8, zero points)."""
    acts = group.get("input_activations") if isinstance(group, Mapping) else None
    if not isinstance(acts, Mapping) or acts.get("type") != "float":
        return None
    if acts.get("dynamic") is False and acts.get("num_bits") == 8 and acts.get("strategy") == "tensor":
        scheme, leaf, kind = "fp8", "input_scale", "multiplier"
    elif acts.get("dynamic") == "local" and acts.get("num_bits") == 4 and acts.get("group_size") == NVFP4_GROUP:
        scheme, leaf, kind = "nvfp4", "input_global_scale", "divisor"
    else:
        return None
    name = f"{prefix}.{leaf}"
    return {"scheme": scheme, "tensor": name, "kind": kind} if name in tensors else None


def _declared_activations(gname: str, group: Mapping, prefix: str) -> dict | None:
    """What the module's config group says of its activations, whatever its tensors hold
    (core/activation.py, details["activations"]): static (dynamic false: ``input_scale``; NVFP4's
    dynamic "local" tensor_group: ``input_global_scale``, the static global scale its run-time group
    scales are under), dynamic (dynamic true) or unquantized (no input_activations): none stored. None
    where the group says something else (qconv then holds the tensors to nothing)."""
    acts = group.get("input_activations") if isinstance(group, Mapping) else None
    label = f"config group {gname!r}"
    if acts is None:
        return {"static": False, "activations": "unquantized", "by": f"{label}: no input_activations, weights only"}
    if not isinstance(acts, Mapping):
        return None
    dynamic = acts.get("dynamic")
    if dynamic is False:
        return {"static": True, "tensor": f"{prefix}.input_scale", "by": f"{label}: input_activations dynamic false",
                "one": acts.get("strategy") == "tensor"}
    if dynamic == "local" and acts.get("strategy") == "tensor_group":
        return {"static": True, "tensor": f"{prefix}.input_global_scale",
                "by": f"{label}: input_activations dynamic \"local\", strategy tensor_group", "one": True}
    if dynamic is True:
        return {"static": False, "activations": "dynamic", "by": f"{label}: input_activations dynamic true"}
    return None


def _with_activation(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> QuantModule:
    match = scheme_for(qc, m.name) if qc else None
    if match is None:
        return m
    act = _static_activation(match[1], m.name, tensors)
    said = _declared_activations(match[0], match[1], m.name)
    details = {**m.details, **({"activation": act} if act is not None else {}),
               **({"activations": said} if said is not None else {})}
    return replace(m, details=details)


def _block_structure(value) -> list[int] | None:
    """A group's block_structure as compressed-tensors' validator takes it ([rows, cols] of positive
    integers, or the older "RxC" string), else None."""
    if isinstance(value, str):
        try:
            value = [int(x) for x in value.split("x")]
        except ValueError:
            return None
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        return list(value)
    return None


def _float_module(prefix: str, tensors: Mapping[str, TensorInfo], p: _Problems, group_name, args: Mapping,
                  fmt: str, version) -> QuantModule:
    """One module of a floating-point format (float-quantized FP8, nvfp4- / mxfp4-pack-quantized FP4; the
    module docstring), from headers and its config group: scheme e4m3 or e2m1, what codec.read needs in
    ``details`` (layout.QuantModule's e4m3 / e2m1 conventions: "scales_dtype", "block_rows", and
    "global_scale" for NVFP4), and every way the config, the headers and the format disagree as a
    problem (``p`` holds those the config alone raised)."""
    def leaf(name: str) -> str:
        return f"{prefix}.{name}"

    fp4 = fmt in _FP4
    scheme, bits, fp4_strategy, fp4_group, fp4_scale = _FP4[fmt] if fp4 else ("e4m3", 8, None, None, None)
    code_leaf = "weight_packed" if fp4 else "weight"
    code_name, scale_name, global_name = leaf(code_leaf), leaf("weight_scale"), leaf("weight_global_scale")
    code, scale, global_t = tensors.get(code_name), tensors.get(scale_name), tensors.get(global_name)
    label = f"config group {group_name!r}"
    strategy = args.get("strategy") if args else None
    block = None

    # The config group against the format.
    if args:
        if args["type"] != "float" or args["num_bits"] != bits:
            p.corrupt(None, f"{label} is stored as {fmt!r} but quantizes weights to {args['type']} "
                            f"{args['num_bits']!r}-bit; {fmt} holds {bits}-bit float weights")
        if not args["symmetric"]:
            p.unsupported(None, f"{label} quantizes {fmt} weights asymmetrically; qconv reads symmetric "
                                f"float weights only")
        if fp4 and (strategy != fp4_strategy or args["group_size"] != fp4_group):
            p.unsupported(None, f"{label} has weight strategy {strategy!r} with group_size "
                                f"{args['group_size']!r}; {fmt} is strategy {fp4_strategy!r} in groups of "
                                f"{fp4_group}, the only layout qconv reads")
        elif not fp4 and strategy not in _FP8_STRATEGIES:
            p.unsupported(None, f"{label} uses weight strategy {strategy!r}; qconv reads {fmt} weights "
                                f"with strategies {', '.join(map(repr, _FP8_STRATEGIES))}")
        elif strategy == "block":
            block = _block_structure(args.get("block_structure"))
            if block is None:
                p.corrupt(None, f"{label} has weight strategy 'block' but block_structure "
                                f"{args.get('block_structure')!r}, expected [rows, cols] of positive integers")

    # The codes give out and in.
    out = inp = 0
    if code is None:
        p.corrupt(code_name, f"{fmt} module has no {code_leaf} tensor")
    elif len(code.shape) != 2:
        p.corrupt(code_name, f"{code_leaf} has shape {list(code.shape)}, expected a matrix")
        code = None
    else:
        out, inp = code.shape[0], code.shape[1] * (2 if fp4 else 1)
        if fp4 and code.dtype != "U8":
            p.corrupt(code_name, f"weight_packed is {code.dtype}, expected U8 bytes of two e2m1 codes")
        elif not fp4 and code.dtype != "F8_E4M3":
            p.unsupported(code_name, f"weight is {code.dtype}; {fmt} 8-bit weights are F8_E4M3 (e4m3) codes, "
                                     f"the only ones qconv reads")

    # Scales: one per block of block_rows x group_size (block_rows 0: one for the tensor).
    block_rows, group_size = 1, -1
    if fp4:
        group_size = fp4_group
    elif strategy == "tensor":
        block_rows = 0
    elif strategy == "block" and block:
        block_rows, group_size = block
    if scale is None:
        p.corrupt(scale_name, "quantized module has no weight_scale tensor")
    else:
        shape = list(scale.shape)
        if fp4 and scale.dtype != fp4_scale:
            p.unsupported(scale_name, f"weight_scale is {scale.dtype}; {fmt} stores {fp4_scale} scales "
                                      f"({'e4m3' if fmt == NVFP4 else 'e8m0 bytes'}), the only ones qconv reads")
        elif not fp4 and scale.dtype not in _SCALE_DTYPES:
            p.unsupported(scale_name, f"weight_scale is {scale.dtype}; qconv reads {', '.join(_SCALE_DTYPES)} "
                                      f"{fmt} scales")
        if code is not None and fp4:
            want = [out, -(-inp // group_size)]
            if shape != want:
                p.corrupt(scale_name, f"weight_scale has shape {shape}; groups of {group_size} over a {out} x "
                                      f"{inp} weight give {want}")
        elif code is not None and strategy == "tensor":
            if math.prod(shape) != 1:
                p.corrupt(scale_name, f"weight_scale has shape {shape}; strategy 'tensor' has one scale")
        elif code is not None and strategy == "channel":
            if shape != [out, 1]:
                p.corrupt(scale_name, f"weight_scale has shape {shape}; strategy 'channel' over a {out} x {inp} "
                                      f"weight gives [{out}, 1]")
        elif code is not None and strategy == "block" and block:
            want = [-(-out // block[0]), -(-inp // block[1])]
            if shape != want:
                p.corrupt(scale_name, f"weight_scale has shape {shape}; block_structure {block} over a {out} x "
                                      f"{inp} weight gives {want}")
    if fmt == NVFP4:
        if global_t is None:
            p.corrupt(global_name, f"{fmt} module has no weight_global_scale tensor")
        elif global_t.dtype != "F32" or list(global_t.shape) != [1]:
            p.corrupt(global_name, f"weight_global_scale is {global_t.dtype} {list(global_t.shape)}, expected "
                                   f"F32 [1]")
    elif global_t is not None:
        p.corrupt(global_name, f"weight_global_scale is stored, but {fmt} has one level of scales")
    stray = [t for t in ("weight_packed" if not fp4 else "weight", "weight_zero_point", "weight_shape",
                         "weight_g_idx") if leaf(t) in tensors]
    for t in stray:
        p.corrupt(leaf(t), f"{t} is stored beside a {fmt} module, which holds none (symmetric float "
                           f"weights{', packed' if fp4 else ''})")

    ordered = p.ordered()
    state = tuple(leaf(t) for t in ("weight_scale",) + EXTRA_STATE_LEAVES + tuple(stray) if leaf(t) in tensors)
    details = {"format": fmt, "strategy": strategy, "symmetric": True, "group": group_name,
               "scale_dtype": scale.dtype if scale is not None else None,
               "scales_dtype": scale.dtype if scale is not None else None,      # registry's key
               "block_rows": block_rows, "block_structure": block,
               "layout": "fp4" if fp4 else "fp8", "in_range": (inp, inp), "version": version,
               "has_g_idx": False, "act_order": False,
               "problem_kinds": tuple(k for k, _, _ in ordered),
               "problem_tensors": tuple(tn for _, tn, _ in ordered)}
    if fmt == NVFP4:
        details["global_scale"] = "divisor"
        details["product_dtype"] = "BF16"      # decoded through bfloat16 (QuantTensor.product_dtype)
    return QuantModule(prefix, "ct", scheme, bits, out, inp, (code_name,) if code is not None else (), state,
                       group_size=group_size, details=details, problems=tuple(msg for _, _, msg in ordered))


def check(m: QuantModule, tensors: Mapping[str, TensorInfo], qc: Mapping | None) -> None:
    """Refuse, from headers and config, a module compressed_tensors.codec.read could not decode exactly:
    UnsupportedFormat for a layout or scheme qconv does not read, CorruptCheckpoint for files that
    disagree with themselves. Names the file and the tensor concerned."""
    if not m.problems:
        return
    kinds = m.details.get("problem_kinds") or ("corrupt",) * len(m.problems)
    names = m.details.get("problem_tensors") or (None,) * len(m.problems)
    kind, tensor, problem = kinds[0], names[0], m.problems[0]
    info = tensors.get(tensor) if tensor else None
    file = info.file if info is not None else m.file(tensors)
    if kind == "unsupported":
        raise UnsupportedFormat(problem, file=file, tensor=tensor or m.name)
    raise CorruptCheckpoint(problem + "; cannot decode it", file=file, tensor=tensor or m.name)


# ---------------------------------------------------------------------------------------------
# What inspect reports

_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*")


def _common(values):
    values = set(values)
    return values.pop() if len(values) == 1 else (sorted(values, key=str) if values else None)


def settings(qc: Mapping | None, modules, all_modules=(), comp=None, warnings: list | None = None) -> dict:
    """Report fields for a compressed-tensors component (stdlib only), and its lints, appended to
    ``warnings``: a name or ``re:`` target that matches no module of the checkpoint (compressed-tensors
    warns "Could not match" and quantizes nothing there), an invalid regex, kv-cache quantization whose
    scales qconv does not carry over. Static activation scales are a fact of a group
    (``activation_scales``), not a warning: convert carries them (core/activation.py)."""
    qc = qc or {}
    warnings = warnings if warnings is not None else []
    ours = [m for m in modules if m.family == "ct"]
    names = sorted(set(all_modules) | {m.name for m in ours}, key=natural_key)
    groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), Mapping) else {}
    described = {}
    for gname, group in groups.items():
        if not isinstance(group, Mapping):
            warnings.append(f"config_groups.{gname} is not an object")
            continue
        args = weight_args(group)
        acts = group.get("input_activations")
        entry = {"targets": _targets(group.get("targets")), "format": group_format(qc, group),
                 "num_bits": args.get("num_bits"), "type": args.get("type"), "strategy": args.get("strategy"),
                 "group_size": args.get("group_size"), "symmetric": args.get("symmetric")}
        for key in ("block_structure", "scale_dtype"):       # set by the floating-point presets only
            if args.get(key) is not None:
                entry[key] = args[key]
        dynamic = acts.get("dynamic") if isinstance(acts, Mapping) else None
        how = " dynamic (static global scale)" if dynamic == "local" else " dynamic" if dynamic else " static"
        entry["input_activations"] = (None if not isinstance(acts, Mapping) else
                                      f"{acts.get('type', 'int')}{acts.get('num_bits', 8)} {acts.get('strategy')}{how}")
        entry["modules"] = sum(1 for m in ours if m.details.get("group") == gname)
        described[gname] = entry
        for target in _targets(group.get("targets")):
            if target.startswith("re:"):
                try:
                    rx = re.compile(target[3:])
                except re.error as exc:
                    warnings.append(f"config_groups.{gname} target {target!r} is not a valid regex ({exc})")
                    continue
                if not any(rx.match(n) for n in names):
                    warnings.append(f"config_groups.{gname} target {target!r} matches no module of this "
                                    f"checkpoint")
            elif not _CLASS_NAME.fullmatch(target) and target not in names:
                warnings.append(f"config_groups.{gname} target {target!r} names no module of this checkpoint")
        members = [m for m in ours if m.details.get("group") == gname]
        static = [m for m in members if m.details.get("activation")]
        if static:                # a fact, not a risk: convert carries them where the target holds the scheme
            leaf = static[0].details["activation"]["tensor"].rsplit(".", 1)[-1]
            entry["activation_scales"] = (f"{leaf} on {len(static)} of {len(members)} modules (static, "
                                          f"calibrated; carried by targets that hold them)")
    for target in _targets(qc.get("ignore")):
        if target.startswith("re:"):
            try:
                re.compile(target[3:])
            except re.error as exc:
                warnings.append(f"ignore entry {target!r} is not a valid regex ({exc})")
    if qc.get("kv_cache_scheme"):
        warnings.append("kv_cache_scheme is set: the attention's k/v scales are not converted by qconv")
    scale_dtypes = [m.details["scale_dtype"] for m in ours if m.details.get("scale_dtype") in DTYPES]
    two_level = _common(m.details["global_scale"] for m in ours if m.details.get("global_scale"))
    extra = {"global_scale": f"{two_level} (weight_global_scale, float32 per tensor)"} if two_level else {}
    return {"format": qc.get("format"), "version": qc.get("version"),
            "quantization_status": qc.get("quantization_status"), "config_groups": described,
            "ignore": _targets(qc.get("ignore")),
            "bits": _common(m.bits for m in ours),
            "group_size": _common(None if m.details.get("block_rows") == 0 else m.group_size  # per tensor: none
                                  for m in ours),
            "scales_dtype": _common(DTYPES[d][1] for d in scale_dtypes), **extra}


def lint(qc: Mapping, modules, all_modules, comp, warnings: list) -> None:
    """The config's lints (settings' warnings) for inspect."""
    settings(qc, modules, all_modules, comp, warnings)


# ---------------------------------------------------------------------------------------------
# What a writer stores

def _groups(group_size: int, inp: int) -> int:
    return 1 if group_size <= 0 else -(-inp // group_size)


def leaves(spec: "QuantSpec", shape: tuple[int, int], fmt: str = PACKED, *, scale_dtype: str | None = None,
           g_idx: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Leaf name -> (safetensors dtype, shape) of what compressed_tensors.codec.encode stores for a ``spec`` weight of
    ``shape`` [out, in] in ``fmt``, predicted before any data exists."""
    if fmt not in READABLE_FORMATS:
        raise NotStorable(f"compressed-tensors format {fmt!r} is not one qconv writes "
                         f"({', '.join(READABLE_FORMATS)})")
    if spec.scheme != "int" or not 1 <= spec.bits <= 8:
        raise NotStorable(f"compressed-tensors stores 1- to 8-bit integer codes, not {spec.name}")
    out, inp = shape
    bits = spec.bits
    g = _groups(spec.group_size, inp)
    sdt = scale_dtype or spec.scale_dtype
    if fmt == PACKED:
        res = {"weight_packed": ("I32", (out, math.ceil(inp * bits / 32))),
               "weight_scale": (sdt, (out, g)),
               "weight_shape": ("I64", (2,))}
        if not spec.symmetric:
            res["weight_zero_point"] = ("I32", (math.ceil(out * bits / 32), g))
    else:
        res = {"weight": ("I8", (out, inp)), "weight_scale": (sdt, (out, g))}
        if not spec.symmetric:
            res["weight_zero_point"] = ("I8", (out, g))
    if g_idx:
        res["weight_g_idx"] = ("I32", (inp,))
    return res


# ---------------------------------------------------------------------------------------------
# The quantization_config a writer emits

def _args(spec: "QuantSpec") -> dict:
    channel = spec.group_size <= 0
    return {"actorder": None, "block_structure": None, "dynamic": False,
            "group_size": None if channel else int(spec.group_size), "num_bits": int(spec.bits),
            "observer": None, "observer_kwargs": {}, "scale_dtype": None,
            "strategy": "channel" if channel else "group", "symmetric": bool(spec.symmetric),
            "type": "int", "zp_dtype": None if spec.symmetric else "torch.int8"}


# W8A8's activations: 8-bit int, symmetric, per token, computed at run time (nothing stored).
INPUT_ACTIVATIONS_INT8_TOKEN = {"actorder": None, "block_structure": None, "dynamic": True,
                                "group_size": None, "num_bits": 8, "observer": None,
                                "observer_kwargs": {}, "scale_dtype": None, "strategy": "token",
                                "symmetric": True, "type": "int", "zp_dtype": None}


def config_for(specs_by_module: Mapping[str, "QuantSpec"], ignore: Iterable[str] = ("lm_head",),
               fmt: str = PACKED, *, class_targets: bool = False, version: str = LAYOUT_VERSION) -> dict:
    """The ``quantization_config`` for a compressed-tensors checkpoint holding ``specs_by_module``
    (module name -> QuantSpec), with llm-compressor's field set (update_config / QuantizationArgs).

    One config group per distinct (bits, group size, symmetric), named group_0, group_1, ... in the
    modules' natural order; targets are the exact module names, or ``["Linear"]`` with
    ``class_targets=True`` when there is one group and every other Linear is in ``ignore``.
    ``fmt`` "int-quantized" adds W8A8's dynamic per-token int8 ``input_activations``. ``version`` is
    the compressed-tensors release whose layout compressed_tensors.codec.encode writes (dense sub-byte packing).
    """
    if fmt not in READABLE_FORMATS:
        raise NotStorable(f"compressed-tensors format {fmt!r} is not one qconv writes "
                         f"({', '.join(READABLE_FORMATS)})")
    by_key: dict[tuple, list[str]] = {}
    for name in sorted(specs_by_module, key=natural_key):
        spec = specs_by_module[name]
        if spec.scheme != "int" or not 1 <= spec.bits <= 8:
            raise NotStorable(f"{name}: compressed-tensors stores 1- to 8-bit integer codes, not {spec.name}")
        if spec.scale_divisor != 1:
            raise NotStorable(f"{name}: compressed-tensors scales are plain multipliers (scale_divisor 1)")
        key = (int(spec.bits), int(spec.group_size) if spec.group_size > 0 else -1, bool(spec.symmetric))
        by_key.setdefault(key, []).append(name)
    if class_targets and len(by_key) > 1:
        raise NotStorable("a 'Linear' class target needs one config group; these modules need "
                         f"{len(by_key)}")
    groups = {}
    for i, names in enumerate(by_key.values()):
        group = {"format": fmt,
                 "input_activations": dict(INPUT_ACTIVATIONS_INT8_TOKEN) if fmt == INT else None,
                 "output_activations": None,
                 "targets": ["Linear"] if class_targets else list(names),
                 "weights": _args(specs_by_module[names[0]])}
        groups[f"group_{i}"] = group
    return {"config_groups": groups, "format": fmt, "global_compression_ratio": None,
            "ignore": list(ignore), "kv_cache_scheme": None, "quant_method": QUANT_METHOD,
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": version}


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks (targets compressed-tensors and compressed-tensors-w8a8)

def writer_leaves(fmt: str):
    def target_leaves(spec, shape, g_idx: bool):
        return leaves(spec, shape, fmt, g_idx=g_idx)
    return target_leaves


def _ignorable(name: str) -> bool:
    """An unquantized 2-D weight that is an nn.Linear in transformers' models (embeddings are not)."""
    return "embed" not in name.rsplit(".", 1)[-1]


def writer_config(fmt: str):
    """llm-compressor's config: one group targeting the class "Linear" with every unquantized Linear
    in ``ignore`` (by exact name), or, for several (bits, group, sym), one group per spec targeting
    exact names."""
    def config(ctx) -> dict:
        ignore = sorted((n for n in ctx.unquantized if _ignorable(n)), key=natural_key)
        distinct = {(s.bits, s.group_size if s.group_size > 0 else -1, s.symmetric) for s in ctx.specs.values()}
        return config_for(ctx.specs, ignore=ignore, fmt=fmt, class_targets=len(distinct) == 1)
    return config


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks of target compressed-tensors-fp8: llm-compressor's float-quantized FP8
# (codec.fit_fp8 / plan_fp8 / requantize_fp8 / retarget_fp8 decide and compute the data)

FP8_TARGET = "compressed-tensors-fp8"


def float_leaves(spec: "QuantSpec", shape: tuple[int, int], g_idx: bool = False, *,
                 scale_dtype: str | None = None, input_scale: float | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode_fp8 stores for an e4m3 module (stdlib, predicted before any data): the e4m3
    ``weight`` [out, in] and ``weight_scale`` in ``scale_dtype`` (the plan's: the model dtype, as
    llm-compressor stores it, or float32 where kept scales would round): strategy "tensor" [1]
    (block_rows 0), "channel" [out, 1] (block_rows 1, one group per row), "block" [ceil(out/B0),
    ceil(in/B1)] (block_rows B0, group B1; last blocks partial); with a static activation scale (the
    plan's ``input_scale``, a multiplier) ``input_scale`` [1], in the scale dtype where it holds the
    value exactly, else float32 (input_scale_dtype)."""
    out, inp = shape
    sdt = scale_dtype or spec.scale_dtype
    if spec.scheme != "e4m3" or spec.block_rows < 0 or (spec.group_size <= 0 and spec.block_rows > 1) \
            or (spec.group_size > 0 and spec.block_rows < 1):
        raise NotStorable(f"compressed-tensors float-quantized stores e4m3 codes per tensor, per channel or in 2-D "
                         f"blocks, not {spec.name} in blocks of {spec.block_rows} x {spec.group_size}")
    if g_idx:
        raise NotStorable("compressed-tensors float-quantized stores no g_idx")
    if sdt not in _SCALE_DTYPES:
        raise NotStorable(f"scale dtype {sdt!r}: compressed-tensors scales are {', '.join(_SCALE_DTYPES)}")
    scales = ((1,) if spec.block_rows == 0 else (out, 1) if spec.group_size <= 0
              else (-(-out // spec.block_rows), -(-inp // spec.group_size)))
    leaves = {"weight": ("F8_E4M3", (out, inp)), "weight_scale": (sdt, scales)}
    if input_scale is not None:
        leaves["input_scale"] = (input_scale_dtype(input_scale, sdt), (1,))
    return leaves


def input_scale_dtype(value: float, scale_dtype: str) -> str:
    """A static activation scale's dtype: the weight scales' (llm-compressor stores both in the model
    dtype) where that holds the value exactly, else float32 (compressed-tensors and vLLM read either)."""
    f32 = struct.unpack("<f", struct.pack("<f", value))[0]
    if scale_dtype == "F16":
        try:
            exact = struct.unpack("<e", struct.pack("<e", f32))[0] == f32
        except OverflowError:
            exact = False
    elif scale_dtype == "BF16":                       # the float32's low 16 bits are zero
        exact = struct.unpack("<I", struct.pack("<f", f32))[0] & 0xFFFF == 0
    else:
        return "F32"
    return scale_dtype if exact else "F32"


def _float_weights(spec: "QuantSpec") -> dict:
    """The ``weights`` QuantizationArgs of llm-compressor's FP8_DYNAMIC (channel) / FP8_BLOCK presets.
    ``observer`` is null, as qconv's integer writers write it: nothing reads it from a compressed
    checkpoint, and kept codes were not made by llm-compressor's observer."""
    block = spec.group_size > 0
    return {"actorder": None, "block_structure": [int(spec.block_rows), int(spec.group_size)] if block else None,
            "dynamic": False, "group_size": None, "num_bits": 8, "observer": None, "observer_kwargs": {},
            "scale_dtype": None, "strategy": "block" if block else "tensor" if spec.block_rows == 0 else "channel",
            "symmetric": True,
            "type": "float", "zp_dtype": None}


def _float_activations(spec: "QuantSpec", static: bool = False) -> dict:
    """The presets' input activations: quantized to e4m3 at run time (nothing stored), FP8_DYNAMIC per
    token, FP8_BLOCK per group of 128 inputs (here the weights' column block, 128 in the preset); or
    ``static``, the FP8 preset's: one calibrated scale per tensor (the module's ``input_scale``)."""
    block = spec.group_size > 0
    return {"actorder": None, "block_structure": None, "dynamic": not static,
            "group_size": int(spec.group_size) if block and not static else None, "num_bits": 8, "observer": None,
            "observer_kwargs": {}, "scale_dtype": None,
            "strategy": "tensor" if static else "group" if block else "token",
            "symmetric": True, "type": "float", "zp_dtype": None}


def float_config(ctx) -> dict:
    """The quantization_config llm-compressor writes for FP8_DYNAMIC / FP8_BLOCK: one float-quantized
    group targeting the class "Linear" (one group per structure, targeting exact names, where modules
    differ), ``ignore`` the Linears left in float by exact name, in the order transformers lists modules
    (the decoder's first, top-level heads such as lm_head last)."""
    by_structure: dict[tuple, list[str]] = {}
    for name in sorted(ctx.specs, key=natural_key):
        spec = ctx.specs[name]
        if spec.scheme != "e4m3":
            raise NotStorable(f"{name}: compressed-tensors-fp8 stores e4m3 codes, not {spec.name}")
        static = ctx.settings.get(name, {}).get("input_scale") is not None
        key = (int(spec.block_rows), int(spec.group_size) if spec.group_size > 0 else -1, static)
        by_structure.setdefault(key, []).append(name)
    groups = {}
    for i, ((_, _, static), names) in enumerate(by_structure.items()):
        spec = ctx.specs[names[0]]
        groups[f"group_{i}"] = {"format": FLOAT, "input_activations": _float_activations(spec, static),
                                "output_activations": None,
                                "targets": ["Linear"] if len(by_structure) == 1 else list(names),
                                "weights": _float_weights(spec)}
    ignore = sorted((n for n in ctx.unquantized if _ignorable(n)), key=lambda n: ("." not in n, natural_key(n)))
    return {"config_groups": groups, "format": FLOAT, "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": None, "quant_method": QUANT_METHOD, "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": LAYOUT_VERSION}


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks of target compressed-tensors-nvfp4: llm-compressor's NVFP4A16
# (codec.fit_nvfp4 / plan_nvfp4 / share_nvfp4 / requantize_nvfp4 / retarget_nvfp4 compute the data)

NVFP4_TARGET = "compressed-tensors-nvfp4"
# fused_group / FUSED_LAYER_NAMES (core/layout.py): the modules sharing one NVFP4 global scale.


def nvfp4_leaves(spec: "QuantSpec", shape: tuple[int, int], g_idx: bool = False, *,
                 input_global_scale: float | None = None, **settings) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode_nvfp4 stores (stdlib, before any data): e2m1 codes two a byte
    ``weight_packed`` U8 [out, in/2], e4m3 ``weight_scale`` [out, in/16], ``weight_global_scale`` F32 [1];
    where the plan carries a static activation scale (W4A4), ``input_global_scale`` F32 [1]."""
    check_nvfp4_shape(spec, shape, g_idx, "compressed-tensors", "divisor")
    out, inp = shape
    leaves = {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("F8_E4M3", (out, inp // NVFP4_GROUP)),
              "weight_global_scale": ("F32", (1,))}
    if input_global_scale is not None:
        leaves["input_global_scale"] = ("F32", (1,))
    return leaves


def nvfp4_config(ctx) -> dict:
    """The quantization_config llm-compressor writes for NVFP4A16 (one nvfp4-pack-quantized group
    targeting the class "Linear": e2m1, tensor_group of 16, e4m3 scales, weights only), or for NVFP4
    (W4A4) where every module carries a static activation scale (input_activations e2m1 in groups of 16,
    dynamic "local": group scales at run time under the stored input_global_scale); modules that differ
    in this are two groups targeting their names. ``ignore`` the Linears left in float by exact name.
    ``observer`` is null, as qconv's other writers write it."""
    return _fp4_config(ctx, NVFP4_TARGET, NVFP4, "tensor_group", NVFP4_GROUP, "torch.float8_e4m3fn",
                       static=lambda name: ctx.settings.get(name, {}).get("input_global_scale") is not None)


def _fp4_config(ctx, target: str, fmt: str, strategy: str, group_size: int, scale_dtype: str,
                static=lambda name: False) -> dict:
    for name, spec in ctx.specs.items():
        if spec.scheme != "e2m1":
            raise NotStorable(f"{name}: {target} stores e2m1 codes, not {spec.name}")
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group_size,
               "num_bits": 4, "observer": None, "observer_kwargs": {}, "scale_dtype": scale_dtype,
               "strategy": strategy, "symmetric": True, "type": "float", "zp_dtype": None}
    w4a4 = {**weights, "dynamic": "local"}
    by_static: dict[bool, list[str]] = {}
    for name in sorted(ctx.specs, key=natural_key):
        by_static.setdefault(bool(static(name)), []).append(name)
    groups = {}
    for i, (carried, names) in enumerate(sorted(by_static.items(), key=lambda kv: not kv[0]) or [(False, [])]):
        groups[f"group_{i}"] = {"format": fmt, "input_activations": w4a4 if carried else None,
                                "output_activations": None,
                                "targets": ["Linear"] if len(by_static) <= 1 else names, "weights": weights}
    ignore = sorted((n for n in ctx.unquantized if _ignorable(n)), key=lambda n: ("." not in n, natural_key(n)))
    return {"config_groups": groups, "format": fmt, "global_compression_ratio": None,
            "ignore": ignore, "kv_cache_scheme": None, "quant_method": QUANT_METHOD,
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": LAYOUT_VERSION}


# ---------------------------------------------------------------------------------------------
# The registry's writer hooks of target compressed-tensors-mxfp4: llm-compressor's MXFP4A16
# (codec.fit_mxfp4 / requantize_mxfp4 / retarget_mxfp4 compute the data)

MXFP4_TARGET = "compressed-tensors-mxfp4"
MXFP4_GROUP = 32


def mxfp4_leaves(spec: "QuantSpec", shape: tuple[int, int], g_idx: bool = False,
                 **settings) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What codec.encode_mxfp4 stores (stdlib, before any data): e2m1 codes two a byte ``weight_packed``
    U8 [out, in/2] (the even element in the low nibble) and e8m0 exponents ``weight_scale`` U8 [out, in/32]."""
    out, inp = shape
    if spec.scheme != "e2m1" or spec.group_size != MXFP4_GROUP or g_idx:
        raise NotStorable(f"compressed-tensors MXFP4 stores e2m1 codes in groups of {MXFP4_GROUP}, not {spec.name}")
    if inp % MXFP4_GROUP:
        raise NotStorable(f"{inp} input features are not whole groups of {MXFP4_GROUP}")
    return {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("U8", (out, inp // MXFP4_GROUP))}


def mxfp4_config(ctx) -> dict:
    """The quantization_config llm-compressor writes for MXFP4A16: one mxfp4-pack-quantized group
    targeting "Linear" (e2m1, groups of 32, uint8 e8m0 scales), ``ignore`` the Linears left in float."""
    return _fp4_config(ctx, MXFP4_TARGET, MXFP4, "group", MXFP4_GROUP, "torch.uint8")
