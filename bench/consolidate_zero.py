"""Time and peak RSS of consolidating a DeepSpeed ZeRO checkpoint: the pipeline versus DeepSpeed's zero_to_fp32.

Input: ``--size-mb`` (fp32 master weights of the model, default 200), ``--dim`` (hidden size, default 1024),
``--stages`` (default ``3,2``), ``--repeat`` (rounds per method, default 3).
Builds one 2-rank ZeRO checkpoint per stage with DeepSpeed on CPU (``torchrun``, gloo, a stack of ``Linear(dim,
dim)`` layers plus an odd-sized vector so the flat partitions are padded, client ``torch.optim.AdamW``, one
step), then runs each method in a fresh subprocess under ``/usr/bin/time -v`` (falling back to
``getrusage(RUSAGE_CHILDREN)``), order rotated per round:

* ``pipeline``: :func:`pipeline.formats.deepspeed_zero.consolidate_zero` (restricted unpickler, lazy tensors,
  streaming safetensors writer);
* ``deepspeed``: ``convert_zero_checkpoint_to_fp32_state_dict(..., safe_serialization=True, max_shard_size=None)``;
* ``baseline``: ``python -c "import torch"``; ``import pipeline`` / ``import deepspeed``: the imports alone of
  the two children (the pipeline's reader no longer imports ``torch.distributed.checkpoint``).

Output: a Markdown table (median [min-max] of peak RSS and wall time, RSS above the baseline, ratios pipeline /
deepspeed) and JSON at ``--out`` (default ``bench/results/consolidate_zero.json``). Both outputs are checked to
be equal tensor for tensor (names, dtypes, shapes, bytes).

    .venv/bin/python bench/consolidate_zero.py                       # 200 MB model, ZeRO-3 and ZeRO-2
    .venv/bin/python bench/consolidate_zero.py --size-mb 100 --stages 3 --repeat 1

Only the standard library is imported at module level so that the measured children import just what they use.
"""

from __future__ import annotations

import argparse
import json
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
from typing import Any

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
TIME_BIN = "/usr/bin/time"
WORLD = 2
TAG = "ckpt"
BUILD_TIMEOUT_S = 1200
CHILD_TIMEOUT_S = 1200

_BUILD_SCRIPT = r"""
import json, sys
from datetime import timedelta
import torch, torch.nn as nn, torch.distributed as dist
import deepspeed
from pipeline.strategies.zero import disable_shm_comm_op
disable_shm_comm_op()  # skips a 25 s JIT build (gloo is used)

save_dir, stage, dim, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", timeout=timedelta(seconds=600))
deepspeed.init_distributed(dist_backend="gloo")
ws = dist.get_world_size()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
        self.odd = nn.Parameter(torch.randn(1001))  # odd size: padded partitions

    def forward(self, x):
        return self.layers(x).pow(2).mean() + self.odd.sum() * 1e-3


torch.manual_seed(0)
model = Model()
cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * ws, "zero_optimization": {"stage": stage},
       "steps_per_print": 10**9}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       config=cfg)
loss = engine(torch.randn(2, dim, generator=torch.Generator().manual_seed(dist.get_rank())))
engine.backward(loss)
engine.step()
engine.save_checkpoint(save_dir, tag="ckpt", save_latest=False)
dist.barrier()
dist.destroy_process_group()
"""


# ------------------------------------------------------------------------------------------------ building


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def layers_for(size_mb: float, dim: int) -> int:
    return max(1, round(size_mb * MiB / (4 * (dim * dim + dim))))


def build(save_dir: Path, stage: int, size_mb: float, dim: int) -> float:
    """Train one step and save a 2-rank ZeRO checkpoint to ``save_dir/ckpt``; return the seconds it took."""
    save_dir.mkdir(parents=True, exist_ok=True)
    script = save_dir.parent / "_build_zero.py"
    script.write_text(_BUILD_SCRIPT)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
        f"--nproc-per-node={WORLD}", str(script), str(save_dir), str(stage), str(dim), str(layers_for(size_mb, dim)),
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"building the ZeRO-{stage} checkpoint failed ({p.returncode}):\n{p.stdout[-4000:]}"
                           f"\n{p.stderr[-4000:]}")  # fmt: skip
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ measured children


