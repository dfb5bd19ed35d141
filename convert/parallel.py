"""Output shards written by worker processes (`--jobs N`), each bounded in memory as one process is.

The output's shards are planned from headers before anything is written (safetensors_writer.plan_shards),
so they are independent: with N > 1 and more than one shard, N child processes each write their share of
the shards into the same staging folder, while this process only hands out the work, reports progress and
gathers what the workers measured. Each worker rebuilds the very same plan from the pickled component
(``Replan``: a top-level function and its arguments; no header is re-read), checks that it planned the same
shards, and writes its own with the same code as one process does, so the bytes are the same whatever N.

Workers are plain ``python -c`` children (not multiprocessing): nothing of the caller's ``__main__`` is
re-run, so a release script that calls ``qconv.convert`` needs no ``if __name__ == "__main__"`` guard.
They ignore Ctrl-C and SIGHUP (this process stops them: a failure, Ctrl-C or SIGTERM here terminates every
worker before the staging folder is removed), die with this process (Linux: PR_SET_PDEATHSIG), write
nothing to the terminal (their stderr is kept for a crash's message), and share the machine's cores
(``threads()``: each gets cores / N threads for its numpy and torch work).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import errors
from ..errors import OutputError, QconvError
from ..formats.core import threads as core_threads
from ..formats.core.threads import machine_cores, on_cores, threads  # noqa: F401 (the verbs' thread counts)

@dataclass(frozen=True)
class Replan:
    """How a worker rebuilds a component's output plan: ``fn(comp, *args) -> (tensors, state)``, where
    tensors is the list of engine.OutTensor and state (None, or an object with ``merge(other)``) is what
    writing measures (convert.Tally). ``fn`` must be a module-level function: it is pickled by name."""
    fn: Callable
    args: tuple = ()


def assign(sizes: list[int], jobs: int) -> list[list[int]]:
    """Shard indices per worker: largest first, each to the least loaded worker (ties: the lowest)."""
    groups: list[list[int]] = [[] for _ in range(jobs)]
    load = [0] * jobs
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        w = min(range(jobs), key=lambda w: (load[w], w))
        groups[w].append(i)
        load[w] += sizes[i]
    return [sorted(g) for g in groups if g]


def _child_env(threads_each: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "QCONV_TEST_SIGNAL"}   # the parent fires test hooks
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads_each)
    env["PYTHONWARNINGS"] = "ignore"
    return env


_BOOT = ("import pickle, sys; path = pickle.load(sys.stdin.buffer); "
         "sys.path[:0] = [p for p in path if p not in sys.path]; "
         "from {pkg}.convert.parallel import child_main; child_main()")


class _Worker:
    def __init__(self, index: int, shards: list[int], task: dict, env: dict, messages: queue.Queue):
        self.index, self.shards = index, shards
        pkg = __name__.split(".")[0]
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT.format(pkg=pkg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, close_fds=True)
        self.stderr = b""
        self._err_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self._err_thread.start()
        self._out_thread = threading.Thread(target=self._read_messages, args=(messages,), daemon=True)
        self._out_thread.start()
        try:
            pickle.dump(list(sys.path), self.proc.stdin)
            pickle.dump(task, self.proc.stdin)
            self.proc.stdin.close()
        except BrokenPipeError:
            pass                                 # it died at once: reported with its exit status

    def _read_stderr(self) -> None:
        data = self.proc.stderr.read()
        self.stderr = data[-4000:]

    def _read_messages(self, messages: queue.Queue) -> None:
        while True:
            try:
                msg = pickle.load(self.proc.stdout)
            except (EOFError, pickle.UnpicklingError, OSError):
                messages.put((self.index, ("exit",)))
                return
            messages.put((self.index, msg))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.terminate()
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        code = self.proc.wait()
        self._out_thread.join()
        self._err_thread.join()
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()
        return code


def _error(msg: tuple) -> QconvError:
    _, cls_name, problem, file, tensor = msg
    cls = getattr(errors, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, QconvError)):
        cls = QconvError
    return cls(problem, file=file, tensor=tensor)


def write_shards(comp, out_dir: Path, shards: list, replan: Replan, jobs: int, on_tensor: Callable[[int], None],
                 state, write_shard: Callable) -> int:
    """Write ``shards`` (the component's whole plan) into ``out_dir`` with ``jobs`` worker processes, each
    calling ``write_shard(out_dir, shard, tensors_by_name, on_tensor)`` (engine.write_shard: a module-level
    function, pickled by name) for its shards; returns the bytes written. ``on_tensor(n)`` is called here, in order of arrival, for every tensor a
    worker has written; ``state.merge`` takes each worker's measurements. The first failure stops every
    worker and is raised here, as the worker raised it."""
    groups = assign([s.data_bytes for s in shards], jobs)
    threads_each = max(1, machine_cores() // len(groups))
    env = _child_env(threads_each)
    messages: queue.Queue = queue.Queue()
    workers: list[_Worker] = []
    written, finished, failure = 0, set(), None
    try:
        for i, group in enumerate(groups):
            task = {"comp": comp, "out_dir": str(out_dir), "shards": [shards[k] for k in group],
                    "replan": replan, "threads": threads_each, "write_shard": write_shard}
            workers.append(_Worker(i, group, task, env, messages))
        while len(finished) < len(workers) and failure is None:
            try:
                index, msg = messages.get(timeout=0.2)
            except queue.Empty:
                continue
            kind = msg[0]
            if kind == "tensor":
                written += msg[1]
                on_tensor(msg[1])
            elif kind == "done":
                if state is not None and msg[1] is not None:
                    state.merge(msg[1])
                finished.add(index)
            elif kind == "error":
                failure = _error(msg)
            elif kind == "crash":
                failure = RuntimeError(f"in a worker process: {msg[1]}")
            elif kind == "exit" and index not in finished:
                code = workers[index].wait()
                failure = _died(workers[index], shards, code, out_dir)
    finally:
        for w in workers:
            w.stop()
        for w in workers:
            w.wait()
    if failure is not None:
        raise failure
    return written


def _died(worker: _Worker, shards: list, code: int, out_dir: Path) -> Exception:
    names = ", ".join(shards[k].filename for k in worker.shards)
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        if -code == signal.SIGKILL:
            how += " (out of memory? try fewer --jobs)"
    else:
        last = worker.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        how = f"exited with status {code} ({last[0]})"
    return OutputError(f"the worker process writing {names} {how}; nothing written", file=out_dir)


# ---- in the worker process ----------------------------------------------------------------------------

def _send(out, msg) -> None:
    pickle.dump(msg, out)
    out.flush()


def _die_with_parent() -> None:
    """Linux: be killed when the process that started us goes (a SIGKILLed qconv leaves no writer)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)            # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:
        os._exit(1)


