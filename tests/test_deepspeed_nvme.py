"""DeepSpeed ZeRO-3 with NVMe optimizer offload: the on-disk layout, its consolidation, and seed 000.

The layout (DeepSpeed 0.19.8; see pipeline/formats/deepspeed_zero.py): every sub-group whose per-rank fp32
partition holds at least 1 MiB lives only in ``offloaded_tensors/rankNN/<first>_<last>.tensor.swp`` (and
``exp_avg-…``/``exp_avg_sq-…``), raw and padded to 256 elements; the optimizer-state files keep an empty tensor
in its place. DeepSpeed's ``zero_to_fp32`` then fails ("consumed N numels out of M"); ``consolidate_zero`` does not.

(a) Always (one ``torchrun`` launch, no libaio): real plain ZeRO-3 checkpoints of a model big enough to be
    swapped (tests/ds_helpers.py) are rewritten into that layout (``ds_helpers.nvme_layout_from``, the same files,
    names, sizes and empty tensors as a real NVMe save: test (c) compares the two). ``zero_to_fp32`` fails on
    them; ``consolidate_zero`` equals ``zero_to_fp32`` of the original, and the Adam state read from the swap
    files equals the original's; reads are bounded ``os.pread`` calls; broken swap files are refused in one line.
(b) Seed 000 (DeepSpeed bug 7549): ranks that ``copytree`` into ONE shared ``offloaded_tensors`` lose with
    FileExistsError; the pipeline's per-rank collection (``zero.collect_offload``, each rank into its own
    ``offloaded_tensors/rankNN``) never collides and lists every file exactly once; ``zero.save`` switches
    DeepSpeed's own copy off and lists the rank's copies.
(c) Opt-in, slow (``PIPELINE_TEST_NVME=1`` and DeepSpeed's async_io op buildable: ``apt-get install libaio-dev``;
    the first use compiles it, several minutes): real NVMe checkpoints from DeepSpeed, and the pipeline CLI
    end to end with ``strategy.offload=nvme``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import CheckpointFormatError
from pipeline.formats import deepspeed_swap, deepspeed_zero
from pipeline.formats.deepspeed_zero import ZeroCheckpoint, consolidate_zero
from pipeline.formats.registry import FORMATS
from pipeline.storage.integrity import FileEntry, verify_entries
from pipeline.strategies import zero
from tests import seed_helpers as sh
from tests.ds_helpers import SWAP_ALIGN_NUMEL, ZeroCase, make_zero_checkpoints, nvme_layout_from

CASES = [ZeroCase(3, odd=True, big=True), ZeroCase(3, bf16=True, odd=True, big=True)]
KEYS = ("fp32", "exp_avg", "exp_avg_sq")
SWAPPED_PER_RANK = 2  # sub-groups 0 and 1 of the big odd model reach 1 MiB per rank at 2 ranks (ds_helpers)
CONSUMED = re.compile(r"consumed \d+ numels out of \d+")

# the module's DeepSpeed checkpoints (``plain``, a torchrun of both cases) are made once: one xdist worker runs
# every test of the module
pytestmark = pytest.mark.xdist_group("deepspeed_nvme")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[ZeroCase, Path]:
    return make_zero_checkpoints(tmp_path_factory.mktemp("plain"), CASES, world=2, steps=2)


@pytest.fixture(scope="module")
def synthetic(plain: dict[ZeroCase, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[ZeroCase, Path]:
    out = {}
    for case, step in plain.items():
        dst = tmp_path_factory.mktemp(case.name) / "ckpt"
        nvme_layout_from(step, dst)
        out[case] = dst
    return out


def _quiet() -> contextlib.AbstractContextManager[Any]:
    return contextlib.redirect_stdout(io.StringIO())  # zero_to_fp32 prints progress


def _ds_state_dict(step_dir: Path) -> dict[str, torch.Tensor]:
    """What DeepSpeed's fp32 converter writes (its safetensors writer refuses the odd model's tied alias)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

    with _quiet():
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name, lazy_mode=True)
        return {k: v.clone() for k, v in to_torch_tensor(lazy, dtype=torch.float32).items()}


