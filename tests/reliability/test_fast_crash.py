"""The fast tier under the crash-point replay (a one-rank gloo world in this process): a crash at every I/O op of
a fast save, and of a restore that quarantines a damaged copy, then a relaunch. The relaunch resumes from a step
that was saved whole (the one being saved, or the one before), with exactly its weights, or from the durable
tier; never a partial copy. Also: a node dir without room turns the fast tier off in one line."""

from __future__ import annotations

import functools
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import Checkpointer
from pipeline.checkpoint.fast import pieces
from pipeline.checkpoint.fast.local import NodeTier, run_key
from pipeline.errors import PipelineError
from pipeline.storage import faults
from tests.reliability.conftest import record, sized
from tests.reliability.test_crash_points import _crash, pick_points
from tests.reliability.test_library import POLL_S, _model, _train, _weights

pytestmark = [pytest.mark.reliability]


def _ck(root: Path, committer: str = "thread") -> Checkpointer:
    return Checkpointer(root / "run", deadline_s=5, poll_interval_s=POLL_S, fast_every=2, committer=committer,
                        external_commit_wait_s=0, fast_dir=str(root / "node"))  # fmt: skip


def _traced(root: Path, action: Callable[[Checkpointer], object], crash_at: int | None = None) -> list[Any] | bool:
    """``action`` on a Checkpointer opened and closed outside the replay (no committer thread: a deterministic
    trace): its I/O ops, or (``crash_at``) whether the process "died" at that op."""
    ck = _ck(root, committer="external")
    try:
        if crash_at is None:
            with faults.tracing() as trace:
                action(ck)
            return trace
        return _crash(functools.partial(action, ck), crash_at).crashed
    finally:
        ck.close()


def _copy(base: Path, dest: Path) -> Path:
    """``base`` (run dir + node dir) at ``dest``, the node dir renamed for the run's new path."""
    shutil.copytree(base / "run", dest / "run")
    old, new = run_key((base / "run").resolve()), run_key((dest / "run").resolve())
    shutil.copytree(base / "node" / old, dest / "node" / new)
    return dest


def _resume(root: Path) -> tuple[int, str, dict[str, torch.Tensor]]:
    model, opt = _model()
    with _ck(root) as ck:
        step = ck.load_latest(into={"model": model, "optim": opt})
        tier = (ck.resumed or {}).get("tier", "?")
    return step, str(tier), _weights(model)


def _states() -> dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    out = {}
    for step in (2, 4, 6, 8):
        model, opt = _model()
        _train(model, opt, step)
        out[step] = (model, opt)
    return out


