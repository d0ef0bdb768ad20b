"""Shared helpers for single-owner output stages (consolidate, export): staging, done-marker, publish.

Each output directory ``<area>/step_N/`` is built in ``<area>/.staging-step_N/``, gets a done-marker JSON
listing its files (size, xxh3-128) and its source (step + manifest hash), and is published by one rename.
A previous output that is forced or fails verification is moved to ``<area>/.retired/``, never deleted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from pipeline.checkpoint.manifest import MANIFEST, Latest, read_latest, read_manifest, verify_committed
from pipeline.errors import PipelineError, VerificationError
from pipeline.storage.atomic import clear_file, move_aside, publish_dir, remove_tree, write_json_atomic
from pipeline.storage.integrity import FileEntry, describe, hash_file, lstat_kind, read_record_json, verify_entries
from pipeline.storage.layout import CheckpointLayout, step_name

CONSOLIDATED_MARKER = "consolidated.json"
"""Done-marker of ``consolidated/step_N/`` (written by consolidate, read by export)."""
EXPORT_MARKER = "provenance.json"
"""Done-marker of ``export/step_N/`` (written by export, read by retention and status)."""
CONSOLIDATED_WEIGHTS = "model.safetensors"
"""The full-tensor weights file in ``consolidated/step_N/``."""


def source_step(layout: CheckpointLayout, verify: bool, step: int | None = None) -> Latest:
    """The committed step that downstream stages read: ``latest`` (its manifest hash checked), or ``step``.

    ``verify=True`` also checks every file against the manifest: done once per job, in ``check_inputs``.
    """
    if step is not None:
        step_dir = layout.committed_step(step)
        if verify:
            verify_committed(step_dir, step)
        read_manifest(step_dir)  # a committed step: one error naming it otherwise
        return Latest(step=step, manifest_hash=hash_file(step_dir / MANIFEST))
    latest = read_latest(layout)
    if latest is None:
        raise PipelineError(
            f"{layout.latest} does not exist: no committed step in run {layout.run_id}; "
            "run train and verify_manifest first"
        )
    if verify:
        verify_committed(layout.committed_step(latest.step))
    return latest


def verified_output(out_dir: Path, marker_name: str, source: dict[str, Any]) -> bool:
    """True when ``out_dir``'s marker names ``source`` and every listed file verifies."""
    marker = out_dir / marker_name
    if lstat_kind(out_dir) != "dir" or lstat_kind(marker) != "file":
        return False
    try:
        obj = read_record_json(marker, "output marker")
        if not isinstance(obj, dict) or obj.get("source") != source or not isinstance(obj.get("files"), list):
            return False
        verify_entries(out_dir, [FileEntry.from_json(f, str(marker)) for f in obj["files"]], str(marker))
    except (VerificationError, OSError):
        return False
    return True


@contextmanager
def staging_dir(area: Path, name: str) -> Iterator[Path]:
    """A fresh ``area/.staging-<name>`` for the ``with`` block; removed again if the block fails (a disk that
    filled up, a file-size limit), so a failed stage leaves no litter even when the next launch skips it."""
    staging = start_staging(area, name)
    try:
        yield staging
    except BaseException:
        with suppress(OSError):
            if lstat_kind(staging) == "dir":
                remove_tree(staging)
        raise


def start_staging(area: Path, name: str) -> Path:
    area.mkdir(parents=True, exist_ok=True)
    staging = area / f".staging-{name}"
    kind = lstat_kind(staging)
    if kind == "dir":
        remove_tree(staging)  # leftovers of a crashed attempt of this same single-owner stage
    elif kind is not None:
        clear_file(staging)  # a file or link where the staging dir goes: removed, never followed
    staging.mkdir()
    return staging


def finish(
    staging: Path, final: Path, marker_name: str, source: dict[str, Any], files: list[str], extra: dict[str, Any]
) -> None:
    entries = [describe(staging, f).to_json() for f in files]
    write_json_atomic(staging / marker_name, {"source": source, "files": entries, **extra})
    if lstat_kind(final) is not None:
        move_aside(final, final.parent / ".retired", f"{final.name}.{int(time.time())}")
    publish_dir(staging, final)


def consolidate_step(
    step_dir: Path, out: Path, on_tensor: Callable[[str], None] | None = None, allow_pickle: bool = False
) -> int:
    """Stream a committed step's model weights into ``out`` with the reader its manifest's format names."""
    from pipeline.formats.registry import get_format  # noqa: PLC0415 - readers import torch; listings do not

    manifest = read_manifest(step_dir)
    fmt = get_format(manifest.format, step_dir / MANIFEST)
    if fmt.consolidate is None:
        raise PipelineError(f"{step_dir}: format {fmt.name} holds no model weights to consolidate")
    return fmt.consolidate(step_dir, out, on_tensor, allow_pickle)


