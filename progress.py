"""Progress of a long verb, as events handed to a callback that the caller chose. Nothing here writes
anywhere: the CLI draws one line on stderr when stderr is a terminal (cli._terminal_progress), the Python
API passes the caller's own callback (``qconv.convert(..., progress=fn)``), and with none, nothing is
reported. The callback runs on the thread that called the verb."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass(frozen=True)
class ProgressEvent:
    task: str          # "converting model", "dequantizing model", "validating model", ...
    done: int          # units done so far
    total: int         # units in all (at least 1)
    unit: str          # "bytes" (write verbs: tensor bytes written) or "layers" (validate)


ProgressCallback = Callable[[ProgressEvent], None]

_callback: contextvars.ContextVar[ProgressCallback | None] = contextvars.ContextVar("qconv_progress", default=None)


@contextmanager
def reporting(callback: ProgressCallback | None) -> Iterator[None]:
    """Send the events of the verb run inside this block to ``callback`` (None: to nobody)."""
    token = _callback.set(callback)
    try:
        yield
    finally:
        _callback.reset(token)


def report(task: str, done: int, total: int, unit: str) -> None:
    callback = _callback.get()
    if callback is not None:
        callback(ProgressEvent(task, done, max(total, 1), unit))
