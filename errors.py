"""qconv's errors: one small hierarchy, each class bound to the exit code the CLI returns for it.

Every message names the file (and the tensor, where there is one), says what was found and what was
expected, and where it can, how to fix it. The CLI prints ``qconv: error: <message>`` on one line.
"""

from __future__ import annotations

from pathlib import Path

# Exit codes. Documented in README.md and in `qconv --help`.
EXIT_OK = 0
EXIT_FAILED = 1          # the command ran and its check failed (inspect --strict found warnings, ...)
EXIT_USAGE = 2           # bad command line (click's own code)
EXIT_NOT_FOUND = 3       # PATH missing, empty, no safetensors weights, pickle-only
EXIT_CORRUPT = 4         # malformed or inconsistent checkpoint: header, offsets, index, config JSON
EXIT_UNSUPPORTED = 5     # well-formed, but a layout or method qconv does not handle
EXIT_OUTPUT = 6          # cannot write the output (DST exists and is not empty, no space, ...)
EXIT_INTERNAL = 70       # a bug in qconv: please report it
EXIT_INTERRUPTED = 130   # Ctrl-C / SIGTERM


class QconvError(Exception):
    """Base class. ``str(err)`` is the one-line message the CLI prints."""

    exit_code = EXIT_FAILED

    def __init__(self, problem: str, *, file: str | Path | None = None, tensor: str | None = None):
        self.problem = problem
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        super().__init__(self.message)

    @property
    def message(self) -> str:
        parts = []
        if self.file:
            parts.append(self.file)
        if self.tensor:
            parts.append(f"tensor {self.tensor!r}")
        parts.append(self.problem)
        return ": ".join(parts).replace("\n", " ")


class UsageError(QconvError):
    """The command line asks for something this machine cannot do (e.g. --device cuda without a GPU)."""

    exit_code = EXIT_USAGE


class InputNotFound(QconvError):
    """Nothing to read: the path is missing, empty, or holds no safetensors weights."""

    exit_code = EXIT_NOT_FOUND


class CorruptCheckpoint(QconvError):
    """The files are malformed or disagree with each other in a way no loader accepts."""

    exit_code = EXIT_CORRUPT


class UnsupportedFormat(QconvError):
    """Well-formed, but a layout or method that qconv does not read."""

    exit_code = EXIT_UNSUPPORTED


class NotStorable(ValueError):
    """A format cannot hold a value or layout (codes beyond its width, a shape its packing does not fill, a
    scale dtype it does not store): raised by the formats' writer hooks (leaves, encode, config, share,
    arrange), which convert turns into an UnsupportedFormat naming the module (exit 5). Its own class, so
    that any other ValueError (a bug, numpy's) is never taken for a refusal. A ValueError for callers that
    caught that."""


class OutputError(QconvError):
    """The destination cannot be written."""

    exit_code = EXIT_OUTPUT


class CheckFailed(QconvError):
    """The verb ran and its check failed: ``inspect(strict=True)`` found warnings, ``validate`` found a
    layer that differs. ``result`` holds the whole report (the API's typed result), where there is one."""

    exit_code = EXIT_FAILED

    def __init__(self, problem: str, *, file: str | Path | None = None, tensor: str | None = None,
                 result=None):
        super().__init__(problem, file=file, tensor=tensor)
        self.result = result


class ValidationFailed(CheckFailed):
    """A converted result did not compute what its source computes (``validate``, ``convert(validate=True)``:
    then nothing was written)."""
