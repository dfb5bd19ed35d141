"""Writing bfloat16 (tensor_io.f32_to_bf16, every float32 -> BF16 store: dequantize's output, scales) is
numpy's, not torch's, so dequantize never imports torch; its bits must be torch's .to(torch.bfloat16) for
every finite and infinite float32 (round to nearest even, overflow to infinity), here checked against
torch itself on random bit patterns and the edges of the rounding, and subnormals against float64."""

import numpy as np
import torch

from qconv.formats.storage.tensor_io import convert_float, f32_to_bf16


def _torch_bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_bfloat16_bits_are_torchs_for_every_non_nan_float32():
    rng = np.random.default_rng(0)
    edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                      0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x00000001, 0x807FFFFF],
                     np.uint32)
    bits = np.concatenate([edges, rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32)])
    x = bits.view(np.float32)
    # normal numbers, zeros and infinities against torch (every CPU path of torch's agrees on them; a
    # vectorized bfloat16 instruction may treat subnormal inputs as zero, so those are checked below)
    keep = ~np.isnan(x) & ((bits & 0x7F800000) != 0) | ((bits & 0x7FFFFFFF) == 0)
    ours, theirs = f32_to_bf16(x[keep]), _torch_bf16(x[keep])
    assert ours.dtype == np.uint16 and np.array_equal(ours, theirs)
    # subnormals: rounded to bfloat16's step there (2^-133), ties to even, computed in float64
    sub = x[((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFFFF) != 0)]
    assert sub.size > 1000
    step = 2.0 ** -133
    expected = (np.round(sub.astype(np.float64) / step) * step).astype(np.float32).view(np.uint32) >> 16
    assert np.array_equal(f32_to_bf16(sub), expected.astype(np.uint16))
    # overflow rounds to infinity, the largest bfloat16 stays
    assert f32_to_bf16(np.array([3.4e38, -3.4e38, 3.3895313e38], np.float32)).tolist() == [0x7F80, 0xFF80, 0x7F7F]


def test_nan_is_a_nan_and_shapes_are_kept():
    x = np.array([[np.nan, -np.nan], [1.0, 2.0]], np.float32)
    out = convert_float(x, "F32", "BF16")
    assert out.shape == (2, 2) and out.dtype == np.uint16
    back = (out.astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(back[0]).all() and back[1].tolist() == [1.0, 2.0]
