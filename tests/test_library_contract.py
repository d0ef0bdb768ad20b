"""The library's contract with its user: a committed step is a resumable one, any committed step loads.

* Each kind of value a user puts in a state is either restored exactly by a resume or refused at ``save``, in one
  line naming its key, before anything is staged (never committed unresumable); on 2 ranks under ``torchrun`` the
  refusal is one ``error: [rank K] ...`` line per rank, no traceback.
* ``steps()``, ``latest_step()``, ``best_step()``, ``load(step=N | "best")``, a state that gained a key
  (``partial=True`` / ``exclude``), on a directory and in a bucket; ``--step`` / ``--best`` of ``status``,
  ``consolidate`` and ``export``; ``keep_best``'s metric reduced across ranks (the mean).
* A typo in an option is one line with the nearest name; one process needs no process group of its own.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.checkpoint import Checkpointer
from pipeline.checkpoint.manifest import read_manifest
from pipeline.checkpoint.protocol.lease_records import newest_holder
from pipeline.checkpoint.stores.posix_store import PosixCheckpoints
from pipeline.errors import CheckpointFormatError, ConfigError, StateError, VerificationError
from pipeline.storage.layout import CheckpointLayout

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


class Counter:
    """A user's own Stateful: restored through its load_state_dict."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": [self.n, self.n * 2]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def _model_and_optim(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


RESTORED: dict[str, tuple[Any, Any]] = {
    # key: (value saved, the value a fresh state holds before the load)
    "tensor": (torch.arange(6.0).reshape(2, 3), torch.zeros(2, 3)),
    "nested": (
        {"a": {"b": torch.ones(2), "c": [1, 2, "x"]}, "d": 2.5},
        {"a": {"b": torch.zeros(2), "c": []}, "d": 0.0},
    ),
    "int": (7, 0),
    "float": (0.125, 0.0),
    "string": ("note: step seven", ""),
    "none": (None, 5),
    "bool": (True, False),
    "tuple": ((1, "two", 3.0), ()),
    "list": ([1, [2, 3], {"k": "v"}], []),
    "bytes": (b"\x00\x01", b""),
    "ordered": (collections.OrderedDict(z=1, a=2), collections.OrderedDict()),
    "size": (torch.Size([2, 3]), torch.Size([])),
}
REFUSED: dict[str, tuple[Any, str]] = {
    "object": (object(), "state['object'] is a builtins.object"),
    "lambda": (lambda: 1, "state['lambda'] is a builtins.function"),
    "dataloader": (torch.utils.data.DataLoader([1, 2, 3]), "a DataLoader has no state of its own to save"),
    "nested_object": ({"ok": 1, "bad": [1, object()]}, "state['nested_object']['bad'][1] is a builtins.object"),
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a.keys()) == list(b.keys()) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_each_kind_of_value_is_restored_exactly_or_refused_at_save(tmp_path: Path, one_rank: Any) -> None:
    model, opt, sched = _model_and_optim(0)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    sched.step()
    counter = Counter(4)
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "counter": counter}
    state.update({k: v for k, (v, _) in RESTORED.items()})
    ck = Checkpointer(tmp_path / "run", poll_interval_s=0.05)
    try:
        for key, (value, expected) in REFUSED.items():
            with pytest.raises(StateError) as caught:
                ck.save(3, {**state, key: value})
            text = str(caught.value)
            assert "\n" not in text and expected in text, text
            assert text.startswith("step 3 not saved: rank 0: "), text
        assert not (ck.layout.checkpoints / "staging" / "step_3").exists(), "a refused save staged files"
        assert ck.save(3, state).ok
    finally:
        ck.close()

    model2, opt2, sched2 = _model_and_optim(1)
    fresh: dict[str, Any] = {"model": model2, "optim": opt2, "sched": sched2, "counter": Counter()}
    fresh.update({k: v for k, (_, v) in RESTORED.items()})
    ck = Checkpointer(tmp_path / "run", poll_interval_s=0.05)
    try:
        assert ck.load_latest(into=fresh) == 3
    finally:
        ck.close()
    for key, (value, _) in RESTORED.items():
        assert _same(value, fresh[key]), f"{key}: saved {value!r}, restored {fresh[key]!r}"
    assert fresh["counter"].n == 4
    pairs = zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert sched2.state_dict() == sched.state_dict()


