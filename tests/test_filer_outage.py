"""The real filesystem misbehaves too (issue 48, "What to build" 6; finding 4): a library run saves through one FUSE
mount of SeaweedFS and ``python -m pipeline.commit --follow`` commits through another mount of the same filer,
while the filer's server is killed (SIGKILL) and restarted on the same ports and data dir, three times:

1. killed while a save is in flight, back 3 s later;
2. the committer SIGKILLed, the server killed, and a new committer started while it is down, back 4 s later;
3. killed while a save is in flight, back 14 s later: past the FUSE client's ~13 s of retries, so the save's
   metadata operations (``mkdir`` of the staging dir, the marker) fail with ``EIO`` rather than wait.

Training goes on through every outage: a save that fails says so in one line per rank (``ok=False`` on every
rank, no traceback, no crashed job); ``latest`` read through the committer's mount never goes back; nothing in
``checkpoints/quarantine/`` verifies; the run ends (exit 0) with ``latest`` at its last step, which verifies.
The harness (kill, restart, what the mounts do meanwhile) is ``tests/filer_outages.py``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.checkpoint.manifest import complete_markers, step_markers, verify_committed
from pipeline.checkpoint.protocol.step_checks import verified_manifest
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.errors import PipelineError, ReadFailed, VerificationError
from pipeline.storage.layout import CheckpointLayout
from tests.filer_outages import FilerWithOutages, filer_with_outages
from tests.sharedfs import skip_reason

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WORLD = 2
WAIT_S = 90.0
"""Bound on each wait for the run to make progress (a loaded 2-core machine, three workers)."""


def _skip_without_fuse() -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


class RunStopped(Exception):
    """A wait of the scenario that cannot end: what it waits for is gone (the training run exited)."""


def _wait(
    what: str,
    done: Callable[[], Any],
    timeout_s: float = WAIT_S,
    interval_s: float = 0.02,
    gone: Callable[[], str | None] = lambda: None,
) -> Any:
    """``done()`` once it is true; TimeoutError after ``timeout_s``; RunStopped as soon as ``gone()`` says why."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = done()
        if got:
            return got
        why = gone()
        if why is not None:
            raise RunStopped(f"{what}: {why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not in {timeout_s:.0f} s")
        time.sleep(interval_s)


