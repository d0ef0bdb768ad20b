"""Wall-time overhead of the pipeline's shard-save over a plain ``torch.distributed.checkpoint.save``.

Starts 2 ranks (``torch.multiprocessing.spawn``, gloo, ``torch.set_num_threads(1)``), builds on each a state dict
shaped like a training checkpoint (an LLM-like fp32 model plus AdamW ``exp_avg``/``exp_avg_sq``, all ``Shard(0)``
DTensors on ``init_device_mesh("cpu", (2,))``, as FSDP2 stores them; plus small ``sched``/``train``/``rng``
entries, as ``pipeline/stages/train.py:_state``), then times the same state, in the same processes and rounds:

* ``dcp sync``: ``dcp.save(state, storage_writer=FileSystemWriter(dir, sync_files=True))`` into a fresh dir: the
  peer, and the denominator of every ratio;
* ``dcp nosync``: the same with ``sync_files=False`` (no durability; a lower bound);
* ``shard_save``: ``pipeline.checkpoint.save.rank_save.save_dcp(target, step, state, pg)`` (what shard-save and the
  library run) into a fresh step of a checkpoint dir:
  DCP write with fsync (``RecordingWriter``) + xxh3-128 of the rank's own files + atomic done-marker;
* ``hash own``: ``pipeline.integrity.hash_file`` over the files the rank's marker lists, right after
  ``shard_save`` (so the page cache is as warm as inside it), checked against the marker's hashes;
* ``marker``: ``pipeline.manifest.write_marker`` of that marker into an empty dir (write + fsync + rename + dir
  fsync).

The last two attribute the overhead ``shard_save - dcp sync``; so does a breakdown of ``shard_save`` itself: the
names it calls (``dcp.save``, ``describe``, ``write_marker``) are wrapped with timers in its module namespace for
that call (``unittest.mock.patch.object``; the pipeline code is not changed). With ``--cold-hash`` (root),
``hash cold`` repeats ``hash own`` after dropping the page cache: what hashing costs if the written pages are gone.

Each timing runs between barriers on both ranks and counts the slower rank. The order of the three saves changes
every round: the rotations of (sync, shard_save, nosync), then the rotations of the reverse order, so that over 6
rounds each save takes each position and directly follows each other save equally often (``hash own`` and
``marker`` always follow ``shard_save``). An untimed warm-up round runs first. Before each timed save every earlier
output is deleted and ``os.sync()`` runs (plus ``echo 3 > /proc/sys/vm/drop_caches`` with ``--drop-caches``).
Scratch disk: one checkpoint at a time (~0.4 GB by default), in a temp dir removed at the end.

    .venv/bin/python bench/save_overhead.py                  # ~406 MB checkpoint, 3 rounds, about 10 s
    .venv/bin/python bench/save_overhead.py --rounds 18      # steadier medians, about 35 s
    .venv/bin/python bench/save_overhead.py --size-mb 100 --rounds 6
    .venv/bin/python bench/save_overhead.py --drop-caches --cold-hash   # root only

No absolute time is asserted anywhere: the result is the ratio to the DCP peer measured in the same round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

MiB = 1 << 20
WORLD = 2
import synthetic  # noqa: E402 - bench/ is on sys.path when a script runs as bench/<name>.py

VOCAB = synthetic.VOCAB
BASE_DIM = 768  # hidden size at the default 400 MB (3 layers); scales with sqrt(size), as in consolidate_rss.py
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
SYNC, NOSYNC, PIPE, HASH, MARK, COLD = "dcp sync", "dcp nosync", "shard_save", "hash own", "marker", "hash cold"
METHODS = (SYNC, NOSYNC, PIPE, HASH, MARK, COLD)
DESCRIPTIONS = {
    SYNC: "(a) dcp.save, FileSystemWriter(sync_files=True): the peer",
    NOSYNC: "(a') dcp.save, FileSystemWriter(sync_files=False)",
    PIPE: "(b) pipeline shard_save.save",
    HASH: "(c) hash_file over own files, right after (b)",
    MARK: "(d) write_marker alone",
    COLD: "(c') hash_file over own files, page cache dropped",
}


# --------------------------------------------------------------------------------------------- synthetic state


def model_layout(size_mb: float) -> tuple[int, list[tuple[str, tuple[int, ...]]]]:
    return synthetic.model_layout(size_mb, BASE_DIM, 400)


def build_state(mesh: Any, rank: int, size_mb: float) -> tuple[dict[str, Any], int]:
    """This rank's state dict (train.py ``_state`` shape) and the bytes of its local tensor shards."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(1234 + rank)
    local_bytes = 0

    def shard(shape: tuple[int, ...], positive: bool = False) -> DTensor:
        nonlocal local_bytes
        rows = shape[0] // WORLD  # every dim-0 size here is even: each rank holds exactly half the rows
        local = torch.randn((rows, *shape[1:]), generator=g, dtype=torch.float32)
        if positive:
            local.abs_()
        local_bytes += local.nbytes
        full = torch.Size(shape)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full, stride=_contiguous(full))

    _, layout = model_layout(size_mb)
    model, optim_state = {}, {}
    for name, shape in layout:
        model[name] = shard(shape)
        optim_state[name] = {"step": torch.tensor(7.0), "exp_avg": shard(shape), "exp_avg_sq": shard(shape, True)}
    state = synthetic.training_state(model, optim_state, rank)
    return state, local_bytes


