"""qconv: inspect, convert, dequantize and validate quantized LLM/VLM checkpoints.

The Python API (api.py, docs/python-api.md) has the command line's verbs:

    import qconv
    qconv.inspect("model/")
    qconv.convert("bnb8/", "gptq/", to="gptq", bits=8, group_size=-1, validate=True)
    qconv.dequantize("gptq/", "float/")
    qconv.validate("bnb8/", "gptq/")
    qconv.check_model("float/", "model.gguf")        # end to end: KL divergence, top-1, perplexities

Importing qconv loads neither torch nor numpy.
"""

from .version import VERSION as __version__  # noqa: E402

from . import convert  # noqa: E402  the package, callable as the verb (api.py)
from .api import (ConvertOptions, ConvertResult, DequantizeOptions, DequantizeResult, InspectOptions,  # noqa: E402
                  InspectResult, ModelCheckResult, ProgressEvent, ValidateOptions, ValidateResult, bnb8_to_gptq,
                  check_model, dequantize, inspect, target_options, targets, to_json, validate)
from .errors import (CheckFailed, CorruptCheckpoint, InputNotFound, OutputError, QconvError,  # noqa: E402
                     UnsupportedFormat, UsageError, ValidationFailed)

__all__ = ["inspect", "convert", "bnb8_to_gptq", "dequantize", "validate", "check_model", "targets", "target_options", "to_json",
           "InspectOptions", "ConvertOptions", "DequantizeOptions", "ValidateOptions",
           "InspectResult", "ConvertResult", "DequantizeResult", "ValidateResult", "ModelCheckResult", "ProgressEvent",
           "QconvError", "UsageError", "InputNotFound", "CorruptCheckpoint", "UnsupportedFormat", "OutputError",
           "CheckFailed", "ValidationFailed"]
