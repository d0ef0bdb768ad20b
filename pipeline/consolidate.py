"""``python -m pipeline.consolidate <dir> [--step N | --best] [--storage s3://bucket/prefix]``

Writes the newest committed step of a checkpoint dir (or the one ``--step``/``--best`` names) as full tensors.
Works on a library checkpoint dir (a ``torchrun`` script's ``Checkpointer``) and on an app run dir alike: the step
is verified against its manifest, then streamed (memory bounded by the largest tensor) into
``<dir>/consolidated/step_N/model.safetensors`` with a done-marker naming the step's manifest hash. Skipped when
that output already verifies. Exit 0, 1 when the step does not verify, 2 for bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.checkpoint.options import BEST_MODES
from pipeline.checkpoint.outputs import consolidate_latest
from pipeline.checkpoint.steps import BEST, LATEST, pick
from pipeline.checkpoint.stores.stores import library_store
from pipeline.errors import PipelineError, run_command
from pipeline.storage.integrity import lstat_kind
from pipeline.storage.layout import CheckpointLayout


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.consolidate",
        description=" ".join((__doc__ or "").split("\n\n", 1)[-1].split()).replace("``", ""),  # the docstring's text
    )
    p.add_argument("dir", help="a checkpoint dir (holding checkpoints/) or a run dir")
    p.add_argument("--storage", default=None, help="s3://bucket/prefix: read the step from that bucket first")
    add_step_arguments(p)
    return p


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """``--step N`` / ``--best`` (by ``--best-metric``, ``--best-mode``): which committed step, not ``latest``'s."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="this committed step instead of the newest")
    which.add_argument("--best", action="store_true", help="the committed step best by --best-metric")
    p.add_argument("--best-metric", default="loss", help="the metric --best ranks by (default: %(default)s)")
    p.add_argument("--best-mode", default="min", choices=BEST_MODES, help="min: lowest is best (default: %(default)s)")


def chosen_step(args: argparse.Namespace) -> int | str:
    """What ``--step`` / ``--best`` asked for (``latest`` without them)."""
    return args.step if args.step is not None else (BEST if args.best else LATEST)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return build_output(
        args.dir,
        lambda layout, step: consolidate_latest(layout, step=step),
        lambda out: f"{out['tensors']} tensors -> {out['out']}",
        args.storage,
        chosen_step(args),
        (args.best_metric, args.best_mode),
    )


def build_output(
    directory: str,
    build: Callable[[CheckpointLayout, int | None], dict[str, Any]],
    made: Callable[[dict[str, Any]], str],
    storage: str | None = None,
    which: int | str = LATEST,
    best: tuple[str, str] = ("loss", "min"),
) -> int:
    """Run ``build`` on the checkpoint dir ``directory`` and the committed step ``which`` (``latest``, ``best`` by
    ``best``'s metric and mode, or a number) as a command line does: one line for what it made or that its output
    already verifies; a bad dir (exit 2) or a failure (exit 1) as one line on stderr. With ``storage``
    (``s3://bucket/prefix``) the step is pulled from there, verified, first."""
    layout = CheckpointLayout(Path(directory).resolve())
    if lstat_kind(layout.checkpoints) != "dir":
        print(f"error: {layout.checkpoints} is not a directory: not a checkpoint dir", file=sys.stderr)
        return 2
    try:
        store = library_store(layout, storage, "--storage")
        if which == LATEST:
            store.local()  # a bucket's latest step: pulled, verified
            out = build(layout, None)
        else:
            step = pick(store, which, *best)
            store.local(step)
            out = build(layout, step)
    except (PipelineError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(
        f"step {out['step']}: {out['out']} already verifies"
        if out.get("skipped")
        else f"step {out['step']}: {made(out)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "nothing half-written was published; run it again to finish"))
