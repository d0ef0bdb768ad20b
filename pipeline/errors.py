"""Error hierarchy. Every message says what failed, where, and how to fix it (:func:`plural` words its counts)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 rank``, ``2 ranks``, ``0 files`` (``nouns`` for an irregular plural): no message says "1 ranks"."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def one_line(message: str) -> str:
    """A message on one line. One that carries tracebacks (DCP's CheckpointException holds every rank's) keeps
    its first line and the error that ends its first traceback."""
    lines = [line.rstrip() for line in message.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), None)
    if start is None:
        return " ".join(message.split())
    inner = next((ln for ln in lines[start + 1 :] if not ln[0].isspace() and not ln.startswith("Traceback")), None)
    head = " ".join(" ".join(lines[:start]).split())
    return " ".join(part for part in (head, f"(caused by {inner.strip()})" if inner else "") if part)


def exception_line(e: BaseException) -> str:
    """``<Type>: <first line>`` of the root cause, at most 300 characters: the deepest ``OSError`` in ``e``'s
    chain when there is one (a full disk, an I/O error), else DCP's first failing rank (its
    ``CheckpointException`` maps ranks to their exceptions), else ``e`` itself."""
    seen: list[BaseException] = [e]
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception or (exception, traceback)}
    if isinstance(failures, dict):
        for _rank, failure in sorted(failures.items(), key=lambda kv: kv[0]):
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                seen.append(inner)
    while len(seen) <= 20 and (seen[-1].__cause__ is not None or seen[-1].__context__ is not None):
        seen.append(seen[-1].__cause__ or seen[-1].__context__)  # type: ignore[arg-type]
    chosen = next((x for x in seen if isinstance(x, OSError)), seen[1] if len(seen) > 1 and failures else e)
    text = str(chosen).strip().splitlines()
    return f"{type(chosen).__name__}: {text[0] if text else ''}"[:300]


class PipelineError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero (2: bad input; 1: a stage failed)."""

    exit_code = 2


class ConfigError(PipelineError):
    """The composed configuration is invalid (unknown key, bad value, missing experiment)."""


class RunNotFoundError(PipelineError):
    """A run id or a stage name does not exist."""


class DeadlineError(PipelineError):
    """A wait ran past its deadline, or what it waited for died first."""

    exit_code = 1


class VerificationError(PipelineError):
    """A file's size or hash does not match its marker or manifest."""

    exit_code = 1


class ReadFailed(PipelineError):
    """A read that did not complete (``EIO``, ``ESTALE``, a timeout, a short read, an S3 5xx), retried for a bounded
    time: what the bytes are is unknown, which is never evidence of damage (nothing is quarantined, ``latest``
    never moves back, no reader picks an older step because of it). :mod:`pipeline.storage.reads`."""

    exit_code = 1


class UnsafePathError(VerificationError):
    """A path read from a manifest or marker escapes the run dir, or a symlink sits where a run's file should."""


class StageFailedError(PipelineError):
    """A stage's job ended in failure; the message carries job id, state and log paths."""

    exit_code = 1


class CheckpointFormatError(PipelineError):
    """A checkpoint is not in a format this pipeline can read safely."""


class StateError(PipelineError):
    """A training state holds a value a resume could not load back (refused at save, before anything is staged),
    or a ``Checkpointer`` option is not one it has."""


class RunBusyError(PipelineError):
    """Another launch owns the run (its lease in the run dir), or the lease cannot be read safely."""


def run_command(main: Callable[[list[str]], int], note: str) -> int:
    """A command line's ``main`` on ``sys.argv``: a Ctrl-C ends it with one line on stderr (``note``: what is
    left and what to do) and exit 130, never a traceback."""
    try:
        return main(sys.argv[1:])
    except KeyboardInterrupt:
        print(f"interrupted: {note}", file=sys.stderr)
        return 130


# -- the optional parts of the install (pip install 'race-free-ckpt[<extra>]'): a feature used without its
# extra stops with one line naming the extra. The core (the library and its command lines) needs only torch, numpy,
# safetensors and xxhash.

PACKAGE = "race-free-ckpt"


def missing(extra: str, what: str, module: str) -> PipelineError:
    """The one-line error for ``what`` used without ``module`` (from the extra ``extra``)."""
    return PipelineError(f"{what} needs {module}, which is not installed: pip install '{PACKAGE}[{extra}]'")


def need(module: str, extra: str, what: str) -> ModuleType:
    """``import module``, or :func:`missing`'s error."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing(extra, what, module.split(".", maxsplit=1)[0]) from None
