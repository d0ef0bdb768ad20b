"""The one committer for checkpoints in a bucket: the same protocol as :mod:`pipeline.checkpoint.committer`,
committed without a rename.

Inputs: ``step_N/<attempt>/`` objects and each rank's ``rank_K.done.json`` object (``pipeline/checkpoint/remote.py``).
Outputs: ``step_N/manifest.json`` written with ``If-None-Match: *`` (the commit point) once every listed object
was re-read and matched its size and hash (and nothing unlisted sits beside them), then ``latest`` moved by
compare-and-swap; a refused attempt's objects are copied to ``quarantine/`` and removed; retention deletes a
step's manifest first and its objects after; a sweep deletes objects that no committed manifest references
(other attempts of a committed step, attempts of steps that ``latest`` superseded) and aborts incomplete
multipart uploads there (dead writers').

The local run dir keeps the committer lock (``flock``): one committer at a time per run; and the manifest's
``If-None-Match`` besides, so of two committers racing for a step exactly one commits.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeline.checkpoint import remote_pieces, retention
from pipeline.checkpoint.committer import CommitPolicy, Committer
from pipeline.checkpoint.manifest import Latest, Manifest, Marker, complete_markers, describe_incomplete
from pipeline.checkpoint.ownership import LeaseStore
from pipeline.checkpoint.remote import QUARANTINE, Remote, digest, is_marker_name
from pipeline.checkpoint.step_checks import check_agreement, check_stored, foreign_files
from pipeline.errors import DeadlineError, VerificationError
from pipeline.storage.atomic import remove_tree
from pipeline.storage.faults import inject
from pipeline.storage.integrity import FileEntry
from pipeline.storage.layout import CheckpointLayout, parse_step
from pipeline.storage.s3 import Conflict
from pipeline.storage.waiting import wait_until

log = logging.getLogger(__name__)


class RemoteCommitter(Committer):
    """Commits the steps staged in one bucket root. Not thread-safe: one thread drives it. Following the producer
    (:meth:`follow`) and the final verdict (:meth:`raise_problems`) are the run dir committer's."""

    def __init__(
        self,
        layout: CheckpointLayout,
        remote: Remote,
        policy: CommitPolicy,
        save_errors: Callable[[], dict[int, str]] = dict,
    ) -> None:
        super().__init__(layout, policy, save_errors=save_errors)
        self.remote = remote

    def lease_store(self) -> LeaseStore:
        return self.remote.lease_store()

    @contextlib.contextmanager
    def hold(self, takeover: bool = False) -> Iterator[None]:
        """The bucket's conditional writes are checked first: the lease itself is one (compare-and-swap)."""
        self.remote.store.check_conditional_writes(self.remote.root.prefix)
        with super().hold(takeover):
            yield

    # -- state ----------------------------------------------------------------------------------------------

    def latest_step(self) -> int:
        latest, _ = self.remote.read_latest()
        return latest.step if latest else 0

    def _candidates(self) -> list[int]:
        after = self.latest_step()
        committed = set(self.remote.committed())
        return [s for s in self.remote.steps() if s > after and s not in committed and self.remote.attempts(s)]

    def pending(self) -> list[int]:
        return self._candidates()

    # -- the passes -----------------------------------------------------------------------------------------

    def recover(self) -> None:
        """Re-verify ``latest`` (quarantining damage, moving ``latest`` back to the newest step that verifies),
        then finish a commit interrupted between its manifest and ``latest``."""
        remote = self.remote
        try:
            found = remote.verified_latest()
            if found is not None:
                remote.fetch_verified(found[0], None)
        except VerificationError as e:
            latest, _ = self._safe_latest()
            bad = latest.step if latest is not None else None
            log.error("latest in %s does not verify: %s", remote.root, e)
            if bad is not None and remote.read_manifest_or_none(bad) is not None:
                self._quarantine_committed(bad, str(e))
            self._move_back(bad)
        after = self.latest_step()
        for step in remote.committed():
            if step <= after:
                continue
            try:
                manifest, raw = remote.read_manifest(step) or (None, b"")
                if manifest is None:
                    continue
                remote.fetch_verified(manifest, None)
            except VerificationError as e:
                self._quarantine_committed(step, str(e))
                continue
            remote.move_latest(step, digest(raw))
            log.warning(
                "step %d had a manifest but latest was not moved (interrupted commit): latest -> %d", step, step
            )
            self.report.committed[step] = time.time()
        remote.store.sweep_probes(remote.root.prefix)  # conditional-write probes a killed launch left behind

    def _safe_latest(self) -> tuple[Latest | None, str | None]:
        try:
            return self.remote.read_latest()
        except VerificationError:
            return None, None

    def _move_back(self, bad: int | None) -> None:
        """Point ``latest`` at the newest committed step (other than ``bad``) that verifies, or remove it."""
        for step in sorted(self.remote.committed(), reverse=True):
            if step == bad:
                continue
            try:
                manifest, raw = self.remote.read_manifest(step) or (None, b"")
                if manifest is None:
                    continue
                self.remote.fetch_verified(manifest, None)
            except VerificationError as e:
                self._quarantine_committed(step, str(e))
                continue
            self.remote.move_latest(step, digest(raw), back=True)
            log.warning("latest -> step %d (the newest committed step that verifies)", step)
            return
        self.remote.store.delete([self.remote.key("latest")])

    def commit_ready(self) -> list[int]:
        done = []
        for step in self._candidates():
            for attempt in self.remote.attempts(step):
                try:
                    markers = complete_markers(self.remote.markers(step, attempt, self.policy.world_size), None)
                except VerificationError:
                    continue  # the last pass quarantines it
                if markers is not None and self._commit_or_quarantine(step, markers):
                    done.append(step)
                    break
        return done

    def finish(self, attempt: str | None, alive: Callable[[], bool]) -> None:
        for step in self._candidates():
            try:
                markers = self._wait_for_markers(step, attempt, alive)
            except DeadlineError as e:
                self.report.incomplete.append((step, str(e)))
                continue
            except VerificationError as e:
                for a in self.remote.attempts(step):
                    self._quarantine_attempt(step, a, e)
                continue
            self._commit_or_quarantine(step, markers)
        self.sweep()
        remote_pieces.sweep(self.remote, self.policy.world_size)

    def _wait_for_markers(self, step: int, attempt: str | None, alive: Callable[[], bool]) -> list[Marker]:
        def look() -> tuple[str, list[Marker | None]] | None:
            found = None
            for a in [attempt] if attempt is not None else self.remote.attempts(step):
                markers = self.remote.markers(step, a, self.policy.world_size)
                if complete_markers(markers, None) is not None:
                    return a, markers
                found = (a, markers)
            return found

        def missing() -> str:
            got = look()
            if got is None:
                return f"step {step}: no rank uploaded a marker under {self.remote.url(self.remote.step_prefix(step))}"
            where = self.remote.url(self.remote.step_prefix(step))
            return f"step {step}: {describe_incomplete(got[1], None)} under {where}"

        def complete() -> list[Marker] | None:
            got = look()
            return complete_markers(got[1], None) if got is not None else None

        return wait_until(complete, deadline_s=self.policy.marker_deadline_s, what=missing, alive=alive)

    def is_clean(self) -> int | None:
        try:
            found = self.remote.verified_latest()
            if found is None or self._candidates():
                return None
            self.remote.fetch_verified(found[0], None)
        except (VerificationError, OSError):
            return None
        return found[0].step

    # -- one step -------------------------------------------------------------------------------------------

    def _commit_or_quarantine(self, step: int, markers: list[Marker]) -> bool:
        try:
            self.commit(step, markers)
        except VerificationError as e:
            self._quarantine_attempt(step, markers[0].attempt, e)
            return False
        except Conflict as e:
            self.report.quarantined.append(f"step {step}: {e}")
            return False
        self.report.committed[step] = time.time()
        self.fence()
        self.apply_retention()
        return True

    def commit(self, step: int, markers: list[Marker]) -> str:
        """Verify ``step``'s objects against its markers (sizes, a full re-read for hashes, nothing extra) and
        the format's own metadata, write the manifest exclusively, then move ``latest``."""
        remote = self.remote
        attempt = markers[0].attempt
        prefix = remote.attempt_prefix(step, attempt)
        where = remote.url(prefix)
        fmt, files = check_agreement(step, markers, where)
        bad = foreign_files(markers, fmt)
        if bad is not None:
            raise VerificationError(
                f"{remote.url(remote.marker_key(step, attempt, bad[0].rank))} lists {bad[1]}, which {fmt.name} names "
                "as another rank's files: each rank lists only the files it owns"
            )
        listed = {prefix + f.path for f in files}
        extra = sorted(
            k for k in remote.store.listing(prefix) if k not in listed and not is_marker_name(k[len(prefix) :])
        )
        if extra:
            raise VerificationError(f"{remote.url(extra[0])} is in step {step} but no marker lists it")
        manifest = Manifest(
            step=step,
            world_size=markers[0].world_size,
            format=markers[0].format,
            attempt=attempt,
            run_id=self.layout.run_id,
            files=files,
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".verify-step_{step}-", dir=self.layout.checkpoints))
        try:
            remote.fetch_verified(manifest, tmp)  # every byte re-read and hashed
            check_stored(fmt, tmp, step, markers, self.policy.allow_pickle)
        finally:
            remove_tree(tmp)
        inject("verify.before_publish", step=step)
        self.fence()
        manifest_hash = remote.create_manifest(manifest)
        inject("verify.before_latest", step=step)
        self.fence()
        remote.move_latest(step, manifest_hash)
        log.info("committed step %d (%d objects) -> %s", step, len(files), remote.url(remote.manifest_key(step)))
        return manifest_hash

    def _quarantine_attempt(self, step: int, attempt: str, e: Exception) -> None:
        self.fence()
        try:
            listed = [f for m in self.remote.markers(step, attempt, self.policy.world_size) if m for f in m.files]
        except VerificationError:
            listed = []
        where = self._move_to_quarantine(step, attempt, str(e))
        self.report.quarantined.append(f"step {step}: {e} (moved to {where})")
        self._quarantine_holders(listed, step, str(e))

    def _quarantine_committed(self, step: int, reason: str, holders: bool = True) -> None:
        """A committed step that does not verify: its manifest goes first (it is no longer committed), then its
        objects move to quarantine; then (``holders``) every committed step listing one of its damaged pieces."""
        remote = self.remote
        found = remote.read_manifest_or_none(step)
        remote.store.delete([remote.manifest_key(step)])
        for attempt in remote.attempts(step):
            where = self._move_to_quarantine(step, attempt, reason)
            self.report.quarantined.append(f"step {step}: {reason} (moved to {where})")
        if found is None:
            self.report.quarantined.append(f"step {step}: {reason}")
        if holders and found is not None:
            self._quarantine_holders(list(found.files), step, reason)

    def _quarantine_holders(self, files: list[FileEntry], step: int, reason: str) -> None:
        """Every committed step listing a piece of ``files`` (``step``'s) that is damaged goes to quarantine too
        (one object: one damage), its note naming the piece; ``latest`` moves back if its step was one of them.
        Only pieces another committed step lists are re-read."""
        latest, _ = self._safe_latest()
        others = remote_pieces.holders(self.remote, self.remote.piece_keys(tuple(files)), step)
        bad = remote_pieces.damaged(self.remote, files, {k for keys in others.values() for k in keys})
        hit = {s: [k for k in keys if k in bad] for s, keys in others.items()}
        for other, keys in ((s, ks) for s, ks in hit.items() if ks):
            names = ", ".join(f"{self.remote.url(k)} ({bad[k].path})" for k in keys)
            self._quarantine_committed(other, f"lists damaged piece {names}, as step {step} does: {reason}", False)
        if latest is not None and hit.get(latest.step):
            self._move_back(latest.step)

    def _move_to_quarantine(self, step: int, attempt: str, reason: str) -> str:
        remote = self.remote
        src = remote.attempt_prefix(step, attempt)
        dst = remote.key(QUARANTINE, f"step_{step}-{attempt}-{int(time.time())}") + "/"
        keys = list(remote.store.listing(src))
        for k in keys:
            remote.store.copy(k, dst + k[len(src) :])
        remote.store.put(
            dst + "reason.txt", (reason + "\n" + remote_pieces.quarantine_note(remote, step, attempt, keys)).encode()
        )
        remote.store.delete(keys)
        log.error("quarantined step %d (attempt %s) to %s: %s", step, attempt, remote.url(dst), reason)
        return remote.url(dst)

    # -- retention and the sweep ----------------------------------------------------------------------------

    def apply_retention(self) -> retention.Decision:
        """Delete the steps the policy lets go: each step's manifest first (it stops being committed), then its
        objects. A crash in between leaves objects no manifest references, which :meth:`sweep` removes."""
        remote = self.remote
        latest = self.latest_step() or None
        decision = retention.decide(remote.committed(), latest, self.policy.keep_last, self.policy.keep_every)
        for step in decision.removed:
            inject("retention.remove", step=step)
            self.remove_step(step)
            log.info("retention: removed step %d from %s", step, remote.root)
        if decision.removed:
            self.sweep()
        return decision

    def remove_step(self, step: int) -> None:
        """Delete a committed step: its manifest first (it stops being committed), then its objects, then the
        shared pieces it listed that no committed manifest still lists."""
        remote = self.remote
        found = remote.read_manifest_or_none(step)
        remote.store.delete([remote.manifest_key(step)])
        inject("retention.after_manifest", step=step)
        remote.store.delete(sorted(remote.store.listing(remote.step_prefix(step))))
        if found is not None:
            remote_pieces.drop(remote, remote.piece_keys(found.files))

    def sweep(self) -> list[str]:
        """Delete objects no committed manifest references, at or below ``latest`` only (a step above it may be
        uploading now): other attempts of a committed step, and every attempt of a step that has no manifest;
        abort incomplete multipart uploads there too. Returns the deleted keys."""
        remote = self.remote
        latest = self.latest_step()
        committed = set(remote.committed())
        deleted: list[str] = []
        for step in remote.steps():
            if step > latest:
                continue
            keep = None
            if step in committed:
                found = remote.read_manifest_or_none(step)
                if found is None:
                    continue  # unreadable manifest: recover decides, not the sweep
                keep = remote.attempt_prefix(step, found.attempt)
            prefix = remote.step_prefix(step)
            doomed = [
                k
                for k in remote.store.listing(prefix)
                if not (keep and k.startswith(keep)) and k != remote.manifest_key(step)
            ]
            if doomed:
                remote.store.delete(doomed)
                deleted += doomed
        if deleted:
            log.info("sweep: deleted %d unreferenced object(s) under %s", len(deleted), remote.root)
        root = remote.root.prefix + "/"

        def dead(key: str) -> bool:  # an upload of a step at or below latest: no live writer uploads there
            step = parse_step(key[len(root) :].split("/", 1)[0])
            return step is not None and step <= latest

        for up in remote.store.abort_uploads(root, dead):
            log.warning("aborted an incomplete upload of a dead writer: %s", remote.url(up))
        return deleted
