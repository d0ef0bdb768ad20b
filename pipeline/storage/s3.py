"""The S3-compatible object store: the one module that talks to a bucket (boto3).

Endpoint, region and credentials come from the standard AWS environment variables and config files
(``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``...,
``AWS_PROFILE``, ``~/.aws/config``): nothing secret is ever part of a config, ``run.yaml`` or a log line.

The primitives the checkpoint protocol uses here (``pipeline/checkpoint/stores/remote.py`` maps names onto keys):

* :meth:`S3Store.put` with ``if_none_match`` (``If-None-Match: *``: create only; the commit point) or
  ``if_match`` (``If-Match: <etag>``: compare-and-swap, how ``latest`` moves); a lost race is :class:`Conflict`;
* :meth:`S3Store.upload_file`: a file as one object (multipart above one part), hashed (xxh3-128) while read
  for upload, so the bytes sent are the bytes whose hash the marker records;
* :meth:`S3Store.download` / :meth:`S3Store.hash_object`: parallel ranged GETs, hashed in order;
* :meth:`S3Store.check_conditional_writes`: the server must refuse a second ``If-None-Match: *`` create and a
  stale ``If-Match``, also under concurrent requests, or nothing is committed there.

Every request boundary calls :func:`~pipeline.storage.faults.inject` (``s3.put``, ``s3.upload_part``,
``s3.complete``, ``s3.get``...) so tests can fail or kill a process exactly there.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from pipeline.errors import PipelineError, need
from pipeline.storage.faults import inject
from pipeline.storage.s3_probe import Conflict, StoreError, StoreReadFailed, probe

PART_SIZE = 16 << 20
"""Multipart part size (S3 needs >= 5 MiB for every part but the last); a file up to this size is one PUT."""
IN_FLIGHT = 4
"""Parts (or ranged GETs) in flight per object: memory stays at ``IN_FLIGHT x PART_SIZE`` per transfer."""

PROBE_NAME = ".conditional-probe-"
"""The reserved name of :meth:`S3Store.check_conditional_writes`'s probe objects, directly under the root it
checks (``<root>/.conditional-probe-<uuid>``, and ``...<uuid>.new``). The pipeline stores nothing else there, so
a probe that a process killed mid-probe left behind is litter: :meth:`S3Store.sweep_probes` deletes it."""
PROBE_STALE_S = 3600.0
"""A probe object at least this old (by the server's ``LastModified``) belongs to a dead process: a probe takes
seconds. Younger ones may be another process's probe in flight and are left alone."""

_URL_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?$")


@dataclass(frozen=True)
class S3Url:
    bucket: str
    prefix: str
    """No leading or trailing slash; may be empty."""

    @staticmethod
    def parse(url: str, what: str = "checkpoint.storage") -> S3Url:
        m = _URL_RE.match(url)
        if m is None:
            raise PipelineError(
                f"{what}={url!r} is not an S3 URL: write s3://<bucket>[/<prefix>] (bucket: 3-63 lowercase "
                "letters, digits, dots or dashes)"
            )
        prefix = (m.group(2) or "").strip("/")
        parts = prefix.split("/") if prefix else []
        if any(p in ("", ".", "..") for p in parts):
            raise PipelineError(f"{what}={url!r}: the prefix may not hold empty, '.' or '..' parts")
        return S3Url(bucket=m.group(1), prefix=prefix)

    def join(self, *parts: str) -> S3Url:
        return S3Url(self.bucket, "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/")))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str


_clients: dict[int, Any] = {}
_CONDITIONAL_OK: set[tuple[str, str]] = set()
"""(endpoint, bucket) pairs whose conditional writes were checked by this process."""
_clients_lock = threading.Lock()


def client() -> Any:
    """One boto3 client per process (thread-safe), configured from the AWS environment. Retries (standard
    mode) and timeouts are bounded: no request waits forever. CRC checksums are left to the server where the
    protocol does not need them: every byte is hashed with xxh3-128 here anyway."""
    pid = os.getpid()
    with _clients_lock:
        found = _clients.get(pid)
        if found is None:
            boto3 = need("boto3", "s3", "checkpoints in a bucket (s3://...)")  # only runs with a bucket import it
            from botocore.config import Config  # noqa: PLC0415

            found = boto3.session.Session().client(
                "s3",
                config=Config(
                    retries={"mode": "standard", "max_attempts": int(os.environ.get("PIPELINE_S3_ATTEMPTS", "5"))},
                    connect_timeout=float(os.environ.get("PIPELINE_S3_TIMEOUT_S", "20")),
                    read_timeout=float(os.environ.get("PIPELINE_S3_TIMEOUT_S", "20")),
                    max_pool_connections=32,
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                ),
            )
            _clients.clear()  # a forked child never reuses its parent's connections
            _clients[pid] = found
        return found


