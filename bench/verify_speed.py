"""Does the committer's hashing keep up with a cold read of the same files?

Writes ``files`` files of ``size_mb`` MB each (fsynced) into a scratch dir, then per round, each after the page
cache of those files is dropped (``fsync`` + ``posix_fadvise(POSIX_FADV_DONTNEED)``: no root needed):

* ``read 1``: one reader reads every file in turn (8 MiB ``readinto``): a plain cold copy's read side;
* ``read N``: ``VERIFY_READERS`` threads read the files, one file each at a time: the same disk, read as fast as
  this machine reads it with that many requests in flight;
* ``verify``: ``pipeline.storage.integrity.verify_entries`` over the files' entries (size + xxh3-128), as the
  committer calls it;
* ``verify 1-by-1``: ``verify_entries`` one entry per call (one file read and hashed after another, the way it
  ran before its reads were parallel).

The order of the four rotates every round. ``warm read`` (one reader, pages cached, measured once after
writing) shows that the drop works: a cold read well below it. The ratio asked for is
``verify / max(read 1, read N)`` (at least 0.9: verifying runs at the speed of a cold read).

    .venv/bin/python bench/verify_speed.py                       # 8 files x 128 MB, 3 rounds, ~30 s
    .venv/bin/python bench/verify_speed.py --size-mb 256 --files 4 --rounds 5
    .venv/bin/python bench/verify_speed.py --dir /scratch        # the disk to measure

Scratch disk: ``size_mb * files`` MB (at most 2 GB is allowed), removed at the end. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as run_bench  # noqa: E402 - bench/run.py: stdlib only at import

from pipeline.storage.integrity import VERIFY_READERS, FileEntry, describe, verify_entries  # noqa: E402

MAX_TOTAL_MB = 2048
_CHUNK = 8 << 20


def _write_files(root: Path, size_mb: int, files: int) -> list[FileEntry]:
    block = bytearray(os.urandom(_CHUNK))
    for i in range(files):
        with open(root / f"shard_{i}.bin", "wb") as f:
            left, n = size_mb << 20, 0
            while left:
                block[:16] = f"{i:08d}{n:08d}".encode()  # no two chunks alike
                f.write(memoryview(block)[: min(left, _CHUNK)])
                left -= min(left, _CHUNK)
                n += 1
            f.flush()
            os.fsync(f.fileno())
    return [describe(root, f"shard_{i}.bin") for i in range(files)]


def drop_cache(paths: list[Path]) -> None:
    """Evict the files' pages from the page cache (the same fsync + POSIX_FADV_DONTNEED as bench/run.py)."""
    for p in paths:
        run_bench.drop_cache(p)


def _read(path: Path) -> int:
    buf = bytearray(_CHUNK)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total


def _read_serial(paths: list[Path]) -> int:
    return sum(_read(p) for p in paths)


def _read_parallel(paths: list[Path]) -> int:
    with ThreadPoolExecutor(VERIFY_READERS) as pool:
        return sum(pool.map(_read, paths))


def _timed(fn: object, paths: list[Path], total: int) -> float:
    """GB/s of ``fn()`` over the files after their cache is dropped."""
    drop_cache(paths)
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return total / (time.perf_counter() - t0) / 1e9


def run(size_mb: int = 128, files: int = 8, rounds: int = 3, scratch: str | None = None) -> dict[str, object]:
    """Measure; returns the medians (GB/s) of each method, the ratios, and every round's numbers."""
    if size_mb * files > MAX_TOTAL_MB:
        raise ValueError(f"{files} x {size_mb} MB is more than {MAX_TOTAL_MB} MB of scratch disk")
    root = Path(tempfile.mkdtemp(prefix="verify_speed-", dir=scratch))
    try:
        entries = _write_files(root, size_mb, files)
        paths = [root / e.path for e in entries]
        total = sum(e.size for e in entries)
        t0 = time.perf_counter()
        _read_serial(paths)  # the pages written are still cached (describe just read them)
        warm = total / (time.perf_counter() - t0) / 1e9
        methods = {
            "read 1": lambda: _read_serial(paths),
            "read N": lambda: _read_parallel(paths),
            "verify": lambda: verify_entries(root, entries, "bench"),
            "verify 1-by-1": lambda: [verify_entries(root, [e], "bench") for e in entries],
        }
        names = list(methods)
        per_round: list[dict[str, float]] = []
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            per_round.append({name: round(_timed(methods[name], paths, total), 3) for name in order})
        med = {name: round(statistics.median(rr[name] for rr in per_round), 3) for name in names}
        cold = max(med["read 1"], med["read N"])
        return {
            "files": files,
            "size_mb": size_mb,
            "total_gb": round(total / 1e9, 3),
            "readers": VERIFY_READERS,
            "cpus": os.cpu_count(),
            "warm_read_gbps": round(warm, 3),
            "median_gbps": med,
            "ratio_verify_to_cold_read": round(med["verify"] / cold, 3),
            "ratio_verify_to_read_1": round(med["verify"] / med["read 1"], 3),
            "ratio_one_by_one_to_cold_read": round(med["verify 1-by-1"] / cold, 3),
            "rounds": per_round,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=128, help="size of each file (MB)")
    ap.add_argument("--files", type=int, default=8, help="number of files")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the medians are reported")
    ap.add_argument("--dir", default=None, help="where the scratch dir goes (default: the temp dir)")
    args = ap.parse_args()
    print(json.dumps(run(args.size_mb, args.files, args.rounds, args.dir), indent=2))


if __name__ == "__main__":
    main()
