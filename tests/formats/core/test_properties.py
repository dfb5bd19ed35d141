"""Property tests: bit packing (formats/core/packing.py) round trips on random widths and shapes, and
bitsandbytes' SCB given back exactly from GPTQ's float32 scales. The readers' properties against
bitsandbytes' own functions and GPTQ's write / read round trips: tests/formats/bnb/test_bnb.py and
tests/formats/gptq/test_gptq.py."""

import numpy as np
import torch
from hypothesis import given, strategies as st

from qconv.formats.core.packing import pack_int32, unpack_int32, unpack_int32_transposed

from conftest import PROPS, random_weights as _weights


@PROPS
@given(bits=st.sampled_from([2, 3, 4, 5, 6, 7, 8]), runs=st.integers(1, 5), cols=st.integers(1, 7),
       seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(bits, runs, cols, seed):
    n = 32 * runs
    codes = np.random.default_rng(seed).integers(0, 1 << bits, size=(n, cols), dtype=np.uint8)
    words = pack_int32(codes, bits, axis=0)
    assert words.dtype == np.int32 and words.shape == (n * bits // 32, cols)
    assert np.array_equal(unpack_int32(words, bits, axis=0), codes)
    transposed = unpack_int32_transposed(words, bits)       # how GPTQ's reader gets [out, in] codes
    assert transposed.flags.c_contiguous and np.array_equal(transposed, codes.T)
    assert np.array_equal(unpack_int32(pack_int32(codes.T, bits, axis=1), bits, axis=1), codes.T)


@PROPS
@given(seed=st.integers(0, 2**16))
def test_scb_survives_float32_gptq_scales(seed):
    """bitsandbytes' SCB is the row absmax of the float16-cast weight (a float16 value); GPTQ stores
    s = float32(SCB / 127); qconv's inverse gives back every such SCB exactly."""
    import bitsandbytes.functional as F
    from qconv.formats.bnb.codec import scb_from_scales as _scb_from_scales

    w = _weights(257, 64, "float16", seed) * float(np.random.default_rng(seed).choice([1e-3, 1, 300]))
    _, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
    s = (scb / 127).numpy().astype(np.float32)
    assert np.array_equal(_scb_from_scales(s), scb.numpy())
