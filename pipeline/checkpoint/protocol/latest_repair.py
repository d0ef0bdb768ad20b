"""The committer's repair of ``latest`` (a mixin of :class:`~pipeline.checkpoint.protocol.committer.Committer`):
re-verify the step it names, quarantine damage there, move it back to the newest committed step that verifies, or up to
a newer one it lags behind. Every act is fenced; a move backwards (or a removal) happens only if ``latest`` is still
what was read before the verification that called for it (``expect``), so a ghost's repair can never undo a newer
holder's commit."""

from __future__ import annotations

import logging

from pipeline.checkpoint.protocol.policy import CommitReport
from pipeline.checkpoint.stores.store import CheckpointStore
from pipeline.errors import VerificationError

log = logging.getLogger("pipeline.checkpoint.protocol.committer")


class LatestRepair:
    """What :class:`~pipeline.checkpoint.protocol.committer.Committer` does when ``latest`` is not what it should be."""

    store: CheckpointStore
    report: CommitReport

    def fence(self) -> None:
        raise NotImplementedError

    @property
    def epoch(self) -> int | None:
        raise NotImplementedError

    def _pointer_step(self) -> int:
        try:
            latest = self.store.read_latest()
        except VerificationError:
            return 0  # unusable: the next recheck repairs it
        return latest.step if latest else 0

    def recheck_latest(self) -> list[str]:
        """Re-verify the step ``latest`` names. Damage there: quarantine that very copy (the step and manifest
        found bad, with every committed step that shares a damaged piece of it) and point ``latest`` at the newest
        step that verifies (or remove it if none does). A pointer to a step that is gone but newer committed
        steps exist (a stale committer's late move, a step retired since) is not damage: it moves up. A step
        retired by a late act that ``latest`` names comes back from the trash. Every act is fenced, and a move of
        ``latest`` backwards happens only if ``latest`` is still what was read before the verification. Returns
        what was repaired."""
        version = self.store.latest_version()
        try:
            latest = self.store.read_latest()
        except VerificationError as e:
            return self._repair_pointer(str(e), version)
        if latest is None:
            return self._bring_back()
        try:
            self.store.verify_committed(latest.step)
        except VerificationError as e:
            return self._quarantine_latest(latest.step, latest.manifest_hash, str(e), version)
        return []

    def _bring_back(self) -> list[str]:
        """No ``latest``, yet the trash holds a step newer than every committed one: a fall-back that could not
        bring it back (an I/O error) removed ``latest``. The fall-back again, now (``latest`` only if still absent)."""
        trashed = self.store.trashed()
        if not trashed or max(trashed) <= max(self.store.committed(), default=-1):
            return []
        repairs: list[str] = []
        fallback = self._fall_back(repairs, None)
        if fallback is None:
            return repairs
        return [f"latest rebuilt as step {fallback}, brought back from the trash", *repairs]

    def _repair_pointer(self, problem: str, version: str | None) -> list[str]:
        """``latest`` names no usable step (malformed, its step missing, its manifest different)."""
        named = self.store.latest_named()
        if named is not None and not self.store.is_published(named):
            self.fence()
            if self.store.restore(named):
                return []  # retired by a late act; verified by the next recheck
        try:  # garbage (named None): readers refuse it, so rebuild
            newest = self.store.newest() if named is not None else None
        except VerificationError:  # its step is there with another manifest (damaged): rebuilt from what verifies
            newest = None
        written = self.store.latest_epoch()
        stale = written is not None and self.epoch is not None and written < self.epoch  # a ghost's late write
        if named is not None and newest is not None and (newest.step > named or (newest.step == named and stale)):
            try:
                manifest_hash = self.store.verify_committed(newest.step)
            except VerificationError as e:
                if newest.step == named:
                    return self._quarantine_latest(named, newest.manifest_hash, str(e), version)
            else:
                self.fence()  # a pointer behind (or beside) the newest committed step: not damage, it moves up
                log.warning("latest named step %d (%s): moved to step %d, the newest committed", named, problem,
                            newest.step)  # fmt: skip
                self.store.move_latest(newest.step, manifest_hash, self.epoch, back=True, expect=version)
                return []
        self.fence()
        where = self.store.drop_latest(problem)
        shared: list[str] = []
        fallback = self._fall_back(shared, None)
        now = f"latest rebuilt as step {fallback}" if fallback is not None else "latest removed (no step verifies)"
        return [f"{now}: {problem} (moved to {where}); rerun to train again from there", *shared]

    def _quarantine_latest(self, step: int, manifest_hash: str, problem: str, version: str | None) -> list[str]:
        self.fence()
        moved = self.store.quarantine(step, None, problem, committed=True, manifest_hash=manifest_hash)
        if moved is None:
            return []  # committed again since (another committer's repair): not this one's to touch
        shared = list(moved.others.values())
        fallback = self._fall_back(shared, version)
        now = (
            f"latest moved back to step {fallback}, the newest step that verifies"
            if fallback is not None
            else ("latest removed (no committed step verifies)")
        )
        return [f"{now}: {problem} (step {step} moved to {moved.where}); rerun to train again from there", *shared]

    def _fall_back(self, repairs: list[str], version: str | None) -> int | None:
        """``latest`` -> the newest committed step that verifies, brought back from the trash if a late retention
        moved it there (removed if none does); returns that step. A newer step that does not verify is damage:
        quarantined rather than left above ``latest``. ``version``: ``latest`` as read before the verification
        that called for this (None: absent); a ``latest`` changed since is another committer's and stays."""
        for step in sorted(set(self.store.committed()) | set(self.store.trashed()), reverse=True):
            if not self.store.is_published(step):
                self.fence()
                if not self.store.restore(step):
                    continue  # quarantined meanwhile with a step that shares its damaged piece, or purged
            found = self.store.manifest_hash(step)
            try:
                manifest_hash = self.store.verify_committed(step)
            except VerificationError as e:
                log.warning("committed step %d does not verify, not a candidate for latest: %s", step, e)
                self.fence()
                moved = self.store.quarantine(step, None, str(e), committed=True, manifest_hash=found)
                if moved is not None:
                    repairs += [f"step {step} does not verify either: {e} (moved to {moved.where})",
                                *moved.others.values()]  # fmt: skip
                continue
            self.fence()
            self.store.move_latest(step, manifest_hash, self.epoch, back=True, expect=version)
            log.warning("latest -> step %d (the newest committed step that verifies)", step)
            return step
        self.fence()
        self.store.remove_latest(expect=version)
        return None

    def _catch_up_latest(self) -> None:
        """``latest`` behind the newest published step (a stale committer elsewhere moved it back, or a commit
        was interrupted before moving it): verified, then ``latest`` moves up to it."""
        try:
            newest = self.store.newest()
        except VerificationError:  # latest names a step a late retention retired: the next recheck restores it
            return
        if newest is None or newest.step <= self._pointer_step():
            return
        try:
            manifest_hash = self.store.verify_committed(newest.step)  # latest names the manifest verified
        except VerificationError as e:
            log.warning("step %d is published but does not verify; latest stays (the next start rechecks): %s",
                        newest.step, e)  # fmt: skip
            return
        log.warning("latest was behind published step %d: moved up to it", newest.step)
        self.fence()
        self.store.move_latest(newest.step, manifest_hash, self.epoch)

    def _quarantine(
        self, step: int, attempt: str | None, reason: str, committed: bool, manifest_hash: str | None = None
    ) -> None:
        """Quarantine ``step`` (the copy whose manifest is ``manifest_hash``, when given) and every committed step
        holding one of its damaged pieces; ``latest`` moves back to the newest step that verifies when its step
        was one of them."""
        version = self.store.latest_version()
        self.fence()
        named = self.store.latest_named()
        moved = self.store.quarantine(step, attempt, reason, committed, manifest_hash=manifest_hash)
        if moved is None:
            return
        lines = list(moved.others.values())
        hit = {step} if committed else set()
        if named is not None and named in hit | set(moved.others) and not self.store.is_published(named):
            fallback = self._fall_back(lines, version)
            lines.append(f"latest moved back to step {fallback}" if fallback else "latest removed (no step verifies)")
        self.report.quarantined += [f"step {step}: {reason} (moved to {moved.where})", *lines]
