"""gpt-oss MXFP4: fused 3-D MoE experts (*_blocks / *_scales), one module per fused tensor; read only.
Its declarations: the mxfp4 family and dialect."""

from ..core.registry import Dialect, Family, register
from . import header as mxfp4

register(Family("mxfp4", "gpt-oss MXFP4", frozenset({"mxfp4"}), lambda method, qc: method == "mxfp4",
                mxfp4.find_modules, mxfp4.check, "mxfp4.codec", mxfp4.settings, scale_tensor="_scales",
                symmetric=lambda m, qc: True, rows=1))
register(Dialect("mxfp4", frozenset({"mxfp4"}), mxfp4.lint, refuse=mxfp4.refuse))
