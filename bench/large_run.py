"""The >= 1 GB example (``+experiment=large``) through the app: what a checkpoint costs at size.

    .venv/bin/python bench/large_run.py [--out DIR] [--steps 6]

Runs the experiment twice (``checkpoint.async_save=false``, then ``true``; 2 DDP ranks, gloo) and reports from
each run's ``metrics.jsonl`` and its steps:

* step time (median over the steps without a save), and the checkpoint's blocked time (how long training
  waited) as a fraction of the step time;
* commit lag behind training: from the end of a checkpoint step's training (its step event) to its
  manifest's publication (the manifest's mtime), the median over the run's checkpoints;
* consolidation of the last step (``consolidate_step`` in a fresh process) against ``cat`` of the same files
  (the copy floor): wall seconds and peak RSS (``/usr/bin/time -v``), the input dropped from the page cache
  before each (``POSIX_FADV_DONTNEED``).

Writes ``large_run.json`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from run import drop_cache  # noqa: E402 - bench/ is on sys.path when a script runs as bench/<name>.py

ROOT = Path(__file__).resolve().parents[1]


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        drop_cache(p)


def _timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``cmd`` under /usr/bin/time -v."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, check=True)
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", proc.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    assert wall and rss, proc.stderr
    h, m, s = wall.groups()
    return int(h or 0) * 3600 + int(m) * 60 + float(s), int(rss.group(1)) * 1024


def _run(root: Path, run_id: str, steps: int, async_save: bool) -> dict[str, object]:
    cmd = [sys.executable, "-m", "pipeline", "+experiment=large", f"run.root={root}", f"run.id={run_id}"]
    cmd += ["run.create=true", f"train.steps={steps}", f"checkpoint.async_save={str(async_save).lower()}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    run_dir = root / "large" / run_id
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ckpts = [e for e in events if e["event"] == "checkpoint" and e.get("ok")]
    saved = {e["step"] for e in ckpts}
    step_s = statistics.median(e["step_s"] for e in events if e["event"] == "step" and e["step"] not in saved)
    blocked = statistics.median(e["blocked_s"] for e in ckpts)
    trained = {e["step"]: e["time"] for e in events if e["event"] == "step"}
    lags = [(run_dir / "checkpoints" / f"step_{s}" / "manifest.json").stat().st_mtime - trained[s] for s in saved]
    return {
        "run_dir": str(run_dir),
        "checkpoint_bytes": ckpts[-1]["bytes"],
        "step_s": step_s,
        "blocked_s": blocked,
        "blocked_fraction_of_step": blocked / step_s,
        "commit_lag_s": statistics.median(lags),
        "last_step": max(saved),
    }


def _consolidation(step_dir: Path, scratch: Path) -> dict[str, float]:
    files = sorted(step_dir.glob("*.distcp")) + [step_dir / ".metadata"]
    out = scratch / "consolidated.safetensors"
    code = (
        "import sys; from pathlib import Path; from pipeline.checkpoint.outputs import consolidate_step; "
        "consolidate_step(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    _drop_cache(files)
    wall, rss = _timed([sys.executable, "-c", code, str(step_dir), str(out)])
    size = out.stat().st_size
    out.unlink()
    _drop_cache(files)
    cat_wall, cat_rss = _timed(["sh", "-c", f"cat {' '.join(map(str, files))} > {scratch / 'cat.out'} && sync"])
    return {
        "consolidate_s": wall,
        "consolidate_peak_rss_mb": rss / 2**20,
        "consolidated_mb": size / 2**20,
        "cat_s": cat_wall,
        "cat_peak_rss_mb": cat_rss / 2**20,
        "ratio_to_cat": wall / cat_wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "latest")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="large-run-") as tmp:
        root = Path(tmp)
        results: dict[str, object] = {
            "sync": _run(root, "sync", args.steps, False),
            "async": _run(root, "async", args.steps, True),
        }
        sync = results["sync"]
        assert isinstance(sync, dict)
        step_dir = Path(str(sync["run_dir"])) / "checkpoints" / f"step_{sync['last_step']}"
        results["consolidation"] = _consolidation(step_dir, root)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "large_run.json").write_text(json.dumps(results, indent=2))
    for name, figures in results.items():
        assert isinstance(figures, dict)
        print(
            name + ": " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        )


if __name__ == "__main__":
    main()
