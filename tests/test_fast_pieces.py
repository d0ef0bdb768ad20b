"""The fast tier writes and sends each distinct byte once (:mod:`pipeline.checkpoint.fast.pieces`, ``.sharing``):
a node keeps one copy of a tensor its ranks share, a replica's holder asks only for what its node lacks, an
unchanged tensor is not written again, and an object no copy names is recycled. In-process; the distributed
restores from damaged objects are in ``test_fast_tier.py``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.checkpoint.fast.codec import Scattered, snapshot, unpack
from pipeline.checkpoint.fast.local import Copy, NodeTier
from pipeline.checkpoint.fast.pieces import OBJECT_MIN, Part, cut, digest, digest_of, hashed, objects, offsets
from pipeline.checkpoint.fast.sharing import feeds, needs, node_bytes, node_plan


def _parts(state: dict[str, torch.Tensor]) -> tuple[memoryview, list[tuple[int, int, bool]], tuple[Part, ...]]:
    blob = snapshot(state)
    view = blob.view()
    ranges = cut(len(view), blob.spans)
    return view, ranges, hashed(view, ranges)


def test_tensors_of_4_kib_or_more_are_objects_and_the_digest_covers_every_byte() -> None:
    big, small = torch.arange(2048, dtype=torch.float32), torch.arange(8, dtype=torch.float32)
    view, ranges, parts = _parts({"big": big, "small": small})
    assert [(e - b, obj) for b, e, obj in ranges if obj] == [(big.numel() * 4, True)] and OBJECT_MIN <= 8192
    assert sum(n for n, _, _ in parts) == len(view) and not all(o for _, _, o in parts)
    # one inline piece: the digest is the whole blob's hash (copies written before pieces existed still verify)
    assert digest_of(((len(view), digest(view), False),)) == digest(view)
    _, _, other = _parts({"big": big + 1, "small": small})
    assert digest_of(other) != digest_of(parts)
    # the pieces, each in a buffer of its own, unpack to the same state
    starts = offsets(parts)
    pieces = Scattered(tuple(starts), tuple(view[s : s + n] for s, (n, _, _) in zip(starts, parts, strict=True)),
                       len(view))  # fmt: skip
    out = unpack(pieces, "test")
    assert out["big"].equal(big) and out["small"].equal(small)


def _ddp(rank: int) -> tuple[Part, ...]:
    """A DDP rank's pieces: the same weights on every rank, an RNG state of its own."""
    weights = torch.arange(4096, dtype=torch.float32)
    rng = torch.full((2048,), float(rank))
    return _parts({"w": weights, "rng": rng})[2]


def test_a_node_writes_a_shared_tensor_once_and_a_replica_asks_only_for_what_its_node_lacks() -> None:
    world, ids = 4, ["a", "a", "b", "b"]  # two nodes of two ranks; replicas go to the other node (offset 2)
    parts = [_ddp(r) for r in range(world)]
    shared = objects(parts[0]) & objects(parts[1])
    assert len(shared) == 1 and all(shared <= objects(p) for p in parts)
    plans = [node_plan(r, ids, parts, offset=2, replicas=1) for r in range(world)]
    assert plans[0].writes == objects(parts[0]) and plans[1].writes == objects(parts[1]) - shared  # lowest rank
    assert plans[2].writes == objects(parts[2]) and plans[3].writes == objects(parts[3]) - shared
    # rank 0 holds rank 2's replica: it asks for rank 2's inline pieces and its RNG, never the shared weights
    ask = plans[0].asks[2]
    asked = {h for (_, h, obj), a in zip(parts[2], ask, strict=True) if a and obj}
    assert asked == objects(parts[2]) - shared and all(a for (_, _, obj), a in zip(parts[2], ask, strict=True)
                                                         if not obj)  # fmt: skip
    assert plans[0].protect == objects(parts[0]) | objects(parts[1]) | objects(parts[2]) | objects(parts[3])


def test_a_node_of_ddp_ranks_needs_room_for_one_copy_of_what_they_share() -> None:
    """The room the first save asks of a node: the shared weights once, each copy's own bytes (its RNG object and
    inline pieces): not a full copy per rank and replica, which would turn the tier off on nodes that have room."""
    ids = ["a", "a", "b", "b"]
    parts = [_ddp(r) for r in range(4)]
    size = {h: n for p in parts for n, h, o in p if o}
    shared = objects(parts[0]) & objects(parts[1])
    own = [sum(size[h] for h in objects(p) - shared) + sum(n for n, _, o in p if not o) for p in parts]
    need = node_bytes(0, ids, parts, offset=2, replicas=1)
    assert need == sum(size[h] for h in shared) + sum(own)  # node a: ranks 0, 1 and the replicas of 2, 3
    assert need < 0.7 * sum(sum(n for n, _, _ in p) for p in parts)  # 4 full copies (2 own + 2 replicas)


