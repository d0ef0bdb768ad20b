"""A local tiny run with its train ranks forked from one import (``launcher.fork_tasks=true``, the default) against
the same run with every rank a new interpreter (``launcher.fork_tasks=false``), alternating, in this script.

Each round runs ``+experiment=tiny`` once each way in a fresh run root and reports the whole launch's CPU seconds
(the launcher and every process under it, from ``resource.getrusage(RUSAGE_CHILDREN)``) and wall seconds, and
the ratio forked / new interpreters of both.

    .venv/bin/python bench/fork_tasks.py [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _launch(fork: bool) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one tiny run."""
    with tempfile.TemporaryDirectory() as root:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        args = ["+experiment=tiny", f"run.root={root}", "run.id=b", "run.create=true", f"launcher.fork_tasks={fork}"]
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True, check=False
        )
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"the tiny run failed (fork_tasks={fork}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for fork in (False, True):
            runs[fork].append(_launch(fork))
    med = {f: (statistics.median(c for c, _ in r), statistics.median(w for _, w in r)) for f, r in runs.items()}
    out = {
        "new_interpreters": {"cpu_s": round(med[False][0], 2), "wall_s": round(med[False][1], 2)},
        "forked": {"cpu_s": round(med[True][0], 2), "wall_s": round(med[True][1], 2)},
        "cpu_ratio": round(med[True][0] / med[False][0], 3),
        "wall_ratio": round(med[True][1] / med[False][1], 3),
        "rounds": args.rounds,
    }
    if args.json:
        print(json.dumps(out))
        return
    for name in ("new_interpreters", "forked"):
        print(f"{name:17s} CPU {out[name]['cpu_s']:6.2f} s   wall {out[name]['wall_s']:6.2f} s (median)")
    print(f"forked / new: CPU {out['cpu_ratio']:.3f}x, wall {out['wall_ratio']:.3f}x ({args.rounds} rounds)")


if __name__ == "__main__":
    main()
