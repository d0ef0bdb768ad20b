"""Restore from the fastest copy that verifies: one decision, every byte checked, never a loop.

Every node's keeper scans its dir (markers, and each copy's size against its marker; a copy that fails is
quarantined there and then) and reports what it holds; rank 0 picks the newest step at or above the durable tier's
newest that is complete across all ranks from any mix of own copies and replicas, agreeing on one table of hashes
(copies that disagree with the table most holders recorded are quarantined), and hands every rank the plan. Blobs
move holder → rank over the checkpoint group; each rank hashes its blob against the table before it uses it (the
only pass over its bytes before they are copied into the state). A copy that fails is quarantined by its holder and
the decision is made again without it, so the choice falls back copy by copy, step by step, then to the durable
tier (``None``), within the one restart."""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.checkpoint.fast import RESUMED_FILE
from pipeline.checkpoint.fast.local import Copy, digest
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


def plan(reports: list[list[Copy]], world: int, floor: int, excluded: set[tuple[int, Copy]]) -> Plan | None:
    """The newest step >= ``floor`` that every rank can restore from verified copies; None: use the durable
    tier. ``reports[p]``: the copies rank ``p``'s node dir holds (only keepers report)."""
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
            sources = _sources(held, key, world) if n == top else None
            if sources is not None:
                return Plan(step, key[1], sources, tuple(outvoted))
    return None


def _sources(held: list[Held], key: tuple[str, tuple[tuple[int, str], ...]], world: int) -> tuple[Held, ...] | None:
    """One copy per rank with table ``key``: the rank's own node first, then the least used holder."""
    sources: list[Held] = []
    for shard in range(world):
        options = [(h, c) for h, c in held if c.shard == shard and (c.attempt, c.table) == key]
        if not options:
            return None
        options.sort(key=lambda hc: (hc[0] != shard, sum(1 for s in sources if s[0] == hc[0]), hc[0]))
        sources.append(options[0])
    return tuple(sources)


def restore(
    tier: FastTier, floor: int, load: Callable[[memoryview], int], record: Callable[[dict[str, Any]], None]
) -> int | None:
    """Every rank: restore the newest verified fast step >= ``floor`` through ``load(blob)`` (returns the step
    the blob records) and return it, or None (nothing usable: resume from the durable tier). Rank 0 calls
    ``record`` with what was decided and where each rank's bytes came from."""
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
    chosen: Plan | None = None
    step: int | None = None
    for _ in range(1 + sum(len(r[0]) for r in reports)):  # each round excludes a copy: never more rounds
        box = [plan([r[0] for r in reports], world, floor, excluded) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        chosen = box[0]
        if chosen is None:
            break
        for (holder, c), why in chosen.outvoted:
            excluded.add((holder, c))
            noted.append(f"{hosts[holder]}: {c.label}: {why}")
            if holder == rank:
                tier.node.quarantine(tier.node.paths(c)[1], why)
        failure = _fetch_and_check(tier, chosen, load, phases)
        failures: list[Any] = [None] * world
        dist.all_gather_object(failures, failure, group=group)
        if all(f is None for f in failures):
            step = chosen.step
            break
        for f in failures:
            if f is None:
                continue
            holder, c, why = f
            excluded.add((holder, c))
            noted.append(f"{hosts[holder]}: {c.label}: {why}")
            if holder == rank:
                tier.node.quarantine(tier.node.paths(c)[1], why)
    if tier.keeper:
        tier.node.drop_all_but(step)
    if rank == 0:
        _report(chosen if step is not None else None, hosts, noted, time.monotonic() - t0, record, floor, phases)
    return step


def _fetch_and_check(
    tier: FastTier, p: Plan, load: Callable[[memoryview], int], phases: dict[str, float]
) -> tuple[int, Copy, str] | None:
    """Move the blobs holder -> rank, check this rank's against the table, load it; what failed (holder, copy,
    why) or None. ``phases``: rank 0's seconds per phase (move, hash, load), added up over the rounds."""
    t = time.monotonic()
    blob, error = _move(tier, p)
    phases["move"] = phases.get("move", 0.0) + time.monotonic() - t
    t = time.monotonic()
    holder, c = p.sources[tier.rank]
    want = p.table[tier.rank]
    if not error and (blob is None or len(blob) != want[0]):
        error = f"{0 if blob is None else len(blob)} bytes arrived, the step's table says {want[0]}"
    elif not error and digest(blob) != want[1]:  # type: ignore[arg-type]
        error = "its bytes do not match the step's table"
    phases["hash"] = phases.get("hash", 0.0) + time.monotonic() - t
    t = time.monotonic()
    if not error:
        try:
            recorded = load(blob)  # type: ignore[arg-type]
            if recorded != p.step:
                error = f"it records step {recorded}, not {p.step}"
        except Exception as e:  # a blob that verified but does not fit: fall back, as for a damaged one
            error = f"it did not load: {exception_line(e)}"
    phases["load"] = phases.get("load", 0.0) + time.monotonic() - t
    return None if not error else (holder, c, error)


def _move(tier: FastTier, p: Plan) -> tuple[memoryview | None, str]:
    """This rank's blob (read here, or sent by its holder), and why not. The pairs go in one global order, so
    no two ranks wait on each other."""
    blob: memoryview | None = None
    error = "no source"
    for shard, (holder, c) in enumerate(p.sources):
        if holder == shard:
            if tier.rank == shard:
                try:
                    blob, error = memoryview(tier.node.read(c)), ""
                except OSError as e:
                    error = f"unreadable ({e.strerror or e})"
        elif tier.rank == holder:
            _send(tier, c, shard)
        elif tier.rank == shard:
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, holder, group=tier.group)
            if size.item() < 0:
                error = "its holder could not read it"
                continue
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(buf, holder, group=tier.group)
            blob, error = buf.numpy().data.cast("B"), ""  # the received tensor's own buffer, not a copy
    return blob, error


def _send(tier: FastTier, c: Copy, to: int) -> None:
    try:
        data = tier.node.read(c)
    except OSError:
        dist.send(torch.tensor([-1], dtype=torch.int64), to, group=tier.group)
        return
    dist.send(torch.tensor([len(data)], dtype=torch.int64), to, group=tier.group)
    dist.send(torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8), to,
              group=tier.group)  # fmt: skip


def _report(
    p: Plan | None,
    hosts: list[str],
    noted: list[str],
    seconds: float,
    record: Callable[[dict[str, Any]], None],
    floor: int,
    phases: dict[str, float],
) -> None:
    if p is None:
        rec: dict[str, Any] = {"tier": "durable", "fast_problems": noted, "floor": floor}
        if noted:
            log.warning("fast tier: nothing usable (%s); resuming from the durable tier", "; ".join(noted))
        record(rec)
        return
    sources = [
        {"rank": shard, "from": "own copy" if holder == shard and c.kind == "own" else f"{c.kind} on rank {holder}",
         "host": hosts[holder]}
        for shard, (holder, c) in enumerate(p.sources)
    ]  # fmt: skip
    rec = {"tier": "fast", "step": p.step, "sources": sources, "fast_problems": noted, "seconds": round(seconds, 3)}
    record({**rec, "phases_s": {k: round(v, 3) for k, v in phases.items()}})  # rank 0's: scan, move, hash, load
    where = ", ".join(f"rank {s['rank']}: {s['from']} ({s['host']})" for s in sources)
    log.info("resumed from step %d from the fast tier in %.2fs (%s)", p.step, seconds, where)
    for line in noted:
        log.warning("fast tier: quarantined %s", line)
