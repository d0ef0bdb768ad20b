"""Incremental saves (``pipeline/checkpoint/save/pieces.py``): what does not train is written once, every step complete.

* A fine-tune with 1.2% of its parameters trainable (a frozen base, a small adapter) writes per save no more than
  1.05 x (trainable weights + their optimizer state + train state), at least 20x less than the same saves without
  sharing; on POSIX and in a bucket. Retention deletes the step that first wrote the base, and every retained
  step still verifies and loads with plain ``torch.distributed.checkpoint.load``.
* Every retention order of 6 steps sharing pieces: deleting any step never breaks another's verification (POSIX:
  all 720 orders), and in a bucket what is left is exactly what the remaining steps need (every transition
  between sets of removed steps, so every order).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader

from pipeline.checkpoint import Checkpointer
from pipeline.checkpoint.manifest import read_latest, verify_committed
from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer
from pipeline.checkpoint.protocol.ownership import LEASE
from pipeline.checkpoint.protocol.retention import retire
from pipeline.checkpoint.save import pieces, rank_save
from pipeline.checkpoint.save.rank_save import RankTarget
from pipeline.checkpoint.stores.bucket_status import remote_checkpoints
from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.remote_pull import pull
from pipeline.driver.run_status import collect_checkpoints
from pipeline.formats.dcp_names import is_piece
from pipeline.rundir.layout import RunLayout
from pipeline.storage.faults import InjectedFault
from pipeline.storage.integrity import describe, hash_file
from pipeline.storage.layout import CheckpointLayout
from pipeline.storage.s3 import S3Url
from tests.conftest import ROOT, run_cli
from tests.s3.helpers import assert_invariants, bucket_store, keys
from tests.s3.helpers import committer as remote_committer
from tests.seed_helpers import TEST_FORMAT

# --- a fine-tune with a frozen base ------------------------------------------------------------------------------


class Adapted(torch.nn.Module):
    """A frozen 4096x2048 base (32 MiB) with a persistent buffer, and a rank-16 adapter that trains (1.2%)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.Linear(4096, 2048)
        with torch.no_grad():
            self.base.weight.copy_(torch.randn(2048, 4096, generator=g) / 50)
        self.base.requires_grad_(False)
        self.register_buffer("scale", torch.full((2048,), 0.5))
        self.down = torch.nn.Linear(4096, 16, bias=False)
        self.up = torch.nn.Linear(16, 2048, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) * self.scale + self.up(self.down(x))


