"""All of bench/ in one run: save throughput, consolidation, DeepSpeed, verify, async blocking, scale.

    bash bench/run.sh [--quick] [--device cuda] [--out DIR]       # sets up .venv, then runs this file
    .venv/bin/python bench/run.py [--quick] [--rounds N] [--sizes 256,512,1024] [--save-mb 768] [--out DIR]

Writes ``results.json``, ``results.md`` and ``plot.png`` into ``<out>/<UTC timestamp>/`` (default out:
``bench/results``) and copies them to ``<out>/latest/``. Every figure is the median of ``--rounds`` rounds
(default 3, ``--quick`` 1); the order of the methods is rotated every round, and every ratio to a peer is the
median of per-round ratios (both sides measured in the same round). Scratch data goes to a temp dir (``--tmpdir``)
that is removed at the end.

Sections:

1. ``save``: throughput of writing an LLM-like fp32 training state (model + AdamW moments), every method fsyncing
   its files, against the disk limit (the best of 1, 2 and 4 parallel raw ``write`` + ``fsync`` streams of the
   same tensors). Methods: ``dcp.save`` (2 ranks, defaults), ``dcp.async_save`` (2 ranks; total and blocking
   time), ``torch.save`` + fsync and ``safetensors.torch.save_file`` + fsync (one process, the whole state),
   torch-checkpointing's ``CheckpointManager.save`` (2 ranks, its default torch-serialization layout; it never
   fsyncs, so the files are fsynced after it inside the timed region), and the pipeline's shard save:
   ``dcp.save(state, storage_writer=RecordingWriter(path, threads=T))`` for T = 1, 2, 4.
2. ``consolidation``: one model-only 2-rank FSDP-style (``Shard(0)`` DTensor) checkpoint per size, written in
   the three input formats (the pipeline's ``RecordingWriter``, DCP's ``HuggingFaceStorageWriter`` sharded per
   rank, torch-checkpointing's safetensors layout), then each method in a fresh process under
   ``/usr/bin/time -v`` with the input dropped from the page cache (fsync + ``POSIX_FADV_DONTNEED``): the
   pipeline's ``consolidate_dcp``, ``dcp_to_torch_save``, ``consolidate_safetensors_files``,
   torch-checkpointing's ``consolidate_hf_safetensors_checkpoint``, ``cat`` of the shard files (the copy floor)
   and ``import torch`` (the baseline). Every output is fsynced; outputs are checked tensor by tensor.
3. ``deepspeed``: ``bench/consolidate_zero.py`` (pipeline vs ``zero_to_fp32``), folded in from its JSON.
4. ``verify``, ``async_blocking``, ``scale``, ``stage_overhead``: ``run()`` of ``bench/verify_speed.py``,
   ``bench/async_blocking.py``, ``bench/scale_commit.py`` and ``bench/stage_overhead.py`` when those files
   exist (skipped with a note otherwise).

Only the standard library is imported at module level so that the measured children import just what they use.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
for _p in (str(BENCH), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import synthetic  # noqa: E402

MiB = 1 << 20
GB = 1e9
WORLD = 2
TIME_BIN = "/usr/bin/time"
DIM = 1024  # hidden size: the embedding / lm_head are VOCAB x DIM fp32 = 32 MiB, the largest tensors
CHILD_TIMEOUT_S = 900
PIPELINE_THREADS = (1, 2, 4)
DISK_STREAMS = (1, 2, 4)
SINGLE = "single"  # methods rank 0 runs alone on the whole state
DUAL = "dual"  # methods both ranks run on their halves
SAVE_METHODS: dict[str, str] = {
    **{f"disk x{n}": SINGLE for n in DISK_STREAMS},
    "dcp.save": DUAL,
    "dcp.async_save": DUAL,
    "torch.save": SINGLE,
    "safetensors.save_file": SINGLE,
    "torch-checkpointing": DUAL,
    **{f"pipeline T={t}": DUAL for t in PIPELINE_THREADS},
}
BASELINES = ("baseline", "import pipeline")  # `import torch`; the pipeline child's imports alone
CONSOLIDATE_METHODS = (*BASELINES, "pipeline", "dcp_to_torch_save", "consolidate_safetensors_files", "tc_hf", "cat")
TARGETS = {
    "pipeline / disk limit": 0.85,
    "pipeline / dcp.save": 1.5,
    "dcp_to_torch_save / pipeline": 4.0,
    "consolidate_safetensors_files / pipeline": 3.0,
    "pipeline / cat": 1.5,  # at most
    "tc_hf / pipeline": 1.0,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def rng(xs: list[float], fmt: str = ".2f") -> str:
    if not xs:
        return "–"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(med(xs), fmt)} [{format(min(xs), fmt)}–{format(max(xs), fmt)}]"


def rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path, only: Callable[[Path], bool] | None = None) -> None:
    """fsync every file under ``path`` (or ``path`` itself), then the directories."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        if only is None or only(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    dirs = [path.parent] if path.is_file() else [path, *(p for p in path.rglob("*") if p.is_dir())]
    for d in dirs:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: Path) -> None:
    """Evict ``path``'s files from the page cache: fsync (dirty pages cannot be dropped) + POSIX_FADV_DONTNEED."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def check_cold(scratch: Path, size_mb: int) -> dict[str, Any]:
    """Does fsync + POSIX_FADV_DONTNEED really make reads cold here? Time a warm and a dropped read."""
    p = scratch / "cold_check.bin"
    block = os.urandom(MiB)
    with open(p, "wb") as f:
        for _ in range(size_mb):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    buf = bytearray(16 * MiB)

    def read() -> float:
        t0 = time.perf_counter()
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return time.perf_counter() - t0

    read()
    warm = min(read(), read())
    colds = []
    for _ in range(2):
        drop_cache(p)
        colds.append(read())
    p.unlink()
    cold = min(colds)
    res = {
        "file_mb": size_mb,
        "warm_read_GBps": size_mb * MiB / warm / GB,
        "cold_read_GBps": size_mb * MiB / cold / GB,
        "cold_over_warm_time": cold / warm,
        "works": cold / warm > 1.5,
    }
    log(
        f"cold-cache check ({size_mb} MiB): warm read {res['warm_read_GBps']:.2f} GB/s, after fsync + "
        f"POSIX_FADV_DONTNEED {res['cold_read_GBps']:.2f} GB/s ({res['cold_over_warm_time']:.1f}x the time)"
        + ("" if res["works"] else "  <- WARNING: dropping the cache has no visible effect here")
    )
    return res


# ================================================================================================= 1. save


def _gen(shape: tuple[int, ...], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def _host_view(t: Any, staging: Any) -> memoryview:
    """The bytes of ``t`` in host memory: a view for CPU tensors; for CUDA ones a copy into pinned ``staging``."""
    import torch

    flat = t.detach().reshape(-1).view(torch.uint8)
    if flat.is_cuda:
        out = staging[: flat.numel()]
        out.copy_(flat)
        flat = out
    return memoryview(flat.numpy())


def raw_streams(tensors: list[Any], out: Path, n: int) -> None:
    """Write the tensors' bytes into ``n`` files by ``n`` threads (os.write, then fsync each file)."""
    import torch

    out.mkdir(parents=True)
    groups: list[list[Any]] = [[] for _ in range(n)]
    sizes = [0] * n
    for t in sorted(tensors, key=lambda t: -t.numel()):
        i = sizes.index(min(sizes))
        groups[i].append(t)
        sizes[i] += t.numel() * t.element_size()
    largest = max(t.numel() * t.element_size() for t in tensors)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            staging = None
            if any(t.is_cuda for t in groups[i]):
                staging = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
            fd = os.open(out / f"stream_{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for t in groups[i]:
                    mv = _host_view(t, staging)
                    while mv:
                        mv = mv[os.write(fd, mv[: 1 << 30]) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    fsync_tree(out, only=lambda p: False)


def _patch_tc_metadata_gather() -> None:
    """torch-checkpointing 0.1.1 all-gathers its metadata through CUDA tensors (metadata_manager.py
    ``_all_gather_pickled_data``: ``device="cuda"``), which fails on a CPU-only machine; gather the same objects
    with ``all_gather_object`` instead (only used when an item declares a resharder)."""
    import torch.distributed as dist
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    def gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    DefaultMetadataManager._all_gather_pickled_data = gather  # type: ignore[method-assign]


def _tc_storage() -> Any:
    """Buffered I/O: the default O_DIRECT stream fails with EINVAL on close when a file's size is not a
    multiple of the block size (torch-checkpointing 0.1.1, ext4 here)."""
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return LocalFileSystemStorageConfig(use_direct_io=False)


def _build_save_state(rank: int, cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(rank 0: the whole state as plain tensors, for the one-process methods; this rank's training state of
    ``Shard(0)`` DTensors, as FSDP2 holds it). Rank 0's shards are views of its whole tensors (no extra memory)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(dev.type, (WORLD,))
    _, layout = synthetic.model_layout(cfg["size_mb"], DIM, cfg["size_mb"], DIM)
    full: dict[str, Any] = {}
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for i, (name, shape) in enumerate(layout):
        parts = []
        for salt, key in enumerate((f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq")):
            half = (shape[0] // WORLD, *shape[1:])
            if rank == 0:
                t = _gen(shape, 3 * i + salt).to(dev)
                full[key] = t
                local = t[: half[0]]
            else:
                local = _gen(half, 10**6 + 3 * i + salt).to(dev)
            parts.append(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        model[name] = parts[0]
        optim[name] = {"step": torch.tensor(7.0), "exp_avg": parts[1], "exp_avg_sq": parts[2]}
    return full, synthetic.training_state(model, optim, rank)


class _Saver:
    """One rank's side of the save section."""

    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import SyncCheckpointSaverConfig

        self.rank = rank
        self.full, self.state = _build_save_state(rank, cfg)
        self.tc = CheckpointManager(
            CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=_tc_storage())
        )

    def run(self, method: str, out: Path) -> float | None:
        """Run one method into ``out``; return its blocking time where that differs from the total."""
        import torch
        import torch.distributed.checkpoint as dcp

        if method.startswith("disk x"):
            raw_streams(list(self.full.values()), out, int(method[len("disk x") :]))
        elif method in ("torch.save", "safetensors.save_file"):
            out.mkdir()
            if method == "torch.save":
                torch.save(self.full, out / "state.pt")
            else:
                from safetensors.torch import save_file

                save_file(self.full, str(out / "state.safetensors"))
            fsync_tree(out)
        elif method == "dcp.save":
            dcp.save(self.state, checkpoint_id=str(out))  # FileSystemWriter(sync_files=True)
        elif method == "dcp.async_save":
            t0 = time.perf_counter()
            fut = dcp.async_save(self.state, checkpoint_id=str(out))
            blocking = time.perf_counter() - t0
            getattr(fut, "upload_completion", fut).result()
            return blocking
        elif method == "torch-checkpointing":
            import torch.distributed as dist

            self.tc.save(str(out), self.state)
            dist.barrier()  # rank 0 renames the temp dir into place after the others have written
            # it never fsyncs: each rank fsyncs its own files (named <item>_<rank>.pt), and the directories
            fsync_tree(out, only=lambda p: p.stem.endswith(f"_{self.rank}"))
        elif method.startswith("pipeline T="):
            from pipeline.formats.dcp import RecordingWriter

            dcp.save(self.state, storage_writer=RecordingWriter(out, threads=int(method[len("pipeline T=") :])))
        else:
            raise ValueError(method)
        return None


def _save_worker(rank: int, port: int, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        saver = _Saver(rank, cfg)
        scratch = Path(cfg["scratch"])
        names = list(cfg["methods"])
        runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        orders: list[list[str]] = []
        for r in range(-cfg["warmup"], cfg["rounds"]):  # negative rounds: untimed warm-up
            order = rotated(names, r)
            if r >= 0:
                orders.append(order)
            for n in order:
                out = scratch / f"save_{n.replace(' ', '_').replace('=', '')}"
                dist.barrier()
                t0 = time.perf_counter()
                blocking = saver.run(n, out) if SAVE_METHODS[n] == DUAL or rank == 0 else None
                dist.barrier()
                dt = time.perf_counter() - t0
                if rank == 0:
                    size = tree_bytes(out)
                    shutil.rmtree(out)
                    os.sync()
                    rec = {"s": dt, "bytes": size, "GBps": size / dt / GB}
                    if blocking is not None:
                        rec["blocking_s"] = blocking
                    extra = f"  blocking {blocking:.3f}s" if blocking is not None else ""
                    what = f"round {r + 1}" if r >= 0 else "warm-up"
                    log(f"  save {what} {n:22s} {dt:6.3f}s  {size / dt / GB:5.2f} GB/s{extra}")
                    if r >= 0:
                        runs[n].append(rec)
                dist.barrier()
        saver.tc.close()
        if rank == 0:
            state_bytes = sum(t.numel() * t.element_size() for t in saver.full.values())
            res = {"runs": runs, "orders": orders, "state_bytes": state_bytes, "tensors": len(saver.full)}
            Path(cfg["result"]).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _save_entry(cfg_path: str) -> None:
    import torch.multiprocessing as mp

    cfg = json.loads(Path(cfg_path).read_text())
    mp.spawn(_save_worker, args=(free_port(), cfg), nprocs=WORLD, join=True)


def section_save(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    d = scratch / "save"
    d.mkdir()
    cfg = {
        "size_mb": args.save_mb,
        "device": args.device,
        "rounds": args.rounds,
        "warmup": 1,
        "scratch": str(d),
        "methods": list(SAVE_METHODS),
        "result": str(d / "result.json"),
    }
    (d / "cfg.json").write_text(json.dumps(cfg))
    log(f"save: {args.save_mb} MB state on {args.device}, {len(SAVE_METHODS)} methods x {args.rounds} rounds")
    p = subprocess.run([sys.executable, __file__, "--_save", str(d / "cfg.json")], check=False, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"the save section failed ({p.returncode})")
    res = json.loads((d / "result.json").read_text())
    shutil.rmtree(d, ignore_errors=True)
    runs = res["runs"]
    rounds = len(res["orders"])
    disk = [max(runs[f"disk x{n}"][r]["GBps"] for n in DISK_STREAMS) for r in range(rounds)]
    summary: dict[str, dict[str, Any]] = {}
    for n, xs in runs.items():
        summary[n] = {
            "s": med([x["s"] for x in xs]),
            "GBps": med([x["GBps"] for x in xs]),
            "bytes": xs[0]["bytes"],
            "of_disk_limit": med([x["GBps"] / disk[r] for r, x in enumerate(xs)]),
            "vs_dcp_save": med([runs["dcp.save"][r]["s"] / x["s"] for r, x in enumerate(xs)]),
        }
        if "blocking_s" in xs[0]:
            summary[n]["blocking_s"] = med([x["blocking_s"] for x in xs])
    best = max((f"pipeline T={t}" for t in PIPELINE_THREADS), key=lambda n: summary[n]["GBps"])
    ratios = {
        "best pipeline": best,
        "pipeline / disk limit": summary[best]["of_disk_limit"],
        "pipeline / dcp.save": summary[best]["vs_dcp_save"],
        "disk limit GBps": med(disk),
        "disk limit per round GBps": disk,
    }
    return {**res, "device": args.device, "size_mb": args.save_mb, "summary": summary, "ratios": ratios}


# ========================================================================================= 2. consolidation


def _cons_layout(size_mb: float) -> list[tuple[str, tuple[int, ...]]]:
    """A model-only layout of about ``size_mb`` MB (synthetic.model_layout sizes model + AdamW moments)."""
    return synthetic.model_layout(3 * size_mb, DIM, 3 * size_mb, DIM)[1]


def _cons_build_worker(rank: int, port: int, size_mb: float, dirs: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder

    from pipeline.formats.dcp import RecordingWriter

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _patch_tc_metadata_gather()
        mesh = init_device_mesh("cpu", (WORLD,))
        model = {}
        for i, (name, shape) in enumerate(_cons_layout(size_mb)):
            local = _gen(shape, i).chunk(WORLD)[rank].clone()
            model[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        dcp.save({"model": model}, storage_writer=RecordingWriter(Path(dirs["pipeline"])))
        dcp.save(model, storage_writer=HuggingFaceStorageWriter(dirs["hf"], save_distributed=True))
        spec = ItemSpec(
            layout=LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization()), resharder=DefaultResharder()
        )
        cfg = CheckpointManager.Config(
            items={"model": spec}, save=SyncCheckpointSaverConfig(), storage_config=_tc_storage()
        )
        tc = cfg.build()
        tc.save(dirs["tc"], {"model": model})
        tc.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _safetensors_names(path: Path) -> list[str]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def child(name: str, src: Path, out: Path) -> None:
    """One measured consolidation; prints the in-process time from just after the imports to the end (fsync
    of the output included)."""
    out.mkdir(parents=True, exist_ok=True)
    if name == "pipeline":
        from pipeline.formats.dcp_stream import consolidate_dcp

        t0 = time.perf_counter()
        consolidate_dcp(src, out / "model.safetensors")  # fsyncs its output
    elif name == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        t0 = time.perf_counter()
        dcp_to_torch_save(src, out / "full.pt")
        fsync_tree(out)
    elif name == "consolidate_safetensors_files":
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        t0 = time.perf_counter()
        names = {n for p in sorted(src.glob("*.safetensors")) for n in _safetensors_names(p)}
        consolidate_safetensors_files(str(src), str(out), dict.fromkeys(sorted(names), 1))
        fsync_tree(out)
    elif name == "tc_hf":
        from torch_checkpointing.hf.consolidation import consolidate_hf_safetensors_checkpoint

        t0 = time.perf_counter()
        consolidate_hf_safetensors_checkpoint(str(src), output_dir=str(out), storage_config=_tc_storage())
        fsync_tree(out)
    else:
        raise ValueError(name)
    print(json.dumps({"inproc_s": time.perf_counter() - t0}))


# Without /usr/bin/time: a fresh wrapper process per measurement runs the command and reports its
# RUSAGE_CHILDREN peak (the wrapper's own memory is not included; only its one child is).
_RUSAGE_WRAPPER = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
    "print('Maximum resident set size (kbytes):', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
    "file=sys.stderr); sys.exit(rc)"
)


def measure(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd`` in a fresh process: peak RSS (MiB), wall time (s) and the JSON line it printed, if any."""
    wrapper = [TIME_BIN, "-v"] if os.access(TIME_BIN, os.X_OK) else [sys.executable, "-c", _RUSAGE_WRAPPER]
    full = [*wrapper, *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(full, capture_output=True, text=True, check=False, timeout=CHILD_TIMEOUT_S)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    if not m:
        raise RuntimeError(f"no peak RSS reported:\n{p.stderr[-2000:]}")
    res: dict[str, float] = {"wall_s": wall, "rss_mib": int(m.group(1)) / 1024}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            res.update(json.loads(line))
    return res


def verify_consolidated(outs: dict[str, Path], size_mb: float) -> str:
    """Every method's output equals the pipeline's tensor for tensor, and the pipeline's equals the source."""
    import torch
    from safetensors import safe_open

    layout = _cons_layout(size_mb)
    ref = outs["pipeline"] / "model.safetensors"
    checked: dict[str, int] = {}
    with safe_open(str(ref), "pt") as a:
        names = sorted(a.keys())
        if names != sorted(n for n, _ in layout):
            raise AssertionError("pipeline output: names differ from the source")
        for i, (n, shape) in enumerate(layout):
            if not torch.equal(a.get_tensor(n), _gen(shape, i)):
                raise AssertionError(f"pipeline output: {n} differs from the source")
        checked["source"] = len(names)
        pt = torch.load(outs["dcp_to_torch_save"] / "full.pt", weights_only=True, mmap=True)["model"]
        others: dict[str, Any] = {"dcp_to_torch_save": pt}
        for m in ("consolidate_safetensors_files", "tc_hf"):
            files = sorted(outs[m].glob("*.safetensors"))
            if len(files) != 1:
                raise AssertionError(f"{m}: expected one output file, found {[p.name for p in files]}")
            others[m] = safe_open(str(files[0]), "pt")
        for m, o in others.items():
            keys = sorted(o.keys())
            if keys != names:
                raise AssertionError(f"{m}: names differ: {sorted(set(keys) ^ set(names))[:5]}")
            for n in names:
                x = o[n] if isinstance(o, dict) else o.get_tensor(n)
                if not torch.equal(x, a.get_tensor(n)):
                    raise AssertionError(f"{m}: {n} differs from the pipeline's")
            checked[m] = len(names)
    return ", ".join(f"{k} {v}/{len(names)}" for k, v in checked.items()) + " tensors equal (torch.equal)"


def _consolidate_one(args: argparse.Namespace, scratch: Path, size_mb: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    d = scratch / f"cons_{int(size_mb)}"
    dirs = {k: d / k for k in ("pipeline", "hf", "tc")}
    d.mkdir()
    layout = _cons_layout(size_mb)
    largest = max(math.prod(s) * 4 for _, s in layout)
    log(f"consolidation {size_mb:.0f} MB: 3 input formats, {len(layout)} tensors, largest {largest / MiB:.0f} MiB")
    t0 = time.perf_counter()
    mp.spawn(_cons_build_worker, args=(free_port(), size_mb, {k: str(v) for k, v in dirs.items()}), nprocs=WORLD)
    for v in dirs.values():
        fsync_tree(v)
    build_s = time.perf_counter() - t0
    inputs = {
        "pipeline": dirs["pipeline"],
        "dcp_to_torch_save": dirs["pipeline"],
        "consolidate_safetensors_files": dirs["hf"],
        "tc_hf": dirs["tc"],
        "cat": dirs["pipeline"],
    }
    outs = {m: d / f"out_{m}" for m in CONSOLIDATE_METHODS if m not in BASELINES}
    shards = sorted(dirs["pipeline"].glob("*.distcp"))
    py, me = sys.executable, str(Path(__file__).resolve())
    cmds = {
        "baseline": [py, "-c", "import torch"],
        "import pipeline": [
            py,
            "-c",
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); import pipeline.formats.dcp_stream",
        ],
        "cat": [
            "/bin/sh",
            "-c",
            'o=$1; shift; cat "$@" > "$o" && sync "$o"',
            "sh",
            str(outs["cat"]),
            *map(str, shards),
        ],
        **{
            m: [py, me, "--_child", m, "--_in", str(inputs[m]), "--_out", str(outs[m])]
            for m in CONSOLIDATE_METHODS
            if m in inputs and m != "cat"
        },
    }
    names = list(CONSOLIDATE_METHODS)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in rotated(names, r):
            if n in outs:
                o = outs[n]
                if o.is_dir():
                    shutil.rmtree(o)
                elif o.exists():
                    o.unlink()
                drop_cache(inputs[n])
            os.sync()
            x = measure(cmds[n])
            if n == "cat":
                x["inproc_s"] = x["wall_s"]
            runs[n].append(x)
            t = f"  in-proc {x['inproc_s']:6.2f}s" if "inproc_s" in x else ""
            log(f"  round {r + 1} {n:30s} rss {x['rss_mib']:7.1f} MiB  wall {x['wall_s']:6.2f}s{t}")
    check = verify_consolidated(outs, size_mb)
    log(f"  verify: {check}")
    base = med([x["rss_mib"] for x in runs["baseline"]])

    def rss(n: str) -> float:
        return med([x["rss_mib"] for x in runs[n]])

    def per_round(a: str, b: str) -> float:  # median over rounds of a's time / b's time
        return med([x["inproc_s"] / y["inproc_s"] for x, y in zip(runs[a], runs[b], strict=True)])

    res = {
        "size_mb": size_mb,
        "checkpoint_bytes": {k: tree_bytes(v) for k, v in dirs.items()},
        "shard_files": [p.name for p in shards],
        "model_bytes": sum(math.prod(s) * 4 for _, s in layout),
        "tensors": len(layout),
        "largest_tensor_bytes": largest,
        "build_s": build_s,
        "runs": runs,
        "median": {n: {k: med([x[k] for x in runs[n]]) for k in runs[n][0]} for n in names},
        "baseline_rss_mib": base,
        "ratios": {
            "dcp_to_torch_save / pipeline": per_round("dcp_to_torch_save", "pipeline"),
            "consolidate_safetensors_files / pipeline": per_round("consolidate_safetensors_files", "pipeline"),
            "tc_hf / pipeline": per_round("tc_hf", "pipeline"),
            "pipeline / cat": per_round("pipeline", "cat"),
            "pipeline rss above baseline / largest": (rss("pipeline") - base) * MiB / largest,
            "pipeline rss above its imports / largest": (rss("pipeline") - rss("import pipeline")) * MiB / largest,
            "tc_hf rss / pipeline rss": rss("tc_hf") / rss("pipeline"),
        },
        "verify": check,
    }
    shutil.rmtree(d, ignore_errors=True)
    return res


def section_consolidation(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"cold_check": check_cold(scratch, 64 if args.quick else 256), "sizes": []}
    for s in args.sizes:
        res["sizes"].append(_consolidate_one(args, scratch, s))
    return res


# ============================================================================================= 3. deepspeed


def section_deepspeed(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    out = scratch / "consolidate_zero.json"
    size, stages = (50, "3") if args.quick else (100, "3,2")
    cmd = [sys.executable, str(BENCH / "consolidate_zero.py"), "--size-mb", str(size), "--stages", stages]
    cmd += ["--repeat", str(args.rounds), "--out", str(out), "--tmpdir", str(scratch)]
    log(f"deepspeed: {' '.join(cmd[1:])}")
    for attempt in (1, 2):
        p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
        if p.returncode == 0:
            break
        # DeepSpeed's CPU/gloo build occasionally aborts at exit ("terminate called without an active exception")
        log(f"deepspeed: consolidate_zero.py failed ({p.returncode}), attempt {attempt} of 2")
    else:
        raise RuntimeError(f"consolidate_zero.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


# ====================================================================== 4. scripts written by other people

OPTIONAL = {
    # run(size_mb per file, files, rounds)
    "verify": ("verify_speed", lambda a: (64 if a.quick else 128, 4 if a.quick else 8, a.rounds)),
    # run(size_mb, rounds, device)
    "async_blocking": ("async_blocking", lambda a: (128 if a.quick else 512, a.rounds, a.device)),
    # run(ranks_list): simulated world sizes (files + metadata only, no processes)
    "scale": ("scale_commit", lambda a: ([64, 512] if a.quick else [64, 512, 2048],)),
    # run(rounds): each stage rerun alone as a local job, its time beyond its own work
    "stage_overhead": ("stage_overhead", lambda a: (a.rounds,)),
    # run(size_mb, rounds): the library's Checkpointer from a plain loop vs dcp.save / dcp.async_save
    "library_save": ("library_save", lambda a: (32 if a.quick else 128, a.rounds)),
    # run(rounds, saves, s3): bytes and seconds per save with and without sharing (LoRA, frozen layers, full)
    "incremental": ("incremental", lambda a: (1 if a.quick else a.rounds, 3 if a.quick else 4, False)),
}
MARK = "BENCH_RESULT_JSON "


def section_optional(key: str, args: argparse.Namespace) -> dict[str, Any]:
    mod, make_args = OPTIONAL[key]
    path = BENCH / f"{mod}.py"
    if not path.exists():
        log(f"{key}: bench/{mod}.py is absent: skipped")
        return {"skipped": f"bench/{mod}.py is absent"}
    call_args = make_args(args)
    code = (
        f"import json, sys; sys.path.insert(0, {str(BENCH)!r}); sys.path.insert(0, {str(ROOT)!r}); import {mod}; "
        f"r = {mod}.run(*{call_args!r}); print({MARK!r} + json.dumps(r, default=str))"
    )
    log(f"{key}: bench/{mod}.py run{call_args!r}")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=1800)
    lines = [ln[len(MARK) :] for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        log(f"{key}: failed ({p.returncode}); see results.json")
        return {"error": f"bench/{mod}.py run{call_args!r} failed ({p.returncode})", "stderr_tail": p.stderr[-2000:]}
    res = json.loads(lines[-1])
    return {"args": list(call_args), "wall_s": time.perf_counter() - t0, "result": res}


# ============================================================================================== reporting


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
        return "[" + ", ".join(_fmt(x) for x in v[:12]) + (", …" if len(v) > 12 else "") + "]"
    s = str(v)
    return s if len(s) <= 120 else s[:117] + "…"


def render_generic(d: Any, title: str) -> list[str]:
    """Markdown for any JSON-like result: lists of flat dicts become tables, other leaves a key | value table."""
    lines: list[str] = []
    scalars: list[tuple[str, Any]] = []
    tables: list[tuple[str, list[dict[str, Any]]]] = []

    def walk(v: Any, path: str) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            tables.append((path, v))
        else:
            scalars.append((path, v))

    walk(d, "")
    if scalars:
        lines += ["| key | value |", "|---|---|"] + [f"| {k or title} | {_fmt(v)} |" for k, v in scalars] + [""]
    for path, rows in tables:
        cols: list[str] = []
        for row in rows:
            cols += [c for c in row if c not in cols]
        lines += [f"`{path}`:", "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |" for row in rows] + [""]
    return lines


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _md_save(sv: dict[str, Any]) -> list[str]:
    r = sv["ratios"]
    L = [
        f"## 1. Save throughput ({sv['state_bytes'] / GB:.2f} GB fp32 state, {sv['tensors']} tensors, "
        f"device {sv['device']}; every method fsyncs)",
        "",
        f"Disk limit (best of {', '.join(map(str, DISK_STREAMS))} parallel write+fsync streams, per round): "
        f"{r['disk limit GBps']:.2f} GB/s. 'speed vs dcp.save' = dcp.save's time / the method's (same round).",
        "",
        "| method | ranks | time s | GB/s | / disk limit | speed vs dcp.save | blocking s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, s in sv["summary"].items():
        xs = sv["runs"][n]
        L.append(
            f"| {n} | {2 if SAVE_METHODS[n] == DUAL else 1} | {rng([x['s'] for x in xs], '.3f')} | "
            f"{rng([x['GBps'] for x in xs])} | {s['of_disk_limit']:.2f} | {s['vs_dcp_save']:.2f} | "
            f"{rng([x['blocking_s'] for x in xs], '.3f') if 'blocking_s' in s else '–'} |"
        )
    a, b = r["pipeline / disk limit"], r["pipeline / dcp.save"]
    L += [
        "",
        f"Pipeline ({r['best pipeline']}) / disk limit: **{a:.2f}** (target ≥ {TARGETS['pipeline / disk limit']}: "
        f"{_mark(a >= TARGETS['pipeline / disk limit'])}); pipeline / dcp.save default speed: **{b:.2f}×** "
        f"(target ≥ {TARGETS['pipeline / dcp.save']}: {_mark(b >= TARGETS['pipeline / dcp.save'])}).",
        "",
    ]
    if sv["device"] == "cuda":
        L += [
            "From GPU memory: the raw streams copy each tensor into a reused pinned buffer; torch.save, "
            "safetensors and DCP copy to pageable CPU memory themselves; dcp.async_save stages to CPU first.",
            "",
        ]
    return L


def _md_consolidation(co: dict[str, Any]) -> list[str]:
    cc = co["cold_check"]
    L = [
        "## 2. Consolidation (model-only 2-rank FSDP-style checkpoint, cold input cache, outputs fsynced)",
        "",
        f"Cold cache via fsync + POSIX_FADV_DONTNEED: warm read {cc['warm_read_GBps']:.2f} GB/s, dropped "
        f"{cc['cold_read_GBps']:.2f} GB/s ({cc['cold_over_warm_time']:.1f}× the time: "
        f"{'effective' if cc['works'] else 'NOT effective here'}). 'in-proc s': from just after the child's "
        "imports to the end (cat: its whole wall time); 'above base': peak RSS minus `import torch`'s; "
        "'import pipeline': the pipeline child's imports alone. GB/s: model bytes / in-proc s.",
        "",
        "| ckpt MB | largest MiB | method | peak RSS MiB | above base MiB | wall s | in-proc s | GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in co["sizes"]:
        mb = s["model_bytes"]
        for n, xs in s["runs"].items():
            rss = med([x["rss_mib"] for x in xs])
            has_t = "inproc_s" in xs[0]
            t = med([x["inproc_s"] for x in xs]) if has_t else math.nan
            above = "–" if n in ("baseline", "cat") else format(rss - s["baseline_rss_mib"], ".0f")
            L.append(
                f"| {mb / 1e6:.0f} | {s['largest_tensor_bytes'] / MiB:.0f} | {n} | "
                f"{rng([x['rss_mib'] for x in xs], '.0f')} | {above} | {rng([x['wall_s'] for x in xs])} | "
                f"{rng([x['inproc_s'] for x in xs]) if has_t else '–'} | "
                f"{format(mb / t / GB, '.2f') if has_t else '–'} |"
            )
    L += [
        "",
        "Ratios (time: median of per-round in-proc ratios; target in brackets):",
        "",
        "| ckpt MB | dcp_to_torch_save / pipeline (≥ 4) | consolidate_safetensors_files / pipeline (≥ 3) | "
        "torch-checkpointing / pipeline (> 1) | pipeline / cat (≤ 1.5) | pipeline above base / largest (≤ 1) "
        "| pipeline above its imports / largest | torch-ckpt RSS / pipeline RSS (> 1) | verify |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in co["sizes"]:
        r = s["ratios"]
        checks = [
            (r["dcp_to_torch_save / pipeline"], r["dcp_to_torch_save / pipeline"] >= 4),
            (r["consolidate_safetensors_files / pipeline"], r["consolidate_safetensors_files / pipeline"] >= 3),
            (r["tc_hf / pipeline"], r["tc_hf / pipeline"] > 1),
            (r["pipeline / cat"], r["pipeline / cat"] <= 1.5),
            (r["pipeline rss above baseline / largest"], r["pipeline rss above baseline / largest"] <= 1),
            (r["tc_hf rss / pipeline rss"], r["tc_hf rss / pipeline rss"] > 1),
        ]
        cells = [f"{v:.2f} ({_mark(ok)})" for v, ok in checks]
        cells.insert(5, f"{r['pipeline rss above its imports / largest']:.2f}")
        L.append(f"| {s['model_bytes'] / 1e6:.0f} | " + " | ".join(cells) + f" | {s['verify']} |")
    return [*L, ""]


def _md_failed(title: str, v: dict[str, Any]) -> list[str]:
    return [title, "", f"failed: {_fmt(v.get('error'))}", ""]


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    L = [
        f"# bench/run.py results, {results['timestamp']}",
        "",
        f"Machine: {cfg['machine']}. {cfg['rounds']} round(s) per figure (median [min–max]), method order rotated"
        " per round, every ratio the median of per-round ratios. "
        f"Wall time of the whole run: {results.get('wall_s', 0) / 60:.1f} min ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in results.get("section_wall_s", {}).items())
        + ").",
        "",
    ]
    if "scaled" in cfg:
        L += [f"Note: {cfg['scaled']}", ""]
    if sv := results.get("save"):
        L += _md_save(sv) if "summary" in sv else _md_failed("## 1. Save throughput", sv)
    if co := results.get("consolidation"):
        L += _md_consolidation(co) if "sizes" in co else _md_failed("## 2. Consolidation", co)
    if ds := results.get("deepspeed"):
        title = "## 3. DeepSpeed ZeRO: pipeline vs zero_to_fp32 (bench/consolidate_zero.py)"
        if "results" in ds:
            import consolidate_zero

            L += [title, "", consolidate_zero.table(ds["results"], ds["config"]["repeat"]), ""]
        else:
            L += _md_failed(title, ds)
    titles = {
        "verify": "Verify hashing",
        "async_blocking": "Async save blocking",
        "scale": "Scale",
        "stage_overhead": "Per-stage local overhead",
        "library_save": "Library save from a plain loop",
        "incremental": "Incremental saves: with and without sharing unchanged pieces",
    }
    for i, (key, title) in enumerate(titles.items(), start=4):
        if (v := results.get(key)) is None:
            continue
        L += [f"## {i}. {title} (bench/{OPTIONAL[key][0]}.py)", ""]
        if "result" in v:
            L += [f"`run{tuple(v['args'])!r}` in {v['wall_s']:.0f} s:", "", *render_generic(v["result"], key)]
        else:
            L += [f"{v.get('skipped') or v.get('error')}", ""]
    return "\n".join(L) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    co = results.get("consolidation") or {}
    sizes = co.get("sizes") or []
    if sizes:
        xs = [s["model_bytes"] / 1e6 for s in sizes]
        labels = {"baseline": "import torch (baseline)", "tc_hf": "torch-checkpointing (HF consolidation)"}
        for n in CONSOLIDATE_METHODS:
            ys = [med([x["rss_mib"] for x in s["runs"][n]]) for s in sizes]
            style = {"linestyle": "--", "marker": "x"} if n in BASELINES else {"marker": "o"}
            ax1.plot(xs, ys, label=labels.get(n, n), **style)
        limit = [s["baseline_rss_mib"] + s["largest_tensor_bytes"] / MiB for s in sizes]
        ax1.plot(xs, limit, ":", color="k", marker="_", markersize=14, label="target: baseline + largest tensor")
        ax1.set_xlabel("checkpoint size (MB, model only)")
        ax1.set_ylabel("peak RSS (MiB)")
        ax1.set_title("Consolidation: peak memory vs checkpoint size")
        ax1.legend(fontsize=8)
        ax1.grid(alpha=0.3)
    else:
        ax1.text(0.5, 0.5, "consolidation not run", ha="center")
    sv = results.get("save") or {}
    if "summary" in sv:
        names = list(sv["summary"])
        vals = [sv["summary"][n]["of_disk_limit"] for n in names]
        colors = ["tab:green" if n.startswith("pipeline") else "tab:grey" if n.startswith("disk") else "tab:blue"
                  for n in names]  # fmt: skip
        ax2.barh(names, vals, color=colors)
        ax2.axvline(1.0, color="k", linewidth=0.8)
        ax2.axvline(0.85, color="tab:green", linestyle=":", label="target 0.85")
        ax2.invert_yaxis()
        ax2.set_xlabel(f"save throughput / disk limit ({sv['ratios']['disk limit GBps']:.2f} GB/s)")
        ax2.set_title(f"Save of a {sv['state_bytes'] / GB:.2f} GB state (fsynced)")
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3, axis="x")
    else:
        ax2.text(0.5, 0.5, "save not run", ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ================================================================================================== main


def fit_sizes(args: argparse.Namespace, scratch: Path) -> str | None:
    """Scale the sizes down to the free disk (and memory); return a message if anything was scaled."""
    free = shutil.disk_usage(scratch).free
    # consolidation: 3 input formats + 5 outputs of the biggest size at once; save: one output at a time
    need = max(8 * max(args.sizes), 2 * args.save_mb) * 1e6 + 2e9
    msgs = []
    if need > free:
        f = max(0.05, (free - 2e9) / (need - 2e9))
        args.sizes = [max(32.0, round(s * f)) for s in args.sizes]
        args.save_mb = max(64.0, round(args.save_mb * f))
        msgs.append(f"free disk {free / 1e9:.1f} GB < {need / 1e9:.1f} GB needed: sizes scaled by {f:.2f}")
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 0
    if avail and 3 * args.save_mb * 1e6 > avail:  # rank 0 holds the whole state, plus staging copies
        args.save_mb = max(64.0, round(avail / 3e6))
        msgs.append(f"available memory {avail / 1e9:.1f} GB: save state scaled to {args.save_mb} MB")
    for m in msgs:
        log("NOTE: " + m)
    return "; ".join(msgs) or None


def machine() -> str:
    import platform

    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return f"{platform.node()}, {os.cpu_count()} CPUs, {mem:.0f} GiB RAM, Python {platform.python_version()}"


SECTIONS = ("save", "consolidation", "deepspeed", *OPTIONAL)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, small sizes (about 2 minutes; default about 8)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the saved state lives")
    ap.add_argument("--out", default=str(BENCH / "results"), help="results root (default bench/results)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per figure (default 3, --quick 1)")
    ap.add_argument("--sizes", default=None, help="consolidation sizes in MB (default 256,512,1024; quick 128)")
    ap.add_argument("--save-mb", type=float, default=None, help="saved state in MB (default 768; quick 256)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--tmpdir", default=None, help="parent of the scratch dir (default: system temp)")
    ap.add_argument("--_save", help=argparse.SUPPRESS)
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_in", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.sizes = [float(s) for s in (args.sizes or ("128" if args.quick else "256,512,1024")).split(",")]
    args.save_mb = args.save_mb or (256.0 if args.quick else 768.0)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        ap.error(f"--only: unknown sections {sorted(unknown)}")
    return args


def run_all(args: argparse.Namespace, scratch: Path, results: dict[str, Any]) -> None:
    scaled = fit_sizes(args, scratch)
    results["config"] = {
        "quick": args.quick,
        "device": args.device,
        "rounds": args.rounds,
        "consolidation_sizes_mb": args.sizes,
        "save_mb": args.save_mb,
        "world": WORLD,
        "hidden": DIM,
        "machine": machine(),
        "peak_rss_via": f"{TIME_BIN} -v" if os.access(TIME_BIN, os.X_OK) else "getrusage(RUSAGE_CHILDREN) wrapper",
        **({"scaled": scaled} if scaled else {}),
    }
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "save": lambda: section_save(args, scratch),
        "consolidation": lambda: section_consolidation(args, scratch),
        "deepspeed": lambda: section_deepspeed(args, scratch),
        **{k: (lambda k=k: section_optional(k, args)) for k in OPTIONAL},
    }
    for name in SECTIONS:
        if name not in args.only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            results[name] = runners[name]()
        except Exception as e:  # one failed section must not lose the others
            log(f"{name}: FAILED: {e}")
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results.setdefault("section_wall_s", {})[name] = time.perf_counter() - t0
        log(f"{name}: {time.perf_counter() - t0:.0f} s")


def main() -> None:
    args = parse_args()
    if args._save:
        return _save_entry(args._save)
    if args._child:
        return child(args._child, Path(args._in), Path(args._out))
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"bench/run.py: --device cuda, but CUDA is not available (torch {torch.__version__})")

    t_start = time.perf_counter()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    scratch = Path(tempfile.mkdtemp(prefix="bench_run_", dir=args.tmpdir))
    results: dict[str, Any] = {"timestamp": stamp}
    try:
        run_all(args, scratch, results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t_start
    out = Path(args.out) / stamp
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    md = markdown(results)
    (out / "results.md").write_text(md)
    plot(results, out / "plot.png")
    latest = Path(args.out) / "latest"
    shutil.rmtree(latest, ignore_errors=True)
    shutil.copytree(out, latest)
    print()
    print(md)
    log(f"wrote results.json, results.md, plot.png to {out} and {latest} ({results['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
