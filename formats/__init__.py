"""On-disk formats. ``storage/`` (safetensors, folders, containers) and ``core/`` (the canonical
representation and the registry's types) are the shared layer below the families; every other folder is
one format family, which declares itself in its package __init__ (formats/core/registry.py). Importing
this package imports every family folder it holds, so adding a format is adding a folder."""

import importlib
import pkgutil

SHARED = ("core", "storage")


def _load_families() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.ispkg and info.name not in SHARED:
            importlib.import_module(f"{__name__}.{info.name}")


_load_families()