def _contiguous(shape: Any) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


# --------------------------------------------------------------------------------------------- per rank

PHASES = ("dcp.save", "describe", "write_marker")


@contextlib.contextmanager
def _phase_timers(module: Any, acc: dict[str, float]) -> Iterator[None]:
    """Time the three calls ``shard_save.save`` makes, by wrapping the names it looks up in its own module
    (``dcp.save``, ``describe``: stat + xxh3-128 of one file, ``write_marker``); the code itself is unchanged."""

    def timer(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += time.perf_counter() - t0

        return wrapped

    dcp_ns = types.SimpleNamespace(save=timer("dcp.save", module.dcp.save))
    with (
        mock.patch.object(module, "dcp", dcp_ns),
        mock.patch.object(module, "describe", timer("describe", module.describe)),
        mock.patch.object(module, "write_marker", timer("write_marker", module.write_marker)),
    ):
        yield


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Bench:
    """One rank's side of the measurement; rank 0 also cleans up and records the results."""

    def __init__(self, rank: int, scratch: Path, opts: dict[str, Any], pg: Any, state: dict[str, Any]) -> None:
        from pipeline.checkpoint.save.rank_save import RankTarget, auto_writer_threads
        from pipeline.storage.layout import CheckpointLayout

        self.rank, self.scratch, self.opts, self.pg, self.state = rank, scratch, opts, pg, state
        layout = CheckpointLayout(scratch / "runs" / "save-overhead")
        if rank == 0:
            layout.staging.mkdir(parents=True, exist_ok=True)
        # fail_on_error: a failed save raises here instead of returning ok=False
        self.target = RankTarget(layout, rank, WORLD, "bench", auto_writer_threads(WORLD), fail_on_error=True)
        self.runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        self.last = ""  # the save method timed just before (its output is what _prepare deleted)
        self.step = 0  # a fresh step number for every shard_save (4, 8, 12, ... as with checkpoint.every=4)

    # -- helpers

    def _prepare(self) -> None:
        """Untimed, before every timed save: rank 0 deletes every earlier output (so each save starts from the
        same state: the previous method's output just deleted), syncs (and drops caches); both ranks then meet."""
        import torch.distributed as dist

        dist.barrier()
        if self.rank == 0:
            stale = [self.scratch / SYNC.replace(" ", "_"), self.scratch / NOSYNC.replace(" ", "_")]
            stale += [p for p in self.target.layout.staging.iterdir()]
            for p in stale:
                shutil.rmtree(p, ignore_errors=True)
            os.sync()
            if self.opts["drop_caches"]:
                DROP_CACHES.write_text("3\n")
        dist.barrier()

    def _timed(self, fn: Callable[[], None]) -> list[float]:
        """Both ranks run ``fn`` between barriers; every rank's own seconds."""
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        fn()
        own = time.perf_counter() - t0
        dist.barrier()
        times: list[Any] = [None] * WORLD
        dist.all_gather_object(times, own)
        return times

    def _record(self, method: str, rnd: int, times: list[float], nbytes: int) -> None:
        if rnd < 0:
            return  # warm-up
        wall = max(times)
        self.runs[method].append({"round": rnd, "wall_s": wall, "rank_s": times, "bytes": nbytes, "after": self.last})
        if method in (SYNC, NOSYNC, PIPE):
            self.last = method
        if self.rank == 0:
            ranks = " ".join(f"r{i} {t:.3f}" for i, t in enumerate(times))
            gbs = f"{nbytes / wall / 1e9:5.2f} GB/s" if nbytes else ""
            print(f"  round {rnd + 1} {method:10s} {wall:7.3f} s  ({ranks})  {gbs}", flush=True)

    # -- methods

    def dcp_plain(self, rnd: int, sync: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        method = SYNC if sync else NOSYNC
        out = self.scratch / method.replace(" ", "_") / f"round_{rnd + 1}"
        self._prepare()

        def go() -> None:
            dcp.save(self.state, storage_writer=FileSystemWriter(str(out), sync_files=sync), process_group=self.pg)

        times = self._timed(go)
        self._record(method, rnd, times, dir_bytes(out) if self.rank == 0 else 0)

    def pipeline_then_hash(self, rnd: int) -> None:
        import torch.distributed as dist

        from pipeline.checkpoint.manifest import read_marker, write_marker
        from pipeline.checkpoint.save import rank_save
        from pipeline.storage.integrity import hash_file

        self.step += 4
        step = self.step
        staged = self.target.layout.staged_step(step)
        self._prepare()
        ok: list[rank_save.SaveResult] = []
        phases = dict.fromkeys(PHASES, 0.0)
        with _phase_timers(rank_save, phases):
            times = self._timed(lambda: ok.append(rank_save.save_dcp(self.target, step, self.state, self.pg)))
        if not ok[0].ok:
            raise RuntimeError(f"rank {self.rank}: shard_save.save failed for step {step}")
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, phases)
        self._record(PIPE, rnd, times, dir_bytes(staged) if self.rank == 0 else 0)
        if rnd >= 0:
            self.runs[PIPE][-1]["phases"] = {k: [g[k] for g in gathered] for k in PHASES}

        # (c): the same hashing the stage does, over the files this rank's marker lists (cache as warm as in (b))
        marker = read_marker(staged, self.rank)
        if marker is None or marker.attempt != "bench" or marker.step != step:
            raise RuntimeError(f"rank {self.rank}: no valid marker in {staged}")
        digests: list[str] = []
        times = self._timed(lambda: digests.extend(hash_file(staged / f.path) for f in marker.files))
        if digests != [f.hash for f in marker.files]:
            raise RuntimeError(f"rank {self.rank}: re-hash differs from the marker in {staged}")
        sizes: list[Any] = [None] * WORLD
        dist.all_gather_object(sizes, sum(f.size for f in marker.files))
        self._record(HASH, rnd, times, sum(sizes))

        # (d): the marker alone, into an empty directory on the same filesystem
        mdir = self.scratch / "markers" / f"step_{step}"
        mdir.mkdir(parents=True, exist_ok=True)
        times = self._timed(lambda: write_marker(mdir, marker))
        self._record(MARK, rnd, times, 0)

        if self.opts["cold_hash"]:  # (c'): what hashing would cost if the written pages had left the page cache
            dist.barrier()
            if self.rank == 0:
                os.sync()
                DROP_CACHES.write_text("3\n")
            times = self._timed(lambda: [hash_file(staged / f.path) for f in marker.files])
            self._record(COLD, rnd, times, sum(sizes))

    def round(self, rnd: int) -> None:
        units: list[Callable[[], None]] = [
            lambda: self.dcp_plain(rnd, sync=True),
            lambda: self.pipeline_then_hash(rnd),
        ]
        if self.opts["nosync"]:
            units.append(lambda: self.dcp_plain(rnd, sync=False))
        for i in unit_order(len(units), max(rnd, 0)):
            unit = units[i]
            unit()


def unit_order(n: int, rnd: int) -> list[int]:
    """Round ``rnd``'s order of ``n`` units: the rotations of 0..n-1, then the rotations of the reverse order.

    Each unit takes each position once per n rounds; over 2n rounds each unit also directly follows every other one
    equally often within rounds (which matters: a save after a deleted fsynced output is not the same as one after
    a deleted unsynced one).
    """
    base = list(range(n)) if (rnd // n) % 2 == 0 else list(reversed(range(n)))
    k = rnd % n
    return base[k:] + base[:k]


def _rank_main(rank: int, port: int, scratch: str, opts: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        pg = dist.new_group(backend="gloo")  # as train.py: checkpoint collectives on their own group
        t0 = time.perf_counter()
        state, local_bytes = build_state(mesh, rank, opts["size_mb"])
        build_s = time.perf_counter() - t0
        bench = Bench(rank, Path(scratch), opts, pg, state)
        if rank == 0:
            print(f"state built in {build_s:.1f} s: {local_bytes / 1e6:.1f} MB of tensor shards per rank", flush=True)
        for w in range(opts["warmup"]):
            if rank == 0:
                print(f"warm-up round {w + 1} (not reported) ...", flush=True)
            bench.round(-1 - w)
        for r in range(opts["rounds"]):
            bench.round(r)
        dist.barrier()
        if rank == 0:
            res = {"runs": bench.runs, "local_bytes": local_bytes, "build_s": build_s, "opts": opts}
            (Path(scratch) / "results.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- report


def _fmt(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}-{format(max(xs), fmt)}]"


def report(res: dict[str, Any]) -> None:
    runs = res["runs"]
    wall = {m: [x["wall_s"] for x in runs[m]] for m in METHODS if runs[m]}
    ckpt_bytes = runs[SYNC][0]["bytes"]
    n = len(wall[SYNC])
    print()
    print(f"checkpoint: {ckpt_bytes:,} B ({ckpt_bytes / MiB:.1f} MiB) written by {WORLD} ranks per save; ", end="")
    print(f"{n} rounds, median [min-max]; wall = slower rank, between barriers")
    print()
    cols = [("method", 58), ("wall s", 22), ("GB/s", 20), ("/ (a) per round", 22)]
    print("| " + " | ".join(f"{c:{w}s}" for c, w in cols) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w in cols) + "|")
    for m, ts in wall.items():
        nbytes = [x["bytes"] for x in runs[m]]
        gbs = [b / t / 1e9 for b, t in zip(nbytes, ts, strict=True)] if nbytes[0] else []
        cells = [DESCRIPTIONS[m], _fmt(ts, ".3f"), _fmt(gbs, ".2f") if gbs else "-", _fmt(_div(ts, wall[SYNC]), ".3f")]
        print("| " + " | ".join(f"{c:{w}s}" for c, (_, w) in zip(cells, cols, strict=True)) + " |")
    over = [b - a for b, a in zip(wall[PIPE], wall[SYNC], strict=True)]
    explained = [c + d for c, d in zip(wall[HASH], wall[MARK], strict=True)]
    med = statistics.median
    print()
    print(f"shard_save / dcp sync (b)/(a), per round: {_fmt(_div(wall[PIPE], wall[SYNC]), '.3f')}", end="")
    print(f"; ratio of medians {med(wall[PIPE]) / med(wall[SYNC]):.3f}")
    print(f"overhead (b)-(a) per round: {_fmt(over, '+.3f')} s")
    print(f"hash + marker (c)+(d) per round: {_fmt(explained, '.3f')} s", end="")
    print(f" = {med(explained) / med(wall[SYNC]):.3f} x (a) (medians)")
    unexplained = [o - e for o, e in zip(over, explained, strict=True)]
    print(f"unexplained (b)-(a)-(c)-(d) per round: {_fmt(unexplained, '+.3f')} s")
    if NOSYNC in wall:
        print(f"(a)/(a'), the cost of fsync, per round: {_fmt(_div(wall[SYNC], wall[NOSYNC]), '.3f')}")
    print()
    print("inside (b), per rank phase, slower rank per round (the calls shard_save.save makes, wrapped in place):")
    for k in PHASES:
        xs = [max(x["phases"][k]) for x in runs[PIPE]]
        print(f"  {k:13s} {_fmt(xs, '.3f')} s  = {_fmt(_div(xs, wall[SYNC]), '.3f')} x (a) of the same round")
    rest = [t - sum(x["phases"][k][r] for k in PHASES) for x in runs[PIPE] for r, t in enumerate(x["rank_s"])]
    print(f"  {'rest':13s} {_fmt(rest, '.4f')} s (mkdir, clear_file, logging, barrier skew; both ranks, all rounds)")


def _div(xs: list[float], ys: list[float]) -> list[float]:
    return [x / y for x, y in zip(xs, ys, strict=True)]


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=400, help="approximate total checkpoint size, MB (default 400)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, order rotated (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds first (default 1)")
    ap.add_argument("--no-nosync", dest="nosync", action="store_false", help="skip the sync_files=False variant")
    ap.add_argument("--drop-caches", action="store_true", help="echo 3 > /proc/sys/vm/drop_caches before each method")
    ap.add_argument("--cold-hash", action="store_true", help="also time (c) after dropping the page cache (root)")
    ap.add_argument("--tmpdir", default=None, help="parent of the scratch dir (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    args = ap.parse_args()
    if (args.drop_caches or args.cold_hash) and not os.access(DROP_CACHES, os.W_OK):
        ap.error(f"--drop-caches and --cold-hash need write access to {DROP_CACHES} (root); uid is {os.getuid()}")

    opts = {k: getattr(args, k) for k in ("size_mb", "rounds", "warmup", "nosync", "drop_caches", "cold_hash")}
    dim, layout = model_layout(args.size_mb)
    print(f"save_overhead: {WORLD} ranks (gloo, 1 thread each), hidden {dim}, {len(layout)} params x 3 tensors")
    print(f"options: {opts}")
    scratch = Path(tempfile.mkdtemp(prefix="save_overhead_", dir=args.tmpdir))
    print(f"scratch: {scratch}; page cache {'dropped' if args.drop_caches else 'not dropped'} before each method")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        mp.spawn(_rank_main, args=(port, str(scratch), opts), nprocs=WORLD, join=True)
        print(f"total {time.perf_counter() - t0:.1f} s (spawn to join)")
        report(json.loads((scratch / "results.json").read_text()))
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
