"""Per-stage local overhead: what a stage costs beyond its own work when launched as a local submitit job.

A tiny run is made once (``+experiment=tiny``, CPU). Then each stage that works on a finished run is rerun
alone with ``stage=<name> force=true`` (``launcher=local``): the launcher prints ``done <stage> in X s`` (from
submission to the runner seeing the job's end: process start, imports, input checks, the work, records,
the poll), and the stage's record holds ``seconds``, the time of its ``run()`` alone. Overhead = X - seconds.
The whole command's wall time (composing the config, planning, the lease) is reported beside it.

    .venv/bin/python bench/stage_overhead.py [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("verify_manifest", "consolidate", "export")


def _pipeline(*args: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True, check=False, timeout=900
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"python -m pipeline {' '.join(args)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p.stdout + p.stderr, wall


def run(rounds: int = 3) -> dict[str, object]:
    scratch = Path(tempfile.mkdtemp(prefix="stage-overhead-"))
    try:
        root = scratch / "outputs"
        _pipeline("+experiment=tiny", f"run.root={root}", "run.id=bench", "run.create=true")
        run_dir = root / "tiny" / "bench"
        samples: dict[str, list[dict[str, float]]] = {s: [] for s in STAGES}
        for _ in range(rounds):
            for stage in STAGES:
                out, wall = _pipeline(f"run.root={root}", "run.id=bench", f"stage={stage}", "force=true")
                m = re.search(rf"done {stage} in ([0-9.]+)s", out)
                if m is None:
                    raise RuntimeError(f"no 'done {stage} in' line in:\n{out[-2000:]}")
                job = float(m.group(1))
                work = float(json.loads((run_dir / "stages" / f"{stage}.json").read_text())["seconds"])
                samples[stage].append({"job_s": job, "work_s": work, "overhead_s": job - work, "command_s": wall})
        table = []
        for stage, rows in samples.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            table.append({"stage": stage, **{k: round(v, 3) for k, v in med.items()}})
        worst = max(r["overhead_s"] for r in table)
        return {"rounds": rounds, "stages": table, "max_overhead_s": worst, "target_s": 2.0, "met": worst <= 2.0}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = ap.parse_args()
    res = run(args.rounds)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print("| stage | job s | run() s | overhead s | whole command s |")
    print("|---|---|---|---|---|")
    for r in res["stages"]:  # type: ignore[attr-defined]
        print(f"| {r['stage']} | {r['job_s']} | {r['work_s']} | {r['overhead_s']} | {r['command_s']} |")
    print(f"max overhead {res['max_overhead_s']:.2f} s (target <= 2 s: {'met' if res['met'] else 'not met'})")


if __name__ == "__main__":
    main()
