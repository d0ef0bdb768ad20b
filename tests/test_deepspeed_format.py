"""DeepSpeed ZeRO checkpoints read safely: consolidation equals DeepSpeed's own ``zero_to_fp32`` bit for bit.

Real ZeRO-1/2/3 checkpoints (fp32 and bf16, a plain and an odd model) are made once per module by one
``torchrun`` launch (tests/ds_helpers.py). The reader (pipeline/formats/torch_zip.py, deepspeed_zero.py) is
compared with ``convert_zero_checkpoint_to_fp32_state_dict(..., safe_serialization=True)`` and with the values
DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` returned in training; hostile
inputs are refused without running code; reads stay bounded by one param (never a whole flat group).
The torch_zip unit tests at the end need no DeepSpeed checkpoint.
"""

from __future__ import annotations

import contextlib
import fractions
import io
import json
import os
import pickle
import shutil
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import CheckpointFormatError, PipelineError
from pipeline.formats import deepspeed_zero, torch_zip
from pipeline.formats.deepspeed_zero import STAGE_OF, ZeroCheckpoint, consolidate_zero, format_name
from pipeline.formats.torch_zip import LazyTensor, load_lazy
from tests.ds_helpers import ZeroCase, make_zero_checkpoints

PLAIN = [ZeroCase(1), ZeroCase(2), ZeroCase(3), ZeroCase(1, bf16=True), ZeroCase(3, bf16=True)]
ODD = [ZeroCase(2, odd=True), ZeroCase(3, odd=True), ZeroCase(3, bf16=True, odd=True)]
ALL = PLAIN + ODD

# the module's DeepSpeed checkpoints (``ckpts``, a torchrun of every case) are made once: one xdist worker runs
# every test of the module
pytestmark = pytest.mark.xdist_group("deepspeed_format")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[ZeroCase, Path]:
    return make_zero_checkpoints(tmp_path_factory.mktemp("zero"), ALL, world=2, steps=2)


def _quiet() -> contextlib.AbstractContextManager[Any]:
    return contextlib.redirect_stdout(io.StringIO())  # zero_to_fp32 prints progress


def _assert_same_file(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, ref_tensor in ref.items():
        got, want = ours[name], ref_tensor.contiguous()
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), name
        if want.numel():
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def _ds_state_dict(case_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What DeepSpeed's converter hands to ``save_file`` (used where its safetensors writer refuses aliases)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

    with _quiet():
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(case_dir), tag="ckpt", lazy_mode=True)
        return {k: v.clone() for k, v in to_torch_tensor(lazy, dtype=dtype).items()}


def _copy_step(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------ equality with DeepSpeed


@pytest.mark.distributed
@pytest.mark.parametrize("case", PLAIN, ids=lambda c: c.name)
def test_consolidation_equals_zero_to_fp32_safetensors(ckpts: dict[ZeroCase, Path], case: ZeroCase, tmp_path: Path):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    step = ckpts[case]
    ours = tmp_path / "ours.safetensors"
    count = consolidate_zero(step, ours)
    with _quiet():
        convert_zero_checkpoint_to_fp32_state_dict(
            str(step.parent), str(tmp_path / "ds"), safe_serialization=True, max_shard_size=None, tag=step.name
        )
    ref = load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert count == len(ref)
    _assert_same_file(load_file(str(ours)), ref)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ODD, ids=lambda c: c.name)
def test_odd_model_equals_zero_to_fp32(ckpts: dict[ZeroCase, Path], case: ZeroCase, tmp_path: Path):
    """Padding (vocab 101, 13- and 11-element params), two param groups, a frozen param, float and int buffers
    and a tied (shared) weight. DeepSpeed's safetensors writer refuses the alias, so the reference is the state
    dict it would write; the alias is written as its own copy of the target."""
    step = ckpts[case]
    out = tmp_path / "ours.safetensors"
    consolidate_zero(step, out)
    ours, ref = load_file(str(out)), _ds_state_dict(step.parent)
    _assert_same_file(ours, ref)
    ckpt = ZeroCheckpoint(step)
    assert ckpt.shared == {"lm.lm_head.weight": "lm.model.embed_tokens.weight"}
    assert ckpt.buffer_names == ["scale_buf", "index_buf"]
    assert ckpt.frozen_names == ["frozen_odd"]
    assert ours["index_buf"].dtype == torch.int64
    assert [s.name for s in ckpt.param_specs()] == list(ref)  # zero_to_fp32's order


