"""Per-step metrics (``metrics.jsonl``) and the console view of a running stage.

Fast tests drive :class:`StageProgress` with hand-written events (controlled ``time`` values and a fake clock);
one slow test checks that a real 2-rank train writes the events, and that a resumed run appends to them.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from pipeline.checkpoint.manifest import Manifest, write_manifest
from pipeline.driver.progress import (
    FIRST_LINES,
    SUMMARY_EVERY,
    StageProgress,
    commit_lines,
    format_bytes,
    format_count,
    format_duration,
    format_number,
)
from pipeline.errors import plural
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import read_json
from pipeline.storage.integrity import describe
from pipeline.storage.metrics import MetricsTail, MetricsWriter
from tests.conftest import run_cli

# --- the JSONL file ---------------------------------------------------------------------------------------------


def _append_raw(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_metrics_round_trip_waits_for_partial_line_and_skips_garbage(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == [], "a file not yet created reads as empty"
    writer = MetricsWriter(path)
    assert path.exists(), "the writer creates the file"
    writer.append({"event": "start", "n": 1})
    writer.append({"event": "step", "step": 1, "loss": 3.5})
    assert tail.read() == [{"event": "start", "n": 1}, {"event": "step", "step": 1, "loss": 3.5}]
    assert tail.read() == []

    _append_raw(path, b'{"event": "step", "st')
    assert tail.read() == [], "a line without its newline is not complete yet"
    _append_raw(path, b'ep": 2}\n')
    assert tail.read() == [{"event": "step", "step": 2}]

    _append_raw(path, b"not json\n[1, 2]\n\xff\xfe\n\n")
    writer.append({"event": "end"})
    assert tail.read() == [{"event": "end"}]
    assert tail.skipped == 3


def test_writer_ends_a_line_a_crashed_attempt_left_open(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _append_raw(path, b'{"event": "step", "step": 3, "lo')  # killed mid-write
    MetricsWriter(path).append({"event": "start", "attempt": "b"})
    tail = MetricsTail(path)
    assert tail.read() == [{"event": "start", "attempt": "b"}]
    assert tail.skipped == 1


def test_tail_rereads_a_file_that_was_replaced(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for i in range(3):
        writer.append({"event": "step", "step": i})
    tail = MetricsTail(path)
    assert len(tail.read()) == 3
    path.write_text('{"event": "start"}\n')  # run.overwrite deleted the run; a new one began
    assert tail.read() == [{"event": "start"}]


# --- formatting -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (3_100_000, "3.1 MB"), (999_960, "1.0 MB"), (1.5e9, "1.5 GB")],
)
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (44.6, "45s"), (381, "6m21s"), (3599.4, "59m59s"), (3720, "1h02m"), (2 * 86400 + 3 * 3600, "2d03h")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [None, float("inf"), float("nan"), -1.0])
def test_format_duration_unknown(seconds: float | None) -> None:
    assert format_duration(seconds) == "?"


def test_format_count_and_number() -> None:
    assert [format_count(n) for n in (950, 9_500, 12_300_000, 2.5e9)] == ["950", "9.5k", "12.3M", "2.5G"]
    assert [format_number(x) for x in (2.0, 2.3141, 0.01523, 123.4, 1234.5)] == ["2", "2.31", "0.0152", "123", "1234"]


# --- StageProgress ----------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Train:
    """Writes train's events for one attempt; step ``k`` happens at ``t0 + k * step_s``."""

    def __init__(self, layout: RunLayout, attempt: str, *, t0: float = 1000.0, step_s: float = 0.5) -> None:
        self.writer = MetricsWriter(layout.metrics)
        self.attempt, self.t0, self.step_s = attempt, t0, step_s

    def event(self, event: str, **fields: Any) -> None:
        self.writer.append({"event": event, "attempt": self.attempt, **fields})

    def start(self, total: int, resume: int = 0, world_size: int = 2) -> None:
        self.event("start", resume_from=resume, total=total, world_size=world_size, time=self.t0)

    def steps(self, first: int, last: int, loss: float = 3.2141) -> None:
        for k in range(first, last + 1):
            t = self.t0 + k * self.step_s
            self.event("step", step=k, loss=loss, lr=1e-3, tokens=4096, step_s=self.step_s, time=t)

    def checkpoint(self, step: int, ok: bool = True) -> None:
        self.event("checkpoint", step=step, bytes=3_100_000, seconds=0.21, gbps=3_100_000 / 0.21 / 1e9, ok=ok)


