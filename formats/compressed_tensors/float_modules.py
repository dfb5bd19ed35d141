"""compressed-tensors' floating-point formats described from tensor headers (stdlib): one module of
float-quantized FP8 or nvfp4- / mxfp4-pack-quantized FP4 (float_module, which header.find_modules calls),
symmetric only, with every way its headers and its config group disagree as a problem; decoding the data
is decode.py (docs/formats.md, compressed-tensors FP8 to MXFP4). float-quantized FP8 per tensor, per
channel and in blocks, NVFP4 and MXFP4 are also written (float_writer.py, codec.py)::

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
"""

from __future__ import annotations

import math
from typing import Mapping

from ..core.layout import QuantModule
from ..storage.safetensors_header import TensorInfo
from .config import EXTRA_STATE_LEAVES, MXFP4, NVFP4, _SCALE_DTYPES

_FP8_STRATEGIES = ("tensor", "channel", "block")
# format -> (scheme, bits, strategy, group size, scale dtype) of the FP4 formats (compressors/nvfp4,
# compressors/mxfp4: each compressor takes exactly this scheme, can_compress).
_FP4 = {NVFP4: ("e2m1", 4, "tensor_group", 16, "F8_E4M3"), MXFP4: ("e2m1", 4, "group", 32, "U8")}


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


def float_module(prefix: str, tensors: Mapping[str, TensorInfo], p, group_name, args: Mapping, fmt: str,
                 version) -> QuantModule:
    """One module of a floating-point format (float-quantized FP8, nvfp4- / mxfp4-pack-quantized FP4; the
    module docstring), from headers and its config group: scheme e4m3 or e2m1, what decode.read needs in
    ``details`` (layout.QuantModule's e4m3 / e2m1 conventions: "scales_dtype", "block_rows", and
    "global_scale" for NVFP4), and every way the config, the headers and the format disagree as a
    problem (``p``, header._Problems, holds those the config alone raised)."""
    m = _FloatModule(prefix, tensors, p, group_name, args, fmt)
    if args:
        m.group()
    m.codes()
    m.scales()
    return m.module(version, m.stray())


