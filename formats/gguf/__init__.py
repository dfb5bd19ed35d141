"""llama.cpp's GGUF: one file (or a split set) holding metadata and block-typed tensors. Its declarations:
the gguf family (a GGUF opened as a source: Q8_0 / Q4_0 / Q5_0 / MXFP4 block tensors, Q4_1 / Q5_1 / Q4_K /
Q5_K as codes with float offsets; a permuted llama q / k read whole, codec.row_step) and dialect, the storage container that opens a GGUF file (and inspect's
header-only report of it), and `--to gguf`, its writer."""

from ..core.registry import Dialect, Engine, Family, FileTarget, lazy
from ..storage.checkpoint import Container, register_container
from . import header as gguf


class Gguf(Family):
    """A GGUF opened as a source: Q8_0 / Q4_0 / Q5_0 / MXFP4 block tensors, Q4_1 / Q5_1 / Q4_K / Q5_K codes with
    float offsets (the other K-quants and IQ types decoded to float); a permuted llama q / k is read whole
    (codec.row_step)."""
    name = "gguf"
    method = "GGUF"
    config_methods = frozenset({"gguf"})
    codec = "gguf.codec"
    header = gguf

    def row_step(self, m) -> int:
        return self.codec_module().row_step(m)


class GgufDialect(Dialect):
    name = "gguf"
    config_methods = frozenset({"gguf"})
    header = gguf
    engine = Engine("llama.cpp", "llama_cpp", "llamacpp_run.py")


register_container(Container("gguf", gguf.looks_like_gguf, lazy("gguf.source", "open_gguf"),
                             lazy("gguf.report", "describe"), lazy("gguf.report", "render")))


class GgufTarget(FileTarget):
    """`--to gguf`: one llama.cpp file (a split set, the mmproj file beside it), written through its sink
    (sink.py; the plan, encoding, report and read-back are writer.py's and mmproj.py's)."""
    name = "gguf"
    family = "gguf"
    options = gguf.WRITER_OPTIONS
    hub_tags = ("gguf",)

    def sink(self, opts, *, max_shard: int, jobs: int, validate: bool):
        from .sink import GGUFSink

        return GGUFSink(opts, max_shard=max_shard, jobs=jobs, validate=validate)
