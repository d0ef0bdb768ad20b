"""A full disk (ENOSPC on a small tmpfs) and a file-size limit (EFBIG under RLIMIT_FSIZE) in the middle of a run.

The run is a copy of the finished base run (steps 4 and 8 committed, consolidated, exported). Each trial
("fill") starts a launch that has more to write, and makes one write of it fail:

* **tmpfs** trials move the run root as a whole onto a fresh tmpfs, extend the run by one checkpoint
  (``train.steps`` + 4) and fill the tmpfs to the last block (fallocate) at a chosen moment: when the new
  checkpoint's staging dir appears (the save runs into ENOSPC), when the consolidate job is submitted, or when
  the export job is submitted. Space is then freed (by remounting the tmpfs bigger, or by deleting the filler)
  and the run root is moved back to the normal disk for the next trial.
* **rlimit** trials launch under ``RLIMIT_FSIZE`` (with SIGXFSZ ignored, so a write past it fails with EFBIG
  instead of killing the writer): 300 KB fails the forced rerun of consolidate (``stage=consolidate
  force=true``; its safetensors file is about 380 KB), 500 KB fails train's next shard (about 600 KB).

Expected of the failed launch: a non-zero exit, and one line on stderr naming the cause ("No space left on
device" / "File too large"), no raw traceback; every step committed before stays intact, and ``latest`` is
unchanged or names a step that verifies. Expected of the rerun after space is freed (or without the limit):
exit 0, latest = the final step with its export, no litter (``*.tmp-*``, ``.staging-*``, ``.*.deleting-*``),
nothing of the run left running.

Figure: fills F, previous step intact F/F, one-line errors E/F, litter L.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.checkpoint.manifest import read_latest
from pipeline.rundir.layout import RunLayout
from tests.reliability.conftest import record, sized
from tests.reliability.harness import (
    BASE_ID,
    Launch,
    base_run,
    check_run,
    committed,
    launch,
    launcher_faults,
    lease_jobs,
    leftovers,
    litter,
    run,
    wait_for,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.distributed]

ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"
EFBIG_TEXT = os.strerror(errno.EFBIG)  # "File too large"
TMPFS_MB = 64
KINDS = ("tmpfs:train", "rlimit:consolidate", "tmpfs:consolidate", "rlimit:train", "tmpfs:export")


@contextlib.contextmanager
def tmpfs(mountpoint: Path, size_mb: int) -> Iterator[Path]:
    """A fresh tmpfs at ``mountpoint``; the test is skipped where mounting is not permitted."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}M,mode=0700", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        text = done.stderr.lower()
        if os.geteuid() != 0 or "permission denied" in text or "not permitted" in text or "superuser" in text:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        raise AssertionError(f"mount failed: {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


def fill(mountpoint: Path) -> int:
    """Allocate every free block of the filesystem at ``mountpoint`` to one file; the bytes allocated."""
    fd = os.open(mountpoint / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    offset, chunk = os.fstat(fd).st_size, 1 << 20
    try:
        while chunk >= 4096:
            try:
                os.posix_fallocate(fd, offset, chunk)
                offset += chunk
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    finally:
        os.close(fd)
    return offset


def move_root(src: Path, dest: Path) -> RunLayout:
    """Move a run root as a whole (``<root>/tiny/base``, every path inside it) to ``dest``."""
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns("filler"))
    with contextlib.suppress(OSError):
        shutil.rmtree(src / "tiny")
    return RunLayout.for_run(dest, "tiny", BASE_ID)


def _limit_file_size(limit: int) -> Callable[[], None]:
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, kills nothing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@dataclass
class Fill:
    kind: str
    failed_as_expected: bool = False
    intact: bool = False
    one_line: bool = False
    litter: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _judge_failure(fill_: Fill, first: Launch, layout: RunLayout, before: dict[int, str], cause: str) -> None:
    rc = first.proc.returncode
    fill_.failed_as_expected = rc not in (0, None)
    if not fill_.failed_as_expected:
        fill_.problems.append(f"{fill_.kind}: the launch did not fail (exit {rc}):\n{first.output}")
    err_lines = [ln for ln in first.stderr.splitlines() if ln.strip()]
    fill_.one_line = len(err_lines) == 1 and cause in err_lines[0] and not launcher_faults(first, one_line_error=True)
    if not fill_.one_line:
        fill_.problems.append(f"{fill_.kind}: the error is not one line naming {cause!r}:\n{first.output}")
    violations = check_run(layout, before)
    fill_.intact = not violations
    fill_.problems += [f"{fill_.kind}: {v}" for v in violations]


def _recover(fill_: Fill, root: Path, layout: RunLayout, before: dict[int, str], final: int, logs: Path) -> None:
    recovery = run(root, BASE_ID, logs=logs)
    if recovery.proc.returncode != 0 or launcher_faults(recovery, one_line_error=False):
        fill_.problems.append(f"{fill_.kind}: the rerun after freeing space failed:\n{recovery.output}")
    fill_.problems += [f"{fill_.kind}: after the rerun: {v}" for v in check_run(layout, before, final_step=final)]
    fill_.litter = [str(p.relative_to(layout.run_dir)) for p in litter(layout.run_dir)]
    fill_.problems += [f"{fill_.kind}: left running: {p}" for p in leftovers(layout.run_dir)]


def _tmpfs_trial(i: int, kind: str, root: Path, tmp_path: Path, logs: Path) -> tuple[Fill, Path]:
    fill_, when = Fill(kind), kind.split(":")[1]
    mnt = tmp_path / f"fs{i}"
    with tmpfs(mnt, TMPFS_MB):
        layout = move_root(root, mnt / "root")
        fs_root = mnt / "root"
        before = committed(layout)
        steps = max(before) + 4
        first = launch(fs_root, BASE_ID, f"train.steps={steps}", logs=logs)
        try:

            def moment() -> bool:
                if when == "train":
                    return layout.staged_step(steps).exists()
                return any(j.get("stage") == when for j in lease_jobs(layout))

            reached = wait_for(f"the {when} moment", moment, 240, while_alive=first)
            if reached:
                fill(mnt)
            first.wait(300)
        finally:
            if first.running():
                first.proc.kill()
        if not reached:
            fill_.problems.append(f"{kind}: the launch ended before the {when} moment:\n{first.output}")
            return fill_, move_root(fs_root, tmp_path / f"after{i}").run_dir.parent.parent
        _judge_failure(fill_, first, layout, before, ENOSPC_TEXT)
        if i % 2 == 0:  # free space: remount bigger (the filler stays), or delete the filler
            subprocess.run(["mount", "-o", f"remount,size={4 * TMPFS_MB}M", str(mnt)], check=True)
        else:
            (mnt / "filler").unlink()
        _recover(fill_, fs_root, layout, {**before, **committed(layout)}, steps, logs)
        out = move_root(fs_root, tmp_path / f"after{i}")
    return fill_, out.run_dir.parent.parent


def _rlimit_trial(i: int, kind: str, root: Path, logs: Path) -> Fill:
    fill_, when = Fill(kind), kind.split(":")[1]
    layout = RunLayout.for_run(root, "tiny", BASE_ID)
    before = committed(layout)
    latest = read_latest(layout)
    assert latest is not None
    if when == "consolidate":
        steps, limit, args = latest.step, 300_000, ("stage=consolidate", "force=true")
    else:
        steps, limit, args = latest.step + 4, 500_000, (f"train.steps={latest.step + 4}",)
    first = run(root, BASE_ID, *args, logs=logs, preexec_fn=_limit_file_size(limit))
    _judge_failure(fill_, first, layout, before, EFBIG_TEXT)
    _recover(fill_, root, layout, {**before, **committed(layout)}, steps, logs)
    return fill_


def test_disk_full_and_file_size_limit_keep_committed_steps_and_recover(tmp_path: Path) -> None:
    t0 = time.monotonic()
    logs = tmp_path / "console"
    root = tmp_path / "start"
    base_run(root, logs)
    fills: list[Fill] = []
    seen: set[str] = set()
    for i in range(sized(ci=2, large=len(KINDS) * 2)):
        kind = KINDS[i % len(KINDS)]
        if kind.startswith("tmpfs"):
            fill_, root = _tmpfs_trial(i, kind, root, tmp_path, logs)
        else:
            fill_ = _rlimit_trial(i, kind, root, logs)
        fill_.litter = [p for p in fill_.litter if p not in seen]  # litter of an earlier trial counts once
        seen |= set(fill_.litter)
        fill_.problems += [f"{kind}: litter after the rerun: <run>/{p}" for p in fill_.litter]
        print(f"fill {i}: {kind}: {'; '.join(fill_.problems) or 'ok'}")
        fills.append(fill_)
    n = len(fills)
    intact = sum(f.intact for f in fills)
    one_line = sum(f.one_line for f in fills)
    left = sum(len(f.litter) for f in fills)
    figure = f"fills {n}, previous step intact {intact}/{n}, one-line errors {one_line}/{n}, litter {left}"
    problems = [p for f in fills for p in f.problems]
    record("disk full (ENOSPC, EFBIG)", figure, ok=not problems, notes=[f"{time.monotonic() - t0:.0f}s", *problems])
    assert not problems, "\n\n".join(problems)