@pytest.mark.distributed
@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_per_param_state_equals_deepspeed(ckpts: dict[ZeroCase, Path], case: ZeroCase):
    """fp32 master weights and Adam exp_avg/exp_avg_sq of every trainable param equal what DeepSpeed's
    safe_get_full_fp32_param / safe_get_full_optimizer_state returned on the live engine."""
    step = ckpts[case]
    ref = load_file(str(step.parent / "reference.safetensors"))
    meta = json.loads((step.parent / "reference.json").read_text())
    ckpt = ZeroCheckpoint(step)
    assert ref
    for key_name, want in ref.items():
        key, name = key_name.split("/", 1)
        got = ckpt.full(name, key)
        assert got.dtype == torch.float32 and torch.equal(got, want), key_name
    step_t = ckpt.optimizer_step()
    assert step_t is not None and float(step_t) == meta["steps"][0] == 2.0
    assert ckpt.param_groups[0]["lr"] == 1e-3
    if case.odd:
        assert [g["weight_decay"] for g in ckpt.param_groups] == [0.1, 0.0]
        with pytest.raises(PipelineError, match="buffer"):
            next(ckpt.iter_parts("scale_buf", "exp_avg"))


@pytest.mark.distributed
def test_dtype_option_equals_deepspeed(ckpts: dict[ZeroCase, Path], tmp_path: Path):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    step = ckpts[ZeroCase(3)]
    consolidate_zero(step, tmp_path / "ours.safetensors", dtype=torch.bfloat16)
    with _quiet():
        convert_zero_checkpoint_to_state_dict(
            str(step.parent), str(tmp_path / "ds"), dtype=torch.bfloat16, safe_serialization=True,
            max_shard_size=None, tag=step.name,
        )  # fmt: skip
    _assert_same_file(load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "ds/model.safetensors")))
    odd = ckpts[ZeroCase(3, odd=True)]
    consolidate_zero(odd, tmp_path / "odd.safetensors", dtype=torch.float16)
    _assert_same_file(load_file(str(tmp_path / "odd.safetensors")), _ds_state_dict(odd.parent, torch.float16))


