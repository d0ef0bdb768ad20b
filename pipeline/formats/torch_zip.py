"""Safe, lazy reader of ``torch.save`` zip archives (e.g. DeepSpeed checkpoints), without unpickling code.

Input: a file written by ``torch.save`` (zip format: ``<archive>/data.pkl`` plus one uncompressed record
``<archive>/data/<key>`` per storage).
Output: :func:`load_lazy` returns the saved object tree: plain containers and scalars, ``OrderedDict``,
``torch.Size``, dtypes, and a :class:`LazyTensor` for every tensor, which reads only the bytes asked for
(``os.pread`` at the storage record's offset, found from the zip local header). A few DeepSpeed classes become
inert data: ``ZeroStageEnum`` its int value, ``fragment_address`` a :class:`FragmentAddress`, ``LossScaler`` a
:class:`LossScalerState` holding its attributes.

``data.pkl`` is read with a restricted unpickler: its opcodes are checked first (memo and frame bombs), and a
global outside the allow-list is refused with a :class:`~pipeline.errors.CheckpointFormatError` naming it
(nothing is imported or called). Compressed or encrypted records, records that run past the end of the file,
storages smaller than their tensors and a ``data.pkl`` over 256 MiB are refused too.

This module is the entry point; the archive and its lazy tensors are in :mod:`~pipeline.formats.torch_zip_archive`,
the restricted unpickler in :mod:`~pipeline.formats.torch_zip_unpickle`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.formats.torch_zip_archive import FileWindow, LazyTensor, TorchArchive
from pipeline.formats.torch_zip_unpickle import ALLOW_PICKLE_HINT, FragmentAddress, LossScalerState, unpickle

__all__ = [  # with the names callers import from here since before the split into torch_zip_*.py
    "ALLOW_PICKLE_HINT",
    "MAX_PICKLE_BYTES",
    "FileWindow",
    "FragmentAddress",
    "LazyTensor",
    "LossScalerState",
    "TorchArchive",
    "load_archive",
    "load_lazy",
    "open_archive",
]

MAX_PICKLE_BYTES = 256 << 20
"""Largest ``data.pkl`` read (DeepSpeed's are kilobytes to a few megabytes: tensors live in the records)."""


def open_archive(path: Path, start: int = 0, length: int | None = None) -> TorchArchive:
    """Open ``path`` (or its bytes ``start..start+length``) as a torch.save zip archive (records located;
    nothing unpickled)."""
    return TorchArchive(path, start, length)


def load_archive(archive: TorchArchive, allow_pickle: bool = False) -> Any:
    """The object tree of an open archive, tensors as :class:`LazyTensor` (see the module docstring).

    ``allow_pickle``: globals outside the allow-list are imported and called (full unpickling: only for a file
    you trust); tensors are still read lazily."""
    return unpickle(archive.read_record("data.pkl", MAX_PICKLE_BYTES), archive, allow_pickle)


def load_lazy(path: Path, allow_pickle: bool = False) -> Any:
    """Open ``path`` and return its object tree with :class:`LazyTensor` leaves (nothing read beyond data.pkl)."""
    return load_archive(open_archive(Path(path)), allow_pickle)
