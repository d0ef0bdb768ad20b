"""The fast tier (``Checkpointer(fast_every=...)``): node-local copies and peer replicas, restored only when every
byte verifies, falling back copy by copy, step by step, then to the durable tier, within one restart.

The distributed tests run the DDP example on 2 ranks with a node-local dir per rank (``node0``, ``node1``: two
"nodes" on one machine; ``tests/multinode`` does it on real namespace nodes), kill it after fast step 12, and
restart it from copies of that state with one node's dir lost or damaged as a scenario asks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline.checkpoint.fast.codec import fill, snapshot, unpack
from pipeline.checkpoint.fast.landing import Landing, destinations, prime
from pipeline.checkpoint.fast.local import Copy, run_key
from pipeline.checkpoint.fast.pieces import inline_size, objects
from pipeline.checkpoint.fast.restore import plan
from pipeline.checkpoint.save.state import apply_state, save_state
from pipeline.errors import CheckpointFormatError, VerificationError
from pipeline.rundir.layout import RunLayout
from tests.conftest import ROOT, run_cli, train_losses

pytestmark = pytest.mark.xdist_group("fast_tier")  # one worker: the killed run is made once

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
FAST, EVERY, KILL_AFTER = 2, 8, 12


# -- the decision, in-process ------------------------------------------------------------------------------------


def _copies(step: int, world: int, attempt: str = "a", salt: str = "") -> list[Copy]:
    table = tuple((100 + r, f"h{step}{salt}-{r}") for r in range(world))
    return [Copy(step, r, "own", world, attempt, *table[r], table) for r in range(world)]


def _replica(c: Copy) -> Copy:
    return Copy(c.step, c.shard, "replica", c.world_size, c.attempt, c.size, c.hash, c.table)


def test_the_decision_takes_the_newest_complete_step_from_any_mix_of_copies() -> None:
    s10, s12 = _copies(10, 2), _copies(12, 2)
    # node 0 holds rank 0's own copies and rank 1's replicas; node 1 (rank 1) was replaced: it holds nothing
    reports = [[s10[0], _replica(s10[1]), s12[0], _replica(s12[1])], []]
    p = plan(reports, 2, floor=8, excluded=set())
    assert p is not None and p.step == 12 and [(h, c.kind) for h, c in p.sources] == [(0, "own"), (0, "replica")]
    # the replica of rank 1's step 12 failed: step 10, in the same decision loop
    p = plan(reports, 2, floor=8, excluded={(0, _replica(s12[1]))})
    assert p is not None and p.step == 10
    # nothing at or above the durable tier's newest step: the durable tier
    assert plan(reports, 2, floor=13, excluded=set()) is None
    # another world size never restores from the fast tier
    assert plan(reports, 4, floor=0, excluded=set()) is None


def test_a_rank_whose_node_holds_its_copy_takes_that_copy_whichever_rank_of_the_node_reported_it() -> None:
    """Two ranks a node: only a node's keeper (its lowest rank) reports what the node dir holds, so rank 1's own
    copy is reported by rank 0; it is still rank 1's own node's copy (mapped, nothing moves), never the replica on
    the other node, which a choice by holder rank alone would take to spread the load."""
    s12 = _copies(12, 4)
    reports = [[s12[0], s12[1], _replica(s12[2]), _replica(s12[3])], [], [s12[2], s12[3], _replica(s12[0]),
               _replica(s12[1])], []]  # fmt: skip
    p = plan(reports, 4, floor=0, excluded=set(), nodes=["a", "a", "b", "b"])
    assert p is not None and [(h, c.kind) for h, c in p.sources] == [(0, "own"), (0, "own"), (2, "own"), (2, "own")]


def test_a_copy_whose_table_is_outvoted_is_rejected_and_never_mixed_in() -> None:
    good, stale = _copies(12, 2), _copies(12, 2, salt="old")
    reports = [[good[0], _replica(stale[1])], [good[1], _replica(good[0])]]
    p = plan(reports, 2, floor=0, excluded=set())
    assert p is not None and p.step == 12 and p.table == good[0].table
    assert [(h, c.kind) for h, c in p.sources] == [(0, "own"), (1, "own")]
    assert [(h, c) for (h, c), _ in p.outvoted] == [(0, _replica(stale[1]))]
    # two launches' copies of one step (another attempt) never make one step together
    other = _copies(12, 2, attempt="b", salt="b")
    assert plan([[good[0]], [other[1]]], 2, floor=0, excluded=set()) is None


def test_a_blob_round_trips_without_pickle_and_refuses_what_it_cannot_hold() -> None:
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(0), "h": torch.ones(3, dtype=torch.bfloat16)},
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}], "state": {}},
        "data": {"pos": 7, "seed": None, "raw": b"\x00\xff", 3: "int key", "flags": torch.tensor([True, False])},
    }
    snap = snapshot(state)
    back = unpack(bytearray(snap.view()), "test")
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["model"]["b"].numel() == 0
    assert torch.equal(back["model"]["h"], state["model"]["h"]) and back["data"].pop("flags").tolist() == [True, False]
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.99) and back["data"] == {
        k: v for k, v in state["data"].items() if k != "flags"
    }
    # the blob is a safetensors file (its own reader agrees), and the next snapshot reuses its buffer
    assert torch.equal(st_load(bytes(snap.view()))["t0"], state["model"]["w"])
    state["model"]["w"] += 1
    again = snapshot(state, reuse=snap)
    assert again.data.data_ptr() == snap.data.data_ptr() and unpack(again.view(), "test")["model"]["w"][0, 0] == 1
    with pytest.raises(CheckpointFormatError, match="data.fn is a function"):
        snapshot({"data": {"fn": lambda: 0}})
    blob = bytes(snapshot(torch.ones(2)).view())
    assert unpack(blob, "test").equal(torch.ones(2))
    for bad in (b"\xff" * 8 + blob[8:], blob[:-3], st_save({"t0": torch.ones(2)})):  # the last: not ours
        with pytest.raises(CheckpointFormatError, match="not a readable fast-tier copy"):
            unpack(bad, "test")


_TWO_D = """
import sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from examples.fsdp2_tp_train import TinyLM, parallelize
from pipeline.checkpoint.fast.codec import fill, snapshot, unpack
from pipeline.checkpoint.save.state import apply_state, save_state
from pipeline.errors import CheckpointFormatError, VerificationError
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)  # rank 1 of 4, no peers: no comms
def state(dp, tp, seed):
    model = TinyLM()
    parallelize(model, dp, tp)
    sd = model.state_dict()
    with torch.no_grad():  # the fake group moves no data: give every local shard values of its own
        for i, t in enumerate(sd.values()):
            t.to_local().copy_(torch.randn(t.to_local().shape, generator=torch.Generator().manual_seed(seed + i)))
    return {"model": sd}
