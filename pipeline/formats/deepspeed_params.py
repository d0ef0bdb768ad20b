"""The tensors DeepSpeed's ``zero_to_fp32`` writes, read from a ZeRO step's model-state files as entries (buffer,
frozen param, trainable param, shared alias) placed on the ranks' flat groups. :class:`ParamLayout` is the second
base of :class:`~pipeline.formats.deepspeed_zero.ZeroCheckpoint`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.formats.deepspeed_checks import as_flat, as_shapes, malformed, require_field
from pipeline.formats.deepspeed_ranks import RankFiles
from pipeline.formats.torch_zip import LazyTensor

_AUTOEP_KEYS = ("ds_autoep_layers", "autoep_layers")


@dataclass(frozen=True)
class BufferEntry:
    tensor: LazyTensor


@dataclass(frozen=True)
class FrozenEntry:
    shape: tuple[int, ...]
    fragments: tuple[LazyTensor, ...]  # ZeRO-1/2: the whole tensor; ZeRO-3: one flat fragment per rank


@dataclass(frozen=True)
class TrainableEntry:
    shape: tuple[int, ...]
    group: int  # ZeRO-1/2 only
    offset: int  # ZeRO-1/2: in the group's merged vector; ZeRO-3: in each rank's concatenated groups
    partitioned: int  # ZeRO-3 only: elements per rank

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Entry = BufferEntry | FrozenEntry | TrainableEntry


class ParamLayout(RankFiles):
    """Maps zero_to_fp32's tensors onto the flat groups :class:`RankFiles` read (in zero_to_fp32's order)."""

    def _build(self, models: list[Any]) -> None:
        """zero_to_fp32's state dict, as entries: buffers, frozen params, trainable params, then aliases."""
        where0 = self.step_dir / self._model_files[0]
        m0 = models[0]
        if not isinstance(m0, dict):
            raise malformed(where0, "it does not hold a dict")
        for key in _AUTOEP_KEYS:
            if m0.get(key):
                raise malformed(where0, "AutoEP expert layers are not supported")
        steps = m0.get("global_steps")
        if steps is not None and (type(steps) is not int or steps < 0):
            raise malformed(where0, f"global_steps {steps!r} is not a step count")
        self._global_steps: int | None = steps
        param_shapes = require_field(m0, "param_shapes", list, where0)
        groups = [as_shapes(d, f"{where0} param_shapes[{i}]") for i, d in enumerate(param_shapes)]
        entries: dict[str, Entry] = {}
        self._add_buffers(entries, m0, where0)
        frozen_shapes = m0.get("frozen_param_shapes")
        self.frozen_names: list[str] = []
        if frozen_shapes:
            self._add_frozen(entries, as_shapes(frozen_shapes, f"{where0} frozen_param_shapes"), models)
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
            raise malformed(where0, "shared_params is not a name -> name mapping")
        self.shared: dict[str, str] = {}
        for alias, target in shared.items():
            if target in entries:
                entries[alias] = entries[target]
                self.shared[alias] = target
        self._entries = entries

    def _add_buffers(self, entries: dict[str, Entry], m0: dict[Any, Any], where0: Path) -> None:
        """zero_to_fp32's buffers: the module's items named in ``buffer_names``, in module order."""
        module = require_field(m0, "module", dict, where0)
        buffer_names = require_field(m0, "buffer_names", list, where0)
        if not all(isinstance(n, str) for n in buffer_names):
            raise malformed(where0, "buffer_names is not a list of names")
        wanted = set(buffer_names)
        self.buffer_names: list[str] = []
        for k, v in module.items():
            if k in wanted:
                if not isinstance(v, LazyTensor):
                    raise malformed(where0, f"buffer {k!r} is not a tensor")
                entries[k] = BufferEntry(v)
                self.buffer_names.append(k)

    def _add_frozen(self, entries: dict[str, Entry], shapes: dict[str, tuple[int, ...]], models: list[Any]) -> None:
        for name, shape in shapes.items():
            frags: list[LazyTensor] = []
            for r, m in enumerate(models):
                where = self.step_dir / self._model_files[r]
                fragments = require_field(m, "frozen_param_fragments", dict, where)
                t = fragments.get(name)
                if not isinstance(t, LazyTensor):
                    raise malformed(where, f"frozen_param_fragments has no tensor for {name!r}")
                frags.append(t)
            numel = math.prod(shape)
            if self.stage <= 2:
                if frags[0].shape != shape:
                    raise malformed(
                        self.step_dir / self._model_files[0], f"frozen {name!r} is {frags[0].shape}, not {shape}"
                    )
            else:
                for r, f in enumerate(frags):
                    as_flat(f, f"{self.step_dir / self._model_files[r]} frozen {name!r}")
                if sum(f.numel for f in frags) < numel or len({f.dtype for f in frags}) != 1:
                    raise malformed(self.step_dir, f"the ranks' fragments of frozen {name!r} do not make up {shape}")
            entries[name] = FrozenEntry(shape, tuple(frags))
            self.frozen_names.append(name)

    def _add_zero2(self, entries: dict[str, Entry], groups: list[dict[str, tuple[int, ...]]]) -> None:
        where = self.step_dir / self._optim_files[0]
        ngroups = len(self._ranks[0].fp32)
        if len(groups) != ngroups or any(len(r.fp32) != ngroups for r in self._ranks):
            raise malformed(where, f"{len(groups)} param groups in param_shapes but {ngroups} fp32 partitions per rank")
        paddings = self._paddings
        align = 2 * self.world_size
        self._group_sizes = [[r.fp32[g].numel for r in self._ranks] for g in range(ngroups)]
        for g, shapes in enumerate(groups):
            avail = sum(self._group_sizes[g])
            pads = None if paddings is None else paddings[g]
            if pads is not None and len(pads) != len(shapes):
                raise malformed(where, f"group {g} has {len(pads)} param_alignment_paddings for {len(shapes)} params")
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                if offset + numel > avail:
                    raise malformed(where, f"{name!r} ends at element {offset + numel} of group {g}, which has {avail}")
                entries[name] = TrainableEntry(shape, g, offset, 0)
                self.trainable_names.append(name)
                offset += numel + (pads[i] if pads is not None else 0)
            if align * math.ceil(offset / align) != align * math.ceil(avail / align):
                raise malformed(
                    where,
                    f"group {g}: the params use {offset} of {avail} elements (zero_to_fp32 would "
                    "fail: 'consumed ... numels')",
                )

    def _add_zero3(self, entries: dict[str, Entry], groups: list[dict[str, tuple[int, ...]]]) -> None:
        sizes = [t.numel for t in self._ranks[0].fp32]
        for r in self._ranks[1:]:
            if [t.numel for t in r.fp32] != sizes:
                raise malformed(
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
            entries[name] = TrainableEntry(shape, 0, offset, part)
            self.trainable_names.append(name)
            offset += part
        if offset != self._group_starts[-1]:
            raise malformed(
                self.step_dir / self._optim_files[0],
                f"the params use {offset * ws} of "
                f"{self._group_starts[-1] * ws} elements (zero_to_fp32 would fail: 'consumed ... numels')",
            )
