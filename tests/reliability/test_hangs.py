"""Liveness: a rank that dies, stops, or never writes its marker ends the launch within its deadline, with one
line naming the rank, and leaves no process behind.

Each scenario is a real launch of the tiny pipeline in a session of its own. The launcher's deadline for a
train job whose rank stops or dies is ``strategy.pg_timeout_s`` (a peer blocked in a collective fails then)
plus ``launcher.peer_grace_s`` (the launcher then cancels the ranks that did not end); for a marker that never
appears it is ``checkpoint.marker_deadline_s``. The table row of each scenario shows its detection time (from
the fault to the ``FAIL`` line) against that deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launchers.local_forks import forked_tasks
from pipeline.rundir.layout import RunLayout
from tests.conftest import ROOT
from tests.reliability.conftest import record

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.distributed]

PG_TIMEOUT_S, GRACE_S, CANCEL_S = 10.0, 3.0, 3.0
DEADLINE_S = PG_TIMEOUT_S + GRACE_S
SLACK_S = 30.0  # the launch's exit may come this long after the deadline (cancel, then verify-manifest)
FAST = (
    "launcher.poll_interval_s=0.2",
    f"launcher.peer_grace_s={GRACE_S:g}",
    f"launcher.cancel_timeout_s={CANCEL_S:g}",
    f"strategy.pg_timeout_s={PG_TIMEOUT_S:g}",
)
LONG = ("train.steps=20000", "checkpoint.every=8")
NO_SAVES = ("train.steps=20000", "checkpoint.every=100000")  # nothing to commit or export after the fault: quicker


class Launch:
    """``python -m pipeline`` in a session of its own, its output lines timestamped as they come."""

    def __init__(self, root: Path, run_id: str, *extra: str, env: dict[str, str] | None = None) -> None:
        self.layout = RunLayout.for_run(root, "tiny", run_id)
        args = ["+experiment=tiny", f"run.root={root}", f"run.id={run_id}", "run.create=true", *FAST, *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.err = ""
        self.seen: dict[int, psutil.Process] = {}  # every process of the run seen while it ran
        self._readers = [threading.Thread(target=self._read_out), threading.Thread(target=self._read_err)]
        for t in self._readers:
            t.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()

    @property
    def out(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def line_time(self, prefix: str) -> float | None:
        return next((t for t, line in self.lines if line.startswith(prefix)), None)

    def run_processes(self) -> list[psutil.Process]:
        """Processes of this run: the launcher's descendants, and whatever names the run dir on its command line."""
        run_dir = str(self.layout.run_dir)
        found = [p for p in psutil.process_iter(["cmdline"]) if run_dir in " ".join(p.info["cmdline"] or ())]
        with contextlib.suppress(psutil.NoSuchProcess):
            found += psutil.Process(self.proc.pid).children(recursive=True)
        for p in found:
            self.seen.setdefault(p.pid, p)
        return found

    def ranks(self, stage: str = "train") -> dict[int, psutil.Process]:
        """The task processes of the stage's job, by rank (``SUBMITIT_LOCAL_GLOBALID``)."""
        folder = str(self.layout.logs / stage)
        forked = {  # a train job's ranks forked by its controller (launchers.local_forks): named in its job folder
            pid: task
            for named in (self.layout.logs / stage).glob("*/*_tasks.json")
            for task, pid in forked_tasks(named.parent, named.name.split("_", 1)[0]).items()
        }
        ranks = {}
        for p in self.run_processes():
            try:
                cmd = " ".join(p.cmdline())
                if p.pid in forked and folder in cmd:
                    ranks[forked[p.pid]] = p
                elif "submitit.core._submit" in cmd and folder in cmd:
                    ranks[int(p.environ()["SUBMITIT_LOCAL_GLOBALID"])] = p
            except (psutil.NoSuchProcess, KeyError):
                continue
        return ranks

    def wait_for_training(self, event: str = "step", timeout: float = 120) -> dict[int, psutil.Process]:
        """Both train ranks, once train has logged ``event`` (a ``step``, a ``checkpoint`` staged)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"launcher exited early: {self.out}\n{self.err}"
            if self.layout.metrics.exists():
                lines = self.layout.metrics.read_text().splitlines()
                events = [json.loads(line) for line in lines if line.endswith("}")]
                if any(e.get("event") == event and e.get("ok", True) for e in events):
                    ranks = self.ranks()
                    if len(ranks) == 2:
                        return ranks
            time.sleep(0.1)
        raise AssertionError(f"train logged no {event} in time: {self.out}")

    def finish(self, timeout: float) -> int | None:
        """The launcher's exit status; None if it ran past ``timeout`` (then it is stopped: SIGTERM cancels its
        job)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)
        for t in self._readers:
            t.join()
        return None if self.proc.returncode == 128 + signal.SIGTERM else self.proc.returncode

    def leftovers(self) -> list[str]:
        """Processes of the run still alive after the launcher returned."""
        time.sleep(0.5)  # the launcher's children were waited for; give the kernel a moment to reap
        alive = []
        for p in [*self.seen.values(), *self.run_processes()]:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and p.pid != self.proc.pid:
                    alive.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                continue
        return sorted(set(alive))

    def kill_all(self) -> None:
        for p in [*self.seen.values(), *self.run_processes()]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                continue