saved = state(2, 2, 0)
blob = bytes(snapshot(saved).view())
same = state(2, 2, 100)
fill(same, unpack(blob, "copy"))
assert all(same["model"][k].to_local().equal(v.to_local()) for k, v in saved["model"].items())
other = state(4, 1, 100)
before = {k: v.to_local().clone() for k, v in other["model"].items()}
try:
    fill(other, unpack(blob, "copy"))
except CheckpointFormatError as e:
    print(e)
assert all(other["model"][k].to_local().equal(v) for k, v in before.items())
"""


def test_received_bytes_land_in_the_tensors_fill_would_copy_them_into_and_nowhere_else() -> None:
    saved = {
        "model": {"w": torch.randn(64, 64), "v": torch.randn(32, 64), "t": torch.randn(64, 64), "s": torch.ones(3)},
        "optim": {"state": {0: {"exp_avg": torch.randn(64, 64)}}, "param_groups": [{"lr": 0.1}]},
        "rng": [torch.arange(2048, dtype=torch.int64)],
    }
    blob = snapshot(saved)
    template = {
        "model": {"w": torch.zeros(64, 64), "v": torch.zeros(32, 64, dtype=torch.float64),  # another dtype
                  "t": torch.zeros(64, 64).t(), "s": torch.zeros(3)},  # not contiguous; a small one
        "optim": {"state": {0: {"exp_avg": torch.zeros(64, 64)}}},
        "rng": [torch.zeros(2048, dtype=torch.int64)],  # in a list: fill never lays lists into the template
    }  # fmt: skip
    places = destinations(template, blob.view())
    w, m = template["model"]["w"], template["optim"]["state"][0]["exp_avg"]
    assert sorted(t.data_ptr() for t in places.values()) == sorted(
        [w.data_ptr(), m.data_ptr(), template["model"]["s"].data_ptr()]
    )
    for at, into in places.items():  # what a restore receives at that offset, straight into the tensor
        into.copy_(blob.data[at : at + into.numel()])
    assert torch.equal(w, saved["model"]["w"]) and torch.equal(m, saved["optim"]["state"][0]["exp_avg"])
    loaded = fill(template, unpack(blob.view(), "test"))
    assert loaded["model"]["w"] is w and torch.equal(loaded["model"]["v"], saved["model"]["v"].double())
    assert torch.equal(loaded["model"]["t"], saved["model"]["t"]) and torch.equal(loaded["rng"][0], saved["rng"][0])
    assert destinations(template, memoryview(b"\x10" + bytes(40))) == {}  # a header that does not parse: none


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_new_optimizer_is_primed_from_the_blob_without_a_step_and_loads_it_exactly() -> None:
    model, opt = _trained(0)
    for _ in range(3):
        _step(model, opt)
    blob = snapshot(save_state({"model": model, "optim": opt}, 3, 0))
    new_model, new_opt = _trained(1)  # a new process: its own initial weights, an optimizer without state
    primed = prime(new_opt, blob.view())
    assert primed == list(new_model.parameters()) and all(p.grad is None for p in primed)  # no step was taken
    assert new_opt.state[primed[0]]["exp_avg"].shape == primed[0].shape
    new_opt.state.clear()
    steps: list[int] = []
    hook = new_opt.register_step_pre_hook(lambda *_: steps.append(1))  # DCP's template takes a step without it
    state = {"model": new_model, "optim": new_opt}
    landing = Landing(lambda: save_state(state, 0, 0), lambda t: apply_state(state, t), "test", new_opt)
    assert landing.load(blob.view()) == 3 and not steps
    hook.remove()
    _step(model, opt)
    _step(new_model, new_opt)  # the next step is the one the saved run took
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), new_model.parameters(), strict=True))
    landing.discard()
    assert not new_opt.state  # nothing restored: the primed state is taken back
    other, other_opt = _trained(2)
    other_opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})  # another layout: not primed
    assert prime(other_opt, blob.view()) == [] and not other_opt.state


def test_a_fresh_start_after_received_bytes_went_into_the_state_is_refused(one_rank: Any) -> None:
    landing = Landing(lambda: {}, lambda state: 0, "rank 0's fast copy")
    landing.check_fresh(0, one_rank)  # nothing landed: a fresh start is a fresh start
    landing.landed = 4096
    landing.check_fresh(12, one_rank)  # the step restored (fast or durable) overwrote it
    with pytest.raises(VerificationError, match="went into the model's state"):
        landing.check_fresh(0, one_rank)
    into = {"w": torch.zeros(4)}
    loaded = Landing(lambda: into, lambda state: 11, "rank 0's fast copy")  # a copy that records another step
    blob = snapshot({"w": torch.ones(4)})
    assert loaded.load(blob.view()) == 11 and loaded.landed == 0 and torch.equal(into["w"], torch.ones(4))
    with pytest.raises(VerificationError, match="went into the model's state"):
        loaded.check_fresh(0, one_rank)  # refused for its step, then a fresh start: its bytes are in the state


def test_a_2d_shard_restores_only_into_the_same_piece_of_its_tensor() -> None:
    """FSDP2 x TP (the 2-D example's layout) as rank 1 of 4 under torch's fake process group: a copy made at
    dp=2, tp=2 restores at the same degrees; at dp=4, tp=1 its first tensor (the embedding: rows 32..48 then,
    rows 16..32 now, the same local shape) is refused in one line before anything is written."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _TWO_D], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == (
        "fast tier: .model.embed.weight is the shard [16, 32] at [32, 0] of [64, 32] in the copy, the shard "
        "[16, 32] at [16, 0] of [64, 32] here (another parallel layout: resume from the durable tier)"
    )


