"""import-checkpoint: stage a checkpoint the pipeline did not write, for the one committer to commit.

Inputs: ``import.source``: a DCP directory (``.metadata``), a DeepSpeed checkpoint directory (its ``latest`` tag,
or a tag directory holding ``*_optim_states.pt``), or one ``torch.save`` file. Its structure is read first with
the pipeline's restricted readers; a file that needs full unpickling is refused unless ``import.allow_pickle=true``.
Outputs: ``checkpoints/staging/step_N/``: a copy of exactly the files the checkpoint's own metadata names (hashed
while copied; the source is never modified or moved), then one ``rank_K.done.json`` per rank that wrote the
source, listing that rank's files (from the format's file naming) with sizes and hashes. ``N`` is
``import.step``, else the step the checkpoint records (DeepSpeed ``global_steps``, the pipeline's ``train.step``),
else 1.
Owner: this single task (train does not run in an import run); verify_manifest commits the step, consolidate and
export read it by its format like any trained step.
Done-marker: a step is committed (``latest``), or staged with every marker of an import attempt.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pipeline.stagekit.checkpoint_store as storage
from pipeline.checkpoint.manifest import Marker, complete_markers, marker_path, step_markers
from pipeline.checkpoint.stores.remote import TRANSFER_THREADS, digest, safe_key_path
from pipeline.config.schema import PipelineConfig
from pipeline.errors import CheckpointFormatError, ConfigError, PipelineError, VerificationError, plural
from pipeline.formats.dcp_names import METADATA_FILE
from pipeline.formats.registry import TORCH_SAVE, get_format
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import Resources, StageContract, TaskContext
from pipeline.storage.atomic import clear_file, copy_file_atomic, remove_tree
from pipeline.storage.faults import inject
from pipeline.storage.integrity import FileEntry, is_real_dir, lstat_kind, safe_join
from pipeline.storage.s3 import S3Store, S3Url

CONTRACT = StageContract(
    name="import_checkpoint",
    needs=("prepare_dirs",),
    reads="import.source (DCP dir, DeepSpeed checkpoint dir, or torch.save file), read-only",
    produces="checkpoints/staging/step_N/: copied files + one rank_K.done.json per rank of the source",
    marker="step committed, or staged with every marker of an import attempt",
    resources=Resources(cpus_per_task=1, mem_gb=4, timeout_min=120),
    check_before_launch=True,
    optional=True,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    format: str
    root: Path
    """The directory the files are relative to."""
    files: dict[str, str]
    """Name in the step -> name under ``root``."""
    world_size: int
    step: int | None


def _source_path(cfg: PipelineConfig) -> Path:
    if not cfg.import_.source:
        raise ConfigError("this run imports nothing: set import.source=<dir or file>")
    if cfg.import_.source.startswith("s3://"):  # a local copy of the prefix, then read as a directory
        try:
            return download_prefix(cfg.import_.source, Path(tempfile.gettempdir()) / "pipeline-imports")
        except PipelineError as e:
            raise ConfigError(str(e)) from None
    return Path(cfg.import_.source).expanduser().absolute()


def _deepspeed_dir(path: Path) -> Path | None:
    """A DeepSpeed tag directory: ``path`` itself, or the tag its ``latest`` names."""
    if any(path.glob("*_optim_states.pt")):
        return path
    latest = path / "latest"
    if lstat_kind(latest) == "file":
        try:
            with open(latest, "rb") as f:  # lstat said a regular file: a tag name, bounded
                tag = f.read(256).decode(errors="replace").strip()
        except OSError as e:
            raise CheckpointFormatError(f"{latest} cannot be read ({e.strerror}): fix its permissions") from None
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointFormatError(f"{latest} names {tag!r}, not a tag directory of {path}")
        tag_dir = safe_join(path, tag)
        if not is_real_dir(tag_dir):
            raise CheckpointFormatError(f"{latest} names {tag!r}, but {tag_dir} is not a directory")
        return tag_dir
    return None


def probe(cfg: PipelineConfig) -> Source:
    """What ``import.source`` is, read with the restricted readers (nothing copied yet)."""
    path = _source_path(cfg)
    allow = cfg.import_.allow_pickle
    kind = lstat_kind(path)
    if kind == "file":
        from pipeline.formats.torch_save import FILE, probe_file  # noqa: PLC0415

        step = probe_file(path, allow_pickle=allow)
        return Source(TORCH_SAVE, path.parent, {FILE: path.name}, 1, step)
    if kind != "dir":
        raise ConfigError(
            f"import.source={path} is {'missing' if kind is None else 'a ' + kind}: give a directory or file"
        )
    if lstat_kind(path / METADATA_FILE) == "file":
        from pipeline.formats.dcp_metadata import stored_files  # noqa: PLC0415

        files = sorted(stored_files(path))
        fmt = get_format("torch_dcp")
        return Source(fmt.name, path, {f: f for f in files}, fmt.world_size(path, False), _dcp_step(path))
    tag_dir = _deepspeed_dir(path)
    if tag_dir is not None:
        from pipeline.formats.deepspeed_zero import ZeroCheckpoint  # noqa: PLC0415

        with ZeroCheckpoint(tag_dir, allow_pickle=allow) as ckpt:
            files = sorted(ckpt.stored_files())
            return Source(ckpt.format, tag_dir, {f: f for f in files}, ckpt.world_size, ckpt.global_steps())
    raise ConfigError(
        f"import.source={path} is not a checkpoint this pipeline reads: expected a DCP directory (.metadata), a "
        "DeepSpeed checkpoint directory (latest, or *_optim_states.pt files) or a torch.save file"
    )


STEP_KEYS = ("train.step", "step", "global_step", "iteration")
"""Where a DCP checkpoint records its step: the pipeline's ``train.step``, or a top-level value as training
scripts commonly save it: a scalar tensor, or a Python int (DCP stores it as a small torch.save archive, read
here with the restricted unpickler: an int and nothing else)."""


def _dcp_step(path: Path) -> int | None:
    """The step a DCP checkpoint records (a scalar tensor under one of :data:`STEP_KEYS`), when it has one."""
    import torch  # noqa: PLC0415

    from pipeline.formats.dcp import load_into, read_metadata_safe  # noqa: PLC0415
    from pipeline.formats.dcp_metadata import TensorStorageMetadata  # noqa: PLC0415

    md = read_metadata_safe(path)
    for key in STEP_KEYS:
        entry = md.state_dict_metadata.get(key)
        if entry is not None and not isinstance(entry, TensorStorageMetadata):  # bytes: a pickled Python value
            stored = _stored_int(path, md, key)
            if stored is not None:
                return stored
            continue
        if entry is None or math.prod(entry.size) != 1:
            continue
        value = torch.zeros(entry.size, dtype=entry.properties.torch_dtype())
        box: dict[str, Any] = {"train": {"step": value}} if key == "train.step" else {key: value}
        load_into(box, path, no_dist=True, metadata=md)
        return int(value.reshape(()).item())
    return None


def _stored_int(path: Path, md: Any, key: str) -> int | None:
    """A Python int DCP stored under ``key`` (its bytes item), read by the restricted unpickler; else None."""
    from pipeline.formats.torch_zip import load_archive, open_archive  # noqa: PLC0415

    info = next((i for idx, i in md.storage_data.items() if idx.fqn == key), None)
    if info is None:
        return None
    try:
        value = load_archive(open_archive(safe_join(path, info.relative_path), info.offset, info.length))
    except (CheckpointFormatError, OSError, ValueError):
        return None  # not a plain value: the step is not taken from it
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def import_step(cfg: PipelineConfig, source: Source) -> int:
    step = cfg.import_.step if cfg.import_.step is not None else (source.step or 1)
    if step < 1:
        raise ConfigError(f"the imported checkpoint records step {step}: set import.step=<N >= 1>")
    return step


def check_inputs(cfg: PipelineConfig, layout: RunLayout) -> None:
    """The source reads, and (before any job runs) its model tensors fit the run's model for the export."""
    source = probe(cfg)
    from pipeline.workload.import_fit import check_exportable, source_shapes  # noqa: PLC0415

    check_exportable(cfg, layout, source_shapes(source.format, source.root, source.files, cfg.import_.allow_pickle))