def _base(base: Path, states: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> Path:
    """Durable step 4 committed, fast steps 4 and 6 kept (step 8's save drops 4 first: its objects are spares). The
    Checkpointer's close removed its snapshot files."""
    with _ck(base) as ck:
        ck.save_fast(2, {"model": states[2][0], "optim": states[2][1]})
        assert ck.save(4, {"model": states[4][0], "optim": states[4][1]}).ok
        ck.save_fast(4, {"model": states[4][0], "optim": states[4][1]})
        ck.save_fast(6, {"model": states[6][0], "optim": states[6][1]})
    assert ck.fast is not None and ck.fast.stats.saved == [2, 4, 6]
    assert list((base / "node").glob("*/objects/*.bin"))
    assert not list((base / "node").glob("*/slots/*/*"))
    return base


@pytest.mark.usefixtures("no_lease_settle")
def test_crash_at_every_io_op_of_a_fast_save_and_of_a_restore(
    one_rank: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pieces, "OBJECT_MIN", 64)  # the small model's weights and moments become objects
    states = _states()
    want = {s: _weights(m) for s, (m, _) in states.items()}
    base = _base(tmp_path / "base", states)

    def fast_save(ck: Checkpointer) -> None:
        ck.save_fast(8, {"model": states[8][0], "optim": states[8][1]})
        assert ck.fast is not None
        ck.fast.wait()

    def restore(ck: Checkpointer) -> None:
        ck.load_latest(into=dict(zip(("model", "optim"), _model(), strict=True)))

    problems: list[str] = []
    clean = _copy(base, tmp_path / "clean")
    trace = _traced(clean, fast_save)
    assert isinstance(trace, list)
    adopted = [path for kind, path in trace if kind == "rename" and "/objects/" in path]
    written = [path for kind, path in trace if kind in ("create", "write") and "/objects/" in path]
    assert adopted and not written, f"step 8's objects were written, not renamed from its snapshot: {written}"
    refilled = [path for kind, path in trace if kind == "rename" and "/slots/" in path]
    assert refilled, "step 8's save took no spare (step 4's stale objects) for the next snapshot"
    points = pick_points(trace, sized(30, len(trace)))
    t0 = time.monotonic()
    for n in points:
        run = _copy(base, tmp_path / f"s{n}")
        if not _traced(run, fast_save, n):
            problems.append(f"save op {n} was never reached")
        step, tier, weights = _resume(run)
        if (step, tier) not in ((8, "fast"), (6, "fast")) or any(not weights[k].equal(want[step][k]) for k in weights):
            problems.append(f"save op {n}: resumed step {step} from the {tier} tier, or other weights")
        if list((run / "node").glob("*/slots/*/*")):  # the dead process's snapshot files, removed at restore
            problems.append(f"save op {n}: snapshot files outlived the restore")
        shutil.rmtree(run)

    # a restore that quarantines step 8's damaged copy and falls back to step 6, crashed at every op
    damaged = _copy(clean, tmp_path / "damaged")
    own = next((damaged / "node").glob("*/own/rank_0/step_8.bin"))
    own.write_bytes(own.read_bytes()[:-1] + bytes([own.read_bytes()[-1] ^ 1]))
    restore_trace = _traced(_copy(damaged, tmp_path / "rclean"), restore)
    assert isinstance(restore_trace, list)
    rpoints = pick_points(restore_trace, sized(30, len(restore_trace)))
    for n in rpoints:
        run = _copy(damaged, tmp_path / f"r{n}")
        if not _traced(run, restore, n):
            problems.append(f"restore op {n} was never reached")
        step, tier, weights = _resume(run)
        if (step, tier) != (6, "fast") or any(not weights[k].equal(want[6][k]) for k in weights):
            problems.append(f"restore op {n}: resumed step {step} from the {tier} tier, or other weights")
        if list((run / "node").glob("*/own/rank_0/step_8.*")):
            problems.append(f"restore op {n}: the damaged copy is still offered")
        shutil.rmtree(run)
    figure = (
        f"{len(points)}/{len(trace)} save + {len(rpoints)}/{len(restore_trace)} restore points, "
        f"{len(problems)} violations ({time.monotonic() - t0:.0f}s)"
    )
    record("crash points: fast tier save + restore", figure, ok=not problems, notes=problems[:4])
    assert not problems, "\n".join(problems[:20])


def test_a_node_dir_without_room_turns_the_fast_tier_off_in_one_line(
    one_rank: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(NodeTier, "free_bytes", lambda self: 1000)
    model, opt = _model()
    with caplog.at_level(logging.WARNING), _ck(tmp_path) as ck:
        assert ck.should_save_fast(2)
        ck.save_fast(2, {"model": model, "optim": opt})
        assert not ck.should_save_fast(4)
        assert ck.save(4, {"model": model, "optim": opt}).ok  # durable saves go on
    lines = [r.getMessage() for r in caplog.records if "fast tier off" in r.getMessage()]
    assert len(lines) == 1 and "MB free" in lines[0] and "checkpoint.fast.dir" in lines[0], lines
    assert not list((tmp_path / "node").glob("*/own/*/*"))


def test_a_fast_dir_that_cannot_be_used_is_one_error_on_every_rank(one_rank: object, tmp_path: Path) -> None:
    (tmp_path / "node").write_text("a file, not a dir")
    with pytest.raises(PipelineError, match="fast tier: cannot use its dir .*rank 0: .*node-local dir"):
        _ck(tmp_path)
