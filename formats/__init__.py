"""On-disk formats: one module per family, each describing (and later reading and writing) its
tensors. ``safetensors_header`` and ``checkpoint`` are the shared, torch-free layer below them."""
