"""What validate and convert's reports run layers on: the seeded outlier-shaped activations, and the
producers' libraries, imported quietly and only when a layer needs them."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np


def outlier_activations(n: int, inp: int, seed: int) -> np.ndarray:
    """n activation rows of width inp: unit-scale normal, with inp/128 outlier columns scaled 8-20x
    (above LLM.int8's 6.0 threshold, as real LLM activations have)."""
    if inp == 0:                             # a zero-size layer: rows of nothing
        return np.zeros((n, 0), np.float32)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, inp)).astype(np.float32)
    outliers = rng.choice(inp, size=max(1, inp // 128), replace=False)
    x[:, outliers] *= np.float32(rng.uniform(8, 20))
    return x


@contextmanager
def producer_imports():
    """Import producers' libraries (bitsandbytes, auto-round) inside this block. They import torch._dynamo,
    whose import makes torch's compile cache folder (``$TMPDIR/torchinductor_<user>``, by
    ``os.makedirs(cache_dir(), exist_ok=True)``): a write outside SRC and DST that qconv, which never
    compiles, does not need. While the block runs, TORCHINDUCTOR_CACHE_DIR names the temporary folder
    itself, which exists, so nothing is made; afterwards the variable is as it was, so a program that
    imports qconv and compiles later gets torch's cache where torch puts it. (The one path torch keeps from
    the import, its opt-in precompile cache, TORCH_CACHING_PRECOMPILE=1, is left to torch: then nothing
    is changed.) A TORCHINDUCTOR_CACHE_DIR the caller set is theirs and left alone."""
    import sys
    import tempfile

    if "torch._dynamo" in sys.modules or "TORCHINDUCTOR_CACHE_DIR" in os.environ \
            or os.environ.get("TORCH_CACHING_PRECOMPILE") == "1":
        yield
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.gettempdir()
    try:
        yield
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def import_bitsandbytes() -> bool:
    """Import bitsandbytes without its import-time log lines (on CPUs with AVX512-BF16 it warns that an
    optional kernel package is missing, which concerns neither qconv nor its user) and without torch's
    compile cache folder (producer_imports)."""
    import logging

    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with producer_imports():
            import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    finally:
        log.setLevel(level)
    return True
