"""qconv's canonical representation of a quantized Linear weight: every reader produces it, every
writer consumes it, and it dequantizes itself exactly as the producing library does.

Integer schemes (bitsandbytes LLM.int8, GPTQ, auto-round), in nn.Linear orientation::

    w[o, i] = ((codes[o, i] - zeros[o, g]) * scales[o, g]) * (1 / scale_divisor),   g = g_idx[i]

with unsigned codes (bnb int8 CB is stored here as CB + 128 against a zero point of 128), true zero
points (never GPTQ v1's stored z - 1), g_idx = i // group_size unless act-order says otherwise, and
group_size -1 meaning one group per output row. bitsandbytes keeps the row absmax (SCB) as its scale
with scale_divisor 127, so ``(CB * SCB) * float32(1/127)`` is reproduced in bitsandbytes' own order.

Float offsets (``spec.offset == "float"``: MLX's affine mode, GGUF's Q4_1 / Q5_1 and Q4_K / Q5_K), codes
[out, in] unsigned, no zero points::

    w[o, i] = fl(fl(codes[o, i] * scales[o, g]) + biases[o, g])

in float32, MLX's and ggml's own order (a K-quant's ``d*sc*q - dmin*m`` is this with biases = -(dmin*m):
the negation is exact). Where every bias is -s * z for an integer z and s * q is exact, the two forms are
the same numbers and readers prefer zero points (every integer target keeps those); a module is otherwise
kept in this form by the targets that store it (Caps.float_offsets) and requantized by the others.

Code-book schemes (bitsandbytes nf4 / fp4), over the row-major flattened weight::

    w.flat[j] = codebook[codes[j]] * absmax[j // blocksize]

where absmax is already decoded from double quantization (kept in ``double_quant`` too, so that a
bitsandbytes write can reproduce the stored bytes).

Floating-point code books (FP8 e4m3: 256 values, docs/formats.md, e4m3, e2m1, e8m0), grouped along each row like the
integers, codes [out, in]::

    w[o, i] = codebook[codes[o, i]] * scales[o, g],   g = i // group_size (group_size -1: one per row)

A two-dimensional block of ``block_rows`` x ``group_size`` (fine-grained FP8's 128 x 128, with a
last partial block where a dimension is not a multiple) is stored with one scale per block; here its
scale is repeated on each of its rows, and ``block_rows`` says how many rows share it (a per-tensor
scale: every row). float32(code) * float32(scale) is exact (4 significant bits times at most 24 fit
in float32), so this is transformers' float32 product and, rounded once to float16 / bfloat16,
compressed-tensors' product in the scale's dtype.

FP4 (e2m1: 16 values, NVFP4 and MXFP4), codes [out, in] unpacked to one nibble a byte, grouped along each
row (16 for NVFP4, 32 for MXFP4), ``scales`` the effective float32 scale of each group as the producer
forms it before the product: NVFP4 has two levels, a stored e4m3 scale per group (``group_scales``,
decoded to float32) and one float32 ``global_scale`` per tensor, which compressed-tensors DIVIDES by
(``spec.global_scale == "divisor"``) and ModelOpt multiplies by (``"multiplier"``); both are kept so
that a writer of either dialect can keep every code. MXFP4's e8m0 scales are powers of two (one level).

A producer may round its product through a narrower float before the model dtype: compressed-tensors
unpacks NVFP4 codes into bfloat16 and computes e2m1 * (float32(scale) / global) into bfloat16 even for a
float16 model, so its weight is fp16(bf16(product)), two roundings (docs/formats.md, NVFP4). Such a QuantTensor
says so with ``product_dtype = "bfloat16"``: ``dequantize_rows`` rounds the float32 product to bfloat16
(to nearest even, as torch casts) and returns it widened, so any later rounding to the model dtype (by
dequantize, or by a caller's cast) gives the producer's bits; validate's device decoding does the same.
None (every other format): the float32 product goes straight to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


FLAT_SCHEMES = ("nf4", "fp4")        # code books over the flattened weight (bitsandbytes' blocks)
ROW_SCHEMES = ("e4m3", "e2m1")      # code books grouped along each row, as the integers
PRODUCT_DTYPES = (None, "bfloat16")  # QuantTensor.product_dtype: a producer's intermediate rounding


def round_to_bfloat16(w: np.ndarray) -> np.ndarray:
    """float32 values rounded in place to the nearest bfloat16 (ties to even, infinity and NaN kept),
    still float32: torch's ``x.to(torch.bfloat16).float()``, bit for bit, without torch."""
    bits = w.view(np.uint32)
    nan = np.isnan(w)
    bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    bits &= np.uint32(0xFFFF0000)
    if nan.any():
        w[nan] = np.nan
    return w


