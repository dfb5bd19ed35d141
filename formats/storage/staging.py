"""Write an output folder atomically: everything goes into a temporary folder beside DST,
``.DST.qconv-tmp-PID``, which is renamed onto DST only when the work has succeeded.

* A failure, Ctrl-C, SIGTERM or SIGHUP removes the temporary folder and any parent folders qconv
  created for DST, and leaves DST as it was; SRC is never written.
* The rename re-checks DST atomically: without --overwrite, ``rename(tmp, DST)`` replaces nothing but
  an empty folder (Linux refuses to rename onto a non-empty one), so a DST created or filled while qconv
  ran is left alone and the run exits 6; of two runs to one DST, one wins.
* With --overwrite the old DST is first renamed aside (``.DST.qconv-old-PID``), then removed.
* Signals are held off while the result is published and while a failure is cleaned up.
* On start, temporary folders left by a killed run for the same DST (exact names, PID not alive, not
  locked by a live run) are removed; an old DST set aside by a run killed mid-publish is put back.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

from ...errors import OutputError, QconvError

try:
    import fcntl
except ImportError:                          # not POSIX: no locks, PID checks only
    fcntl = None

# TEST-ONLY hook. QCONV_TEST_SIGNAL=POINT:SIGNAME (e.g. "tensor-written:SIGINT") makes qconv send
# itself SIGNAME the first time it reaches POINT, so tests can interrupt (or SIGSTOP) a run at a known
# step without racing it. Points: "tensor-written" (engine: the first output tensor is on disk) and
# "before-publish" (the work is done, DST not yet renamed). Not a user feature; never set it otherwise.
TEST_SIGNAL_ENV = "QCONV_TEST_SIGNAL"
_fired: set[str] = set()


def test_hook(point: str) -> None:
    spec = os.environ.get(TEST_SIGNAL_ENV)
    if not spec or point in _fired:
        return
    where, _, name = spec.partition(":")
    sig = getattr(signal, name, None)
    if where == point and isinstance(sig, signal.Signals):
        _fired.add(point)
        os.kill(os.getpid(), sig)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_not_source(src: Path, dst: Path, *, overwrite: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or (s.is_dir() and _inside(d, s)):
        raise OutputError("is the source or inside it; write the output somewhere else", file=dst)
    if overwrite and _inside(s, d):
        raise OutputError("holds the source; --overwrite would delete it", file=dst)


def _check_existing(dst: Path, *, overwrite: bool) -> None:
    if dst.exists() or dst.is_symlink():
        if not dst.is_dir() or dst.is_symlink():
            raise OutputError("exists and is not a folder", file=dst)
        if any(dst.iterdir()) and not overwrite:
            raise OutputError("exists and is not empty; pass --overwrite to replace it", file=dst)


def check_destination(src: Path, dst: Path, *, overwrite: bool) -> None:
    _check_not_source(src, dst, overwrite=overwrite)
    _check_existing(dst, overwrite=overwrite)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False                         # a folder with our PID is from an earlier process
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                          # EPERM: alive, someone else's
        return True
    return True


def _open_dir(folder) -> int | None:
    try:
        return os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def _lock(folder: Path) -> int | None:
    """Hold an advisory lock on our temporary folder for the whole run (released when the returned
    descriptor is closed), so that a run in another PID namespace never takes it for a dead run's."""
    fd = _open_dir(folder) if fcntl is not None else None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
    return fd


def _locked_by_someone(folder: str) -> bool:
    fd = _open_dir(folder) if fcntl is not None else None
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as exc:                   # held by a live run; other errors: no locks here
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)                         # also releases the probe's own lock


def remove_stale(dst: Path) -> None:
    """Remove ``.DST.qconv-tmp-PID`` / ``.DST.qconv-old-PID`` folders of runs that are gone. An old
    DST set aside by a run killed between its two renames is put back when DST is missing."""
    pattern = re.compile(re.escape(f".{dst.name}.qconv-") + r"(tmp|old)-([0-9]+)")
    try:
        entries = list(os.scandir(dst.parent))
    except OSError:
        return
    for entry in sorted(entries, key=lambda e: e.name):
        m = pattern.fullmatch(entry.name)
        if not m or _pid_alive(int(m[2])) or not entry.is_dir(follow_symlinks=False) \
                or _locked_by_someone(entry.path):
            continue
        if m[1] == "old" and not os.path.lexists(dst):
            try:
                os.rename(entry.path, dst)
                continue
            except OSError:
                continue                     # never delete what may be the only copy of DST
        shutil.rmtree(entry.path, ignore_errors=True)


def _make_parents(folder: Path, created: list[Path]) -> None:
    """Create ``folder`` and its missing parents, recording in ``created`` (deepest first) those made."""
    missing = []
    p = folder
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
            created.insert(0, d)
        except FileExistsError:
            pass


def _remove_parents(created: list[Path]) -> None:
    for d in created:                        # deepest first; stops at one that is not empty
        try:
            os.rmdir(d)
        except OSError:
            break


_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class _Terminated(KeyboardInterrupt):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated()


