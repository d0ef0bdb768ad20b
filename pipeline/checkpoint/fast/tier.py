"""A rank's fast tier: a save every K steps into node-local storage and onto peer nodes, in the background.

Inputs: the rank's state dict (what the durable save writes), every ``every`` steps. Outputs: this rank's own
copy and the replicas it holds for its peers (:mod:`.local`), the newest ``keep`` steps of each. Owner: each
rank writes its own copy and the replicas it receives; a node's *keeper* (the lowest rank sharing the dir)
removes what earlier launches left, at restore, before any rank saves again.

Training waits only for the copy of its tensors to CPU (:func:`.codec.snapshot`): each tensor of 4 KiB or more
into a file of the node dir of its own (:mod:`.slots`), the rest into a buffer; both are reused by the next save.
A thread then hashes the blob's pieces (:mod:`.pieces`: each such tensor is one, the bytes between them others;
the one pass over the bytes before they are kept or sent), gathers every rank's size and digest (so every copy's
marker carries the whole step's table) and exchanges whole piece lists only with the ranks that need them (its
node's, and those whose replicas it holds), renames into the node's objects the files of the tensors it is its
node's lowest holder of (:mod:`.sharing`; one the node already has, an unchanged tensor, is not kept again: no
byte is copied a second time), writes its own copy (the inline pieces), and swaps with the peers over a gloo
group of its own (rank ``r`` sends to ``r + i·n`` and receives from ``r − i·n``, ``n`` the ranks per node, ``i`` =
1..replicas): each holder asks its source only for the pieces its node lacks (under DDP: the source's own RNG and
position, not the weights and moments its node holds already), receives each object straight into a file of the
node, and checks each piece against the source's hash before it keeps it. A peer that dies mid-swap leaves the
step incomplete, so no restore picks it (:mod:`.restore`). Last, the snapshot files it renamed are replaced, for
the next save. The thread is the only one; its CPU by phase is in ``stats``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.checkpoint.fast import sharing
from pipeline.checkpoint.fast.codec import Blob, snapshot
from pipeline.checkpoint.fast.local import Copy, NodeTier, run_key
from pipeline.checkpoint.fast.options import FastConfig, FastStats
from pipeline.checkpoint.fast.pieces import Part, cut, digest, digest_of, hashed
from pipeline.checkpoint.fast.sharing import NodePlan, node_bytes, node_plan, pairs
from pipeline.checkpoint.fast.slots import Slot, Slots
from pipeline.errors import PipelineError, exception_line
from pipeline.storage.atomic import clear_file

log = logging.getLogger(__name__)

FAST_DIR_ENV = "PIPELINE_FAST_DIR"
"""Where the fast tier goes when no dir is given (a node-local dir per cluster, set in the job's environment)."""
NICE_ENV = "PIPELINE_FAST_NICE"
"""The background save thread's niceness (Linux, that thread only; default 0). For measuring: on the 2-core VM,
niceness 19 made training slower, not faster (``bench/fast_recovery.py --nice``; docs/figures.md)."""
ROOM_MARGIN = 1.1
"""Room asked for beyond the copies themselves (a blob being written beside the ``keep`` it replaces)."""


class FastTier:
    """One rank's fast tier (every rank constructs it alike: a collective)."""

    def __init__(
        self, cfg: FastConfig, run_dir: Path, attempt: str, group: Any, deadline_s: float, rank_dir: str | None = None
    ) -> None:
        cfg.check()
        self.cfg, self.attempt, self.group, self.deadline_s = cfg, attempt, group, deadline_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.node = NodeTier(Path(rank_dir or cfg.dir) / run_key(run_dir))
        self.xfer = dist.new_group(backend="gloo", timeout=timedelta(seconds=deadline_s))
        try:
            mine = self.node.node_id()
        except OSError as e:  # every rank hears it (a rank raising alone would leave the others in the gather)
            mine = f"error: {self.node.root}: {e.strerror or e}"
        ids: list[Any] = [None] * self.world
        dist.all_gather_object(ids, mine, group=group)
        bad = [f"rank {r}: {i[7:]}" for r, i in enumerate(ids) if str(i).startswith("error: ")]
        if bad:
            raise PipelineError(f"fast tier: cannot use its dir ({'; '.join(bad)}): give a writable node-local dir")
        self.node_ids: list[str] = ids
        self.keeper = ids.index(ids[self.rank]) == self.rank
        per_node = ids.count(ids[self.rank])
        self.offset = offset = per_node if self.world > per_node else 1
        self.replicas = min(cfg.replicas, self.world // offset - 1 if offset > 1 else self.world - 1)
        self.pairs = pairs(self.rank, self.world, offset, self.replicas)
        self.same_node = [dst for dst, _ in self.pairs if ids[dst] == ids[self.rank]]
        if self.rank == 0:
            nodes = len(set(ids))
            note = "" if not self.same_node else ": replicas share a node and do not survive its loss"
            log.info(
                "fast tier: every %d steps in %s (%d node dir(s)), %d replica(s)%s",
                cfg.every, self.node.root, nodes, self.replicas, note,
            )  # fmt: skip
        self.enabled = True
        self._room_checked = False
        self._short = ""
        self._thread: threading.Thread | None = None
        self._pending: int | None = None
        self._buffer: Blob | None = None
        self.slots = Slots(self.node, self.rank)
        self._said_slots = False
        self.stats = FastStats()

    # -- when --------------------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.every == 0

    # -- save --------------------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], any_rank: Any) -> float:
        """Copy ``state`` to CPU and persist it in the background; returns the seconds training waited. Every
        rank calls it at the same step. ``any_rank(flag)``: the checkpoint group's agreement (main thread)."""
        t0 = time.monotonic()
        stuck = not self._settle(self.deadline_s)
        if any_rank(stuck or not self.enabled or bool(self._short)):
            self._disable(f"a fast save still ran after {self.deadline_s:g} s" if stuck else self._short)
            return time.monotonic() - t0
        self.slots.begin()
        snap = self._buffer = snapshot(state, reuse=self._buffer, place=self.slots.take)
        if self.slots.failed and not self._said_slots:
            self._said_slots = True
            log.warning("fast tier: rank %d keeps some tensors in memory, not in node files, and writes them in the "
                        "background (a second copy): %s", self.rank, self.slots.failed)  # fmt: skip
        if not self._room_checked:
            self._room_checked = True
            short = self._room_short(snap)
            if any_rank(bool(short)):
                self._disable(short or "a rank's node has no room for its fast copies")
                return time.monotonic() - t0
        self._pending = step
        self._thread = threading.Thread(target=self._persist, args=(step, snap), name=f"fast-save-{step}", daemon=True)
        self._thread.start()
        return time.monotonic() - t0

    def _room_short(self, snap: Blob) -> str:
        """Before the first save: room for this rank's own copies at least (what its node shares is known only
        once the pieces are hashed: :meth:`_node_short` checks the rest)."""
        need = int(snap.nbytes * self.cfg.keep * ROOM_MARGIN)
        return self._short_of(need, "at least ")

    def _nodes_short(self, every: dict[int, tuple[Part, ...]]) -> str:
        """The first save, before it writes: whether each node has room for every distinct byte its copies of
        ``keep`` steps hold (its objects once, each copy's inline pieces). Each node's keeper judges its own node;
        every rank hears every verdict (the first short node's, by keeper) and decides alike."""
        short = ""
        if self.keeper:
            held = node_bytes(self.rank, self.node_ids, every, self.offset, self.replicas)
            short = self._short_of(int(held * self.cfg.keep * ROOM_MARGIN), "")
        verdicts: list[Any] = [None] * self.world
        dist.all_gather_object(verdicts, short, group=self.xfer)
        for keeper, why in enumerate(verdicts):
            if why:
                return why if self.node_ids[keeper] == self.node_ids[self.rank] else f"rank {keeper}'s node: {why}"
        return ""

    def _exchange(self, parts: tuple[Part, ...]) -> dict[int, tuple[Part, ...]]:
        """The piece lists of the ranks this rank needs (:func:`~.sharing.needs`: its node's ranks and the ranks
        they hold replicas of), each from its rank, and this rank's sent to the ranks that need it: what a rank
        receives grows with its node, not with the world (an all-gather of every list would hand each rank the
        whole world's, ~50 bytes a tensor a rank)."""
        needs = sorted(sharing.needs(self.rank, self.node_ids, self.offset, self.replicas) - {self.rank})
        feeds = sorted(sharing.feeds(self.rank, self.node_ids, self.offset, self.replicas) - {self.rank})
        mine = torch.frombuffer(bytearray(json.dumps(parts).encode()), dtype=torch.uint8)
        sizes = {src: torch.empty(1, dtype=torch.int64) for src in needs}
        size = torch.tensor([mine.numel()], dtype=torch.int64)
        sends = [dist.isend(size, dst, group=self.xfer, tag=_LIST_TAG) for dst in feeds]
        _wait([dist.irecv(t, src, group=self.xfer, tag=_LIST_TAG) for src, t in sizes.items()])
        lists = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in sizes.items()}
        sends += [dist.isend(mine, dst, group=self.xfer, tag=_LIST_TAG + 1) for dst in feeds]
        _wait([dist.irecv(t, src, group=self.xfer, tag=_LIST_TAG + 1) for src, t in lists.items()] + sends)
        out = {src: _parts_of(bytes(t.numpy()), src) for src, t in lists.items()}
        out[self.rank] = parts
        return out

    def _short_of(self, need: int, bound: str) -> str:
        free = self.node.free_bytes() + self.node.held_bytes()
        if free >= need:
            return ""
        sharing = self.node_ids.count(self.node_ids[self.rank])
        return (
            f"{self.node.root} has {free / 1e6:.0f} MB free, its {sharing} rank(s) need {bound}{need / 1e6:.0f} MB "
            f"({self.cfg.keep} steps of what they and {self.replicas} replica(s) hold); give checkpoint.fast.dir "
            "more room"
        )

    def _disable(self, why: str) -> None:
        if self.enabled and self.rank == 0 and why:
            log.warning("fast tier off: %s; durable saves only", why)
        self.enabled = False
        self.slots.release()
        self._buffer = None  # its tensors' memory (the slots' pages among it) goes with it

    def close(self, settle: bool = True) -> None:
        """The pending save settled (at most the deadline; ``settle=False``: not waited for, a failing run's), then
        this process's snapshot files removed (a save still running then fails, and is not offered)."""
        if settle:
            self.wait()
        self.slots.release()

    def _persist(self, step: int, snap: Blob) -> None:
        t0, c0 = time.monotonic(), time.thread_time()
        _nice_this_thread()
        try:
            self._prune(max(1, self.cfg.keep - 1))  # before the gather: the keeper's collect then sees the node's
            c = self.stats.add("prune", c0)  # the newest complete step survives; the others' objects are reused
            ranges = cut(snap.nbytes, snap.spans)
            parts = hashed(snap.bytes, ranges)  # the one pass over the bytes before they are written or sent
            c = self.stats.add("hash", c)
            gathered: list[Any] = [None] * self.world
            first = not self.stats.saved and not self.stats.failed
            dist.all_gather_object(gathered, (snap.nbytes, digest_of(parts)), group=self.xfer)  # the step's table
            rows = tuple((int(s), str(h)) for s, h in gathered)
            every = self._exchange(parts)
            plan = node_plan(self.rank, self.node_ids, every, self.offset, self.replicas)
            if first:  # every rank alike, before any writes: the next save turns the tier off everywhere
                self._short = self._nodes_short(every)
                if self._short:
                    raise PipelineError(self._short)
            c = self.stats.add("gather", c)
            if self.keeper:  # what no kept copy and nothing of this step names (no rank of the node writes it)
                self.node.collect(plan.protect)
            self._write_objects(snap, ranges, parts, plan)
            inline = b"".join(snap.bytes(b, e) for b, e, obj in ranges if not obj)
            self.node.write(Copy(step, self.rank, "own", self.world, self.attempt, *rows[self.rank], rows, parts),
                            inline)  # fmt: skip
            self.stats.written_bytes += len(inline)
            c = self.stats.add("write", c)
            self.slots.begin()  # the spares this step's collect left, for what arrives
            for dst, src in self.pairs:
                self._replicate(step, snap, ranges, (dst, src), rows, every[src], plan)
            c = self.stats.add("replicate", c)
            self._prune(self.cfg.keep)
            self.stats.saved.append(step)
            mine = [("own", self.rank), *(("replica", src) for _, src in self.pairs)]
            self.stats.held_bytes = self.node.held_bytes(mine)
            c = self.stats.add("prune", c)
            self.slots.refill((b, e) for b, e, obj in ranges if obj)  # for the next snapshot, while training goes on
            self.stats.staging_bytes = snap.nbytes - sum(t.numel() for t in snap.placed.values()) + self.slots.nbytes
            self.stats.add("refill", c)
        except BaseException as e:  # a background save never kills training: the step is just not in the fast tier
            self.stats.failed[step] = exception_line(e)
            log.warning("fast tier: rank %d did not save step %d: %s", self.rank, step, exception_line(e))
        finally:
            self.stats.last_persist_s = time.monotonic() - t0
            self.stats.persist_cpu_s += time.thread_time() - c0
            self.stats.save_cpu_s.append(time.thread_time() - c0)

    def _write_objects(self, snap: Blob, ranges: list[tuple[int, int, bool]], parts: tuple[Part, ...],
                       plan: NodePlan) -> None:  # fmt: skip
        """The objects of this rank's blob it writes for its node: a snapshot file renamed (:mod:`.slots`), or the
        bytes written from the snapshot's buffer (a GPU state's, or where no file could be made)."""
        for (b, e, obj), (_, h, _) in zip(ranges, parts, strict=True):
            if not obj or h not in plan.writes:
                continue  # another rank of the node writes it, or it is the copy's own file's
            if self.slots.held(b):
                if self.slots.adopt(b, h):
                    self.stats.written_bytes += e - b
                    self.stats.renamed_bytes += e - b
            elif self.node.write_object(h, snap.bytes(b, e)):
                self.stats.written_bytes += e - b

    def _prune(self, keep: int) -> None:
        """The newest ``keep`` steps of this rank's own copies and of the replicas it holds."""
        self.node.prune("own", self.rank, keep)
        for _, src in self.pairs:
            self.node.prune("replica", src, keep)

    def _replicate(self, step: int, snap: Blob, ranges: list[tuple[int, int, bool]], pair: tuple[int, int],
                   rows: tuple[tuple[int, str], ...], theirs: tuple[Part, ...], plan: NodePlan) -> None:  # fmt: skip
        """Send ``dst`` the pieces of this rank's blob it asks for; ask ``src`` for the pieces of its blob this
        node lacks, check each against the hash ``src`` gathered, and keep them as ``src``'s replica."""
        dst, src = pair
        want = [a and (not obj or not self.node.has_object(h, n)) for a, (n, h, obj) in zip(plan.asks[src], theirs,
                                                                                            strict=True)]  # fmt: skip
        asked = torch.empty(len(ranges), dtype=torch.uint8)
        _wait([dist.isend(torch.tensor(want, dtype=torch.uint8), src, group=self.xfer),
               dist.irecv(asked, dst, group=self.xfer)])  # fmt: skip
        # each object asked for arrives straight in a file of this node (named once it checks), the rest in a buffer
        files = {i: self.slots.scratch(n) for i, ((n, _, obj), w) in enumerate(zip(theirs, want, strict=True))
                 if w and obj}  # fmt: skip
        into = {i: f.tensor for i, f in files.items() if f is not None}
        got = torch.empty(sum(n for i, ((n, _, _), w) in enumerate(zip(theirs, want, strict=True))
                              if w and i not in into), dtype=torch.uint8)  # fmt: skip
        works, at = [], 0
        for i, ((b, e, _), a) in enumerate(zip(ranges, asked.tolist(), strict=True)):
            if a:
                works.append(dist.isend(snap.piece(b, e), dst, group=self.xfer, tag=1 + i))
                self.stats.sent_bytes += e - b
        for i, ((n, _, _), w) in enumerate(zip(theirs, want, strict=True)):
            if w and i not in into:
                into[i], at = got[at : at + n], at + n
            if w:
                works.append(dist.irecv(into[i], src, group=self.xfer, tag=1 + i))
        try:
            _wait(works)
            inline = self._keep(step, src, theirs, into, files)
        finally:
            for f in files.values():
                if f is not None:  # damaged, or the node had it: not kept
                    clear_file(f.path)
        self.node.write(Copy(step, src, "replica", self.world, self.attempt, *rows[src], rows, theirs), inline)
        self.stats.written_bytes += len(inline)

    def _keep(self, step: int, src: int, theirs: tuple[Part, ...], into: dict[int, torch.Tensor],
              files: dict[int, Slot | None]) -> bytearray:  # fmt: skip
        """Check each piece that arrived from ``src`` against its hash; name the objects that came in files (the
        node's own, now: taken out of ``files``), write the others; the inline pieces, in order."""
        inline = bytearray()
        for i in sorted(into):
            n, h, obj = theirs[i]
            data = into[i].numpy().data.cast("B")  # the received bytes where they lie, not a copy
            if digest(data) != h:
                raise PipelineError(f"the replica of rank {src}'s step {step} arrived damaged (piece {i}); not kept")
            if not obj:
                inline += data
            elif (f := files.get(i)) is not None:
                if not self.node.has_object(h, n):
                    self.slots.name(f, h)
                    files[i] = None
                    self.stats.written_bytes += n
                    self.stats.renamed_bytes += n
            elif self.node.write_object(h, data):
                self.stats.written_bytes += n
        return inline

    def _settle(self, timeout_s: float) -> bool:
        """Wait for the background save (bounded); False if it still runs."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread, self._pending = None, None
        return True

    def wait(self) -> None:
        """The pending fast save settled (at most the deadline)."""
        self._settle(self.deadline_s)


def _nice_this_thread() -> None:
    nice = os.environ.get(NICE_ENV, "").strip()
    if nice.lstrip("-").isdigit() and int(nice):
        with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed: the default priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(nice))


def _wait(works: list[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()


_LIST_TAG = 1 << 30
"""The tags of a save's piece-list exchange (above any piece's ``1 + i``, so a peer already replicating never
matches it)."""


def _parts_of(raw: bytes, rank: int) -> tuple[Part, ...]:
    """A peer's piece list as it sent it (JSON: [length, hash, is_object] each)."""
    try:
        items = json.loads(raw)
        return tuple((int(n), str(h), bool(o)) for n, h, o in items)
    except (ValueError, TypeError) as e:
        raise PipelineError(f"fast tier: rank {rank}'s piece list did not parse ({e})") from e
