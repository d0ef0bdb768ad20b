"""Async shard-save (``checkpoint.async_save=true``): same checkpoints as a sync save; a writer that dies or
stalls is named within its deadline, the ranks agree, training goes on (or stops cleanly) and never hangs."""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.checkpoint.save.async_save import AsyncSaver, Progress
from pipeline.config.compose import load_config
from pipeline.errors import ConfigError
from pipeline.formats.dcp import read_metadata_safe
from pipeline.rundir.layout import RunLayout
from pipeline.stagekit.contract import TaskContext
from pipeline.stages import shard_save
from pipeline.storage.atomic import read_json
from tests.conftest import run_cli

ASYNC = ("checkpoint.async_save=true", "launcher.poll_interval_s=0.2")
DEADLINE_S = 5.0
WRITER_POINTS = ["async_save.before_write", "async_save.mid_write", "async_save.after_write"]
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


# --- one process: the saver itself (a world-size-1 gloo group) ---------------------------------------------------


def _ctx(tmp_path: Path, *overrides: str) -> TaskContext:
    cfg = load_config(["+experiment=tiny", f"run.root={tmp_path / 'out'}", "run.id=u", *overrides])
    layout = RunLayout.for_run(cfg.run.root, cfg.experiment, "u")
    return TaskContext(cfg=cfg, layout=layout, attempt="unit", rank=0, world_size=1)


def _state(mb: int) -> dict[str, Any]:
    n = mb * (1 << 20) // 4 // 8
    return {"model": {f"w{i}": torch.randn(n) for i in range(8)}, "step": torch.tensor(3), "lr": 0.5}


def test_staging_buffer_is_reused_and_holds_the_state_of_its_step(tmp_path: Path, one_rank: Any) -> None:
    seen: list[dict[str, torch.Tensor]] = []

    def persist(staged: dict[str, Any], _group: Any, _progress: Progress) -> tuple[int, int]:
        seen.append({k: v.clone() for k, v in staged["model"].items()})
        return 1, 0

    saver = AsyncSaver(0, one_rank, deadline_s=10, threads=1)
    state = _state(1)
    ptrs = []
    for step in (1, 2, 3):
        saver.start(step, state, persist)
        buffer = saver.staging_buffer()
        assert buffer is not None
        ptrs.append([t.data_ptr() for t in buffer["model"].values()])
        expected = {k: v.clone() for k, v in state["model"].items()}
        for t in state["model"].values():
            t.add_(1.0)  # training goes on while the writer runs: the staged copy must not change
        done = saver.wait()
        assert done is not None and done.ok and done.step == step
        assert all(torch.equal(seen[-1][k], expected[k]) for k in expected)
    assert ptrs[0] == ptrs[1] == ptrs[2], "every save must copy into the same preallocated buffer"


def test_blocked_time_is_far_below_the_persist_time(tmp_path: Path, one_rank: Any) -> None:
    ctx = _ctx(tmp_path)
    saver = AsyncSaver(0, one_rank, deadline_s=60, threads=2)
    state = _state(48)
    shard_save.save_async(ctx, saver, 1, state, waited_s=0.0)  # the first save also allocates the buffer
    first = saver.wait()
    assert first is not None and first.ok
    blocked = shard_save.save_async(ctx, saver, 2, state, waited_s=0.0)
    done = saver.wait()
    assert done is not None and done.ok and done.blocked_s == blocked
    assert (ctx.layout.staged_step(2) / "rank_0.done.json").is_file()
    assert blocked < done.persist_s, f"blocked {blocked:.3f} s, persist {done.persist_s:.3f} s"