def test_a_tensor_held_by_no_rank_of_the_node_is_asked_for_by_one_holder_only() -> None:
    # one rank per node and a per-rank tensor nobody else holds: each replica holder asks for it; with two
    # holders of two sources on one node sharing a tensor the other node holds, only the lower one asks
    ids = ["a", "a", "b", "b"]
    same = _parts({"x": torch.ones(4096)})[2]
    other = _parts({"x": torch.zeros(4096)})[2]
    parts = [other, other, same, same]  # node b's ranks share "same"; node a does not hold it
    p0, p1 = (node_plan(r, ids, parts, offset=2, replicas=1) for r in (0, 1))
    h = next(iter(objects(same)))
    ask0 = {hh for (_, hh, o), a in zip(same, p0.asks[2], strict=True) if a and o}
    ask1 = {hh for (_, hh, o), a in zip(same, p1.asks[3], strict=True) if a and o}
    assert ask0 == {h} and ask1 == set()


def test_an_unchanged_tensor_is_not_written_again_and_a_stale_object_is_recycled(tmp_path: Path) -> None:
    node = NodeTier(tmp_path / "node")
    frozen, moving = torch.arange(4096, dtype=torch.float32), torch.zeros(4096)
    written = []
    for step in (1, 2, 3):
        moving.fill_(step)
        view, ranges, parts = _parts({"frozen": frozen, "w": moving})
        n = 0
        for (b, e, obj), (_, h, _) in zip(ranges, parts, strict=True):
            if obj:
                n += node.write_object(h, view[b:e])
        written.append(n)
        inline = b"".join(view[b:e] for b, e, obj in ranges if not obj)
        node.write(Copy(step, 0, "own", 1, "a", len(view), digest_of(parts), ((len(view), digest_of(parts)),),
                        parts), inline)  # fmt: skip
        node.prune("own", 0, keep=1)
        node.collect(set())
        spares = list((node.root / "spare").glob("*.bin"))
        assert len(spares) == (0 if step == 1 else 1), spares  # the last step's moving tensor, kept to reuse
        if step > 1:
            inode = spares[0].stat().st_ino
    assert written == [2, 1, 1]  # the frozen tensor once; the moving one every step
    marker = json.loads((node.root / "own" / "rank_0" / "step_3.json").read_text())
    names = objects(Copy.of(marker).parts)
    assert {p.name[:-4] for p in (node.root / "objects").glob("*.bin")} == names
    # the next write of the moving tensor goes into the spare's pages (the same file), not a new one
    moving.fill_(4)
    view, ranges, parts = _parts({"frozen": frozen, "w": moving})
    h = next(h for (_, h, obj) in parts if obj and h not in names)
    b, e, _ = next(r for r, p in zip(ranges, parts, strict=True) if p[1] == h)
    assert node.write_object(h, view[b:e]) and node.object_path(h).stat().st_ino == inode
    assert node.object_path(h).read_bytes() == bytes(view[b:e])


def test_a_save_exchanges_piece_lists_only_with_the_ranks_that_need_them() -> None:
    """Who needs whose piece list (its node's ranks and the ranks they hold replicas of) and who sends to whom
    agree for every rank, and what a rank receives does not grow with the world: 4 ranks a node, 1 replica,
    8 ranks ... 4,096 ranks: 7 lists, against 4,095 for an all-gather."""
    for world, per_node, replicas in ((2, 1, 1), (4, 2, 1), (8, 2, 2), (12, 4, 2), (4096, 4, 1)):
        ids = [f"n{r // per_node}" for r in range(world)]
        offset = per_node if world > per_node else 1
        ranks = range(world) if world <= 12 else (0, 1, 2047, 4095)
        for r in ranks:
            assert all(r in needs(s, ids, offset, replicas) for s in feeds(r, ids, offset, replicas))
            assert all(r in feeds(s, ids, offset, replicas) for s in needs(r, ids, offset, replicas))
        if world == 4096:
            assert len(needs(0, ids, offset, replicas)) == 2 * per_node
    ids = [f"n{r // 2}" for r in range(8)]
    parts = [(*_ddp(r)[:-1], (64, f"unique-{r}", True)) for r in range(8)]  # shared objects, one of its own
    for r in range(8):  # the plan made from only the lists a rank needs is the one made from every list
        mine = {s: parts[s] for s in needs(r, ids, 2, 2)}
        assert node_plan(r, ids, mine, 2, 2) == node_plan(r, ids, parts, 2, 2)
        assert node_bytes(r, ids, mine, 2, 2) == node_bytes(r, ids, parts, 2, 2)
