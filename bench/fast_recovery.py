"""The fast tier against the durable tier, in one script (2 ranks, ``torchrun``, gloo, this machine's 2 cores).

    .venv/bin/python bench/fast_recovery.py [--mb 1100] [--steps 20] [--every 10] [--rounds 1] [--out DIR]
                                            [--device cuda]

A DDP model of ``--mb`` MB of training state per rank (parameters + AdamW moments; 1,100 MB = the ≥ 1 GB
example's size), each rank a "node" with a fast dir of its own in ``/dev/shm``:

1. **Overhead**: the same ``--steps`` steps trained without a fast tier, then with a fast save every ``--every``
   steps: the step-time overhead (extra wall time / the run without), the time training was blocked per fast
   save (the copy of its tensors to CPU), the background save's time, and the memory each rank's node holds.
2. **Recovery**: after the last step is saved durably and in the fast tier, rank 1's node dir is deleted (a
   replaced node) and the page cache dropped, then a relaunch restores with the fast tier (rank 1's copy from
   rank 0's replica, over gloo) and, separately, from the durable tier alone; durable tier = the run dir on
   local disk, on a SeaweedFS FUSE mount (a shared filesystem) and in a SeaweedFS S3 bucket (loopback). Each
   restore is timed from the relaunched ``Checkpointer``'s ``load_latest`` call to its return; the ratio is
   durable / fast. ``--rounds N`` restores each saved run N times from each tier, in turn (this VM's speed moves
   from one minute to the next: one pair of restores can be 2.6x or 4.2x), and reports the ratio of the means.
3. **Across nodes** (``--only cluster``, root, no cluster of the tests running): the same on node1 and node2 of
   the namespace cluster (``scripts/cluster/start.sh``: own network, hostname, tmpfs ``/local``, FUSE mount of
   one SeaweedFS filer at ``/shared``): durable tier in ``/shared``, fast tier in each node's ``/local``, node2
   killed (``node.sh kill9``: its ``/local`` lost) and brought back empty; its shard comes from node1's replica
   over the nodes' network.

``--strategy fsdp2`` shards the same model over the 2 ranks (``fully_shard`` per layer: every parameter and
moment sharded, nothing replicated, half the state per rank), the case where nothing can be shared.

``--device cuda`` trains on the GPU (both ranks on ``cuda:0`` with one GPU, DDP over gloo): the step is the GPU's
work and the fast tier's background work (hash, write, swap with the peer) has the CPU cores to itself, as on a
GPU node; the fast save's blocking copy is the device-to-host copy into a pinned buffer. Run it as
``--device cuda --only overhead,local`` on a GPU machine for the overhead target (``bash bench/run.sh`` does not
include this script: it needs 2 × (4 × ``--mb``) MB of ``/dev/shm`` and minutes).

Results: ``<out>/fast_recovery.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WIDTH = 2048


# -- the worker (one rank under torchrun) --------------------------------------------------------------------------


def _setup(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """The DDP model of ``--mb`` MB of training state on ``--device``, its AdamW, a batch and a clock that waits
    for the device first."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    dist.init_process_group("gloo")  # on a GPU too: with one GPU both ranks share it, which NCCL refuses
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers = max(1, int(args.mb * 1e6 / 12 / (WIDTH * WIDTH)))  # params + two AdamW moments, fp32
    net = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))).to(device)
    if args.strategy == "fsdp2":  # every parameter and moment sharded over the 2 ranks: nothing replicated
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        for layer in net:
            fully_shard(layer)
        model = fully_shard(net)
    else:
        model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def settled() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic()

    return model, opt, torch.randn(8, WIDTH, device=device), settled


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    from pipeline.checkpoint import Checkpointer, RankRNG  # noqa: PLC0415

    model, opt, x, settled = _setup(args)
    rank = dist.get_rank()
    layers = len(getattr(model, "module", model))
    fast_every = args.every if args.fast else None
    fast_dir = args.node_dirs if args.node_local else f"{args.node_dirs}/node{rank}"
    ckpt = Checkpointer(args.run_dir, storage=args.storage, fast_every=fast_every, deadline_s=900, fast_dir=fast_dir)
    state = {"model": model, "optim": opt, "rng": RankRNG(rank)}
    out: dict[str, Any] = {"layers": layers}
    if args.mode == "restore":
        out["limits"] = _limits(x.device)
        t0 = settled()
        out["step"] = ckpt.load_latest(into=state)
        out["restore_s"] = settled() - t0
        out["tier"] = (ckpt.resumed or {}).get("tier", "durable")
        out["phases_s"] = (ckpt.resumed or {}).get("phases_s")
        out["rank_phases_s"] = (ckpt.resumed or {}).get("rank_phases_s")
        out["state_bytes"] = _state_bytes(model, opt)
        lim = out["limits"]  # rank 1's blob moved over the link, then verified and copied into its state
        out["limit_s"] = out["state_bytes"] / 1e9 * (1 / lim["link_gbps"] + 1 / lim["copy_hash_gbps"])
        out["limit_fresh_s"] = out["state_bytes"] / 1e9 * (1 / lim["link_gbps"] + 1 / lim["fresh_copy_gbps"])
    else:
        blocked, t0, cpu0 = [], settled(), _cpu()
        step_s: list[float] = []
        for step in range(1, args.steps + 1):
            ts = settled()
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ckpt.should_save_fast(step):
                blocked.append(ckpt.save_fast(step, state))
            step_s.append(settled() - ts)
        train_s = settled() - t0
        if ckpt.fast is not None:
            ckpt.fast.wait()
            st = ckpt.fast.stats
            n = max(1, len(blocked))
            out.update(held_bytes=st.held_bytes, persist_s=st.last_persist_s, fast_saved=st.saved,  # (getattr:
                       written_per_save=getattr(st, "written_bytes", 0) / n,
                       sent_per_save=getattr(st, "sent_bytes", 0) / n,
                       persist_cpu_per_save=getattr(st, "persist_cpu_s", 0.0) / n,  # older commits lack them)
                       renamed_per_save=getattr(st, "renamed_bytes", 0) / n,
                       steady_cpu_per_save=_steady(getattr(st, "save_cpu_s", [])),
                       phase_cpu_per_save={k: v / n for k, v in getattr(st, "phase_cpu_s", {}).items()})  # fmt: skip
        out.update(train_s=train_s, blocked_s=blocked, cpu_s=_cpu() - cpu0, step_s=step_s)  # cpu: to the last save
        if args.save:
            t1 = time.monotonic()
            ckpt.save(args.steps, state)
            out["durable_save_s"] = time.monotonic() - t1
    ckpt.close()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _state_bytes(model: Any, opt: Any) -> int:
    import torch  # noqa: PLC0415

    def size(v: Any) -> int:
        if isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v  # a DTensor: this rank's shard
            return local.numel() * local.element_size()
        if isinstance(v, dict):
            return sum(size(x) for x in v.values())
        if isinstance(v, list | tuple):
            return sum(size(x) for x in v)
        return 0

    return size(model.state_dict()) + size(opt.state_dict())