def _code(e: Exception) -> tuple[str, int]:
    resp = getattr(e, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", "")), int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _failed(what: str, url: str, e: Exception) -> StoreError:
    """The one-line error of a failed request; a read's is :class:`StoreReadFailed` (unknown, not damage)."""
    code, status = _code(e)
    why = f"{code} (HTTP {status})" if code else f"{type(e).__name__}: {e}"
    if what in ("GET", "HEAD", "LIST"):
        return StoreReadFailed(f"{what} {url} failed: {why}: unknown, not damage (nothing is quarantined or rolled "
                               "back for it); check the object store, then rerun")  # fmt: skip
    return StoreError(f"{what} {url} failed: {why}")


class S3Store:
    """One bucket. Keys are full keys (the caller adds its prefix)."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # -- small objects ----------------------------------------------------------------------------------------

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """PUT ``data``; returns the new ETag. ``if_none_match``: only if ``key`` does not exist; ``if_match``:
        only if its ETag is still that one. A lost condition raises :class:`Conflict`."""
        inject("s3.put", key=key)
        kwargs: dict[str, Any] = {}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        try:
            resp = client().put_object(Bucket=self.bucket, Key=key, Body=data, **kwargs)
        except Exception as e:
            code, status = _code(e)
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise Conflict(f"conditional PUT of {self.url(key)} refused: {code or status}") from None
            raise _failed("PUT", self.url(key), e) from None
        return str(resp["ETag"])

    def get(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag, or None if there is no such key."""
        inject("s3.get", key=key)
        try:
            resp = client().get_object(Bucket=self.bucket, Key=key)
            return resp["Body"].read(), str(resp["ETag"])
        except Exception as e:
            if _code(e)[1] == 404 or _code(e)[0] in ("NoSuchKey", "404"):
                return None
            raise _failed("GET", self.url(key), e) from None

    def head(self, key: str) -> ObjectInfo | None:
        inject("s3.head", key=key)
        try:
            resp = client().head_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if _code(e)[1] == 404 or _code(e)[0] in ("NoSuchKey", "404", "NotFound"):
                return None
            raise _failed("HEAD", self.url(key), e) from None
        return ObjectInfo(size=int(resp["ContentLength"]), etag=str(resp["ETag"]))

    def listing(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every key under ``prefix`` (a listing only nominates: manifests and markers decide)."""
        inject("s3.list", prefix=prefix)
        out: dict[str, ObjectInfo] = {}
        try:
            for page in client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    out[obj["Key"]] = ObjectInfo(size=int(obj["Size"]), etag=str(obj.get("ETag", "")))
        except Exception as e:
            raise _failed("LIST", self.url(prefix), e) from None
        return out

    def children(self, prefix: str) -> list[str]:
        """The next path components under ``prefix`` (which ends with ``/``): names, not keys."""
        inject("s3.list", prefix=prefix)
        names: set[str] = set()
        try:
            pages = client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/")
            for page in pages:
                names.update(p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", []))
                names.update(o["Key"][len(prefix) :] for o in page.get("Contents", []))
        except Exception as e:
            raise _failed("LIST", self.url(prefix), e) from None
        return sorted(n for n in names if n)

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            inject("s3.delete", key=batch[0])
            try:
                resp = client().delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except Exception as e:
                raise _failed("DELETE", self.url(batch[0]), e) from None
            if resp.get("Errors"):
                err = resp["Errors"][0]
                raise StoreError(f"DELETE {self.url(err.get('Key', ''))} failed: {err.get('Code')}")

    def copy(self, src: str, dst: str) -> None:
        inject("s3.copy", key=dst)
        try:
            client().copy_object(Bucket=self.bucket, Key=dst, CopySource={"Bucket": self.bucket, "Key": src})
        except Exception as e:
            raise _failed("COPY to", self.url(dst), e) from None

    # -- large objects ----------------------------------------------------------------------------------------

    def upload_file(self, key: str, path: Path, part_size: int = PART_SIZE) -> tuple[int, str]:
        """Upload ``path`` as ``key``; returns (size, xxh3-128 of the bytes sent). Parts are read in order
        (and hashed), ``IN_FLIGHT`` uploading at once; a failure aborts the multipart upload."""
        h = xxhash.xxh3_128()
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size <= part_size:
                data = f.read()
                h.update(data)
                self.put(key, data)
                return len(data), h.hexdigest()
            return self._multipart(key, f, h, part_size)

    def _multipart(self, key: str, f: Any, h: Any, part_size: int) -> tuple[int, str]:
        c = client()
        inject("s3.create_multipart", key=key)
        try:
            upload_id = c.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        except Exception as e:
            raise _failed("CreateMultipartUpload", self.url(key), e) from None
        parts: list[dict[str, Any]] = []
        total = 0

        def send(number: int, data: bytes) -> dict[str, Any]:
            inject("s3.upload_part", key=key, part=number)
            resp = c.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data)
            return {"ETag": resp["ETag"], "PartNumber": number}

        try:
            with cf.ThreadPoolExecutor(IN_FLIGHT) as pool:
                pending: deque[cf.Future[dict[str, Any]]] = deque()
                number = 0
                while data := f.read(part_size):
                    number += 1
                    h.update(data)
                    total += len(data)
                    pending.append(pool.submit(send, number, data))
                    if len(pending) >= IN_FLIGHT:
                        parts.append(pending.popleft().result())
                parts.extend(p.result() for p in pending)
            inject("s3.complete", key=key)
            c.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException as e:
            with contextlib.suppress(Exception):  # else the committer aborts what a dead writer leaves
                c.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            if isinstance(e, Exception) and not isinstance(e, PipelineError | RuntimeError):
                raise _failed("multipart upload of", self.url(key), e) from None
            raise
        return total, h.hexdigest()

    def _ranges(self, key: str, size: int, part_size: int) -> Iterator[bytes]:
        """The object's bytes in order, fetched by ranged GETs ``IN_FLIGHT`` at a time."""
        c = client()

        def fetch(start: int) -> bytes:
            inject("s3.get", key=key, start=start)
            end = min(start + part_size, size) - 1
            return bytes(c.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}")["Body"].read())

        starts = iter(range(0, size, part_size))
        with cf.ThreadPoolExecutor(IN_FLIGHT) as pool:
            pending: deque[cf.Future[bytes]] = deque(
                pool.submit(fetch, s) for _, s in zip(range(IN_FLIGHT), starts, strict=False)
            )
            while pending:
                chunk = pending.popleft().result()
                nxt = next(starts, None)
                if nxt is not None:
                    pending.append(pool.submit(fetch, nxt))
                yield chunk

    def download(self, key: str, size: int, dest: Path | None, part_size: int = PART_SIZE) -> tuple[int, str]:
        """Read ``key`` (``size`` bytes expected) by ranged GETs into ``dest`` (or only hash it); returns
        (bytes read, xxh3-128). A short or long object shows as a size different from ``size``."""
        h = xxhash.xxh3_128()
        got = 0
        out = open(dest, "xb") if dest is not None else None  # noqa: SIM115 (closed below)
        try:
            try:
                for chunk in self._ranges(key, max(size, 1), part_size) if size else iter(()):
                    h.update(chunk)
                    got += len(chunk)
                    if out is not None:
                        out.write(chunk)
            except PipelineError:
                raise
            except RuntimeError:
                raise
            except Exception as e:
                code, status = _code(e)
                if status == 416 or code == "InvalidRange":
                    return -1, ""  # shorter than its marker says
                raise _failed("GET", self.url(key), e) from None
        finally:
            if out is not None:
                out.close()
        return got, h.hexdigest()

    # -- multipart housekeeping -------------------------------------------------------------------------------

    def abort_uploads(self, prefix: str, which: Callable[[str], bool] = lambda _key: True) -> list[str]:
        """Abort every incomplete multipart upload under ``prefix`` whose key ``which`` accepts (a dead
        writer's); returns their keys."""
        inject("s3.list", prefix=prefix)
        c = client()
        aborted = []
        try:
            for page in c.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
                for up in page.get("Uploads", []):
                    if not which(up["Key"]):
                        continue
                    c.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    aborted.append(up["Key"])
        except Exception as e:
            raise _failed("abort of incomplete uploads under", self.url(prefix), e) from None
        return aborted

    # -- the server's guarantees ------------------------------------------------------------------------------

    def check_conditional_writes(self, prefix: str) -> None:
        """Refuse (one line) a server that does not enforce ``If-None-Match: *`` and ``If-Match``, also for
        concurrent requests: committing there could let two committers both commit, or ``latest`` go back.
        Asked once per process and endpoint/bucket (the probe costs seconds on a server that serializes them)."""
        asked = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "", self.bucket)
        if asked in _CONDITIONAL_OK:
            return
        key = probe_prefix(prefix) + uuid.uuid4().hex
        why = probe(self, key)
        self.delete([key])
        if why:
            raise StoreError(
                f"s3://{self.bucket}/{prefix}: the server does not enforce conditional writes ({why}); the pipeline "
                "commits only where a second create and a stale compare-and-swap are refused (use a server with "
                "If-None-Match/If-Match support, e.g. AWS S3 or SeaweedFS >= 4)"
            )
        _CONDITIONAL_OK.add(asked)

    def sweep_probes(self, prefix: str, older_than_s: float | None = None) -> list[str]:
        """Delete the probe objects of :meth:`check_conditional_writes` directly under ``prefix`` (the reserved
        :data:`PROBE_NAME`) that are at least ``older_than_s`` old (default :data:`PROBE_STALE_S`): what a launch
        killed between the probe's PUT and its delete left. Returns the deleted keys."""
        age = PROBE_STALE_S if older_than_s is None else older_than_s
        start = probe_prefix(prefix)
        inject("s3.list", prefix=start)
        now = time.time()
        doomed = []
        try:
            for page in client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                for obj in page.get("Contents", []):
                    key = str(obj["Key"])
                    if "/" not in key[len(start) :] and now - obj["LastModified"].timestamp() >= age:
                        doomed.append(key)
        except Exception as e:
            raise _failed("LIST", self.url(start), e) from None
        if doomed:
            self.delete(doomed)
        return doomed


def probe_prefix(prefix: str) -> str:
    """Where the probe objects of the root ``prefix`` are: every key starting with this is one."""
    return f"{prefix.rstrip('/')}/{PROBE_NAME}"