def _fine_tune(directory: Path, storage: str | None, dedup: bool, steps: int = 5) -> tuple[list[Any], dict]:
    """Train and save every step (each committed before the next); the save results and each step's state."""
    torch.manual_seed(1)
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state = {"model": model, "optim": opt}
    ck = Checkpointer(directory, keep_last=3, storage=storage, dedup=dedup, writer_threads=2, poll_interval_s=0.05)
    results, saved = [], {}
    try:
        for step in range(1, steps + 1):
            model(torch.randn(4, 4096)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            results.append(ck.save(step, state))
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            _wait_committed(ck, step)
    finally:
        ck.close()
    return results, {"saved": saved, "model": model, "opt": opt}


def _wait_committed(ck: Checkpointer, step: int) -> None:
    def now() -> int:
        if ck.remote is not None:
            latest, _ = ck.remote.read_latest()
        else:
            latest = read_latest(ck.layout)
        return latest.step if latest else 0

    until = time.monotonic() + 60
    while now() < step:
        assert time.monotonic() < until, f"step {step} was not committed within 60 s"
        time.sleep(0.05)


def _bound(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Trainable weights + their optimizer state + train state (the checkpointer's step), in bytes."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    optim = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return trainable + optim + 8


def _load_plain(step_dir: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP step through plain ``dcp.load`` (torch's own reader and planner)."""
    md = FileSystemReader(str(step_dir)).read_metadata()
    out = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    dcp.load(out, checkpoint_id=str(step_dir), no_dist=True)
    return {k.removeprefix("model."): v for k, v in out.items()}


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_fine_tune_writes_only_what_trains_and_every_step_stays_complete(
    backend: str, tmp_path: Path, one_rank: Any, request: pytest.FixtureRequest
) -> None:
    storage = None
    if backend == "s3":
        bucket, prefix = request.getfixturevalue("bucket"), request.getfixturevalue("prefix")
        storage = f"s3://{bucket}/{prefix}"
    results, run = _fine_tune(tmp_path / "dedup", storage, dedup=True)
    full = [r.bytes for r in _fine_tune(tmp_path / "full", storage and storage + "-full", dedup=False)[0]]
    bound = _bound(run["model"], run["opt"])
    written = [r.bytes for r in results]
    assert all(r.ok for r in results)
    assert results[0].shared == 0 and written[0] > 32 << 20, "the first save writes the base once"
    for step, r in enumerate(results[1:], start=2):
        assert r.bytes <= 1.05 * bound, f"step {step} wrote {r.bytes} bytes; trainable + optimizer + train: {bound}"
        assert full[step - 1] >= 20 * r.bytes, f"step {step}: {full[step - 1]} bytes unshared vs {r.bytes}"
        assert r.shared > 32 << 20
    assert abs(written[0] - full[0]) < 1e-3 * full[0], "a first save writes what an unshared save writes"

    layout = CheckpointLayout((tmp_path / "dedup").resolve())
    if storage is not None:  # retained steps: pulled one by one, each verified against its manifest on the way
        remote = Remote(S3Url.parse(storage), cache_dir=layout.run_dir)
        assert remote.committed() == [3, 4, 5]
        stored = keys(remote.root.bucket, remote.pieces_prefix())
        listed = {remote.pieces_prefix() + e.hash for s in (3, 4, 5) for e in _manifest(remote, s) if is_piece(e.path)}
        assert set(stored) == listed, "the bucket keeps exactly the pieces a committed manifest lists"
        for s in (3, 4, 5):  # the cache holds one step at a time
            _check_loads(pull(remote, s).committed_step(s), run["saved"][s])
        view = remote_checkpoints(remote)
        assert [c.get("shared_files") for c in view["committed"]] == [3, 3, 3]  # the base (weight, bias) and the buffer
        assert view["shared_saved"] >= 2 * (32 << 20), "status counts the bytes stored once"
        return
    else:
        step_dirs = {s: layout.committed_step(s) for s in (3, 4, 5)}
        assert not layout.committed_step(1).exists(), "retention deleted the step that wrote the base"
        base = {s: (d / "__0_frozen0.distcp").stat() for s, d in step_dirs.items()}
        assert len({st.st_ino for st in base.values()}) == 1, "the base is one file, linked into every step"
        for s, d in step_dirs.items():
            verify_committed(d, s)
    for s, d in step_dirs.items():
        _check_loads(d, run["saved"][s])
    view = collect_checkpoints(layout)
    assert [c.get("shared_files") for c in view["checkpoints"]["committed"]] == [3, 3, 3]
    assert view["checkpoints"]["shared_saved"] >= 2 * (32 << 20)

    # Damage latest's own file: the committer quarantines step 5, whose shared pieces stay with steps 3 and 4.
    with (layout.committed_step(5) / "__0_0.distcp").open("r+b") as f:
        f.write(b"rot")
    c = Committer(layout, CommitPolicy(world_size=1))
    with c.hold():
        c.recover()
    assert c.latest_step() == 4
    (q,) = collect_checkpoints(layout)["checkpoints"]["quarantined"]
    assert q["step"] == 5 and "3 shared piece(s)" in q["reason"], q
    for s in (3, 4):
        verify_committed(layout.committed_step(s), s)


def _check_loads(step_dir: Path, saved: dict[str, torch.Tensor]) -> None:
    loaded = _load_plain(step_dir)
    assert set(loaded) == set(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in loaded), f"{step_dir} loads other tensors"


def _manifest(remote: Remote, step: int) -> tuple[Any, ...]:
    found = remote.read_manifest(step)
    assert found is not None
    return found[0].files


# --- every retention order ---------------------------------------------------------------------------------------

STEPS = (1, 2, 3, 4, 5, 6)


def _files(step: int, rank: int) -> dict[str, bytes]:
    """A rank's files of ``step``: its own data, a frozen piece that changes once (at step 5), buffers that change
    every second step."""
    return {
        f"__{rank}_0.distcp": f"step={step} rank={rank} ".encode() * 64,
        f"__{rank}_frozen0.distcp": f"frozen v{1 if step < 5 else 2} rank={rank} ".encode() * 512,
        f"__{rank}_buffers0.distcp": f"buffers v{(step + 1) // 2} rank={rank} ".encode() * 32,
    }


def _stage(layout: CheckpointLayout, remote: Remote | None, step: int, rank: int) -> None:
    """One rank's save of ``step`` through the real rank path, sharing a piece the latest committed step holds
    with the same bytes (a hard link; in a bucket, not uploaded)."""
    t = RankTarget(layout=layout, rank=rank, world_size=2, attempt="a1", remote=remote)
    staged = rank_save.prepare(t, step)
    share = t.store.piece_source(rank, staged, {"x": "frozen"})
    reused = set()
    entries = []
    for name, data in _files(step, rank).items():
        before = share.previous.get(name)
        if before is not None and before.hash == xxhash.xxh3_128(data).hexdigest() and share.reuse(name):
            reused.add(name)
            entries.append(before)
            continue
        (staged / name).write_bytes(data)
        entries.append(describe(staged, name))
    rank_save.finish(t, staged, step, TEST_FORMAT, tuple(entries), reused=frozenset(reused))


class _Store:
    """The six committed steps and how the test deletes, restores and checks them, on one backend."""

    def __init__(self, tmp: Path, remote: Remote | None) -> None:
        self.template = CheckpointLayout(tmp / "template")
        for d in self.template.checkpoint_dirs():
            d.mkdir(parents=True, exist_ok=True)
        self.remote = remote
        for step in STEPS:
            for rank in (0, 1):
                _stage(self.template, remote, step, rank)
            c = (
                remote_committer(self.template, remote)
                if remote is not None
                else Committer(self.template, CommitPolicy(world_size=2))
            )
            with c.hold():
                assert c.commit_ready() == [step]
        self.shared = self._count_shared()

    def _count_shared(self) -> int:
        if self.remote is not None:
            listed = [e.hash for s in STEPS for e in _manifest(self.remote, s) if is_piece(e.path)]
            return len(listed) - len(set(listed))
        inodes = [
            (self.template.committed_step(s) / n).stat().st_ino for s in STEPS for n in _files(s, 0) if is_piece(n)
        ]
        return len(inodes) - len(set(inodes))


def _link(src: str, dst: str) -> None:
    import os  # noqa: PLC0415

    os.link(src, dst)


def test_every_retention_order_of_six_sharing_steps_keeps_the_others_verifiable(tmp_path: Path) -> None:
    """All 720 orders of deleting 6 committed steps that share pieces (hard links), one step at a time by
    retention's own removal: after each deletion every remaining step verifies. Walked depth first, a deleted
    step is put back (linked from the template) before the next branch."""
    import shutil  # noqa: PLC0415

    store = _Store(tmp_path, None)
    assert store.shared >= 6, "the six steps share pieces"
    work = CheckpointLayout(tmp_path / "work")
    work.checkpoints.mkdir(parents=True)

    def put_back(step: int) -> None:  # links to the template's files: the steps keep sharing their pieces
        shutil.copytree(store.template.committed_step(step), work.committed_step(step), copy_function=_link)

    for step in STEPS:
        put_back(step)
    orders = 0

    def walk(remaining: tuple[int, ...]) -> None:
        nonlocal orders
        if not remaining:
            orders += 1
            return
        for step in remaining:
            retire(work.checkpoints, (step,))
            rest = tuple(s for s in remaining if s != step)
            assert sorted(p.name for p in work.checkpoints.glob("step_*")) == sorted(f"step_{s}" for s in rest)
            for s in rest:
                verify_committed(work.committed_step(s), s)
            walk(rest)
            put_back(step)

    walk(STEPS)
    assert orders == 720


def _walk(
    restore: Callable[[frozenset[int]], None],
    remove: Callable[[int], None],
    state: Callable[[], frozenset[int]],
    verify: Callable[[], None],
) -> int:
    transitions = 0
    for size in range(len(STEPS)):
        for removed in _subsets(size):
            for step in STEPS:
                if step in removed:
                    continue
                restore(removed)
                remove(step)
                verify()
                assert state() == frozenset(STEPS) - removed - {step}
                transitions += 1
    return transitions


def _subsets(size: int) -> list[frozenset[int]]:
    import itertools  # noqa: PLC0415

    return [frozenset(c) for c in itertools.combinations(STEPS, size)]


def test_every_retention_order_in_a_bucket_deletes_a_piece_only_when_no_manifest_lists_it(
    tmp_path: Path, bucket: str, prefix: str
) -> None:
    """In a bucket: from the state of each subset of removed steps, removing any other step leaves exactly the
    objects the remaining manifests list (their attempts' objects and the pieces they list), each verifying."""
    layout = CheckpointLayout(tmp_path / "run")
    for d in layout.checkpoint_dirs():
        d.mkdir(parents=True, exist_ok=True)
    template = Remote(S3Url(bucket, f"{prefix}/template"), cache_dir=layout.run_dir)
    store = _Store(tmp_path, template)
    assert store.shared >= 6
    all_keys = _unleased(keys(bucket, template.root.prefix + "/"), template)
    per_step = {s: _step_keys(template, s) for s in STEPS}

    def expected(remaining: frozenset[int]) -> set[str]:
        return {k for s in remaining for k in per_step[s]} | {template.key("latest")}

    work = Remote(S3Url(bucket, f"{prefix}/work"), cache_dir=layout.run_dir)
    c = remote_committer(layout, work)
    moved = lambda k: work.root.prefix + k[len(template.root.prefix) :]  # noqa: E731
    current: set[str] = set()

    def restore(removed: frozenset[int]) -> None:
        want = {moved(k): k for k in expected(frozenset(STEPS) - removed)}
        extra = sorted(current - set(want))
        if extra:
            work.store.delete(extra)
        for k in sorted(set(want) - current):  # copy back what the last removal deleted
            work.store.copy(want[k], k)
        current.clear()
        current.update(want)

    def remove(step: int) -> None:
        bucket_store(c).remove_step(step)

    def state() -> frozenset[int]:
        now = _unleased(keys(bucket, work.root.prefix + "/"), work)
        current.clear()
        current.update(now)
        remaining = frozenset(work.committed())
        assert now == {moved(k) for k in expected(remaining)}, "objects left that no manifest lists, or missing"
        return remaining

    checked: set[frozenset[int]] = set()

    def verify() -> None:
        remaining = frozenset(work.committed())
        if remaining in checked:
            return
        checked.add(remaining)
        for s in remaining:
            found = work.read_manifest(s)
            assert found is not None
            work.fetch_verified(found[0], None)

    assert set(all_keys) == expected(frozenset(STEPS))
    assert _walk(restore, remove, state, verify) == 6 * 2**5
    assert len(checked) == 2**6 - 1  # every non-empty subset of remaining steps, each verified in full


def _unleased(found: dict[str, int], remote: Remote) -> set[str]:
    """The keys but the committer lease's records (one per holder, named by its epoch and token)."""
    return {k for k in found if not k.startswith(remote.key(LEASE) + "/")}


def _step_keys(remote: Remote, step: int) -> set[str]:
    """The objects step ``step`` needs: its manifest, its attempt's objects (files, markers), the pieces it lists."""
    found = remote.read_manifest(step)
    assert found is not None
    manifest = found[0]
    attempt = set(keys(remote.root.bucket, remote.attempt_prefix(step, manifest.attempt)))
    return {remote.manifest_key(step)} | attempt | remote.piece_keys(manifest.files)


def test_a_crash_in_bucket_retention_never_leaves_a_committed_step_without_its_pieces(
    tmp_path: Path, bucket: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention interrupted after a step's manifest is deleted, before its pieces are, or at its first request:
    every committed step still verifies at once, and the next committer's last pass leaves exactly what the
    committed manifests list (the crashed deletion's objects and orphaned pieces swept)."""
    layout = CheckpointLayout(tmp_path / "run")
    for d in layout.checkpoint_dirs():
        d.mkdir(parents=True, exist_ok=True)
    remote = Remote(S3Url(bucket, f"{prefix}/r"), cache_dir=layout.run_dir)
    _Store(tmp_path, remote)
    for step, fault in ((1, "retention.after_manifest"), (2, "retention.pieces"), (3, "s3.delete")):
        monkeypatch.setenv("PIPELINE_FAULTS", fault)
        with pytest.raises(InjectedFault):
            bucket_store(remote_committer(layout, remote)).remove_step(step)
        monkeypatch.delenv("PIPELINE_FAULTS")
        assert assert_invariants(layout, remote) == 6, f"after a crash at {fault}"
        c = remote_committer(layout, remote)
        with c.hold():
            c.recover()
            c.finish(None, lambda: False)
        remaining = remote.committed()
        want = {k for s in remaining for k in _step_keys(remote, s)} | {remote.key("latest")}
        assert _unleased(keys(bucket, remote.root.prefix + "/"), remote) == want, f"after the sweep after {fault}"
    assert remote.committed() == [3, 4, 5, 6]  # the crash at the first request deleted nothing

    # A refused attempt that shares pieces: quarantined without them, its reason naming what it shared.
    for rank in (0, 1):
        _stage(layout, remote, 7, rank)
    own = remote.attempt_prefix(7, "a1") + "__1_0.distcp"
    size = keys(bucket, own)[own]
    remote.store.put(own, b"x" * size)  # same size, other bytes
    c = remote_committer(layout, remote)
    with c.hold():
        assert c.commit_ready() == []
    (reason,) = [k for k in keys(bucket, remote.key("quarantine") + "/") if k.endswith("reason.txt")]
    text = remote.store.get(reason)[0].decode()  # type: ignore[index]
    assert "__1_0.distcp" in text and "shared pieces its markers list" in text and "4 object(s)" in text, text
    assert_invariants(layout, remote)


# --- the app: a run with frozen layers ---------------------------------------------------------------------------

FROZEN = "model.freeze=[model.embed_tokens.*,model.layers.0.*]"


def test_frozen_layers_resume_and_export_bit_identical_to_a_run_without_sharing(tmp_path: Path) -> None:
    """``+experiment=tiny`` with its embedding and first layer frozen: without sharing (``checkpoint.dedup=false``)
    in one go, and with sharing stopped at step 4 then continued (a new launch: step 8 links step 4's pieces).
    Both steps load to the same tensors, and the consolidated weights and the export are the same bytes."""
    common = ("+experiment=tiny", f"run.root={tmp_path}", "run.create=true", FROZEN)
    launches = [  # two runs at once: each mostly waits on its jobs
        subprocess.Popen(
            [sys.executable, "-m", "pipeline", *common, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args in (
            ("run.id=plain", "checkpoint.dedup=false"),
            ("run.id=shared", "train.stop_after_step=4", "export=none"),
        )
    ]
    for launch in launches:
        out, _ = launch.communicate(timeout=600)
        assert launch.returncode == 0, out
    proc = run_cli(f"run.root={tmp_path}", "run.id=shared", "export=hf")  # the first launch said export=none
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plain, shared = (RunLayout.for_run(tmp_path, "tiny", r) for r in ("plain", "shared"))

    pieces4 = sorted(p.name for p in shared.committed_step(4).glob("__*") if is_piece(p.name))
    assert pieces4 == ["__0_frozen0.distcp", "__1_frozen0.distcp"]
    for name in pieces4:
        a, b = (shared.committed_step(s) / name for s in (4, 8))
        assert a.stat().st_ino == b.stat().st_ino, f"step 8's {name} is step 4's file (one inode)"
    assert not any(is_piece(p.name) for p in plain.committed_step(8).iterdir())
    saves = {e["step"]: e for e in _events(shared) if e["event"] == "checkpoint"}
    plain_saves = {e["step"]: e for e in _events(plain) if e["event"] == "checkpoint"}
    assert saves[8]["shared_bytes"] > 0 and saves[8]["bytes"] + saves[8]["shared_bytes"] >= plain_saves[8]["bytes"]
    assert saves[8]["bytes"] < plain_saves[8]["bytes"] - saves[8]["shared_bytes"] / 2

    for step in (4, 8):
        a, b = _load_plain(plain.committed_step(step)), _load_plain(shared.committed_step(step))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"step {step} differs"
    for area in (lambda run: run.consolidated_step(8), lambda run: run.export_step(8)):
        files = {p.name for p in area(plain).iterdir() if p.suffix == ".safetensors" or p.name == "config.json"}
        assert files and all(hash_file(area(plain) / f) == hash_file(area(shared) / f) for f in files)


def _events(run: RunLayout) -> list[dict[str, Any]]:
    import json  # noqa: PLC0415

    return [json.loads(line) for line in run.metrics.read_text().splitlines()]


def test_shared_groups_name_frozen_tied_weights_and_buffers_by_their_state_dict_keys() -> None:
    """Every state-dict key of a frozen weight is grouped, a tied one under each of its names (GPT-2's ``lm_head``
    is ``wte``); buffers apart; what trains is in no group. ``model.freeze`` refuses a pattern matching nothing."""
    from pipeline.errors import ConfigError  # noqa: PLC0415
    from pipeline.workload.model import freeze  # noqa: PLC0415

    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(8, 4)
    m.head = torch.nn.Linear(4, 8, bias=False)
    m.head.weight = m.emb.weight  # tied
    m.norm = torch.nn.BatchNorm1d(4)
    m.adapter = torch.nn.Linear(4, 4)
    freeze(m, ["emb.*", "norm.*"])
    groups = pieces.shared_groups(m, "model")
    assert {k for k, g in groups.items() if g == "frozen"} == {
        "model.emb.weight",
        "model.head.weight",
        "model.norm.weight",
        "model.norm.bias",
    }
    assert {k for k, g in groups.items() if g == "buffers"} == {
        "model.norm.running_mean",
        "model.norm.running_var",
        "model.norm.num_batches_tracked",
    }
    with pytest.raises(ConfigError, match=r"'layers\.\*' matches no parameter of this model"):
        freeze(m, ["layers.*"])