def _set_handlers(handlers: dict) -> dict:
    """Install ``{signal: handler}``; returns the previous ones ({} when not in the main thread)."""
    previous = {}
    try:
        for sig, handler in handlers.items():
            if handler is not None:          # None: a handler not set from Python, left alone
                previous[sig] = signal.signal(sig, handler)
    except ValueError:                       # not the main thread: leave signals alone
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        return {}
    return previous


def _termination_handlers() -> dict:
    """SIGTERM and SIGHUP end the run like Ctrl-C, unless they were ignored when qconv started
    (``nohup qconv ...`` keeps running when its terminal goes)."""
    out = {}
    for sig in _SIGNALS:
        if sig != signal.SIGINT and signal.getsignal(sig) not in (signal.SIG_IGN, None):
            out[sig] = _raise_terminated
    return out


@contextmanager
def _signals_held():
    """Ctrl-C, SIGTERM and SIGHUP are ignored for the few steps that must not be cut short."""
    previous = _set_handlers({s: signal.SIG_IGN for s in _SIGNALS})
    try:
        yield
    finally:
        _set_handlers(previous)


def _remove(path: Path) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _publish(tmp: Path, dst: Path, shown: Path, *, overwrite: bool) -> None:
    if overwrite and os.path.lexists(dst):
        old = dst.parent / f".{dst.name}.qconv-old-{os.getpid()}"
        os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except OSError:
            os.rename(old, dst)
            raise
        _remove(old)
        return
    try:
        os.rename(tmp, dst)                  # replaces only a missing or empty DST, atomically
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise OutputError("was created or filled by someone else while qconv ran; left as it is, "
                              "nothing written (pass --overwrite to replace it)", file=shown) from None
        if exc.errno in (errno.ENOTDIR, errno.EISDIR):
            raise OutputError("became a file or a link while qconv ran; left as it is, nothing written",
                              file=shown) from None
        raise


def _check_existing_file(dst: Path, *, overwrite: bool) -> None:
    if os.path.lexists(dst):
        if dst.is_dir() or dst.is_symlink():
            raise OutputError("exists and is a folder or a link, not a file", file=dst)
        if not overwrite:
            raise OutputError("exists; pass --overwrite to replace it", file=dst)


def check_file_free(path: Path, *, overwrite: bool) -> None:
    """A file the run will publish beside DST (a one-file target's model card): refused before any work
    where it exists and --overwrite was not given, as DST itself is."""
    _check_existing_file(path, overwrite=overwrite)


def _publish_files(tmp: Path, dst: Path, shown: Path, *, overwrite: bool) -> None:
    """Move each file of tmp beside DST (DST itself, or its split files): without --overwrite by a hard
    link that fails where a file of that name appeared meanwhile, so nothing is replaced."""
    names = sorted(os.listdir(tmp))
    for name in names:
        _check_existing_file(dst.parent / name, overwrite=overwrite)
    for name in names:
        if overwrite:
            os.replace(tmp / name, dst.parent / name)
            continue
        try:
            os.link(tmp / name, dst.parent / name)
        except FileExistsError:
            raise OutputError("was created by someone else while qconv ran; left as it is", file=dst.parent / name) \
                from None
        os.unlink(tmp / name)
    _remove(tmp)


@contextmanager
def staged_output(src: Path, dst: Path, *, overwrite: bool, files: bool = False):
    """Yields the temporary folder to fill; on success it becomes DST. files: DST is a file (a GGUF):
    what the folder holds is moved beside DST instead, DST and its split files."""
    shown = dst                              # messages name DST as the user wrote it
    _check_not_source(src, dst, overwrite=overwrite)
    dst = dst.absolute()
    remove_stale(dst)
    (_check_existing_file if files else _check_existing)(shown, overwrite=overwrite)
    created: list[Path] = []
    tmp = dst.parent / f".{dst.name}.qconv-tmp-{os.getpid()}"
    lock = None
    previous = _set_handlers(_termination_handlers())
    try:
        try:
            _make_parents(dst.parent, created)
            if os.path.lexists(tmp):
                _remove(tmp)
            tmp.mkdir()
        except OSError as exc:
            raise OutputError(f"cannot create the output folder: {exc.strerror or exc}", file=shown) from None
        lock = _lock(tmp)
        yield tmp
        test_hook("before-publish")
        with _signals_held():
            (_publish_files if files else _publish)(tmp, dst, shown, overwrite=overwrite)
    except BaseException as exc:
        with _signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_parents(created)
        def as_in_dst(where: str) -> str:        # name a file as it would have been in DST
            return str(shown) + where[len(str(tmp)):] if where.startswith(str(tmp)) else where

        if isinstance(exc, OSError):
            where = as_in_dst(str(getattr(exc, "filename", None) or shown))
            raise OutputError(f"cannot write the output: {exc.strerror or exc}", file=where) from None
        if isinstance(exc, QconvError) and exc.file:   # e.g. a failed --validate names the result
            exc.file = as_in_dst(exc.file)
            exc.args = (exc.message,)
        raise
    finally:
        _set_handlers(previous)
        if lock is not None:
            os.close(lock)
