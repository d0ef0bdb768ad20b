"""Peak RSS of the consolidate stage versus checkpoint size, against torch's ``dcp_to_torch_save``.

Builds a synthetic 2-rank DCP checkpoint (model and optimizer tensors as DTensors, ``Shard(0)`` on a 1-D CPU
mesh, as FSDP2 stores them; plus small ``sched``/``train``/``rng`` entries), then runs each method in a fresh
subprocess under ``/usr/bin/time -v`` (falling back to ``getrusage(RUSAGE_CHILDREN)`` when it is absent):

* ``pipeline``: the consolidate stage's own function ``consolidate_dcp`` (``TensorStreamer``: metadata parsed
  once, one reused buffer, then ``StreamingSafetensorsWriter``), without a run directory;
* ``pipeline, fixed mmap thr``: the same with ``MALLOC_MMAP_THRESHOLD_=1048576``, which separates glibc's
  retention of freed heap memory from what the loop itself needs;
* ``dcp_to_torch_save``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (loads everything);
* ``baseline``: ``python -c "import torch, torch.distributed.checkpoint"``.

Then checks the consolidated safetensors bit-exactly against the ``model`` part of ``dcp_to_torch_save``'s
output and against the tensors the checkpoint was generated from.

    .venv/bin/python bench/consolidate_rss.py                 # 655 MB checkpoint, largest tensor 32 MiB
    .venv/bin/python bench/consolidate_rss.py --size-mb 150   # smaller (the hidden size scales with it)
    .venv/bin/python bench/consolidate_rss.py --size-mb 1000 --dim 1024   # bigger, same largest tensor
    .venv/bin/python bench/consolidate_rss.py --trace         # also: RSS after each tensor, pipeline path

Only the standard library is imported at module level so that the measured children import just what they use.
"""

from __future__ import annotations

import argparse
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
import time
from pathlib import Path

MiB = 1 << 20
import synthetic  # noqa: E402 - bench/ is on sys.path when a script runs as bench/<name>.py

VOCAB = synthetic.VOCAB
BASE_DIM = 1024  # hidden size at the default --size-mb: the embedding is VOCAB x BASE_DIM fp32 = 32 MiB
DEFAULT_SIZE_MB = 600
TIME_BIN = "/usr/bin/time"
WORLD = 2  # ranks writing the synthetic checkpoint


# --------------------------------------------------------------------------------------------- synthetic model


def model_layout(size_mb: float, dim: int = 0) -> tuple[int, list[tuple[str, tuple[int, ...]]]]:
    return synthetic.model_layout(size_mb, BASE_DIM, DEFAULT_SIZE_MB, dim)


def full_tensor(index: int, shape: tuple[int, ...], salt: int = 0):
    """The deterministic full value of parameter ``index`` (``salt`` 1/2 for exp_avg/exp_avg_sq)."""
    import torch

    g = torch.Generator().manual_seed(1000 * index + salt)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def _save_rank(rank: int, port: int, ckpt: str, size_mb: float, dim: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = WORLD
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))

        def shard(t: torch.Tensor):
            # every rank computes the same full tensor, so no scatter is needed (src_data_rank=None)
            return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

        _, layout = model_layout(size_mb, dim)
        model, optim_state = {}, {}
        for i, (name, shape) in enumerate(layout):
            model[name] = shard(full_tensor(i, shape))
            optim_state[name] = {
                "step": torch.tensor(7.0),
                "exp_avg": shard(full_tensor(i, shape, 1)),
                "exp_avg_sq": shard(full_tensor(i, shape, 2).abs_()),
            }
        state = synthetic.training_state(model, optim_state, rank)
        dcp.save(state, checkpoint_id=ckpt)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make_checkpoint(ckpt: Path, size_mb: float, dim: int) -> float:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    mp.spawn(_save_rank, args=(port, str(ckpt), size_mb, dim), nprocs=WORLD, join=True)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------- measured children


def child_pipeline(ckpt: Path, out: Path, trace: bool) -> None:
    """The consolidate stage's loop (pipeline/stages/consolidate.py ``run``), minus the run-dir bookkeeping."""
    from pipeline.formats.dcp_stream import consolidate_dcp

    rss = None
    if trace:
        import psutil

        proc = psutil.Process()

        def rss() -> float:
            return proc.memory_info().rss / MiB

        print(f"trace: after imports rss={rss():.0f} MiB", file=sys.stderr)
    t0 = time.perf_counter()

    def on_tensor(name: str) -> None:
        if rss is not None:
            print(f"trace: {name:28s} rss={rss():.0f} MiB", file=sys.stderr)

    import resource

    count = consolidate_dcp(ckpt, out, on_tensor)
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    specs = range(count)
    print(json.dumps({"inproc_s": time.perf_counter() - t0, "tensors": len(specs), "setup_rss_mib": setup_rss}))


