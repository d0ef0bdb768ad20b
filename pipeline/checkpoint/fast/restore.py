"""Restore from the fastest copy that verifies: one decision, every byte checked, never a loop.

Every node's keeper scans its dir (markers, and each copy's size against its marker; a copy that fails is
quarantined there and then) and reports what it holds; rank 0 picks the newest step at or above the durable tier's
newest that is complete across all ranks from any mix of own copies and replicas, agreeing on one table of hashes
(copies that disagree with the table most holders recorded are quarantined), and hands every rank the plan. A
rank's pieces that its own node holds (its own copy, or objects its node-mates share) are mapped from their files
and loaded as they lie; only the others move, holder → rank over the checkpoint group, straight into the
state's tensors where the durable tier has a step to overwrite them (:mod:`.landing`). Each rank hashes every
piece against its copy's list (whose digest is the table's) before it uses any (the only pass over the bytes
before they are copied into the state, or where they landed). A copy that fails is quarantined by its holder (a
damaged object by a rank of its node) and the decision is made again without it, so the choice falls back copy by
copy, step by step, then to the durable tier (``None``), within the one restart."""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.checkpoint.fast import RESUMED_FILE
from pipeline.checkpoint.fast.codec import Scattered, over
from pipeline.checkpoint.fast.landing import Landing
from pipeline.checkpoint.fast.local import Copy
from pipeline.checkpoint.fast.pieces import digest, objects, offsets
from pipeline.checkpoint.fast.prefault import Prefault
from pipeline.checkpoint.fast.tier import FastTier
from pipeline.errors import exception_line

log = logging.getLogger(__name__)

__all__ = ["RESUMED_FILE", "Plan", "plan", "restore"]

Held = tuple[int, Copy]
"""A copy and the rank (this launch's) whose node holds it."""


@dataclass(frozen=True)
class Plan:
    step: int
    table: tuple[tuple[int, str], ...]
    sources: tuple[Held, ...]
    """Index ``K``: where rank ``K``'s blob comes from."""
    outvoted: tuple[tuple[Held, str], ...] = ()


def plan(
    reports: list[list[Copy]],
    world: int,
    floor: int,
    excluded: set[tuple[int, Copy]],
    nodes: Sequence[str] | None = None,
) -> Plan | None:
    """The newest step >= ``floor`` that every rank can restore from verified copies; None: use the durable
    tier. ``reports[p]``: the copies rank ``p``'s node dir holds (only keepers report); ``nodes[p]``: rank
    ``p``'s node (default: one rank a node)."""
    by_step: dict[int, list[Held]] = {}
    for holder, copies in enumerate(reports):
        for c in copies:
            if c.world_size == world and c.step >= max(floor, 1) and (holder, c) not in excluded:
                by_step.setdefault(c.step, []).append((holder, c))
    outvoted: list[tuple[Held, str]] = []
    for step in sorted(by_step, reverse=True):
        held = by_step[step]
        votes = Counter((c.attempt, c.table) for _, c in held).most_common()
        top = votes[0][1]
        for key, n in votes:
            if n < top:  # fewer holders recorded this table than another: a stale or rebuilt copy
                why = f"its step {step} table disagrees with the one {top} other holder(s) recorded"
                outvoted += [((h, c), why) for h, c in held if (c.attempt, c.table) == key]
        for key, n in votes:
            sources = _sources(held, key, world, nodes or [str(r) for r in range(world)]) if n == top else None
            if sources is not None:
                return Plan(step, key[1], sources, tuple(outvoted))
    return None


def _sources(
    held: list[Held], key: tuple[str, tuple[tuple[int, str], ...]], world: int, nodes: Sequence[str]
) -> tuple[Held, ...] | None:
    """One copy per rank with table ``key``: one on the rank's own node first (it maps it, nothing moves), then
    the least used holder."""
    sources: list[Held] = []
    for shard in range(world):
        options = [(h, c) for h, c in held if c.shard == shard and (c.attempt, c.table) == key]
        if not options:
            return None
        options.sort(key=lambda hc: (nodes[hc[0]] != nodes[shard], sum(1 for s in sources if s[0] == hc[0]), hc[0]))
        sources.append(options[0])
    return tuple(sources)


