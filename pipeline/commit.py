"""``python -m pipeline.commit <dir> [--follow] [--world-size N] [--keep-last N] [--keep-every N]``

The one committer of a checkpoint dir written by the library's ``Checkpointer(..., committer="external")`` (or
to finish what a killed job staged): verifies each completely staged step, publishes it, then moves ``latest``.
Without ``--follow`` it makes one pass and exits; with it, it commits each step as it completes until
interrupted (Ctrl-C or SIGTERM: one last pass, then exit 0) or until ``--idle-exit`` seconds pass with nothing
staged. One committer commits a dir at a time, on any node: it holds the committer lease (a heartbeat and a
fencing epoch in ``checkpoints/committer/``). Exit 0 on success, 1 when a step was quarantined or when
another committer took the lease over (``stopped: ...``), 2 for bad arguments or when a live committer holds the
dir (one line on stderr, naming it).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from pipeline.checkpoint import options
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer, CommitterBusy, CommitterLost
from pipeline.checkpoint.protocol.ownership import DEFAULT_LEASE_S
from pipeline.checkpoint.stores.stores import remote_at, store_for
from pipeline.errors import PipelineError
from pipeline.storage.integrity import lstat_kind
from pipeline.storage.layout import CheckpointLayout


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.commit",
        description=" ".join((__doc__ or "").split("\n\n", 1)[-1].split()).replace("``", ""),  # the docstring's text
    )
    p.add_argument("dir", help="the checkpoint dir (the Checkpointer's directory, holding checkpoints/)")
    p.add_argument("--follow", action="store_true", help="keep committing as steps complete, until interrupted")
    p.add_argument("--world-size", type=int, default=1, help="markers a step needs when its rank-0 marker is absent")
    p.add_argument("--keep-last", type=int, default=None, help="retention: keep the newest N committed steps")
    p.add_argument("--keep-every", type=int, default=None, help="retention: also keep every step divisible by N")
    p.add_argument("--keep-best", type=int, default=None, help="retention: also keep the N steps best by --best-metric")
    p.add_argument("--best-metric", default="loss", help="the metric --keep-best ranks by (default: %(default)s)")
    p.add_argument("--best-mode", default="min", help="min: lowest is best; max: highest (default: %(default)s)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between looks (default: %(default)s)")
    p.add_argument("--storage", default=None, help="s3://bucket/prefix: the checkpoints live in that bucket")
    p.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE_S,
        help="seconds without a heartbeat after which a committer counts as gone (default: %(default)s)",
    )
    p.add_argument("--idle-exit", type=float, default=None, help="with --follow: exit after S seconds idle")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    layout = CheckpointLayout(Path(args.dir).resolve())
    if lstat_kind(layout.checkpoints) != "dir":
        print(f"error: {layout.checkpoints} is not a directory: not a checkpoint dir", file=sys.stderr)
        return 2
    try:
        options.check_world_size(args.world_size, "--world-size")
        options.check_seconds(args.interval, "--interval")
        options.check_keep(args.keep_last, "--keep-last")
        options.check_keep(args.keep_every, "--keep-every")
        options.check_seconds(args.lease, "--lease")
        best_names = ("--keep-best", "--best-metric", "--best-mode")
        options.check_best(args.keep_best, args.best_metric, args.best_mode, best_names)
        policy = CommitPolicy(
            world_size=args.world_size,
            poll_interval_s=args.interval,
            keep_last=args.keep_last,
            keep_every=args.keep_every,
            keep_best=args.keep_best,
            best_metric=args.best_metric,
            best_mode=args.best_mode,
            lease_s=args.lease,
        )
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        remote = remote_at(args.storage, layout.run_dir, "--storage")
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    committer = Committer(layout, policy, store_for(layout, remote))
    try:
        with committer.hold():
            if args.follow:
                _follow(committer, args.idle_exit, stop)
            else:
                committer.recover()
                committer.commit_ready()
    except CommitterBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CommitterLost as e:
        print(f"stopped: {e}", file=sys.stderr)
        return e.exit_code
    except (PipelineError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    report = committer.report
    newest = committer.latest_step()
    print(f"committed: {sorted(report.committed) or 'nothing new'}; latest = step {newest or 'none'}")
    for line in report.quarantined:
        print(f"quarantined: {line}", file=sys.stderr)
    return 1 if report.quarantined else 0


def _follow(committer: Committer, idle_exit: float | None, stop: threading.Event) -> None:
    """``--follow``: commit each step as it completes until stopped (or idle for ``idle_exit`` s). A store that
    cannot be read now (a filer away) costs passes, never an act: the pass after it recovers first."""
    committer.recover_or_defer()
    idle_since = [time.monotonic()]

    def alive() -> bool:
        if committer.pending():
            idle_since[0] = time.monotonic()
        return idle_exit is None or time.monotonic() - idle_since[0] < idle_exit

    committer.follow(alive=alive, stop=stop.is_set)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