@dataclass(frozen=True)
class QuantSpec:
    scheme: str                      # "int" | "nf4" | "fp4" | "e4m3" | "e2m1"
    bits: int
    group_size: int                  # int: inputs per group, -1 = per output row; nf4/fp4: blocksize
    symmetric: bool
    codebook: tuple[float, ...] | None = None
    scale_divisor: int = 1           # 127 for bitsandbytes int8 (scales hold the row absmax)
    scale_dtype: str = "F32"         # the dtype the scales were stored in (safetensors code)
    # On-disk variant of the source, made explicit; writers decide deliberately what to emit.
    zero_encoding: str | None = None     # GPTQ qzeros: "v1" (stored z-1) | "v2" (stored z)
    storage: str | None = None           # bitsandbytes 4-bit quant storage dtype code ("U8", "BF16", ...)
    block_rows: int = 1                  # rows sharing one scale (a 2-D block; 0: every row, per tensor)
    global_scale: str | None = None      # two-level scales (NVFP4): "divisor" | "multiplier" (None: one level)
    offset: str | None = None            # "float": w = s * q + b with float biases (QuantTensor.biases), no
                                         # zero points; None: integer zero points (or none)

    def __post_init__(self):
        if self.scheme not in ("int",) + FLAT_SCHEMES + ROW_SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}")
        if self.scheme != "int" and (self.codebook is None or len(self.codebook) != 1 << self.bits):
            raise ValueError(f"{self.scheme} needs a codebook of {1 << self.bits} values")
        if self.offset not in (None, "float") or (self.offset and (self.scheme != "int" or self.scale_divisor != 1)):
            raise ValueError(f"offset {self.offset!r}: float offsets are for integer codes without a divisor")

    @property
    def name(self) -> str:
        """Report name: int8, int4, nf4, fp4, e4m3, ..."""
        return f"int{self.bits}" if self.scheme == "int" else self.scheme

    @property
    def flat(self) -> bool:
        """Codes and blocks run over the flattened weight (bitsandbytes 4-bit), not along each row."""
        return self.scheme in FLAT_SCHEMES


@dataclass(frozen=True, eq=False)
class DoubleQuant:
    """bitsandbytes' second-level quantization of the 4-bit absmax (docs/formats.md, bitsandbytes 4-bit)."""

    codes: np.ndarray            # uint8 [n_blocks]
    nested_absmax: np.ndarray    # float32 [ceil(n_blocks / blocksize)]
    nested_map: np.ndarray       # float32 [256]
    offset: np.float32
    blocksize: int = 256

    def decode(self) -> np.ndarray:
        """absmax exactly as bitsandbytes rebuilds it: (map[c] * nested_absmax[i // 256]) + offset."""
        blocks = np.arange(self.codes.size) // self.blocksize
        absmax = self.nested_map[self.codes] * self.nested_absmax[blocks]
        return (absmax + np.float32(self.offset)).astype(np.float32)


