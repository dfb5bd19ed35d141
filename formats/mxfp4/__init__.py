"""gpt-oss MXFP4: fused 3-D MoE experts (*_blocks / *_scales), one module per fused tensor; read only.
Its declarations: the mxfp4 family and dialect."""

from ..core.registry import Dialect, Family
from . import header as mxfp4


class Mxfp4(Family):
    name = "mxfp4"
    method = "gpt-oss MXFP4"
    config_methods = frozenset({"mxfp4"})
    codec = "mxfp4.codec"
    header = mxfp4
    scale_tensor = "_scales"
    row_multiple = 1


class Mxfp4Dialect(Dialect):
    name = "mxfp4"
    config_methods = frozenset({"mxfp4"})
    header = mxfp4

    def refuse(self, qc):
        return mxfp4.refuse(qc)
