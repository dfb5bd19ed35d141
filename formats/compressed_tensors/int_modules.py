"""compressed-tensors' integer formats described from tensor headers (stdlib): one module of
pack-quantized, int-quantized or naive-quantized codes (int_module, which header.find_modules calls), with
every way its headers and its config group disagree as a problem; decoding the data is decode.py.

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

"""

from __future__ import annotations

import math
from typing import Mapping

from ..core.layout import QuantModule, int_scheme
from ..storage.safetensors_header import TensorInfo
from .config import (EXTRA_STATE_LEAVES, FLOAT_FORMATS, INT, NAIVE, PACKED, _INT_DTYPES, _SCALE_DTYPES,
                     parse_version)

DENSE_SINCE = (0, 18)
WEIGHT_LEAVES = ("weight_packed", "weight")
STATE_LEAVES = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
_PADDED_BITS = (3, 5, 6, 7)              # the widths whose layout changed in 0.18


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


def int_module(prefix: str, tensors: Mapping[str, TensorInfo], p, group_name, args: Mapping, fmt: str, version,
               shapes: Mapping[str, tuple[int, int]]) -> QuantModule:
    """One module of an integer format (or of none qconv reads), from headers and its config group:
    bits, group size and symmetry from the group's weight arguments, ``details`` as decode.read needs
    them (the layout, "pack" or "int", and ``in_range``), and every way the config, the headers and the
    format disagree as a problem (``p``, header._Problems, holds those the config alone raised).
    ``shapes``: the values of the checkpoint's ``weight_shape`` tensors (header._weight_shapes)."""
    m = _IntModule(prefix, tensors, p, group_name, args, fmt)
    m.scheme()
    m.layout()
    m.scales()
    if m.kind == "int" and m.code_t is not None:
        m.int_in_features()
    elif m.kind == "pack" and m.code_t is not None and m.bits:
        m.packed_in_features(version, shapes)
    m.zero_points()
    m.g_idx()
    return m.module(version)


