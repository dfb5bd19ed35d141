"""Apple MLX (mlx-lm): affine low-bit codes with per-group scales and biases. header.py (stdlib) describes
the layout, codec.py (numpy) reads and writes the data. Its declarations: the mlx family, dialect (its
config has no quant_method: recognised bare) and target."""

from ..core.registry import Caps, Dialect, Engine, Family, Target
from . import header as mlx


class Mlx(Family):
    name = "mlx"
    method = "MLX"
    config_methods = frozenset({"mlx"})
    codec = "mlx.codec"
    header = mlx
    scale_tensor = ".scales"
    row_multiple = 1
    state_leaves = (".scales", ".biases")

    def symmetric(self, m, qc) -> bool:
        return False

    def source_spec(self, m, tensors, qc):
        """Integer zero points (b = -s * z), or none, decided from its scales and biases."""
        return self.codec_module().source_spec(m, tensors, qc)


class MlxDialect(Dialect):
    name = "mlx"
    config_methods = frozenset({"mlx"})
    header = mlx
    engine = Engine("mlx-lm", "mlx_lm", "mlxlm_run.py")

    def refuse(self, qc):
        return mlx.refuse(qc)

    def bare(self, doc) -> bool:
        return mlx.is_config(doc)


class MlxTarget(Target):
    """Integer codes kept with b = -s * z, float offsets (mlx-lm's min / max biases, GGUF Q4_1 / Q4_K ...) kept
    as they are, scales and biases in a dtype that holds them exactly (plan), groups of 32 / 64 / 128, mlx-lm's config keys (model_config) and stacked experts (arrange)."""
    name = "mlx"
    family = "mlx"
    hub_library = "mlx"
    hub_tags = ("mlx",)
    caps = Caps(frozenset(mlx.BITS) - {1}, per_row=False, tiles_rows=True, fallback_bits=8, divisor_scale="F16",
                float_offsets=True, group_sizes=frozenset(mlx.GROUPS))
    codec = "mlx.codec"

    def leaves(self, spec, shape, g_idx, **settings):
        return mlx.writer_leaves(spec, shape, g_idx, **settings)

    def quantization_config(self, ctx):
        return mlx.writer_config(ctx)

    def fit(self, m, source_spec, request, negotiate):
        return mlx.fit(m, source_spec, request, negotiate)

    def share(self, settings):
        return mlx.share(settings)

    def model_config(self, config):
        return mlx.model_config(config)

    def arrange(self, outputs):
        return mlx.arrange(outputs)

    def plan(self, ctx):
        return self.codec_module().plan(ctx)

    def retarget(self, qt, spec, settings):
        return self.codec_module().retarget(qt, spec, settings)