@pytest.mark.distributed
def test_files_and_format_names(ckpts: dict[ZeroCase, Path]):
    assert {n: format_name(s) for n, s in STAGE_OF.items()} == {n: n for n in STAGE_OF}
    z2 = ZeroCheckpoint(ckpts[ZeroCase(2)])
    assert (z2.stage, z2.world_size, z2.bf16, z2.format) == (2, 2, False, "deepspeed_zero2")
    assert z2.files_by_rank() == {
        0: ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
        1: ["zero_pp_rank_1_mp_rank_00_optim_states.pt"],
    }
    z3 = ZeroCheckpoint(ckpts[ZeroCase(3, bf16=True)])
    assert (z3.stage, z3.bf16) == (3, True)
    assert z3.files_by_rank() == {
        r: [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"]
        for r in (0, 1)
    }
    for ck in (z2, z3):
        assert ck.stored_files() == {p.name for p in ck.step_dir.iterdir() if p.name.endswith(".pt")}
    assert deepspeed_zero.is_zero_checkpoint(z3.step_dir) and not deepspeed_zero.is_zero_checkpoint(z3.step_dir.parent)


@pytest.mark.distributed
def test_allow_pickle_opts_in_for_a_trusted_file(ckpts: dict[ZeroCase, Path], tmp_path: Path):
    """A client-state value of a class outside the allow-list: refused by default, read with allow_pickle."""
    step = _copy_step(ckpts[ZeroCase(2)], tmp_path / "z2")
    model_file = step / "mp_rank_00_model_states.pt"
    state = torch.load(model_file, weights_only=False)
    state["client"] = fractions.Fraction(1, 3)
    torch.save(state, model_file)
    with pytest.raises(CheckpointFormatError, match=r"fractions\.Fraction.*import\.allow_pickle=true"):
        ZeroCheckpoint(step)
    with ZeroCheckpoint(step, allow_pickle=True) as ckpt:
        assert ckpt.global_steps() == 2
    consolidate_zero(step, tmp_path / "a.safetensors", allow_pickle=True)
    consolidate_zero(ckpts[ZeroCase(2)], tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


# ----------------------------------------------------------------------------------------- bounded memory


@pytest.fixture
def read_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Bytes of every LazyTensor.read; materialize (a whole tensor at once) is forbidden."""
    log: list[int] = []
    real_read = LazyTensor.read

    def read(self: LazyTensor, start: int = 0, count: int | None = None) -> torch.Tensor:
        out = real_read(self, start, count)
        log.append(out.numel() * out.element_size())
        return out

    def materialize(self: LazyTensor) -> torch.Tensor:
        raise AssertionError(f"materialize of a {self.shape} tensor")

    monkeypatch.setattr(LazyTensor, "read", read)
    monkeypatch.setattr(LazyTensor, "materialize", materialize)
    yield log


@pytest.mark.distributed
@pytest.mark.parametrize("case", [ZeroCase(2, odd=True), ZeroCase(3, bf16=True)], ids=lambda c: c.name)
def test_reads_are_bounded_by_one_param(ckpts: dict[ZeroCase, Path], case: ZeroCase, tmp_path: Path, read_log):
    step = ckpts[case]
    ckpt = ZeroCheckpoint(step)
    largest_param = max(s.nbytes for s in ckpt.param_specs())
    largest_flat_group = max(t.nbytes for r in ckpt._ranks for t in r.fp32)
    assert largest_param < largest_flat_group  # else this test could not tell the two apart
    consolidate_zero(step, tmp_path / "a.safetensors")
    for name in ckpt.trainable_names:
        for key in ("exp_avg", "exp_avg_sq"):
            for _ in ckpt.iter_parts(name, key):
                pass
    assert read_log and max(read_log) <= largest_param
    read_log.clear()
    consolidate_zero(step, tmp_path / "b.safetensors", max_read_bytes=1024)  # several reads per piece
    assert max(read_log, default=0) <= 1024  # fp32 master slices are copied file to file: no read at all
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


# ----------------------------------------------------------------------------------------- hostile inputs


@pytest.mark.distributed
def test_truncated_optim_file_is_refused(ckpts: dict[ZeroCase, Path], tmp_path: Path):
    for case in (ZeroCase(2), ZeroCase(3)):
        step = _copy_step(ckpts[case], tmp_path / case.name)
        victim = step / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        os.truncate(victim, victim.stat().st_size // 2)
        with pytest.raises(CheckpointFormatError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt.*truncated"):
            ZeroCheckpoint(step)
        with pytest.raises(CheckpointFormatError):
            consolidate_zero(step, tmp_path / f"{case.name}.safetensors")


@pytest.mark.distributed
def test_missing_rank_file_is_refused(ckpts: dict[ZeroCase, Path], tmp_path: Path):
    step = _copy_step(ckpts[ZeroCase(2)], tmp_path / "z2")
    (step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointFormatError, match=r"rank 1 \(zero_pp_rank_1_mp_rank_00_optim_states\.pt\)"):
        ZeroCheckpoint(step)
    step = _copy_step(ckpts[ZeroCase(3, bf16=True)], tmp_path / "z3")
    (step / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointFormatError, match=r"rank 0 \(bf16_zero_pp_rank_0_mp_rank_00_optim_states\.pt\)"):
        ZeroCheckpoint(step)
    step = _copy_step(ckpts[ZeroCase(3)], tmp_path / "z3m")
    (step / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt of rank 1"):
        ZeroCheckpoint(step)
    with pytest.raises(CheckpointFormatError, match="not a DeepSpeed ZeRO step dir"):
        ZeroCheckpoint(tmp_path)


class _Evil:
    """Pickles as a call of ``os.system``: loading it with full unpickling would run the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


@pytest.mark.distributed
def test_code_in_a_pickle_is_refused_not_run(ckpts: dict[ZeroCase, Path], tmp_path: Path):
    sentinel = tmp_path / "pwned"
    step = _copy_step(ckpts[ZeroCase(2)], tmp_path / "z2")
    victim = step / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Evil(f"touch {sentinel}")}, victim)
    for call in (lambda: load_lazy(victim), lambda: ZeroCheckpoint(step)):
        with pytest.raises(CheckpointFormatError, match=r"posix\.system.*import\.allow_pickle=true") as e:
            call()
        assert str(victim) in str(e.value)
    assert not sentinel.exists()
    torch.load(victim, weights_only=False)  # the payload is live: full unpickling runs it
    assert sentinel.exists()


# ------------------------------------------------------------------------------- torch_zip (no DeepSpeed needed)