def _progress(layout: RunLayout, lines: list[str], clock: Clock, **kw: Any) -> StageProgress:
    return StageProgress(layout, "train", "a1", lines.append, tty=False, interval_s=10.0, clock=clock, **kw)


def test_plain_lines_respect_the_interval_and_compute_rates(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    lines: list[str] = []
    clock = Clock()
    progress = _progress(layout, lines, clock)
    progress.poll()
    assert lines == [], "no metrics file yet: nothing to show"

    train = Train(layout, "a1")
    train.start(total=1000)
    train.steps(1, 1)
    progress.poll()
    # the first step prints at once; with one step the rate comes from its own step_s (0.5 s)
    assert lines == [
        "train: steps 1..1000 on 2 ranks",
        "train: step 1/1000 (0%)  loss 3.214  2 steps/s  8.2k tok/s  ETA 8m20s",
    ]

    clock.now = 9.9
    train.steps(2, 100)
    progress.poll()
    assert len(lines) == 2, "within interval_s of the last line: no new line"

    clock.now = 10.0
    train.steps(101, 120)
    progress.poll()
    # at most one line per poll, for the newest step read; window: steps 101..120, 0.5 s apart -> 2 steps/s,
    # 2 * 4096 tok/s; ETA 880 steps / 2 steps/s = 440 s
    assert lines[2:] == ["train: step 120/1000 (12%)  loss 3.214  2 steps/s  8.2k tok/s  ETA 7m20s"]

    train.checkpoint(120)
    train.checkpoint(120, ok=False)
    progress.poll()
    assert lines[3:] == [
        "train: staged step 120: 3.1 MB in 0.21s (0.0148 GB/s)",
        "train: step 120 NOT saved by every rank (it will not be committed)",
    ], "checkpoint lines do not wait for the interval"


def test_other_attempts_are_ignored(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    old = Train(layout, "a0")
    old.start(total=8)
    old.steps(1, 4, loss=9.0)
    old.checkpoint(4)
    lines: list[str] = []
    clock = Clock()
    progress = _progress(layout, lines, clock)
    progress.poll()
    assert lines == []

    new = Train(layout, "a1", t0=2000.0)
    new.start(total=8, resume=4)
    new.steps(5, 5)
    Train(layout, "a2").steps(8, 8, loss=9.0)  # not ours: its last step would print at once if it were
    progress.poll()
    assert lines == [
        "train: steps 5..8 (resumed from step 4) on 2 ranks",
        "train: step 5/8 (62%)  loss 3.214  2 steps/s  8.2k tok/s  ETA 2s",
    ]


def test_last_step_always_prints_and_close_is_idempotent(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    lines: list[str] = []
    progress = _progress(layout, lines, Clock())
    train = Train(layout, "a1")
    train.start(total=4)
    train.steps(1, 2)
    progress.poll()
    train.steps(3, 4)
    train.event("end", last_step=4, time=1003.0)
    progress.poll()
    assert [line.split("  ")[0] for line in lines] == [
        "train: steps 1..4 on 2 ranks",
        "train: step 2/4 (50%)",
        "train: step 4/4 (100%)",
    ], "the last step prints although interval_s has not passed"
    assert lines[-1].endswith("ETA 0s")
    progress.close()
    progress.close()
    assert len(lines) == 3, "the last step was already shown"


def test_close_shows_where_an_interrupted_attempt_stopped(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    lines: list[str] = []
    progress = _progress(layout, lines, Clock())
    train = Train(layout, "a1")
    train.start(total=8)
    train.steps(1, 2)
    progress.poll()
    train.steps(3, 3)  # written after the last poll, before the job died
    progress.close()
    assert lines[-1].startswith("train: step 3/8 (37%)  loss 3.214")
    progress.close()
    progress.poll()
    assert lines[-1].startswith("train: step 3/8"), "nothing after close"


def test_many_checkpoints_are_summarised_not_listed(tmp_path: Path) -> None:
    """A long run stays quiet: the first FIRST_LINES checkpoints get a line each, later ones one line per
    SUMMARY_EVERY and at most one per interval_s, a failed save always its own line, and the end one line for the
    rest and one for them all."""
    layout = RunLayout(tmp_path)
    lines: list[str] = []
    clock = Clock()
    progress = _progress(layout, lines, clock)  # interval_s=10
    train = Train(layout, "a1")
    train.start(total=400)
    for k in range(1, 101):  # a checkpoint every 4 steps, one poll per checkpoint
        clock.now = 0.5 * k if k <= 60 else 100.0 * k  # 0.5 s apart (the interval rules), then 100 s (the count)
        train.checkpoint(4 * k, ok=k != 50)
        progress.poll()
    train.event("end", last_step=400, time=1200.0)
    progress.close()
    staged = [line for line in lines if line.startswith("train: staged")]
    assert staged[:FIRST_LINES] == [
        f"train: staged step {4 * k}: 3.1 MB in 0.21s (0.0148 GB/s)" for k in range(1, FIRST_LINES + 1)
    ]
    assert staged[FIRST_LINES] == "train: staged steps 16..92 (20 checkpoints): 62.0 MB in 4.20s (0.0148 GB/s)"
    counts = [int(line.split("(")[1].split()[0]) for line in staged[FIRST_LINES:-1]]
    assert counts == [20, 20, 17, 10, SUMMARY_EVERY, 10, 9], staged  # the 9: what was left at the end
    assert staged[-1] == "train: staged 99 checkpoints in all (steps 4..400): 306.9 MB in 20.79s (0.0148 GB/s)"
    assert "train: step 200 NOT saved by every rank (it will not be committed)" in lines
    assert len(lines) == 1 + len(staged) + 1, "the start line, the checkpoint lines and the failed save: no more"


def test_counts_agree_with_their_noun(tmp_path: Path) -> None:
    """A single-rank train is "on 1 rank", not "on 1 ranks" (and every count line uses the same rule)."""
    layout = RunLayout(tmp_path)
    lines: list[str] = []
    progress = _progress(layout, lines, Clock())
    Train(layout, "a1").start(total=4, world_size=1)
    progress.poll()
    assert lines == ["train: steps 1..4 on 1 rank"]
    assert [plural(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]
    assert plural(1, "child", "children") == "1 child" and plural(3, "child", "children") == "3 children"


def test_stages_without_metrics_show_nothing(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    train = Train(layout, "a1")
    train.start(total=4)
    train.steps(1, 4)
    lines: list[str] = []
    progress = StageProgress(layout, "consolidate", "a1", lines.append, tty=False)
    progress.poll()
    progress.close()
    assert lines == []


def test_tty_mode_draws_a_bar_and_prints_lines_through_say(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    stream = io.StringIO()
    lines: list[str] = []
    progress = StageProgress(layout, "train", "a1", lines.append, tty=True, stream=stream)
    train = Train(layout, "a1")
    train.start(total=8)
    train.steps(1, 4)
    train.checkpoint(4)
    progress.poll()
    train.steps(5, 8)
    train.checkpoint(8)
    train.event("end", last_step=8, time=1005.0)
    progress.poll()
    progress.close()
    progress.close()
    assert lines == [
        "train: steps 1..8 on 2 ranks",
        "train: staged step 4: 3.1 MB in 0.21s (0.0148 GB/s)",
        "train: staged step 8: 3.1 MB in 0.21s (0.0148 GB/s)",
    ], "a terminal gets the bar instead of plain progress lines"
    drawn = stream.getvalue()
    assert "8/8" in drawn and "loss 3.214" in drawn and "steps/s" in drawn and "tok/s" in drawn


def test_tty_defaults_to_the_stream_being_a_terminal(tmp_path: Path) -> None:
    progress = StageProgress(RunLayout(tmp_path), "train", "a1", print, stream=io.StringIO())
    assert progress.tty is False


# --- commit lines -----------------------------------------------------------------------------------------------


def test_commit_lines_name_files_and_bytes_and_tolerate_a_missing_manifest(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    step_dir = layout.committed_step(4)
    step_dir.mkdir(parents=True)
    for name, size in (("__0_0.distcp", 2_000_000), ("__1_0.distcp", 1_000_000), (".metadata", 100_000)):
        (step_dir / name).write_bytes(b"x" * size)
    files = tuple(describe(step_dir, n) for n in ("__0_0.distcp", "__1_0.distcp", ".metadata"))
    write_manifest(step_dir, Manifest(files=files, step=4, world_size=2, format="dcp", attempt="v", run_id="r"))
    assert commit_lines(layout, {"committed": [4, 8], "latest": 8}) == [
        "verify_manifest: committed step 4 (3 files, 3.1 MB)",
        "verify_manifest: committed step 8",
    ]
    assert commit_lines(layout, {"committed": [], "latest": 8}) == []
    assert commit_lines(layout, {}) == []


def test_many_commits_are_one_line_after_the_first_few(tmp_path: Path) -> None:
    """A 3,000-step run saved every 4 steps commits 750 steps: FIRST_LINES lines, then one for the rest."""
    layout = RunLayout(tmp_path)
    for step in (4, 3000):  # the other steps' manifests are not read
        step_dir = layout.committed_step(step)
        step_dir.mkdir(parents=True)
        (step_dir / "__0_0.distcp").write_bytes(b"x" * 1_300_000)
        files = (describe(step_dir, "__0_0.distcp"),)
        write_manifest(step_dir, Manifest(files=files, step=step, world_size=1, format="dcp", attempt="v", run_id="r"))
    lines = commit_lines(layout, {"committed": list(range(4, 3001, 4)), "latest": 3000})
    assert FIRST_LINES == 3 and lines == [
        "verify_manifest: committed step 4 (1 file, 1.3 MB)",
        "verify_manifest: committed step 8",
        "verify_manifest: committed step 12",
        "verify_manifest: committed steps 16..3000 (747 more, 750 in all; step 3000: 1 file, 1.3 MB)",
    ]


# --- a real train -----------------------------------------------------------------------------------------------


def _cli(root: Path, *extra: str) -> None:
    proc = run_cli("+experiment=tiny", f"run.root={root}", "run.id=m", "strategy.world_size=1", *extra)  # 1 rank
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _attempt_events(layout: RunLayout, attempt: str) -> dict[str, list[dict[str, Any]]]:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in MetricsTail(layout.metrics).read():
        if e["attempt"] == attempt:
            by_kind.setdefault(e["event"], []).append(e)
    return by_kind


@pytest.mark.slow
@pytest.mark.distributed
def test_train_appends_events_across_attempts(tmp_path: Path) -> None:
    """Train stopped after step 4, then resumed: each attempt's events carry its record's attempt, and the
    second attempt appends to the first's lines."""
    layout = RunLayout.for_run(tmp_path, "tiny", "m")
    _cli(tmp_path, "run.create=true", "train.stop_after_step=4", "export=none")  # step 4 is committed
    first = read_json(layout.stage_record("train"))["attempt"]
    before = layout.metrics.read_bytes()
    _cli(tmp_path, "stage=train")  # resumes from step 4
    second = read_json(layout.stage_record("train"))["attempt"]
    assert first != second
    assert layout.metrics.read_bytes().startswith(before), "a rerun appends; it never rewrites the file"

    all_events = MetricsTail(layout.metrics).read()
    assert {e["attempt"] for e in all_events} == {first, second}
    steps = [e["step"] for e in all_events if e["event"] == "step"]
    assert steps == list(range(1, 9))
    for attempt, resume, total, saved in ((first, 0, 4, [4]), (second, 4, 8, [8])):
        ev = _attempt_events(layout, attempt)
        assert [(e["resume_from"], e["total"], e["world_size"]) for e in ev["start"]] == [(resume, total, 1)]
        assert [e["step"] for e in ev["step"]] == list(range(resume + 1, total + 1))
        for e in ev["step"]:
            assert e["tokens"] > 0 and e["step_s"] > 0 and e["loss"] > 0 and e["lr"] > 0
        times = [e["time"] for e in ev["start"] + ev["step"] + ev["end"]]
        assert times == sorted(times)
        assert [e["step"] for e in ev["checkpoint"]] == saved
        assert all(e["ok"] and e["bytes"] > 0 and e["seconds"] > 0 for e in ev["checkpoint"])
        assert [e["last_step"] for e in ev["end"]] == [total]

    # the losses in the metrics are the global batch's, the same number train logs (the record carries none)
    losses = [e["loss"] for e in _attempt_events(layout, second)["step"]]
    assert len(losses) == 4 and all(isinstance(v, float) and v > 0 for v in losses)
    assert "losses" not in read_json(layout.stage_record("train"))["summary"], "the record is no copy of metrics"

    # the console view replays the second attempt
    lines: list[str] = []
    progress = StageProgress(layout, "train", second, lines.append, tty=False, interval_s=3600)
    progress.close()
    assert len(lines) == 3, lines
    assert lines[0] == "train: steps 5..8 (resumed from step 4) on 1 rank"
    assert lines[1].startswith("train: step 8/8 (100%)  loss ") and "steps/s" in lines[1]
    assert lines[2].startswith("train: staged step 8: ") and lines[2].endswith(" GB/s)")


def test_a_missing_committer_is_said_on_the_console(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    lines: list[str] = []
    progress = _progress(layout, lines, Clock())
    train = Train(layout, "a1")
    train.start(total=100)
    train.checkpoint(10)
    train.event("no_committer", step=10)
    progress.poll()
    assert "train: NO COMMITTER IS RUNNING: step 10 is staged, nothing commits it" in lines, lines