class _FloatModule:
    """The floating-point module at ``prefix`` as float_module describes it, one step a method, each adding
    what it finds wrong to ``p`` and what it learns to the object, in the order the headers are checked."""

    def __init__(self, prefix: str, tensors: Mapping[str, TensorInfo], p, group_name, args: Mapping, fmt: str):
        self.prefix, self.tensors, self.p = prefix, tensors, p
        self.group_name, self.args, self.fmt = group_name, args, fmt
        self.fp4 = fmt in _FP4
        self.scheme, self.bits, self.fp4_strategy, self.fp4_group, self.fp4_scale = (
            _FP4[fmt] if self.fp4 else ("e4m3", 8, None, None, None))
        self.code_leaf = "weight_packed" if self.fp4 else "weight"
        self.code_name = self.leaf(self.code_leaf)
        self.code = tensors.get(self.code_name)
        self.strategy = args.get("strategy") if args else None
        self.block = None
        self.out = self.inp = 0

    def leaf(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def group(self) -> None:
        """The config group against the format: type, bits, symmetry, strategy and its block structure."""
        p, args, fmt, bits, strategy = self.p, self.args, self.fmt, self.bits, self.strategy
        fp4_strategy, fp4_group = self.fp4_strategy, self.fp4_group
        label = f"config group {self.group_name!r}"
        if args["type"] != "float" or args["num_bits"] != bits:
            p.corrupt(None, f"{label} is stored as {fmt!r} but quantizes weights to {args['type']} "
                            f"{args['num_bits']!r}-bit; {fmt} holds {bits}-bit float weights")
        if not args["symmetric"]:
            p.unsupported(None, f"{label} quantizes {fmt} weights asymmetrically; qconv reads symmetric "
                                f"float weights only")
        if self.fp4 and (strategy != fp4_strategy or args["group_size"] != fp4_group):
            p.unsupported(None, f"{label} has weight strategy {strategy!r} with group_size "
                                f"{args['group_size']!r}; {fmt} is strategy {fp4_strategy!r} in groups of "
                                f"{fp4_group}, the only layout qconv reads")
        elif not self.fp4 and strategy not in _FP8_STRATEGIES:
            p.unsupported(None, f"{label} uses weight strategy {strategy!r}; qconv reads {fmt} weights "
                                f"with strategies {', '.join(map(repr, _FP8_STRATEGIES))}")
        elif strategy == "block":
            self.block = _block_structure(args.get("block_structure"))
            if self.block is None:
                p.corrupt(None, f"{label} has weight strategy 'block' but block_structure "
                                f"{args.get('block_structure')!r}, expected [rows, cols] of positive integers")

    def codes(self) -> None:
        """The codes give out and in."""
        p, code, code_name, code_leaf, fmt = self.p, self.code, self.code_name, self.code_leaf, self.fmt
        if code is None:
            p.corrupt(code_name, f"{fmt} module has no {code_leaf} tensor")
        elif len(code.shape) != 2:
            p.corrupt(code_name, f"{code_leaf} has shape {list(code.shape)}, expected a matrix")
            self.code = None
        else:
            self.out, self.inp = code.shape[0], code.shape[1] * (2 if self.fp4 else 1)
            if self.fp4 and code.dtype != "U8":
                p.corrupt(code_name, f"weight_packed is {code.dtype}, expected U8 bytes of two e2m1 codes")
            elif not self.fp4 and code.dtype != "F8_E4M3":
                p.unsupported(code_name, f"weight is {code.dtype}; {fmt} 8-bit weights are F8_E4M3 (e4m3) codes, "
                                         f"the only ones qconv reads")

    def scales(self) -> None:
        """Scales: one per block of block_rows x group_size (block_rows 0: one for the tensor), of the
        format's dtype and in the strategy's shape."""
        strategy, block = self.strategy, self.block
        self.block_rows, self.group_size = 1, -1
        if self.fp4:
            self.group_size = self.fp4_group
        elif strategy == "tensor":
            self.block_rows = 0
        elif strategy == "block" and block:
            self.block_rows, self.group_size = block
        scale_name = self.leaf("weight_scale")
        self.scale = scale = self.tensors.get(scale_name)
        if scale is None:
            self.p.corrupt(scale_name, "quantized module has no weight_scale tensor")
            return
        fmt, fp4_scale = self.fmt, self.fp4_scale
        if self.fp4 and scale.dtype != fp4_scale:
            self.p.unsupported(scale_name, f"weight_scale is {scale.dtype}; {fmt} stores {fp4_scale} scales "
                                           f"({'e4m3' if fmt == NVFP4 else 'e8m0 bytes'}), the only ones qconv "
                                           f"reads")
        elif not self.fp4 and scale.dtype not in _SCALE_DTYPES:
            self.p.unsupported(scale_name, f"weight_scale is {scale.dtype}; qconv reads "
                                           f"{', '.join(_SCALE_DTYPES)} {fmt} scales")
        if self.code is not None:
            self._scale_shape(scale_name, list(scale.shape))

    def _scale_shape(self, scale_name: str, shape: list) -> None:
        out, inp, group_size, strategy, block = self.out, self.inp, self.group_size, self.strategy, self.block
        if self.fp4:
            want = [out, -(-inp // group_size)]
            if shape != want:
                self.p.corrupt(scale_name, f"weight_scale has shape {shape}; groups of {group_size} over a "
                                           f"{out} x {inp} weight give {want}")
        elif strategy == "tensor":
            if math.prod(shape) != 1:
                self.p.corrupt(scale_name, f"weight_scale has shape {shape}; strategy 'tensor' has one scale")
        elif strategy == "channel":
            if shape != [out, 1]:
                self.p.corrupt(scale_name, f"weight_scale has shape {shape}; strategy 'channel' over a {out} x "
                                           f"{inp} weight gives [{out}, 1]")
        elif strategy == "block" and block:
            want = [-(-out // block[0]), -(-inp // block[1])]
            if shape != want:
                self.p.corrupt(scale_name, f"weight_scale has shape {shape}; block_structure {block} over a "
                                           f"{out} x {inp} weight gives {want}")

    def stray(self) -> list[str]:
        """weight_global_scale (NVFP4's, only there) and the leaves no floating-point module holds."""
        p, fmt, leaf = self.p, self.fmt, self.leaf
        global_name = leaf("weight_global_scale")
        global_t = self.tensors.get(global_name)
        if fmt == NVFP4:
            if global_t is None:
                p.corrupt(global_name, f"{fmt} module has no weight_global_scale tensor")
            elif global_t.dtype != "F32" or list(global_t.shape) != [1]:
                p.corrupt(global_name, f"weight_global_scale is {global_t.dtype} {list(global_t.shape)}, "
                                       f"expected F32 [1]")
        elif global_t is not None:
            p.corrupt(global_name, f"weight_global_scale is stored, but {fmt} has one level of scales")
        stray = [t for t in ("weight_packed" if not self.fp4 else "weight", "weight_zero_point", "weight_shape",
                             "weight_g_idx") if leaf(t) in self.tensors]
        for t in stray:
            p.corrupt(leaf(t), f"{t} is stored beside a {fmt} module, which holds none (symmetric float "
                               f"weights{', packed' if self.fp4 else ''})")
        return stray

    def module(self, version, stray: list[str]) -> QuantModule:
        leaf, scale = self.leaf, self.scale
        state = tuple(leaf(t) for t in ("weight_scale",) + EXTRA_STATE_LEAVES + tuple(stray) if leaf(t) in self.tensors)
        details = {"format": self.fmt, "strategy": self.strategy, "symmetric": True, "group": self.group_name,
                   "scale_dtype": scale.dtype if scale is not None else None,
                   "scales_dtype": scale.dtype if scale is not None else None,      # registry's key
                   "block_rows": self.block_rows, "block_structure": self.block,
                   "layout": "fp4" if self.fp4 else "fp8", "in_range": (self.inp, self.inp), "version": version,
                   "has_g_idx": False, "act_order": False, **self.p.details()}
        if self.fmt == NVFP4:
            details["global_scale"] = "divisor"
            details["product_dtype"] = "BF16"      # decoded through bfloat16 (QuantTensor.product_dtype)
        return QuantModule(self.prefix, "ct", self.scheme, self.bits, self.out, self.inp,
                           (self.code_name,) if self.code is not None else (), state,
                           group_size=self.group_size, details=details, problems=self.p.messages())