# -- restarts from damaged tiers, with torchrun --------------------------------------------------------------------


def _example(out: Path, nodes: Path, steps: int, *extra: str) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc-per-node", "2", "examples/ddp_train.py", "--out", str(out),
            "--steps", str(steps), "--every", str(EVERY), "--fast-every", str(FAST),
            "--fast-dir", str(nodes / "node{rank}"), *extra]  # fmt: skip


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)$", text, re.M)}


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, str]]:
    """The example killed (SIGKILL, whole job) once fast step 12 is on both nodes: durable latest 8; and the
    losses of an uninterrupted run."""
    base = tmp_path_factory.mktemp("fast")
    ref = subprocess.run(_example(base / "ref", base / "refnodes", 16), cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    proc = subprocess.Popen(_example(base / "run", base, 40, "--sleep", "0.5"), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    key = run_key((base / "run").resolve())
    markers = [base / f"node{n}" / key / kind / f"rank_{r}" / f"step_{KILL_AFTER}.json"
               for n, kind, r in ((0, "own", 0), (0, "replica", 1), (1, "own", 1), (1, "replica", 0))]  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not all(m.exists() for m in markers):
            assert proc.poll() is None and time.monotonic() < deadline, "the example ended before the kill"
            time.sleep(0.05)
    finally:
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        for pid in tree:  # the whole job at once (torchrun's workers run in sessions of their own)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    return base, _losses(ref.stdout)


def _scenario(killed: tuple[Path, dict[int, str]], tmp: Path) -> tuple[Path, Path, dict[int, Path]]:
    """A copy of the killed run: its run dir, its nodes' base dir, and each node's fast dir for the run."""
    base, _ = killed
    run, nodes = tmp / "run", tmp / "nodes"
    shutil.copytree(base / "run", run, symlinks=True)
    old, new = run_key((base / "run").resolve()), run_key(run.resolve())
    fast = {}
    for n in (0, 1):
        shutil.copytree(base / f"node{n}" / old, nodes / f"node{n}" / new)
        fast[n] = nodes / f"node{n}" / new
    return run, nodes, fast


def _restart(run: Path, nodes: Path, steps: int) -> tuple[dict[str, object], dict[int, str]]:
    done = subprocess.run(_example(run, nodes, steps), cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run / "checkpoints" / "resumed.json").read_text()), _losses(done.stdout)


def _quarantined(fast: Path) -> list[str]:
    return sorted(json.loads(p.read_text())["why"] for p in (fast / "quarantine").glob("*.why.json"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_flipped_byte_and_a_stale_replica_are_quarantined_and_the_peer_copy_restores_the_step(
    killed: tuple[Path, dict[int, str]], tmp_path: Path
) -> None:
    run, nodes, fast = _scenario(killed, tmp_path)
    _flip(fast[1] / "own" / "rank_1" / f"step_{KILL_AFTER}.bin")
    # node 1's replica of rank 0's step 12 holds step 10's bytes, its marker made to match them (a rebuilt replica)
    stale = fast[1] / "replica" / "rank_0"
    marker = json.loads((stale / f"step_{KILL_AFTER - FAST}.json").read_text())
    (stale / f"step_{KILL_AFTER}.bin").write_bytes((stale / f"step_{KILL_AFTER - FAST}.bin").read_bytes())
    (stale / f"step_{KILL_AFTER}.json").write_text(json.dumps({**marker, "step": KILL_AFTER}))
    rec, losses = _restart(run, nodes, 16)
    assert rec["tier"] == "fast" and rec["step"] == KILL_AFTER, rec
    assert [s["from"] for s in rec["sources"]] == ["own copy", "replica on rank 0"], rec  # type: ignore[attr-defined]
    assert set(rec["phases_s"]) == {"scan", "template", "move", "hash", "load"}, rec  # type: ignore[arg-type]
    assert _quarantined(fast[1]) == [
        "its bytes do not match the step's table",
        f"its step {KILL_AFTER} table disagrees with the one 3 other holder(s) recorded",  # the flipped copy too
    ]
    assert losses == {s: killed[1][s] for s in range(KILL_AFTER + 1, 17)}, "losses differ after the fast restore"
    status = subprocess.run([sys.executable, "-m", "pipeline.status", str(run)], capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    assert f"last resume: step {KILL_AFTER} from the fast tier" in status and "rank 1: replica on rank 0" in status
    assert status.count("quarantined: ") == 2, status


@pytest.mark.slow
@pytest.mark.distributed
def test_a_replaced_node_with_a_truncated_replica_falls_back_a_step_and_restores_from_the_peer(
    killed: tuple[Path, dict[int, str]], tmp_path: Path
) -> None:
    run, nodes, fast = _scenario(killed, tmp_path)
    shutil.rmtree(fast[1])  # node 1 replaced: an empty local tier
    rep = fast[0] / "replica" / "rank_1" / f"step_{KILL_AFTER}.bin"
    rep.write_bytes(rep.read_bytes()[:-10])
    rec, losses = _restart(run, nodes, 16)
    assert rec["tier"] == "fast" and rec["step"] == KILL_AFTER - FAST, rec
    assert [s["from"] for s in rec["sources"]] == ["own copy", "replica on rank 0"], rec  # type: ignore[attr-defined]
    assert len(_quarantined(fast[0])) == 1 and "bytes, the marker says" in _quarantined(fast[0])[0]
    assert losses == {s: killed[1][s] for s in range(KILL_AFTER - FAST + 1, 17)}, "losses differ"


def _copy_of(fast: Path, kind: str, shard: int, step: int = KILL_AFTER) -> Copy:
    return Copy.of(json.loads((fast / kind / f"rank_{shard}" / f"step_{step}.json").read_text()))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_node_keeps_one_copy_of_what_a_rank_and_its_replica_share(killed: tuple[Path, dict[int, str]]) -> None:
    """DDP: node 0 holds rank 0's step and rank 1's replica; the weights and moments are the same bytes, kept
    once (content-addressed), so the replica's own bytes are its inline pieces and its RNG state."""
    base, _ = killed
    node0 = base / "node0" / run_key((base / "run").resolve())
    own, rep = _copy_of(node0, "own", 0), _copy_of(node0, "replica", 1)
    size = {h: n for n, h, obj in (*own.parts, *rep.parts) if obj}
    shared = objects(own.parts) & objects(rep.parts)
    unique = sum(size[h] for h in objects(rep.parts) - shared)
    assert shared and unique < 0.25 * sum(size[h] for h in objects(rep.parts)), (own.parts, rep.parts)
    assert (node0 / "replica" / "rank_1" / f"step_{KILL_AFTER}.bin").stat().st_size == inline_size(rep.parts)
    assert objects(own.parts) | objects(rep.parts) <= {p.stem for p in (node0 / "objects").glob("*.bin")}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_damaged_shared_object_is_quarantined_and_the_peer_sends_its_bytes(
    killed: tuple[Path, dict[int, str]], tmp_path: Path
) -> None:
    """Node 1's object of a weight that rank 1's copy and rank 0's replica both name is damaged: rank 1's own
    copy fails its check, the object is quarantined, and rank 1 restores from its replica on node 0, node 0
    sending only the object node 1 lost (the rest node 1 still holds)."""
    run, nodes, fast = _scenario(killed, tmp_path)
    shared = sorted(objects(_copy_of(fast[1], "own", 1).parts) & objects(_copy_of(fast[1], "replica", 0).parts))
    _flip(fast[1] / "objects" / f"{shared[0]}.bin")
    rec, losses = _restart(run, nodes, 16)
    assert rec["tier"] == "fast" and rec["step"] == KILL_AFTER, rec
    assert [s["from"] for s in rec["sources"]] == ["own copy", "replica on rank 0"], rec  # type: ignore[attr-defined]
    problems = rec["fast_problems"]
    assert any(f"object {shared[0]}: its bytes do not match its name" in q for q in problems), problems  # type: ignore[attr-defined]
    assert not (fast[1] / "objects" / f"{shared[0]}.bin").exists()
    assert _quarantined(fast[1]) == ["its bytes do not match its name", "its bytes do not match the step's table"]
    assert losses == {s: killed[1][s] for s in range(KILL_AFTER + 1, 17)}, "losses differ after the fast restore"


@pytest.mark.slow
@pytest.mark.distributed
def test_both_copies_of_a_shard_lost_falls_back_to_the_durable_tier(
    killed: tuple[Path, dict[int, str]], tmp_path: Path
) -> None:
    run, nodes, fast = _scenario(killed, tmp_path)
    shutil.rmtree(fast[1])
    shutil.rmtree(fast[0] / "replica")
    rec, losses = _restart(run, nodes, 16)
    assert rec["tier"] == "durable" and rec["step"] == EVERY, rec
    assert losses == {s: killed[1][s] for s in range(EVERY + 1, 17)}


@pytest.mark.slow
@pytest.mark.distributed
def test_bytes_received_into_the_state_that_fail_their_hash_are_overwritten_by_the_durable_step(
    killed: tuple[Path, dict[int, str]], tmp_path: Path
) -> None:
    """Node 1 replaced: rank 1's bytes arrive from node 0 straight into its model and optimizer (the durable tier
    has step 8 to overwrite them). Node 0's biggest object of step 12 and of step 10 is damaged: each lands in
    rank 1's state, fails its hash, and the restore falls back step by step to the durable step, whose load
    leaves nothing of them: the losses are an uninterrupted run's."""
    run, nodes, fast = _scenario(killed, tmp_path)
    shutil.rmtree(fast[1])
    for step in (KILL_AFTER, KILL_AFTER - FAST):
        parts = _copy_of(fast[0], "replica", 1, step).parts
        _flip(fast[0] / "objects" / f"{max((n, h) for n, h, obj in parts if obj)[1]}.bin")
    rec, losses = _restart(run, nodes, 16)
    assert rec["tier"] == "durable" and rec["step"] == EVERY, rec
    landed = rec["landed_bytes"]
    assert landed[0] == 0 and landed[1] > 0.9 * 2 * sum(n for n, _, o in parts if o), rec  # type: ignore[index]
    assert losses == {s: killed[1][s] for s in range(EVERY + 1, 17)}, "the durable step did not overwrite them"


def _four(out: Path, nodes: Path, steps: int, *extra: str) -> list[str]:
    """The DDP example on 4 ranks, 2 a "node": ranks 0 and 1 share ``node0``'s dir, ranks 2 and 3 ``node1``'s."""
    return [TORCHRUN, "--standalone", "--nproc-per-node", "4", "examples/ddp_train.py", "--out", str(out),
            "--steps", str(steps), "--every", str(EVERY), "--fast-every", str(FAST), "--ranks-per-node", "2",
            "--fast-dir", str(nodes / "node{node}"), *extra]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_of_a_node_keep_one_copy_and_a_replaced_node_restores_both_from_its_peer(tmp_path: Path) -> None:
    """Two ranks per node (4 DDP ranks): node 0 holds ranks 0 and 1's copies and the replicas of ranks 2 and 3
    (one replica per rank, on the other node), and all four name the same objects, written once: the node's
    ``objects/`` holds one copy of the model and optimizer, the rest is each copy's inline bytes. Node 1 replaced
    (its dir gone), ranks 2 and 3 restore from their replicas on node 0 and train on with the losses of an
    uninterrupted run."""
    run, nodes = tmp_path / "run", tmp_path / "nodes"
    ref = subprocess.run(_four(tmp_path / "ref", tmp_path / "refnodes", 16), cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    subprocess.run(_four(run, nodes, KILL_AFTER), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
                   check=True)  # fmt: skip
    node0 = nodes / "node0" / run_key(run.resolve())
    copies = [_copy_of(node0, kind, r) for kind, r in (("own", 0), ("own", 1), ("replica", 2), ("replica", 3))]
    shared = set.intersection(*(objects(c.parts) for c in copies))  # the weights and moments: DDP replicates them
    for c in copies:  # each copy's own file holds its inline pieces only; its objects are the node's
        size = {h: n for n, h, obj in c.parts if obj}
        assert sum(size[h] for h in shared) > 0.5 * sum(size.values()), (c.label, c.parts)
        assert (node0 / c.kind / f"rank_{c.shard}" / f"step_{KILL_AFTER}.bin").stat().st_size == inline_size(c.parts)
        assert objects(c.parts) <= {p.stem for p in (node0 / "objects").glob("*.bin")}, f"{c.label}: objects lost"
    shutil.rmtree(nodes / "node1")
    done = subprocess.run(_four(run, nodes, 16), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rec = json.loads((run / "checkpoints" / "resumed.json").read_text())
    assert rec["tier"] == "fast" and rec["step"] == KILL_AFTER, rec
    assert [s["from"] for s in rec["sources"]] == ["own copy"] * 2 + ["replica on rank 0"] * 2, rec  # type: ignore[attr-defined]
    want = _losses(ref.stdout)
    assert _losses(done.stdout) == {s: want[s] for s in range(KILL_AFTER + 1, 17)}, "losses differ after the restore"


# -- the app: checkpoint.fast.* ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_the_app_resumes_a_killed_train_from_the_fast_tier_bit_identically(tmp_path: Path) -> None:
    """Durable saves every 8 steps, fast every 2; rank 1 dies while saving step 12 durably: latest stays 8, the
    rerun resumes from fast step 10 and trains steps 11 and 12 to the same losses."""
    args = ["+experiment=tiny", f"run.root={tmp_path}", "run.id=f", "run.create=true", "train.steps=12",
            "checkpoint.every=8", "checkpoint.fast.every=2", f"checkpoint.fast.dir={tmp_path / 'local'}",
            "export=none"]  # fmt: skip
    plan = run_cli(*args, "dry_run=true")
    assert "fast:   every 2 steps, each rank's state in" in plan.stdout, plan.stdout
    kill = {"PIPELINE_FAULTS": "shard_save.before_marker@rank=1@step=12@action=exit"}
    first = run_cli(*args, env=kill)
    assert first.returncode == 1 and "failed; latest = step 8" in first.stdout, first.stdout + first.stderr
    layout = RunLayout.for_run(tmp_path, "tiny", "f")
    killed_attempt = json.loads(layout.stage_record("train").read_text())["attempt"]
    second = run_cli(*args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert json.loads(layout.stage_record("train").read_text())["summary"]["resumed_from"] == 10
    resumed = json.loads((layout.checkpoints / "resumed.json").read_text())
    assert resumed["tier"] == "fast" and resumed["step"] == 10, resumed
    # the killed launch's snapshot files went at the restore, the finished one's at its end
    assert not list((tmp_path / "local").glob("*/slots/*/*")) and list((tmp_path / "local").glob("*/objects/*"))
    before = train_losses(layout, killed_attempt)
    assert train_losses(layout) == {k: v for k, v in before.items() if int(k) > 10} != {}
    status = run_cli("status=true", f"run.root={tmp_path}", "run.id=f", "+experiment=tiny").stdout
    assert "last resume: step 10 from the fast tier" in status, status
