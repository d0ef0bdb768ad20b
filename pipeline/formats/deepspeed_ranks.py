"""Each rank's optimizer-state file of a ZeRO step dir: the files found by name, the stage and world size, and
each rank's flat fp32 groups and Adam state (:class:`RankState`), swapped-out sub-groups read from their NVMe swap
files. :class:`RankFiles` is the first base of :class:`~pipeline.formats.deepspeed_zero.ZeroCheckpoint`.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import CheckpointFormatError, plural
from pipeline.formats.deepspeed_checks import as_flat, malformed, require_field
from pipeline.formats.deepspeed_names import (
    MODEL_STATES_Z12,
    MODEL_SUFFIX,
    OPTIM_RE,
    OPTIM_SUFFIX,
    offload_dir,
    optim_file,
    swap_file,
    z3_model_file,
)
from pipeline.formats.deepspeed_swap import SwapTensor, match_swapped, open_swap, parse_swap_names
from pipeline.formats.torch_zip import LazyTensor, TorchArchive, load_archive, open_archive

Flat = LazyTensor | SwapTensor
"""A flat fp32 partition or Adam state: in an optimizer-state file, or (NVMe offload) in a swap file."""


@dataclass
class RankState:
    """One rank's optimizer state, per flat group."""

    rank: int
    file: str
    fp32: list[Flat]  # ZeRO-3 with NVMe offload: a swapped sub-group's partition is a SwapTensor
    state: list[dict[str, Flat]]  # per flat group: exp_avg, exp_avg_sq (may be empty before a step)
    steps: list[object]  # per flat group: the Adam step (a 0-d tensor or a number), None if absent
    param_groups: list[dict[str, Any]]


