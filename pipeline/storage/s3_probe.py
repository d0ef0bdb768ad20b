"""The object store's errors, and the conditional-write probe of a bucket
(:meth:`pipeline.storage.s3.S3Store.check_conditional_writes`): a second ``If-None-Match: *`` create and a stale
``If-Match`` must be refused, also under concurrent requests, or the protocol's commit point and ``latest``'s
compare-and-swap hold nothing."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Protocol

from pipeline.errors import PipelineError, ReadFailed


class StoreError(PipelineError):
    """An object-store request failed (after the client's retries), or the server cannot be committed to."""


class StoreReadFailed(StoreError, ReadFailed):
    """A GET, HEAD or LIST that failed after the client's retries (a 5xx, a timeout, no connection): what the
    object holds is unknown, never damage (:mod:`pipeline.storage.reads`)."""


class Conflict(StoreError):
    """A conditional write lost: the key exists (``If-None-Match``) or changed (``If-Match``)."""


class S3Store(Protocol):
    """What the probe asks of :class:`pipeline.storage.s3.S3Store`."""

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str: ...
    def delete(self, keys: list[str]) -> None: ...


def probe(store: S3Store, key: str) -> str:
    """Why the server at ``store`` cannot be trusted with the protocol's conditional writes ("": it can), probed
    on ``key`` (a reserved probe name, deleted by the caller)."""
    try:
        first = store.put(key, b"0", if_none_match=True)
    except Conflict:
        return "a create of a new key was refused"
    try:
        store.put(key, b"1", if_none_match=True)
        return "a second If-None-Match: * create of one key succeeded"
    except Conflict:
        pass
    second = store.put(key, b"2", if_match=first)
    try:
        store.put(key, b"3", if_match=first)
        return "an If-Match write with a stale ETag succeeded"
    except Conflict:
        pass
    with cf.ThreadPoolExecutor(8) as pool:
        swaps = sum(pool.map(lambda i: _try(store, key, i, second), range(8)))
        creates = sum(pool.map(lambda i: _try(store, key + ".new", i, None), range(8)))
    store.delete([key + ".new"])
    if swaps != 1:
        return f"{swaps} of 8 concurrent If-Match writes with one ETag succeeded"
    if creates != 1:
        return f"{creates} of 8 concurrent If-None-Match: * creates of one key succeeded"
    return ""


def _try(store: S3Store, key: str, i: int, etag: str | None) -> bool:
    try:
        if etag is None:
            store.put(key, f"r{i}".encode(), if_none_match=True)
        else:
            store.put(key, f"r{i}".encode(), if_match=etag)
        return True
    except Conflict:
        return False
