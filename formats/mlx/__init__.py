"""Apple MLX (mlx-lm): affine low-bit codes with per-group scales and biases. header.py (stdlib) describes
the layout, codec.py (numpy) reads and writes the data."""