@pytest.mark.parametrize("action", ["raise", "sleep"])
def test_a_dead_or_stalled_writer_is_named_within_the_deadline(
    tmp_path: Path, one_rank: Any, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    ctx = _ctx(tmp_path)
    # A writer that dies is named as soon as it dies, long before a generous deadline; one that stalls is named
    # when the deadline passes, with what it was doing. The clock starts once the writer is inside its first file
    # (the fault point), so a loaded machine that is slow to plan the save cannot move the stall elsewhere.
    deadline = 30.0 if action == "raise" else 1.0
    saver = AsyncSaver(0, one_rank, deadline_s=deadline, threads=1)
    fault = "async_save.mid_write@step=1" + ("@action=sleep@seconds=5" if action == "sleep" else "")
    monkeypatch.setenv("PIPELINE_FAULTS", fault)
    shard_save.save_async(ctx, saver, 1, _state(1), waited_s=0.0)
    if action == "sleep":
        job = saver._job  # noqa: SLF001 - the test waits for the writer to reach the stall it injected
        reached = time.monotonic() + 60
        while job is not None and not job.doing.startswith("writing file") and time.monotonic() < reached:
            time.sleep(0.01)
    t0 = time.monotonic()
    done = saver.wait()
    waited = time.monotonic() - t0
    assert done is not None and not done.ok
    if action == "raise":
        assert done.error.startswith("async writer of step 1 on rank 0 died: "), done.error
        assert "InjectedFault" in done.error
        assert waited < deadline, f"a dead writer was named only after {waited:.1f} s"
    else:
        assert re.match(
            r"async writer of step 1 on rank 0 has not finished after \d+\.\d s; last: writing file __0_0", done.error
        ), done.error
        assert waited >= deadline
    assert not (ctx.layout.staged_step(1) / "rank_0.done.json").exists()
    saver.discard()
    monkeypatch.delenv("PIPELINE_FAULTS")
    shard_save.save_async(ctx, saver, 2, _state(1), waited_s=0.0)  # a fresh buffer and group, and it saves
    again = saver.wait()
    assert again is not None and again.ok, again


def test_async_save_with_deepspeed_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.async_save=true works with strategy=ddp or strategy=fsdp2"):
        load_config(["+experiment=tiny", f"run.root={tmp_path}", "strategy=deepspeed", "checkpoint.async_save=true"])
    with pytest.raises(ConfigError, match=r"checkpoint.async_deadline_s=0.0 must be a finite number > 0"):
        load_config(["+experiment=tiny", f"run.root={tmp_path}", "checkpoint.async_deadline_s=0"])


# --- two ranks through the CLI -------------------------------------------------------------------------------


def _run(root: Path, run_id: str, *extra: str, env: dict[str, str] | None = None, ok: bool = True) -> Any:
    proc = run_cli(
        "+experiment=tiny", f"run.root={root}", f"run.id={run_id}", "run.create=true", *extra, env=env, timeout=180
    )
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _layout(root: Path, run_id: str) -> RunLayout:
    return RunLayout.for_run(root, "tiny", run_id)


def _log_lines(layout: RunLayout, needle: str) -> list[tuple[datetime, str]]:
    """Timestamped lines of the train tasks' logs that contain ``needle``."""
    out = []
    for log in sorted(layout.logs.glob("train/*/*_log.err")):
        for line in log.read_text().splitlines():
            m = _STAMP.match(line)
            if m and needle in line:
                out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"), line))
    return out


def _detection_s(layout: RunLayout) -> float:
    """From rank 1's start of the save of step 4 to the ranks' agreement that it failed (rank 0's line)."""
    started = _log_lines(layout, "rank 1: async save of step 4 started")
    agreed = _log_lines(layout, "step 4 was not saved by rank(s)")
    assert started and agreed, "the start and the failure of step 4 must both be logged"
    return (agreed[0][0] - started[0][0]).total_seconds()


@pytest.mark.slow
@pytest.mark.distributed
def test_async_run_commits_the_same_checkpoints_as_a_sync_run(tmp_path: Path) -> None:
    _run(tmp_path, "sync", "export=none")  # consolidated weights are compared; the export adds nothing here
    _run(tmp_path, "async", *ASYNC, "export=none")
    sync, asyn = _layout(tmp_path, "sync"), _layout(tmp_path, "async")
    for step in (4, 8):
        a, b = read_manifest(sync.committed_step(step)), read_manifest(asyn.committed_step(step))
        data = {f.path: (f.size, f.hash) for f in a.files if f.path != ".metadata"}
        assert data == {f.path: (f.size, f.hash) for f in b.files if f.path != ".metadata"}
        # .metadata lists the same items at the same places (DCP's sync order of them follows its writer threads)
        ma, mb = (read_metadata_safe(d.committed_step(step)) for d in (sync, asyn))
        assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
    weights = [load_file(str(d.consolidated_step(8) / "model.safetensors")) for d in (sync, asyn)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    events = [e for e in map(read_json_line, asyn.metrics.read_text().splitlines()) if e["event"] == "checkpoint"]
    assert [e["step"] for e in events] == [4, 8] and all(e["mode"] == "async" and e["ok"] for e in events)
    assert all(e["blocked_s"] >= 0 and e["persist_s"] > 0 for e in events)


def read_json_line(line: str) -> dict[str, Any]:
    import json  # noqa: PLC0415

    value = json.loads(line)
    assert isinstance(value, dict)
    return value


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("point", WRITER_POINTS)
def test_killed_writer_loses_only_its_step(tmp_path: Path, point: str) -> None:
    env = {"PIPELINE_FAULTS": f"{point}@rank=1@step=4"}
    _run(tmp_path, "k", "stage=prepare_dirs")
    _run(tmp_path, "k", "stage=train", *ASYNC, f"checkpoint.async_deadline_s={DEADLINE_S}", env=env)
    layout = _layout(tmp_path, "k")
    rec = read_json(layout.stage_record("train"))
    assert rec["status"] == "succeeded" and rec["summary"]["failed_saves"] == [4] and rec["summary"]["saved"] == [8]
    assert "rank 1: " in rec["summary"]["save_errors"]["4"], rec["summary"]["save_errors"]
    assert _log_lines(layout, "ASYNC WRITER DIED: step 4 rank 1"), "the dead writer is named with step and rank"
    assert _detection_s(layout) < DEADLINE_S + 5
    assert read_latest(layout).step == 8  # type: ignore[union-attr]
    assert not layout.committed_step(4).exists(), "a step whose writer died must never be committed"
    assert not (layout.staged_step(4) / "rank_1.done.json").exists()


STALL_S = 180
"""How long the stalled writer sleeps: far above the run's own time on a loaded 2-core CI machine (44 s alone,
up to 67 s under load), so finishing before it wakes proves the run did not wait for it."""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fail", [False, True])
def test_stalled_writer_is_named_and_nothing_hangs(tmp_path: Path, fail: bool) -> None:
    point = "async_save.after_write" if fail else "async_save.mid_write"
    env = {"PIPELINE_FAULTS": f"{point}@rank=1@step=4@action=sleep@seconds={STALL_S}"}
    _run(tmp_path, "s", "stage=prepare_dirs")
    t0 = time.monotonic()
    extra = (*ASYNC, f"checkpoint.async_deadline_s={DEADLINE_S}", f"checkpoint.fail_on_save_error={str(fail).lower()}")
    proc = _run(tmp_path, "s", "stage=train", *extra, env=env, ok=not fail)
    assert time.monotonic() - t0 < STALL_S, "the run must not wait for the stalled writer"
    layout = _layout(tmp_path, "s")
    named = _log_lines(layout, "async writer of step 4 on rank 1 has not finished after")
    assert named and "last: " in named[0][1], "the stall is named with what the writer was doing"
    assert _detection_s(layout) < DEADLINE_S + 5
    assert not (layout.staged_step(4) / "rank_1.done.json").exists()
    if fail:
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "async save of step 4 failed (rank 1: async writer of step 4 on rank 1 has not finished" in proc.stderr
        assert "checkpoint.fail_on_save_error=true" in proc.stderr
    else:
        rec = read_json(layout.stage_record("train"))
        assert rec["status"] == "succeeded" and rec["summary"]["failed_saves"] == [4]
        assert read_latest(layout).step == 8  # type: ignore[union-attr]
