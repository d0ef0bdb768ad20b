"""``python -m pipeline.status <run dir | run id | last> [--step N | --best] [--verify] [--json] [--root DIR]``

Shows one run without touching it (no lease, nothing written): who owns it, each stage's last record (with the
scheduler's word on its job), the errors and their logs, committed / staged / quarantined steps, retention,
outputs, and the resume command. A library checkpoint dir shows its checkpoints (a dir whose checkpoints live in a
bucket shows the bucket's). ``--step N`` / ``--best`` also name that committed step with its recorded metrics.
``--verify`` also re-hashes every committed step (or only the one named) against its manifest and says per step ok
or damaged (naming the file). Exit 0 when the status
could be shown (a failed run included), 1 when ``--verify`` found a damaged step or the checkpoints' store (a
bucket) cannot be read, 2 for bad arguments or an unknown run (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pipeline.consolidate import add_step_arguments
from pipeline.consolidate import chosen_step as chosen_arg
from pipeline.driver.run_status import chosen_step, collect, collect_checkpoints, verify_steps
from pipeline.driver.status_view import render
from pipeline.errors import PipelineError, RunNotFoundError, run_command
from pipeline.rundir.layout import RUN_YAML, RunLayout
from pipeline.rundir.runs import DEFAULT_ROOT, locate_run, newest_runs
from pipeline.storage.integrity import lstat_kind
from pipeline.storage.layout import CheckpointLayout


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.status",
        description=" ".join((__doc__ or "").split("\n\n", 1)[-1].split()).replace("``", ""),  # the docstring's text
    )
    p.add_argument(
        "run", help="a run dir (holding run.yaml), a library checkpoint dir, a run id, or 'last' for the newest run"
    )
    p.add_argument("--root", default=DEFAULT_ROOT, help="where runs live, as run.root (default: %(default)s)")
    p.add_argument("--experiment", help="look the id up under this experiment only (default: every experiment)")
    p.add_argument("--json", action="store_true", help="print the same data as one JSON object")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also re-hash every committed step's files against its manifest (reads every byte; changes nothing): "
        "ok or damaged per step, exit 1 when one is damaged",
    )
    add_step_arguments(p)
    return p


def resolve_run(arg: str, root: str, experiment: str | None) -> RunLayout | CheckpointLayout:
    """A run dir as given, a library checkpoint dir (``checkpoints/`` without ``run.yaml``), or the run
    ``<root>/<experiment>/<arg>`` (``last``: the newest); else RunNotFoundError."""
    path = Path(arg)
    if (path / RUN_YAML).is_file():
        return RunLayout(path.resolve())
    library = CheckpointLayout(path.resolve())
    if lstat_kind(library.checkpoints) == "dir":
        return library
    if arg.startswith("s3://"):
        raise RunNotFoundError(
            f"{arg}: status takes the local dir the checkpoints' bucket is recorded in (the Checkpointer's directory, "
            "or the run dir), which names the bucket: python -m pipeline.status <that dir>"
        )
    if "/" in arg or arg in (".", ".."):
        raise RunNotFoundError(
            f"{arg} is not a run dir (no {RUN_YAML}) nor a checkpoint dir of the library (no checkpoints/)"
        )
    base = Path(root).resolve()
    found = locate_run(arg, base, experiment, how_to_pick="add --experiment NAME")
    if found is None:
        where = base / experiment if experiment else base
        newest = ", ".join(d.name for d in newest_runs(base, experiment, 5)) or "none"
        raise RunNotFoundError(f"no run {arg!r} under {where} (newest: {newest}); check the id, --root, --experiment")
    return RunLayout(found)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or argparse's usage error (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        layout = resolve_run(args.run, args.root, args.experiment)
    except (PipelineError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    status = collect(layout) if isinstance(layout, RunLayout) else collect_checkpoints(layout)
    lines = list(render(status))
    only = None
    if args.step is not None or args.best:
        try:
            chosen = status["chosen"] = chosen_step(layout, chosen_arg(args), args.best_metric, args.best_mode)
        except (PipelineError, OSError) as e:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        only = int(chosen["step"])
        shown = ", ".join(f"{k} {v}" for k, v in sorted(chosen["metrics"].items())) or "no metrics recorded"
        lines.append(f"chosen ({chosen['asked']}): step {only}, {shown}; manifest {chosen['manifest']}")
    if args.verify:
        try:
            checks = status["verify"] = verify_steps(layout, only)
        except (PipelineError, OSError) as e:
            print(f"error: cannot verify: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        lines += [f"verify: step {v['step']} {'ok' if v['ok'] else 'DAMAGED: ' + v['error']}" for v in checks]
        lines.append(f"verify: {sum(v['ok'] for v in checks)} of {len(checks)} committed step(s) ok")
    text = json.dumps(status, indent=2, default=str) if args.json else "\n".join(lines)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # piped into head & co.: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not fail again
    unreadable = status.get("checkpoints", {}).get("unreadable")
    if unreadable:  # not "committed: none": a store that cannot be read is not an empty one
        why = " ".join(str(unreadable).split())
        print(f"error: cannot read the checkpoints: {why} (check the endpoint and the AWS_* credentials)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 1 if any(not v["ok"] for v in status.get("verify", ())) else 0


if __name__ == "__main__":
    sys.exit(run_command(main, "nothing was written"))
