"""Checkpoints in a bucket: the protocol's names as keys, and the reads and writes of each party.

Under the checkpoints root ``s3://<bucket>/<prefix>`` (the app adds ``<experiment>/<run_id>``):

* ``step_N/<attempt>/<file>``: rank K's files of step N, uploaded by rank K (multipart, hashed while read for
  upload: the hash must equal the one taken while the file was written), then ``step_N/<attempt>/rank_K.done.json``;
  an attempt is one launch of train (every rank of it shares the name), so two attempts never write one key;
* ``step_N/manifest.json``: written by the one committer with ``If-None-Match: *`` once every file verified.
  **The commit point**: a step is committed exactly when its manifest exists beside its attempt's rank 0 marker
  and verifies; two committers can never both write it. The manifest names the attempt whose files it lists
  (retention's purge deletes that marker first, so a stale committer's manifest landing later commits nothing).
  An empty object there is a manifest its writer took back (:meth:`Remote.withdraw_manifest`): it commits nothing,
  and the next commit of the step replaces it (``If-Match``);
* ``latest``: ``{"step", "dir", "manifest_hash"}``, moved only forward by compare-and-swap (``If-Match``), and
  only after the manifest exists;
* ``quarantine/step_N-<attempt>/``: a refused attempt's objects (server-side copies), with ``reason.txt``;
* ``pieces/<xxh3-128>``: a shared piece (``__K_frozen<n>.distcp``, ``__K_buffers<n>.distcp``), stored once by its
  content and listed by every step's marker and manifest that holds it (:mod:`pipeline.checkpoint.save.pieces`); it
  is deleted only when no committed manifest lists it.

Readers trust manifests, never listings: :meth:`Remote.pull` downloads a committed step's listed files into a
local cache (``<run_dir>/s3-cache/checkpoints/step_N``, published by one rename once every hash matched), and
every local reader (resume, consolidate, export) works on that copy unchanged.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from pipeline.checkpoint.manifest import MANIFEST, MARKER_RE, Latest, Manifest, Marker, parse_pointer
from pipeline.checkpoint.protocol.ownership import LEASE, ObjectLease
from pipeline.errors import VerificationError
from pipeline.formats.dcp_names import is_piece
from pipeline.storage import atomic
from pipeline.storage.integrity import MAX_RECORD_BYTES, FileEntry, safe_join
from pipeline.storage.layout import CheckpointLayout, parse_step, step_name
from pipeline.storage.s3 import Conflict, S3Store, S3Url

log = logging.getLogger(__name__)

LATEST = "latest"
QUARANTINE = "quarantine"
TRASH = "trash"
_TRASHED = re.compile(r"^trash/step_(\d+)\.e\d+\.\d+\.json$")
"""A trash record's key under the root (:mod:`pipeline.checkpoint.stores.bucket_trash`)."""
PIECES = "pieces"
_HASH_RE = re.compile(r"^[0-9a-f]{32}$")
_PART_RE = re.compile(r"^[A-Za-z0-9_.=+-][A-Za-z0-9_.=+ -]*$")
TRANSFER_THREADS = 4
"""Objects uploaded, verified or downloaded at once (each with its own ranged requests)."""


WITHDRAWN = b""
"""What a manifest object its writer took back holds (:meth:`Remote.withdraw_manifest`): no step is committed by it."""