def child_main() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)      # the parent stops us (SIGTERM) when it is interrupted
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    out = sys.stdout.buffer
    sys.stdout = sys.stderr                      # nothing a library prints can break the message stream
    try:
        task = pickle.load(sys.stdin.buffer)
        core_threads.set_threads(task["threads"])
        state = _write(task, lambda n: _send(out, ("tensor", n)))
        _send(out, ("done", state))
    except QconvError as exc:
        _send(out, ("error", type(exc).__name__, exc.problem, exc.file, exc.tensor))
    except BaseException as exc:                # a bug: its type and message, as the CLI reports one
        _send(out, ("crash", f"{type(exc).__name__}: {exc}"))


def _write(task: dict, sent: Callable[[int], None]):
    comp, replan, write_shard = task["comp"], task["replan"], task["write_shard"]
    tensors, state = replan.fn(comp, *replan.args)
    by_name = {t.name: t for t in tensors}
    for shard in task["shards"]:
        for name, dtype, shape in shard.tensors:
            t = by_name.get(name)
            if t is None or (t.dtype, tuple(t.shape)) != (dtype, tuple(shape)):
                raise AssertionError(f"the worker planned {name!r} differently from the parent")
        write_shard(Path(task["out_dir"]), shard, by_name, sent)
    return state
