"""How the committer's verify + commit scales with the world size, by simulation.

For each N in ``--ranks`` a fresh run dir (``prepare_dirs``, world size N) gets one staged step that is a real
DCP checkpoint of N ranks, written without N processes: ``files_per_rank`` small data files per rank
(``__K_i.distcp``, owner rank K), a real ``.metadata`` (a pickled ``torch.distributed.checkpoint.metadata.Metadata``
as ``FileSystemWriter.finish`` writes it: ``files_per_rank`` tensors, each sharded over all N ranks as FSDP2
stores them, one chunk per rank in that rank's file ``i``, plus one bytes item of rank 0), and each rank's
``rank_K.done.json`` with the real sizes and xxh3-128 hashes. Then the verify-manifest stage runs on it exactly
as its job runs it (``pipeline.driver.task.execute_task("verify_manifest", ...)``: re-check of
``latest``, marker wait, size + hash of every file, the format's metadata and owner checks, ``manifest.json``,
publish, ``latest``, retention); that call is what is timed. The step must commit, and its manifest must list
every file written. ``recheck`` times ``verify_committed`` of the committed step afterwards: what every later
start of the committer (and train's resume) re-checks.

    .venv/bin/python bench/scale_commit.py                           # 64 .. 4096 ranks, 8 files each, ~1 min
    .venv/bin/python bench/scale_commit.py --ranks 64,256,1024,4096
    .venv/bin/python bench/scale_commit.py --rounds 3                # median of 3 commits per N
    .venv/bin/python bench/scale_commit.py --ranks 4096 --profile 30  # cProfile of the commit, top 30

Prints a Markdown table (ranks, files, seconds, seconds per rank) and then the JSON (also ``--json PATH``); the
growth checks are ``per_rank_ratio`` (seconds per rank at the largest N over that at the smallest: ~1 or below
when linear, as the fixed cost is spread over more ranks) and ``fit`` (``seconds = fixed + per_rank x ranks``
and its largest residual as a fraction of the largest N's time). An untimed 8-rank commit runs first (imports).
Scratch disk: a few KB per file (4096 ranks x 8 files x 2 KB = 64 MB); each run dir is removed after its N.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pickle
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import xxhash  # noqa: E402
from torch.distributed.checkpoint import metadata as dcp_meta  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402

from pipeline.checkpoint.manifest import (  # noqa: E402
    Marker,
    marker_path,
    read_latest,
    read_manifest,
    verify_committed,
)
from pipeline.config.compose import load_config  # noqa: E402
from pipeline.driver.task import execute_task  # noqa: E402
from pipeline.formats.dcp import FORMAT, METADATA_FILE  # noqa: E402
from pipeline.rundir.layout import RunLayout  # noqa: E402
from pipeline.storage.integrity import FileEntry  # noqa: E402

DEFAULT_RANKS = (64, 128, 256, 512, 1024, 2048, 4096)
STEP = 1
ATTEMPT = "scale-train"
_BYTES_ITEM = 64


def _entry(rel: str, data: bytes) -> FileEntry:
    return FileEntry(path=rel, size=len(data), hash=xxhash.xxh3_128(data).hexdigest())


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:  # no fsync: the bench times the commit, not the staging
        f.write(data)


def stage_dcp_step(step_dir: Path, ranks: int, files_per_rank: int = 8, file_kb: int = 2) -> list[str]:
    """Stage a DCP step of ``ranks`` ranks in ``step_dir`` (markers last); return every file's path."""
    step_dir.mkdir(parents=True, exist_ok=True)
    elems = (file_kb << 10) // 4  # float32 elements of each rank's chunk of each tensor
    state: dict[str, dcp_meta.TensorStorageMetadata | dcp_meta.BytesStorageMetadata] = {}
    storage: dict[dcp_meta.MetadataIndex, _StorageInfo] = {}
    for i in range(files_per_rank):
        fqn = f"model.layers.{i}.weight"
        state[fqn] = dcp_meta.TensorStorageMetadata(
            properties=dcp_meta.TensorProperties(dtype=torch.float32),
            size=torch.Size([ranks * elems]),
            chunks=[
                dcp_meta.ChunkStorageMetadata(offsets=torch.Size([k * elems]), sizes=torch.Size([elems]))
                for k in range(ranks)
            ],
        )
        for k in range(ranks):
            index = dcp_meta.MetadataIndex(fqn=fqn, offset=torch.Size([k * elems]), index=k)
            storage[index] = _StorageInfo(relative_path=f"__{k}_{i}.distcp", offset=0, length=elems * 4)
    state["train.step"] = dcp_meta.BytesStorageMetadata()
    storage[dcp_meta.MetadataIndex(fqn="train.step")] = _StorageInfo(
        relative_path="__0_0.distcp", offset=elems * 4, length=_BYTES_ITEM
    )
    md = dcp_meta.Metadata(state_dict_metadata=state, storage_data=storage, planner_data=None, version="1.0.0")
    meta_bytes = pickle.dumps(md)
    _write(step_dir / METADATA_FILE, meta_bytes)
    files = {0: [_entry(METADATA_FILE, meta_bytes)]}
    payload = os.urandom(elems * 4 + _BYTES_ITEM)
    for k in range(ranks):
        listed = files.setdefault(k, [])
        for i in range(files_per_rank):
            rel = f"__{k}_{i}.distcp"
            n = elems * 4 + (_BYTES_ITEM if (k, i) == (0, 0) else 0)
            data = f"{k:08d}{i:08d}".encode() + payload[16:n]  # every file different
            _write(step_dir / rel, data)
            listed.append(_entry(rel, data))
    for k in range(ranks):
        marker = Marker(step=STEP, rank=k, world_size=ranks, format=FORMAT, attempt=ATTEMPT, files=tuple(files[k]))
        _write(marker_path(step_dir, k), json.dumps(marker.to_json()).encode())
    return [f.path for k in range(ranks) for f in files[k]]