def _tree_equal(lazy: Any, ref: Any) -> int:
    if isinstance(lazy, LazyTensor):
        got = lazy.materialize()
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref)
        return 1
    if isinstance(lazy, dict):
        assert list(lazy) == list(ref)
        return sum(_tree_equal(lazy[k], ref[k]) for k in lazy)
    if isinstance(lazy, (list, tuple)) and not isinstance(lazy, torch.Size):
        assert type(lazy) is type(ref) and len(lazy) == len(ref)
        return sum(_tree_equal(a, b) for a, b in zip(lazy, ref, strict=True))
    assert lazy == ref
    return 0


def test_torch_zip_round_trip(tmp_path: Path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    obj = {
        "od": OrderedDict(a=1, b=[2.5, None, True, "s"], c=(1, 2)),
        "t": base,
        "transposed": base.t(),  # non-contiguous, shares the storage
        "row": base[2],  # storage offset 20
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "ints": torch.arange(7),
        "mask": torch.tensor([True, False]),
        "param": torch.nn.Parameter(torch.ones(4)),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 3),
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
        "set": {1, 2},
        "bytes": b"\x00\xffab",
    }
    path = tmp_path / "obj.pt"
    torch.save(obj, path)
    lazy = load_lazy(path)
    assert _tree_equal(lazy, torch.load(path, weights_only=False)) == 9
    row = lazy["row"]
    assert (row.storage_offset, row.is_contiguous(), lazy["transposed"].is_contiguous()) == (20, True, False)
    assert torch.equal(row.read(3, 4), base[2, 3:7])
    with pytest.raises(PipelineError, match="outside"):
        row.read(8, 5)
    with pytest.raises(PipelineError, match="non-contiguous"):
        lazy["transposed"].read()


def _rewrite_zip(src: Path, dst: Path, edit: Any) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data, compress = edit(info.filename, zin.read(info))
            zout.writestr(info.filename, data, compress_type=compress)


def test_torch_zip_refuses_malformed_archives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(16)}, good)
    deflated = tmp_path / "deflated.pt"
    _rewrite_zip(good, deflated, lambda name, data: (data, zipfile.ZIP_DEFLATED if "/data/" in name else 0))
    with pytest.raises(CheckpointFormatError, match="compressed"):
        load_lazy(deflated)
    short = tmp_path / "short.pt"
    _rewrite_zip(good, short, lambda name, data: (data[:32] if "/data/" in name else data, 0))
    with pytest.raises(CheckpointFormatError, match="fewer than its 16"):
        load_lazy(short)
    (tmp_path / "link.pt").symlink_to(good)
    with pytest.raises(CheckpointFormatError, match="symlink"):
        load_lazy(tmp_path / "link.pt")
    not_zip = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, not_zip, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointFormatError, match="not a complete torch.save zip"):
        load_lazy(not_zip)
    monkeypatch.setattr(torch_zip, "MAX_PICKLE_BYTES", 16)
    with pytest.raises(CheckpointFormatError, match="more than 16"):
        load_lazy(good)


def test_torch_zip_refuses_globals_and_bombs(tmp_path: Path):
    path = tmp_path / "g.pt"
    torch.save({"f": torch.nn.Linear}, path)  # a class: would be imported by full unpickling
    with pytest.raises(CheckpointFormatError, match=r"torch\.nn\.modules\.linear\.Linear.*full unpickling"):
        load_lazy(path)
    bomb = pickle.dumps({}, protocol=2)[:-1] + b"r\xff\xff\xff\x7f."  # LONG_BINPUT 2**31-1 before STOP
    _rewrite_zip(path, tmp_path / "bomb.pt", lambda name, data: (bomb if name.endswith("data.pkl") else data, 0))
    with pytest.raises(CheckpointFormatError, match="memo index"):
        load_lazy(tmp_path / "bomb.pt")


@pytest.mark.distributed
def test_fp32_master_slices_are_copied_without_decoding(
    ckpts: dict[ZeroCase, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    copied: list[int] = []
    real = os.copy_file_range

    def counting(*args: int) -> int:
        copied.append(args[2])
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", counting)
    for case in (ZeroCase(2, odd=True), ZeroCase(3)):
        copied.clear()
        ckpt = ZeroCheckpoint(ckpts[case])
        trainable = sum(ckpt.spec(n).nbytes for n in ckpt.trainable_names)
        raw = sum(s.nbytes for s in ckpt.param_specs() if ckpt.raw_spans(s.name) is not None)  # + shared aliases
        consolidate_zero(ckpts[case], tmp_path / f"{case.name}.safetensors")
        assert sum(copied) == raw >= trainable > 0, case.name
        ckpt.close()
