"""Who writes which object of a fast save, and which pieces a replica's holder asks its source for: decided by
every rank alike from the step's gathered piece lists (:mod:`.pieces`), so no two ranks of a node write one
object and no byte a node already holds crosses the link.

A node's object is written by the lowest of its ranks whose own blob holds it; a replica's holder asks its
source for the copy's inline pieces and for each object no rank of its node holds, the lowest holder of the
node that needs it asking (a node that already has it from an earlier step is asked nothing: the holder checks
its ``objects/`` before it asks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.checkpoint.fast.pieces import Part, inline_size


@dataclass
class NodePlan:
    writes: set[str] = field(default_factory=set)
    """The objects of this rank's own blob that it writes (it is its node's lowest rank holding them)."""
    asks: dict[int, list[bool]] = field(default_factory=dict)
    """Per replica source: for each of its pieces, whether this rank asks for it."""
    protect: set[str] = field(default_factory=set)
    """Every object this step's copies on the node name (the keeper never removes them while it is saved)."""


Parts = Sequence[Sequence[Part]] | Mapping[int, Sequence[Part]]
"""Piece lists by rank: every rank's, or those of the ranks a rank needs (:func:`needs`)."""


def needs(rank: int, ids: Sequence[str], offset: int, replicas: int) -> set[int]:
    """The ranks whose piece lists ``rank`` needs to plan its node's part of a save (:func:`node_plan`,
    :func:`node_bytes`): its node's ranks and the ranks they hold replicas of. A save exchanges only these, so
    what a rank receives grows with its node's size, not with the world's."""
    world = len(ids)
    node = _node(rank, ids)
    return {*node, *(src for q in node for _, src in pairs(q, world, offset, replicas))}


def feeds(rank: int, ids: Sequence[str], offset: int, replicas: int) -> set[int]:
    """The ranks that need ``rank``'s piece list (``rank`` in their :func:`needs`): its node's ranks and the
    ranks of the nodes that hold its replicas."""
    world = len(ids)
    dests = {ids[dst] for dst, _ in pairs(rank, world, offset, replicas)} | {ids[rank]}
    return {r for r in range(world) if ids[r] in dests}


def _node(rank: int, ids: Sequence[str]) -> list[int]:
    """The ranks on ``rank``'s node, lowest first."""
    return [r for r, i in enumerate(ids) if i == ids[rank]]


def pairs(rank: int, world: int, offset: int, replicas: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s (send to, receive from) ranks, one pair per replica: ``r + i·offset`` and ``r − i·offset``."""
    return [((rank + i * offset) % world, (rank - i * offset) % world) for i in range(1, replicas + 1)]


def node_plan(rank: int, ids: Sequence[str], parts: Parts, offset: int, replicas: int) -> NodePlan:
    """``ids``: each rank's node id; ``parts``: the step's piece lists of (at least) the ranks in
    :func:`needs` of ``rank``."""
    world = len(ids)
    node = _node(rank, ids)
    holder: dict[str, int] = {}
    for r in node:
        for _, h, obj in parts[r]:
            if obj:
                holder.setdefault(h, r)
    claimed: dict[str, tuple[int, int]] = {}
    for q in node:
        for _, src in pairs(q, world, offset, replicas):
            for _, h, obj in parts[src]:
                if obj and h not in holder:
                    claimed.setdefault(h, (q, src))
    out = NodePlan(protect=set(holder) | set(claimed))
    out.writes = {h for h, r in holder.items() if r == rank}
    for _, src in pairs(rank, world, offset, replicas):
        out.asks[src] = [not obj or claimed.get(h) == (rank, src) for _, h, obj in parts[src]]
    return out


def node_bytes(rank: int, ids: Sequence[str], parts: Parts, offset: int, replicas: int) -> int:
    """The distinct bytes the node of ``rank`` holds for one step: each object its copies name once, and every
    copy's inline pieces (its ranks' own and the replicas they hold)."""
    world = len(ids)
    node = _node(rank, ids)
    copies = [*node, *(src for q in node for _, src in pairs(q, world, offset, replicas))]
    sizes = {h: n for r in copies for n, h, obj in parts[r] if obj}
    named = node_plan(rank, ids, parts, offset, replicas).protect
    return sum(sizes[h] for h in named) + sum(inline_size(parts[r]) for r in copies)