def restore(tier: FastTier, floor: int, landing: Landing, record: Callable[[dict[str, Any]], None]) -> int | None:
    """Every rank: restore the newest verified fast step >= ``floor`` into ``landing`` (its ``load(blob)`` returns
    the step the blob records) and return it, or None (nothing usable: resume from the durable tier). Bytes that
    arrive over the link land in the state's tensors where the durable tier has a step (``floor`` >= 1) to
    overwrite them should they fail. Rank 0 calls ``record`` with what was decided and where each rank's bytes
    came from."""
    t0 = time.monotonic()
    phases: dict[str, float] = {}
    rank, world, group = tier.rank, tier.world, tier.group
    mine: list[Copy] = []
    quarantined: list[str] = []
    if tier.keeper:
        mine, bad = tier.node.scan()
        for marker, why in bad:
            tier.node.quarantine(marker, why)
            quarantined.append(f"{socket.gethostname()}:{marker}: {why}")
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, (mine, socket.gethostname(), quarantined), group=group)
    phases["scan"] = time.monotonic() - t0
    hosts = [r[1] for r in reports]
    noted = [q for r in reports for q in r[2]]
    excluded: set[Held] = set()
    landed, ranks = [0] * world, [phases] * world
    chosen: Plan | None = None
    step: int | None = None
    named = {h for r in reports for c in r[0] for h in objects(c.parts)}
    for _ in range(1 + sum(len(r[0]) for r in reports) + len(named)):  # a round excludes a copy or an object
        box = [plan([r[0] for r in reports], world, floor, excluded, tier.node_ids) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        chosen = box[0]
        if chosen is None:
            break
        for (holder, c), why in chosen.outvoted:
            excluded.add((holder, c))
            noted.append(f"{hosts[holder]}: {c.label}: {why}")
            if holder == rank:
                tier.node.quarantine(tier.node.paths(c)[1], why)
        failure = _fetch_and_check(tier, chosen, landing, floor >= 1, phases)
        phases["template"] = landing.seconds
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (failure, landing.landed, phases), group=group)
        failures, landed, ranks = [g[0] for g in gathered], [g[1] for g in gathered], [g[2] for g in gathered]
        if all(f is None for f in failures):
            step = chosen.step
            break
        _set_aside(tier, failures, hosts, noted, excluded)
    if step is None:
        landing.discard()
    if tier.keeper:
        tier.node.drop_all_but(step)
    if rank == 0:
        _report(chosen if step is not None else None, hosts, noted, time.monotonic() - t0, record, floor,
                tier.node_ids, landed, ranks)  # fmt: skip
    return step


def _set_aside(tier: FastTier, failures: list[Any], hosts: list[str], noted: list[str], excluded: set[Held]) -> None:
    """Every rank alike: the copies that failed are excluded from the next decision (their holders quarantine
    them), and damaged objects are quarantined by a rank of their node."""
    for f in failures:
        if f is None:
            continue
        holder, c, why, blame, bad = f
        if bad is not None:  # (rank, hash): an object on that rank's node whose bytes are not its name's
            noted.append(f"{hosts[bad[0]]}: object {bad[1]}: its bytes do not match its name")
            if bad[0] == tier.rank:
                tier.node.quarantine_object(bad[1], "its bytes do not match its name")
        if blame:
            excluded.add((holder, c))
            noted.append(f"{hosts[holder]}: {c.label}: {why}")
            if holder == tier.rank:
                tier.node.quarantine(tier.node.paths(c)[1], why)


Failure = tuple[int, Copy, str, bool, tuple[int, str] | None]
"""What failed: the holder and its copy, why, whether the copy is to blame (else only an object of this rank's
node, which is quarantined and fetched from the holder next round), and the damaged object (its node's rank,
its hash)."""


def _fetch_and_check(
    tier: FastTier, p: Plan, landing: Landing, in_place: bool, phases: dict[str, float]
) -> Failure | None:
    """Move the pieces holder -> rank (``in_place``: into the state's tensors where they fit), check this rank's
    blob piece by piece against its copy's list (whose digest is the table's), load it; what failed or None.
    ``phases``: rank 0's seconds per phase (template, move, hash, load), added up over the rounds."""
    sends: list[tuple[Any, torch.Tensor]] = []
    ahead: list[Prefault] = []
    try:
        return _check_and_load(tier, p, landing, in_place, phases, sends, ahead)
    finally:  # what this rank serves goes on while it checks and loads its own; done before the next collective
        for work, _ in sends:
            work.wait()
        for pf in ahead:
            pf.stop()


