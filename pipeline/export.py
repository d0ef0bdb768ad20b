"""``python -m pipeline.export <dir> [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]``

The newest committed step of a checkpoint dir (a ``torchrun`` script's ``Checkpointer``, or a run dir) as Hugging
Face's sharded safetensors layout: consolidated first when needed (verified against its manifest, streamed), then
``<dir>/export/step_N/model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` + ``provenance.json``
(the done-marker: source step, manifest hash, consolidated file hash, settings, every file's hash). Weights
only: the app's export stage adds ``config.json`` and the tokenizer for its ``transformers`` model. Skipped when
that output already verifies. Exit 0, 1 when the step does not verify, 2 for bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.checkpoint.outputs import export_latest
from pipeline.errors import PipelineError
from pipeline.storage.integrity import lstat_kind
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.sizes import parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.export", description=__doc__.splitlines()[2].strip())
    p.add_argument("dir", help="a checkpoint dir (holding checkpoints/) or a run dir")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-shard-size", default="5GB", help="largest shard (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="redo it even if the output verifies")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    layout = CheckpointLayout(Path(args.dir).resolve())
    try:
        max_bytes = parse_size(args.max_shard_size)
    except PipelineError as e:
        print(f"error: --max-shard-size: {e}", file=sys.stderr)
        return 2
    if lstat_kind(layout.checkpoints) != "dir":
        print(f"error: {layout.checkpoints} is not a directory: not a checkpoint dir", file=sys.stderr)
        return 2
    try:
        out = export_latest(layout, args.dtype, max_bytes, force=args.force)
    except (PipelineError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if out.get("skipped"):
        print(f"step {out['step']}: {out['out']} already verifies")
    else:
        print(f"step {out['step']}: {out['files']} files -> {out['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