def not_applicable(cfg: PipelineConfig) -> str | None:
    return None if cfg.import_.source else "no import.source: this run trains"


def is_done(cfg: PipelineConfig, layout: RunLayout) -> str | None:
    if not cfg.import_.source:
        return "no import.source: this run trains"
    try:
        latest = storage.committed_latest(cfg, layout)
    except (PipelineError, OSError, ValueError):
        latest = None
    if latest is not None:
        return f"step {latest.step} is committed"
    if cfg.checkpoint.storage:
        return None  # a step staged in the bucket: the import runs again (idempotent), the committer commits
    for staged in sorted(layout.staging.glob("step_*")) if is_real_dir(layout.staging) else []:
        try:
            step = int(staged.name.split("_", 1)[1])
            first = step_markers(staged, step, 1)[0]
            if first is not None and complete_markers(step_markers(staged, step, first.world_size), None):
                return f"{staged.name} is staged with every marker (verify_manifest commits it)"
        except (ValueError, VerificationError):
            continue
    return None


def run(ctx: TaskContext) -> dict[str, object]:
    cfg, layout = ctx.cfg, ctx.layout
    source = probe(cfg)
    step = import_step(cfg, source)
    fmt = get_format(source.format)
    store = storage.store(cfg, layout)
    staged = store.rank_dir(step, 0)  # one dir for every rank's files: this job writes them all
    for rank in range(1, source.world_size):
        clear_file(marker_path(staged, rank))  # an earlier attempt's markers: this attempt writes its own
    by_rank: dict[int, list[FileEntry]] = {r: [] for r in range(source.world_size)}
    total = 0
    for name, src_rel in sorted(source.files.items()):
        owner = fmt.owner(name)
        rank = 0 if owner is None else owner
        if rank not in by_rank:
            raise CheckpointFormatError(
                f"{source.root / src_rel} belongs to rank {rank}, "
                f"but the checkpoint has {plural(source.world_size, 'rank')}"
            )
        dst = safe_join(staged, name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        size, digest = copy_file_atomic(safe_join(source.root, src_rel), dst)
        by_rank[rank].append(FileEntry(path=name, size=size, hash=digest))
        total += size
        log.info("imported %s (%d bytes)", name, size)
    inject("import.before_markers", step=step)
    for rank, entries in by_rank.items():
        if not entries:
            raise PipelineError(f"rank {rank} of {source.root} wrote no file the checkpoint names")
        marker = Marker(
            step=step,
            rank=rank,
            world_size=source.world_size,
            format=source.format,
            attempt=ctx.attempt,
            files=tuple(entries),
        )
        store.deliver(staged, marker)  # in a bucket: each rank's files, then its marker object, as a rank's
    store.release(staged)
    return {
        "source": cfg.import_.source if str(cfg.import_.source).startswith("s3://") else str(_source_path(cfg)),
        "format": source.format,
        "world_size": source.world_size,
        "step": step,
        "files": len(source.files),
        "bytes": total,
    }


def download_prefix(url: str, dest_root: Path) -> Path:
    """A local copy of every object under ``url`` (``s3://bucket/prefix``): a foreign checkpoint to import,
    read like a local directory afterwards by the restricted readers. Cached under ``dest_root`` by the
    listing's keys, sizes and ETags (the same listing reuses the copy); keys are checked as relative paths."""
    src = S3Url.parse(url, "import.source")
    store = S3Store(src.bucket)
    base = src.prefix + "/" if src.prefix else ""
    listing = store.listing(base)
    if not listing:
        raise VerificationError(f"import.source={url} holds no objects")
    sig = digest(json.dumps(sorted((k, o.size, o.etag) for k, o in listing.items())).encode())
    final = dest_root / f"s3-import-{sig[:16]}"
    if final.is_dir():
        return final
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = dest_root / f".s3-import-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with cf.ThreadPoolExecutor(TRANSFER_THREADS) as pool:
            futures = []
            for key, info in listing.items():
                rel = safe_key_path(key[len(base) :], f"import.source={url}")
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                futures.append(pool.submit(store.download, key, info.size, tmp / rel))
            for f in futures:
                f.result()
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # another process published the same copy first
                raise
    finally:
        if tmp.exists():
            remove_tree(tmp)
    log.info("downloaded import.source %s (%d objects) into %s", url, len(listing), final)
    return final