def _config(root: Path, ranks: int) -> object:
    return load_config(
        [
            "+experiment=tiny",
            f"run.root={root}",
            f"run.id=scale{ranks}",
            f"strategy.world_size={ranks}",
            f"train.global_batch_size={ranks}",
            "checkpoint.marker_deadline_s=5",
        ]
    )


def measure(ranks: int, files_per_rank: int = 8, file_kb: int = 2, profile: int = 0) -> dict[str, object]:
    """Stage and commit one step of ``ranks`` ranks in a fresh scratch dir (removed afterwards)."""
    scratch = Path(tempfile.mkdtemp(prefix=f"scale_commit-{ranks}-"))
    try:
        cfg = _config(scratch, ranks)
        layout = RunLayout.for_run(scratch, "tiny", f"scale{ranks}")
        execute_task("prepare_dirs", cfg, str(layout.run_dir), "scale-prepare")  # type: ignore[arg-type]
        t0 = time.perf_counter()
        written = stage_dcp_step(layout.staged_step(STEP), ranks, files_per_rank, file_kb)
        os.sync()  # durable, as each rank's save leaves its files (fsynced) before the commit starts
        staged_s = time.perf_counter() - t0
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        summary = execute_task("verify_manifest", cfg, str(layout.run_dir), "scale-commit")  # type: ignore[arg-type]
        if prof is not None:
            prof.disable()
        seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        verify_committed(layout.committed_step(STEP), STEP)  # what every later committer start re-checks
        recheck_s = time.perf_counter() - t0
        latest = read_latest(layout)
        listed = [f.path for f in read_manifest(layout.committed_step(STEP)).files]
        if latest is None or latest.step != STEP or summary.get("committed") != [STEP]:
            raise RuntimeError(f"{ranks} ranks: step {STEP} was not committed ({summary})")
        if listed != written:
            raise RuntimeError(f"{ranks} ranks: the manifest lists {len(listed)} files, {len(written)} were written")
        out: dict[str, object] = {
            "ranks": ranks,
            "files": len(written),
            "seconds": round(seconds, 3),
            "seconds_per_rank": round(seconds / ranks, 6),
            "recheck_seconds": round(recheck_s, 3),
            "staging_seconds": round(staged_s, 3),
        }
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(profile)
            out["profile"] = text.getvalue()
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _median_row(rows: list[dict[str, object]]) -> dict[str, object]:
    """The round with the median commit time, with every round's seconds (the disk's fsync latency varies)."""
    ordered = sorted(rows, key=lambda r: float(r["seconds"]))  # type: ignore[arg-type]
    return {**ordered[len(ordered) // 2], "seconds_all": [r["seconds"] for r in rows]}


def run(
    ranks_list: list[int] | tuple[int, ...] = DEFAULT_RANKS, files_per_rank: int = 8, rounds: int = 1
) -> dict[str, object]:
    """Measure every N in ``ranks_list``; returns the rows, the seconds-per-rank growth ratio (largest N over
    smallest) and a least-squares fit ``seconds = fixed + per_rank * ranks`` with its largest residual as a
    fraction of the largest N's time (linear growth: small; a superlinear term puts the largest N far above)."""
    measure(8, files_per_rank)  # untimed: the first commit of a process imports the format readers
    rows = [_median_row([measure(n, files_per_rank) for _ in range(rounds)]) for n in ranks_list]
    first, last = rows[0], rows[-1]
    ratio = float(last["seconds_per_rank"]) / max(float(first["seconds_per_rank"]), 1e-9)  # type: ignore[arg-type]
    xs = [float(r["ranks"]) for r in rows]  # type: ignore[arg-type]
    ys = [float(r["seconds"]) for r in rows]  # type: ignore[arg-type]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    fixed = my - slope * mx
    residual = max(abs(y - (fixed + slope * x)) for x, y in zip(xs, ys, strict=True)) / max(*ys, 1e-9)
    return {
        "rows": rows,
        "per_rank_ratio": round(ratio, 3),
        "per_rank_ratio_between": [first["ranks"], last["ranks"]],
        "fit": {
            "fixed_s": round(fixed, 3),
            "per_rank_ms": round(slope * 1000, 3),
            "max_residual": round(residual, 3),
        },
        "cpus": os.cpu_count(),
    }


def markdown(result: dict[str, object]) -> str:
    lines = [
        "| ranks | files | seconds | seconds per rank | re-check of the committed step |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:  # type: ignore[attr-defined]
        per_rank = f"{r['seconds_per_rank'] * 1000:.2f} ms"
        lines.append(
            f"| {r['ranks']} | {r['files']} | {r['seconds']:.2f} | {per_rank} | {r['recheck_seconds']:.2f} s |"
        )
    a, b = result["per_rank_ratio_between"]  # type: ignore[misc]
    fit = result["fit"]
    lines.append(f"\nseconds per rank at {b} ranks / at {a} ranks: {result['per_rank_ratio']}")
    lines.append(
        f"fit: {fit['fixed_s']} s + {fit['per_rank_ms']} ms x ranks "  # type: ignore[index]
        f"(largest residual: {fit['max_residual']:.0%} of the largest N's time)"  # type: ignore[index]
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)), help="comma-separated world sizes")
    ap.add_argument("--files-per-rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="commits per N; the median is reported")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the largest N; print the top K functions")
    ap.add_argument("--json", default=None, help="also write the JSON result here")
    args = ap.parse_args()
    logging.disable(logging.INFO)  # the stage logs one line per commit; the table is the output
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    result = run(ranks, args.files_per_rank, args.rounds)
    if args.profile:
        result["profile"] = measure(max(ranks), args.files_per_rank, profile=args.profile)["profile"]
    print(markdown(result))
    print(result.pop("profile", ""), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