@dataclass(frozen=True, eq=False)
class QuantTensor:
    spec: QuantSpec
    shape: tuple[int, int]           # logical [out, in]
    dtype: str                       # the weight's original dtype: "float16", "bfloat16", "float32"
    codes: np.ndarray                # uint8; int, e4m3: [out, in]; nf4/fp4: [out * in]
    scales: np.ndarray               # float32; int, e4m3: [out, G]; nf4/fp4: [n_blocks] (decoded absmax)
    zeros: np.ndarray | None = None  # int: [out, G] true zero points
    g_idx: np.ndarray | None = None  # int: [in], None = contiguous groups (i // group_size)
    double_quant: DoubleQuant | None = None
    group_scales: np.ndarray | None = None   # two-level scales: the stored per-group level, float32 [out, G]
    global_scale: np.float32 | None = None   # ... and the per-tensor level (spec.global_scale says how)
    product_dtype: str | None = None         # "bfloat16": the producer rounds each weight to it before the
                                             # model dtype (see above); None: no intermediate rounding
    input_scale: np.float32 | None = None    # a static per-tensor activation scale a target stores beside
                                             # the weight (ModelOpt NVFP4's input_scale, a multiplier), set by
                                             # its retarget; never read by dequantization. None: none stored
    biases: np.ndarray | None = None         # spec.offset "float": float32 [out, G], w = fl(fl(q * s) + b)

    def __post_init__(self):
        if self.product_dtype not in PRODUCT_DTYPES:
            raise ValueError(f"product_dtype {self.product_dtype!r} is not one of {PRODUCT_DTYPES}")

    @property
    def groups(self) -> np.ndarray:
        """Group of each input channel."""
        if self.g_idx is not None:
            return self.g_idx
        inp = self.shape[1]
        if self.spec.group_size <= 0:
            return np.zeros(inp, dtype=np.int64)
        return np.arange(inp) // self.spec.group_size

    def dequantize_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows r0:r1 of the float32 weight, in the producer's order of operations."""
        inp = self.shape[1]
        rows = r1 - r0
        if rows <= 0 or inp == 0:                   # a zero-size weight (its group size may be unknown)
            return np.zeros((max(rows, 0), inp), np.float32)
        if not self.spec.flat:
            if self.biases is not None:
                return self._offset_rows(r0, r1)
            if self.spec.scheme == "int":
                w = self.codes[r0:r1].astype(np.float32)        # q - z is exact in float32
                z = self.zeros[r0:r1].astype(np.float32)
            else:
                w = np.asarray(self.spec.codebook, dtype=np.float32)[self.codes[r0:r1]]
                z = None
            s = self.scales[r0:r1]
            n_groups, gs = s.shape[1], self.spec.group_size
            if n_groups == 1:
                if z is not None:
                    w -= z
                w *= s
            elif self.g_idx is None and gs > 0 and n_groups * gs == inp:
                w3 = w.reshape(rows, n_groups, gs)
                if z is not None:
                    w3 -= z[:, :, None]
                w3 *= s[:, :, None]
            else:
                g = self.groups
                if z is not None:
                    w -= z[:, g]
                w *= s[:, g]
            if self.spec.scale_divisor != 1:
                w *= np.float32(1.0 / self.spec.scale_divisor)
            return w if self.product_dtype is None else round_to_bfloat16(w)
        book = np.asarray(self.spec.codebook, dtype=np.float32)
        bs = self.spec.group_size
        j0, j1 = r0 * inp, r1 * inp
        w = book[self.codes[j0:j1]]
        if j0 % bs == 0 and (j1 - j0) % bs == 0:
            w.reshape(-1, bs).__imul__(self.scales[j0 // bs:j1 // bs, None])
        else:
            w *= self.scales[np.arange(j0, j1) // bs]
        w = w.reshape(rows, inp)
        return w if self.product_dtype is None else round_to_bfloat16(w)

    def _offset_rows(self, r0: int, r1: int) -> np.ndarray:
        """Float offsets: fl(fl(q * s) + b), in float32, group by group."""
        w = self.codes[r0:r1].astype(np.float32)
        s, b = self.scales[r0:r1], self.biases[r0:r1]
        rows, inp = w.shape
        n_groups, gs = s.shape[1], self.spec.group_size
        if n_groups == 1:
            w *= s
            w += b
        elif self.g_idx is None and gs > 0 and n_groups * gs == inp:
            w3 = w.reshape(rows, n_groups, gs)
            w3 *= s[:, :, None]
            w3 += b[:, :, None]
        else:
            g = self.groups
            w *= s[:, g]
            w += b[:, g]
        return w if self.product_dtype is None else round_to_bfloat16(w)

    def slab_rows(self, target_elements: int = 1 << 20) -> int:
        """Rows per slab near target_elements; for code books, whole blocks per slab."""
        inp = max(self.shape[1], 1)
        rows = max(1, target_elements // inp)
        if self.spec.flat:
            step = self.spec.group_size // np.gcd(inp, self.spec.group_size)
            rows = max(step, rows // step * step)
        return rows

    def dequantize(self) -> np.ndarray:
        return self.dequantize_rows(0, self.shape[0])


def stack_rows(parts: list[QuantTensor]) -> QuantTensor:
    """QuantTensors of consecutive row windows of one module (a row-separable requantizer's parts) as
    one: codes and per-row state concatenated; what every part holds alike (spec, dtype, global and
    input scales) kept, and refused where parts differ."""
    first = parts[0]
    if len(parts) == 1:
        return first
    for p in parts[1:]:
        if p.spec != first.spec or p.dtype != first.dtype or p.product_dtype != first.product_dtype \
                or p.global_scale != first.global_scale or p.input_scale != first.input_scale:
            raise AssertionError("row windows of one module quantized differently")
    if first.spec.flat or first.g_idx is not None or first.double_quant is not None:
        raise AssertionError("stack_rows: only row-wise QuantTensors")
    cat = (lambda name: None if getattr(first, name) is None
           else np.concatenate([getattr(p, name) for p in parts], axis=0))
    return replace(first, shape=(sum(p.shape[0] for p in parts), first.shape[1]), codes=cat("codes"),
                   scales=cat("scales"), zeros=cat("zeros"), group_scales=cat("group_scales"),
                   biases=cat("biases"))


@dataclass(frozen=True)
class FloatSpec:
    """What stands in for a QuantSpec where a module's codes cannot be kept because there are none to
    keep: an unquantized float weight (quantized data-free), or a stored type the canonical representation
    has no exact form for (a GGUF Q2_K / Q3_K / Q6_K or IQ block tensor: ``origin``), whose exact float
    weights are requantized. The target spec rules read only its scheme, name, bits and group size."""
    name: str                        # "float16", "bfloat16", "float32"; or the stored type ("Q4_K")
    scheme: str = "float"
    group_size: int | None = None    # a requantization's preferred group (None: the target's default)
    scale_divisor: int = 1
    bits: int = 4                    # a requantization's default bit width (--bits overrides it)
    origin: str | None = None        # None: an unquantized weight; else where its weights were decoded from
    symmetric: bool = True           # a requantization's default zero points (False: asymmetric, the grid of
                                     # the stored type: MLX's affine biases)

    def requantized(self, to: str = "") -> str:
        """Why the module is quantized, for the report (``to``: " to e4m3", ...)."""
        if self.origin is None:
            return f"{self.name} weights quantized data-free{to} (no calibration data)"
        return f"{self.origin} holds no codes qconv keeps: quantized{to} from its decoded weights"


@dataclass(frozen=True, eq=False)
class FloatWeight:
    """A Linear weight with no codes to keep (FloatSpec): its exact float32 values, which the lossy
    encoders requantize, and which dequantize and validate read as any QuantTensor's rows."""
    spec: FloatSpec
    shape: tuple[int, int]
    dtype: str                       # the model's dtype
    values: np.ndarray               # float32 [out, in], finite

    def dequantize_rows(self, r0: int, r1: int) -> np.ndarray:
        return self.values[r0:r1]

    def dequantize(self) -> np.ndarray:
        return self.values

    def slab_rows(self, target_elements: int = 1 << 20) -> int:
        return max(1, target_elements // max(self.shape[1], 1))


# The largest finite value of each float a weight is decoded into (a product in bfloat16, a model dtype).
FLOAT_MAX = {"float32": float(np.finfo(np.float32).max), "bfloat16": 3.3895313892515355e38, "float16": 65504.0}


def _rounded(w: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return w.astype(np.float16)
    return round_to_bfloat16(w.copy()) if dtype == "bfloat16" else w


def nonfinite_weight(t, dtype: str = "float32") -> tuple[int, int, float] | None:
    """The first weight of ``t`` (a QuantTensor or FloatWeight) that is not finite as the producer
    decodes it (float32, through its product dtype) and then rounded to ``dtype``: (row, column, its
    float32 value, NaN or +-inf when the product itself is not finite); None where every weight is finite.

    Certain from the scales alone wherever the largest code magnitude a group can hold (|code - zero|
    for integers, the code book's largest magnitude) times its scale stays within the narrowest float on
    the way, so a sane module costs one pass over its scales; only the rows whose groups could overflow
    (or whose scales are not finite) are decoded, under numpy's error state (no RuntimeWarning)."""
    narrow = [d for d in ("float32", getattr(t, "product_dtype", None), dtype) if d]
    limit = min(FLOAT_MAX[d] for d in narrow)
    rows = t.shape[0]
    if isinstance(t, FloatWeight):
        suspect = np.arange(rows)
    elif t.spec.flat:
        book = float(np.nanmax(np.abs(np.asarray(t.spec.codebook, np.float64))))
        with np.errstate(over="ignore", invalid="ignore"):
            bound = book * np.abs(np.asarray(t.scales, np.float64))
        bad = np.nonzero(~(bound <= limit))[0]
        inp = max(t.shape[1], 1)
        suspect = np.unique(np.concatenate([bad * t.spec.group_size // inp,
                                            np.minimum(((bad + 1) * t.spec.group_size - 1) // inp, rows - 1)]))
    else:
        s = np.abs(np.asarray(t.scales, np.float64))
        offset = 0.0
        if t.spec.scheme == "int" and t.biases is not None:     # |q s + b| <= qmax |s| + |b|
            magnitude = float((1 << t.spec.bits) - 1)
            offset = np.abs(np.asarray(t.biases, np.float64))
        elif t.spec.scheme == "int":
            qmax = (1 << t.spec.bits) - 1
            z = np.asarray(t.zeros, np.float64) if t.zeros is not None else np.zeros_like(s)
            magnitude = np.maximum(z, qmax - z)
        else:
            magnitude = float(np.nanmax(np.abs(np.asarray(t.spec.codebook, np.float64))))
        with np.errstate(over="ignore", invalid="ignore"):
            bound = magnitude * s / t.spec.scale_divisor + offset
        suspect = np.nonzero(~(bound <= limit).all(axis=1))[0] if bound.size else np.zeros(0, np.int64)
    if suspect.size == 0:
        return None
    step = max(1, t.slab_rows())
    r0 = int(suspect[0])
    last = int(suspect[-1]) + 1
    while r0 < last:
        r1 = min(last, r0 + step)
        with np.errstate(over="ignore", invalid="ignore"):
            w = np.asarray(t.dequantize_rows(r0, r1), np.float32)
            bad = ~np.isfinite(_rounded(w, dtype))
        if bad.any():
            r, c = (int(v[0]) for v in np.nonzero(bad))
            return r0 + r, c, float(w[r, c])
        r0 = r1
    return None
