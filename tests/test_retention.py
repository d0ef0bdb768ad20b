"""Checkpoint retention: the pure decision table, apply() on a fake run dir, a crash at every I/O op of one apply(),
planted links, and the outputs policy. No processes, no real checkpoints (a step is a dir with ``manifest.json``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.checkpoint.manifest import MANIFEST
from pipeline.checkpoint.outputs import CONSOLIDATED_MARKER
from pipeline.checkpoint.protocol import retention
from pipeline.checkpoint.protocol.retention import TRASH, Decision, decide
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.config.schema import CheckpointConfig
from pipeline.errors import ConfigError
from pipeline.rundir.layout import RunLayout
from pipeline.storage import faults
from pipeline.storage.atomic import read_json
from pipeline.storage.integrity import lstat_kind

# --- the pure decision ---------------------------------------------------------------------------------------


def apply(layout: RunLayout, cfg: retention.Policy, *, latest_step: int | None) -> Decision:
    """Retention as the committer applies it to a checkpoints dir."""
    return retention.apply(PosixCheckpoints(layout), cfg, latest_step=latest_step)


def _split(d: Decision) -> tuple[list[int], list[int]]:
    return sorted(d.kept), list(d.removed)


@pytest.mark.parametrize(
    ("committed", "latest", "keep_last", "keep_every", "kept", "removed"),
    [
        # no policy: nothing goes, whatever latest is
        ([4, 8, 12], 12, None, None, [4, 8, 12], []),
        ([4, 8, 12], None, None, None, [4, 8, 12], []),
        # keep_last only
        ([4, 8, 12, 16], 16, 2, None, [12, 16], [4, 8]),
        ([4, 8, 12, 16], 16, 1, None, [16], [4, 8, 12]),
        ([4, 8], 8, 5, None, [4, 8], []),
        # keep_every only: latest still stays
        ([50, 100, 150, 200, 250], 250, None, 100, [100, 200, 250], [50, 150]),
        # both
        ([50, 100, 150, 200, 250, 300, 350], 350, 2, 100, [100, 200, 300, 350], [50, 150, 250]),
        # latest older than the newest committed (a fallback, or a step being published): the newer ones stay,
        # and keep_last counts from latest down
        ([4, 8, 12, 16], 8, 1, None, [8, 12, 16], [4]),
        ([4, 8, 12, 16], 12, 2, None, [8, 12, 16], [4]),
        # no latest: nothing is known to be safe, nothing goes
        ([4, 8, 12], None, 1, 4, [4, 8, 12], []),
        # latest not among the listed steps (e.g. not listed yet): nothing newer than it goes
        ([4, 8, 12], 10, 1, None, [8, 12], [4]),
        ([], 8, 1, None, [], []),
    ],
)
def test_decision_table(
    committed: list[int],
    latest: int | None,
    keep_last: int | None,
    keep_every: int | None,
    kept: list[int],
    removed: list[int],
) -> None:
    d = decide(committed, latest, keep_last, keep_every)
    assert _split(d) == (kept, removed)
    assert set(d.kept).isdisjoint(d.removed) and set(d.kept) | set(d.removed) == set(committed)


def test_decision_reasons_say_why_each_step_stays() -> None:
    d = decide([100, 150, 200, 250, 300], 250, 2, 100)
    assert d.kept == {
        100: ("multiple of 100",),
        200: ("newest 2", "multiple of 100"),
        250: ("latest", "newest 2"),
        300: ("newer than latest", "multiple of 100"),
    }
    assert d.removed == (150,)
    assert decide([4], 4, None, None).kept == {4: (retention.NO_POLICY,)}
    assert decide([4], None, 1, None).kept == {4: (retention.NO_LATEST,)}


def test_decide_never_removes_latest_or_anything_newer() -> None:
    steps = list(range(1, 40))
    for latest in (1, 7, 20, 39):
        for keep_last in (None, 1, 2, 5):
            for keep_every in (None, 1, 3, 10):
                d = decide(steps, latest, keep_last, keep_every)
                assert all(s < latest for s in d.removed), (latest, keep_last, keep_every)
                if keep_last is None and keep_every is None:
                    assert not d.removed


def test_decide_refuses_counts_below_one() -> None:
    with pytest.raises(ValueError, match="keep_last=0"):
        decide([4], 4, 0, None)
    with pytest.raises(ValueError, match="keep_every=-1"):
        decide([4], 4, None, -1)


# --- config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["keep_last", "keep_every", "keep_outputs_last"])
def test_config_refuses_counts_below_one_naming_the_key(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"checkpoint\.{key}=0 must be an integer >= 1"):
        CheckpointConfig(**{key: 0})
    assert getattr(CheckpointConfig(**{key: 3}), key) == 3


def test_retention_keys_are_mutable_and_off_by_default() -> None:
    from dataclasses import fields

    from pipeline.config.schema import MUTABLE

    by_name = {f.name: f for f in fields(CheckpointConfig)}
    for key in ("keep_last", "keep_every", "keep_outputs_last"):
        assert by_name[key].metadata == MUTABLE, key
        assert by_name[key].default is None, key


def test_export_marker_is_the_export_stages_marker() -> None:
    from pipeline.stages import export

    assert retention.EXPORT_MARKER == export.MARKER


# --- apply() on a fake run dir ----------------------------------------------------------------------------------


def _step(area: Path, step: int, marker: str) -> Path:
    d = area / f"step_{step}"
    (d / "sub").mkdir(parents=True)
    (d / marker).write_text(f'{{"step": {step}}}')
    (d / "__0_0.distcp").write_bytes(os.urandom(64))
    (d / "sub" / "nested.bin").write_bytes(b"x" * 10)
    return d


def _run(tmp_path: Path, ckpt: list[int], outputs: tuple[int, ...] | list[int] = ()) -> RunLayout:
    layout = RunLayout(tmp_path / "run")
    for area in (layout.checkpoints, layout.staging, layout.quarantine, layout.consolidated, layout.export):
        area.mkdir(parents=True, exist_ok=True)
    for s in ckpt:
        _step(layout.checkpoints, s, MANIFEST)
    for s in outputs:
        _step(layout.consolidated, s, CONSOLIDATED_MARKER)
        _step(layout.export, s, retention.EXPORT_MARKER)
    layout.latest.write_text("{}")  # apply() takes latest's step from the caller; the file must survive
    (layout.staging / "step_20").mkdir()
    (layout.quarantine / "step_3.1700000000").mkdir()
    return layout


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` (files with their bytes, dirs and links as None), never following a link."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out


def _under(snap: dict[str, bytes | None], prefix: str) -> dict[str, bytes | None]:
    return {k: v for k, v in snap.items() if k == prefix or k.startswith(prefix + "/")}


def _steps(area: Path) -> list[str]:
    return sorted(p.name for p in area.iterdir() if p.name.startswith("step_"))


def test_apply_removes_old_steps_and_records_the_decision(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8, 12, 16, 20])
    before = _snapshot(layout.run_dir)
    d = apply(layout, CheckpointConfig(keep_last=2, keep_every=8), latest_step=16)
    assert _split(d) == ([8, 12, 16, 20], [4])
    assert _steps(layout.checkpoints) == ["step_12", "step_16", "step_20", "step_8"]
    after = _snapshot(layout.run_dir)
    for s in (8, 12, 16, 20):  # kept steps byte for byte
        assert _under(after, f"checkpoints/step_{s}") == _under(before, f"checkpoints/step_{s}")
    for rel in ("checkpoints/latest", "checkpoints/staging/step_20", "checkpoints/quarantine/step_3.1700000000"):
        assert after[rel] == before[rel]
    assert not any((layout.checkpoints / TRASH).iterdir())
    record = read_json(layout.checkpoints / retention.RECORD)
    assert record["latest"] == 16
    assert record["policy"] == {"keep_last": 2, "keep_every": 8, "keep_outputs_last": None}
    assert record["areas"]["checkpoints"]["removed"] == [4]
    assert {"step": 16, "reasons": ["latest", "newest 2", "multiple of 8"]} in record["areas"]["checkpoints"]["kept"]
    assert record["time"].endswith("Z")
    assert retention.read_record(layout) == record


def test_a_second_apply_with_nothing_to_do_does_no_io(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8, 12], outputs=[4, 8, 12])
    cfg = CheckpointConfig(keep_last=1, keep_outputs_last=1)
    apply(layout, cfg, latest_step=12)
    with faults.tracing() as trace:
        d = apply(layout, cfg, latest_step=12)
    assert trace == [] and d.removed == ()
    # a new commit changes the decision: it is recorded again
    _step(layout.checkpoints, 16, MANIFEST)
    apply(layout, cfg, latest_step=16)
    assert _steps(layout.checkpoints) == ["step_16"]
    assert read_json(layout.checkpoints / retention.RECORD)["areas"]["checkpoints"]["removed"] == [12]


def test_without_a_policy_nothing_is_removed_or_written(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8, 12], outputs=[4, 8])
    before = _snapshot(layout.run_dir)
    with faults.tracing() as trace:
        d = apply(layout, CheckpointConfig(), latest_step=12)
    assert trace == [] and _snapshot(layout.run_dir) == before
    assert sorted(d.kept) == [4, 8, 12] and d.removed == ()
    # a policy set on a continued run and dropped again: the record says "keep all" from then on
    apply(layout, CheckpointConfig(keep_every=8), latest_step=12)
    assert _steps(layout.checkpoints) == ["step_12", "step_8"]
    apply(layout, CheckpointConfig(), latest_step=12)
    record = read_json(layout.checkpoints / retention.RECORD)
    assert record["policy"]["keep_every"] is None
    assert record["areas"]["checkpoints"]["kept"][0]["reasons"] == [retention.NO_POLICY]


def test_no_latest_removes_nothing(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8], outputs=[4, 8])
    before = _snapshot(layout.run_dir)
    apply(layout, CheckpointConfig(keep_last=1, keep_outputs_last=1), latest_step=None)
    after = _snapshot(layout.run_dir)
    assert {k: v for k, v in after.items() if k != f"checkpoints/{retention.RECORD}"} == before


def test_only_real_step_dirs_with_a_manifest_count(tmp_path: Path) -> None:
    layout = _run(tmp_path, [8, 12])
    outside = tmp_path / "outside"
    _step(outside, 4, MANIFEST)
    os.symlink(outside / "step_4", layout.checkpoints / "step_4")  # a planted link: never followed nor removed
    (layout.checkpoints / "step_2").write_text("a file where a step goes")
    (layout.checkpoints / "step_6").mkdir()  # no manifest: not a committed step
    (layout.checkpoints / "step_7").mkdir()
    os.symlink(outside / "step_4" / MANIFEST, layout.checkpoints / "step_7" / MANIFEST)  # a linked manifest
    (layout.checkpoints / "latest.tmp-1-abcdef01").write_text("litter of the committer, not retention's")
    outside_before = _snapshot(outside)
    before = _snapshot(layout.run_dir)
    d = apply(layout, CheckpointConfig(keep_last=1), latest_step=12)
    assert _split(d) == ([12], [8])
    assert _snapshot(outside) == outside_before
    after = _snapshot(layout.run_dir)
    for rel in ("step_2", "step_4", "step_6", "step_7", "step_7/manifest.json", "latest.tmp-1-abcdef01"):
        assert after[f"checkpoints/{rel}"] == before[f"checkpoints/{rel}"], rel
    assert (layout.checkpoints / "step_4").is_symlink()


def test_a_link_planted_as_the_trash_is_unlinked_never_followed(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8])
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    os.symlink(victim, layout.checkpoints / TRASH)
    apply(layout, CheckpointConfig(keep_last=1), latest_step=8)
    assert (victim / "precious").read_text() == "keep me" and sorted(os.listdir(victim)) == ["precious"]
    assert _steps(layout.checkpoints) == ["step_8"]
    assert lstat_kind(layout.checkpoints / TRASH) == "dir"


def test_a_half_deleted_step_left_in_the_trash_is_finished(tmp_path: Path) -> None:
    layout = _run(tmp_path, [8])
    trash = layout.checkpoints / TRASH
    half = _step(trash, 4, MANIFEST)
    (half / MANIFEST).unlink()  # rmtree got this far
    (trash / ".step_0.deleting-1-abcdef01" / "a" / "b").mkdir(parents=True)  # a remove_tree that died midway
    (trash / "stray").write_text("x")
    os.symlink(tmp_path / "nowhere", trash / "link")
    apply(layout, CheckpointConfig(), latest_step=8)  # no policy: the trash is still emptied
    assert list(trash.iterdir()) == []
    assert _steps(layout.checkpoints) == ["step_8"]


def test_a_claimed_trash_entry_and_an_own_one_keep_their_grace(tmp_path: Path) -> None:
    """A new holder claims what lower epochs left in the trash (a late purge by its predecessor then finds nothing),
    but a claimed step is not its own: it stays restorable for the grace period, so a fall-back that could not
    bring it back at once can do so later. What this epoch moved itself waits out the grace too (a committer may be
    a ghost whatever its fence says: issue 48, suspicion (c)), then goes; a higher epoch's entry is never a lower
    one's own (suspicion (b))."""
    from pipeline.checkpoint.protocol import trash  # noqa: PLC0415

    layout = _run(tmp_path, [8])
    bin_ = layout.checkpoints / TRASH
    _step(bin_, 4, MANIFEST).rename(bin_ / "step_4.e1.100")
    _step(bin_, 6, MANIFEST).rename(bin_ / "step_6.e3.100")
    trash.claim(layout, 3)
    names = sorted(os.listdir(bin_))
    assert len(names) == 2 and names[0].startswith("step_4.c3.") and names[1] == "step_6.e3.100", names
    assert trash.own_entry("step_6.e3.100", 3) and not trash.own_entry("step_6.e3.100", 2)
    first_seen: dict[str, float] = {}
    trash.purge(layout, 3, first_seen)
    assert trash.trashed(layout) == [4, 6]  # both stay for the grace
    first_seen["step_6.e3.100"] -= trash.GRACE_S  # seen (moved) a grace ago
    trash.purge(layout, 3, first_seen)
    assert trash.trashed(layout) == [4]  # the claimed one stays; the own one is gone after its grace
    assert trash.restore(layout, 4) and (layout.committed_step(4) / MANIFEST).is_file()