def _error_line(launch: Launch) -> str:
    """The launcher's stderr when it is the one ``error:`` line it should be, else ``""``."""
    lines = launch.err.strip().splitlines()
    return lines[0] if len(lines) == 1 and lines[0].startswith("error: ") else ""


def _check_train_failure(launch: Launch, scenario: str, t_fault: float, deadline_s: float, *names: str) -> str:
    """Exit 1 within the deadline (+ slack), one error line naming ``names``, nothing left running."""
    rc = launch.finish(timeout=deadline_s + SLACK_S + 30)
    t_exit = time.monotonic()
    left = launch.leftovers()
    failed_at = launch.line_time("FAIL train")
    detect = (failed_at or t_exit) - t_fault  # the FAIL line comes after the cancel of ranks that did not end
    # the chain after the deadline: the launcher's poll sees rank 0 end, the peer grace, the cancel (SIGTERM to a
    # stopped rank, SIGKILL after CANCEL_S), then its next poll: 2 s of slack was 0.3 s short once under the suite's
    # load (18.3 s); 4 s still bounds it far below the run's own length (20,000 steps, about 18 minutes)
    bound = deadline_s + CANCEL_S + 4.0
    error = _error_line(launch)
    clean = "Traceback" not in launch.out + launch.err
    ok = (
        rc == 1
        and failed_at is not None
        and detect <= bound
        and t_exit - t_fault <= deadline_s + SLACK_S
        and all(n in error for n in names)
        and clean
        and not left
    )
    record(
        scenario,
        f"failed in {detect:.1f}s (deadline {deadline_s:g}s + cancel {CANCEL_S:g}s), "
        f"exit after {t_exit - t_fault:.1f}s, {len(left)} processes left",
        ok=ok,
        notes=[error[:200]],
    )
    assert rc is not None, f"the launch did not end within {deadline_s + SLACK_S + 30:g}s:\n{launch.out}"
    assert rc == 1, launch.out + launch.err
    assert error and clean, f"not one error line, or a traceback:\n{launch.out}\n{launch.err}"
    assert not left, f"processes of the run outlived the launch: {left}"
    assert failed_at is not None and detect <= bound, f"detected after {detect:.1f}s:\n{launch.out}"
    assert t_exit - t_fault <= deadline_s + SLACK_S, f"exited {t_exit - t_fault:.1f}s after the fault"
    for name in names:
        assert name in error, error
    assert f"log: {launch.layout.logs / 'train'}" in error, error
    return error


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """Launches of a test; whatever of them is left when it ends (a failed assertion) is killed."""
    started: list[Launch] = []
    yield started
    for launch in started:
        if launch.proc.poll() is None:
            launch.proc.kill()
        launch.kill_all()


