"""llama.cpp's GGUF: one file (or a split set) holding metadata and block-typed tensors. Its declarations:
the gguf family (a GGUF opened as a source: Q8_0 / Q4_0 / Q5_0 / MXFP4 block tensors; a permuted llama
q / k read whole, codec.row_step) and dialect, the storage container that opens a GGUF file (and inspect's
header-only report of it), and `--to gguf`, its writer."""

from ..core.registry import Dialect, Family, FileTarget, lazy, register, register_file_target
from ..storage.checkpoint import Container, register_container
from . import header as gguf

register(Family("gguf", "GGUF", frozenset({"gguf"}), lambda method, qc: method == "gguf", gguf.find_modules,
                gguf.check, "gguf.codec", gguf.settings, symmetric=lambda m, qc: True, rows="row_step"))
register(Dialect("gguf", frozenset({"gguf"}), gguf.lint))
register_container(Container("gguf", gguf.looks_like_gguf, lazy("gguf.source", "open_gguf"),
                             lazy("gguf.report", "describe"), lazy("gguf.report", "render")))
# `--to gguf`: one llama.cpp file (writer.py), its options (core/request.py's Options) and their values checked
register_file_target(FileTarget("gguf", "gguf", gguf.WRITER_OPTIONS, lazy("gguf.writer", "convert_to_gguf")))