def _zero_to_fp32_fails(step_dir: Path, out: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    with _quiet(), pytest.raises(ValueError, match=CONSUMED):
        convert_zero_checkpoint_to_fp32_state_dict(
            str(step_dir.parent), str(out), tag=step_dir.name, safe_serialization=True, max_shard_size=None
        )


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _swap_files(step_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in (step_dir / "offloaded_tensors").rglob("*.swp"))


# ------------------------------------------------------------------------------------ (a) the synthetic layout


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layout_is_deepspeeds(synthetic: dict[ZeroCase, Path], case: ZeroCase) -> None:
    step = synthetic[case]
    files = _swap_files(step)
    assert len(files) == 2 * SWAPPED_PER_RANK * 3
    for rel in files:
        assert re.fullmatch(r"offloaded_tensors/rank0[01]/((exp_avg|exp_avg_sq)-)?\d+_\d+\.tensor\.swp", rel), rel
        assert (step / rel).stat().st_size % (SWAP_ALIGN_NUMEL * 4) == 0
    optim = torch.load(next(step.glob("*zero_pp_rank_0_*optim_states.pt")), weights_only=False)
    groups = optim["optimizer_state_dict"]["fp32_flat_groups"]
    assert [t.numel() == 0 for t in groups] == [True, True, False, False]
    with ZeroCheckpoint(step) as ckpt:
        by_rank = ckpt.files_by_rank()
        assert ckpt.stored_files() >= set(files)
    owner = FORMATS["deepspeed_zero3"].owner
    for rank, names in by_rank.items():
        assert all(owner(n) == rank for n in names), names
        assert sum(n.startswith(f"offloaded_tensors/rank{rank:02d}/") for n in names) == SWAPPED_PER_RANK * 3


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_zero_to_fp32_fails_but_consolidation_equals_the_original(
    plain: dict[ZeroCase, Path], synthetic: dict[ZeroCase, Path], case: ZeroCase, tmp_path: Path
) -> None:
    _zero_to_fp32_fails(synthetic[case], tmp_path / "ds_out")
    theirs = _ds_state_dict(plain[case])  # zero_to_fp32 of the original, not offloaded, checkpoint
    for max_read in (deepspeed_zero.DEFAULT_MAX_READ_BYTES, 12_345 * 4):  # one read per piece, or many
        out = tmp_path / f"ours_{max_read}.safetensors"
        count = consolidate_zero(synthetic[case], out, max_read_bytes=max_read)
        ours = load_file(str(out))
        assert count == len(ours) and sorted(ours) == sorted(theirs)
        bad = [k for k in theirs if not _bitwise_equal(ours[k], theirs[k].contiguous())]
        assert not bad, bad


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_adam_state_from_swap_files_equals_the_original(
    plain: dict[ZeroCase, Path], synthetic: dict[ZeroCase, Path], case: ZeroCase
) -> None:
    reference = load_file(str(plain[case].parent / "reference.safetensors"))  # DeepSpeed's own values
    with ZeroCheckpoint(plain[case]) as original, ZeroCheckpoint(synthetic[case]) as offloaded:
        assert torch.equal(offloaded.optimizer_step(), original.optimizer_step())
        for name in offloaded.trainable_names:
            for key in KEYS:
                got = offloaded.full(name, key)
                assert _bitwise_equal(got, original.full(name, key)), (name, key)
                assert torch.equal(got.float(), reference[f"{key}/{name}"]), (name, key)


@pytest.mark.distributed
def test_swap_reads_are_bounded_preads(synthetic: dict[ZeroCase, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    step = synthetic[CASES[0]]
    reads: list[tuple[str, int, int]] = []
    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".tensor.swp"):  # (the torch_zip reader of the other files uses os.pread too)
            reads.append((path, n, offset))
        return real_pread(fd, n, offset)

    monkeypatch.setattr(deepspeed_swap.os, "pread", pread)
    limit = 64 << 10
    with ZeroCheckpoint(step, max_read_bytes=limit) as ckpt:
        for name in ckpt.trainable_names:
            for key in KEYS:
                for _ in ckpt.iter_parts(name, key):
                    pass
    assert reads, "the swap files were not read with os.pread"
    assert max(n for _, n, _ in reads) <= limit
    per_file: dict[str, int] = {}
    for path, n, _ in reads:
        per_file[path] = per_file.get(path, 0) + n
    assert len(per_file) == len(_swap_files(step))
    for path, total in per_file.items():  # every element once; the alignment padding never
        size = Path(path).stat().st_size
        assert size - SWAP_ALIGN_NUMEL * 4 < total <= size, path


def _fresh(synthetic: dict[ZeroCase, Path], tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(synthetic[CASES[0]], dst)
    return dst


def _first_swap(step: Path, rank: int, prefix: str = "") -> Path:
    return sorted((step / f"offloaded_tensors/rank{rank:02d}").glob(f"{prefix}[0-9]*_*.tensor.swp"))[0]


def _break(step: Path, how: str) -> None:
    fp32 = _first_swap(step, 1)
    if how == "missing":
        fp32.unlink()
    elif how == "truncated":
        os.truncate(fp32, fp32.stat().st_size - SWAP_ALIGN_NUMEL * 4 - 4)
    elif how == "too_large":
        with open(fp32, "ab") as f:
            f.write(b"\0" * (2 << 20))
    elif how == "missing_exp_avg":
        _first_swap(step, 1, "exp_avg-").unlink()
    elif how == "no_rank_dir":
        shutil.rmtree(step / "offloaded_tensors/rank01")
    elif how == "extra_rank_dir":
        (step / "offloaded_tensors/rank02").mkdir()
    elif how == "stray_file":
        (step / "offloaded_tensors/rank00/notes.txt").write_text("x")
    elif how == "foreign_ids":
        shutil.copy(fp32, fp32.with_name("900_901.tensor.swp"))
    elif how == "symlink":
        target = step.parent / "elsewhere.swp"
        shutil.move(fp32, target)
        fp32.symlink_to(target)


BROKEN = {
    "missing": r"rank01/\d+_\d+\.tensor\.swp is missing: .* fp32 master weights live only there",
    "truncated": r"bytes, but sub-group \d \(rank 1's partition\) has \d+ float32 elements .* truncated",
    "too_large": r"truncated or from another save",
    "missing_exp_avg": r"exp_avg-\d+_\d+\.tensor\.swp is missing: .* has an optimizer exp_avg",
    "no_rank_dir": r"offloaded_tensors/rank01/ with rank 1's swap files is missing",
    "extra_rank_dir": r"rank 2 exceeds the world size 2",
    "stray_file": r"notes\.txt: a file DeepSpeed's NVMe offload does not write",
    "foreign_ids": r"ds_ids 900_901, which name no swapped sub-group",
    "symlink": r"not a regular file \(a symlink is never followed\)",
}


@pytest.mark.distributed
@pytest.mark.parametrize("how", sorted(BROKEN))
def test_broken_swap_files_are_refused_in_one_line(synthetic: dict[ZeroCase, Path], tmp_path: Path, how: str) -> None:
    step = _fresh(synthetic, tmp_path)
    _break(step, how)
    with pytest.raises(CheckpointFormatError, match=BROKEN[how]) as info:
        consolidate_zero(step, tmp_path / "out.safetensors")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.distributed
def test_litter_of_an_interrupted_copy_is_no_data(
    synthetic: dict[ZeroCase, Path], plain: dict[ZeroCase, Path], tmp_path: Path
) -> None:
    step = _fresh(synthetic, tmp_path)
    swap = _first_swap(step, 0)
    litter = [
        swap.with_name(swap.name + ".tmp-123-abcd1234"),  # copy_file_atomic's temp file
        swap.with_name(swap.name.replace(".tensor.swp", "_gradient_0_262144.tensor.swp")),  # never copied
        step / "offloaded_tensors" / ".rank00.deleting-1-abcd",  # remove_tree's trash
    ]
    for path in litter[:2]:
        path.write_bytes(b"garbage")
    litter[2].mkdir()
    with ZeroCheckpoint(step) as ckpt:
        assert not {str(p.relative_to(step)) for p in litter} & ckpt.stored_files()
    consolidate_zero(step, tmp_path / "ours.safetensors")
    ours, theirs = load_file(str(tmp_path / "ours.safetensors")), _ds_state_dict(plain[CASES[0]])
    assert all(_bitwise_equal(ours[k], theirs[k].contiguous()) for k in theirs)


# --------------------------------------------------------------------------- (b) seed 000: one shared destination

WORLD = 4
SWAP_NAMES = ("0_20.tensor.swp", "exp_avg-0_20.tensor.swp", "exp_avg_sq-0_20.tensor.swp")
GRADIENT = "0_20_gradient_0_262144.tensor.swp"  # transient: DeepSpeed never copies it into a checkpoint


def _payload(rank: int, name: str) -> bytes:
    return f"rank={rank} file={name}\n".encode() * 4096


def _fake_swap_folder(root: Path, rank: int) -> Path:
    """A rank's swap folder as DeepSpeed lays it out (``<nvme_path>/zero_stage_3/optimizer/rank<R>``). Every
    rank has the SAME file names (ds_ids are global): a shared destination loses data even with exist_ok."""
    src = root / f"rank_{rank}" / "zero_stage_3" / "optimizer" / f"rank{rank}"
    src.mkdir(parents=True)
    for name in (*SWAP_NAMES, GRADIENT):
        (src / name).write_bytes(_payload(rank, name))
    return src


def bug7549_copytree(rank: int, world: int, barrier: Any, *, swap_root: str, save_dir: str) -> int:
    """What DeepSpeed 0.16.9 did at save time on every rank: copytree into one shared ``offloaded_tensors``."""
    src = _fake_swap_folder(Path(swap_root), rank)
    sh.sync(barrier)
    shutil.copytree(
        src,
        Path(save_dir) / "offloaded_tensors",
        ignore=lambda _d, names: [n for n in names if "gradient" in n],
        dirs_exist_ok=False,
    )
    return rank


def pipeline_collect(rank: int, world: int, barrier: Any, *, swap_root: str, step_dir: str) -> list[dict[str, object]]:
    """The pipeline's save path for the same swap folder: ``zero.collect_offload`` into this rank's own dir."""
    src = _fake_swap_folder(Path(swap_root), rank)
    sh.sync(barrier)
    return [e.to_json() for e in zero.collect_offload(src, Path(step_dir), rank)]


@pytest.mark.distributed
def test_seed000_shared_copytree_fails_per_rank_collection_never_collides(tmp_path: Path) -> None:
    unguarded = sh.run_ranks(
        bug7549_copytree, WORLD, swap_root=str(tmp_path / "swap_a"), save_dir=str(tmp_path / "ds" / "global_step4")
    )
    losers = [r for r in unguarded if not r.ok]
    assert len(losers) == WORLD - 1 and {r.error_type for r in losers} == {"FileExistsError"}, unguarded
    winner = next(r for r in unguarded if r.ok)
    shared = tmp_path / "ds" / "global_step4" / "offloaded_tensors"
    assert all((shared / n).read_bytes() == _payload(winner.value, n) for n in SWAP_NAMES), "only one rank's files"

    for attempt in range(3):  # the same race, several times: the pipeline's collection never collides
        step_dir = tmp_path / f"staging_{attempt}" / "step_4"
        step_dir.mkdir(parents=True)
        results = sh.run_ranks(
            pipeline_collect, WORLD, swap_root=str(tmp_path / f"swap_b{attempt}"), step_dir=str(step_dir)
        )
        assert all(r.ok for r in results), results
        listed = [FileEntry.from_json(e, "test") for r in results for e in r.value]
        paths = [e.path for e in listed]
        assert len(paths) == len(set(paths)) == WORLD * len(SWAP_NAMES), "every file listed exactly once"
        for r in results:
            mine = sorted(FileEntry.from_json(e, "test").path for e in r.value)
            assert mine == sorted(f"offloaded_tensors/rank{r.rank:02d}/{n}" for n in SWAP_NAMES)
            assert all(FORMATS["deepspeed_zero3"].owner(p) == r.rank for p in mine)
            for p in mine:
                assert (step_dir / p).read_bytes() == _payload(r.rank, p.rsplit("/", 1)[1])
        verify_entries(step_dir, listed, "the ranks' lists")
        on_disk = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())
        assert on_disk == sorted(paths), "nothing but the listed files (no temp files, no gradients)"


class _FakeEngine:
    """Just what ``zero.save`` touches of a DeepSpeed engine, and DeepSpeed 0.19.8's NVMe copy at save time."""

    def __init__(self, swap_folder: Path | None, rank: int) -> None:
        self.checkpoint_engine: Any = "deepspeed's"
        swapper = SimpleNamespace(swap_folder=str(swap_folder))
        self.optimizer = SimpleNamespace(swap_optimizer=swap_folder is not None, optimizer_swapper=swapper)
        self.global_rank = rank
        self.deepspeed_copied = False

    def zero_nvme_offload_optimizer(self) -> bool:
        return bool(self.optimizer.swap_optimizer)

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        path = os.path.join(save_dir, tag, f"zero_pp_rank_{self.global_rank}_mp_rank_00_optim_states.pt")
        self.checkpoint_engine.makedirs(os.path.dirname(path), exist_ok=True)
        self.checkpoint_engine.save({"x": torch.ones(3)}, path)
        if self.zero_nvme_offload_optimizer():  # engine.save_checkpoint's copytree
            dst = os.path.join(save_dir, tag, "offloaded_tensors", f"rank{self.global_rank:02d}")
            shutil.copytree(self.optimizer.optimizer_swapper.swap_folder, dst, dirs_exist_ok=False)
            self.deepspeed_copied = True


def test_save_lists_its_own_offload_copies_and_switches_deepspeeds_copy_off(tmp_path: Path) -> None:
    rank = 1
    swap = _fake_swap_folder(tmp_path / "swap", rank)
    staging = tmp_path / "staging"
    stale = staging / "step_4" / "offloaded_tensors" / "rank01" / "stale.tensor.swp"  # an earlier attempt's
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    engine = _FakeEngine(swap, rank)
    entries = zero.save(engine, staging, "step_4")
    assert [e.path for e in entries] == [
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        *sorted(f"offloaded_tensors/rank01/{n}" for n in SWAP_NAMES),
    ]
    verify_entries(staging / "step_4", entries, "save()'s list")
    assert not engine.deepspeed_copied and not stale.exists()
    assert engine.zero_nvme_offload_optimizer() and "zero_nvme_offload_optimizer" not in vars(engine)
    assert engine.checkpoint_engine == "deepspeed's"

    plain = _FakeEngine(None, 0)  # no NVMe offload: nothing collected, nothing switched
    assert [e.path for e in zero.save(plain, tmp_path / "plain", "step_4")] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ]
    assert not (tmp_path / "plain" / "step_4" / "offloaded_tensors").exists()


def test_collect_refuses_a_missing_swap_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="swap folder .* of rank 3 is missing") as info:
        zero.collect_offload(tmp_path / "nope", tmp_path / "step_4", 3)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------- (c) opt-in: real NVMe offload (libaio)