def _cpu() -> float:
    """This process's CPU seconds so far (every thread: the transport's too)."""
    import resource  # noqa: PLC0415

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _limits(device: Any, mb: int = 256) -> dict[str, float]:
    """This machine's limits for a restore, measured here: memory copy + xxh3 (GB/s, one thread, as a restore
    verifies and loads) and the link between rank 0 and rank 1 (GB/s, gloo, as a restore moves blobs)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    import xxhash  # noqa: PLC0415

    n = mb << 20
    a, b = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    b.copy_(a)
    t = time.monotonic()
    b.copy_(a)
    xxhash.xxh3_128(b.numpy().data).hexdigest()
    copy_hash = n / (time.monotonic() - t) / 1e9
    t = time.monotonic()
    torch.empty(n, dtype=torch.uint8).copy_(a)  # into memory this process has not touched (a restored state's is)
    fresh = n / (time.monotonic() - t) / 1e9
    dist.barrier()
    t = time.monotonic()
    if dist.get_rank() == 0:
        dist.send(a, 1)
    elif dist.get_rank() == 1:
        dist.recv(b, 0)
    dist.barrier()
    link = n / (time.monotonic() - t) / 1e9
    del device
    return {"copy_hash_gbps": copy_hash, "fresh_copy_gbps": fresh, "link_gbps": link}


# -- the orchestrator ---------------------------------------------------------------------------------------------


def _launch(args: argparse.Namespace, mode: str, run: Path, nodes: Path, *, fast: bool, storage: str | None = None,
            save: bool = False, env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", mode, "--run-dir", str(run), "--node-dirs", str(nodes), "--mb", str(args.mb), "--steps",
           str(args.steps), "--every", str(args.every), "--device", args.device,
           "--strategy", args.strategy]  # fmt: skip
    cmd += ["--fast"] if fast else []
    cmd += ["--save"] if save else []
    cmd += ["--storage", storage] if storage else []
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, check=False)  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{mode} failed ({done.returncode}): {done.stderr[-3000:]}")
    return dict(json.loads(lines[-1][7:]))


def _recovery(args: argparse.Namespace, where: str, run: Path, nodes: Path, storage: str | None,
              env: dict[str, str] | None) -> dict[str, Any]:  # fmt: skip
    saved = _launch(args, "train", run, nodes, fast=True, storage=storage, save=True, env=env)
    key = next((nodes / "node1").iterdir())
    shutil.rmtree(key)  # rank 1's node replaced: an empty local tier
    out = _rounds(args, where, saved, lambda fast: _launch(args, "restore", run, nodes, fast=fast, storage=storage,
                                                           env=env))  # fmt: skip
    shutil.rmtree(nodes, ignore_errors=True)  # RAM: the next section needs it
    return out


def _rounds(args: argparse.Namespace, where: str, saved: dict[str, Any], restore: Any) -> dict[str, Any]:
    """``--rounds`` restores from the fast tier and from the durable tier alone, in turn, of the one saved run
    (a fast restore writes nothing into the replaced node's dir, so each round restores the same), each after the
    page cache is dropped (a relaunch after a node failure finds nothing of the durable step in it). The ratios
    are of the means; ``fast`` and ``durable`` are the first round's results."""
    rounds = []
    for _ in range(args.rounds):
        _drop_caches()
        fast = restore(True)
        _drop_caches()
        durable = restore(False)
        rounds.append({"fast": fast, "durable": durable})
        print(f"  {where}: restore fast {fast['restore_s']:.2f}s ({fast['tier']}), durable "
              f"{durable['restore_s']:.2f}s ({durable['tier']}): {durable['restore_s'] / fast['restore_s']:.1f}x",
              flush=True)  # fmt: skip

    def mean(key: str, of: str = "restore_s") -> float:
        return sum(r[key][of] for r in rounds) / len(rounds)

    print(f"  {where}: durable save {saved['durable_save_s']:.2f}s; mean of {len(rounds)}: fast "
          f"{mean('fast'):.2f}s, durable {mean('durable'):.2f}s", flush=True)  # fmt: skip
    return {"where": where, "durable_save_s": saved["durable_save_s"], "saved": saved,
            "fast": rounds[0]["fast"], "durable": rounds[0]["durable"],
            "rounds": [{"fast_s": r["fast"]["restore_s"], "durable_s": r["durable"]["restore_s"],
                        "to_limit": r["fast"]["restore_s"] / r["fast"]["limit_s"]} for r in rounds],
            "fast_s": mean("fast"), "durable_s": mean("durable"),
            "ratio": mean("durable") / mean("fast"),
            "to_limit": mean("fast") / mean("fast", "limit_s"),
            "to_fresh_limit": mean("fast") / mean("fast", "limit_fresh_s")}  # fmt: skip


def _drop_caches() -> None:
    """Drop the page cache (root; /dev/shm, the fast tier, is RAM and stays), else say the figures are warm."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        print(f"  (page cache not dropped: {e.strerror}; the durable restores read warm data)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=1100.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="restores from each tier of each saved run, in turn")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp2"), help="fsdp2: sharded, nothing replicated")
    p.add_argument("--nice", type=int, default=0, help="also train with the background save thread at this nice")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fast_recovery"))
    p.add_argument("--only", default="overhead,local,sharedfs,s3", help="and/or cluster (root: starts scripts/cluster)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: train on the GPU (not with cluster)")
    p.add_argument("--worker", choices=("train", "restore"))
    p.add_argument("--run-dir", default="")
    p.add_argument("--node-dirs", default="")
    p.add_argument("--storage", default=None)
    p.add_argument("--fast", action="store_true")
    p.add_argument("--save", action="store_true")
    p.add_argument("--node-local", action="store_true", help="(worker) --node-dirs is this node's own dir")
    args = p.parse_args()
    if args.worker:
        args.mode = args.worker
        _worker(args)
        return
    only = set(args.only.split(","))
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give 1 or more (restores from each tier per saved run)")
    if args.device == "cuda" and "cluster" in only:
        raise SystemExit("--device cuda: the namespace cluster's nodes have no GPU; leave out --only cluster")
    if args.device == "cuda":
        import torch  # noqa: PLC0415 - only to say so in one line before two ranks fail on it

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False)")
    scratch = Path(tempfile.mkdtemp(prefix="fastbench-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="fastbench-", dir="/dev/shm"))
    results: dict[str, Any] = {"mb": args.mb, "steps": args.steps, "every": args.every, "cpus": os.cpu_count(),
                               "device": args.device, "strategy": args.strategy}  # fmt: skip
    try:
        if "overhead" in only:
            results["overhead"] = _overhead(args, scratch, shm)
        results["recovery"] = _recoveries(args, only, scratch, shm)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fast_recovery.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n| durable tier | durable save | restore: durable | restore: fast | durable / fast | fast / limit "
          "| fast / limit, fresh memory |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results["recovery"]:
        print(f"| {r['where']} | {r['durable_save_s']:.2f} s | {r['durable_s']:.2f} s | {r['fast_s']:.2f} s | "
              f"{r['ratio']:.1f}x | {r['to_limit']:.2f}x | {r['to_fresh_limit']:.2f}x |")  # fmt: skip


def _overhead(args: argparse.Namespace, scratch: Path, shm: Path) -> dict[str, Any]:
    plain = _launch(args, "train", scratch / "plain", shm / "plain", fast=False)
    fast = _launch(args, "train", scratch / "fast", shm / "fast", fast=True)
    shutil.rmtree(shm, ignore_errors=True)  # RAM: the next section needs it
    niced = None
    if args.nice:  # the same, the background thread at a lower priority than training's
        niced = _launch(args, "train", scratch / "niced", shm / "niced", fast=True,
                        env={"PIPELINE_FAST_NICE": str(args.nice)})  # fmt: skip
        shutil.rmtree(shm, ignore_errors=True)
    o = {
        "plain_train_s": plain["train_s"],
        "fast_train_s": fast["train_s"],
        "overhead": fast["train_s"] / plain["train_s"] - 1,
        "blocked_s": fast["blocked_s"],
        "persist_s": fast.get("persist_s"),
        "held_bytes_per_rank": fast.get("held_bytes"),
        "written_per_save": fast.get("written_per_save"),
        "sent_per_save": fast.get("sent_per_save"),
        "persist_cpu_per_save": fast.get("persist_cpu_per_save"),
        "renamed_per_save": fast.get("renamed_per_save"),
        # from the third save on: the first two take new pages (the node holds two steps before it drops one)
        "steady_cpu_per_save": fast.get("steady_cpu_per_save"),
        "phase_cpu_per_save": fast.get("phase_cpu_per_save"),
        "extra_cpu_per_save": (fast["cpu_s"] - plain["cpu_s"]) / max(1, len(fast["blocked_s"])),
        # after the third save: the node reuses the pages of the steps it dropped (the first two saves take new
        # pages, and the second one's background work runs until the third)
        "steady_overhead": sum(fast["step_s"][3 * args.every :]) / sum(plain["step_s"][3 * args.every :]) - 1
        if args.steps > 3 * args.every
        else None,
    }
    if niced is not None:
        o["niced"] = {"nice": args.nice, "fast_train_s": niced["train_s"],
                      "overhead": niced["train_s"] / plain["train_s"] - 1,
                      "steady_overhead": sum(niced["step_s"][3 * args.every :])
                      / sum(plain["step_s"][3 * args.every :]) - 1 if args.steps > 3 * args.every else None,
                      "blocked_s": niced["blocked_s"]}  # fmt: skip
        print(f"  background at nice {args.nice}: overhead {o['niced']['overhead']:+.1%}, steady state "
              f"{o['niced']['steady_overhead'] or 0:+.1%}", flush=True)  # fmt: skip
    print(f"  overhead: {o['overhead']:+.1%} ({plain['train_s']:.1f}s -> {fast['train_s']:.1f}s for {args.steps} "
          f"steps); blocked {max(fast['blocked_s']):.2f}s per fast save; background {o['persist_s']:.2f}s; "
          f"{(o['held_bytes_per_rank'] or 0) / 1e9:.2f} GB held per rank", flush=True)  # fmt: skip
    if o["steady_overhead"] is not None:
        print(f"  steady state (steps {3 * args.every + 1}..{args.steps}): {o['steady_overhead']:+.1%}", flush=True)
    steady = o["steady_cpu_per_save"]
    print(f"  per fast save and rank: written {o['written_per_save'] / 1e9:.2f} GB ("
          f"{(o['renamed_per_save'] or 0) / 1e9:.2f} GB of it renamed, not copied), sent "
          f"{o['sent_per_save'] / 1e9:.2f} GB; background thread {o['persist_cpu_per_save']:.2f} CPU-s"
          f"{f' ({steady:.2f} from the third save)' if steady is not None else ''}; the process's extra CPU "
          f"{o['extra_cpu_per_save']:.2f} CPU-s (rank 0)", flush=True)  # fmt: skip
    return o


def _steady(per_save: list[float]) -> float | None:
    """The mean background CPU of the saves after the first two (None: fewer than three)."""
    return sum(per_save[2:]) / len(per_save[2:]) if len(per_save) > 2 else None


def _recoveries(args: argparse.Namespace, only: set[str], scratch: Path, shm: Path) -> list[dict[str, Any]]:
    out = []
    if "local" in only:
        out.append(_recovery(args, "local disk", scratch / "local", shm / "local", None, None))
    if "sharedfs" in only:
        from tests.sharedfs import shared_filesystem, skip_reason  # noqa: PLC0415

        why = skip_reason()
        if why:
            print(f"  shared filesystem skipped: {why}")
        else:
            with shared_filesystem(scratch / "sfs", mounts=1) as fs:
                out.append(_recovery(args, "SeaweedFS FUSE", fs.mounts[0] / "run", shm / "sfs", None, None))
    if "cluster" in only:
        out.append(_cluster_recovery(args))
    if "s3" in only:
        from tests.s3.server import seaweedfs  # noqa: PLC0415

        with seaweedfs(scratch / "s3data", volume_mb=1024) as server:
            url = f"s3://{server.new_bucket()}/run"
            out.append(_recovery(args, "S3 bucket", scratch / "s3run", shm / "s3", url, server.env()))
    return out


# -- across the namespace cluster's nodes (scripts/cluster) ------------------------------------------------------

CLUSTER = ROOT / "scripts" / "cluster"


def _node(action: str, node: str, *cmd: str, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = ["bash", str(CLUSTER / "node.sh"), action, node, *cmd]
    if log is None:
        return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    with open(log, "w") as f:
        return subprocess.run(args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, check=False)


def _on_two_nodes(args: argparse.Namespace, mode: str, run: str, logs: Path, *, fast: bool,
                  save: bool = False) -> dict[str, Any]:  # fmt: skip
    """The worker under ``torchrun --nnodes 2`` (c10d at node1), one rank per node, its fast dir the node's
    own tmpfs (``/local/fast``); rank 0's RESULT."""
    import threading  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400",
            "--rdzv-id", uuid.uuid4().hex[:8]]  # fmt: skip
    cmd = ["env", "OMP_NUM_THREADS=1", str(Path(sys.executable).with_name("torchrun")), *rdzv, __file__,
           "--worker", mode, "--run-dir", run, "--node-dirs", "/local/fast", "--node-local", "--mb", str(args.mb),
           "--steps", str(args.steps), "--every", str(args.every)]  # fmt: skip
    cmd += ["--fast"] if fast else []
    cmd += ["--save"] if save else []
    done: dict[str, subprocess.CompletedProcess[str]] = {}

    def agent(node: str) -> None:
        done[node] = _node("exec", node, *cmd, log=logs / f"{mode}-{node}.log")

    agents = [threading.Thread(target=agent, args=(n,)) for n in ("node1", "node2")]
    for a in agents:
        a.start()
    for a in agents:
        a.join()
    text = (logs / f"{mode}-node1.log").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if any(d.returncode != 0 for d in done.values()) or not lines:
        raise SystemExit(f"cluster {mode} failed: {text[-3000:]}")
    return dict(json.loads(lines[-1][7:]))