def child_pipeline(step_dir: Path, out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from pipeline.formats.deepspeed_zero import consolidate_zero

    t0 = time.perf_counter()
    count = consolidate_zero(step_dir, out / "model.safetensors")
    print(json.dumps({"inproc_s": time.perf_counter() - t0, "tensors": count}))


def child_deepspeed(step_dir: Path, out: Path) -> None:
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        convert_zero_checkpoint_to_fp32_state_dict(
            str(step_dir.parent), str(out), safe_serialization=True, max_shard_size=None, tag=step_dir.name
        )
    print(json.dumps({"inproc_s": time.perf_counter() - t0}))


# ----------------------------------------------------------------------------------------------- measuring


def measure(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd`` in a fresh process; its peak RSS (MiB), wall time (s) and the JSON line it printed, if any."""
    use_time = os.access(TIME_BIN, os.X_OK)
    full = [TIME_BIN, "-v", *cmd] if use_time else cmd
    if not use_time:
        import resource

        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(full, capture_output=True, text=True, check=False, env=env, timeout=CHILD_TIMEOUT_S)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    res: dict[str, float] = {"wall_s": wall}
    if use_time:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
        if not m:
            raise RuntimeError(f"no peak RSS in /usr/bin/time output:\n{p.stderr[-2000:]}")
        res["rss_mib"] = int(m.group(1)) / 1024
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if peak <= before:
            raise RuntimeError("getrusage(RUSAGE_CHILDREN) cannot isolate this child: run a larger child first")
        res["rss_mib"] = peak / 1024
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            res.update(json.loads(line))
    return res


def verify(ours: Path, theirs: Path) -> str:
    """Both files hold the same tensors: names, dtypes, shapes and bytes (one tensor in memory at a time)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(ours), "pt") as a, safe_open(str(theirs), "pt") as b:
        names = set(a.keys())
        if names != set(b.keys()):
            raise AssertionError(f"names differ: {sorted(names ^ set(b.keys()))[:5]}")
        for n in sorted(names):
            x, y = a.get_tensor(n), b.get_tensor(n)
            if (
                x.dtype != y.dtype
                or x.shape != y.shape
                or not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
            ):
                raise AssertionError(f"{n} differs")  # fmt: skip
    return f"{len(names)} tensors equal (names, dtypes, shapes, bytes)"


def run_stage(args: argparse.Namespace, scratch: Path, stage: int) -> dict[str, object]:
    save_dir = scratch / f"zero{stage}"
    print(f"ZeRO-{stage}: building a {WORLD}-rank checkpoint ({args.size_mb} MB fp32 weights, dim {args.dim}) ...")
    build_s = build(save_dir, stage, args.size_mb, args.dim)
    step_dir = save_dir / TAG
    files = {p.name: p.stat().st_size for p in sorted(step_dir.iterdir()) if p.suffix == ".pt"}
    ckpt_bytes = sum(files.values())
    print(f"  built in {build_s:.1f}s: " + ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in files.items()))
    py, me = sys.executable, str(Path(__file__).resolve())
    outs = {"pipeline": scratch / f"out{stage}_pipeline", "deepspeed": scratch / f"out{stage}_deepspeed"}
    for o in outs.values():
        o.mkdir()
    methods = {
        "baseline": [py, "-c", "import torch"],
        "import pipeline": [py, "-c", "import pipeline.formats.deepspeed_zero"],
        "import deepspeed": [py, "-c", "import deepspeed.utils.zero_to_fp32"],
        "pipeline": [py, me, "--_child", "pipeline", "--_step", str(step_dir), "--_out", str(outs["pipeline"])],
        "deepspeed": [py, me, "--_child", "deepspeed", "--_step", str(step_dir), "--_out", str(outs["deepspeed"])],
    }
    names = list(methods)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.repeat):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            runs[n].append(measure(methods[n]))
            print(f"  round {r + 1} {n:10s} rss {runs[n][-1]['rss_mib']:7.1f} MiB  wall {runs[n][-1]['wall_s']:.2f}s")
    check = verify(outs["pipeline"] / "model.safetensors", outs["deepspeed"] / "model.safetensors")
    model_bytes = (outs["pipeline"] / "model.safetensors").stat().st_size

    def med(n: str, k: str) -> float:
        return statistics.median(x[k] for x in runs[n])

    base = med("baseline", "rss_mib")
    summary: dict[str, object] = {
        "stage": stage,
        "world_size": WORLD,
        "checkpoint_bytes": ckpt_bytes,
        "files": files,
        "consolidated_bytes": model_bytes,
        "largest_tensor_bytes": 4 * args.dim * args.dim,
        "build_s": build_s,
        "runs": runs,
        "median": {n: {k: med(n, k) for k in runs[n][0]} for n in names},
        "rss_ratio": med("pipeline", "rss_mib") / med("deepspeed", "rss_mib"),
        "rss_above_base_ratio": (med("pipeline", "rss_mib") - base) / (med("deepspeed", "rss_mib") - base),
        "wall_ratio": med("pipeline", "wall_s") / med("deepspeed", "wall_s"),
        "inproc_ratio": med("pipeline", "inproc_s") / med("deepspeed", "inproc_s"),
        "verify": check,
    }
    return summary


