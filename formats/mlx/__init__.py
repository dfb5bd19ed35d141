"""Apple MLX (mlx-lm): affine low-bit codes with per-group scales and biases. header.py (stdlib) describes
the layout, codec.py (numpy) reads and writes the data. Its declarations: the mlx family, dialect (its
config has no quant_method: recognised bare) and target."""

from ..core.registry import Caps, Dialect, Family, Target, lazy, register, register_target
from . import header as mlx

register(Family("mlx", "MLX", frozenset({"mlx"}), lambda method, qc: method == "mlx", mlx.find_modules,
                mlx.check, "mlx.codec", mlx.settings, rows=1, scale_tensor=".scales", source_spec="source_spec",
                symmetric=lambda m, qc: False, state_leaves=(".scales", ".biases")))
register(Dialect("mlx", frozenset({"mlx"}), mlx.lint, refuse=mlx.refuse, bare=mlx.is_config))
# integer codes kept with b = -s * z, scales and biases in a dtype that holds them exactly (plan), groups of
# 32 / 64 / 128, mlx-lm's config keys (model_config) and stacked experts (arrange)
register_target(Target("mlx", "mlx", Caps(frozenset(mlx.BITS) - {1}, per_row=False, tiles_rows=True, fallback_bits=8,
                                          divisor_scale="F16", group_sizes=frozenset(mlx.GROUPS)),
                       mlx.writer_leaves, mlx.writer_config, "mlx.codec", fit=mlx.fit, plan=lazy("mlx.codec", "plan"),
                       retarget=lazy("mlx.codec", "retarget"), share=mlx.share, model_config=mlx.model_config,
                       arrange=mlx.arrange))
