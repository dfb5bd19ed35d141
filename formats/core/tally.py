"""What writing changed, for the report: per module (Stats: scales rounded, requantized layers and
their error) and per component (Tally, which merges the workers' of --jobs)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .layout import natural_key


@dataclass
class Stats:
    """What writing one module changed, for the summary: scale rounding is the only loss it allows."""
    modules: int = 0
    scales: int = 0
    scales_rounded: int = 0
    max_scale_rel_error: float = 0.0
    layers: list[dict] = field(default_factory=list)       # requantized modules and their error
    v1_zero: list[str] = field(default_factory=list)        # modules with a zero point of 0 written as v1
    scale_dtype: str | None = None   # the dtype its scales were stored in (a target may pick it per module: MLX)

    def requantized(self, module: str, reason: str, source: str, target: str, err) -> None:
        self.layers.append({"module": module, "reason": reason, "from": source, "to": target,
                            "rel_frobenius": round(float(err.rel_frobenius), 6),
                            "max_abs": float(err.max_abs), "sq_error": float(err.sq_error),
                            "rtn_rel_frobenius": round(float(err.rtn_rel_frobenius), 6),
                            "rtn_sq_error": float(err.rtn_sq_error)})

    def scale_rounding(self, exact: np.ndarray, stored: np.ndarray) -> None:
        rel = np.abs(stored.astype(np.float64) - exact.astype(np.float64)) / np.maximum(
            np.abs(exact.astype(np.float64)), np.finfo(np.float64).tiny)
        self.scales += exact.size
        self.scales_rounded += int((rel > 0).sum())
        self.max_scale_rel_error = max(self.max_scale_rel_error, float(rel.max(initial=0.0)))


@dataclass
class Tally:
    """Every written module's Stats, by module. A module whose tensors fall in two shards that two worker
    processes write (--jobs) is encoded by both: it counts once, so the summary is the same whatever N."""
    of: dict[str, Stats] = field(default_factory=dict)

    def add(self, module: str, stats: Stats) -> None:
        self.of[module] = stats

    def merge(self, other: "Tally") -> None:          # a worker's (parallel.write_shards)
        self.of.update(other.of)

    def summary(self) -> dict:
        layers = sorted((r for st in self.of.values() for r in st.layers), key=lambda r: natural_key(r["module"]))
        sq, rtn = sum(r["sq_error"] for r in layers), sum(r["rtn_sq_error"] for r in layers)
        modules = sum(st.modules for st in self.of.values())
        return {"modules": modules, "codes_kept": modules - len(layers), "requantized": len(layers),
                "scales": sum(st.scales for st in self.of.values()),
                "scales_rounded": sum(st.scales_rounded for st in self.of.values()),
                "max_scale_rel_error": max((st.max_scale_rel_error for st in self.of.values()), default=0.0),
                "max_rel_frobenius": max((r["rel_frobenius"] for r in layers), default=0.0),
                "sq_error_vs_rtn": round(sq / rtn, 4) if rtn else None, "layers": layers,
                "v1_zero_points": sorted((n for st in self.of.values() for n in st.v1_zero), key=natural_key),
                "scale_dtypes": dict(sorted(Counter(st.scale_dtype for st in self.of.values() if st.scale_dtype).items()))}
