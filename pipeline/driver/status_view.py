"""The terminal view of a run's status: :func:`render` turns :func:`~pipeline.driver.run_status.collect`'s
(or ``collect_checkpoints``') JSON-able dict into aligned lines (``python -m pipeline.status``, ``status=true``)."""

from __future__ import annotations

from typing import Any

from pipeline.driver.progress import format_bytes, format_duration

Status = dict[str, Any]


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip() for r in rows]


def _duration(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else format_duration(seconds)


def _state_text(st: Status) -> str:
    text = str(st["state"])
    if st.get("slurm_state") is not None or st.get("cluster") == "slurm":
        text += f" (SLURM: {st.get('slurm_state') or 'unknown'})"
    elif st["state"] == "died" and st.get("pid") is not None:
        text += f" (pid {st['pid']} gone)"
    if st.get("signal"):
        text += f" by {st['signal']}"
    return text + (f" ({st['note']})" if st.get("note") else "")


def _stage_lines(stages: list[Status]) -> list[str]:
    rows = [["stage", "state", "attempt", "job", "nodes", "started", "ended", "time"]]
    for st in stages:
        secs, so_far = st.get("seconds"), st.get("running_for_s")
        rows.append(
            [
                st["stage"],
                _state_text(st),
                str(st.get("attempt", "")),
                str(st.get("job_id") or ""),
                str(st.get("nodes") or st.get("host") or ""),
                str(st.get("started", "")),
                str(st.get("ended", "")),
                _duration(secs) if isinstance(secs, int | float) else f"{_duration(so_far)} so far" if so_far else "",
            ]
        )
    lines = ["stages:", *_table(rows)]
    troubles = [st for st in stages if st["state"] in ("failed", "died", "interrupted", "unreadable")]
    if troubles:
        lines.append("errors:")
    for st in troubles:
        lines.append(f"  {st['stage']}: {_state_text(st)}: {st.get('error') or '(no error recorded)'}")
        if st.get("log_dir"):
            files = f" ({', '.join(st['log_files'])})" if st.get("log_files") else " (no *_log.err files)"
            lines.append(f"    logs: {st['log_dir']}/{files}")
    return lines


def _checkpoint_lines(ck: Status) -> list[str]:
    lines = [f"checkpoints: {ck['store']}" if ck.get("store") else "checkpoints:"]
    latest = ck["latest"]
    lines.append(f"  latest: step {latest['step']}" if latest else f"  latest: {ck['latest_error'] or 'none'}")
    names = sorted({n for c in ck["committed"] for n in c.get("metrics") or {}})
    rows = [["committed", "files", "size", "shared", "format", *names, ""]]
    for c in ck["committed"]:
        if "error" in c:
            rows.append([f"step {c['step']}", "", "", "", "", *([""] * len(names)), f"damaged: {c['error']}"])
        else:
            written = f"{c['format']} x{c['world_size']}"
            latest_mark = "latest" if c["latest"] else ""
            shared = format_bytes(c["shared_bytes"]) if c.get("shared_files") else "-"
            values = [_metric_text((c.get("metrics") or {}), n) for n in names]
            row = [f"step {c['step']}", str(c["files"]), format_bytes(c["bytes"]), shared, written, *values]
            rows.append([*row, latest_mark])
    lines += _table(rows) if len(rows) > 1 else ["  committed: none"]
    saved = ck.get("shared_saved")
    if saved:
        lines.append(f"  shared pieces: {format_bytes(saved)} stored once instead of once per step")
    for s in ck["staged"]:
        of = f" of {s['world_size']}" if s.get("world_size") else ""
        text = s["error"] if "error" in s else f"{s['markers']}{of} rank markers"
        attempt = f" (attempt {s['attempt']})" if s.get("attempt") else ""
        lines.append(f"  staged: step {s['step']}{attempt}: {text}")
    for q in ck["quarantined"]:
        what = f"step {q['step']}" if q.get("step") is not None else "not a step"
        when = f", {q['time']}" if q.get("time") else ""
        lines.append(f"  quarantined: {q['name']} ({what}{when}): {q.get('reason') or q.get('error')}")
    if "retention" in ck:
        lines += _retention_lines(ck["retention"], ck["retention_error"])
    return lines + _resume_lines(ck.get("resumed"), ck.get("resumed_error"))


def _metric_text(metrics: dict[str, Any], name: str) -> str:
    """A step's recorded value of ``name`` (``-``: not recorded; ``nan``: recorded, not finite)."""
    if name not in metrics:
        return "-"
    value = metrics[name]
    return "nan" if value is None else f"{value:.4g}"


def _resume_lines(rec: Any, error: str | None) -> list[str]:
    """The fast tier's settings and how the last launch resumed (``checkpoints/resumed.json``)."""
    if error:
        return [f"  last resume: unreadable record ({error})"]
    if not isinstance(rec, dict):
        return []
    lines = []
    fast = rec.get("fast")
    if isinstance(fast, dict):
        where = "on this node (one node: they do not survive its loss)" if fast.get("same_node") else "on other nodes"
        lines.append(
            f"  fast tier: every {fast.get('every')} steps in {fast.get('dir')} (node-local), "
            f"{fast.get('replicas')} replica(s) {where}, newest {fast.get('keep')} kept"
        )
    step, tier = rec.get("step"), rec.get("tier")
    if tier == "none":
        lines.append(f"  last resume: none (attempt {rec.get('attempt')} started fresh)")
    else:
        took = f" in {rec['seconds']}s" if rec.get("seconds") is not None else ""
        lines.append(f"  last resume: step {step} from the {tier} tier{took} (attempt {rec.get('attempt')})")
    for s in rec.get("sources") or []:
        if isinstance(s, dict):
            lines.append(f"    rank {s.get('rank')}: {s.get('from')} ({s.get('host')})")
    lines += [f"    quarantined: {p}" for p in rec.get("fast_problems") or []]
    return lines


def _reasons(why: Any) -> str:
    return ", ".join(map(str, why)) if isinstance(why, list | tuple) else str(why)


def _kept_text(kept: Any) -> str:
    """``{step: reason(s)}`` or ``[{"step": N, "reasons": [...]}]``, whichever the record holds."""
    if isinstance(kept, dict):
        items = [(k, v) for k, v in kept.items()]
    elif isinstance(kept, list):
        items = [(k["step"], k.get("reasons", "")) if isinstance(k, dict) and "step" in k else (k, "") for k in kept]
    else:
        return str(kept)[:200]
    return ", ".join(f"step {s}" + (f" ({_reasons(why)})" if why else "") for s, why in items) or "none"


def _retention_lines(rec: Any, error: str | None) -> list[str]:
    """Whatever ``checkpoints/retention.json`` holds: per-area decisions (``areas``) or one flat decision."""
    if error is not None:
        return [f"  retention: unreadable: {error}"]
    if rec is None:
        return []
    if not isinstance(rec, dict):
        return [f"  retention: not a JSON object: {str(rec)[:120]}"]
    at = f" at {rec['time']}" if "time" in rec else ""
    of = f" (latest step {rec['latest']})" if rec.get("latest") is not None else ""
    lines = [f"  retention{at}{of}:"]
    policy = rec.get("policy")
    if isinstance(policy, dict):
        lines.append("    policy: " + (", ".join(f"{k}={v}" for k, v in policy.items() if v is not None) or "none"))
    areas = rec["areas"] if isinstance(rec.get("areas"), dict) else {"": rec}
    for name, area in areas.items():
        head = f"    {name}: " if name else "    "
        if not isinstance(area, dict):
            lines.append(f"{head}{str(area)[:200]}")
            continue
        parts = [f"kept {_kept_text(area['kept'])}"] if "kept" in area else []
        removed = area.get("removed")
        if removed is not None:
            steps = ", ".join(f"step {s}" for s in removed) if isinstance(removed, list) else str(removed)[:200]
            parts.append(f"removed {steps or 'none'}")
        lines.append(head + "; ".join(parts))
    shown = {"time", "latest", "policy", "areas", "kept", "removed"}
    lines += [f"    {k}: {str(v)[:200]}" for k, v in rec.items() if k not in shown]
    return lines


def _owner_lines(status: Status) -> list[str]:
    owner = status["owner"]
    if owner is None:
        return [f"owner:      {status['owner_error'] or 'none (no launch is running)'}"]
    left = f"exited {owner['handed_over']}" if owner.get("handed_over") else "not running"
    alive = {
        "alive": "alive",
        "jobs": f"{left}; its jobs hold the run until they end",
        "ended": f"{left}; its jobs have all ended: nobody owns the run, the next launch takes it",
        "other host": "other host",
        "stale": "not running: a stale lease",
    }[owner["state"]]
    jobs_text = ", ".join(
        f"{j.get('stage')} {j.get('job_id')} ({j.get('cluster')}: {j.get('state')})" for j in owner["jobs"]
    )
    return [
        f"owner:      pid {owner['pid']} on {owner['host']} since {owner['started']} ({alive})",
        f"jobs:       {jobs_text or 'none yet'}",
    ]


def _outputs_text(items: list[Status]) -> str:
    return ", ".join(f"step {o['step']}" + ("" if o["complete"] else " (no done-marker)") for o in items) or "none"


def _committer_text(status: Status) -> str:
    if not status["committer_running"]:
        return "not running"
    holder = status.get("committer")
    return f"running: {holder}" if holder else "running (holds the committer lock on this node)"


def render(status: Status) -> list[str]:
    """The terminal view of :func:`collect`'s (or :func:`collect_checkpoints`') dict."""
    if status.get("library"):
        lines = [
            f"checkpoints: {status['run_dir']} (written by the library's Checkpointer)",
            f"committer:  {_committer_text(status)}",
        ]
        lines += _checkpoint_lines(status["checkpoints"])
        lines.append(f"consolidated: {_outputs_text(status['consolidated'])}")
        lines.append(f"exported:     {_outputs_text(status['exported'])}")
        lines.append(f"resume:       {status['resume']}")
        return lines
    lines = [
        f"run:        {status['run_id']}",
        f"dir:        {status['run_dir']}",
        f"experiment: {status['experiment']}",
    ]
    if status["run_yaml_error"]:
        lines.append(f"run.yaml:   {status['run_yaml_error']}")
    lines += _owner_lines(status)
    lines += _stage_lines(status["stages"])
    lines += _checkpoint_lines(status["checkpoints"])
    lines.append(f"consolidated: {_outputs_text(status['consolidated'])}")
    lines.append(f"exported:     {_outputs_text(status['exported'])}")
    lines.append(f"resume:       {status['resume']}")
    return lines
