"""What the launching process shows while a stage runs: train's progress, read from ``<run>/metrics.jsonl``.

Train runs as a separate job (local processes or SLURM nodes), so its rank 0 appends events to the metrics
file (:mod:`pipeline.storage.metrics`) and the launching process tails it from its wait loop, calling
:meth:`StageProgress.poll` between job-state checks and :meth:`StageProgress.close` when the job ends.

On a terminal: a tqdm bar with step/total, loss, steps/s, tokens/s and ETA, the rates taken from the events'
own times over the last :data:`WINDOW` steps (the poll interval would make tqdm's own rate jumpy). Elsewhere
(SLURM logs, CI): one plain line at most every ``interval_s`` seconds, and always one at the last step.

Checkpoints stay quiet on a long run: the first :data:`FIRST_LINES` staged checkpoints get a line each, later ones
one summary line per :data:`SUMMARY_EVERY` and at most one every ``interval_s`` seconds (the steps, bytes and rate
since the last line), and the end of the job one for the rest and one for all of them; a checkpoint not saved
by every rank always gets its own line. :func:`commit_lines` does the same for verify-manifest's commits
(reported when it ends): the first :data:`FIRST_LINES` commits, then one line for the rest.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from pipeline.checkpoint.manifest import read_manifest
from pipeline.errors import PipelineError, plural
from pipeline.rundir.layout import RunLayout
from pipeline.storage.metrics import MetricsTail

WINDOW = 20
"""Steps over which steps/s and tokens/s are measured."""

FIRST_LINES = 3
"""Staged checkpoints (and commits) shown one line each before they are summarised."""

SUMMARY_EVERY = 10
"""Later staged checkpoints: one line per this many, and at most one per ``interval_s``."""


def format_bytes(n: float) -> str:
    """Decimal units, like the GB/s beside them: ``3.1 MB``."""
    if n < 1000:
        return f"{int(n)} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if n < 999.95 or unit == "TB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def format_duration(seconds: float | None) -> str:
    """``45s``, ``6m21s``, ``1h02m``, ``2d03h``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_count(n: float) -> str:
    """``950``, ``9.5k``, ``12.3M``, ``1.2G``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def format_number(x: float) -> str:
    """Three significant digits without an exponent for ordinary values: ``2.31``, ``0.015``, ``1234``."""
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _step_content(layout: RunLayout, step: int) -> str | None:
    """``3 files, 1.3 MB`` from a committed step's manifest; None if it cannot be read (a report, not a check)."""
    try:
        manifest = read_manifest(layout.committed_step(step))
    except (PipelineError, OSError, ValueError):
        return None
    return f"{plural(len(manifest.files), 'file')}, {format_bytes(sum(f.size for f in manifest.files))}"


def commit_lines(layout: RunLayout, summary: dict[str, Any]) -> list[str]:
    """What verify-manifest committed (its stage record's ``summary["committed"]``): a line for each of the first
    :data:`FIRST_LINES` steps, then one for the rest (a 3,000-step run saved every 4 steps commits 750)."""
    steps = [int(s) for s in summary.get("committed") or []]
    lines = []
    for step in steps[:FIRST_LINES]:
        content = _step_content(layout, step)
        lines.append(f"verify_manifest: committed step {step}" + (f" ({content})" if content else ""))
    rest = steps[FIRST_LINES:]
    if rest:
        last = _step_content(layout, rest[-1])
        which = f"steps {rest[0]}..{rest[-1]}" if len(rest) > 1 else f"step {rest[0]}"
        lines.append(
            f"verify_manifest: committed {which} ({len(rest)} more, {len(steps)} in all"
            + (f"; step {rest[-1]}: {last})" if last else ")")
        )
    return lines


