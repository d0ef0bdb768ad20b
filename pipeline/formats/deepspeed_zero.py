"""DeepSpeed ZeRO (stage 1, 2, 3) checkpoints, read without unpickling code and in bounded memory.

Input: a DeepSpeed step dir (``engine.save_checkpoint(save_dir, tag)`` writes ``save_dir/tag/``):

- ZeRO-1/2: ``mp_rank_00_model_states.pt`` (rank 0) and ``[bf16_]zero_pp_rank_K_mp_rank_00_optim_states.pt``
  per rank K (flat fp32 partitions per param group, Adam state of the same layout);
- ZeRO-3: ``zero_pp_rank_K_mp_rank_00_model_states.pt`` and ``[bf16_]zero_pp_rank_K_mp_rank_00_optim_states.pt``
  per rank K;
- ZeRO-3 with NVMe optimizer offload (``offload_optimizer.device=nvme``), in addition: ``offloaded_tensors/rankNN/``
  per rank (NN: two or more digits), the copy of that rank's swap folder. DeepSpeed swaps a sub-group's flat fp32
  partition out when it holds at least 1 MiB; its optimizer-state file then has an EMPTY tensor in
  ``fp32_flat_groups`` (and empty ``exp_avg``/``exp_avg_sq``; the scalar ``step`` stays), and the values are in
  raw swap files: ``<first>_<last>.tensor.swp`` (fp32 master partition) and ``exp_avg-<first>_<last>.tensor.swp``,
  ``exp_avg_sq-<first>_<last>.tensor.swp`` (``<first>``/``<last>``: the ZeRO ``ds_id`` of the sub-group's first and
  last param). A swap file is the partition's elements (the master dtype, native byte order, no header) padded
  up to DeepSpeed's I/O alignment (256 fp32 elements by default). Smaller sub-groups stay in the optimizer-state
  file as usual. DeepSpeed's own ``zero_to_fp32`` cannot read such a step ("consumed N numels out of M");
  this reader can: it matches each swapped sub-group to its files by ``ds_id`` (ids follow the module's
  parameter order, see :meth:`ZeroCheckpoint._match_swapped`) and checks every file's size.

Files are found by name only and read with :mod:`pipeline.formats.torch_zip` (restricted unpickler, lazy tensors);
swap files with ``os.pread``, one bounded piece at a time.
Output: :class:`ZeroCheckpoint` gives the full tensors exactly as DeepSpeed's ``zero_to_fp32`` rebuilds them
(same names, order, dtypes, values: buffers, frozen params, trainable params, shared-param aliases), streamed
as consecutive row-major pieces, never a whole flat group; the Adam ``exp_avg``/``exp_avg_sq`` of every
trainable param by the same slicing. :func:`consolidate_zero` writes them to one safetensors file.
Every malformed, missing or inconsistent input is a :class:`~pipeline.errors.CheckpointFormatError`.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import CheckpointFormatError, PipelineError, plural
from pipeline.formats.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from pipeline.formats.torch_zip import LazyTensor, TorchArchive, load_archive, open_archive
from pipeline.storage.atomic import is_temp_name
from pipeline.storage.integrity import lstat_kind

STAGE_OF: dict[str, int] = {f"deepspeed_zero{s}": s for s in (1, 2, 3)}
"""Format name (as written in markers and manifests) -> ZeRO stage."""

KEYS: tuple[str, ...] = ("fp32", "exp_avg", "exp_avg_sq")

MODEL_STATES_Z12 = "mp_rank_00_model_states.pt"
DEFAULT_MAX_READ_BYTES = 64 << 20
"""Largest single read: a piece of a tensor larger than this is streamed in several reads."""

_OPTIM_RE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
OFFLOAD_DIR = "offloaded_tensors"
_OFFLOAD_RANK_RE = re.compile(r"rank(\d{2,})")
_SWAP_RE = re.compile(r"(?:([A-Za-z_]\w*)-)?(\d+)_(\d+)\.tensor\.swp")
SWAP_PAD_LIMIT = 1 << 20
"""Most bytes of alignment padding a swap file may have after its elements (DeepSpeed pads to 1 KiB times
``aio.intra_op_parallelism``; 1 MiB is its AIO block size)."""
_AUTOEP_KEYS = ("ds_autoep_layers", "autoep_layers")


def format_name(stage: int) -> str:
    """``deepspeed_zero{stage}`` for stage 1, 2 or 3."""
    if stage not in (1, 2, 3):
        raise PipelineError(f"ZeRO stage {stage!r} does not exist: use 1, 2 or 3")
    return f"deepspeed_zero{stage}"


def optim_file(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def z3_model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def offload_dir(rank: int) -> str:
    """Rank ``rank``'s copy of its NVMe swap folder, relative to the step dir (DeepSpeed's name)."""
    return f"{OFFLOAD_DIR}/rank{rank:02d}"


def swap_file(ds_ids: tuple[int, int], key: str = "fp32") -> str:
    """DeepSpeed's name of a swapped sub-group's file: ``<first>_<last>.tensor.swp`` for the fp32 partition,
    ``<key>-<first>_<last>.tensor.swp`` for an optimizer state (``exp_avg``, ``exp_avg_sq``)."""
    base = f"{ds_ids[0]}_{ds_ids[1]}.tensor.swp"
    return base if key == "fp32" else f"{key}-{base}"


def is_zero_checkpoint(step_dir: Path) -> bool:
    """Whether ``step_dir`` holds DeepSpeed ZeRO optimizer-state files (by name only; nothing is read)."""
    try:
        return any(_OPTIM_RE.fullmatch(n) for n in os.listdir(step_dir))
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ validation


def _bad(where: object, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{where}: {problem}; it is not a DeepSpeed ZeRO checkpoint this pipeline reads "
        "(restore the step from an intact copy or save it again)"
    )


def _field(d: object, key: str, kind: type | tuple[type, ...], where: object) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise _bad(where, f"the field {key!r} is missing")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and type(value) is bool):
        raise _bad(where, f"the field {key!r} is a {type(value).__name__}")
    return value


def _shape(value: object, where: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(d) is int and d >= 0 for d in value):
        raise _bad(where, f"a shape {str(value)[:60]} is not a list of sizes")
    return tuple(value)


def _flat(value: object, where: object) -> LazyTensor:
    if not isinstance(value, LazyTensor) or len(value.shape) != 1 or not value.is_contiguous():
        raise _bad(where, f"expected a flat (1-D contiguous) tensor, found {type(value).__name__}")
    return value


def _names(d: object, where: object) -> dict[str, tuple[int, ...]]:
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise _bad(where, "a name -> shape mapping is malformed")
    return {k: _shape(v, f"{where} [{k}]") for k, v in d.items()}


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """zero_to_fp32's output dtype: floating tensors become float32, others keep theirs."""
    return torch.float32 if dtype.is_floating_point else dtype


