"""What validate and convert's reports run layers on: the seeded outlier-shaped activations, and the
producers' libraries, imported quietly and only when a layer needs them."""

from __future__ import annotations

import numpy as np


def outlier_activations(n: int, inp: int, seed: int) -> np.ndarray:
    """n activation rows of width inp: unit-scale normal, with inp/128 outlier columns scaled 8-20x
    (above LLM.int8's 6.0 threshold, as real LLM activations have)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, inp)).astype(np.float32)
    outliers = rng.choice(inp, size=max(1, inp // 128), replace=False)
    x[:, outliers] *= np.float32(rng.uniform(8, 20))
    return x


def import_bitsandbytes() -> bool:
    """Import bitsandbytes without its import-time log lines (on CPUs with AVX512-BF16 it warns that an
    optional kernel package is missing, which concerns neither qconv nor its user)."""
    import logging

    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    finally:
        log.setLevel(level)
    return True
