"""Best-k retention (``keep_best``): keep the steps whose recorded metric is best, always keep ``latest``.

* The pure decision: the best ``k`` up to ``latest`` by ``min`` or ``max``, a non-finite value never best, a step
  without the metric kept, ties to the newer step, combined with ``keep_last``/``keep_every`` as a union.
* The metric's path: ``save(step, state, metrics=...)`` -> each rank's marker -> rank 0's into the manifest; old
  manifests without metrics still read; bad metrics and bad knobs are one-line errors naming the knob.
* The library end to end on one rank: losses 5, 1, 4, 2, NaN, 3 and a step without metrics keep steps 2, 4 (best 2)
  and 7 (latest); ``status`` shows each step's loss.
* A crash at every I/O op of a best-k retention pass: every step the rule keeps is intact, a rerun finishes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import Checkpointer, options
from pipeline.checkpoint.manifest import MANIFEST, Manifest, read_latest, read_manifest, verify_committed
from pipeline.checkpoint.protocol import retention
from pipeline.checkpoint.protocol.policy import CommitPolicy
from pipeline.checkpoint.protocol.retention import Best, decide
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.config.schema import CheckpointConfig
from pipeline.errors import ConfigError, VerificationError
from pipeline.rundir.layout import RunLayout
from pipeline.storage import faults
from pipeline.storage.atomic import read_json
from tests.test_retention import _run, _snapshot, _steps, _under

# --- the pure decision ---------------------------------------------------------------------------------------

LOSSES: dict[int, float | None] = {4: 3.0, 8: 1.0, 12: 2.0, 16: 5.0, 20: 4.0}


@pytest.mark.parametrize(
    ("k", "mode", "scores", "latest", "kept", "removed"),
    [
        (2, "min", LOSSES, 20, [8, 12, 20], [4, 16]),
        (2, "max", LOSSES, 20, [16, 20], [4, 8, 12]),  # 20 is among the best 2 and latest
        (1, "min", LOSSES, 20, [8, 20], [4, 12, 16]),
        # a step newer than latest is never ranked (nor removed); keep_best counts up to latest
        (1, "min", {**LOSSES, 20: 0.5}, 16, [8, 16, 20], [4, 12]),
        # a NaN (recorded as None) is never best; a step without the metric stays
        (2, "min", {4: None, 8: 1.0, 12: None}, 20, [8, 16, 20], [4, 12]),
        # ties: the newer step wins
        (1, "min", {4: 1.0, 8: 1.0, 12: 1.0, 16: 2.0, 20: 3.0}, 20, [12, 20], [4, 8, 16]),
    ],
)
def test_best_k_decision(
    k: int,
    mode: str,
    scores: dict[int, float | None],
    latest: int,
    kept: list[int],
    removed: list[int],
) -> None:
    d = decide([4, 8, 12, 16, 20], latest, None, None, Best(k, "loss", mode, scores))
    assert (sorted(d.kept), list(d.removed)) == (kept, removed)


def test_reasons_name_the_rule_and_a_step_without_the_metric() -> None:
    d = decide([4, 8, 12, 16], 16, 1, None, Best(1, "loss", "min", {4: 2.0, 8: 1.0, 16: 3.0}))
    assert d.kept == {
        8: ("best 1 by loss (min)",),
        12: ("no loss recorded",),
        16: ("latest", "newest 1"),
    }
    assert d.removed == (4,)


def test_best_k_joins_keep_last_and_keep_every() -> None:
    scores = {s: float(s % 7) for s in range(10, 110, 10)}  # 70 -> 0.0 is best, then 50 (1.0), 30 (2.0)...
    d = decide(list(range(10, 110, 10)), 100, 2, 40, Best(2, "loss", "min", scores))
    assert sorted(d.kept) == [40, 50, 70, 80, 90, 100]  # multiples of 40, newest 2 (90, 100), best 2 (70, 50)


# --- the metric's path and validation --------------------------------------------------------------------------


def test_manifest_carries_metrics_and_old_manifests_still_read(tmp_path: Path) -> None:
    m = Manifest(step=4, world_size=1, format="dcp", attempt="a", run_id="r", files=(), metrics={"loss": 1.5})
    again = Manifest.from_json(json.loads(json.dumps(m.to_json())), "here")
    assert again == m and again.metrics == {"loss": 1.5}
    old = {k: v for k, v in m.to_json().items() if k != "metrics"}
    assert Manifest.from_json(old, "old").metrics == {}
    bare = Manifest(step=4, world_size=1, format="dcp", attempt="a", run_id="r", files=())
    assert "metrics" not in bare.to_json()  # a step without metrics writes the same bytes as before
    for bad in ({"loss": "low"}, {"loss": True}, [1.0], {3: 1.0}):
        with pytest.raises(VerificationError, match="missing or wrong type: metrics"):
            Manifest.from_json({**old, "metrics": bad}, "bad")


def test_check_metrics_takes_numbers_and_records_non_finite_as_null() -> None:
    got = options.check_metrics({"loss": torch.tensor(2.5), "acc": 1, "nan": math.nan, "inf": -math.inf})
    assert got == {"loss": 2.5, "acc": 1.0, "nan": None, "inf": None}
    assert options.check_metrics(None) == {}
    for bad, name in (({"loss": "2.5"}, "loss"), ({"loss": False}, "loss"), ({"x": [1, 2]}, "x")):
        with pytest.raises(ConfigError, match=rf"^metrics\['{name}'\]=.* must be a number"):
            options.check_metrics(bad)
    with pytest.raises(ConfigError, match="must be a mapping"):
        options.check_metrics([("loss", 1.0)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"keep_best": 0}, "checkpoint.keep_best=0 must be an integer >= 1"),
        ({"keep_best": 2, "best_mode": "lowest"}, "checkpoint.best_mode='lowest': choose min"),
        ({"keep_best": 2, "best_metric": " "}, "checkpoint.best_metric=' ' must be the name of a metric"),
    ],
)
def test_the_app_refuses_bad_best_k_knobs_naming_them(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointConfig(**kw)
    assert str(caught.value).startswith(message), caught.value


def test_the_apps_knobs_reach_the_committers_policy() -> None:
    from pipeline.config.compose import load_config  # noqa: PLC0415
    from pipeline.stages.verify_manifest import policy  # noqa: PLC0415

    overrides = ["+experiment=tiny", "checkpoint.keep_best=3", "checkpoint.best_metric=eval_loss"]
    cfg = load_config(overrides)
    got = policy(cfg)
    assert (got.keep_best, got.best_metric, got.best_mode) == (3, "eval_loss", "min")
    with pytest.raises(ConfigError, match="keep_best=0"):
        CommitPolicy(world_size=1, keep_best=0)


def test_the_commit_command_refuses_a_bad_best_mode_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.commit import main  # noqa: PLC0415

    (tmp_path / "checkpoints").mkdir()
    assert main([str(tmp_path), "--keep-best", "2", "--best-mode", "lowest"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --best-mode='lowest': choose min (lower is better, a loss) or max (higher is better)"
    ]


# --- the library end to end --------------------------------------------------------------------------------------


def test_the_library_keeps_the_best_k_and_latest_and_status_shows_each_loss(
    tmp_path: Path, one_rank: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.status import main as status_main  # noqa: PLC0415

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    state = {"model": model}
    recorded: list[dict[str, float] | None] = [{"loss": 5.0}, {"loss": 1.0}, {"loss": 4.0}, {"loss": 2.0}]
    recorded += [{"loss": math.nan}, {"loss": 3.0}, None]
    ck = Checkpointer(tmp_path / "run", keep_best=2, poll_interval_s=0.05)
    try:
        for step, metrics in enumerate(recorded, start=1):
            with torch.no_grad():
                model.weight.add_(1.0)
            if step % 2:
                ck.save(step, state, metrics=metrics)
            else:
                ck.save_async(step, state, metrics=metrics)
    finally:
        ck.close()
    layout = ck.layout
    assert read_latest(layout) is not None and read_latest(layout).step == 7  # type: ignore[union-attr]
    assert sorted(int(p.name.split("_")[1]) for p in layout.checkpoints.glob("step_*")) == [2, 4, 7]
    for step in (2, 4, 7):
        verify_committed(layout.committed_step(step), step)
    assert read_manifest(layout.committed_step(2)).metrics == {"loss": 1.0}
    assert read_manifest(layout.committed_step(7)).metrics == {}
    record = read_json(layout.checkpoints / retention.RECORD)
    assert record["policy"]["keep_best"] == 2 and record["policy"]["best_metric"] == "loss"
    kept = {e["step"]: e["reasons"] for e in record["areas"]["checkpoints"]["kept"]}
    assert kept == {2: ["best 2 by loss (min)"], 4: ["best 2 by loss (min)"], 7: ["latest", "no loss recorded"]}

    capsys.readouterr()
    assert status_main([str(layout.run_dir)]) == 0
    rows = {ln.split()[1]: ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("step")}
    assert rows["2"][-1] == "1" and rows["4"][-1] == "2" and rows["7"][-2:] == ["-", "latest"], rows


def test_a_bad_metric_is_refused_before_anything_is_written(tmp_path: Path, one_rank: Any) -> None:
    ck = Checkpointer(tmp_path / "run", keep_best=1, poll_interval_s=0.05)
    try:
        with pytest.raises(ConfigError, match=r"metrics\['loss'\]='low' must be a number"):
            ck.save(1, {"model": torch.nn.Linear(2, 2)}, metrics={"loss": "low"})
        assert not any(ck.layout.staging.glob("step_*"))
    finally:
        ck.close()


# --- a crash during a best-k pass ------------------------------------------------------------------------------

BEST_CKPT, BEST_LATEST = [4, 8, 12, 16, 20, 24], 20
BEST_SCORES = {4: 0.5, 8: 3.0, 12: 1.0, 16: 4.0, 20: 2.0}  # step 24 (newer than latest) recorded none
BEST_CFG = CheckpointConfig(keep_best=2)
BEST_KEPT = [4, 12, 20, 24]  # best 2 (4, 12), latest (20), newer than latest (24)


def _best_run(tmp_path: Path) -> RunLayout:
    layout = _run(tmp_path, BEST_CKPT)
    for step in BEST_CKPT:
        metrics = {"loss": BEST_SCORES[step]} if step in BEST_SCORES else {}
        m = Manifest(step=step, world_size=1, format="dcp", attempt="a", run_id="r", files=(), metrics=metrics)
        (layout.committed_step(step) / MANIFEST).write_text(json.dumps(m.to_json()))
    return layout


def test_crash_at_every_io_op_of_a_best_k_pass_keeps_what_the_rule_keeps(tmp_path: Path) -> None:
    def apply(layout: RunLayout) -> None:
        retention.apply(PosixCheckpoints(layout), BEST_CFG, latest_step=BEST_LATEST)

    with faults.tracing() as trace:
        apply(_best_run(tmp_path / "clean"))
    ops = len(trace)
    assert ops >= 10, trace
    for k in range(1, ops + 1):
        layout = _best_run(tmp_path / f"crash{k}")
        before = _snapshot(layout.run_dir)
        with pytest.raises(faults.SimulatedCrash), faults.io_plan(crash_at=k) as plan:
            apply(layout)
        assert plan.crashed
        after = _snapshot(layout.run_dir)
        for entry in _steps(layout.checkpoints):  # whole under its name, or gone
            assert _under(after, f"checkpoints/{entry}") == _under(before, f"checkpoints/{entry}"), (k, entry)
        assert {f"step_{s}" for s in BEST_KEPT} <= set(_steps(layout.checkpoints)), k
        apply(layout)  # the next pass finishes
        assert _steps(layout.checkpoints) == sorted(f"step_{s}" for s in BEST_KEPT), k
        done = _snapshot(layout.run_dir)
        for s in BEST_KEPT:
            assert _under(done, f"checkpoints/step_{s}") == _under(before, f"checkpoints/step_{s}"), (k, s)
        record = read_json(layout.checkpoints / retention.RECORD)
        assert [e["step"] for e in record["areas"]["checkpoints"]["kept"]] == BEST_KEPT, k