def test_an_area_replaced_by_a_link_is_never_entered(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8])
    elsewhere = tmp_path / "elsewhere"
    for s in (4, 8):
        _step(elsewhere, s, CONSOLIDATED_MARKER)
    _step(elsewhere / TRASH, 1, CONSOLIDATED_MARKER)
    layout.consolidated.rmdir()
    os.symlink(elsewhere, layout.consolidated)
    before = _snapshot(elsewhere)
    apply(layout, CheckpointConfig(keep_last=1, keep_outputs_last=1), latest_step=8)
    assert _snapshot(elsewhere) == before
    assert _steps(layout.checkpoints) == ["step_8"]


# --- a crash at every I/O operation of one apply() ---------------------------------------------------------


CRASH_CFG = CheckpointConfig(keep_last=2, keep_every=8, keep_outputs_last=1)
CRASH_CKPT, CRASH_OUTPUTS, CRASH_LATEST = [4, 8, 12, 16, 20, 24], [12, 16, 24], 20
CRASH_KEPT = {"checkpoints": [8, 16, 20, 24], "consolidated": [16, 24], "export": [16, 24]}


def _crash_run(tmp_path: Path) -> RunLayout:
    layout = _run(tmp_path, CRASH_CKPT, outputs=CRASH_OUTPUTS)
    _step(layout.checkpoints / TRASH, 1, MANIFEST)  # left by an earlier crashed call
    (layout.consolidated / ".retired" / "step_8.1700000000").mkdir(parents=True)  # a forced redo's: never deleted
    return layout


