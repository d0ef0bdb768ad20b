"""``python -m pipeline.status`` for a run whose checkpoints live in a bucket: the same view, read from there.

Committed steps are the steps whose manifest object exists (each read and parsed; a listing only nominates),
``latest`` is checked against its manifest's hash, staged steps are attempts without a manifest (with how many
marker objects each has), and quarantine entries come with their ``reason.txt``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.checkpoint.stores.remote import QUARANTINE, Remote, digest, is_marker_name
from pipeline.errors import PipelineError
from pipeline.formats.dcp_names import is_piece
from pipeline.storage.layout import parse_step

Status = dict[str, Any]


def remote_checkpoints(remote: Remote) -> Status:
    """The bucket's checkpoints as :func:`pipeline.driver.run_status.collect` shows a run dir's."""
    out: Status = {"store": str(remote.root), "latest": None, "latest_error": None, "committed": [], "staged": []}
    try:
        listing = remote.store.listing(remote.root.prefix + "/")
    except PipelineError as e:  # an empty view would pass for a bucket without checkpoints: status exits 1
        out["latest_error"] = out["unreadable"] = f"cannot list {remote.root}: {e}"
        out["quarantined"] = []
        return out
    try:
        found = remote.verified_latest()
        if found is not None:
            out["latest"] = {"step": found[0].step, "manifest_hash": digest(found[1])}
    except PipelineError as e:
        out["latest_error"] = str(e)
    latest_step = out["latest"]["step"] if out["latest"] else None
    by_step: dict[int, dict[str, list[str]]] = {}
    for key in listing:
        name, _, rest = key[len(remote.root.prefix) + 1 :].partition("/")
        step = parse_step(name)
        if step is not None:
            attempt, _, leaf = rest.partition("/")
            by_step.setdefault(step, {}).setdefault(attempt, []).append(leaf)
    for step, attempts in sorted(by_step.items()):
        manifest_info = listing.get(remote.manifest_key(step))
        if manifest_info is not None and not manifest_info.size:  # taken back by its writer: commits nothing
            attempts.pop("manifest.json", None)
        if "manifest.json" in attempts:
            entry: Status = {"step": step, "latest": step == latest_step}
            try:
                manifest = remote.read_manifest(step)
                if manifest is None:
                    raise PipelineError("manifest vanished while listing")
                m = manifest[0]
                entry.update(files=len(m.files), bytes=sum(f.size for f in m.files), format=m.format)
                entry["world_size"] = m.world_size
                entry["pieces"] = {e.hash: e.size for e in m.files if is_piece(e.path)}
                if m.metrics:
                    entry["metrics"] = m.metrics
            except PipelineError as e:
                entry["error"] = str(e)
            out["committed"].append(entry)
            continue
        for attempt, leaves in sorted(attempts.items()):
            markers = sum(1 for leaf in leaves if is_marker_name(leaf))
            out["staged"].append({"step": step, "attempt": attempt, "markers": markers, "world_size": None})
    out["shared_saved"] = add_sharing(out["committed"])
    out["quarantined"] = _quarantined(remote, listing)
    return out


def _quarantined(remote: Remote, listing: dict[str, Any]) -> list[Status]:
    base = remote.key(QUARANTINE) + "/"
    names = sorted({k[len(base) :].split("/", 1)[0] for k in listing if k.startswith(base)})
    out = []
    for name in names:
        entry: Status = {"name": name, "path": remote.url(base + name)}
        step = name.split("-", 1)[0]
        entry["step"] = parse_step(step)
        try:
            got = remote.store.get(base + name + "/reason.txt")
            entry["reason"] = got[0].decode("utf-8", "replace").strip() if got else "no reason.txt"
        except PipelineError as e:
            entry["error"] = str(e)
        out.append(entry)
    return out


def add_sharing(committed: list[Status]) -> int:
    """Give each committed step its ``shared_files``/``shared_bytes`` (pieces another committed step holds too)
    from its ``pieces`` (identities, dropped here); returns the bytes stored once instead of once per step."""
    per_step, saved = sharing({c["step"]: own for c in committed if (own := c.pop("pieces", None))})
    for c in committed:
        if c["step"] in per_step:
            c["shared_files"], c["shared_bytes"] = per_step[c["step"]]
    return saved


def sharing(pieces_of: Mapping[int, Mapping[Any, int]]) -> tuple[dict[int, tuple[int, int]], int]:
    """From each step's pieces (an identity: an inode, a content key -> size): per step, how many of its pieces
    another listed step shares and their bytes; and the bytes stored once instead of once per step."""
    holders: dict[Any, int] = {}
    for own in pieces_of.values():
        for key in own:
            holders[key] = holders.get(key, 0) + 1
    per_step = {
        step: (sum(1 for k in own if holders[k] > 1), sum(n for k, n in own.items() if holders[k] > 1))
        for step, own in pieces_of.items()
    }
    sizes = {k: n for own in pieces_of.values() for k, n in own.items()}
    return per_step, sum(sizes[k] * (count - 1) for k, count in holders.items())