def _errname(e: BaseException) -> str:
    """``EIO``, ``ENOTCONN``, ... for an OSError anywhere in ``e``'s chain, else the exception's type."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return errno.errorcode.get(seen.errno, str(seen.errno))
        seen = seen.__cause__ or seen.__context__
    return type(e).__name__


# -- the harness on its own ------------------------------------------------------------------------------------


def test_the_mounts_come_back_by_themselves_after_the_server_is_killed_and_restarted(tmp_path: Path) -> None:
    """No remount: both FUSE clients (the same processes, the same mounts) serve again after the restart (~1-3 s;
    up to ~30 s of EIO on reads when a mount looked a volume up before the volume server registered: see
    ``tests/filer_outages.py``); what was written before reads back whole; what one writes after, the other
    sees. A read begun while the server is down either waits for it or fails with EIO (never a wrong byte)."""
    _skip_without_fuse()
    with filer_with_outages(tmp_path / "sfs") as filer:
        fs = filer.fs
        body = os.urandom(3 * 1024 * 1024 + 5)
        fs.path(0, "d").mkdir()
        fs.path(0, "d/before").write_bytes(body)
        devs = [os.stat(m).st_dev for m in fs.mounts]
        filer.kill()
        during: dict[str, str] = {}

        def read(i: int, name: str) -> None:
            t0 = time.monotonic()
            try:
                ok = fs.path(i, name).read_bytes() == body
                during[f"mount{i} {name}"] = f"{'whole' if ok else 'WRONG BYTES'} after {time.monotonic() - t0:.1f} s"
            except OSError as e:
                during[f"mount{i} {name}"] = f"{_errname(e)} after {time.monotonic() - t0:.1f} s"

        readers = [threading.Thread(target=read, args=(i, "d/before"), daemon=True) for i in (0, 1)]
        for t in readers:
            t.start()
        time.sleep(3.0)
        serving = filer.restart()
        t0 = time.monotonic()
        after: list[str] = []  # a read may still fail for a moment after the server serves again

        def whole(i: int) -> bool:
            try:
                return fs.path(i, "d/before").read_bytes() == body
            except OSError as e:
                after.append(f"mount{i} {_errname(e)} at +{time.monotonic() - t0:.1f} s")
                return False

        for i in (0, 1):
            assert _wait(f"mount {i} reads again", lambda i=i: whole(i), 60, interval_s=0.1)
        back = time.monotonic() - t0
        fs.path(0, "d/after").write_bytes(b"after")
        assert _wait("mount 1 sees a file written through mount 0", lambda: fs.path(1, "d/after").exists(), 10)
        assert fs.path(1, "d/after").read_bytes() == b"after"
        for t in readers:
            t.join(30)
        assert not [k for k, v in during.items() if "WRONG" in v], during
        assert [os.stat(m).st_dev for m in fs.mounts] == devs, "the mounts are the same (no remount)"
        assert all(_pid_alive(p) for p in fs.pids[1:]), "the FUSE clients survived the outage"
        print(f"serving {serving:.1f} s after the restart; both mounts read {back:.1f} s later ({len(after)} failed "
              f"reads meanwhile, the last {after[-1:]}); reads begun while down: {during}")  # fmt: skip


def _pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# -- the library run through outages ---------------------------------------------------------------------------


class LatestPoller(threading.Thread):
    """Reads ``latest`` through one mount every 0.1 s (as a resuming reader would: ``newest``) and verifies each
    step it names for the first time. Read failures are counted (an outage), never violations; a reader's step
    going back, a ``latest`` read as damaged, or a named step that fails verification (not a read failure) are."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True, name="latest-poller")
        self.run_dir = run_dir
        self.stop = threading.Event()
        self.newest = -1
        self.polls = 0
        self.errors: dict[str, int] = {}
        self.violations: list[str] = []
        self.verified: list[int] = []
        self.first: dict[str, str] = {}
        """The first error of each kind: its message and the frames in ``pipeline/`` it came through."""

    def run(self) -> None:
        store = PosixCheckpoints(CheckpointLayout(self.run_dir))
        while not self.stop.is_set():
            self.polls += 1
            try:
                found = store.newest()
            except (ReadFailed, OSError) as e:
                self._count(e)
                found = None
            except VerificationError as e:  # nothing is damaged in this test: a read taken for damage
                self.violations.append(f"{time.time():.3f} latest read as damaged: {e}")
                found = None
            except PipelineError as e:
                self._count(e)
                found = None
            if found is not None:
                if found.step < self.newest:
                    self.violations.append(f"{time.time():.3f} latest went back from {self.newest} to {found.step}")
                self.newest = max(self.newest, found.step)
                if found.step not in self.verified:
                    self._verify(store, found.step)
            time.sleep(0.1)

    def _verify(self, store: PosixCheckpoints, step: int) -> None:
        try:
            store.verify_committed(step)
            self.verified.append(step)
        except (ReadFailed, OSError) as e:
            self._count(e)  # tried again at the next poll
        except VerificationError as e:
            self.violations.append(f"{time.time():.3f} latest names step {step}, which does not verify: {e}")
            self.verified.append(step)

    def _count(self, e: BaseException) -> None:
        key = f"{type(e).__name__}/{_errname(e)}"
        self.errors[key] = self.errors.get(key, 0) + 1
        if key not in self.first:
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "/pipeline/" in f.filename]
            where = " <- ".join(f"{Path(f.filename).stem}.{f.name}:{f.lineno}" for f in reversed(frames))
            self.first[key] = f"{e} (raised at {where})"[:600]