def _check_and_load(
    tier: FastTier,
    p: Plan,
    landing: Landing,
    in_place: bool,
    phases: dict[str, float],
    sends: list[tuple[Any, torch.Tensor]],
    ahead: list[Prefault],
) -> Failure | None:
    t = time.monotonic()
    blob, local, error = _move(tier, p, landing, in_place, sends, ahead)
    phases["move"] = phases.get("move", 0.0) + time.monotonic() - t
    t = time.monotonic()
    holder, c = p.sources[tier.rank]
    want = p.table[tier.rank]
    if not error and (blob is None or blob.size != want[0] or (c.size, c.hash) != want):
        error = f"{0 if blob is None else blob.size} bytes arrived, the step's table says {want[0]}"
    elif not error and blob is not None:
        for i, ((_, h, obj), view) in enumerate(zip(c.parts, blob.views, strict=True)):
            if digest(view) == h:
                continue
            phases["hash"] = phases.get("hash", 0.0) + time.monotonic() - t
            why = "its bytes do not match the step's table"
            if obj and local[i] and holder != tier.rank:  # this node's object, not the holder's copy
                return holder, c, why, False, (tier.rank, h)
            return holder, c, why, True, ((holder, h) if obj else None)
    phases["hash"] = phases.get("hash", 0.0) + time.monotonic() - t
    t = time.monotonic()
    if not error:
        try:
            recorded = landing.load(blob)  # type: ignore[arg-type]
            if recorded != p.step:
                error = f"it records step {recorded}, not {p.step}"
        except Exception as e:  # a blob that verified but does not fit: fall back, as for a damaged one
            error = f"it did not load: {exception_line(e)}"
    phases["load"] = phases.get("load", 0.0) + time.monotonic() - t
    return None if not error else (holder, c, error, True, None)


def _move(
    tier: FastTier,
    p: Plan,
    landing: Landing,
    in_place: bool,
    sends: list[tuple[Any, torch.Tensor]],
    ahead: list[Prefault],
) -> tuple[Scattered | None, list[bool], str]:
    """This rank's blob as pieces: those its node holds mapped from their files (no copy), the others sent by
    the copy's holder (``in_place``: into ``landing``'s tensors where they fit); which pieces are this node's,
    and why there is no blob. The transfers go first, in one global order (no two ranks wait on each other, and
    no holder makes a peer wait while it reads its own). What this rank serves is sent in the background
    (``sends``: each send and the bytes it reads), mapped from the same files as its own pieces. The pages about
    to be read or written are faulted in ahead of their use (``ahead``: stopped once the pieces are loaded)."""
    received: dict[int, memoryview] = {}
    maps: dict[str, memoryview] = {}  # an object's hash -> its mapping, made once a restore round
    local: list[bool] = []
    error = ""
    ids = tier.node_ids
    for shard, (holder, c) in enumerate(p.sources):
        if ids[holder] == ids[shard]:  # a copy in the rank's own node dir: it maps every piece itself
            continue
        if tier.rank == holder:
            _serve(tier, c, shard, sends, maps, ahead)
        elif tier.rank == shard:
            local = [obj and tier.node.has_object(h, n) for n, h, obj in c.parts]
            received, error = _receive(tier, c, local, holder, landing if in_place else None)
    holder, c = p.sources[tier.rank]
    if ids[holder] == ids[tier.rank]:
        local = [True] * len(c.parts)
    if error:
        return None, local, error
    try:
        views = tuple(_mapped(tier, c, i, maps) if local[i] else received[i] for i in range(len(c.parts)))
    except OSError as e:
        return None, local, f"unreadable ({e.strerror or e})"
    if any(local):  # read next: hashed, then copied into the state, whose fresh memory is faulted in meanwhile
        queued = {id(v) for pf in ahead for v in pf.regions}  # what it serves from the same files (DDP: all)
        ahead.append(Prefault([v for v, here in zip(views, local, strict=True) if here and id(v) not in queued],
                              write=False))  # fmt: skip
        if digest(views[0]) == c.parts[0][1]:
            ahead.append(Prefault([t for _, t in sorted(_places(landing, views[0]).items())]))
    return Scattered(tuple(offsets(c.parts)), views, c.size), local, ""


def _places(landing: Landing, head: memoryview) -> dict[int, torch.Tensor]:
    """``landing.places(head)``; {} where the template cannot be built (the load then says why)."""
    try:
        return landing.places(head)
    except Exception as e:
        log.debug("no template for the blob: %s", exception_line(e))
        return {}


