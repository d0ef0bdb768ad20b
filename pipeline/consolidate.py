"""``python -m pipeline.consolidate <dir> [--storage s3://bucket/prefix]``

Writes the newest committed step of a checkpoint dir as full tensors. Works on a library checkpoint dir (a
``torchrun`` script's ``Checkpointer``) and on an app run dir alike: the step ``latest`` names is verified against
its manifest, then streamed (memory bounded by the largest tensor) into
``<dir>/consolidated/step_N/model.safetensors`` with a done-marker naming the step's manifest hash. Skipped when
that output already verifies. Exit 0, 1 when the step does not verify, 2 for bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.checkpoint.outputs import consolidate_latest
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
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return build_output(
        args.dir, consolidate_latest, lambda out: f"{out['tensors']} tensors -> {out['out']}", args.storage
    )


def build_output(
    directory: str,
    build: Callable[[CheckpointLayout], dict[str, Any]],
    made: Callable[[dict[str, Any]], str],
    storage: str | None = None,
) -> int:
    """Run ``build`` on the checkpoint dir ``directory`` as a command line does: one line for what it made or
    that its output already verifies; a bad dir (exit 2) or a failure (exit 1) as one line on stderr. With
    ``storage`` (``s3://bucket/prefix``) the step ``latest`` names there is pulled, verified, first."""
    layout = CheckpointLayout(Path(directory).resolve())
    if lstat_kind(layout.checkpoints) != "dir":
        print(f"error: {layout.checkpoints} is not a directory: not a checkpoint dir", file=sys.stderr)
        return 2
    try:
        library_store(layout, storage, "--storage").local()  # a bucket's latest step: pulled, verified
        out = build(layout)
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
