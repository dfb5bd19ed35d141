"""Threads for numpy / torch work in this process: every core it may run on, or a --jobs worker's share
(set_threads), and one shared pool (on_cores) that the readers, the requantizer and the writers map over."""

from __future__ import annotations

import os
import threading
from typing import Callable

_THREADS: int | None = None             # set in a worker (convert/parallel.py): its share of the machine's cores


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads() -> int:
    """Threads for numpy / torch work in this process: all its cores, or a worker's share of them."""
    return _THREADS or machine_cores()


_POOL = None
_POOL_PREFIX = "qconv-compute"


def on_cores(fn: Callable, items) -> list:
    """[fn(i) for i in items] on threads() threads (numpy, torch and BLAS release the GIL), in the items'
    order. Called from one of those threads (a task that itself maps), it runs in that thread: a pool
    never waits on itself."""
    global _POOL
    items = list(items)
    if len(items) <= 1 or threading.current_thread().name.startswith(_POOL_PREFIX):
        return [fn(i) for i in items]
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(threads(), thread_name_prefix=_POOL_PREFIX)
    return list(_POOL.map(fn, items))


def set_threads(n: int | None) -> None:
    """A worker process's share of the cores (convert/parallel.py), before any pool is made."""
    global _THREADS
    _THREADS = n