class _SavedSpan:
    """Checkpoints staged over a span of steps: how many, their bytes and write time."""

    def __init__(self) -> None:
        self.count, self.bytes, self.seconds = 0, 0, 0.0
        self.first: int | None = None
        self.last: int | None = None

    def add(self, step: int, size: int, seconds: float) -> None:
        self.count, self.bytes, self.seconds = self.count + 1, self.bytes + size, self.seconds + seconds
        self.first = step if self.first is None else self.first
        self.last = step

    def text(self) -> str:
        gbps = format_number(self.bytes / self.seconds / 1e9) if self.seconds > 0 else "?"
        return f"{format_bytes(self.bytes)} in {self.seconds:.2f}s ({gbps} GB/s)"

    def steps(self) -> str:
        return f"step {self.first}" if self.first == self.last else f"steps {self.first}..{self.last}"


class StageProgress:
    """Show one attempt of one stage from its metrics events (only train writes any; other stages show nothing).

    ``say`` prints a line (the launcher's output); ``clock`` and ``stream`` are for tests.
    """

    def __init__(
        self,
        layout: RunLayout,
        stage: str,
        attempt: str,
        say: Callable[[str], None],
        *,
        tty: bool | None = None,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        stream: IO[str] | None = None,
    ) -> None:
        self.stage, self.attempt = stage, attempt
        self.say = say
        self.interval_s = interval_s
        self.clock = clock
        self.stream = stream if stream is not None else sys.stdout
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        from pipeline.stages import get_stage  # noqa: PLC0415 - a launch shows progress; status imports no stage

        self._tail = MetricsTail(layout.metrics) if get_stage(stage).CONTRACT.reports_progress else None
        self._bar: Any = None  # a tqdm bar (the app's extra; imported when a bar is drawn)
        self._window: deque[tuple[int, float, int]] = deque(maxlen=WINDOW)  # (step, time, tokens)
        self._total: int | None = None
        self._resume = 0
        self._step: int | None = None
        self._loss: float | None = None
        self._step_s: float | None = None
        self._printed_step: int | None = None
        self._printed_at: float | None = None
        self._saved = _SavedSpan()  # every checkpoint staged in this attempt
        self._unshown = _SavedSpan()  # staged since the last checkpoint line
        self._saved_shown_at: float | None = None
        self._closed = False

    def poll(self) -> None:
        if self._tail is None or self._closed:
            return
        for event in self._tail.read():
            if event.get("attempt") != self.attempt:
                continue
            try:
                self._handle(event)
            except (KeyError, TypeError, ValueError):  # a malformed event is skipped, never fatal to the launcher
                continue
        self._show_progress()

    def close(self) -> None:
        if self._closed:
            return
        self.poll()  # the job has ended: its last events are on disk
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._step is not None and self._printed_step != self._step:
            self._line(self.progress_line())
        if self._saved.count > FIRST_LINES:  # the checkpoints not shown yet, then all of them
            if self._unshown.count:
                self._show_unshown()
            self._line(
                f"{self.stage}: staged {plural(self._saved.count, 'checkpoint')} in all "
                f"({self._saved.steps()}): {self._saved.text()}"
            )

    # --- events -------------------------------------------------------------------------------------------------

    def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "step":
            self._on_step(event)
            return
        self._show_progress()  # lines stay in the order of the events
        if kind == "start":
            self._total, self._resume = int(event["total"]), int(event["resume_from"])
            self._window.clear()
            resumed = f" (resumed from step {self._resume})" if self._resume else ""
            world = event.get("world_size")
            ranks = plural(world, "rank") if isinstance(world, int) else "? ranks"
            self._line(f"{self.stage}: steps {self._resume + 1}..{self._total}{resumed} on {ranks}")
            if self.tty:
                self._open_bar()
        elif kind == "checkpoint":
            step = int(event["step"])
            if event.get("ok", True):
                self._on_saved(step, int(event["bytes"]), float(event["seconds"]), float(event["gbps"]))
            else:
                self._line(f"{self.stage}: step {step} NOT saved by every rank (it will not be committed)")
        elif kind == "no_committer":
            self._line(f"{self.stage}: NO COMMITTER IS RUNNING: step {event['step']} is staged, nothing commits it")

    def _on_saved(self, step: int, size: int, seconds: float, gbps: float) -> None:
        """A line each for the first :data:`FIRST_LINES` checkpoints; later, one line for those staged since the
        last one, once there are :data:`SUMMARY_EVERY` of them and ``interval_s`` has passed (a 3,000-step run
        saved every 4 steps stages 750)."""
        self._saved.add(step, size, seconds)
        now = self.clock()
        if self._saved.count <= FIRST_LINES:
            self._line(
                f"{self.stage}: staged step {step}: {format_bytes(size)} in {seconds:.2f}s ({format_number(gbps)} GB/s)"
            )
            self._saved_shown_at = now
            return
        self._unshown.add(step, size, seconds)
        due = self._saved_shown_at is None or now - self._saved_shown_at >= self.interval_s
        if due and self._unshown.count >= SUMMARY_EVERY:
            self._show_unshown()
            self._saved_shown_at = now

    def _show_unshown(self) -> None:
        span, self._unshown = self._unshown, _SavedSpan()
        self._line(f"{self.stage}: staged {span.steps()} ({plural(span.count, 'checkpoint')}): {span.text()}")

    def _on_step(self, event: dict[str, Any]) -> None:
        step = int(event["step"])
        self._step, self._loss = step, float(event["loss"])
        self._step_s = float(event["step_s"]) if "step_s" in event else None
        self._window.append((step, float(event["time"]), int(event.get("tokens", 0))))
        if self._bar is not None:
            self._bar.set_postfix_str(self._stats(), refresh=False)
            self._bar.update(step - self._bar.n)

    def _show_progress(self) -> None:
        """Plain mode: a line for the newest step read, if ``interval_s`` passed since the last one or it is the
        last step."""
        if self._bar is not None or self._step is None or self._step == self._printed_step:
            return
        now = self.clock()
        due = self._printed_at is None or now - self._printed_at >= self.interval_s
        if due or self._step == self._total:
            self._line(self.progress_line())
            self._printed_step, self._printed_at = self._step, now

    # --- view ---------------------------------------------------------------------------------------------------

    def rates(self) -> tuple[float | None, float | None]:
        """(steps/s, tokens/s) over the window; from the one step's own time while there is only one."""
        if len(self._window) >= 2:
            (s0, t0, _), (s1, t1, _) = self._window[0], self._window[-1]
            if t1 > t0 and s1 > s0:
                tokens = sum(tok for _, _, tok in list(self._window)[1:])
                return (s1 - s0) / (t1 - t0), tokens / (t1 - t0)
        if self._window and self._step_s:
            return 1 / self._step_s, self._window[-1][2] / self._step_s
        return None, None

    def eta_s(self) -> float | None:
        steps_per_s, _ = self.rates()
        if steps_per_s is None or self._total is None or self._step is None:
            return None
        return max(0, self._total - self._step) / steps_per_s

    def _stats(self) -> str:
        steps_per_s, tokens_per_s = self.rates()
        parts = [f"loss {self._loss:.4g}"] if self._loss is not None else []
        if steps_per_s is not None and tokens_per_s is not None:
            parts += [f"{format_number(steps_per_s)} steps/s", f"{format_count(tokens_per_s)} tok/s"]
        parts.append(f"ETA {format_duration(self.eta_s())}")
        return "  ".join(parts)

    def progress_line(self) -> str:
        """``train: step 120/1000 (12%)  loss 3.214  2.31 steps/s  9.5k tok/s  ETA 6m21s``."""
        if self._total:
            where = f"step {self._step}/{self._total} ({100 * (self._step or 0) // self._total}%)"
        else:
            where = f"step {self._step}"
        return f"{self.stage}: {where}  {self._stats()}"

    def _open_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
        from tqdm import tqdm  # noqa: PLC0415 - only the app draws a bar

        self._bar = tqdm(
            total=self._total,
            initial=self._resume,
            desc=self.stage,
            unit="step",
            file=self.stream,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}",
        )

    def _line(self, text: str) -> None:
        if self._bar is None:
            self.say(text)
            return
        from tqdm import tqdm  # noqa: PLC0415

        with tqdm.external_write_mode(file=self.stream):  # clear the bar, print, redraw it
            self.say(text)