def _save_steps(ck: Checkpointer, losses: dict[int, float]) -> None:
    model, opt, _ = _model_and_optim(0)
    extra = {"epoch": 0}
    for step, loss in losses.items():
        with torch.no_grad():
            model.weight.fill_(float(step))
        extra["epoch"] = step
        assert ck.save(step, {"model": model, "optim": opt, "extra": extra}, metrics={"loss": loss}).ok


def _wait_committed(ck: Checkpointer, step: int) -> None:
    deadline = time.monotonic() + 30
    while ck.latest_step() != step:
        assert time.monotonic() < deadline, f"step {step} was not committed in 30 s (latest {ck.latest_step()})"
        time.sleep(0.05)


@pytest.mark.parametrize("store", ["posix", "bucket"])
def test_any_committed_step_loads_by_number_or_best_and_a_state_that_gained_a_key_resumes(
    tmp_path: Path, one_rank: Any, store: str, request: pytest.FixtureRequest
) -> None:
    storage = None
    if store == "bucket":
        storage = f"s3://{request.getfixturevalue('bucket')}/{request.getfixturevalue('prefix')}"
    losses = {2: 3.0, 4: 1.0, 6: 2.0, 8: 4.0}
    ck = Checkpointer(tmp_path / "run", keep_last=1, keep_best=2, storage=storage, poll_interval_s=0.05)
    try:
        _save_steps(ck, losses)
        _wait_committed(ck, 8)
        deadline = time.monotonic() + 30
        while ck.steps() != [4, 6, 8]:  # best 2 (4, 6) and latest
            assert time.monotonic() < deadline, f"retention left {ck.steps()}"
            time.sleep(0.05)
        assert ck.best_step() == 4

        model, opt, _ = _model_and_optim(1)
        state: dict[str, Any] = {"model": model, "optim": opt, "extra": {"epoch": -1}}
        assert ck.load(state, step="best") == 4
        assert float(model.weight[0, 0]) == 4.0 and state["extra"] == {"epoch": 4}
        assert ck.load(state, step=6) == 6 and state["extra"] == {"epoch": 6}
        gone = r"cannot load step 2: step 2 is not committed .*\(committed: 4, 6, 8\)"
        with pytest.raises(VerificationError, match=gone):
            ck.load(state, step=2)

        grown: dict[str, Any] = {"model": model, "optim": opt, "extra": {"epoch": -1, "seen": 11}}
        with pytest.raises(CheckpointFormatError, match=r"holds no value for extra\.seen .*partial=True"):
            ck.load_latest(grown)
        assert ck.load_latest(grown, partial=True) == 8
        assert grown["extra"] == {"epoch": 8, "seen": 11}
        assert float(model.weight[0, 0]) == 8.0
        kept = {"epoch": -5}
        assert ck.load({"model": model, "optim": opt, "extra": kept}, step=4, exclude=("extra",)) == 4
        assert kept == {"epoch": -5} and float(model.weight[0, 0]) == 4.0
        assert ck.load({"model": model, "optim": opt, "extra": kept}, step=6, exclude="extra") == 6  # one key
        assert kept == {"epoch": -5} and float(model.weight[0, 0]) == 6.0
        with pytest.raises(ConfigError, match=r"the state has no key 'extr' \(its keys: model, optim, extra\)"):
            ck.load({"model": model, "optim": opt, "extra": kept}, step=6, exclude=("extr",))
    finally:
        ck.close()
    _command_lines_take_a_step(tmp_path / "run")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, check=False)


def _command_lines_take_a_step(run: Path) -> None:
    done = _cli("pipeline.status", str(run), "--best", "--verify")
    assert done.returncode == 0, done.stderr
    assert "chosen (best): step 4, loss 1.0" in done.stdout and "verify: 1 of 1 committed step(s) ok" in done.stdout
    done = _cli("pipeline.status", str(run), "--step", "2")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: step 2 is not committed in {done.stderr.split(' in ', 1)[1].split(' (')[0]} (committed: 4, 6, 8)"
    ], done.stderr
    done = _cli("pipeline.consolidate", str(run), "--step", "6")
    assert done.returncode == 0 and done.stdout.startswith("step 6: "), done.stdout + done.stderr
    done = _cli("pipeline.export", str(run), "--best")
    assert done.returncode == 0 and done.stdout.startswith("step 4: "), done.stdout + done.stderr
    assert (run / "export" / "step_4" / "provenance.json").is_file()
    assert (run / "consolidated" / "step_6").is_dir()


