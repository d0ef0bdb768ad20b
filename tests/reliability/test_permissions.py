"""Under ``umask 000``: job folders stay private, nothing published is group- or world-writable.

The shared base run (:func:`~tests.reliability.harness.base_run`) is made by a launch under ``umask 000``: a
full tiny run, every stage a submitit job whose folder under ``logs/`` holds pickles (the submitted function
and its config, the results). Then a copy gets one more launch under ``umask 000`` that redoes a stage
(``stage=consolidate force=true``: a new job folder, a new output, the old one moved to ``.retired/``).

Checked on both:

* ``logs/`` is mode 0700;
* no ``*.pkl`` under the run dir is readable by group or others through its path (its own mode lacks the
  read bit, or a directory between the run dir and it lacks the search bit, for that class);
* no path under the run dir (the run dir itself, ``checkpoints/``, ``consolidated/``, ``export/``,
  ``assets/``, ``stages/``, ``run.yaml``, ``metrics.jsonl``, ``.hydra/``, the lease files) is group- or
  world-writable by its own mode; under ``logs/`` none is writable by group or others through its path.

Figure: files checked N, violations V.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import record
from tests.reliability.harness import BASE_ID, base_run, base_run_dir, launcher_faults, leftovers, run

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.distributed]

CLASSES = {"group": (stat.S_IRGRP, stat.S_IWGRP, stat.S_IXGRP), "others": (stat.S_IROTH, stat.S_IWOTH, stat.S_IXOTH)}


def _reachable(run_dir: Path, path: Path, search_bit: int) -> bool:
    """Whether every directory from ``run_dir`` down to ``path``'s parent grants ``search_bit``."""
    d = path.parent
    while True:
        if not d.lstat().st_mode & search_bit:
            return False
        if d == run_dir:
            return True
        d = d.parent


def check_permissions(run_dir: Path, *, above: tuple[Path, ...] = ()) -> tuple[int, list[str]]:
    """(paths checked, violations) for ``run_dir`` and the directories ``above`` it that the launch made."""
    bad: list[str] = []
    logs = run_dir / "logs"
    mode = stat.S_IMODE(logs.lstat().st_mode)
    if mode != 0o700:
        bad.append(f"{logs} is mode {mode:04o}, not 0700")
    bad += [
        f"{d} (mode {d.lstat().st_mode & 0o777:04o}) is writable by group or others"
        for d in above
        if d.lstat().st_mode & 0o022
    ]
    paths = [run_dir, *sorted(run_dir.rglob("*"))]
    for path in paths:
        st = path.lstat()
        mode = stat.S_IMODE(st.st_mode)
        in_logs = path == logs or logs in path.parents
        for who, (read, write, search) in CLASSES.items():
            through = path == run_dir or _reachable(run_dir, path, search)
            if path.suffix == ".pkl" and mode & read and through:
                bad.append(f"{path} (a pickle, mode {mode:04o}) is readable by {who}")
            if mode & write and not stat.S_ISLNK(st.st_mode) and (through or not in_logs):
                bad.append(f"{path} (mode {mode:04o}) is writable by {who}")
    return len(paths) + len(above), bad


def test_umask_000_keeps_job_folders_private_and_outputs_unwritable(tmp_path: Path) -> None:
    t0 = time.monotonic()
    logs = tmp_path / "console"
    layout = base_run(tmp_path / "p", logs)  # the original was made under umask 000
    original = base_run_dir()
    assert original is not None
    checked, violations = check_permissions(original, above=(original.parent,))  # <root>/tiny: made by the launch
    pickles = len(list(original.rglob("*.pkl")))
    assert pickles >= 5, f"expected the job folders' pickles under {original}/logs, found {pickles}"

    rerun = run(tmp_path / "p", BASE_ID, "stage=consolidate", "force=true", logs=logs, umask=0)
    assert rerun.proc.returncode == 0, rerun.output
    assert (layout.run_dir / "consolidated" / ".retired").is_dir() or any(layout.run_dir.rglob(".retired")), (
        "force=true moves the old output aside"
    )
    more, more_violations = check_permissions(layout.run_dir)
    checked += more
    violations += more_violations + launcher_faults(rerun, one_line_error=False) + leftovers(layout.run_dir)

    figure = f"files checked {checked}, violations {len(violations)}"
    record(
        "umask 000: private job folders",
        figure,
        ok=not violations,
        notes=[f"{time.monotonic() - t0:.0f}s", *violations],
    )
    assert not violations, "\n".join(violations)