def _saves(events: Path) -> dict[int, list[dict[str, Any]]]:
    """Rank -> its saves in order (the script's ``rank<K>.jsonl``)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in range(WORLD):
        f = events / f"rank{rank}.jsonl"
        lines = f.read_text().splitlines() if f.exists() else []
        out[rank] = [json.loads(line) for line in lines if line.strip()]
    return out


def _progress(events: Path) -> tuple[str, int]:
    try:
        word, step, _ = (events / "progress").read_text().split()
    except (FileNotFoundError, ValueError):
        return "", 0
    return word, int(step)


def _quarantined_that_verify(layout: CheckpointLayout) -> tuple[list[str], list[str]]:
    """(every entry of ``quarantine/``, those that verify): a committed copy against its manifest, a staged one
    against its markers."""
    q = layout.quarantine
    entries = sorted(p.name for p in q.iterdir()) if q.is_dir() else []
    good = []
    for name in entries:
        m = re.match(r"step_(\d+)", name)
        path = q / name
        if m is None or not path.is_dir():
            continue
        step = int(m.group(1))
        try:
            if (path / "manifest.json").exists():
                verify_committed(path, step)
            else:
                markers = complete_markers(step_markers(path, step, WORLD), None)
                if markers is None:
                    continue
                verified_manifest(step, markers, path, "", False)
            good.append(name)
        except (PipelineError, OSError):
            continue
    return entries, good


class Run:
    """One test's processes (torchrun through mount 0, the committers through mount 1) and what they saw."""

    def __init__(self, filer: FilerWithOutages, tmp: Path) -> None:
        self.filer = filer
        self.tmp = tmp
        self.events = tmp / "events"
        self.events.mkdir()
        self.stop_file = tmp / "stop"
        self.run0 = filer.fs.path(0, "run")
        self.run1 = filer.fs.path(1, "run")
        self.committers: list[subprocess.Popen[bytes]] = []
        self.trainer: subprocess.Popen[bytes] | None = None
        self.poller = LatestPoller(self.run1)
        self.problems: list[str] = []
        self.notes: list[str] = []
        self._logs: list[Any] = []

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def tail(self, name: str, n: int = 1500) -> str:
        return self.log(name).read_text(errors="replace")[-n:]

    def _popen(self, cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        self._logs.append(open(self.log(name), "wb"))  # noqa: SIM115 (closed in close())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._logs[-1],
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def start(self) -> None:
        self.trainer = self._popen(
            [TORCHRUN, "--standalone", "--nproc-per-node", str(WORLD), str(ROOT / "tests" / "filer_outage_train.py"),
             "--out", str(self.run0), "--events", str(self.events), "--stop", str(self.stop_file),
             "--every", "4", "--sleep", "0.1"],
            "trainer",
        )  # fmt: skip
        self.wait("the Checkpointer made its layout (seen through mount 1)", (self.run1 / "checkpoints").is_dir)
        self.start_committer()
        self.poller.start()

    def start_committer(self) -> subprocess.Popen[bytes]:
        n = len(self.committers)
        cmd = [sys.executable, "-m", "pipeline.commit", str(self.run1), "--follow", "--world-size", str(WORLD),
               "--interval", "0.2"]  # fmt: skip
        self.committers.append(self._popen(cmd, f"committer{n}"))
        return self.committers[-1]

    def wait(self, what: str, done: Callable[[], Any], interval_s: float = 0.02) -> Any:
        """:func:`_wait`, given up at once when the training run has exited."""
        assert self.trainer is not None
        trainer = self.trainer

        def gone() -> str | None:
            rc = trainer.poll()
            if rc is not None:
                return f"the training run exited {rc} first"
            if self.committers and self.committers[-1].poll() is not None:
                n = len(self.committers) - 1
                return f"committer {n} exited {self.committers[-1].returncode} first: {self.tail(f'committer{n}')}"
            return None

        return _wait(what, done, interval_s=interval_s, gone=gone)

    def saved_after(self, t: float) -> int:
        """The newest step every rank saved (ok) in a save that began after ``t``, or 0."""
        saves = _saves(self.events)
        ok = [{s["step"] for s in saves[r] if s["ok"] and s["began"] > t} for r in range(WORLD)]
        return max(set.intersection(*ok), default=0)

    def goes_on(self, what: str) -> None:
        """Wait for a step saved after the last restart, then for it to be committed (``latest`` read through
        mount 1 reaching it); the scenario ends here if it does not come."""
        back = (self.filer.outages[-1].serving or 0.0) if self.filer.outages else 0.0
        try:
            step = self.wait(f"{what}: a save after the restart", lambda: self.saved_after(back))
            self.wait(
                f"{what}: step {step} committed (latest read through mount 1)", lambda: self.poller.newest >= step
            )
        except TimeoutError as e:
            raise RunStopped(str(e)) from None

    def kill_in_a_save(self) -> int:
        """Kill the server the moment rank 0 begins its next save; returns that step."""
        _, before = _progress(self.events)

        def begun() -> int:
            word, step = _progress(self.events)
            return step if word == "saving" and step > before else 0

        step = self.wait("rank 0 begins a save", begun, interval_s=0.005)
        self.filer.kill()
        return step

    def outage(self, down_s: float, what: str) -> None:
        time.sleep(max(0.0, down_s - (time.time() - self.filer.outages[-1].killed)))
        self.notes.append(f"{what}: down {down_s:.0f} s, serving {self.filer.restart():.1f} s after the restart")

    def restart_committer_while_down(self) -> None:
        """The committer dies (SIGKILL, reaped: a process in a FUSE call the server does not answer cannot die
        until the mount answers), the server is killed, and a new committer starts while it is down."""
        old = self.committers[-1]
        if old.poll() is not None:
            self.problems.append(f"committer 0 exited {old.returncode} before its restart: {self.tail('committer0')}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.pid, signal.SIGKILL)
        old.wait(30)
        self.filer.kill()
        time.sleep(0.5)
        new = self.start_committer()
        time.sleep(3.0)
        if new.poll() is not None:
            self.problems.append(f"the committer started while the server was down exited {new.returncode} before "
                                 f"the server came back: {self.tail('committer1')}")  # fmt: skip

    def scenario(self) -> None:
        """The three outages of the module docstring, each followed by a step saved and committed."""
        self.start()
        self.goes_on("before the first outage")
        step = self.kill_in_a_save()
        self.outage(3, f"outage 1 (step {step} in flight)")
        self.goes_on("after outage 1")
        self.restart_committer_while_down()
        self.outage(4, "outage 2 (the committer restarted while down)")
        self.goes_on("after outage 2")
        step = self.kill_in_a_save()
        self.outage(14, f"outage 3 (step {step} in flight)")
        self.goes_on("after outage 3")

    def finish(self) -> tuple[int | None, list[int | None]]:
        """Stop the training (its stop file) and then the committers (SIGTERM: one last pass); their exit codes."""
        self.stop_file.touch()
        assert self.trainer is not None
        try:
            rc: int | None = self.trainer.wait(WAIT_S + 60)
        except subprocess.TimeoutExpired:
            rc = None
            self.problems.append("the training run did not end after its stop file")
        for p in self.committers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        rcs: list[int | None] = []
        for p in self.committers:
            try:
                rcs.append(p.wait(60))
            except subprocess.TimeoutExpired:
                rcs.append(None)
        return rc, rcs

    def close(self) -> None:
        """SIGKILL whatever still runs, then reap it (a process in a FUSE call dies when the call returns)."""
        self.poller.stop.set()
        procs = [*([self.trainer] if self.trainer else []), *self.committers]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
        self.poller.join(30)
        for f in self._logs:
            f.close()


def test_a_library_run_and_its_committer_ride_out_filer_outages(tmp_path: Path) -> None:
    """Three outages (see the module docstring); every check is gathered, then asserted together."""
    _skip_without_fuse()
    t0 = time.monotonic()
    with filer_with_outages(tmp_path / "sfs") as filer:
        run = Run(filer, tmp_path)
        try:
            try:
                run.scenario()
            except RunStopped as e:
                run.problems.append(str(e))
            rc, committer_rcs = run.finish()
        finally:
            run.close()
        latest = _latest_at_the_end(run)
        quarantined, verify = _quarantined_that_verify(CheckpointLayout(run.run1))
    saves = _saves(run.events)
    out = run.log("trainer").read_text(errors="replace")
    done = json.loads((run.events / "done").read_text()) if (run.events / "done").exists() else None
    if rc != 0:
        run.problems.append(f"the training run exited {rc}: {out[-3000:]}")
    if done is None:
        run.problems.append("the training script did not reach its end")
    elif latest != {0: done["last"], 1: done["last"]}:
        run.problems.append(f"latest is {latest} (through mounts 0, 1), not the run's last step {done['last']}")
    run.problems += _judge_saves(saves, out)
    for i in range(len(run.committers)):
        text = run.log(f"committer{i}").read_text(errors="replace")
        if "Traceback" in text:
            run.problems.append(f"a traceback in committer {i}'s output: {_around(text, 'Traceback')}")
    if committer_rcs[-1] != 0:
        text = run.log(f"committer{len(run.committers) - 1}").read_text(errors="replace")
        run.problems.append(f"the last committer exited {committer_rcs[-1]}: {text[-1500:]}")
    in_outage = _saves_in_outages(saves[0], filer)
    if not in_outage:
        run.problems.append("no save overlapped an outage: the test did not exercise what it claims")
    run.problems += run.poller.violations
    if verify:
        run.problems.append(f"quarantine/ holds entries that verify: {verify} (all entries: {quarantined})")
    summary = {
        "wall_s": round(time.monotonic() - t0, 1),
        "outages": run.notes,
        "saves overlapping an outage (step, ok, seconds)": in_outage,
        "failed saves": sorted({s["step"] for s in saves[0] if not s["ok"]}),
        "error lines": [ln[24:] for ln in out.splitlines() if re.search(r" (ERROR|CRITICAL) ", ln)][:12],
        "reader": {"polls": run.poller.polls, "read errors": run.poller.errors, "first": run.poller.first},
        "committer exits": committer_rcs,
        "quarantine": quarantined,
        "latest": latest,
        "done": done,
    }
    print(json.dumps(summary, indent=1))
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))
    assert not run.problems, "\n".join(run.problems)