def safe_key_path(rel: str, where: str) -> str:
    """A relative path read from a marker or manifest, as key components: never absolute, no ``.``/``..`` or empty
    parts, no backslash or control characters; so a key built from it cannot leave the attempt's prefix."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") or not _PART_RE.match(p) for p in parts):
        raise VerificationError(f"{where} names {rel!r}: a path that could leave its step's prefix is refused")
    return rel


def parse_record(data: bytes, what: str, where: str) -> Any:
    if len(data) > MAX_RECORD_BYTES:
        raise VerificationError(f"{what} {where} is larger than {MAX_RECORD_BYTES} bytes: not one this pipeline wrote")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise VerificationError(f"{what} {where} is not valid JSON ({str(e)[:200]})") from None


def record_bytes(obj: Any) -> bytes:
    return atomic.json_bytes(obj)


def digest(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


@dataclass(frozen=True)
class Remote:
    """One checkpoints root in a bucket, and the local cache its readers use."""

    root: S3Url
    cache_dir: Path
    """``<run_dir>/s3-cache``: a :class:`CheckpointLayout` root holding verified copies of committed steps."""

    @property
    def store(self) -> S3Store:
        return S3Store(self.root.bucket)

    @property
    def cache(self) -> CheckpointLayout:
        return CheckpointLayout(self.cache_dir)

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.root.prefix, *parts) if p)

    def lease_store(self) -> ObjectLease:
        """The committer lease of this root, an object written by compare-and-swap."""
        return ObjectLease(self.store, self.key(LEASE))

    def step_prefix(self, step: int) -> str:
        return self.key(step_name(step)) + "/"

    def attempt_prefix(self, step: int, attempt: str) -> str:
        if not _PART_RE.match(attempt) or attempt in (".", ".."):
            raise VerificationError(f"attempt {attempt!r} of step {step} is not a safe key component")
        return self.key(step_name(step), attempt) + "/"

    def manifest_key(self, step: int) -> str:
        return self.key(step_name(step), MANIFEST)

    def marker_key(self, step: int, attempt: str, rank: int) -> str:
        return self.attempt_prefix(step, attempt) + f"rank_{rank}.done.json"

    def url(self, key: str) -> str:
        return f"s3://{self.root.bucket}/{key}"

    def withdraw_manifest(self, step: int, etag: str) -> bool:
        """Take back the manifest of ``step`` this process wrote (``etag``: what its write returned): replaced by
        :data:`WITHDRAWN`, which commits nothing, only while it is still that very object (``If-Match``). Never a
        plain delete: a delete cannot be conditional on every server this store accepts (S3 and Ceph take
        ``If-Match`` on DELETE now; a server that ignores it deletes unconditionally), and between any look and a
        plain delete another committer may commit the step again (a newer attempt), whose manifest the delete
        would take. Returns whether the object was still this process's."""
        try:
            self.store.put(self.manifest_key(step), WITHDRAWN, if_match=etag)
        except Conflict:
            log.warning("%s is no longer the manifest this committer wrote: left as it is",
                        self.url(self.manifest_key(step)))  # fmt: skip
            return False
        return True

    def pieces_prefix(self) -> str:
        return self.key(PIECES) + "/"

    def object_key(self, step: int, attempt: str, e: FileEntry, where: str = "manifest") -> str:
        """Where the file ``e`` of ``step``'s ``attempt`` is: a shared piece by its hash, else in the attempt."""
        if is_piece(e.path):
            if not _HASH_RE.match(e.hash):
                raise VerificationError(f"{where} lists piece {e.path!r} with hash {e.hash!r}: not an xxh3-128 digest")
            return self.pieces_prefix() + e.hash
        return self.attempt_prefix(step, attempt) + safe_key_path(e.path, where)

    def piece_keys(self, files: tuple[FileEntry, ...]) -> set[str]:
        return {self.pieces_prefix() + e.hash for e in files if is_piece(e.path) and _HASH_RE.match(e.hash)}

    # -- a rank ---------------------------------------------------------------------------------------------

    def upload_rank(self, scratch: Path, marker: Marker, reused: frozenset[str] = frozenset()) -> None:
        """Upload rank ``marker.rank``'s files from its private ``scratch`` dir (each hash must equal the one its
        marker took while writing), then its marker: the marker object is written last. ``reused``: pieces the
        latest committed step already holds (listed by the marker, not uploaded again)."""
        store = self.store

        def one(e: FileEntry) -> None:
            key = self.object_key(marker.step, marker.attempt, e, "marker")
            size, h = store.upload_file(key, safe_join(scratch, e.path))
            if (size, h) != (e.size, e.hash):
                raise VerificationError(
                    f"{scratch / e.path} changed between its write and its upload to {self.url(key)} "
                    f"({size} bytes, hash {h}; written: {e.size} bytes, hash {e.hash})"
                )

        with cf.ThreadPoolExecutor(TRANSFER_THREADS) as pool:
            for f in [pool.submit(one, e) for e in marker.files if e.path not in reused]:
                f.result()
        store.put(self.marker_key(marker.step, marker.attempt, marker.rank), record_bytes(marker.to_json()))

    # -- the committer --------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Step numbers that have any object (a listing: it only nominates)."""
        return sorted(s for s in (parse_step(n) for n in self.store.children(self.root.prefix + "/")) if s is not None)

    def attempts(self, step: int) -> list[str]:
        """The attempts with at least one object under ``step_N/`` (a store may keep an emptied "directory")."""
        prefix = self.step_prefix(step)
        names = {k[len(prefix) :].split("/", 1)[0] for k in self.store.listing(prefix) if "/" in k[len(prefix) :]}
        return sorted(n for n in names if _PART_RE.match(n))

    def read_marker(self, step: int, attempt: str, rank: int) -> Marker | None:
        key = self.marker_key(step, attempt, rank)
        got = self.store.get(key)
        if got is None:
            return None
        m = Marker.from_json(parse_record(got[0], "marker", self.url(key)), self.url(key))
        if (m.step, m.rank, m.attempt) != (step, rank, attempt):
            raise VerificationError(
                f"{self.url(key)} claims rank {m.rank} of step {m.step} (attempt {m.attempt}): a marker must name "
                "its own rank, step and attempt"
            )
        return m

    def markers(self, step: int, attempt: str, world_size: int) -> list[Marker | None]:
        first = self.read_marker(step, attempt, 0)
        world = first.world_size if first is not None and first.world_size >= 1 else world_size
        with cf.ThreadPoolExecutor(TRANSFER_THREADS) as pool:
            rest = list(pool.map(lambda r: self.read_marker(step, attempt, r), range(1, world)))
        out = [first, *rest]
        for r, m in enumerate(out):
            if m is not None and m.world_size != world:
                raise VerificationError(
                    f"{self.url(self.marker_key(step, attempt, r))} says a world of {m.world_size}, rank 0's {world}"
                )
        return out

    def read_manifest(self, step: int) -> tuple[Manifest, bytes] | None:
        key = self.manifest_key(step)
        got = self.store.get(key)
        if got is None or got[0] == WITHDRAWN:
            return None
        manifest = Manifest.from_json(parse_record(got[0], "manifest", self.url(key)), self.url(key))
        if manifest.step != step:
            raise VerificationError(f"{self.url(key)} records step {manifest.step}, not {step}")
        self.attempt_prefix(step, manifest.attempt)
        for e in manifest.files:
            safe_key_path(e.path, self.url(key))
        return manifest, got[0]

    def read_manifest_or_none(self, step: int) -> Manifest | None:
        """The step's manifest when it exists and parses (a damaged one counts as none)."""
        try:
            found = self.read_manifest(step)
        except VerificationError:
            return None
        return found[0] if found else None

    def read_latest(self) -> tuple[Latest | None, str | None]:
        """``latest`` as written (not yet checked against its manifest) and its ETag (None: no such object)."""
        key = self.key(LATEST)
        got = self.store.get(key)
        if got is None:
            return None, None
        obj = parse_record(got[0], "latest pointer", self.url(key))
        pointer = parse_pointer(obj)
        if pointer is None:
            raise VerificationError(
                f"{self.url(key)} is malformed ({repr(obj)[:120]}): it must name step, dir and hash"
            )
        return pointer, got[1]

    def move_latest(
        self, step: int, manifest_hash: str, *, back: bool = False, epoch: int | None = None, expect: object = None
    ) -> None:
        """Compare-and-swap ``latest`` to ``step``: forward only; ``back`` (the repair of a damaged latest) only
        from the version ``expect`` (an ETag, None: absent) read before the verification that justified it,
        when given as a string or None; any other ``expect``: from whatever is there.
        ``epoch``: the committer lease epoch of the writer (who moved it, for readers)."""
        key = self.key(LATEST)
        record: dict[str, object] = {"step": step, "dir": step_name(step), "manifest_hash": manifest_hash}
        if epoch is not None:
            record["epoch"] = epoch
        data = record_bytes(record)
        pinned = back and (expect is None or isinstance(expect, str))
        for _ in range(20):
            try:
                current, etag = self.read_latest()
            except VerificationError:  # a damaged latest: replaced (the committer's repair decided to)
                info = self.store.head(key)
                current, etag = None, (info.etag if info else None)
            if current is not None and not back and current.step >= step:
                return
            if pinned:
                etag = expect  # type: ignore[assignment]
            try:
                if etag is None:
                    self.store.put(key, data, if_none_match=True)
                else:
                    self.store.put(key, data, if_match=etag)
                return
            except Conflict:
                if pinned:
                    log.warning("%s changed since it was found damaged: not moved back to step %d", self.url(key), step)
                    return
                continue  # it moved under us: look again
        raise Conflict(
            f"{self.url(key)} kept changing under 20 compare-and-swap attempts: is a second committer running?"
        )

    def fetch_verified(self, manifest: Manifest, dest: Path | None, files: tuple[FileEntry, ...] = ()) -> None:
        """Read every file of ``manifest`` (or ``files`` of its attempt) from the bucket, checking size and
        hash; into ``dest`` when given (created fresh). The first bad file is named."""
        prefix = self.attempt_prefix(manifest.step, manifest.attempt)
        entries = files or manifest.files
        keys = {e.path: self.object_key(manifest.step, manifest.attempt, e) for e in entries}
        sizes = self.store.listing(prefix)
        if any(is_piece(e.path) for e in entries):
            sizes.update(self.store.listing(self.pieces_prefix()))
        for e in entries:
            found = sizes.get(keys[e.path])
            if found is None:
                raise VerificationError(f"{self.url(keys[e.path])} is missing (step {manifest.step}, {e.path})")
            if found.size != e.size:
                raise VerificationError(
                    f"{self.url(keys[e.path])} has {found.size} bytes, its manifest/marker says {e.size} ({e.path})"
                )
        store = self.store

        def one(e: FileEntry) -> None:
            target = None
            if dest is not None:
                target = dest / e.path
                target.parent.mkdir(parents=True, exist_ok=True)
            size, h = store.download(keys[e.path], e.size, target)
            if (size, h) != (e.size, e.hash):
                raise VerificationError(
                    f"{self.url(keys[e.path])} does not match its record: {size} bytes, hash {h} (recorded "
                    f"{e.size} bytes, {e.hash}): changed or replaced after it was written"
                )

        with cf.ThreadPoolExecutor(TRANSFER_THREADS) as pool:
            futures = [pool.submit(one, e) for e in entries]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    # -- readers --------------------------------------------------------------------------------------------

    def verified_latest(self) -> tuple[Manifest, bytes] | None:
        """The step ``latest`` names, with its manifest checked against ``latest``'s hash (not its files)."""
        latest, _ = self.read_latest()
        if latest is None:
            return None
        found = self.read_manifest(latest.step)
        if found is None or digest(found[1]) != latest.manifest_hash:
            raise VerificationError(
                f"{self.url(self.key(LATEST))} names step {latest.step}, but "
                f"{self.url(self.manifest_key(latest.step))} is missing or differs"
            )
        return found

    def newest_manifest(self) -> tuple[Manifest, bytes] | None:
        """What a reader resumes from: the newest committed step (its manifest is its commit, written only once
        every object verified), whatever ``latest`` says: ``latest`` lags between a commit and its move, and a
        stale committer's late move of it must not take a reader back. A manifest that does not parse is
        skipped (the committer quarantines it). When ``latest`` names a newer step that a late retention moved
        to the trash, a reader is told to resume again (the committer brings it back), never given an older one."""
        keys = set(self.store.listing(self.root.prefix + "/"))
        found = None
        for step in reversed(self._steps_with(keys, MANIFEST)):
            try:
                found = self.read_manifest(step)
            except VerificationError:
                continue
            if found is not None and self.marker_key(step, found[0].attempt, 0) in keys:
                break
            found = None  # a late manifest of a step retired since: its objects are gone
        below = found[0].step if found is not None else -1
        trashed = {int(m.group(1)) for k in keys if (m := _TRASHED.match(k[len(self.root.prefix) + 1 :]))}
        if any(t > below for t in trashed):
            named, _ = self.read_latest()
            if named is not None and named.step > below and named.step in trashed:
                raise VerificationError(
                    f"{self.url(self.key(LATEST))} names step {named.step}, which a late retention moved to "
                    f"{self.url(self.key(TRASH))}/: the committer brings it back at its next pass; resume again then"
                )
        return found

    def committed(self) -> list[int]:
        """Steps whose manifest object exists beside a rank 0 marker (listing nominates, each manifest is read by
        its user). A manifest whose step has no marker left is a stale committer's late write of a step retention
        purged (the purge deletes the marker first): it commits nothing; nor does a manifest its writer took back
        (:data:`WITHDRAWN`, an empty object)."""
        listing = self.store.listing(self.root.prefix + "/")
        keys = [k for k, info in listing.items() if info.size or not k.endswith("/" + MANIFEST)]
        marked = set(self._steps_with(keys, "*/rank_0.done.json"))
        return [s for s in self._steps_with(keys, MANIFEST) if s in marked]

    def _steps_with(self, keys: Iterable[str], leaf: str) -> list[int]:
        out = []
        for key in keys:
            name, _, rest = key[len(self.root.prefix) + 1 :].partition("/")
            step = parse_step(name)
            if step is not None and (rest == leaf or (leaf[:2] == "*/" and rest.endswith("/" + leaf[2:]))):
                out.append(step)
        return sorted(out)


def is_marker_name(name: str) -> bool:
    return MARKER_RE.match(name) is not None
