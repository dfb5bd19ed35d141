"""The GGUF architectures qconv maps, one module a family of them (llama.py, qwen2.py, qwen3.py), each
declaring with base.register what it is: its gguf name, Hugging Face model_type and class, the flags the
generic mapping (arch.py) follows, and a VL model's vision tower as llama.cpp's mmproj file (its tensor
names and clip keys both ways, its read-back config and token ids: mmproj.py, clip_keys.py and source.py
read them); or, with base.register_unwritten, one qconv refuses to write, saying why (cogvlm.py).
Importing this package imports every module it holds, so adding an architecture is adding a module."""

import importlib
import pkgutil

from .base import (ARCHS, BY_GGUF_NAME, UNWRITTEN, VISION, Arch, Unwritten, Vision, register, register_unwritten,
                   vision_prefixes)


def _load_archs() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")


_load_archs()

__all__ = ["ARCHS", "BY_GGUF_NAME", "UNWRITTEN", "VISION", "Arch", "Unwritten", "Vision", "register",
           "register_unwritten", "vision_prefixes"]
