"""A fast save copies each big tensor once (:mod:`pipeline.checkpoint.fast.slots`): the snapshot copies it into a
file of the node dir, which becomes the object under its hash by a rename; an object is never written again; a
spare's pages are reused for the next snapshot; a slot that cannot be made leaves the tensor in the snapshot's
buffer. In-process; the distributed saves and restores on this layout are in ``test_fast_tier.py``."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.checkpoint.fast import local as local_module
from pipeline.checkpoint.fast import slots as slots_module
from pipeline.checkpoint.fast.codec import Blob, Scattered, snapshot, unpack
from pipeline.checkpoint.fast.local import NodeTier
from pipeline.checkpoint.fast.options import FastStats
from pipeline.checkpoint.fast.pieces import Part, cut, digest, hashed, offsets
from pipeline.checkpoint.fast.slots import Slots
from pipeline.checkpoint.fast.tier import FastTier
from pipeline.errors import PipelineError


def _save(slots: Slots, state: dict[str, torch.Tensor]) -> tuple[Blob, list[tuple[int, int, bool]], tuple[Part, ...]]:
    slots.begin()
    blob = snapshot(state, place=slots.take)
    ranges = cut(blob.nbytes, blob.spans)
    return blob, ranges, hashed(blob.bytes, ranges)


def _objects(ranges: list[tuple[int, int, bool]], parts: tuple[Part, ...]) -> list[tuple[int, str]]:
    return [(b, h) for (b, _, obj), (_, h, _) in zip(ranges, parts, strict=True) if obj]


def _state(node: NodeTier, blob: Blob, ranges: list[tuple[int, int, bool]], parts: tuple[Part, ...]) -> dict:
    """What the node's files hold for this blob: its objects from ``objects/``, the rest from the blob."""
    views = tuple(
        memoryview(node.object_path(h).read_bytes()) if obj else blob.bytes(b, e)
        for (b, e, obj), (_, h, _) in zip(ranges, parts, strict=True)
    )
    return unpack(Scattered(tuple(offsets(parts)), views, blob.nbytes), "test")


def test_a_big_tensor_is_copied_once_and_its_file_becomes_the_object(tmp_path: Path) -> None:
    node = NodeTier(tmp_path / "node")
    slots = Slots(node, rank=0)
    w, small = torch.arange(4096, dtype=torch.float32), torch.arange(8, dtype=torch.float32)
    blob, ranges, parts = _save(slots, {"w": w, "small": small})
    ((at, h),) = _objects(ranges, parts)
    assert list(blob.placed) == [at] and slots.held(at)  # the small tensor stays in the buffer
    (slot,) = slots.dir.glob("*.bin")
    inode = slot.stat().st_ino
    assert slot.read_bytes() == w.numpy().tobytes()  # the snapshot's copy went straight into the file
    assert slots.adopt(at, h) and not slots.held(at)
    assert node.object_path(h).stat().st_ino == inode and not slot.exists()  # renamed, not written
    out = _state(node, blob, ranges, parts)
    assert out["w"].equal(w) and out["small"].equal(small)

    # the next snapshot never writes into the object: a new slot, and the object keeps its bytes
    blob2, ranges2, parts2 = _save(slots, {"w": w + 1, "small": small})
    ((at2, h2),) = _objects(ranges2, parts2)
    assert at2 == at and h2 != h and node.object_path(h).read_bytes() == w.numpy().tobytes()
    # a tensor the node already has: the slot stays (overwritten by the next snapshot, never named)
    blob3, ranges3, parts3 = _save(slots, {"w": w, "small": small})
    assert _objects(ranges3, parts3) == [(at, h)] and not slots.adopt(at, h) and slots.held(at)
    again = next(slots.dir.glob("*.bin")).stat().st_ino
    _save(slots, {"w": w + 2, "small": small})
    assert next(slots.dir.glob("*.bin")).stat().st_ino == again

    # an object no copy names becomes a spare; a refill takes its pages for the next snapshot
    blob4, ranges4, parts4 = _save(slots, {"w": w + 3, "small": small})
    assert slots.adopt(at, _objects(ranges4, parts4)[0][1])
    node.collect({h})  # the step being saved names h: only w + 3's object is a spare
    (spare,) = (node.root / "spare").glob("*.bin")
    spare_inode = spare.stat().st_ino
    slots.refill([(at, at + w.numel() * 4)])
    assert slots.reused == 1 and next(slots.dir.glob("*.bin")).stat().st_ino == spare_inode
    # the file this process named keeps its mapping: the slot made of it again is mapped in already
    assert slots.take(at, w.numel() * 4).data_ptr() == blob4.placed[at].data_ptr()
    slots.release()
    assert not slots.dir.exists()