def _areas(layout: RunLayout) -> dict[str, Path]:
    return {"checkpoints": layout.checkpoints, "consolidated": layout.consolidated, "export": layout.export}


def test_crash_at_every_io_op_of_apply_keeps_every_kept_step_and_a_rerun_finishes(tmp_path: Path) -> None:
    with faults.tracing() as trace:
        apply(_crash_run(tmp_path / "clean"), CRASH_CFG, latest_step=CRASH_LATEST)
    ops = len(trace)
    kinds = {k for k, _ in trace}
    assert {"rename", "rmtree", "mkdir", "create", "write", "fsync", "fsync_dir"} <= kinds, kinds
    assert ops >= 20, trace

    for k in range(1, ops + 1):
        layout = _crash_run(tmp_path / f"crash{k}")
        before = _snapshot(layout.run_dir)
        with pytest.raises(faults.SimulatedCrash), faults.io_plan(crash_at=k) as plan:
            apply(layout, CRASH_CFG, latest_step=CRASH_LATEST)
        assert plan.crashed and plan.count == k
        after = _snapshot(layout.run_dir)
        for name, area in _areas(layout).items():
            rel = area.relative_to(layout.run_dir)
            for entry in _steps(area):  # a step is there whole under its name, or not at all
                assert _under(after, f"{rel}/{entry}") == _under(before, f"{rel}/{entry}"), (k, name, entry)
            assert {f"step_{s}" for s in CRASH_KEPT[name]} <= set(_steps(area)), (k, name)
        assert after["consolidated/.retired/step_8.1700000000"] is None

        apply(layout, CRASH_CFG, latest_step=CRASH_LATEST)  # the next call finishes the job
        done = _snapshot(layout.run_dir)
        for name, area in _areas(layout).items():
            assert _steps(area) == sorted(f"step_{s}" for s in CRASH_KEPT[name]), (k, name)
            rel = area.relative_to(layout.run_dir)
            for s in CRASH_KEPT[name]:
                assert _under(done, f"{rel}/step_{s}") == _under(before, f"{rel}/step_{s}"), (k, name, s)
            trash = area / TRASH
            assert not trash.exists() or not any(trash.iterdir()), (k, name, list(trash.iterdir()))
        assert [p for p in done if ".deleting-" in p or ".tmp-" in p] == [], k
        assert "consolidated/.retired/step_8.1700000000" in done
        record = read_json(layout.checkpoints / retention.RECORD)
        assert [e["step"] for e in record["areas"]["checkpoints"]["kept"]] == CRASH_KEPT["checkpoints"], k