def consolidate_latest(
    layout: CheckpointLayout,
    allow_pickle: bool = False,
    verify: bool = True,
    force: bool = False,
    step: int | None = None,
) -> dict[str, Any]:
    """``latest``'s step (or committed ``step``) as ``consolidated/step_N/model.safetensors`` (full tensors,
    streamed; published with its done-marker naming the step's manifest hash). Skipped, saying so, when that
    output already verifies, unless ``force`` (the old output then moves to ``.retired/``)."""
    latest = source_step(layout, verify=verify, step=step)
    source = {"step": latest.step, "manifest_hash": latest.manifest_hash}
    final = layout.consolidated_step(latest.step)
    if not force and verified_output(final, CONSOLIDATED_MARKER, source):
        return {"step": latest.step, "out": str(final), "skipped": True}
    with staging_dir(layout.consolidated, step_name(latest.step)) as staging:
        count = consolidate_step(layout.committed_step(latest.step), staging / CONSOLIDATED_WEIGHTS, None, allow_pickle)
        finish(staging, final, CONSOLIDATED_MARKER, source, [CONSOLIDATED_WEIGHTS], {"tensors": count})
    return {"step": latest.step, "tensors": count, "out": str(final)}


def export_latest(
    layout: CheckpointLayout,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 10**9,
    force: bool = False,
    config: str | Path | Any | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """``latest``'s step (or committed ``step``) as ``export/step_N/``: Hugging Face's sharded safetensors
    (``model-0000i-of-0000n``, at most ``max_shard_bytes`` each) and ``model.safetensors.index.json``, cast to
    ``dtype``, with a done-marker naming the step's manifest hash and the consolidated file it was made from
    (consolidated first if needed).

    ``config``: the model's ``transformers`` config (a directory holding ``config.json``, the file, or a
    ``PretrainedConfig``): the weights are checked against the model it describes (on the meta device, before
    anything is written; a one-line error names the first tensor that differs), tied duplicates are left out, and
    ``config.json``, ``generation_config.json`` and the directory's tokenizer files are written beside them, so
    ``from_pretrained(export_dir)`` loads it. Without it: weights only."""
    import torch  # noqa: PLC0415 - the committer's imports stay light

    from pipeline.formats.hf_model import HFConfig, tied_duplicates  # noqa: PLC0415
    from pipeline.formats.safetensors_shards import reader, stored_shapes, write_sharded  # noqa: PLC0415

    if dtype not in ("float32", "bfloat16", "float16"):
        raise PipelineError(f"dtype {dtype!r}: choose float32, bfloat16 or float16")
    hf = HFConfig.of(config) if config is not None else None
    consolidated = consolidate_latest(layout, step=step)
    step = int(consolidated["step"])
    latest = source_step(layout, verify=False, step=step)  # consolidate_latest verified it just now
    weights = layout.consolidated_step(step) / CONSOLIDATED_WEIGHTS
    source = {
        "step": step,
        "manifest_hash": latest.manifest_hash,
        "consolidated_hash": _recorded_hash(weights.parent / CONSOLIDATED_MARKER, CONSOLIDATED_WEIGHTS),
        "dtype": dtype,
        "max_shard_bytes": max_shard_bytes,
        **({"config": hf.digest} if hf is not None else {}),
    }
    final = layout.export_step(step)
    if not force and verified_output(final, EXPORT_MARKER, source):
        return {"step": step, "out": str(final), "skipped": True}
    plan = None
    if hf is not None:
        stored = stored_shapes(weights)
        dups = tied_duplicates(hf.check_fits(stored, str(weights)))
        plan = [(n, shape, reader(n)) for n, shape in sorted(stored.items()) if n not in dups]
    with staging_dir(layout.export, step_name(step)) as staging:
        files = write_sharded(weights, staging, getattr(torch, dtype), max_shard_bytes, plan)
        files += hf.write(staging, dtype) if hf is not None else []
        kind = "huggingface" if hf is not None else "safetensors-sharded"
        finish(staging, final, EXPORT_MARKER, source, files, {"format": kind})
    return {"step": step, "out": str(final), "files": len(files)}


def _recorded_hash(marker: Path, name: str) -> str:
    """The hash an output's done-marker records for ``name`` (verified when that output was checked just now):
    the file is not hashed a second time."""
    obj = read_record_json(marker, "output marker")
    for entry in obj.get("files", []) if isinstance(obj, dict) else []:
        e = FileEntry.from_json(entry, str(marker))
        if e.path == name:
            return e.hash
    raise VerificationError(f"{marker} lists no {name}")
