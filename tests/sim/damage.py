"""Damage a schedule does to a simulated world (a disk's or an operator's doing, never the protocol's), and the
looks the invariants take at copies of steps: which attempt a committed step is, what sits in quarantine.

Damage is positive evidence: bytes that stay wrong. It hits one of

* a committed step's data file (a byte flipped), its manifest, or a rank's marker (staged or committed);
* ``latest``; a lease record; a trash record (a bucket's ``trash/*.json``; a directory's trash entry's manifest);

each overwritten in place with wrong bytes: garbage (no JSON), or JSON whose content is wrong (a hash changed).
Every copy it hits (a step and an attempt) is recorded; ``latest`` and lease records damaged are remembered by their
bytes, so an invariant can tell whether the damage is still there.

Everything here reads the world raw (never through the processes' faulty views): it runs in the scheduler.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from pipeline.checkpoint.manifest import MANIFEST, TRASH
from pipeline.checkpoint.protocol.ownership import LEASE
from pipeline.checkpoint.stores.repair import QUARANTINE_NOTE
from pipeline.storage.layout import parse_step

if TYPE_CHECKING:
    from tests.sim.world import World

Copy = tuple[int, str]
"""A copy of a step: its number and the attempt that saved it."""
ROOT = "runs/r1"
TARGETS = ("data", "manifest", "marker", "latest", "lease", "trash")
WEIGHTS = {"data": 4, "manifest": 2, "marker": 2, "latest": 1, "lease": 1, "trash": 1}
"""How often each target is drawn, relative to the others (where it exists)."""


def _objs(w: World) -> dict[str, tuple[bytes, str]]:
    return w.bucket.objects.setdefault("sim", {})


def _attempt(raw: bytes | None) -> str | None:
    try:
        obj = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    attempt = obj.get("attempt") if isinstance(obj, dict) else None
    return attempt if isinstance(attempt, str) else None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def copy_at(w: World, step: int) -> Copy | None:
    """The copy committed at ``step`` now (its manifest's attempt, else its markers'; a manifest this module damaged:
    the copy it was), or None."""
    if w.remote is not None:
        key = f"{ROOT}/step_{step}/{MANIFEST}"
        got = _objs(w).get(key)
        found = w.garbled.get(key) if got is not None and got[0] == w.garbled_bytes.get(key) else None
        attempt = _attempt(got[0]) if got is not None else None
        return found or ((step, attempt) if attempt else None)
    d = w.layout.committed_step(step)
    path = str(d / MANIFEST)
    raw = _read(d / MANIFEST)
    if raw is not None and raw == w.garbled_bytes.get(path):
        return w.garbled[path]
    attempt = _attempt(raw) or _attempt(_read(d / "rank_0.done.json"))
    return (step, attempt) if attempt else None


# -- what can be damaged now ---------------------------------------------------------------------------------------


def targets(w: World, kind: str) -> list[Any]:
    """Where damage of ``kind`` can land now (empty: nowhere; or ``SIM_SKIP`` names ``damage-<kind>``)."""
    if f"damage-{kind}" in os.environ.get("SIM_SKIP", ""):
        return []
    if kind == "data":
        return list(w.ok_steps())
    if kind == "manifest":
        return [s for s in w.present() if copy_at(w, s) is not None]
    return _bucket_targets(w, kind) if w.remote is not None else _posix_targets(w, kind)


def _bucket_targets(w: World, kind: str) -> list[Any]:
    keys = sorted(_objs(w))
    if kind == "marker":
        return [k for k in keys if k.endswith(".done.json") and parse_step(k.split("/")[2]) is not None]
    if kind == "latest":
        return [k for k in keys if k == f"{ROOT}/latest"]
    if kind == "lease":
        return [k for k in keys if k.startswith(f"{ROOT}/{LEASE}/")]
    if kind == "trash":
        return [k for k in keys if k.startswith(f"{ROOT}/trash/") and k.endswith(".json")]
    return []


def _posix_targets(w: World, kind: str) -> list[Any]:
    ck = w.layout.checkpoints
    if kind == "marker":
        found = []
        for area in (w.layout.staging, ck):
            for d in sorted(area.glob("step_*")):
                found += sorted(str(p) for p in d.glob("rank_*.done.json"))
        return found
    if kind == "latest":
        return [str(w.layout.latest)] if w.layout.latest.is_file() else []
    if kind == "lease":
        return sorted(str(p) for p in (ck / LEASE).glob("*") if p.is_file() and ".tmp-" not in p.name)
    if kind == "trash":
        return sorted(str(p / MANIFEST) for p in (ck / TRASH).glob("step_*") if (p / MANIFEST).is_file())
    return []


# -- damage -------------------------------------------------------------------------------------------------------


def wrong(raw: bytes, garbage: bool) -> bytes:
    """``raw`` made wrong: cut into garbage, or (JSON) a recorded hash changed, else a byte flipped."""
    if not garbage:
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            files = obj.get("files")
            first = files[0] if isinstance(files, list) and files else None
            if isinstance(first, dict) and isinstance(first.get("hash"), str):
                h = first["hash"]
                first["hash"] = ("0" if h[:1] != "0" else "1") + h[1:]
                return json.dumps(obj, sort_keys=True).encode()
            if isinstance(obj.get("manifest_hash"), str):
                h = obj["manifest_hash"]
                obj["manifest_hash"] = ("0" if h[:1] != "0" else "1") + h[1:]
                return json.dumps(obj, sort_keys=True).encode()
    cut = raw[: max(1, len(raw) // 3)]
    return cut + b"\x00garbage" if cut == raw else cut


def damage(w: World, kind: str, where: Any, garbage: bool) -> str:
    """Damage ``where`` (one of :func:`targets`); returns what was done. Records the copy hit (``w.damaged``) or, for
    ``latest`` and a lease record, the bytes written (``w.garbled_bytes``)."""
    if kind == "data":
        w.damage(where)
        return f"data of step {where}"
    if kind == "manifest":
        copy = copy_at(w, where)
        d = w.layout.committed_step(where)
        where = f"{ROOT}/step_{where}/{MANIFEST}" if w.remote is not None else str(d / MANIFEST)
    elif kind in ("marker", "trash"):
        copy = _copy_of_record(w, where)
    else:
        copy = None
    raw = _objs(w)[where][0] if w.remote is not None else Path(where).read_bytes()
    bad = wrong(raw, garbage or kind == "lease")
    if w.remote is not None:
        objs = _objs(w)
        objs[where] = (bad, objs[where][1] + "x")
    else:
        Path(where).write_bytes(bad)  # in place: the same inode, a new mtime (its checks look again)
    w.garbled_bytes[where] = bad
    if copy is not None:
        w.garbled[where] = copy
        w.damaged_copies.add(copy)
    w.touched()
    what = "garbage" if bad[:1] != b"{" or bad[-1:] != b"}" else "a wrong hash"
    shown = where.replace(str(w.layout.checkpoints), "").replace(ROOT, "")
    return f"{kind} {shown} ({what}{f', copy {copy[0]}/{copy[1]}' if copy else ''})"


def _copy_of_record(w: World, where: str) -> Copy | None:
    """The copy a marker or a trash record belongs to (its step and attempt)."""
    raw = _objs(w)[where][0] if w.remote is not None else _read(Path(where))
    try:
        obj = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(obj, dict) or type(obj.get("step")) is not int or not isinstance(obj.get("attempt"), str):
        return None
    return obj["step"], obj["attempt"]


# -- quarantine ---------------------------------------------------------------------------------------------------


def quarantined(w: World) -> list[tuple[Copy, bool, str]]:
    """Each whole copy in quarantine (every rank's marker of one attempt): the copy, whether its files match its
    markers, and where it is with the reason it went there."""
    out: list[tuple[Copy, bool, str]] = []
    for where, files, reason in _entries(w):
        markers: dict[str, dict[int, dict[str, Any]]] = {}
        for name, raw in files.items():
            if raw is not None and name.startswith("rank_") and name.endswith(".done.json"):
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("attempt"), str) and type(obj.get("rank")) is int:
                    markers.setdefault(obj["attempt"], {})[obj["rank"]] = obj
        for attempt, ranks in markers.items():
            world = next(iter(ranks.values())).get("world_size")
            if type(world) is not int or set(ranks) != set(range(world)):
                continue
            step = next(iter(ranks.values())).get("step")
            good = all(_matches(files.get(e.get("path")), e) for m in ranks.values() for e in m.get("files", []))
            out.append(((step, attempt), good, f"{where}: {reason}"))
    return out


def _matches(raw: bytes | None, entry: Any) -> bool:
    return (
        raw is not None and isinstance(entry, dict) and len(raw) == entry.get("size")
        and xxhash.xxh3_128(raw).hexdigest() == entry.get("hash")
    )  # fmt: skip


def _entries(w: World) -> list[tuple[str, dict[str, bytes | None], str]]:
    """(where, {file name: bytes}, reason) of each quarantine entry."""
    out: list[tuple[str, dict[str, bytes | None], str]] = []
    if w.remote is not None:
        by: dict[str, dict[str, bytes | None]] = {}
        top = f"{ROOT}/quarantine/"
        for key, (data, _) in _objs(w).items():
            if key.startswith(top) and "/" in key[len(top) :]:
                entry, name = key[len(top) :].split("/", 1)
                by.setdefault(entry, {})[name] = data
        for entry, files in sorted(by.items()):
            reason = (files.get("reason.txt") or b"").decode(errors="replace").split("\n", 1)[0]
            out.append((f"quarantine/{entry}", files, reason[:300]))
        return out
    q = w.layout.quarantine
    if not q.is_dir():
        return out
    for d in sorted(q.iterdir()):
        if not d.is_dir() or d.is_symlink():
            continue
        files = {p.name: _read(p) for p in d.iterdir() if p.is_file()}
        note = files.get(QUARANTINE_NOTE) or b""
        try:
            reason = str(json.loads(note).get("reason", ""))
        except (ValueError, AttributeError):
            reason = note.decode(errors="replace")
        out.append((f"quarantine/{d.name}", files, reason[:300]))
    return out


def lease_garbled(w: World) -> bool:
    """A lease record still holds the bytes damage wrote there."""
    if w.remote is not None:
        objs = _objs(w)
        return any(k in objs and objs[k][0] == b for k, b in w.garbled_bytes.items() if f"/{LEASE}/" in k)
    return any(_read(Path(k)) == b for k, b in w.garbled_bytes.items() if f"{os.sep}{LEASE}{os.sep}" in k)


def latest_garbled(w: World) -> bool:
    """``latest`` still holds the bytes damage wrote there."""
    if w.remote is not None:
        key = f"{ROOT}/latest"
        got = _objs(w).get(key)
        return got is not None and got[0] == w.garbled_bytes.get(key)
    path = str(w.layout.latest)
    return path in w.garbled_bytes and _read(w.layout.latest) == w.garbled_bytes[path]
