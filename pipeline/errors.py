"""Error hierarchy. Every message says what failed, where, and how to fix it (:func:`plural` words its counts)."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 rank``, ``2 ranks``, ``0 files`` (``nouns`` for an irregular plural): no message says "1 ranks"."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


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


class UnsafePathError(VerificationError):
    """A path read from a manifest or marker escapes the run dir, or a symlink sits where a run's file should."""


class StageFailedError(PipelineError):
    """A stage's job ended in failure; the message carries job id, state and log paths."""

    exit_code = 1


class CheckpointFormatError(PipelineError):
    """A checkpoint is not in a format this pipeline can read safely."""


class RunBusyError(PipelineError):
    """Another launch owns the run (its lease in the run dir), or the lease cannot be read safely."""
