"""The options the library and the app share, each validated by one function here.

A knob has one spelling per surface: ``keep_last`` to ``Checkpointer(...)`` and ``CommitPolicy``, ``--keep-last``
to ``python -m pipeline.commit``, ``checkpoint.keep_last`` in the app's config. Every surface calls the same
check, passing ``name`` as its caller wrote it, so the rule and its message are written once. A bad value raises
:class:`~pipeline.errors.ConfigError` (a ``PipelineError``): one line naming the knob, its value and what it
takes. ``None`` means "unset" wherever a knob is optional.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.errors import ConfigError, PipelineError
from pipeline.storage.s3 import S3Url

MAX_WRITER_THREADS = 64
"""More files per rank than this in parallel only adds seeks; a larger value is a typo."""
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
BEST_MODES = ("min", "max")
"""Whether the lowest (a loss) or the highest (an accuracy) value of ``best_metric`` is best."""
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


BEST_NAMES = ("keep_best", "best_metric", "best_mode")


def check_best(
    keep_best: int | None, best_metric: str, best_mode: str, names: tuple[str, str, str] = BEST_NAMES
) -> None:
    """Best-k retention: ``keep_best`` an integer >= 1 or unset, ``best_metric`` a non-empty name (what training
    passes in ``metrics``), ``best_mode`` one of :data:`BEST_MODES`. ``names``: the three knobs as the caller
    spells them (``checkpoint.keep_best`` in the app's config, ``--keep-best`` on a command line)."""
    check_keep(keep_best, names[0])
    if not isinstance(best_metric, str) or not best_metric.strip():
        raise ConfigError(f"{names[1]}={best_metric!r} must be the name of a metric training reports (e.g. 'loss')")
    if best_mode not in BEST_MODES:
        raise ConfigError(f"{names[2]}={best_mode!r}: choose min (lower is better, a loss) or max (higher is better)")


def check_metrics(metrics: Mapping[str, object] | None) -> dict[str, float | None]:
    """What a save records (``save(step, state, metrics=...)``): name -> a real number (a Python or NumPy
    number, or a one-element tensor). A value that is not finite (a NaN loss) is kept as ``None``: never
    the best. Anything else raises :class:`~pipeline.errors.ConfigError` naming the metric."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"metrics={metrics!r} must be a mapping of metric name to number, e.g. {{'loss': 2.31}}")
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"metrics: name {name!r} must be a non-empty string")
        try:
            if isinstance(value, str | bytes | bool):
                raise TypeError
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(f"metrics[{name!r}]={value!r} must be a number (e.g. loss.item())") from None
        out[name] = number if math.isfinite(number) else None
    return out


def check_call(owner: str, init: Callable[..., None], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """The arguments of ``owner(...)`` bind to ``init``'s parameters, or one line naming what does not, with the
    nearest valid name for a typo (``keep_lst`` -> ``keep_last``) instead of Python's ``TypeError``."""
    params = inspect.signature(init).parameters
    names = [n for n, p in params.items() if n != "self" and p.kind is p.KEYWORD_ONLY]
    for key in kwargs:
        if key not in params or params[key].kind is inspect.Parameter.POSITIONAL_ONLY:
            near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}=?" if near else f"its options: {', '.join(names)}"
            raise ConfigError(f"{owner}({key}=...): no such option; {hint}")
    try:
        inspect.signature(init).bind(None, *args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"{owner}(...): {e}") from None
