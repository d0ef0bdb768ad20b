"""Concurrent launches of one run: exactly one proceeds, the others refuse in one line, no work is done twice.

Two kinds of trial:

* **mixed**: K launches of the finished base run, a mix of a plain continuation (``run.id=base``), a restart
  (``run.overwrite=true``) and a one-stage rerun (``stage=consolidate force=true``). To make them meet at the
  lease at the same moment, the test holds ``.lease.lock`` while they start and lets go once every one of them
  is waiting on it: they all take the lock within milliseconds of each other.
* **double submit**: ``+experiment=tiny run.id=X run.create=true run.overwrite=true`` twice at once, for a run
  that does not exist yet (no lock trick: the run dir is not there to hold).

In each trial one launch at a time owns the run (prints ``run <id>:`` and exits 0): no two owners overlap (a
waiter may proceed once the owner has ended: a no-op continuation ends within a waiter's 10 s of patience);
every other launch exits 2 with one line on stderr naming an owner ("owned by another launch"), and no
traceback. The job folders created under ``logs/`` are exactly the jobs the owners reported (no duplicate
work), each stage record names one of them,
and the run verifies afterwards (latest = step 8 with its export; a non-overwriting winner loses no committed
step).

Figure: launches N, proceeded exactly one in each of M trials, refusals one-line.
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import read_json
from tests.reliability.conftest import record, sized
from tests.reliability.harness import (
    BASE_ID,
    BASE_STEPS,
    Launch,
    base_run,
    check_run,
    committed,
    job_ids,
    launch,
    launcher_faults,
    leftovers,
    seeded_rng,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.distributed]

VARIANTS: dict[str, tuple[str, ...]] = {
    "continue": (),
    "overwrite": ("run.overwrite=true",),
    "consolidate": ("stage=consolidate", "force=true"),
}
LOCK_PATIENCE_S = 7.0
"""Let go of the lock at the latest this long after the first launch began to wait (each waits 10 s for it)."""
JOB_LINE = re.compile(r"^\s+(\w+): job (\d+), logs ", re.MULTILINE)


@dataclass
class Outcome:
    launches: int = 0
    exactly_one: bool = False
    refusals_one_line: bool = True
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _opened_lock(proc: Launch, lock: Path) -> bool:
    try:
        return any(f.path == str(lock) for f in psutil.Process(proc.pid).open_files())
    except psutil.Error:
        return False


def _owned(layout: RunLayout, launches: list[Launch]) -> dict[int, tuple[float, float]]:
    """Wait for every launch; per pid, when it announced that it owns the run (``run <id>:``, printed once its
    lease is taken) and when it ended (polled every 20 ms)."""
    since: dict[int, float] = {}
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 300
    while len(ended) < len(launches):
        now = time.monotonic()
        for one in launches:
            if one.pid not in since and f"run {layout.run_id}:" in one.stdout:
                since[one.pid] = now
            if one.pid not in ended and not one.running():
                ended[one.pid] = now
        if now > deadline:
            for one in launches:
                one.wait(1)  # names and kills the one still running
        time.sleep(0.02)
    return {pid: (since[pid], ended[pid]) for pid in since}


def _judge(layout: RunLayout, launches: list[Launch], jobs_before: set[tuple[str, str]]) -> Outcome:
    out = Outcome(launches=len(launches))
    owned = _owned(layout, launches)
    proceeded = [one for one in launches if one.proc.returncode != 2]
    refused = [one for one in launches if one.proc.returncode == 2]
    # One owner at a time: a launch may proceed once the one before it has ended (a no-op continuation ends
    # within a waiter's 10 s of patience), never while another owns the run.
    spans = sorted(owned.get(one.pid, (0.0, 0.0)) for one in proceeded)
    # 1 s of slack: an owner lets go of its lease just before its process ends; two real owners overlap longer
    overlap = any(b[0] < a[1] - 1.0 for a, b in zip(spans, spans[1:], strict=False))
    out.exactly_one = len(proceeded) == 1
    if overlap or not proceeded:
        out.problems.append(
            f"{len(proceeded)} of {len(launches)} launches proceeded, "
            f"{'at the same time' if overlap else 'none'}:\n" + "\n".join(p.output for p in proceeded)
        )
    elif len(proceeded) > 1:
        out.notes.append(f"{len(proceeded)} launches proceeded one after another (each after the last had ended)")
    for one in launches:
        out.problems += launcher_faults(one, one_line_error=one in refused)
    for one in refused:
        err = one.stderr.strip()
        if len(err.splitlines()) != 1 or "owned by another launch" not in err or f"run {layout.run_id}:" in one.stdout:
            out.refusals_one_line = False
            out.problems.append(f"refusal is not one line naming the owner:\n{one.output}")
    if proceeded:  # one owner, or owners one after another: each launch's jobs are its own
        for one in proceeded:
            if one.proc.returncode != 0:
                out.problems.append(f"a launch that proceeded failed:\n{one.output}")
        pids = {f"pid {one.pid} on " for one in proceeded}
        if refused and not any(p in one.stderr for one in refused for p in pids):
            out.problems.append(f"no refusal names an owner ({sorted(pids)})")
        reported = {(m[1], m[2]) for one in proceeded for m in JOB_LINE.finditer(one.stdout)}
        new = job_ids(layout) - jobs_before
        if new != reported:
            out.problems.append(f"job folders {sorted(new)} are not the owners' jobs {sorted(reported)}")
        for stage in {st for st, _ in reported}:
            rec = read_json(layout.stage_record(stage)) if layout.stage_record(stage).exists() else {}
            if (stage, str(rec.get("job_id"))) not in reported:
                out.problems.append(f"stages/{stage}.json names job {rec.get('job_id')}, none of the owners'")
    return out


def _mixed_trial(i: int, rng: random.Random, tmp_path: Path) -> Outcome:
    root, logs = tmp_path / f"m{i}", tmp_path / "console"
    layout = base_run(root, logs)
    before, jobs_before = committed(layout), job_ids(layout)
    k = 3 if i == 0 else rng.randint(2, 5)
    names = list(VARIANTS) if i == 0 else [rng.choice(list(VARIANTS)) for _ in range(k)]
    rng.shuffle(names)
    lock = layout.lease_lock
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        launches = [launch(root, BASE_ID, *VARIANTS[name], logs=logs) for name in names]
        waiting: dict[int, float] = {}  # pid -> when it was first seen waiting on the lock
        deadline = time.monotonic() + 120
        while len(waiting) < len(launches) and time.monotonic() < deadline:
            now = time.monotonic()
            waiting |= {one.pid: now for one in launches if one.pid not in waiting and _opened_lock(one, lock)}
            if waiting and now - min(waiting.values()) > LOCK_PATIENCE_S:
                break
            if not all(one.running() for one in launches):
                break
            time.sleep(0.02)
        met = len(waiting) == len(launches)
    finally:
        os.close(fd)  # let them all at the lease at once
    out = _judge(layout, launches, jobs_before)
    out.notes.append(f"mixed trial {i}: {'all' if met else 'NOT all'} {k} launches were waiting on the lock")
    # owners may follow one another (each after the last ended): any of them that overwrote replaced the steps
    winners = [(n, one) for n, one in zip(names, launches, strict=True) if one.proc.returncode != 2]
    overwrote = any("run.overwrite=true" in one.args for _, one in winners)
    print(f"mixed trial {i}: {names}; proceeded: {[n for n, _ in winners]}")
    out.problems += check_run(layout, None if overwrote else before, final_step=BASE_STEPS)
    out.problems += leftovers(layout.run_dir)
    return out


def _double_submit_trial(i: int, tmp_path: Path) -> Outcome:
    root, logs = tmp_path / f"d{i}", tmp_path / "console"
    run_id = f"double{i}"
    layout = RunLayout.for_run(root, "tiny", run_id)
    launches = [launch(root, run_id, "run.overwrite=true", logs=logs, create=True) for _ in range(2)]
    out = _judge(layout, launches, set())
    print(f"double submit {i}: exits {[one.proc.returncode for one in launches]}")
    out.problems += check_run(layout, final_step=BASE_STEPS)
    out.problems += leftovers(layout.run_dir)
    return out


def test_concurrent_launches_of_one_run_exactly_one_proceeds(tmp_path: Path) -> None:
    rng, seed = seeded_rng("concurrent")
    t0 = time.monotonic()
    outcomes = [_mixed_trial(i, rng, tmp_path) for i in range(sized(ci=1, large=10))]
    outcomes += [_double_submit_trial(i, tmp_path) for i in range(sized(ci=1, large=5))]
    launches = sum(o.launches for o in outcomes)
    exact = sum(o.exactly_one for o in outcomes)
    one_line = all(o.refusals_one_line for o in outcomes)
    problems = [p for o in outcomes for p in o.problems]
    figure = (
        f"launches {launches}, proceeded exactly one in {exact} of {len(outcomes)} trials, "
        f"refusals {'one-line' if one_line else 'NOT one-line'}"
    )
    notes = [f"seed {seed}, {len(outcomes)} trials in {time.monotonic() - t0:.0f}s", *problems]
    notes += [n for o in outcomes for n in o.notes]
    record("concurrent launches of one run", figure, ok=not problems, notes=notes)
    assert not problems, "\n\n".join(problems)
