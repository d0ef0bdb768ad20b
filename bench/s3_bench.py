"""The S3 path against peers on the same endpoint (SeaweedFS on loopback, started here), as ratios.

    .venv/bin/python bench/s3_bench.py [--mb 512] [--rounds 3] [--ranks 64,256,1024] [--out DIR]

1. **Save throughput**: each of 2 "ranks" (threads) uploads its shard file(s) through the pipeline's rank path
   (``Remote.upload_rank``: multipart, xxh3 of every part while read, the marker object last) vs boto3's own
   ``upload_file`` (s3transfer, the same part size and parts in flight) of the same bytes to the same endpoint.
   Ratio = raw seconds / pipeline seconds (target >= 0.9). Also the whole rank save: ``dcp.save`` into the
   rank's scratch dir + the upload.
2. **Commit time vs ranks**: R simulated ranks (one 64 KiB file + marker each) staged, then one committer's
   ``commit_ready`` (list, read R markers, re-read and hash every object, format check, manifest
   ``If-None-Match``, ``latest`` CAS) timed for R = 64, 256, 1024.
3. **Consolidation from the bucket** of a committed DCP step (one rank, fp32, largest tensor 64 MiB):
   ``Remote.pull`` (ranged GETs, hashed, published) + the streaming consolidation into safetensors, vs a plain
   download of the same objects (s3transfer ``download_file``, 4 at once). Ratio = pipeline / download.

The method order alternates every round; every figure is the median of the rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402
import torch  # noqa: E402
from boto3.s3.transfer import TransferConfig  # noqa: E402

from pipeline.checkpoint.manifest import Marker  # noqa: E402
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer  # noqa: E402
from pipeline.checkpoint.stores.bucket_store import BucketCheckpoints  # noqa: E402
from pipeline.checkpoint.stores.remote import Remote  # noqa: E402
from pipeline.checkpoint.stores.remote_pull import pull  # noqa: E402
from pipeline.formats.registry import FORMATS, Format, _dcp_owner  # noqa: E402
from pipeline.storage import s3  # noqa: E402
from pipeline.storage.integrity import describe  # noqa: E402
from pipeline.storage.layout import CheckpointLayout  # noqa: E402
from pipeline.storage.s3 import IN_FLIGHT, PART_SIZE, S3Url  # noqa: E402
from tests.s3.server import seaweedfs  # noqa: E402

BENCH_FORMAT = "bench-bytes"
FORMATS.setdefault(
    BENCH_FORMAT,
    Format(BENCH_FORMAT, lambda d, _a=False: set(), _dcp_owner, lambda d, _a=False: len(list(d.glob("__*_0.distcp")))),
)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _remote(tmp: Path, bucket: str, name: str) -> tuple[CheckpointLayout, Remote]:
    layout = CheckpointLayout(tmp / name)
    for d in layout.checkpoint_dirs():
        d.mkdir(parents=True, exist_ok=True)
    return layout, Remote(root=S3Url(bucket, f"bench-{uuid.uuid4().hex[:8]}/{name}"), cache_dir=layout.run_dir)


def _files(tmp: Path, mb: int, ranks: int = 2) -> list[Path]:
    out = []
    for r in range(ranks):
        p = tmp / f"__{r}_0.distcp"
        if not p.exists():
            with open(p, "wb") as f:
                chunk = os.urandom(8 << 20)
                for _ in range(max(1, mb // ranks // 8)):
                    f.write(chunk)
        out.append(p)
    return out


def save_throughput(tmp: Path, bucket: str, mb: int, rounds: int) -> dict[str, object]:
    files = _files(tmp, mb)
    total = sum(f.stat().st_size for f in files)
    c = boto3.client("s3")
    cfg = TransferConfig(multipart_threshold=PART_SIZE, multipart_chunksize=PART_SIZE, max_concurrency=IN_FLIGHT)

    def raw() -> float:
        prefix = f"raw-{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        threads = [
            threading.Thread(target=c.upload_file, args=(str(f), bucket, f"{prefix}/{f.name}"), kwargs={"Config": cfg})
            for f in files
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0

    def ours() -> float:
        _, remote = _remote(tmp, bucket, "save")
        markers = [
            Marker(
                step=1, rank=r, world_size=len(files), format=BENCH_FORMAT, attempt="a", files=(describe(tmp, f.name),)
            )
            for r, f in enumerate(files)
        ]  # hashed while written in a real save: not part of the upload's time
        t0 = time.monotonic()
        threads = [threading.Thread(target=remote.upload_rank, args=(tmp, m)) for m in markers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0

    res: dict[str, list[float]] = {"raw": [], "pipeline": []}
    for i in range(rounds):
        order = [("raw", raw), ("pipeline", ours)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            res[name].append(fn())
    ratio = _median([r / p for r, p in zip(res["raw"], res["pipeline"], strict=True)])
    mbps = {k: total / _median(v) / 1e6 for k, v in res.items()}
    return {
        "bytes": total,
        "seconds": {k: _median(v) for k, v in res.items()},
        "MB_per_s": mbps,
        "ratio_raw_over_pipeline": ratio,
    }


def commit_scale(tmp: Path, bucket: str, sizes: list[int]) -> dict[str, object]:
    out: dict[str, object] = {}
    payload = os.urandom(64 << 10)
    for ranks in sizes:
        layout, remote = _remote(tmp, bucket, f"commit{ranks}")
        src = tmp / f"commit{ranks}-src"
        src.mkdir(exist_ok=True)

        def stage(r: int, remote: Remote = remote, src: Path = src, ranks: int = ranks) -> None:
            d = src / str(r)
            d.mkdir(exist_ok=True)
            name = f"__{r}_0.distcp"
            (d / name).write_bytes(payload)
            remote.upload_rank(
                d,
                Marker(step=1, rank=r, world_size=ranks, format=BENCH_FORMAT, attempt="a", files=(describe(d, name),)),
            )

        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(16) as pool:
            list(pool.map(stage, range(ranks)))
        staged_s = time.monotonic() - t0
        committer = Committer(layout, CommitPolicy(world_size=ranks), BucketCheckpoints(layout, remote))
        with committer.hold():
            t0 = time.monotonic()
            done = committer.commit_ready()
            commit_s = time.monotonic() - t0
        assert done == [1], f"{ranks} ranks: commit_ready said {done}, quarantined {committer.report.quarantined}"
        out[str(ranks)] = {"commit_s": commit_s, "stage_all_ranks_s": staged_s, "per_rank_ms": commit_s / ranks * 1e3}
        print(f"  commit of {ranks} ranks: {commit_s:.2f} s ({commit_s / ranks * 1e3:.1f} ms per rank)", flush=True)
    return out


def consolidation(tmp: Path, bucket: str, mb: int, rounds: int) -> dict[str, object]:
    import torch.distributed as dist  # noqa: PLC0415

    from pipeline.checkpoint.save import rank_save  # noqa: PLC0415
    from pipeline.checkpoint.save.rank_save import RankTarget  # noqa: PLC0415
    from pipeline.formats.registry import get_format  # noqa: PLC0415

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    layout, remote = _remote(tmp, bucket, "consolidate")
    n = max(1, mb // 64)
    state = {"model": {f"w{i}": torch.randn(4096, 4096) for i in range(n)}}  # 64 MiB each
    result = rank_save.save_dcp(RankTarget(layout, 0, 1, "a", remote=remote), 1, state, None)
    assert result.ok, result.error
    committer = Committer(layout, CommitPolicy(world_size=1), BucketCheckpoints(layout, remote))
    with committer.hold():
        assert committer.commit_ready() == [1], committer.report.quarantined
    manifest = remote.read_manifest(1)
    assert manifest is not None
    keys = [(remote.attempt_prefix(1, manifest[0].attempt) + f.path, f.path) for f in manifest[0].files]
    c = boto3.client("s3")
    cfg = TransferConfig(multipart_threshold=PART_SIZE, multipart_chunksize=PART_SIZE, max_concurrency=IN_FLIGHT)

    def download() -> float:
        d = Path(tempfile.mkdtemp(dir=tmp))
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda kp: c.download_file(bucket, kp[0], str(d / kp[1]), Config=cfg), keys))
        return time.monotonic() - t0

    def ours() -> float:
        import shutil  # noqa: PLC0415

        shutil.rmtree(layout.checkpoints / "step_1", ignore_errors=True)
        out = Path(tempfile.mkdtemp(dir=tmp)) / "model.safetensors"
        t0 = time.monotonic()
        cache = pull(remote)
        get_format(manifest[0].format).consolidate(cache.committed_step(1), out, None, False)  # type: ignore[misc]
        return time.monotonic() - t0

    res: dict[str, list[float]] = {"download": [], "pipeline": []}
    for i in range(rounds):
        order = [("download", download), ("pipeline", ours)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            res[name].append(fn())
    ratio = _median([p / d for d, p in zip(res["download"], res["pipeline"], strict=True)])
    total = sum(f.size for f in manifest[0].files)
    return {"bytes": total, "seconds": {k: _median(v) for k, v in res.items()}, "ratio_pipeline_over_download": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=512, help="bytes saved (and consolidated) per round, in MB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", default="64,256,1024")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "s3"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="s3bench-") as t:
        tmp = Path(t)
        with seaweedfs(tmp / "weed", volume_mb=1024) as server:
            os.environ.update(server.env())
            s3._clients.clear()
            bucket = server.bucket
            print("save throughput ...", flush=True)
            save = save_throughput(tmp, bucket, args.mb, args.rounds)
            print(json.dumps(save, indent=1), flush=True)
            print("commit time vs ranks ...", flush=True)
            commit = commit_scale(tmp, bucket, [int(x) for x in args.ranks.split(",")])
            print("consolidation from the bucket ...", flush=True)
            cons = consolidation(tmp, bucket, args.mb, args.rounds)
            print(json.dumps(cons, indent=1), flush=True)
    results = {"save": save, "commit": commit, "consolidate": cons, "args": vars(args), "time": time.time()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(
        f"\nsave: pipeline {save['MB_per_s']['pipeline']:.0f} MB/s vs raw multipart {save['MB_per_s']['raw']:.0f} MB/s "  # type: ignore[index]
        f"= {save['ratio_raw_over_pipeline']:.2f}x (target >= 0.9)"
    )
    for ranks, row in commit.items():
        print(f"commit: {ranks} ranks in {row['commit_s']:.2f} s")  # type: ignore[index]
    secs = cons["seconds"]
    print(
        f"consolidation from the bucket: {secs['pipeline']:.2f} s vs download {secs['download']:.2f} s "  # type: ignore[index]
        f"= {cons['ratio_pipeline_over_download']:.2f}x"
    )
    print(f"written: {out / (name + '.json')}")


if __name__ == "__main__":
    main()