class _IntModule:
    """The integer module at ``prefix`` as int_module describes it, one step a method, each adding what
    it finds wrong to ``p`` and what it learns to the object (bits, strategy, kind: "pack" / "int", out,
    groups, in_features and its range), in the order the headers are checked."""

    def __init__(self, prefix: str, tensors: Mapping[str, TensorInfo], p, group_name, args: Mapping, fmt: str):
        self.prefix, self.tensors, self.p = prefix, tensors, p
        self.group_name, self.args, self.fmt = group_name, args, fmt
        self.t = {leaf: tensors.get(f"{prefix}.{leaf}") for leaf in WEIGHT_LEAVES + STATE_LEAVES}
        self.tname = {leaf: f"{prefix}.{leaf}" for leaf in WEIGHT_LEAVES + STATE_LEAVES}
        self.kind = self.code_t = self.out = self.groups = self.in_range = None
        self.code_name, self.inp = "", 0

    def scheme(self) -> None:
        """bits, strategy, group size, symmetry and actorder from the config group's weight arguments."""
        p, args, group_name, fmt = self.p, self.args, self.group_name, self.fmt
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
        self.bits, self.strategy, self.gs = bits, strategy, gs
        self.symmetric = bool(args.get("symmetric", True)) if args else True
        self.actorder = args.get("actorder") if args else None

    def layout(self) -> None:
        """Which tensors hold the codes: weight_packed ("pack") or an integer weight ("int")."""
        p, t, tname, fmt = self.p, self.t, self.tname, self.fmt
        packed, weight, scale = t["weight_packed"], t["weight"], t["weight_scale"]
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
        self.kind = layout

    def scales(self) -> None:
        """out and the number of groups, from weight_scale (else from the codes), checked against the codes."""
        p, t, tname, layout = self.p, self.t, self.tname, self.kind
        scale = t["weight_scale"]
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
            if self.strategy == "channel" and groups != 1:
                p.corrupt(tname["weight_scale"], f"weight_scale has {groups} columns but strategy "
                                                 f"'channel' has one scale per output row")
        code_t = t["weight_packed"] if layout == "pack" else t["weight"] if layout == "int" else None
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
        self.out, self.groups, self.code_t, self.code_name = out, groups, code_t, code_name

    def _group_range(self) -> tuple[int, int] | None:
        """compressed-tensors refuses a row wider than one group that is not whole groups
        (forward_helpers._process_group): G > 1 groups pin in to G * group_size."""
        gs, groups = self.gs, self.groups
        if self.strategy == "group" and gs and groups:
            return (groups * gs, groups * gs) if groups > 1 else (1, gs)
        return None

    def int_in_features(self) -> None:
        """in_features of an unpacked integer weight: its width, which the groups must divide."""
        inp = self.code_t.shape[1]
        self.inp, self.in_range = inp, (inp, inp)
        weight = self.t["weight"]
        if weight.dtype != "I8":
            self.p.unsupported(self.code_name, f"weight is {weight.dtype}; compressed-tensors stores integer "
                                               f"codes of up to 8 bits as I8")
        group_range = self._group_range()
        if group_range and _meet((inp, inp), group_range) is None:
            self.p.corrupt(self.tname["weight_scale"], f"weight_scale has {self.groups} groups of {self.gs}, which "
                                                       f"do not divide {inp} input channels")

    def packed_in_features(self, version, shapes: Mapping[str, tuple[int, int]]) -> None:
        """in_features of packed words: the range the words a row (and the groups) allow, the value
        weight_shape holds where it agrees with them, else the widest; the padded layout refused."""
        p, tname, bits, groups, gs, code_name = self.p, self.tname, self.bits, self.groups, self.gs, self.code_name
        packed, shape_t = self.t["weight_packed"], self.t["weight_shape"]
        cols = self.code_t.shape[1]
        group_range = self._group_range()
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
            self.inp = in_range[1]
            told = shapes.get(tname["weight_shape"])
            if told is not None and told[0] == self.out and in_range[0] <= told[1] <= in_range[1]:
                self.inp = told[1]                    # weight_shape, where it agrees with the headers
        self.in_range = in_range
        if shape_t is None:
            p.corrupt(tname["weight_shape"], "pack-quantized module has no weight_shape tensor")
        elif shape_t.dtype not in _INT_DTYPES or shape_t.shape != (2,):
            p.corrupt(tname["weight_shape"], f"weight_shape is {shape_t.dtype} "
                                             f"{list(shape_t.shape)}, expected I64 [2]")

    def zero_points(self) -> None:
        """weight_zero_point: stored exactly where the group is asymmetric, in the layout's shape."""
        p, tname, zp = self.p, self.tname, self.t["weight_zero_point"]
        out, groups, bits = self.out, self.groups, self.bits
        if zp is not None and self.symmetric:
            p.corrupt(tname["weight_zero_point"], "weight_zero_point is stored but the config says "
                                                  "symmetric")
        if not self.symmetric and self.args:
            if zp is None:
                p.corrupt(tname["weight_zero_point"], "asymmetric module has no weight_zero_point "
                                                      "tensor")
            elif self.kind == "pack" and out and groups and bits:
                want = (math.ceil(out * bits / 32), groups)
                if zp.dtype != "I32" or zp.shape != want:
                    p.corrupt(tname["weight_zero_point"], f"weight_zero_point is {zp.dtype} "
                                                          f"{list(zp.shape)}, expected I32 {list(want)} "
                                                          f"(packed along out)")
            elif self.kind == "int" and out and groups:
                if zp.dtype not in _INT_DTYPES or zp.shape != (out, groups):
                    p.corrupt(tname["weight_zero_point"], f"weight_zero_point is {zp.dtype} "
                                                          f"{list(zp.shape)}, expected an integer "
                                                          f"[{out}, {groups}]")

    def g_idx(self) -> None:
        """weight_g_idx: group strategy only, one integer entry per input channel (which pins in_features)."""
        p, tname, g_idx, in_range = self.p, self.tname, self.t["weight_g_idx"], self.in_range
        if g_idx is None:
            return
        if self.strategy != "group":
            p.corrupt(tname["weight_g_idx"], f"weight_g_idx is stored but the weight strategy is "
                                             f"{self.strategy!r}, not 'group'")
        fits = in_range is None or (len(g_idx.shape) == 1
                                    and in_range[0] <= g_idx.shape[0] <= in_range[1])
        if g_idx.dtype not in _INT_DTYPES or len(g_idx.shape) != 1 or not fits:
            p.corrupt(tname["weight_g_idx"], f"weight_g_idx is {g_idx.dtype} {list(g_idx.shape)}, "
                                             f"expected an integer [{self.inp}]")
        elif in_range is not None:               # one entry per input channel: in, exactly
            self.inp = g_idx.shape[0]
            self.in_range = (self.inp, self.inp)

    def module(self, version) -> QuantModule:
        t, tname, scale, bits = self.t, self.tname, self.t["weight_scale"], self.bits
        weight_tensors = tuple(tname[leaf] for leaf in WEIGHT_LEAVES if t[leaf] is not None)
        state = tuple(tname[leaf] for leaf in STATE_LEAVES if t[leaf] is not None)
        state += tuple(f"{self.prefix}.{leaf}" for leaf in EXTRA_STATE_LEAVES
                       if f"{self.prefix}.{leaf}" in self.tensors)
        details = {"format": self.fmt, "strategy": self.strategy, "symmetric": self.symmetric,
                   "group": self.group_name,
                   "scale_dtype": scale.dtype if scale is not None else None,
                   "scales_dtype": scale.dtype if scale is not None else None,      # registry's key
                   "actorder": self.actorder,
                   "layout": self.kind, "in_range": self.in_range, "version": version,
                   "has_g_idx": t["weight_g_idx"] is not None,
                   "act_order": t["weight_g_idx"] is not None,      # weight_g_idx is stored for act-order only
                   **self.p.details()}
        return QuantModule(self.prefix, "ct", int_scheme(bits or 0), bits or 0, self.out or 0, self.inp,
                           weight_tensors, state, group_size=self.gs, details=details, problems=self.p.messages())
