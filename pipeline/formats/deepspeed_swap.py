"""DeepSpeed's NVMe offload files in a ZeRO-3 step dir: :class:`SwapTensor` (a swap file's raw elements, read
with bounded ``os.pread`` calls) and how the ``offloaded_tensors/rankNN/`` files are listed, size-checked and
matched by ``ds_id`` to the sub-groups whose fp32 partitions were swapped out.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import CheckpointFormatError, PipelineError
from pipeline.formats.deepspeed_checks import malformed
from pipeline.formats.deepspeed_names import (
    OFFLOAD_DIR,
    OFFLOAD_RANK_RE,
    SWAP_RE,
    is_gradient_partition,
    offload_dir,
    offload_rank_name,
)
from pipeline.storage.atomic import is_temp_name
from pipeline.storage.integrity import lstat_kind

SWAP_PAD_LIMIT = 1 << 20
"""Most bytes of alignment padding a swap file may have after its elements (DeepSpeed pads to 1 KiB times
``aio.intra_op_parallelism``; 1 MiB is its AIO block size)."""


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
                raise malformed(self.path, f"the swap file is not a regular file of {self.numel} {self.dtype} elements")
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
                raise malformed(self.path, f"the swap file ended at byte {offset + done} (truncated while being read?)")
            view[done : done + len(data)] = data
            done += len(data)
        return out

    def materialize(self) -> torch.Tensor:
        return self.read()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def scan_offload(step_dir: Path, listing: list[str], stage: int, world_size: int) -> dict[int, list[str]]:
    """The files of each ``offloaded_tensors/rankNN/`` (NVMe offload; names checked, nothing read).

    Hidden names, temp files of an interrupted atomic copy and gradient partitions (DeepSpeed never copies
    them into a checkpoint) hold no checkpoint data and are left out."""
    if OFFLOAD_DIR not in listing:
        return {}
    root = step_dir / OFFLOAD_DIR
    if stage != 3:
        raise malformed(root, f"NVMe offload files in a ZeRO-{stage} step (DeepSpeed swaps to NVMe with ZeRO-3 only)")
    kind = lstat_kind(root)
    if kind != "dir":
        raise malformed(root, f"it is a {kind}, not a directory (a symlink is never followed)")
    out: dict[int, list[str]] = {}
    for name in sorted(os.listdir(root)):
        if name.startswith("."):
            continue
        m = OFFLOAD_RANK_RE.fullmatch(name)
        if m is None or name != offload_rank_name(int(m.group(1))):
            raise malformed(root / name, "a name DeepSpeed's NVMe offload does not write (expected rankNN)")
        rank = int(m.group(1))
        if rank >= world_size:
            raise malformed(
                root / name,
                f"rank {rank} exceeds the world size {world_size} that partition_count records "
                "(files of two saves mixed?)",
            )
        if lstat_kind(root / name) != "dir":
            raise malformed(root / name, "it is not a directory (a symlink is never followed)")
        files: list[str] = []
        for f in sorted(os.listdir(root / name)):
            if f.startswith(".") or is_temp_name(f) or is_gradient_partition(f):
                continue
            if lstat_kind(root / name / f) != "file":
                raise malformed(root / name / f, "it is not a regular file (a symlink is never followed)")
            files.append(f"{OFFLOAD_DIR}/{name}/{f}")
        out[rank] = files
    return out


def open_swap(path: Path, dtype: torch.dtype, numel: int, what: str) -> SwapTensor:
    """A swap file's tensor, after checking that its size is ``numel`` elements plus DeepSpeed's padding."""
    size = os.lstat(path).st_size
    need = numel * dtype.itemsize
    if size < need or size - need >= SWAP_PAD_LIMIT or size % dtype.itemsize:
        raise CheckpointFormatError(
            f"{path}: {size} bytes, but {what} has {numel} {str(dtype).removeprefix('torch.')} elements ({need} "
            f"bytes, plus less than {SWAP_PAD_LIMIT} bytes of alignment padding): the swap file is truncated or "
            "from another save; restore the step from an intact copy or use an earlier step"
        )
    return SwapTensor(path, dtype, numel)


def parse_swap_names(step_dir: Path, files: list[str]) -> dict[tuple[int, int], dict[str, str]]:
    """A rank's swap ``files`` (relative to ``step_dir``) by sub-group: ``(first ds_id, last ds_id) ->
    {"fp32" | state key: relative path}``."""
    out: dict[tuple[int, int], dict[str, str]] = {}
    for rel in files:
        m = SWAP_RE.fullmatch(rel.rsplit("/", 1)[1])
        if m is None:
            raise malformed(step_dir / rel, "a file DeepSpeed's NVMe offload does not write (<key>-<a>_<b>.tensor.swp)")
        out.setdefault((int(m.group(2)), int(m.group(3))), {})[m.group(1) or "fp32"] = rel
    return out


def match_swapped(
    step_dir: Path,
    groups: list[dict[str, tuple[int, ...]]],
    swapped: list[int],
    ids: list[tuple[int, int]],
    m0: dict[Any, Any],
    where: Path,
    frozen_names: list[str],
) -> dict[int, tuple[int, int]]:
    """Which ``(first, last)`` ds_ids name each swapped sub-group's files.

    ZeRO-3 numbers params (``ds_id``) in ``module.parameters()`` order from a process-wide counter, so
    ds_id = base + the param's position among the module's params (``module`` in rank 0's model states:
    params and buffers in module order, minus buffers and shared-param aliases). The sub-groups' first
    params sorted by position and the files sorted by first ds_id are paired, and the pairing is accepted
    only when one ``base`` explains every first and last id."""
    if len(ids) != len(swapped):
        raise malformed(
            step_dir / offload_dir(0),
            f"it holds {len(ids)} fp32 swap files for {len(swapped)} swapped-out sub-groups {swapped}",
        )
    if len(ids) == 1:
        return {swapped[0]: ids[0]}
    module = m0.get("module")
    trainable = {n for i in swapped for n in groups[i]}
    known = {n for d in groups for n in d} | set(frozen_names)
    shared = m0.get("shared_params") or {}
    order = [k for k in module if k in known and k not in shared] if isinstance(module, dict) else []
    position = {name: p for p, name in enumerate(dict.fromkeys(order))}
    if not trainable <= position.keys():
        raise malformed(where, "the module's parameter order is not recorded, so its swap files cannot be matched")
    ends = {i: (position[next(iter(groups[i]))], position[next(reversed(groups[i]))]) for i in swapped}
    pairs = list(zip(sorted(swapped, key=lambda i: ends[i][0]), sorted(ids), strict=True))
    bases = {(first - ends[i][0], last - ends[i][1]) for i, (first, last) in pairs}
    if len(bases) != 1 or len({b for pair in bases for b in pair}) != 1:
        raise malformed(
            step_dir / offload_dir(0),
            f"its swap files' ds_ids {[f'{a}_{b}' for a, b in ids]} do not follow the module's parameter order, "
            "so they cannot be matched to the swapped sub-groups",
        )
    return dict(pairs)