def test_rank_sigkilled_during_training(tmp_path: Path, launches: list[Launch]) -> None:
    launch = Launch(tmp_path, "kill", *NO_SAVES)
    launches.append(launch)
    ranks = launch.wait_for_training()
    ranks[1].send_signal(signal.SIGKILL)
    t_fault = time.monotonic()
    error = _check_train_failure(launch, "rank SIGKILLed in training", t_fault, DEADLINE_S, "rank 1 died")
    assert "rank 0 failed" not in error.split(";")[0], "the root cause is the killed rank, not its peer's gloo error"


def test_rank_sigkilled_while_its_peer_is_stopped(tmp_path: Path, launches: list[Launch]) -> None:
    """Rank 0 is stopped, then rank 1 killed: nothing fails in a collective; the launcher's grace ends it."""
    launch = Launch(tmp_path, "killstop", *NO_SAVES)
    launches.append(launch)
    ranks = launch.wait_for_training()
    ranks[0].send_signal(signal.SIGSTOP)
    ranks[1].send_signal(signal.SIGKILL)
    t_fault = time.monotonic()
    _check_train_failure(
        launch, "rank SIGKILLed, peer stopped", t_fault, GRACE_S, "rank 1 died", "rank 0 (stopped) cancelled"
    )


def test_rank_sigstopped_during_training(tmp_path: Path, launches: list[Launch]) -> None:
    launch = Launch(tmp_path, "stop", *NO_SAVES)
    launches.append(launch)
    ranks = launch.wait_for_training()
    ranks[1].send_signal(signal.SIGSTOP)
    t_fault = time.monotonic()
    _check_train_failure(launch, "rank SIGSTOPped in training", t_fault, DEADLINE_S, "rank 1 (stopped)", "rank 0")


def test_rank_stopped_during_shard_save(tmp_path: Path, launches: list[Launch]) -> None:
    """Rank 1 is stopped after its step's staging dir appeared and before its marker: mid-save."""
    launch = Launch(tmp_path, "save", *LONG)
    launches.append(launch)
    rank1 = launch.wait_for_training("checkpoint")[1]
    staging = launch.layout.staging
    known = set(os.listdir(staging))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = set(os.listdir(staging)) - known
        if not new:
            time.sleep(0.002)
            continue
        rank1.send_signal(signal.SIGSTOP)
        if not (staging / sorted(new)[0] / "rank_1.done.json").exists():
            break  # stopped before its marker: mid-save
        rank1.send_signal(signal.SIGCONT)  # the save was already done: try the next step
        known |= new
    else:
        pytest.fail("could not stop rank 1 during a save")
    t_fault = time.monotonic()
    _check_train_failure(launch, "rank stopped in shard-save", t_fault, DEADLINE_S, "rank 1 (stopped)", "rank 0")


def test_marker_never_written(tmp_path: Path, launches: list[Launch]) -> None:
    """Rank 1 fails to write its marker of the last step: verify-manifest names rank 1 and the step."""
    marker_deadline_s = 10.0
    fault = {"PIPELINE_FAULTS": "shard_save.before_marker@rank=1@step=8"}  # logged; training goes on
    launch = Launch(
        tmp_path, "marker", "train.steps=8", f"checkpoint.marker_deadline_s={marker_deadline_s:g}", env=fault
    )
    launches.append(launch)
    rc = launch.finish(timeout=180)
    left = launch.leftovers()
    # The marker can appear until rank 1's process ends, so the deadline runs from train's end (under load
    # train alone can take longer than the deadline; verify-manifest starts beside it).
    trained, failed = launch.line_time("done train"), launch.line_time("FAIL verify_manifest")
    took = (failed or time.monotonic()) - (trained or launch.line_time("run  verify_manifest") or 0.0)
    error = next((line for line in launch.out.splitlines() if line.startswith("FAIL verify_manifest")), "")
    named = "step 8" in error and "rank(s) 1" in error
    ok = rc == 1 and failed is not None and took <= marker_deadline_s and named and not left
    record(
        "marker never written",
        f"reported in {took:.1f}s (deadline {marker_deadline_s:g}s), {len(left)} processes left",
        ok=ok,
        notes=[error[:200]],
    )
    assert rc == 1, launch.out + launch.err
    assert failed is not None and took <= marker_deadline_s, launch.out
    assert named, error
    assert not left, left