def _latest_at_the_end(run: Run) -> dict[int, int | None]:
    """``latest``'s step read through each mount (its step verified), the server up."""
    latest: dict[int, int | None] = {}
    for i, run_dir in enumerate((run.run0, run.run1)):
        layout = CheckpointLayout(run_dir)
        try:
            found = PosixCheckpoints(layout).read_latest()
            latest[i] = found.step if found else None
            if found is not None:
                verify_committed(layout.committed_step(found.step), found.step)
        except (PipelineError, OSError) as e:
            run.problems.append(f"latest through mount {i} does not read or verify: {e}")
    return latest


def _judge_saves(saves: dict[int, list[dict[str, Any]]], out: str) -> list[str]:
    """Every rank saved the same steps with the same verdict, the last one ok; a failed save cost at most one line
    per rank (rank 0: also the verdict it logs for all), and no traceback."""
    problems = []
    steps = [[(s["step"], s["ok"]) for s in saves[r]] for r in range(WORLD)]
    if any(steps[r] != steps[0] for r in range(WORLD)):
        problems.append(f"the ranks' saves differ (step, ok): {steps}")
    if not saves[0] or not all(saves[r] and saves[r][-1]["ok"] for r in range(WORLD)):
        problems.append("the last save did not succeed on every rank")
    for step in sorted({s["step"] for s in saves[0] if not s["ok"]}):
        for r in range(WORLD):
            pattern = rf"rank{r} (ERROR|WARNING|CRITICAL) .*\bstep {step}\b"
            lines = [ln for ln in out.splitlines() if re.search(pattern, ln)]
            if len(lines) > (2 if r == 0 else 1):
                problems.append(f"the failed save of step {step} cost rank {r} {len(lines)} lines: {lines}")
    if "Traceback" in out:
        problems.append(f"a traceback in the training run's output: {_around(out, 'Traceback')}")
    return problems


def _saves_in_outages(saves: list[dict[str, Any]], filer: FilerWithOutages) -> list[tuple[int, bool, float]]:
    """(step, ok, seconds) of each save that overlapped an outage (killed .. serving again)."""
    found = []
    for o in filer.outages:
        end = o.serving or time.time()
        found += [(s["step"], s["ok"], round(s["ended"] - s["began"], 1)) for s in saves
                  if s["began"] < end and s["ended"] > o.killed]  # fmt: skip
    return found


def _around(text: str, needle: str, before: int = 300, after: int = 2500) -> str:
    i = text.find(needle)
    return text[max(0, i - before) : i + after]
