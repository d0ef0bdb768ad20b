"""What removes objects from a bucket of checkpoints (a mixin of
:class:`~pipeline.checkpoint.stores.bucket_store.BucketCheckpoints`): quarantine of a damaged step (copied to
``quarantine/`` with its reason, then deleted), retention (a committed step's manifest first, its objects after),
and the sweep of objects no committed manifest references. Each act re-checks its own target when it runs."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from pipeline.checkpoint.manifest import Latest
from pipeline.checkpoint.stores import bucket_trash, remote_pieces
from pipeline.checkpoint.stores.remote import QUARANTINE, Remote
from pipeline.checkpoint.stores.store import Quarantined
from pipeline.errors import VerificationError
from pipeline.storage.faults import inject
from pipeline.storage.integrity import FileEntry
from pipeline.storage.layout import parse_step

log = logging.getLogger("pipeline.checkpoint.stores.bucket_store")


class BucketRemoval:
    """Removal from the bucket ``remote``; the rest of the store is :class:`BucketCheckpoints`."""

    remote: Remote
    _first_seen: dict[str, float]
    """Trash records of other committers by when this one first saw them (its own monotonic clock)."""

    @property
    def where(self) -> str:
        raise NotImplementedError

    def newest(self) -> Latest | None:
        raise NotImplementedError

    def manifest_hash(self, step: int) -> str | None:
        raise NotImplementedError

    def latest_step(self) -> int:
        raise NotImplementedError

    # -- damage ---------------------------------------------------------------------------------------------

    def quarantine(
        self, step: int, attempt: str | None, reason: str, committed: bool, manifest_hash: str | None = None
    ) -> Quarantined | None:
        """A committed step: its manifest goes first (it is no longer committed), then its objects; a staged
        one: the ``attempt``'s objects (None: every attempt's). Then every committed step listing one of its
        pieces that is damaged (one object: one damage), its note naming the piece. ``manifest_hash``: only
        the copy found bad (None: nothing, when the step was committed again since)."""
        remote = self.remote
        files: list[FileEntry] = []
        if manifest_hash is not None and self.manifest_hash(step) != manifest_hash:
            log.warning("step %d is not the one found bad (committed again since): not quarantined", step)
            return None
        found = remote.read_manifest_or_none(step) if committed else None
        wheres: list[str] = []
        if committed:
            if found is None:  # a manifest past reading: it alone is kept aside; the attempts stay staged and the
                wheres.append(self._manifest_aside(step, reason))  # next pass verifies them anew
            remote.store.delete([remote.manifest_key(step)])
            files = list(found.files) if found is not None else []
            # its own attempt only, never a new attempt staged beside it (the trainer's save of the step again
            # after the fall-back, which the next pass commits)
            attempts = [found.attempt] if found is not None else []
        else:
            attempts = [attempt] if attempt is not None else remote.attempts(step)
            for a in attempts:
                with contextlib.suppress(VerificationError):
                    files += [f for m in remote.markers(step, a, 1) if m for f in m.files]
        wheres += [self._move_to_quarantine(step, a, reason) for a in attempts]
        return Quarantined(
            ", ".join(wheres) or remote.url(remote.step_prefix(step)), self._holders(files, step, reason)
        )

    def _holders(self, files: list[FileEntry], step: int, reason: str) -> dict[int, str]:
        """Every committed step listing a piece of ``files`` (``step``'s) that is damaged goes to quarantine too.
        Only pieces another committed step lists are re-read."""
        remote = self.remote
        others = remote_pieces.holders(remote, remote.piece_keys(tuple(files)), step)
        bad = remote_pieces.damaged(remote, files, {k for keys in others.values() for k in keys})
        out: dict[int, str] = {}
        for other, keys in ((s, [k for k in ks if k in bad]) for s, ks in others.items()):
            if not keys:
                continue
            names = ", ".join(f"{remote.url(k)} ({bad[k].path})" for k in keys)
            why = f"lists damaged piece {names}, as step {step} does: {reason}"
            held = remote.read_manifest_or_none(other)  # its committed attempt only, not one staged beside it
            remote.store.delete([remote.manifest_key(other)])
            wheres = [self._move_to_quarantine(other, a, why) for a in ([held.attempt] if held else [])]
            out[other] = f"step {other}: {why} (moved to {', '.join(wheres) or 'nowhere: its manifest was taken back'})"
        return out

    def _manifest_aside(self, step: int, reason: str) -> str:
        """A committed manifest that cannot be read whole into a manifest, kept in quarantine with the reason."""
        remote = self.remote
        dst = remote.key(QUARANTINE, f"step_{step}-manifest-{int(time.time())}") + "/"
        remote.store.copy(remote.manifest_key(step), dst + "manifest.json")
        remote.store.put(dst + "reason.txt", (reason + "\n").encode())
        log.error("quarantined step %d's manifest to %s: %s", step, remote.url(dst), reason)
        return remote.url(dst)

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

    # -- litter, retention and the sweep --------------------------------------------------------------------

    def tidy(self, fence: Callable[[], None], world_size: int, allow_pickle: bool, first: bool) -> list[str]:
        if first:
            self.remote.store.sweep_probes(self.remote.root.prefix)  # probes a killed launch left behind
        return []

    def trashed(self) -> list[int]:
        return sorted({step for step, _, _ in bucket_trash.entries(self.remote)})

    def restore(self, step: int) -> bool:
        return bucket_trash.restore(self.remote, step)

    def claim(self, fence: Callable[[], None], epoch: int) -> None:
        fence()
        bucket_trash.claim(self.remote, epoch)

    def retire(self, steps: tuple[int, ...], fence: Callable[[], None], epoch: int) -> None:
        """Phase one (into the trash) for each step, re-checked at the act: never the step ``latest`` names, the
        newest committed one, or anything above them; then phase two for the records this committer may purge
        (:mod:`pipeline.checkpoint.stores.bucket_trash`)."""
        moved = []
        for step in steps:
            fence()
            newest = self.newest()
            try:
                named, _ = self.remote.read_latest()
            except VerificationError:
                named = None
            if newest is None or step >= newest.step or (named is not None and step >= named.step):
                log.warning("retention: step %d is not retired: latest or the newest committed step needs it", step)
                continue
            inject("retention.remove", step=step)
            if bucket_trash.retire_step(self.remote, step, epoch):
                moved.append(step)
                log.info("retention: retired step %d from %s", step, self.where)
        if not moved and not self._first_seen:
            return
        if moved:
            inject("retention.before_delete", area="checkpoints", steps=",".join(map(str, moved)))
        fence()
        remote_pieces.drop(self.remote, set(bucket_trash.purge(self.remote, epoch, self._first_seen)))
        self.sweep_unreferenced()

    def remove_step(self, step: int) -> None:
        """Delete a committed step: its manifest first (it stops being committed), then its objects, then the
        shared pieces it listed that no committed manifest still lists. A crash in between leaves objects no
        manifest references, which :meth:`sweep_unreferenced` removes."""
        remote = self.remote
        found = remote.read_manifest_or_none(step)
        remote.store.delete([remote.manifest_key(step)])
        inject("retention.after_manifest", step=step)
        remote.store.delete(sorted(remote.store.listing(remote.step_prefix(step))))
        if found is not None:
            remote_pieces.drop(remote, remote.piece_keys(found.files))

    def sweep(self, latest: int, world_size: int) -> None:
        self.sweep_unreferenced()
        remote_pieces.sweep(self.remote, world_size)

    def sweep_unreferenced(self) -> list[str]:
        """Delete objects no committed manifest references, at or below ``latest`` only (a step above it may be
        uploading now): other attempts of a committed step, and every attempt of a step that has no manifest;
        abort incomplete multipart uploads there too. Returns the deleted keys."""
        remote = self.remote
        latest = self.latest_step()
        committed = set(remote.committed())
        trashed = set(self.trashed())  # listed after the manifests: a step retired meanwhile is in one of them
        deleted: list[str] = []
        for step in remote.steps():
            if step > latest or (step in trashed and step not in committed):
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