class RankFiles:
    """Reads a ZeRO step dir's optimizer-state files, rank by rank (the names, checks and errors of that part of
    :class:`~pipeline.formats.deepspeed_zero.ZeroCheckpoint`, which opens the step and sets the fields below)."""

    step_dir: Path
    allow_pickle: bool
    stage: int
    world_size: int
    bf16: bool
    frozen_names: list[str]  # set before the swap files are matched (their ds_ids count frozen params too)
    _archives: list[TorchArchive]
    _swaps: list[SwapTensor]
    _offload_files: dict[int, list[str]]  # rank -> its offloaded_tensors/rankNN/ files
    _paddings: list[list[int]] | None  # rank 0's param_alignment_paddings (ZeRO-1/2)
    _ranks: list[RankState]

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
            m = OPTIM_RE.fullmatch(n)
            if m is None:
                if n.endswith(OPTIM_SUFFIX):
                    raise malformed(
                        self.step_dir / n, "an optimizer-state file with a name DeepSpeed ZeRO does not write"
                    )
                continue
            if m.group(3) != "00":
                raise malformed(
                    self.step_dir / n, "model/tensor-parallel checkpoints (mp_rank other than 00) are not read"
                )
            prefixes.add(m.group(1) is not None)
            optim[int(m.group(2))] = n
        if not optim:
            raise CheckpointFormatError(
                f"{self.step_dir} holds no '[bf16_]zero_pp_rank_K_mp_rank_00_optim_states.pt' file: "
                "not a DeepSpeed ZeRO step dir (pass the tag dir that engine.save_checkpoint wrote)"
            )
        if len(prefixes) > 1:
            raise malformed(self.step_dir, "it mixes bf16_ and plain optimizer-state files (two saves in one dir?)")
        self.bf16 = prefixes.pop()
        return listing, optim

    def _stage_and_world(self, head: object, where: Path) -> tuple[int, int]:
        """ZeRO stage and world size (``partition_count``) from the first optimizer-state file."""
        osd = require_field(head, "optimizer_state_dict", dict, where)
        stage = require_field(osd, "zero_stage", int, where)
        if stage not in (1, 2, 3):
            raise malformed(where, f"zero_stage {stage} is not 1, 2 or 3 (a non-ZeRO optimizer state)")
        if stage == 3:
            count = osd.get("partition_count")
            if type(count) is not int or count <= 0:
                raise malformed(where, f"partition_count {count!r} is not a positive int")
            return stage, count
        counts = require_field(osd, "partition_count", list, where)
        if not counts or not all(type(c) is int and c > 0 for c in counts) or len(set(counts)) != 1:
            raise malformed(
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
            raise malformed(
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
            if n.endswith(MODEL_SUFFIX) and n not in self._model_files:
                raise malformed(
                    self.step_dir / n, "an extra model-state file (MoE/expert or other-stage files are not read)"
                )
        for r, n in enumerate(self._model_files):
            if not (self.step_dir / n).exists():
                raise CheckpointFormatError(
                    f"{self.step_dir}: the model-state file {n} of rank {r if self.stage == 3 else 0} is missing: "
                    "restore the step from an intact copy or use an earlier step"
                )

    def _read_rank(self, rank: int, tree: object) -> RankState:
        name = self._optim_files[rank]
        where = self.step_dir / name
        osd = require_field(tree, "optimizer_state_dict", dict, where)
        if require_field(osd, "zero_stage", int, where) != self.stage:
            raise malformed(where, f"its zero_stage differs from rank 0's ({self.stage})")
        if self.stage <= 2:
            groups_key, base_key = "single_partition_of_fp32_groups", "base_optimizer_state"
            counts = require_field(osd, "partition_count", list, where)
            if any(c != self.world_size for c in counts):
                raise malformed(where, f"its partition_count {counts} differs from the other ranks'")
            pads = osd.get("param_alignment_paddings")
            if rank == 0 and pads is not None:
                if not isinstance(pads, list) or not all(
                    isinstance(p, list) and all(type(x) is int and x >= 0 for x in p) for p in pads
                ):
                    raise malformed(where, "param_alignment_paddings is not a list of padding lists")
                self._paddings = pads
        else:
            groups_key, base_key = "fp32_flat_groups", "optimizer_state_dict"
            if osd.get("partition_count") != self.world_size:
                raise malformed(where, f"its partition_count differs from the other ranks' ({self.world_size})")
        fp32: list[Flat] = [
            as_flat(t, f"{where} {groups_key}[{i}]") for i, t in enumerate(require_field(osd, groups_key, list, where))
        ]
        rank_state = RankState(rank, name, fp32, [{} for _ in fp32], [None for _ in fp32], [])
        base = osd.get(base_key)
        if base is not None:
            self._read_base_state(rank_state, base, where)
        return rank_state

    def _read_base_state(self, r: RankState, base: object, where: Path) -> None:
        """The wrapped torch optimizer's state: one flat param per fp32 group, in param-group order (a torch
        ``state_dict``), or ZeRO-1/2's ``elastic_checkpoint`` form (a list of per-group states, no padding)."""
        if isinstance(base, list) and self.stage <= 2:
            per_group: list[object] = list(base)
        else:
            bstate = require_field(base, "state", dict, where)
            order: list[object] = []
            for g in require_field(base, "param_groups", list, where):
                order.extend(require_field(g, "params", list, where))
                r.param_groups.append({k: v for k, v in g.items() if k != "params"})
            per_group = [bstate.get(idx) if isinstance(idx, int) else None for idx in order]
        if len(per_group) != len(r.fp32):
            raise malformed(where, f"its optimizer has {len(per_group)} flat params for {len(r.fp32)} fp32 groups")
        for i, s in enumerate(per_group):
            if s is None:
                continue
            if not isinstance(s, dict):
                raise malformed(where, f"the optimizer state of flat group {i} is not a dict")
            r.steps[i] = s.get("step")
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in s:
                    continue
                t = as_flat(s[key], f"{where} optimizer state {i} {key}")
                need = r.fp32[i].numel
                if t.numel < need or (self.stage == 3 and t.numel != need):
                    raise malformed(
                        where, f"the optimizer {key} of flat group {i} has {t.numel} elements, its fp32 {need}"
                    )
                r.state[i][key] = t

    def _swap_tensor(self, rel: str, dtype: torch.dtype, numel: int, what: str) -> SwapTensor:
        """A swap file's tensor, after checking that its size is ``numel`` elements plus DeepSpeed's padding."""
        t = open_swap(self.step_dir / rel, dtype, numel, what)
        self._swaps.append(t)
        return t

    def _attach_swapped(self, groups: list[dict[str, tuple[int, ...]]], m0: dict[Any, Any], where0: Path) -> None:
        """ZeRO-3 with NVMe offload: each swapped-out sub-group (an empty fp32 partition in every rank's
        optimizer-state file) gets its values from the rank's swap files; every swap file must be used."""
        swapped = [i for i, t in enumerate(self._ranks[0].fp32) if t.numel == 0]
        for r in self._ranks[1:]:
            mine = [i for i, t in enumerate(r.fp32) if t.numel == 0]
            if mine != swapped:
                raise malformed(
                    self.step_dir / r.file,
                    f"its swapped-out (empty) fp32 sub-groups {mine} differ from rank 0's {swapped}",
                )
        names = [parse_swap_names(self.step_dir, self._offload_files.get(r, [])) for r in range(self.world_size)]
        if not swapped:
            extra = next((r for r in range(self.world_size) if names[r]), None)
            if extra is not None:
                raise malformed(
                    self.step_dir / offload_dir(extra),
                    "it holds swap files, but no fp32 sub-group was swapped out (files of another save?)",
                )
            return
        where = self.step_dir / self._optim_files[0]
        if len(groups) != len(self._ranks[0].fp32):
            raise malformed(
                where0, f"{len(groups)} sub-groups in param_shapes but {len(self._ranks[0].fp32)} fp32 partitions"
            )
        for rank in range(self.world_size):
            if rank not in self._offload_files:
                raise CheckpointFormatError(
                    f"{self.step_dir}: the fp32 partitions of sub-groups {swapped} were offloaded to NVMe (empty in "
                    f"{self._optim_files[rank]}), but {offload_dir(rank)}/ with rank {rank}'s swap files is missing: "
                    "the save did not copy them; restore the step from an intact copy or use an earlier step"
                )
        fp32_ids = sorted(k for k, v in names[0].items() if "fp32" in v)
        ids = match_swapped(self.step_dir, groups, swapped, fp32_ids, m0, where, self.frozen_names)
        ws = self.world_size
        numels = {i: sum(math.ceil(math.prod(shape) / ws) for shape in groups[i].values()) for i in swapped}
        for r in self._ranks:
            unmatched = sorted(set(names[r.rank]) - set(ids.values()))
            if unmatched:
                raise malformed(
                    self.step_dir / offload_dir(r.rank),
                    f"it holds swap files of ds_ids {unmatched[0][0]}_{unmatched[0][1]}, "
                    "which name no swapped sub-group of rank 0",
                )
            for i in swapped:
                self._attach_group(r, i, ids[i], names[r.rank].get(ids[i], {}), numels[i])

    def _attach_group(self, r: RankState, i: int, ids: tuple[int, int], files: dict[str, str], numel: int) -> None:
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
