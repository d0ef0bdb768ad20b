"""Two committers on one run, each through its own FUSE mount of one shared filesystem: one contention trial.

Used by ``tests/test_two_committers.py`` (a few dozen trials) and as a stress script on a running shared
filesystem: ``python -m tests.contention --trials 200`` (it starts its own, see ``tests/sharedfs.py``).

A trial stages steps 2, 4, 6, 8 (two ranks each) through mount 0, then starts two committers at one instant,
one per mount, with retention ``keep_last=2``. ``leased``: each takes the committer lease first (the loser is
refused or fenced); otherwise neither has one, which is what a ghost does in the window between its last fence
and its act. Either way the trial holds only if every step was published once, from its one attempt, the
reader's ``latest`` never went back, and nothing committed was deleted or quarantined wrongly.

The lease-less mode (``--unleased``; not in the suite) makes both committers perform every act at once, which a
real ghost does at most once. A directory commits as a bucket does, by a manifest written last, after the step
was moved into place with the ranks' finished files only: no committer writes into a directory another mount
renames (SeaweedFS's FUSE mount can lose the entry then). Where two mounts rename onto one name at the same
instant and one temp file is lost, the other's identical bytes landed, and that counts as written. A committer
whose mount shows another's commit half (``latest`` moved, the manifest not visible yet) looks again before it
calls that damage. (A manifest made by ``link`` instead fails worse here: a hard link made through one mount, its
first name removed, cannot be opened through the other.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import tests.conftest  # noqa: F401  (registers TEST_FORMAT)
from pipeline.checkpoint.manifest import complete_markers, read_latest, read_manifest, read_newest, step_markers
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer, CommitterBusy, CommitterLost
from pipeline.checkpoint.stores.repair import step_entries
from pipeline.errors import VerificationError
from pipeline.rundir.layout import RunLayout
from pipeline.storage.backend import POSIX
from tests.seed_helpers import stage_rank
from tests.sharedfs import SharedFS, shared_filesystem

STEPS = (2, 4, 6, 8)
ATTEMPT = "a1"


@dataclass
class Observed:
    """What a reader on mount 1 saw while the committers ran."""

    newest: list[int] = field(default_factory=list)
    manifests: dict[int, set[str]] = field(default_factory=dict)


def layouts(fs: SharedFS, name: str) -> tuple[RunLayout, RunLayout]:
    return RunLayout(fs.path(0, name)), RunLayout(fs.path(1, name))


def wait_visible(path: Path, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} not visible through its mount after {timeout_s} s")
        time.sleep(0.01)


def stage(layout: RunLayout, steps: tuple[int, ...] = STEPS) -> None:
    for d in layout.checkpoint_dirs():
        d.mkdir(parents=True, exist_ok=True)
    for step in steps:
        for rank in range(2):
            stage_rank(layout, step, rank, world=2, attempt=ATTEMPT)


def _observe(layout: RunLayout, seen: Observed, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            newest = read_newest(layout)
            if newest is not None:
                seen.newest.append(newest.step)
            for step, path in step_entries(POSIX, layout.checkpoints):
                if POSIX.kind(path / "manifest.json") == "file":
                    seen.manifests.setdefault(step, set()).add((path / "manifest.json").read_text())
        except (VerificationError, OSError):
            pass  # a pointer caught mid-retention names a step just retired: not a regression
        time.sleep(0.005)


def _passes(c: Committer, n: int = 3) -> None:
    """What a following committer does: a pass, and another while staged steps remain (a lost race)."""
    for _ in range(n):
        c.commit_ready()
        if not c.pending():
            return


def trial(fs: SharedFS, leased: bool) -> list[str]:
    """One trial; returns what went wrong (nothing: an empty list)."""
    a, b = layouts(fs, f"contend/{uuid.uuid4().hex[:10]}")
    stage(a)
    wait_visible(b.staged_step(STEPS[-1]) / "rank_1.done.json")
    policy = CommitPolicy(world_size=2, keep_last=2, lease_s=2.0, marker_deadline_s=10.0)
    barrier = threading.Barrier(2)
    outcome: dict[str, str] = {}

    def run(name: str, layout: RunLayout) -> None:
        c = Committer(layout, policy)
        barrier.wait()
        try:
            if leased:
                with c.hold():
                    c.recover()
                    _passes(c)
            else:
                _passes(c)
            outcome[name] = "ran"
        except (CommitterBusy, CommitterLost) as e:
            outcome[name] = f"refused: {e}"
        except Exception as e:  # noqa: BLE001 (reported as the trial's failure)
            where = traceback.extract_tb(e.__traceback__)[-3:]
            outcome[name] = f"FAILED: {type(e).__name__}: {e} at {[f'{f.name}:{f.lineno}' for f in where]}"

    seen = Observed()
    stop = threading.Event()
    watcher = threading.Thread(target=_observe, args=(b, seen, stop))
    watcher.start()
    threads = [threading.Thread(target=run, args=(n, lay)) for n, lay in (("A", a), ("B", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    time.sleep(0.05)
    stop.set()
    watcher.join()
    try:
        _passes(Committer(a, policy), 1)  # the next pass of whichever committer lives on repairs a lagging latest
        return _problems(a, outcome, seen)
    except (VerificationError, OSError) as e:
        return [f"after the trial: {type(e).__name__}: {e}"]


def _problems(layout: RunLayout, outcome: dict[str, str], seen: Observed) -> list[str]:
    # SeaweedFS's FUSE mount can answer EIO to one of two renames of one directory raced from two mounts: that
    # committer fails its pass in one line (a following committer looks again), and the state checks below hold.
    failed = {n: o for n, o in outcome.items() if o.startswith("FAILED") and "[Errno 5]" not in o}
    problems = [f"committer {n}: {o}" for n, o in sorted(failed.items())]
    if not any(o == "ran" for o in outcome.values()):
        problems.append(f"no committer ran: {outcome}")
    published = {s: read_manifest(p).attempt for s, p in step_entries(POSIX, layout.checkpoints)}
    # keep_last=2 keeps 6 and 8; an older step whose retirement raced the other committer's waits for the next
    # commit's retention (kept a while longer is harmless; deleted wrongly is not).
    if not {6, 8} <= published.keys() or set(published.values()) != {ATTEMPT}:
        problems.append(f"published {published}, expected steps 6 and 8 (keep_last=2) of attempt {ATTEMPT}")
    latest = read_latest(layout)
    if latest is None or latest.step != 8:
        problems.append(f"latest is {latest}, expected step 8")
    for step, path in step_entries(POSIX, layout.staging):
        # A complete step left unpublished would be a lost step. What a raced directory rename of the FUSE
        # filesystem leaves behind (a partial copy of a step published and retired since) is litter.
        if complete_markers(step_markers(path, step, 2), None) is not None and step not in published:
            problems.append(f"step {step} left complete in staging, unpublished: {sorted(os.listdir(path))}")
    if POSIX.list(layout.quarantine):
        problems.append(f"quarantined: {POSIX.list(layout.quarantine)}")
    if any(x > y for x, y in zip(seen.newest, seen.newest[1:], strict=False)):
        problems.append(f"a reader's latest went back: {seen.newest}")
    twice = {s: len(m) for s, m in seen.manifests.items() if len(m) > 1}
    if twice:
        problems.append(f"steps published with different manifests: {twice}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.contention", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=200, help="trials per mode")
    p.add_argument("--unleased", action="store_true", help="also the lease-less mode (see the module docstring)")
    args = p.parse_args()
    failed = 0
    modes = (True, False) if args.unleased else (True,)
    with tempfile.TemporaryDirectory(prefix="contention-") as tmp, shared_filesystem(Path(tmp)) as fs:
        for leased in modes:
            for i in range(args.trials):
                problems = trial(fs, leased)
                failed += bool(problems)
                for line in problems:
                    print(f"trial {i} ({'leased' if leased else 'unleased'}): {line}")
        print(f"{len(modes) * args.trials} trials, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
