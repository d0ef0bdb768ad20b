"""The options the library and the app share, each validated by one function here.

A knob has one spelling per surface: ``keep_last`` to ``Checkpointer(...)`` and ``CommitPolicy``, ``--keep-last``
to ``python -m pipeline.commit``, ``checkpoint.keep_last`` in the app's config. Every surface calls the same
check, passing ``name`` as its caller wrote it, so the rule and its message are written once. A bad value raises
:class:`~pipeline.errors.ConfigError` (a ``PipelineError``): one line naming the knob, its value and what it
takes. ``None`` means "unset" wherever a knob is optional.
"""

from __future__ import annotations

import math

from pipeline.errors import ConfigError, PipelineError
from pipeline.storage.s3 import S3Url

MAX_WRITER_THREADS = 64
"""More files per rank than this in parallel only adds seeks; a larger value is a typo."""
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
"""dtypes an export may hold (``export.dtype``, ``python -m pipeline.export --dtype``)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_every_steps(value: int | None, name: str = "every_steps") -> None:
    """Save every this many steps (app: ``checkpoint.every``): an integer >= 1, or unset."""
    if value is not None and not (_is_int(value) and value >= 1):
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")


def check_keep(value: int | None, name: str = "keep_last") -> None:
    """A retention count (``keep_last``, ``keep_every``, ``keep_outputs_last``): an integer >= 1, or unset."""
    if value is not None and not (_is_int(value) and value >= 1):
        raise ConfigError(f"{name}={value!r} must be an integer >= 1 (or unset to keep every step)")


def check_deadline(value: float, name: str = "deadline_s") -> None:
    """The longest a wait may take (markers, async writers, the last commit pass): finite and > 0 seconds, since
    every wait needs a deadline."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name}={value!r} must be a finite number > 0 (seconds: every wait needs a deadline)")


def check_seconds(value: float, name: str = "poll_interval_s") -> None:
    """A period or grace in seconds (a poll interval, the committer lease): > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{name}={value!r} must be > 0 (seconds)")


def check_writer_threads(value: int | None, name: str = "writer_threads") -> None:
    """Files each rank writes in parallel: an integer from 1 to :data:`MAX_WRITER_THREADS`, or unset (automatic:
    the CPUs a rank has to itself, at most 4)."""
    if value is not None and not (_is_int(value) and 1 <= value <= MAX_WRITER_THREADS):
        raise ConfigError(f"{name}={value!r} must be an integer between 1 and {MAX_WRITER_THREADS} (or unset)")


def check_world_size(value: int, name: str = "world_size") -> None:
    """Ranks that write a step (markers a step needs): an integer >= 1."""
    if not (_is_int(value) and value >= 1):
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")


def check_storage(value: str | None, name: str = "storage") -> None:
    """Where checkpoints live: unset (the directory's ``checkpoints/``) or ``s3://<bucket>[/<prefix>]``."""
    if value is None:
        return
    try:
        S3Url.parse(value, name)
    except PipelineError as e:
        raise ConfigError(str(e)) from None


def check_export_dtype(value: str, name: str = "dtype") -> None:
    """The dtype of exported weights: one of :data:`EXPORT_DTYPES`."""
    if value not in EXPORT_DTYPES:
        raise ConfigError(f"{name}={value!r}: choose {', '.join(EXPORT_DTYPES[:-1])} or {EXPORT_DTYPES[-1]}")