def test_a_slot_that_cannot_be_made_leaves_the_tensor_in_the_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    node = NodeTier(tmp_path / "node")
    slots = Slots(node, rank=0)
    w = torch.arange(4096, dtype=torch.float32)
    blob, ranges, parts = _save(slots, {"w": w})
    assert not blob.placed and "No space left" in slots.failed and not list(slots.dir.glob("*"))
    assert unpack(blob.view(), "test")["w"].equal(w)
    ((at, h),) = _objects(ranges, parts)
    assert not slots.held(at) and node.write_object(h, blob.bytes(at, at + w.numel() * 4))


def test_past_the_mapping_bound_tensors_stay_in_the_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_module, "MAPS_MAX", 4)  # two slots at most
    slots = Slots(NodeTier(tmp_path / "node"), rank=0)
    state = {f"w{i}": torch.full((2048,), float(i)) for i in range(3)}
    blob, _, _ = _save(slots, state)
    assert len(blob.placed) == 2 and "more than 2 tensors" in slots.failed
    for (b, e), t in zip(blob.spans, state.values(), strict=True):
        assert bytes(blob.bytes(b, e)) == t.numpy().tobytes()


def test_a_dead_process_slots_that_cannot_be_removed_never_fail_the_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper removes dead processes' slot dirs at restore; an error there would be the keeper's alone (its
    node-mates would wait for it in the restore's next collective): the dir stays, for the next restore."""
    node = NodeTier(tmp_path / "node")
    dead = node.root / "slots" / "rank_0-1-dead"
    dead.mkdir(parents=True)
    (dead / "8192-x.bin").write_bytes(b"\0" * 8192)

    def refuse(path: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(local_module, "remove_tree", refuse)
    node.drop_all_but(None)
    assert dead.is_dir()
    monkeypatch.undo()
    node.drop_all_but(None)
    assert not dead.exists()


def test_an_object_received_for_a_replica_arrives_in_a_node_file_that_becomes_the_object(tmp_path: Path) -> None:
    """A replica's holder receives each object it asked for straight into a file of its process's slots dir; once
    its hash checks, that file is renamed into the node's objects (no copy). A damaged one is refused, not named."""
    node = NodeTier(tmp_path / "node")
    slots = Slots(node, rank=0)
    tier = SimpleNamespace(node=node, slots=slots, stats=FastStats())  # what FastTier._keep reads
    raw = torch.arange(2048, dtype=torch.float32).numpy().tobytes()  # 8 KiB: an object
    h = digest(raw)
    theirs = ((len(raw), h, True),)

    f = slots.scratch(len(raw))
    assert f is not None and f.path.parent == slots.dir
    f.tensor.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))  # what the transport's receive does
    inode, files = f.path.stat().st_ino, {0: f}
    assert FastTier._keep(tier, 8, 1, theirs, {0: f.tensor}, files) == bytearray()  # type: ignore[arg-type]
    assert files == {0: None} and node.object_path(h).stat().st_ino == inode
    assert node.object_path(h).read_bytes() == raw and tier.stats.renamed_bytes == len(raw)

    node.object_path(h).unlink()
    bad = slots.scratch(len(raw))
    assert bad is not None  # its bytes are zeros: not the piece's
    with pytest.raises(PipelineError, match="arrived damaged"):
        FastTier._keep(tier, 8, 1, theirs, {0: bad.tensor}, {0: bad})  # type: ignore[arg-type]
    assert not node.has_object(h, len(raw)) and bad.path.exists()  # the caller (_replicate) removes it


def test_a_planted_link_among_the_spares_is_removed_and_never_written_through(tmp_path: Path) -> None:
    """A spare is a file the node's writers reuse in place; a link planted among them (to a file outside the node
    dir) is removed when taken, and a slot or an object is made anew: the link's target keeps its bytes."""
    node = NodeTier(tmp_path / "node")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 8192)
    (node.root / "spare").mkdir(parents=True)
    for name in ("8192-a.bin", "8192-b.bin"):
        (node.root / "spare" / name).symlink_to(outside)
    slots = Slots(node, rank=0)
    w = torch.ones(2048)  # 8 KiB, the spares' size
    blob, ranges, parts = _save(slots, {"w": w})
    assert slots.reused == 0 and len(blob.placed) == 1 and not slots.failed
    ((at, h),) = _objects(ranges, parts)
    assert node.write_object(h, blob.bytes(at, at + 8192))  # the object's writes take spares too
    assert outside.read_bytes() == b"x" * 8192 and not list((node.root / "spare").iterdir())
    assert node.object_path(h).read_bytes() == w.numpy().tobytes() and not node.object_path(h).is_symlink()
