"""Write an output folder atomically: everything goes into a temporary folder beside DST, which is
renamed onto DST only when the work has succeeded. A failure, Ctrl-C or SIGTERM removes the temporary
folder and leaves DST as it was; SRC is never written."""

from __future__ import annotations

import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def check_destination(src: Path, dst: Path, *, overwrite: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or (s.is_dir() and _inside(d, s)):
        raise OutputError("is the source or inside it; write the output somewhere else", file=dst)
    if overwrite and _inside(s, d):
        raise OutputError("holds the source; --overwrite would delete it", file=dst)
    if dst.exists() or dst.is_symlink():
        if not dst.is_dir() or dst.is_symlink():
            raise OutputError("exists and is not a folder", file=dst)
        if any(dst.iterdir()) and not overwrite:
            raise OutputError("exists and is not empty; pass --overwrite to replace it", file=dst)


class _Terminated(KeyboardInterrupt):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated()


@contextmanager
def staged_output(src: Path, dst: Path, *, overwrite: bool):
    """Yields the temporary folder to fill; on success it becomes DST."""
    check_destination(src, dst, overwrite=overwrite)
    dst = dst.absolute()
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.parent / f".{dst.name}.qconv-tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        raise OutputError(f"cannot create the output folder: {exc.strerror or exc}", file=dst) from None
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:                       # not the main thread: leave SIGTERM alone
        previous = None
    try:
        yield tmp
        old = None
        if dst.exists():
            old = dst.parent / f".{dst.name}.qconv-old-{os.getpid()}"
            os.rename(dst, old)
        os.rename(tmp, dst)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write the output: {exc.strerror or exc}",
                          file=getattr(exc, "filename", None) or dst) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