def table(results: list[dict[str, Any]], repeat: int) -> str:
    cols = ["stage", "method", "peak RSS MiB", "above base MiB", "above / output", "wall s", "in-proc s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for res in results:
        runs, out_mib = res["runs"], res["consolidated_bytes"] / MiB
        base = statistics.median(x["rss_mib"] for x in runs["baseline"])
        for n, xs in runs.items():

            def rng(k: str, fmt: str, xs: list[dict[str, float]] = xs) -> str:
                if k not in xs[0]:
                    return "-"
                v = [x[k] for x in xs]
                return f"{format(statistics.median(v), fmt)} [{format(min(v), fmt)}-{format(max(v), fmt)}]"

            above = statistics.median(x["rss_mib"] for x in xs) - base
            measured = n != "baseline"
            cells = [
                f"ZeRO-{res['stage']}",
                n,
                rng("rss_mib", ".0f"),
                f"{above:.0f}" if measured else "-",
                f"{above / out_mib:.2f}" if measured else "-",
                rng("wall_s", ".2f"),
                rng("inproc_s", ".2f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"median [min-max] of {repeat} rounds; output = the consolidated fp32 safetensors file")
    for res in results:
        lines.append(
            f"ZeRO-{res['stage']} (checkpoint {res['checkpoint_bytes'] / MiB:.0f} MiB, output "
            f"{res['consolidated_bytes'] / MiB:.0f} MiB, largest tensor {res['largest_tensor_bytes'] / MiB:.1f} MiB): "
            f"pipeline / deepspeed peak RSS {res['rss_ratio']:.3f}, RSS above baseline "
            f"{res['rss_above_base_ratio']:.3f}, wall {res['wall_ratio']:.2f}, in-process {res['inproc_ratio']:.2f}; "
            f"verify: {res['verify']}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=200, help="fp32 master weights of the model (MB)")
    ap.add_argument("--dim", type=int, default=1024, help="hidden size (largest tensor: dim x dim fp32)")
    ap.add_argument("--stages", default="3,2", help="comma-separated ZeRO stages to measure")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per method (order rotated); median [min-max]")
    ap.add_argument("--out", default=str(ROOT / "bench/results/consolidate_zero.json"), help="JSON results path")
    ap.add_argument("--tmpdir", default=None, help="parent of the scratch dir (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    ap.add_argument("--_child", choices=["pipeline", "deepspeed"], help=argparse.SUPPRESS)
    ap.add_argument("--_step", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child == "pipeline":
        return child_pipeline(Path(args._step), Path(args._out))
    if args._child == "deepspeed":
        return child_deepspeed(Path(args._step), Path(args._out))

    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="consolidate_zero_", dir=args.tmpdir))
    try:
        print(f"peak RSS via {TIME_BIN + ' -v' if os.access(TIME_BIN, os.X_OK) else 'getrusage(RUSAGE_CHILDREN)'}")
        results = [run_stage(args, scratch, s) for s in stages]
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(table(results, args.repeat))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"size_mb": args.size_mb, "dim": args.dim, "repeat": args.repeat, "python": sys.version.split()[0]}
    out.write_text(json.dumps({"config": meta, "results": results}, indent=2) + "\n")
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