# --- outputs ------------------------------------------------------------------------------------------------


def test_outputs_keep_the_newest_complete_ones_and_latests(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8, 12], outputs=[4, 8])
    (layout.consolidated / "step_12").mkdir()  # being written / incomplete: no marker, not counted, not removed
    forced = layout.export / ".retired" / "step_8.1700000000"
    forced.mkdir(parents=True)
    apply(layout, CheckpointConfig(keep_outputs_last=1), latest_step=12)
    assert _steps(layout.consolidated) == ["step_12", "step_8"]
    assert _steps(layout.export) == ["step_8"]
    assert _steps(layout.checkpoints) == ["step_12", "step_4", "step_8"]  # checkpoints follow their own keys
    assert forced.is_dir()
    record = read_json(layout.checkpoints / retention.RECORD)
    assert record["areas"]["consolidated"]["removed"] == [4] and record["areas"]["export"]["removed"] == [4]


def test_an_output_goes_only_once_a_newer_complete_one_exists(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8, 12], outputs=[4])
    apply(layout, CheckpointConfig(keep_outputs_last=1), latest_step=12)  # consolidate has not run for 8 or 12
    assert _steps(layout.consolidated) == ["step_4"] and _steps(layout.export) == ["step_4"]


def test_latests_output_stays_when_latest_moved_back(tmp_path: Path) -> None:
    layout = _run(tmp_path, [4, 8], outputs=[4, 8, 12])  # step 12 was latest, then found damaged: latest -> 8
    apply(layout, CheckpointConfig(keep_outputs_last=1), latest_step=8)
    assert _steps(layout.consolidated) == ["step_12", "step_8"]
    assert _steps(layout.export) == ["step_12", "step_8"]


def test_a_symlinked_output_is_ignored(tmp_path: Path) -> None:
    layout = _run(tmp_path, [8], outputs=[8])
    outside = tmp_path / "outside"
    _step(outside, 4, CONSOLIDATED_MARKER)
    os.symlink(outside / "step_4", layout.consolidated / "step_4")
    apply(layout, CheckpointConfig(keep_outputs_last=1), latest_step=8)
    assert (layout.consolidated / "step_4").is_symlink() and (outside / "step_4" / CONSOLIDATED_MARKER).is_file()
