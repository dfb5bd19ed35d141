"""qconv: inspect, convert, dequantize and validate quantized LLM/VLM checkpoints."""

__version__ = "0.1.0"
