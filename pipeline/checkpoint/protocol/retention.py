"""Checkpoint retention: which committed steps (and which consolidated/export outputs) to keep, and removing the rest.

Done by the committer (verify-manifest, the single task that owns ``checkpoints/``) after each commit, so no
rank and no other stage ever deletes a step. Two parts:

* :func:`decide` is pure: from the committed steps, the step ``latest`` names and the policy
  (``checkpoint.keep_last``, ``checkpoint.keep_every``, ``checkpoint.keep_best`` with the metric each step's
  manifest records) it says which steps stay, each with its reasons, and which go. It never removes ``latest``'s
  step, never a step newer than ``latest`` (one being committed, or one the committer has not vouched for yet),
  never a step that did not record the best-k metric, and nothing at all without a policy or without a
  ``latest``.
* :func:`apply` carries a decision out in one area at a time. A step leaves in one ``rename`` into the area's
  trash dir (:data:`TRASH`, ``<area>/.deleting/``) and is deleted there; every call first empties the trash of
  what a crashed call left. So a crash at any point leaves every kept step intact and, at most, a half-deleted
  directory inside the trash that the next call finishes. The decision is recorded in
  ``checkpoints/retention.json`` (:data:`RECORD`) for ``status``.

``consolidated/`` and ``export/`` follow ``checkpoint.keep_outputs_last`` the same way, counting only complete
outputs (their done-marker is a file): an output goes only when a newer complete output of the same kind exists,
and latest's output always stays. The trash is not ``<area>/.retired/``: that is where consolidate and export
keep outputs replaced by a forced redo, which are never deleted.

Listings only nominate: a ``step_N`` counts when it is a real directory (``lstat``, never followed) holding its
marker as a regular file; symlinks, files, staging and quarantine are left alone (the committer quarantines
planted links). Every mutation goes through :mod:`pipeline.storage.atomic`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.checkpoint.outputs import CONSOLIDATED_MARKER, EXPORT_MARKER
from pipeline.errors import VerificationError
from pipeline.storage.atomic import clear_file, is_temp_name, move_aside, remove_tree, write_json_atomic
from pipeline.storage.faults import inject
from pipeline.storage.integrity import is_real_dir, lstat_kind, read_record_json
from pipeline.storage.layout import CheckpointLayout, parse_step, step_name

if TYPE_CHECKING:
    from pipeline.checkpoint.stores.store import CheckpointStore

log = logging.getLogger(__name__)

TRASH = ".deleting"
"""Per area: steps and outputs on their way out (moved here in one rename, then deleted; emptied every call)."""
RECORD = "retention.json"
"""``checkpoints/retention.json``: the last decision that changed something (time, policy, kept, removed)."""


class Policy(Protocol):
    """What to keep (the app's ``CheckpointConfig`` and the library's ``CommitPolicy`` both are one)."""

    @property
    def keep_last(self) -> int | None: ...
    @property
    def keep_every(self) -> int | None: ...
    @property
    def keep_outputs_last(self) -> int | None: ...
    @property
    def keep_best(self) -> int | None: ...
    @property
    def best_metric(self) -> str: ...
    @property
    def best_mode(self) -> str: ...


@dataclass(frozen=True)
class Best:
    """Best-k retention: keep the ``k`` committed steps (up to ``latest``) whose ``metric`` is best.

    ``scores`` holds each step that recorded the metric (``None``: its value was not finite, never best); a
    step that did not record it stays (its reason says so), as Orbax keeps checkpoints without metrics.
    """

    k: int
    metric: str
    mode: str
    scores: Mapping[int, float | None]

    def chosen(self, steps: list[int], latest: int) -> set[int]:
        """The best ``k`` of ``steps`` up to ``latest`` (ties: the newer step wins)."""
        ranked = [(v, s) for s in steps if s <= latest and (v := self.scores.get(s)) is not None]
        ranked.sort(key=lambda e: (e[0] if self.mode == "min" else -e[0], -e[1]))
        return {s for _, s in ranked[: self.k]}

    def reasons(self, step: int, chosen: set[int]) -> list[str]:
        """Why this rule keeps ``step`` (it is one of the ``chosen`` best, or it recorded no value): or nothing."""
        if step in chosen:
            return [f"best {self.k} by {self.metric} ({self.mode})"]
        return [no_metric(self.metric)] if step not in self.scores else []


NO_POLICY = "no retention policy"
NO_LATEST = "no latest"
LATEST = "latest"
NEWER_THAN_LATEST = "newer than latest"


def no_metric(metric: str) -> str:
    return f"no {metric} recorded"


@dataclass(frozen=True)
class Decision:
    """Which steps of one area stay (with why) and which go."""

    kept: Mapping[int, tuple[str, ...]]
    """Step -> the reasons it stays (``latest``, ``newest 2``, ``multiple of 100``...), oldest step first."""
    removed: tuple[int, ...]
    """Steps to delete (or, from :func:`apply`, deleted), oldest first."""

    def to_json(self) -> dict[str, Any]:
        kept = [{"step": s, "reasons": list(r)} for s, r in self.kept.items()]
        return {"kept": kept, "removed": list(self.removed)}


def decide(
    committed: list[int],
    latest: int | None,
    keep_last: int | None,
    keep_every: int | None,
    best: Best | None = None,
) -> Decision:
    """Split ``committed`` into kept (with reasons) and removed steps. Pure.

    ``keep_last`` counts the newest steps up to ``latest`` (after a fallback, steps above ``latest`` are not the
    history it vouches for); ``keep_every`` keeps multiples of it forever; ``best`` keeps the best ``k`` by a
    metric, and every step without it. ``latest`` and anything newer always stay; with no rule set, or no
    ``latest``, nothing goes.
    """
    for key, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and value < 1:
            raise ValueError(f"{key}={value} must be >= 1 or None")
    steps = sorted(set(committed))
    if keep_last is None and keep_every is None and best is None:
        return Decision(kept={s: (NO_POLICY,) for s in steps}, removed=())
    if latest is None:
        return Decision(kept={s: (NO_LATEST,) for s in steps}, removed=())
    newest = set(sorted((s for s in steps if s <= latest), reverse=True)[:keep_last]) if keep_last else set()
    chosen = best.chosen(steps, latest) if best is not None else set()
    kept: dict[int, tuple[str, ...]] = {}
    removed = []
    for s in steps:
        reasons = [LATEST] if s == latest else [NEWER_THAN_LATEST] if s > latest else []
        if s in newest:
            reasons.append(f"newest {keep_last}")
        if keep_every is not None and s % keep_every == 0:
            reasons.append(f"multiple of {keep_every}")
        if best is not None:
            reasons += best.reasons(s, chosen)
        if reasons:
            kept[s] = tuple(reasons)
        else:
            removed.append(s)
    return Decision(kept=kept, removed=tuple(removed))


def complete_steps(area: Path, marker: str) -> list[int]:
    """``step_N`` entries of ``area`` that are real directories holding ``marker`` as a regular file (lstat only)."""
    if not is_real_dir(area):
        return []
    out = []
    for p in area.iterdir():
        step = parse_step(p.name)
        if step is not None and is_real_dir(p) and lstat_kind(p / marker) == "file":
            out.append(step)
    return sorted(out)


def empty_trash(area: Path) -> None:
    """Delete whatever ``area``'s trash holds (a crashed call's leftovers, or this call's moved steps).

    ``area`` must be a real directory. A link or file planted where the trash dir goes is unlinked, never
    followed: the trash is this owner's own.
    """
    trash = area / TRASH
    kind = lstat_kind(trash)
    if kind is None:
        return
    if kind != "dir":
        clear_file(trash)
        return
    for entry in sorted(trash.iterdir()):
        try:
            if is_real_dir(entry):
                remove_tree(entry)  # renames it to a hidden sibling inside the trash first: a crash leaves it there
            else:
                clear_file(entry)
        except OSError as e:  # another committer empties the same trash (a duplicate, a ghost): the next call
            log.warning("retention: %s not deleted yet (%s); the next pass finishes it", entry, e)


def retire(area: Path, steps: tuple[int, ...]) -> None:
    """Move each step out of ``area`` in one rename, then delete them all inside the trash."""
    for step in steps:
        try:
            move_aside(area / step_name(step), area / TRASH, step_name(step))
        except OSError as e:  # another committer (a duplicate, a ghost) is retiring it too: the next pass looks
            log.warning("retention: %s not moved out of %s (%s)", step_name(step), area, e)
    inject("retention.before_delete", area=area.name, steps=",".join(map(str, steps)))
    empty_trash(area)


def _apply_area(
    area: Path, marker: str, latest_step: int | None, keep_last: int | None, keep_every: int | None
) -> Decision:
    if not is_real_dir(area):  # missing, or a link planted for a managed area: nothing under it is touched
        return decide([], latest_step, keep_last, keep_every)
    empty_trash(area)
    decision = decide(complete_steps(area, marker), latest_step, keep_last, keep_every)
    if decision.removed:
        log.info("retention: removing %s from %s (kept: %s)", decision.removed, area, sorted(decision.kept))
        retire(area, decision.removed)
    return decision


def output_areas(layout: CheckpointLayout) -> dict[str, tuple[Path, str]]:
    """Output kind -> (area, done-marker) that ``checkpoint.keep_outputs_last`` governs."""
    return {
        "consolidated": (layout.consolidated, CONSOLIDATED_MARKER),
        "export": (layout.export, EXPORT_MARKER),
    }


def record_path(layout: CheckpointLayout) -> Path:
    return layout.checkpoints / RECORD


def _sweep_record_temps(layout: CheckpointLayout) -> None:
    """Temp files of a record write that a crash interrupted: never content."""
    if not is_real_dir(layout.checkpoints):
        return
    for p in layout.checkpoints.iterdir():
        if p.name.startswith(f"{RECORD}.") and is_temp_name(p.name) and lstat_kind(p) == "file":
            clear_file(p)


def read_record(layout: CheckpointLayout) -> dict[str, Any] | None:
    """The recorded decision (for ``status``), or None if there is none or it cannot be read."""
    try:
        obj = read_record_json(record_path(layout), "retention record")
    except (FileNotFoundError, VerificationError, OSError):
        return None
    return obj if isinstance(obj, dict) else None


def apply(
    store: CheckpointStore,
    cfg: Policy,
    *,
    latest_step: int | None,
    fence: Callable[[], None] = lambda: None,
    epoch: int = 0,
) -> Decision:
    """Carry out retention for the committed steps of ``store`` (``keep_last``, ``keep_every``, ``keep_best``) and
    the local output areas (``keep_outputs_last``); return the decision for the committed steps.

    ``latest_step`` is the step ``latest`` names now (None: no step is removed anywhere). Only the committer may
    call this: ``fence`` before each removal, ``epoch`` its lease's (the store re-checks each step at the act).
    ``checkpoints/retention.json`` is rewritten when something was removed or the kept steps or policy changed,
    so a call with nothing to do writes nothing (nor does a run that never set a policy).
    """
    layout = store.layout
    _sweep_record_temps(layout)
    committed = store.committed()
    checkpoints = decide(committed, latest_step, cfg.keep_last, cfg.keep_every, _best(store, cfg, committed))
    store.retire(checkpoints.removed, fence, epoch)  # each re-checked at the act: a decision can be stale
    outputs = {
        kind: _apply_area(area, marker, latest_step, cfg.keep_outputs_last, None)
        for kind, (area, marker) in output_areas(layout).items()
    }
    policy: dict[str, Any] = {
        "keep_last": cfg.keep_last, "keep_every": cfg.keep_every, "keep_outputs_last": cfg.keep_outputs_last
    }  # fmt: skip
    if cfg.keep_best is not None:
        policy.update(keep_best=cfg.keep_best, best_metric=cfg.best_metric, best_mode=cfg.best_mode)
    areas = {"checkpoints": checkpoints.to_json(), **{k: d.to_json() for k, d in outputs.items()}}
    removed_any = any(d.removed for d in (checkpoints, *outputs.values()))
    recorded = read_record(layout)
    stale = _recorded_state(recorded) != _recorded_state({"policy": policy, "areas": areas})
    has_policy = any(v is not None for v in policy.values())
    if is_real_dir(layout.checkpoints) and (removed_any or (stale and (has_policy or recorded is not None))):
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record = {"time": stamp, "latest": latest_step, "policy": policy, "areas": areas}
        try:
            write_json_atomic(record_path(layout), record)
        except FileNotFoundError as e:  # a record for status only: another committer's rename onto it won
            log.warning("retention's record %s not replaced (%s): the next pass writes it", record_path(layout), e)
    return checkpoints


def _best(store: CheckpointStore, cfg: Policy, committed: list[int]) -> Best | None:
    """The best-k rule with each committed step's recorded value of the metric (read from its manifest)."""
    if cfg.keep_best is None:
        return None
    scores = {}
    for step in committed:
        recorded = store.step_metrics(step)
        if cfg.best_metric in recorded:
            scores[step] = recorded[cfg.best_metric]
    return Best(cfg.keep_best, cfg.best_metric, cfg.best_mode, scores)


def _recorded_state(record: dict[str, Any] | None) -> Any:
    """What decides whether the record is stale: the policy and each area's kept steps (not time, not removed)."""
    if record is None:
        return None
    areas = record.get("areas")
    kept = {k: v.get("kept") for k, v in areas.items() if isinstance(v, dict)} if isinstance(areas, dict) else None
    return record.get("policy"), kept