def _receive(
    tier: FastTier, c: Copy, local: list[bool], holder: int, landing: Landing | None
) -> tuple[dict[int, memoryview], str]:
    """The pieces of ``c`` that are not ``local``, from ``holder`` (which answers first whether it could read
    them). The first piece (the header: always inline, so always sent) comes first; once it matches its hash,
    each piece that ``landing`` has a tensor for lands in that tensor's bytes, the rest in one buffer."""
    dist.send(torch.tensor([not x for x in local], dtype=torch.uint8), holder, group=tier.group)
    ok = torch.empty(1, dtype=torch.int64)
    dist.recv(ok, holder, group=tier.group)
    if ok.item() < 0:
        return {}, "its holder could not read it"
    head = torch.empty(c.parts[0][0], dtype=torch.uint8)
    dist.recv(head, holder, group=tier.group, tag=1)
    out = {0: head.numpy().data.cast("B")}
    places = _places(landing, out[0]) if landing is not None and digest(out[0]) == c.parts[0][1] else {}
    starts = offsets(c.parts)
    into = {i: places[starts[i]] for i, (n, _, _) in enumerate(c.parts) if i and not local[i]
            and starts[i] in places and places[starts[i]].numel() == n}  # fmt: skip
    rest = sum(n for i, (n, _, _) in enumerate(c.parts) if i and not local[i] and i not in into)
    buf = torch.empty(rest, dtype=torch.uint8)  # its views are what arrives there: no copy
    dest, at = {}, 0
    for i, (n, _, _) in enumerate(c.parts):
        if i and not local[i]:
            dest[i] = into[i] if i in into else buf[at : at + n]
            at += 0 if i in into else n
    ahead = Prefault(list(dest.values()))  # in the order the pieces arrive
    try:
        works = [dist.irecv(t, holder, group=tier.group, tag=1 + i) for i, t in dest.items()]
        out.update({i: t.numpy().data.cast("B") for i, t in dest.items()})
        if landing is not None and into:
            landing.landed += sum(t.numel() for t in into.values())
        for work in works:
            if work is not None:
                work.wait()
    finally:
        ahead.stop()
    return out, ""


def _mapped(tier: FastTier, c: Copy, i: int, maps: dict[str, memoryview]) -> memoryview:
    """Piece ``i`` of ``c`` mapped from its file; an object mapped once a round (a node's copies share them)."""
    n, h, obj = c.parts[i]
    if not obj:
        return tier.node.piece(c, i)
    if h not in maps:
        maps[h] = tier.node.piece(c, i)
    return maps[h]


def _serve(
    tier: FastTier,
    c: Copy,
    to: int,
    sends: list[tuple[Any, torch.Tensor]],
    maps: dict[str, memoryview],
    ahead: list[Prefault],
) -> None:
    """The pieces of a copy held here that rank ``to`` asks for, each sent from the file it lies in, in the
    background (``sends``), its pages mapped in ahead of the sends (``ahead``)."""
    asked = torch.empty(len(c.parts), dtype=torch.uint8)
    dist.recv(asked, to, group=tier.group)
    try:
        pieces = {i: _mapped(tier, c, i, maps) for i, a in enumerate(asked.tolist()) if a}
    except OSError:
        dist.send(torch.tensor([-1], dtype=torch.int64), to, group=tier.group)
        return
    dist.send(torch.tensor([0], dtype=torch.int64), to, group=tier.group)
    ahead.append(Prefault(list(pieces.values()), write=False))
    for i, piece in pieces.items():
        data = over(piece)  # a read-only mapping: gloo only reads what it sends
        work = dist.isend(data, to, group=tier.group, tag=1 + i)
        if work is not None:
            sends.append((work, data))


def _report(
    p: Plan | None,
    hosts: list[str],
    noted: list[str],
    seconds: float,
    record: Callable[[dict[str, Any]], None],
    floor: int,
    nodes: Sequence[str],
    landed: list[int],
    ranks: list[dict[str, float]],
) -> None:
    """``landed[K]``: the bytes rank ``K`` received straight into its state (every round); ``ranks[K]``: its
    seconds per phase."""
    if p is None:
        rec: dict[str, Any] = {"tier": "durable", "fast_problems": noted, "floor": floor, "landed_bytes": landed}
        if noted:
            log.warning("fast tier: nothing usable (%s); resuming from the durable tier", "; ".join(noted))
        record(rec)
        return
    sources = [
        {"rank": shard, "from": "own copy" if nodes[holder] == nodes[shard] and c.kind == "own"
         else f"{c.kind} on rank {holder}", "host": hosts[holder]}
        for shard, (holder, c) in enumerate(p.sources)
    ]  # fmt: skip
    rec = {"tier": "fast", "step": p.step, "sources": sources, "fast_problems": noted, "seconds": round(seconds, 3),
           "landed_bytes": landed}  # fmt: skip
    per_rank = [{k: round(v, 3) for k, v in r.items()} for r in ranks]
    record({**rec, "phases_s": per_rank[0], "rank_phases_s": per_rank})  # scan, template, move, hash, load
    where = ", ".join(f"rank {s['rank']}: {s['from']} ({s['host']})" for s in sources)
    log.info("resumed from step %d from the fast tier in %.2fs (%s)", p.step, seconds, where)
    for line in noted:
        log.warning("fast tier: quarantined %s", line)