def _cluster_recovery(args: argparse.Namespace) -> dict[str, Any]:
    """Node1 and node2 of a 3-node namespace cluster (own network, hostname, tmpfs ``/local`` and FUSE mount of one
    SeaweedFS filer at ``/shared``): train and save (durably in ``/shared``, fast in each node's ``/local`` with a
    replica on the other node), kill node2 (its ``/local`` is lost) and bring it back empty, then restore from the
    fast tier (node2's shard from node1's replica over the veth network) and from the durable tier alone."""
    need_mb = int(args.mb * 2 * 2 * 1.25) + 256  # own + replica, keep 2, the room check's margin
    env = {**os.environ, "MN_LOCAL_MB": str(need_mb)}
    started = subprocess.run(["bash", str(CLUSTER / "start.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=False)  # fmt: skip
    if started.returncode != 0:  # nothing half-up is left behind
        subprocess.run(["bash", str(CLUSTER / "stop.sh")], cwd=ROOT, env=env, capture_output=True, check=False)
        raise SystemExit(f"scripts/cluster/start.sh failed: {started.stdout[-2000:]}{started.stderr[-2000:]}")
    logs = Path(tempfile.mkdtemp(prefix="fastbench-cluster-"))
    run = f"/shared/fastbench-{os.getpid()}/run"
    try:
        saved = _on_two_nodes(args, "train", run, logs, fast=True, save=True)
        _node("kill9", "node2")
        subprocess.run(["bash", str(CLUSTER / "node.sh"), "up", "node2"], cwd=ROOT, env=env, capture_output=True,
                       check=True)  # fmt: skip
        out = _rounds(args, "SeaweedFS FUSE across 2 namespace nodes", saved,
                      lambda fast: _on_two_nodes(args, "restore", run, logs, fast=fast))  # fmt: skip
    finally:
        subprocess.run(["bash", str(CLUSTER / "node.sh"), "exec", "login", "rm", "-rf", str(Path(run).parent)],
                       cwd=ROOT, capture_output=True, check=False)  # fmt: skip
        subprocess.run(["bash", str(CLUSTER / "stop.sh")], cwd=ROOT, env=env, capture_output=True, check=False)
        shutil.rmtree(logs, ignore_errors=True)
    out["overhead_on_cluster"] = {
        "train_s": saved["train_s"],
        "blocked_s": saved["blocked_s"],
        "persist_s": saved.get("persist_s"),
    }
    return out


if __name__ == "__main__":
    main()