def test_a_typo_in_an_option_is_one_line_naming_the_nearest(tmp_path: Path) -> None:
    typo = r"^Checkpointer\(keep_lst=\.\.\.\): no such option; did you mean keep_last=\?$"
    with pytest.raises(ConfigError, match=typo):
        Checkpointer(tmp_path, keep_lst=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="no such option; its options: every_steps"):
        Checkpointer(tmp_path, zzz=1)  # type: ignore[call-arg]


def test_one_process_needs_no_process_group_and_ends_the_one_it_made(tmp_path: Path) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    assert not dist.is_initialized()
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path, poll_interval_s=0.05) as ck:
        assert ck.save(1, {"model": model}).ok
    assert not dist.is_initialized()
    with Checkpointer(tmp_path, poll_interval_s=0.05) as ck:
        assert ck.load_latest({"model": torch.nn.Linear(2, 2)}) == 1
    assert not dist.is_initialized()


SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from pipeline.checkpoint import Checkpointer
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = Checkpointer(sys.argv[1], keep_best=1, poll_interval_s=0.05)
    model = torch.nn.Linear(2, 2)
    ck.save(1, {"model": model}, metrics={"loss": 1.0 + 2 * rank})   # mean over 2 ranks: 2.0
    ck.wait()
    note = object() if rank == 1 else "fine"                          # only rank 1's state is unloadable
    ck.save(2, {"model": model, "note": note})
    """
)


@pytest.mark.distributed
def test_on_two_ranks_a_refused_state_is_one_line_per_rank_and_metrics_are_averaged(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script), str(run)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        timeout=240,
        check=False,
    )
    assert done.returncode != 0
    ours = sorted(ln for ln in done.stderr.splitlines() if ln.startswith("error: [rank"))
    assert ours == [
        "error: [rank 0] step 2 not saved: another rank's state holds a value a resume could not load",
        "error: [rank 1] step 2 not saved: rank 1: state['note'] is a builtins.object, which a resume could not load "
        "(the restricted reader refuses it: global object is not allowed): keep tensors, numbers, strings, "
        "None and lists/dicts of them in a state, or an object with state_dict()/load_state_dict() (a Stateful)",
    ], done.stderr
    # no traceback of the ranks (torch's hook prefixes theirs with [rankK]:); torchrun's own report stays
    assert "[rank0]:" not in done.stderr and "[rank1]:" not in done.stderr, done.stderr
    assert f'File "{script}"' not in done.stderr, done.stderr
    assert not (run / "checkpoints" / "staging" / "step_2").exists()
    # step 1 stays staged, complete (the job died before its committer's next pass): the next committer commits it
    done = _cli("pipeline.commit", str(run), "--world-size", "2")
    assert done.returncode == 0, done.stderr
    assert read_manifest(run / "checkpoints" / "step_1").metrics == {"loss": 2.0}


def test_a_second_committer_on_the_same_node_is_refused_naming_the_holder(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    first = subprocess.Popen(
        [sys.executable, "-m", "pipeline.commit", str(tmp_path), "--follow", "--interval", "0.1"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        lease = PosixCheckpoints(CheckpointLayout(tmp_path)).lease_store()
        while newest_holder(lease) is None:
            assert time.monotonic() < deadline and first.poll() is None, "the first committer took no lease"
            time.sleep(0.05)
        second = _cli("pipeline.commit", str(tmp_path))
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith("error: another committer holds "), lines[0]
        assert f"(pid {first.pid} on " in lines[0] and ", since 20" in lines[0], lines[0]
    finally:
        first.terminate()
        first.wait(30)


class _Opaque:
    pass


def test_a_value_the_reader_refuses_at_load_is_one_line_naming_the_key(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    from pipeline.formats.dcp import load_into  # noqa: PLC0415

    dcp.save({"t": torch.ones(2), "extra": {"note": _Opaque()}}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(CheckpointFormatError) as caught:
        load_into({"t": torch.zeros(2), "extra": {"note": None}}, tmp_path, no_dist=True)
    text = str(caught.value)
    assert "\n" not in text and "\x1b" not in text, text
    assert f"{tmp_path}: the value 'extra.note' cannot be loaded by the restricted reader (global " in text, text
    assert "nothing was unpickled" in text, text