@pytest.fixture(scope="module")
def nvme_available() -> None:
    if os.environ.get("PIPELINE_TEST_NVME") != "1":
        pytest.skip("real NVMe offload: set PIPELINE_TEST_NVME=1 (needs libaio-dev; compiles async_io once)")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io op cannot be built here: apt-get install libaio-dev")


def _renumbered(step_dir: Path) -> list[tuple[str, int]]:
    """Swap files with their ds_ids replaced by their order (``#k``), and sizes: the base of ZeRO's ds_id
    counter differs between processes and engines."""
    ids = sorted({tuple(map(int, m.groups())) for f in _swap_files(step_dir) if (m := re.search(r"(\d+)_(\d+)", f))})
    rank_of = {f"{a}_{b}": f"#{k}" for k, (a, b) in enumerate(ids)}
    return sorted(
        (re.sub(r"\d+_\d+", lambda m: rank_of[m.group(0)], f), (step_dir / f).stat().st_size)
        for f in _swap_files(step_dir)
    )


def _optim_shape(step_dir: Path, rank: int) -> list[object]:
    optim = torch.load(next(step_dir.glob(f"*zero_pp_rank_{rank}_*optim_states.pt")), weights_only=False)
    osd = optim["optimizer_state_dict"]
    state = osd["optimizer_state_dict"]["state"]
    return [
        [(t.numel(), t.dtype, hasattr(t, "ds_id")) for t in osd["fp32_flat_groups"]],
        [{k: (v.numel(), v.dtype) for k, v in s.items()} for _, s in sorted(state.items())],
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_real_nvme_checkpoint_is_the_synthetic_layout_and_consolidates(nvme_available: None, tmp_path: Path) -> None:
    cases = [ZeroCase(3, bf16=bf16, odd=True, big=True, nvme=nvme) for bf16 in (False, True) for nvme in (True, False)]
    made = make_zero_checkpoints(tmp_path / "made", cases, world=2, steps=2, timeout_s=1800)
    for case in (c for c in cases if c.nvme):
        real = made[case]
        syn = tmp_path / f"{case.name}_syn"
        nvme_layout_from(made[ZeroCase(3, bf16=case.bf16, odd=True, big=True)], syn)
        assert _renumbered(real) == _renumbered(syn), "the synthetic layout is DeepSpeed's"
        assert all(_optim_shape(real, r) == _optim_shape(syn, r) for r in (0, 1))
        _zero_to_fp32_fails(real, tmp_path / f"{case.name}_ds")
        reference = load_file(str(real.parent / "reference.safetensors"))  # DeepSpeed's own values, in training
        with ZeroCheckpoint(real) as ckpt:
            for name in ckpt.trainable_names:
                for key in KEYS:
                    assert torch.equal(ckpt.full(name, key).float(), reference[f"{key}/{name}"]), (name, key)
        out = tmp_path / f"{case.name}.safetensors"
        consolidate_zero(real, out)
        consolidated = load_file(str(out))
        assert all(torch.equal(consolidated[n], reference[f"fp32/{n}"]) for n in ckpt.trainable_names)


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_trains_commits_and_exports_with_nvme_offload(nvme_available: None, tmp_path: Path) -> None:
    from pipeline.checkpoint.manifest import read_latest, read_manifest
    from pipeline.rundir.layout import RunLayout
    from pipeline.storage.atomic import read_json
    from tests.conftest import probe_env, probe_file, read_probe, run_cli

    proc = run_cli(
        "+experiment=tiny",
        "strategy=deepspeed",
        "strategy.zero_stage=3",
        "strategy.offload=nvme",
        f"strategy.nvme_path={tmp_path / 'nvme'}",
        f"run.root={tmp_path / 'runs'}",
        "run.id=nvme",
        "run.create=true",
        "model.hidden_size=256",  # ~2 M params: the one sub-group holds > 1 MiB per rank, so it is swapped
        "model.intermediate_size=1024",
        timeout=1800,
        env=probe_env(probe_file(tmp_path, "nvme")),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    layout = RunLayout.for_run(tmp_path / "runs", "tiny", "nvme")
    latest = read_latest(layout)
    assert latest is not None and latest.step == 8
    step_dir = layout.committed_step(8)
    manifest = read_manifest(step_dir)
    assert manifest.format == "deepspeed_zero3"
    for rank in (0, 1):
        marker = read_json(step_dir / f"rank_{rank}.done.json")
        offloaded = [f["path"] for f in marker["files"] if f["path"].startswith("offloaded_tensors/")]
        assert len(offloaded) == 3, offloaded
        assert all(p.startswith(f"offloaded_tensors/rank{rank:02d}/") for p in offloaded)
        assert {re.sub(r"\d+_\d+", "N", p.rsplit("/", 1)[1]) for p in offloaded} == {
            "N.tensor.swp",
            "exp_avg-N.tensor.swp",
            "exp_avg_sq-N.tensor.swp",
        }
        assert set(offloaded) <= {f.path for f in manifest.files}
    _zero_to_fp32_fails(step_dir, tmp_path / "ds_out")
    probe = read_probe(probe_file(tmp_path, "nvme"))
    from transformers import AutoModelForCausalLM

    export = layout.export_step(8)
    assert export.is_dir()
    model = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the training ranks ran: at hidden 256 the summation order depends on threads
    try:
        with torch.no_grad():
            got = model(torch.tensor([probe["input_ids"]])).logits.float()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, torch.tensor(probe["logits"]).view(probe["shape"])), "the export is the trained model"
