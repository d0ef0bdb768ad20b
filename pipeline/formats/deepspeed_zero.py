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
  parameter order, see :func:`~pipeline.formats.deepspeed_swap.match_swapped`) and checks every file's size.

Files are found by name only (:mod:`~pipeline.formats.deepspeed_names`) and read with
:mod:`pipeline.formats.torch_zip` (restricted unpickler, lazy tensors); swap files with ``os.pread``, one bounded
piece at a time (:mod:`~pipeline.formats.deepspeed_swap`).
Output: :class:`ZeroCheckpoint` gives the full tensors exactly as DeepSpeed's ``zero_to_fp32`` rebuilds them
(same names, order, dtypes, values: buffers, frozen params, trainable params, shared-param aliases), streamed
as consecutive row-major pieces, never a whole flat group; the Adam ``exp_avg``/``exp_avg_sq`` of every
trainable param by the same slicing. :func:`consolidate_zero` writes them to one safetensors file.
Every malformed, missing or inconsistent input is a :class:`~pipeline.errors.CheckpointFormatError`.

This module holds the reading API and :func:`consolidate_zero`; the rank files are read by
:mod:`~pipeline.formats.deepspeed_ranks`, the tensors placed on them by :mod:`~pipeline.formats.deepspeed_params`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import PipelineError
from pipeline.formats.deepspeed_checks import malformed
from pipeline.formats.deepspeed_names import MODEL_STATES_Z12, STAGE_OF, format_name, is_zero_checkpoint, z3_model_file
from pipeline.formats.deepspeed_params import BufferEntry, Entry, FrozenEntry, ParamLayout, TrainableEntry
from pipeline.formats.deepspeed_ranks import Flat
from pipeline.formats.deepspeed_swap import SwapTensor, scan_offload
from pipeline.formats.safetensors_stream import StreamingSafetensorsWriter, TensorSpec
from pipeline.formats.torch_zip import LazyTensor, TorchArchive

__all__ = [  # with the names callers import from here since before the split into deepspeed_*.py
    "DEFAULT_MAX_READ_BYTES",
    "KEYS",
    "STAGE_OF",
    "SwapTensor",
    "ZeroCheckpoint",
    "consolidate_zero",
    "format_name",
    "is_zero_checkpoint",
]

KEYS: tuple[str, ...] = ("fp32", "exp_avg", "exp_avg_sq")

DEFAULT_MAX_READ_BYTES = 64 << 20
"""Largest single read: a piece of a tensor larger than this is streamed in several reads."""


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """zero_to_fp32's output dtype: floating tensors become float32, others keep theirs."""
    return torch.float32 if dtype.is_floating_point else dtype


class ZeroCheckpoint(ParamLayout):
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

    def _open(self) -> None:
        listing, optim = self._scan()
        first = min(optim)
        head = self._load(optim[first])
        self.stage, self.world_size = self._stage_and_world(head, self.step_dir / optim[first])
        self._check_ranks(listing, optim)
        self._offload_files = scan_offload(self.step_dir, listing, self.stage, self.world_size)
        self._ranks = [self._read_rank(r, head if r == first else self._load(optim[r])) for r in range(self.world_size)]
        self._build([self._load(n) for n in self._model_files])

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

    def _entry(self, name: str) -> Entry:
        e = self._entries.get(name)
        if e is None:
            raise PipelineError(f"{self.step_dir}: no tensor {name!r} in this ZeRO checkpoint")
        return e

    def spec(self, name: str) -> TensorSpec:
        e = self._entry(name)
        if isinstance(e, BufferEntry):
            return TensorSpec(name, _out_dtype(e.tensor.dtype), e.tensor.shape)
        if isinstance(e, FrozenEntry):
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
                    raise malformed(self.step_dir / r.file, "the optimizer step is not a scalar")
                s = s.materialize()
            elif isinstance(s, (int, float)) and type(s) is not bool:
                s = torch.tensor(s)
            elif s is not None:
                raise malformed(self.step_dir / r.file, f"the optimizer step is a {type(s).__name__}")
            values.append(s)
        if all(v is None for v in values):
            return None
        first = values[0]
        if first is None or any(v is None or not torch.equal(v, first) for v in values):
            raise malformed(self.step_dir, "the ranks record different optimizer steps (files of two saves mixed?)")
        return first

    def _source(self, rank: int, group: int, key: str) -> Flat:
        r = self._ranks[rank]
        if key == "fp32":
            return r.fp32[group]
        t = r.state[group].get(key)
        if t is None:
            raise PipelineError(
                f"{self.step_dir / r.file}: no optimizer {key} for flat group {group} (saved before the first step?)"
            )
        return t

    def _pieces(self, e: TrainableEntry) -> Iterator[tuple[int, int, int, int]]:
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

    def _chunks(self, t: Flat, start: int, count: int) -> Iterator[torch.Tensor]:
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
        if not isinstance(e, TrainableEntry):
            if key != "fp32":
                kind = "buffer" if isinstance(e, BufferEntry) else "frozen param"
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
        if not isinstance(e, TrainableEntry):
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

    def _other_parts(self, e: BufferEntry | FrozenEntry) -> Iterator[torch.Tensor]:
        if isinstance(e, BufferEntry) or self.stage <= 2:  # one whole tensor
            tensor = e.tensor if isinstance(e, BufferEntry) else e.fragments[0]
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