# ------------------------------------------------------------------------------------------------ entries


@dataclass(frozen=True)
class _Buffer:
    tensor: LazyTensor


@dataclass(frozen=True)
class _Frozen:
    shape: tuple[int, ...]
    fragments: tuple[LazyTensor, ...]  # ZeRO-1/2: the whole tensor; ZeRO-3: one flat fragment per rank


@dataclass(frozen=True)
class _Trainable:
    shape: tuple[int, ...]
    group: int  # ZeRO-1/2 only
    offset: int  # ZeRO-1/2: in the group's merged vector; ZeRO-3: in each rank's concatenated groups
    partitioned: int  # ZeRO-3 only: elements per rank

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_Entry = _Buffer | _Frozen | _Trainable


class SwapTensor:
    """A flat tensor in a DeepSpeed NVMe swap file: ``numel`` elements of ``dtype`` from byte 0 (then padding).

    Read with ``os.pread``, only the elements asked for (no whole-file read); the file is opened on the first
    read (never through a symlink) and closed by :meth:`close`."""

    def __init__(self, path: Path, dtype: torch.dtype, numel: int) -> None:
        self.path = path
        self.dtype = dtype
        self.numel = numel
        self.shape = (numel,)
        self._fd: int | None = None

    def is_contiguous(self) -> bool:
        return True

    def fileno(self) -> int:
        """The swap file's read-only descriptor (opened on demand; closed by :meth:`close`)."""
        return self._open()

    def _open(self) -> int:
        if self._fd is None:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as e:
                raise CheckpointFormatError(
                    f"{self.path}: the swap file cannot be opened ({e.strerror}): restore the step from an intact copy"
                ) from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < self.numel * self.dtype.itemsize:
                os.close(fd)
                raise _bad(self.path, f"the swap file is not a regular file of {self.numel} {self.dtype} elements")
            self._fd = fd
        return self._fd

    def read(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + count)`` as a fresh 1-D tensor (only those bytes are read)."""
        count = self.numel - start if count is None else count
        if start < 0 or count < 0 or start + count > self.numel:
            raise PipelineError(f"{self.path}: read of [{start}, {start + count}) outside {self.numel} elements")
        out = torch.empty(count, dtype=self.dtype)
        if not count:
            return out
        view = out.view(torch.uint8).numpy().data
        fd, offset, done = self._open(), start * self.dtype.itemsize, 0
        while done < len(view):
            data = os.pread(fd, len(view) - done, offset + done)
            if not data:
                raise _bad(self.path, f"the swap file ended at byte {offset + done} (truncated while being read?)")
            view[done : done + len(data)] = data
            done += len(data)
        return out

    def materialize(self) -> torch.Tensor:
        return self.read()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_Flat = LazyTensor | SwapTensor


@dataclass
class _Rank:
    rank: int
    file: str
    fp32: list[_Flat]  # ZeRO-3 with NVMe offload: a swapped sub-group's partition is a SwapTensor
    state: list[dict[str, _Flat]]  # per flat group: exp_avg, exp_avg_sq (may be empty before a step)
    steps: list[object]  # per flat group: the Adam step (a 0-d tensor or a number), None if absent
    param_groups: list[dict[str, Any]]


class ZeroCheckpoint:
    """One DeepSpeed ZeRO step dir, opened safely: reads every ``data.pkl`` (small) and no tensor data.

    ``allow_pickle=True`` lets globals outside the allow-list be imported and called (a trusted checkpoint
    only; tensors stay lazy). ``stage``, ``world_size``, ``bf16`` (the file prefix); :meth:`param_specs`
    (zero_to_fp32's tensors), :meth:`global_steps`,
    :meth:`iter_parts` / :meth:`full` (a tensor's values: ``fp32`` weights, or Adam ``exp_avg``/``exp_avg_sq``),
    :meth:`optimizer_step`, :attr:`param_groups`, :meth:`files_by_rank` / :meth:`stored_files`.
    """

    def __init__(
        self, step_dir: Path, *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES, allow_pickle: bool = False
    ) -> None:
        self.step_dir = Path(step_dir)
        self.max_read_bytes = max(1, max_read_bytes)
        self.allow_pickle = allow_pickle
        self._archives: list[TorchArchive] = []
        self._swaps: list[SwapTensor] = []
        self._offload_files: dict[int, list[str]] = {}  # rank -> its offloaded_tensors/rankNN/ files
        self._paddings: list[list[int]] | None = None  # rank 0's param_alignment_paddings (ZeRO-1/2)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------------------------------------- loading

    def _load(self, name: str) -> Any:
        archive = open_archive(self.step_dir / name)
        self._archives.append(archive)
        return load_archive(archive, self.allow_pickle)

    def _scan(self) -> tuple[list[str], dict[int, str]]:
        """The step dir's listing and its optimizer-state files by rank (names checked; nothing read)."""
        try:
            st = os.lstat(self.step_dir)
            listing = os.listdir(self.step_dir)
        except OSError as e:
            raise CheckpointFormatError(f"{self.step_dir} cannot be listed ({e.strerror})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointFormatError(f"{self.step_dir} is not a directory (a symlink is not followed)")
        optim: dict[int, str] = {}
        prefixes: set[bool] = set()
        for n in listing:
            m = _OPTIM_RE.fullmatch(n)
            if m is None:
                if n.endswith("_optim_states.pt"):
                    raise _bad(self.step_dir / n, "an optimizer-state file with a name DeepSpeed ZeRO does not write")
                continue
            if m.group(3) != "00":
                raise _bad(self.step_dir / n, "model/tensor-parallel checkpoints (mp_rank other than 00) are not read")
            prefixes.add(m.group(1) is not None)
            optim[int(m.group(2))] = n
        if not optim:
            raise CheckpointFormatError(
                f"{self.step_dir} holds no '[bf16_]zero_pp_rank_K_mp_rank_00_optim_states.pt' file: "
                "not a DeepSpeed ZeRO step dir (pass the tag dir that engine.save_checkpoint wrote)"
            )
        if len(prefixes) > 1:
            raise _bad(self.step_dir, "it mixes bf16_ and plain optimizer-state files (two saves in one dir?)")
        self.bf16 = prefixes.pop()
        return listing, optim

    def _stage_and_world(self, head: object, where: Path) -> tuple[int, int]:
        """ZeRO stage and world size (``partition_count``) from the first optimizer-state file."""
        osd = _field(head, "optimizer_state_dict", dict, where)
        stage = _field(osd, "zero_stage", int, where)
        if stage not in (1, 2, 3):
            raise _bad(where, f"zero_stage {stage} is not 1, 2 or 3 (a non-ZeRO optimizer state)")
        if stage == 3:
            count = osd.get("partition_count")
            if type(count) is not int or count <= 0:
                raise _bad(where, f"partition_count {count!r} is not a positive int")
            return stage, count
        counts = _field(osd, "partition_count", list, where)
        if not counts or not all(type(c) is int and c > 0 for c in counts) or len(set(counts)) != 1:
            raise _bad(
                where,
                f"partition_count {str(counts)[:80]} is not one world size for every group "
                "(expert-parallel groups are not supported)",
            )
        return stage, counts[0]

    def _check_ranks(self, listing: list[str], optim: dict[int, str]) -> None:
        """Every rank's files are present (a missing one is named), and no file of another save is."""
        world = self.world_size
        extra = sorted(r for r in optim if r >= world)
        if extra:
            raise _bad(
                self.step_dir / optim[extra[0]],
                f"rank {extra[0]} exceeds the world size {world} that partition_count records "
                "(files of two saves mixed?)",
            )
        missing = [r for r in range(world) if r not in optim]
        if missing:
            raise CheckpointFormatError(
                f"{self.step_dir}: the optimizer-state file of rank {missing[0]} ({optim_file(missing[0], self.bf16)})"
                f" is missing ({len(optim)} of {plural(world, 'rank')} present, partition_count {world}); the save"
                " did not finish on every rank: restore the step from an intact copy or use an earlier step"
            )
        self._optim_files = [optim[r] for r in range(world)]
        if self.stage <= 2:
            self._model_files = [MODEL_STATES_Z12]
        else:
            self._model_files = [z3_model_file(r) for r in range(world)]
        for n in listing:  # MoE expert files and other model files zero_to_fp32 would also glob
            if n.endswith("_model_states.pt") and n not in self._model_files:
                raise _bad(
                    self.step_dir / n, "an extra model-state file (MoE/expert or other-stage files are not read)"
                )
        for r, n in enumerate(self._model_files):
            if not (self.step_dir / n).exists():
                raise CheckpointFormatError(
                    f"{self.step_dir}: the model-state file {n} of rank {r if self.stage == 3 else 0} is missing: "
                    "restore the step from an intact copy or use an earlier step"
                )

    def _scan_offload(self, listing: list[str]) -> dict[int, list[str]]:
        """The files of each ``offloaded_tensors/rankNN/`` (NVMe offload; names checked, nothing read).

        Hidden names, temp files of an interrupted atomic copy and gradient partitions (DeepSpeed never copies
        them into a checkpoint) hold no checkpoint data and are left out."""
        if OFFLOAD_DIR not in listing:
            return {}
        root = self.step_dir / OFFLOAD_DIR
        if self.stage != 3:
            raise _bad(
                root, f"NVMe offload files in a ZeRO-{self.stage} step (DeepSpeed swaps to NVMe with ZeRO-3 only)"
            )
        kind = lstat_kind(root)
        if kind != "dir":
            raise _bad(root, f"it is a {kind}, not a directory (a symlink is never followed)")
        out: dict[int, list[str]] = {}
        for name in sorted(os.listdir(root)):
            if name.startswith("."):
                continue
            m = _OFFLOAD_RANK_RE.fullmatch(name)
            if m is None or name != f"rank{int(m.group(1)):02d}":
                raise _bad(root / name, "a name DeepSpeed's NVMe offload does not write (expected rankNN)")
            rank = int(m.group(1))
            if rank >= self.world_size:
                raise _bad(
                    root / name,
                    f"rank {rank} exceeds the world size {self.world_size} that partition_count records "
                    "(files of two saves mixed?)",
                )
            if lstat_kind(root / name) != "dir":
                raise _bad(root / name, "it is not a directory (a symlink is never followed)")
            files: list[str] = []
            for f in sorted(os.listdir(root / name)):
                if f.startswith(".") or is_temp_name(f) or "gradient" in f:
                    continue
                if lstat_kind(root / name / f) != "file":
                    raise _bad(root / name / f, "it is not a regular file (a symlink is never followed)")
                files.append(f"{OFFLOAD_DIR}/{name}/{f}")
            out[rank] = files
        return out

    def _open(self) -> None:
        listing, optim = self._scan()
        first = min(optim)
        head = self._load(optim[first])
        self.stage, self.world_size = self._stage_and_world(head, self.step_dir / optim[first])
        self._check_ranks(listing, optim)
        self._offload_files = self._scan_offload(listing)
        self._ranks = [self._read_rank(r, head if r == first else self._load(optim[r])) for r in range(self.world_size)]
        self._build([self._load(n) for n in self._model_files])

    def _read_rank(self, rank: int, tree: object) -> _Rank:
        name = self._optim_files[rank]
        where = self.step_dir / name
        osd = _field(tree, "optimizer_state_dict", dict, where)
        if _field(osd, "zero_stage", int, where) != self.stage:
            raise _bad(where, f"its zero_stage differs from rank 0's ({self.stage})")
        if self.stage <= 2:
            groups_key, base_key = "single_partition_of_fp32_groups", "base_optimizer_state"
            counts = _field(osd, "partition_count", list, where)
            if any(c != self.world_size for c in counts):
                raise _bad(where, f"its partition_count {counts} differs from the other ranks'")
            pads = osd.get("param_alignment_paddings")
            if rank == 0 and pads is not None:
                if not isinstance(pads, list) or not all(
                    isinstance(p, list) and all(type(x) is int and x >= 0 for x in p) for p in pads
                ):
                    raise _bad(where, "param_alignment_paddings is not a list of padding lists")
                self._paddings = pads
        else:
            groups_key, base_key = "fp32_flat_groups", "optimizer_state_dict"
            if osd.get("partition_count") != self.world_size:
                raise _bad(where, f"its partition_count differs from the other ranks' ({self.world_size})")
        fp32: list[_Flat] = [
            _flat(t, f"{where} {groups_key}[{i}]") for i, t in enumerate(_field(osd, groups_key, list, where))
        ]
        rank_state = _Rank(rank, name, fp32, [{} for _ in fp32], [None for _ in fp32], [])
        base = osd.get(base_key)
        if base is not None:
            self._read_base_state(rank_state, base, where)
        return rank_state

    def _read_base_state(self, r: _Rank, base: object, where: Path) -> None:
        """The wrapped torch optimizer's state: one flat param per fp32 group, in param-group order (a torch
        ``state_dict``), or ZeRO-1/2's ``elastic_checkpoint`` form (a list of per-group states, no padding)."""
        if isinstance(base, list) and self.stage <= 2:
            per_group: list[object] = list(base)
        else:
            bstate = _field(base, "state", dict, where)
            order: list[object] = []
            for g in _field(base, "param_groups", list, where):
                order.extend(_field(g, "params", list, where))
                r.param_groups.append({k: v for k, v in g.items() if k != "params"})
            per_group = [bstate.get(idx) if isinstance(idx, int) else None for idx in order]
        if len(per_group) != len(r.fp32):
            raise _bad(where, f"its optimizer has {len(per_group)} flat params for {len(r.fp32)} fp32 groups")
        for i, s in enumerate(per_group):
            if s is None:
                continue
            if not isinstance(s, dict):
                raise _bad(where, f"the optimizer state of flat group {i} is not a dict")
            r.steps[i] = s.get("step")
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in s:
                    continue
                t = _flat(s[key], f"{where} optimizer state {i} {key}")
                need = r.fp32[i].numel
                if t.numel < need or (self.stage == 3 and t.numel != need):
                    raise _bad(where, f"the optimizer {key} of flat group {i} has {t.numel} elements, its fp32 {need}")
                r.state[i][key] = t

    def _build(self, models: list[Any]) -> None:
        """zero_to_fp32's state dict, as entries: buffers, frozen params, trainable params, then aliases."""
        where0 = self.step_dir / self._model_files[0]
        m0 = models[0]
        if not isinstance(m0, dict):
            raise _bad(where0, "it does not hold a dict")
        for key in _AUTOEP_KEYS:
            if m0.get(key):
                raise _bad(where0, "AutoEP expert layers are not supported")
        steps = m0.get("global_steps")
        if steps is not None and (type(steps) is not int or steps < 0):
            raise _bad(where0, f"global_steps {steps!r} is not a step count")
        self._global_steps: int | None = steps
        param_shapes = _field(m0, "param_shapes", list, where0)
        groups = [_names(d, f"{where0} param_shapes[{i}]") for i, d in enumerate(param_shapes)]
        entries: dict[str, _Entry] = {}
        self._add_buffers(entries, m0, where0)
        frozen_shapes = m0.get("frozen_param_shapes")
        self.frozen_names: list[str] = []
        if frozen_shapes:
            self._add_frozen(entries, _names(frozen_shapes, f"{where0} frozen_param_shapes"), models)
        self.trainable_names: list[str] = []
        if self.stage <= 2:
            self._add_zero2(entries, groups)
        else:
            self._attach_swapped(groups, m0, where0)
            self._add_zero3(entries, groups)
        shared = m0.get("shared_params") or {}
        if not isinstance(shared, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in shared.items()
        ):
            raise _bad(where0, "shared_params is not a name -> name mapping")
        self.shared: dict[str, str] = {}
        for alias, target in shared.items():
            if target in entries:
                entries[alias] = entries[target]
                self.shared[alias] = target
        self._entries = entries

    def _add_buffers(self, entries: dict[str, _Entry], m0: dict[Any, Any], where0: Path) -> None:
        """zero_to_fp32's buffers: the module's items named in ``buffer_names``, in module order."""
        module = _field(m0, "module", dict, where0)
        buffer_names = _field(m0, "buffer_names", list, where0)
        if not all(isinstance(n, str) for n in buffer_names):
            raise _bad(where0, "buffer_names is not a list of names")
        wanted = set(buffer_names)
        self.buffer_names: list[str] = []
        for k, v in module.items():
            if k in wanted:
                if not isinstance(v, LazyTensor):
                    raise _bad(where0, f"buffer {k!r} is not a tensor")
                entries[k] = _Buffer(v)
                self.buffer_names.append(k)

    def _add_frozen(self, entries: dict[str, _Entry], shapes: dict[str, tuple[int, ...]], models: list[Any]) -> None:
        for name, shape in shapes.items():
            frags: list[LazyTensor] = []
            for r, m in enumerate(models):
                where = self.step_dir / self._model_files[r]
                fragments = _field(m, "frozen_param_fragments", dict, where)
                t = fragments.get(name)
                if not isinstance(t, LazyTensor):
                    raise _bad(where, f"frozen_param_fragments has no tensor for {name!r}")
                frags.append(t)
            numel = math.prod(shape)
            if self.stage <= 2:
                if frags[0].shape != shape:
                    raise _bad(
                        self.step_dir / self._model_files[0], f"frozen {name!r} is {frags[0].shape}, not {shape}"
                    )
            else:
                for r, f in enumerate(frags):
                    _flat(f, f"{self.step_dir / self._model_files[r]} frozen {name!r}")
                if sum(f.numel for f in frags) < numel or len({f.dtype for f in frags}) != 1:
                    raise _bad(self.step_dir, f"the ranks' fragments of frozen {name!r} do not make up {shape}")
            entries[name] = _Frozen(shape, tuple(frags))
            self.frozen_names.append(name)

    def _add_zero2(self, entries: dict[str, _Entry], groups: list[dict[str, tuple[int, ...]]]) -> None:
        where = self.step_dir / self._optim_files[0]
        ngroups = len(self._ranks[0].fp32)
        if len(groups) != ngroups or any(len(r.fp32) != ngroups for r in self._ranks):
            raise _bad(where, f"{len(groups)} param groups in param_shapes but {ngroups} fp32 partitions per rank")
        paddings = self._paddings
        align = 2 * self.world_size
        self._group_sizes = [[r.fp32[g].numel for r in self._ranks] for g in range(ngroups)]
        for g, shapes in enumerate(groups):
            avail = sum(self._group_sizes[g])
            pads = None if paddings is None else paddings[g]
            if pads is not None and len(pads) != len(shapes):
                raise _bad(where, f"group {g} has {len(pads)} param_alignment_paddings for {len(shapes)} params")
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                if offset + numel > avail:
                    raise _bad(where, f"{name!r} ends at element {offset + numel} of group {g}, which has {avail}")
                entries[name] = _Trainable(shape, g, offset, 0)
                self.trainable_names.append(name)
                offset += numel + (pads[i] if pads is not None else 0)
            if align * math.ceil(offset / align) != align * math.ceil(avail / align):
                raise _bad(
                    where,
                    f"group {g}: the params use {offset} of {avail} elements (zero_to_fp32 would "
                    "fail: 'consumed ... numels')",
                )

    def _swap_tensor(self, rel: str, dtype: torch.dtype, numel: int, what: str) -> SwapTensor:
        """A swap file's tensor, after checking that its size is ``numel`` elements plus DeepSpeed's padding."""
        path = self.step_dir / rel
        size = os.lstat(path).st_size
        need = numel * dtype.itemsize
        if size < need or size - need >= SWAP_PAD_LIMIT or size % dtype.itemsize:
            raise CheckpointFormatError(
                f"{path}: {size} bytes, but {what} has {numel} {str(dtype).removeprefix('torch.')} elements ({need} "
                f"bytes, plus less than {SWAP_PAD_LIMIT} bytes of alignment padding): the swap file is truncated or "
                "from another save; restore the step from an intact copy or use an earlier step"
            )
        t = SwapTensor(path, dtype, numel)
        self._swaps.append(t)
        return t

    def _parse_swap_names(self, rank: int) -> dict[tuple[int, int], dict[str, str]]:
        """Rank ``rank``'s swap files: ``(first ds_id, last ds_id) -> {"fp32" | state key: relative path}``."""
        out: dict[tuple[int, int], dict[str, str]] = {}
        for rel in self._offload_files.get(rank, []):
            m = _SWAP_RE.fullmatch(rel.rsplit("/", 1)[1])
            if m is None:
                raise _bad(
                    self.step_dir / rel, "a file DeepSpeed's NVMe offload does not write (<key>-<a>_<b>.tensor.swp)"
                )
            out.setdefault((int(m.group(2)), int(m.group(3))), {})[m.group(1) or "fp32"] = rel
        return out

    def _attach_swapped(self, groups: list[dict[str, tuple[int, ...]]], m0: dict[Any, Any], where0: Path) -> None:
        """ZeRO-3 with NVMe offload: each swapped-out sub-group (an empty fp32 partition in every rank's
        optimizer-state file) gets its values from the rank's swap files; every swap file must be used."""
        swapped = [i for i, t in enumerate(self._ranks[0].fp32) if t.numel == 0]
        for r in self._ranks[1:]:
            mine = [i for i, t in enumerate(r.fp32) if t.numel == 0]
            if mine != swapped:
                raise _bad(
                    self.step_dir / r.file,
                    f"its swapped-out (empty) fp32 sub-groups {mine} differ from rank 0's {swapped}",
                )
        names = [self._parse_swap_names(r) for r in range(self.world_size)]
        if not swapped:
            extra = next((r for r in range(self.world_size) if names[r]), None)
            if extra is not None:
                raise _bad(
                    self.step_dir / offload_dir(extra),
                    "it holds swap files, but no fp32 sub-group was swapped out (files of another save?)",
                )
            return
        where = self.step_dir / self._optim_files[0]
        if len(groups) != len(self._ranks[0].fp32):
            raise _bad(
                where0, f"{len(groups)} sub-groups in param_shapes but {len(self._ranks[0].fp32)} fp32 partitions"
            )
        for rank in range(self.world_size):
            if rank not in self._offload_files:
                raise CheckpointFormatError(
                    f"{self.step_dir}: the fp32 partitions of sub-groups {swapped} were offloaded to NVMe (empty in "
                    f"{self._optim_files[rank]}), but {offload_dir(rank)}/ with rank {rank}'s swap files is missing: "
                    "the save did not copy them; restore the step from an intact copy or use an earlier step"
                )
        ids = self._match_swapped(groups, swapped, sorted(k for k, v in names[0].items() if "fp32" in v), m0, where)
        ws = self.world_size
        numels = {i: sum(math.ceil(math.prod(shape) / ws) for shape in groups[i].values()) for i in swapped}
        for r in self._ranks:
            unmatched = sorted(set(names[r.rank]) - set(ids.values()))
            if unmatched:
                raise _bad(
                    self.step_dir / offload_dir(r.rank),
                    f"it holds swap files of ds_ids {unmatched[0][0]}_{unmatched[0][1]}, "
                    "which name no swapped sub-group of rank 0",
                )
            for i in swapped:
                self._attach_group(r, i, ids[i], names[r.rank].get(ids[i], {}), numels[i])

    def _attach_group(self, r: _Rank, i: int, ids: tuple[int, int], files: dict[str, str], numel: int) -> None:
        """Sub-group ``i`` of rank ``r`` reads its fp32 partition and Adam state from its swap ``files``."""
        what = f"sub-group {i} (rank {r.rank}'s partition)"
        if "fp32" not in files:
            raise CheckpointFormatError(
                f"{self.step_dir / offload_dir(r.rank) / swap_file(ids)} is missing: {what} was swapped to NVMe "
                "and its fp32 master weights live only there; restore the step from an intact copy"
            )
        fp32 = self._swap_tensor(files["fp32"], r.fp32[i].dtype, numel, what)
        r.fp32[i] = fp32
        for key in ("exp_avg", "exp_avg_sq"):
            listed = r.state[i].get(key)
            if key not in files:
                if listed is not None:
                    raise CheckpointFormatError(
                        f"{self.step_dir / offload_dir(r.rank) / swap_file(ids, key)} is missing: {r.file} has an "
                        f"optimizer {key} for {what}, which lives only in that swap file; restore the step from an "
                        "intact copy"
                    )
                continue
            dtype = listed.dtype if listed is not None else fp32.dtype
            r.state[i][key] = self._swap_tensor(files[key], dtype, numel, f"{what} {key}")

    def _match_swapped(
        self,
        groups: list[dict[str, tuple[int, ...]]],
        swapped: list[int],
        ids: list[tuple[int, int]],
        m0: dict[Any, Any],
        where: Path,
    ) -> dict[int, tuple[int, int]]:
        """Which ``(first, last)`` ds_ids name each swapped sub-group's files.

        ZeRO-3 numbers params (``ds_id``) in ``module.parameters()`` order from a process-wide counter, so
        ds_id = base + the param's position among the module's params (``module`` in rank 0's model states:
        params and buffers in module order, minus buffers and shared-param aliases). The sub-groups' first
        params sorted by position and the files sorted by first ds_id are paired, and the pairing is accepted
        only when one ``base`` explains every first and last id."""
        if len(ids) != len(swapped):
            raise _bad(
                self.step_dir / offload_dir(0),
                f"it holds {len(ids)} fp32 swap files for {len(swapped)} swapped-out sub-groups {swapped}",
            )
        if len(ids) == 1:
            return {swapped[0]: ids[0]}
        module = m0.get("module")
        trainable = {n for i in swapped for n in groups[i]}
        known = {n for d in groups for n in d} | set(self.frozen_names)
        shared = m0.get("shared_params") or {}
        order = [k for k in module if k in known and k not in shared] if isinstance(module, dict) else []
        position = {name: p for p, name in enumerate(dict.fromkeys(order))}
        if not trainable <= position.keys():
            raise _bad(where, "the module's parameter order is not recorded, so its swap files cannot be matched")
        ends = {i: (position[next(iter(groups[i]))], position[next(reversed(groups[i]))]) for i in swapped}
        pairs = list(zip(sorted(swapped, key=lambda i: ends[i][0]), sorted(ids), strict=True))
        bases = {(first - ends[i][0], last - ends[i][1]) for i, (first, last) in pairs}
        if len(bases) != 1 or len({b for pair in bases for b in pair}) != 1:
            raise _bad(
                self.step_dir / offload_dir(0),
                f"its swap files' ds_ids {[f'{a}_{b}' for a, b in ids]} do not follow the module's parameter order, "
                "so they cannot be matched to the swapped sub-groups",
            )
        return dict(pairs)

    def _add_zero3(self, entries: dict[str, _Entry], groups: list[dict[str, tuple[int, ...]]]) -> None:
        sizes = [t.numel for t in self._ranks[0].fp32]
        for r in self._ranks[1:]:
            if [t.numel for t in r.fp32] != sizes:
                raise _bad(
                    self.step_dir / r.file,
                    f"its fp32 flat groups {[t.numel for t in r.fp32]} differ from rank 0's {sizes}",
                )
        self._group_sizes = [sizes]
        self._group_starts = [0]
        for n in sizes:
            self._group_starts.append(self._group_starts[-1] + n)
        merged: dict[str, tuple[int, ...]] = {}
        for d in groups:
            merged.update(d)
        offset, ws = 0, self.world_size
        for name, shape in merged.items():
            numel = math.prod(shape)
            part = math.ceil(numel / ws)
            entries[name] = _Trainable(shape, 0, offset, part)
            self.trainable_names.append(name)
            offset += part
        if offset != self._group_starts[-1]:
            raise _bad(
                self.step_dir / self._optim_files[0],
                f"the params use {offset * ws} of "
                f"{self._group_starts[-1] * ws} elements (zero_to_fp32 would fail: 'consumed ... numels')",
            )

    # ---------------------------------------------------------------------------------------------- API

    def close(self) -> None:
        for a in self._archives:
            a.close()
        for t in self._swaps:
            t.close()

    def __enter__(self) -> ZeroCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def format(self) -> str:
        return format_name(self.stage)

    def files_by_rank(self) -> dict[int, list[str]]:
        """Files each rank wrote (names relative to the step dir); ZeRO-1/2 model states belong to rank 0."""
        out: dict[int, list[str]] = {r: [] for r in range(self.world_size)}
        if self.stage <= 2:
            out[0].append(MODEL_STATES_Z12)
        else:
            for r in range(self.world_size):
                out[r].append(z3_model_file(r))
        for r, n in enumerate(self._optim_files):
            out[r].append(n)
        for r, files in self._offload_files.items():  # NVMe offload: offloaded_tensors/rankNN/*
            out[r].extend(files)
        return out

    def stored_files(self) -> set[str]:
        """Every file holding this checkpoint's data."""
        return {n for names in self.files_by_rank().values() for n in names}

    def names(self) -> list[str]:
        """zero_to_fp32's tensor names, in its order."""
        return list(self._entries)

    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            raise PipelineError(f"{self.step_dir}: no tensor {name!r} in this ZeRO checkpoint")
        return e

    def spec(self, name: str) -> TensorSpec:
        e = self._entry(name)
        if isinstance(e, _Buffer):
            return TensorSpec(name, _out_dtype(e.tensor.dtype), e.tensor.shape)
        if isinstance(e, _Frozen):
            return TensorSpec(name, _out_dtype(e.fragments[0].dtype), e.shape)
        return TensorSpec(name, _out_dtype(self._ranks[0].fp32[e.group].dtype), e.shape)

    def param_specs(self) -> list[TensorSpec]:
        """Every tensor zero_to_fp32 writes, in its order: buffers, frozen params, trainable params, aliases."""
        return [self.spec(n) for n in self._entries]

    def global_steps(self) -> int | None:
        """The engine's ``global_steps`` as rank 0's model states record it (None if absent)."""
        return self._global_steps

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Rank 0's optimizer param-group hyperparameters (``lr``, ``betas``, ...; ``params`` left out)."""
        return self._ranks[0].param_groups

    def optimizer_step(self) -> torch.Tensor | None:
        """The Adam step of the first flat group (checked equal on every rank), or None before any step."""
        values = []
        for r in self._ranks:
            s = r.steps[0] if r.steps else None
            if isinstance(s, LazyTensor):
                if s.numel != 1:
                    raise _bad(self.step_dir / r.file, "the optimizer step is not a scalar")
                s = s.materialize()
            elif isinstance(s, (int, float)) and type(s) is not bool:
                s = torch.tensor(s)
            elif s is not None:
                raise _bad(self.step_dir / r.file, f"the optimizer step is a {type(s).__name__}")
            values.append(s)
        if all(v is None for v in values):
            return None
        first = values[0]
        if first is None or any(v is None or not torch.equal(v, first) for v in values):
            raise _bad(self.step_dir, "the ranks record different optimizer steps (files of two saves mixed?)")
        return first

    def _source(self, rank: int, group: int, key: str) -> _Flat:
        r = self._ranks[rank]
        if key == "fp32":
            return r.fp32[group]
        t = r.state[group].get(key)
        if t is None:
            raise PipelineError(
                f"{self.step_dir / r.file}: no optimizer {key} for flat group {group} (saved before the first step?)"
            )
        return t

    def _pieces(self, e: _Trainable) -> Iterator[tuple[int, int, int, int]]:
        """``(rank, group, start, count)``: consecutive row-major pieces of a trainable param."""
        if self.stage <= 2:
            start = 0
            for rank, size in enumerate(self._group_sizes[e.group]):
                lo, hi = max(e.offset, start), min(e.offset + e.numel, start + size)
                if lo < hi:
                    yield rank, e.group, lo - start, hi - lo
                start += size
            return
        left = e.numel
        starts = self._group_starts
        for rank in range(self.world_size):
            for g in range(len(starts) - 1):
                lo, hi = max(e.offset, starts[g]), min(e.offset + e.partitioned, starts[g + 1])
                if lo < hi and left > 0:
                    n = min(hi - lo, left)
                    yield rank, g, lo - starts[g], n
                    left -= n

    def _chunks(self, t: _Flat, start: int, count: int) -> Iterator[torch.Tensor]:
        step = max(1, self.max_read_bytes // t.dtype.itemsize)
        for s in range(start, start + count, step):
            yield t.read(s, min(step, start + count - s))

    def iter_parts(self, name: str, key: str = "fp32") -> Iterator[torch.Tensor]:
        """Consecutive row-major 1-D pieces of tensor ``name`` (each at most ``max_read_bytes``).

        ``key``: ``fp32`` (the value zero_to_fp32 writes, in :meth:`spec`'s dtype), or the Adam ``exp_avg`` /
        ``exp_avg_sq`` of a trainable param (float32 as stored)."""
        if key not in KEYS:
            raise PipelineError(f"key {key!r} is not one of {KEYS}")
        e = self._entry(name)
        out_dtype = self.spec(name).dtype
        if not isinstance(e, _Trainable):
            if key != "fp32":
                kind = "buffer" if isinstance(e, _Buffer) else "frozen param"
                raise PipelineError(f"{self.step_dir}: {name!r} is a {kind}: it has no optimizer {key}")
            yield from (p.to(out_dtype) for p in self._other_parts(e))
            return
        for rank, group, start, count in self._pieces(e):
            for part in self._chunks(self._source(rank, group, key), start, count):
                yield part.to(out_dtype) if key == "fp32" else part

    def raw_spans(self, name: str) -> list[tuple[int, int, int]] | None:
        """Where the fp32 value of trainable param ``name`` lies as stored, ``(fd, offset, length)`` pieces in
        row-major order, so it can be copied without decoding; None for buffers and frozen params, or when the
        stored dtype is not the output's (then :meth:`iter_parts` decodes it). The descriptors stay owned by
        this checkpoint (closed with it)."""
        e = self._entry(name)
        if not isinstance(e, _Trainable):
            return None
        out_dtype = self.spec(name).dtype
        spans = []
        for rank, group, start, count in self._pieces(e):
            t = self._source(rank, group, "fp32")
            if t.dtype != out_dtype:
                return None
            if isinstance(t, SwapTensor):
                spans.append((t.fileno(), start * t.dtype.itemsize, count * t.dtype.itemsize))
            else:
                if not t.is_contiguous():
                    return None
                offset = t.storage.data_offset + (t.storage_offset + start) * t.dtype.itemsize
                spans.append((t.storage.archive.fileno(), offset, count * t.dtype.itemsize))
        return spans

    def _other_parts(self, e: _Buffer | _Frozen) -> Iterator[torch.Tensor]:
        if isinstance(e, _Buffer) or self.stage <= 2:  # one whole tensor
            tensor = e.tensor if isinstance(e, _Buffer) else e.fragments[0]
            if tensor.is_contiguous():
                yield from self._chunks(tensor, 0, tensor.numel)
            else:
                yield tensor.materialize().reshape(-1)
            return
        left = math.prod(e.shape)
        for frag in e.fragments:  # ZeRO-3: cat of the ranks' fragments, cut to numel
            n = min(frag.numel, left)
            if n:
                yield from self._chunks(frag, 0, n)
            left -= n

    def full(self, name: str, key: str = "fp32") -> torch.Tensor:
        """The whole tensor ``name`` (one tensor's memory)."""
        spec = self.spec(name)
        parts = list(self.iter_parts(name, key))
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=spec.dtype if key == "fp32" else torch.float32)
        return flat.view(spec.shape)


def consolidate_zero(
    step_dir: Path,
    out: Path,
    dtype: torch.dtype | None = None,
    on_tensor: Callable[[str], None] | None = None,
    *,
    max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
    allow_pickle: bool = False,
) -> int:
    """Stream every tensor of a ZeRO checkpoint into one safetensors file (``out``); return the tensor count.

    The file holds what ``convert_zero_checkpoint_to_state_dict(..., dtype, safe_serialization=True)`` writes
    (fp32 by default; ``dtype`` casts floating tensors), except that a shared param's alias is written as its
    own copy (DeepSpeed's safetensors writer refuses aliased tensors). Memory: one read of at most
    ``max_read_bytes`` at a time; a trainable param's fp32 slices are copied file to file (``copy_file_range``)
    when no cast is asked for. ``allow_pickle``: see :class:`ZeroCheckpoint`."""
    with ZeroCheckpoint(step_dir, max_read_bytes=max_read_bytes, allow_pickle=allow_pickle) as ckpt:
        specs = ckpt.param_specs()
        if dtype is not None:
            specs = [TensorSpec(s.name, dtype if s.dtype.is_floating_point else s.dtype, s.shape) for s in specs]
        writer = StreamingSafetensorsWriter(out, specs, metadata={"format": "pt"})
        try:
            for spec in specs:
                spans = ckpt.raw_spans(spec.name) if dtype is None else None
                if spans is not None:  # fp32 master slices copied as stored (copy_file_range), never decoded
                    writer.copy_parts(spec.name, spans)
                    if on_tensor is not None:
                        on_tensor(spec.name)
                    continue
                parts = ckpt.iter_parts(spec.name, "fp32")
                writer.write_parts(spec.name, (p.to(spec.dtype) for p in parts) if dtype is not None else parts)
                if on_tensor is not None:
                    on_tensor(spec.name)
            writer.close()
        finally:
            writer.discard()  # pending copies finish before the checkpoint's descriptors close
        return len(specs)
