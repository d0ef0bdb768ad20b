"""The options the library and the app share are validated once (:mod:`pipeline.checkpoint.options`): each check
takes the knob's name as its caller spells it, and the app's config reaches the same check."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from pipeline.checkpoint import options
from pipeline.config.launcher import LocalLauncherConfig
from pipeline.config.schema import CheckpointConfig, ExportConfig, StrategyConfig
from pipeline.errors import ConfigError

Check = Callable[[Any, str], None]

CASES: list[tuple[Check, list[Any], list[Any]]] = [
    (options.check_every_steps, [None, 1, 100], [0, -1, 2.5, True, "4"]),
    (options.check_keep, [None, 1, 7], [0, -3, 1.5, False]),
    (options.check_deadline, [0.5, 1, 600.0], [0, -1.0, math.inf, math.nan, True, None]),
    (options.check_seconds, [0.01, 1, 30.0], [0, -0.5, math.nan, True, None]),
    (options.check_writer_threads, [None, 1, 64], [0, 65, 2.0, True]),
    (options.check_world_size, [1, 8], [0, -2, 1.0, None]),
    (options.check_storage, [None, "s3://bucket", "s3://my-bucket/runs/a"], ["bucket", "s3://B", "s3://bkt/../x"]),
    (options.check_export_dtype, list(options.EXPORT_DTYPES), ["fp32", "int8", ""]),
]


@pytest.mark.parametrize("check, good, bad", CASES, ids=[c[0].__name__ for c in CASES])
def test_each_check_takes_good_values_and_names_the_knob_of_a_bad_one(check: Check, good: list[Any], bad: list[Any]):
    for value in good:
        check(value, "some.knob")
    for value in bad:
        with pytest.raises(ConfigError) as caught:
            check(value, "some.knob")
        message = str(caught.value)
        assert message.startswith(f"some.knob={value!r}") and "\n" not in message, message


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: CheckpointConfig(keep_last=0), "checkpoint.keep_last=0 must be an integer >= 1"),
        (lambda: CheckpointConfig(keep_outputs_last=-1), "checkpoint.keep_outputs_last=-1 must be"),
        (lambda: CheckpointConfig(every=0), "checkpoint.every=0 must be an integer >= 1"),
        (lambda: CheckpointConfig(writer_threads=65), "checkpoint.writer_threads=65 must be an integer between"),
        (lambda: CheckpointConfig(marker_deadline_s=math.inf), "checkpoint.marker_deadline_s=inf must be a finite"),
        (lambda: CheckpointConfig(storage="bucket"), "checkpoint.storage='bucket' is not an S3 URL"),
        (lambda: StrategyConfig(name="ddp", world_size=0), "strategy.world_size=0 must be an integer >= 1"),
        (lambda: ExportConfig(dtype="fp8"), "export.dtype='fp8': choose float32, bfloat16 or float16"),
        (lambda: LocalLauncherConfig(poll_interval_s=0.0), "launcher.poll_interval_s=0.0 must be > 0"),
    ],
)
def test_the_app_config_reaches_the_shared_checks(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert str(caught.value).startswith(message), caught.value