def child_torch(ckpt: Path, out: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    t0 = time.perf_counter()
    dcp_to_torch_save(ckpt, out)
    print(json.dumps({"inproc_s": time.perf_counter() - t0}))


# --------------------------------------------------------------------------------------------- measurement


def measure(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``cmd`` in a fresh process; its peak RSS (MiB), wall time (s) and the JSON line it printed, if any."""
    use_time = os.access(TIME_BIN, os.X_OK)
    full = [TIME_BIN, "-v", *cmd] if use_time else cmd
    before = None
    if not use_time:
        import resource

        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    p = subprocess.run(full, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    res: dict[str, float] = {"wall_s": wall}
    if use_time:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
        if not m:
            raise RuntimeError(f"no peak RSS in /usr/bin/time output:\n{p.stderr}")
        res["rss_mib"] = int(m.group(1)) / 1024
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if before is not None and peak <= before:
            raise RuntimeError("getrusage(RUSAGE_CHILDREN) cannot isolate this child: pass a larger run first")
        res["rss_mib"] = peak / 1024
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            res.update(json.loads(line))
    for line in p.stderr.splitlines():
        if line.startswith("trace:"):
            print("   ", line)
    return res


def verify(st_path: Path, pt_path: Path, size_mb: float, dim: int) -> str:
    import torch
    from safetensors.torch import load_file

    st = load_file(str(st_path))
    sd = torch.load(pt_path, weights_only=True, mmap=True)
    if isinstance(sd.get("model"), dict):
        ref = sd["model"]
    else:  # flattened keys
        ref = {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")}
    if set(st) != set(ref):
        raise AssertionError(f"names differ: only safetensors {set(st) - set(ref)}, only .pt {set(ref) - set(st)}")
    bad = [k for k in st if not torch.equal(st[k], ref[k])]
    if bad:
        raise AssertionError(f"{len(bad)} tensors differ from dcp_to_torch_save: {bad[:5]}")
    _, layout = model_layout(size_mb, dim)
    bad = [n for i, (n, shape) in enumerate(layout) if not torch.equal(st[n], full_tensor(i, shape))]
    if bad:
        raise AssertionError(f"{len(bad)} tensors differ from the generated source: {bad[:5]}")
    return f"{len(st)}/{len(ref)} model tensors equal (torch.equal) to dcp_to_torch_save's and to the source"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=DEFAULT_SIZE_MB, help="approximate checkpoint size (MB)")
    ap.add_argument("--dim", type=int, default=0, help="fix the hidden size (default: scales with --size-mb)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per method (order rotated); median [min-max]")
    ap.add_argument("--tmpdir", default=None, help="parent of the scratch dir (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    ap.add_argument("--trace", action="store_true", help="print the pipeline child's RSS after each tensor")
    ap.add_argument("--_child", choices=["pipeline", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--_ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child == "pipeline":
        return child_pipeline(Path(args._ckpt), Path(args._out), args.trace)
    if args._child == "torch":
        return child_torch(Path(args._ckpt), Path(args._out))

    scratch = Path(tempfile.mkdtemp(prefix="consolidate_rss_", dir=args.tmpdir))
    try:
        run_bench(args, scratch)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def inherent_peak(ckpt: Path) -> tuple[int, int, str]:
    """(largest tensor bytes, max over model tensors of full + its largest DCP chunk, that tensor's name).

    ``TensorStreamer.load`` holds the full output tensor while torch.load stages one stored chunk at a time, so this
    is the least any loop over whole tensors can need above the interpreter.
    """
    from pipeline.formats.dcp import read_metadata_safe, tensor_entries

    md = read_metadata_safe(ckpt)
    best, largest, name = 0, 0, ""
    for key, meta in tensor_entries(md, "model."):
        item = meta.properties.torch_dtype().itemsize
        full = math.prod(meta.size) * item
        chunk = max(math.prod(c.sizes) * item for c in meta.chunks)
        largest = max(largest, full)
        if full + chunk > best:
            best, name = full + chunk, key
    return largest, best, name


FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(MiB)}  # a fixed threshold stops glibc's dynamic threshold raise


def run_bench(args: argparse.Namespace, scratch: Path) -> None:
    ckpt, st_out, pt_out = scratch / "ckpt", scratch / "model.safetensors", scratch / "full.pt"
    dim, layout = model_layout(args.size_mb, args.dim)
    print(f"creating a 2-rank DCP checkpoint (DTensor Shard(0), hidden {dim}, {len(layout)} params) in {ckpt} ...")
    save_s = make_checkpoint(ckpt, args.size_mb, args.dim)
    files = {p.name: p.stat().st_size for p in sorted(ckpt.iterdir())}
    ckpt_bytes = sum(files.values())
    model_bytes = sum(math.prod(s) * 4 for _, s in layout)
    largest, inherent, inherent_key = inherent_peak(ckpt)
    print(f"  saved in {save_s:.1f}s: " + ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in files.items()))

    py, me = sys.executable, str(Path(__file__).resolve())
    pipe = [py, me, "--_child", "pipeline", "--_ckpt", str(ckpt), "--_out", str(st_out)]
    methods: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "baseline": ([py, "-c", "import torch, torch.distributed.checkpoint"], None),
        "pipeline": ([*pipe, *(["--trace"] if args.trace else [])], None),
        "pipeline, fixed mmap thr": (pipe, FIXED_MMAP),
        "dcp_to_torch_save": ([py, me, "--_child", "torch", "--_ckpt", str(ckpt), "--_out", str(pt_out)], None),
    }
    print(f"peak RSS via {TIME_BIN + ' -v' if os.access(TIME_BIN, os.X_OK) else 'getrusage(RUSAGE_CHILDREN)'}")
    names = list(methods)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.repeat):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            runs[n].append(measure(*methods[n]))
            print(f"  round {r + 1} {n:24s} rss {runs[n][-1]['rss_mib']:7.1f} MiB  wall {runs[n][-1]['wall_s']:.2f}s")

    def med(n: str, k: str) -> float:
        return statistics.median(x[k] for x in runs[n])

    def rng(n: str, k: str, fmt: str) -> str:
        xs = [x[k] for x in runs[n]]
        return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}-{format(max(xs), fmt)}]"

    base = med("baseline", "rss_mib")
    ck_mib, lg_mib = ckpt_bytes / MiB, largest / MiB
    print()
    print(f"checkpoint: {ckpt_bytes:,} B ({ck_mib:.1f} MiB) in {len(files)} files", end="; ")
    print(f"model part {model_bytes / MiB:.1f} MiB")
    print(f"largest tensor: {lg_mib:.1f} MiB; {len(layout)} model tensors; .metadata {files.get('.metadata', 0):,} B")
    print(
        f"inherent minimum above baseline for one-tensor-at-a-time loading: {inherent / MiB:.1f} MiB "
        f"({inherent_key}: full tensor + its largest stored chunk)"
    )
    print(f"rounds: {args.repeat}, median [min-max]; 'fixed mmap thr' = pipeline run with {FIXED_MMAP}")
    print()
    cols = [
        ("method", 24),
        ("peak RSS MiB", 18),
        ("above base MiB", 14),
        ("above / largest", 15),
        ("peak / ckpt", 11),
        ("above / ckpt", 12),
        ("wall s (incl. start)", 20),
        ("in-proc s", 16),
    ]
    print("| " + " | ".join(f"{c:{w}s}" for c, w in cols) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w in cols) + "|")
    for n in names:
        rss = med(n, "rss_mib")
        above = rss - base
        cells = [
            n,
            rng(n, "rss_mib", ".0f"),
            f"{above:.0f}",
            f"{above / lg_mib:.2f}",
            f"{rss / ck_mib:.3f}",
            f"{above / ck_mib:.3f}",
            rng(n, "wall_s", ".2f"),
            rng(n, "inproc_s", ".2f") if "inproc_s" in runs[n][0] else "-",
        ]
        print("| " + " | ".join(f"{c:{w}s}" for c, (_, w) in zip(cells, cols, strict=True)) + " |")
    p_above = med("pipeline", "rss_mib") - base
    t_above = med("dcp_to_torch_save", "rss_mib") - base
    print()
    ratio = med("pipeline", "rss_mib") / med("dcp_to_torch_save", "rss_mib")
    print(f"pipeline / dcp_to_torch_save, peak RSS: {ratio:.3f}")
    print(f"pipeline / dcp_to_torch_save, RSS above baseline: {p_above / t_above:.3f}")
    print(
        f"pipeline RSS above baseline: {p_above:.0f} MiB = {p_above / lg_mib:.2f} x largest tensor "
        f"(inherent {inherent / MiB:.0f} MiB = {inherent / largest:.2f} x; "
        f"with fixed mmap threshold {med('pipeline, fixed mmap thr', 'rss_mib') - base:.0f} MiB)"
    )
    print("verify:", verify(st_out, pt_out, args.size_mb, args.dim))


if __name__ == "__main__":
    main()
