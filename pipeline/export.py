"""``python -m pipeline.export <dir> [--step N | --best] [--config DIR] [--dtype DTYPE] [--force] [--storage URL]``

Writes the newest committed step (or the one ``--step``/``--best`` names) of a checkpoint dir (a ``torchrun``
script's ``Checkpointer``, or a run dir) in
Hugging Face's sharded safetensors layout: consolidated first when needed (verified against its manifest,
streamed), then ``<dir>/export/step_N/model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` +
``provenance.json`` (the done-marker: source step, manifest hash, consolidated file hash, settings, every file's
hash). With ``--config`` (the directory ``config.save_pretrained`` or ``model.save_pretrained`` wrote, or its
``config.json``) the weights are checked against that model first, and ``config.json``, ``generation_config.json``
and the directory's tokenizer files are written beside them: ``from_pretrained(<export dir>)`` loads it. Without
it, weights only. Skipped when that output already verifies. Exit 0, 1 when the step does not verify or the
weights do not fit the config, 2 for bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys

from pipeline.checkpoint.options import EXPORT_DTYPES
from pipeline.checkpoint.outputs import export_latest
from pipeline.consolidate import add_step_arguments, build_output, chosen_step
from pipeline.errors import PipelineError, run_command
from pipeline.formats.hf_model import HFConfig
from pipeline.storage.sizes import parse_size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.export",
        description=" ".join((__doc__ or "").split("\n\n", 1)[-1].split()).replace("``", ""),  # the docstring's text
    )
    p.add_argument("dir", help="a checkpoint dir (holding checkpoints/) or a run dir")
    p.add_argument(
        "--config",
        default=None,
        help="the model's transformers config: a directory holding config.json (and tokenizer files), or the file",
    )
    p.add_argument("--dtype", default="float32", choices=EXPORT_DTYPES)
    p.add_argument("--max-shard-size", default="5GB", help="largest shard (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="redo it even if the output verifies")
    p.add_argument("--storage", default=None, help="s3://bucket/prefix: read the step from that bucket first")
    add_step_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        max_bytes = parse_size(args.max_shard_size)
    except PipelineError as e:
        print(f"error: --max-shard-size: {e}", file=sys.stderr)
        return 2
    try:
        config = HFConfig.of(args.config) if args.config is not None else None
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return build_output(
        args.dir,
        lambda layout, step: export_latest(layout, args.dtype, max_bytes, force=args.force, config=config, step=step),
        lambda out: f"{out['files']} files -> {out['out']}",
        args.storage,
        chosen_step(args),
        (args.best_metric, args.best_mode),
    )


if __name__ == "__main__":
    sys.exit(run_command(main, "nothing half-written was published; run it again to finish"))
