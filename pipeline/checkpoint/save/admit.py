"""What a state may hold: checked at ``save``, before anything is staged, against what the loader will accept.

"Committed" must mean "resumable". The restricted reader (:class:`pipeline.formats.dcp.SafeLoadPlanner`) restores
tensors and what ``torch.load(weights_only=True)`` accepts: numbers, strings, bytes, ``None``, lists, tuples,
dicts, sets, ``torch.Size``, dtypes. A value it would refuse at resume (a plain object, a lambda, a ``DataLoader``)
is refused here, by key, so no step that cannot be loaded is ever committed. Every value that is not a tensor nor a
plain scalar is round-tripped through that same reader now (values are small: tensors never go through it).
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from pipeline.formats.pickle_safety import error_summary, weights_only_reason

_SCALARS = (bool, int, float, str, bytes, type(None))
_HINT = (
    "keep tensors, numbers, strings, None and lists/dicts of them in a state, or an object with "
    "state_dict()/load_state_dict() (a Stateful)"
)


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every value the reader will have to restore, with its path (``['extra']['epoch']``); containers walked."""
    if type(value) in (dict, OrderedDict):
        for k, v in value.items():
            if not isinstance(k, _SCALARS):
                yield f"{path} key {k!r}", k
            yield from _leaves(v, f"{path}[{k!r}]")
    elif type(value) in (list, tuple):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def _what_to_do(value: Any) -> str:
    if isinstance(value, torch.utils.data.DataLoader):
        return (
            "a DataLoader has no state of its own to save: wrap it, pipeline.checkpoint.ResumableLoader(loader), "
            "or use torchdata's StatefulDataLoader (docs: library.md, 'Data loaders')"
        )
    if callable(value):
        return "code is never saved (nothing unpickles it back): rebuild it at start and leave it out of the state"
    return _HINT


def refusal(sd: Mapping[str, Any]) -> str | None:
    """Why ``sd`` (the state dict a save would write, :func:`~pipeline.checkpoint.save.state.save_state`'s) could
    not be resumed, naming the first value the reader would refuse; None if every value round-trips."""
    for path, value in _leaves(dict(sd), "state"):
        if isinstance(value, (torch.Tensor, *_SCALARS)):
            continue
        why = _round_trip(value)
        if why is not None:
            return (
                f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which a resume could not load "
                f"({why}): {_what_to_do(value)}"
            )
    return None


def _round_trip(value: Any) -> str | None:
    """None if ``value`` comes back equal through ``torch.save`` and the restricted reader; else why not."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises (a lambda, a lock) is the answer
        return f"it cannot be written: {type(e).__name__}: {error_summary(e)}"
    buf.seek(0)
    try:
        back = torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001 - the reader's refusal is the answer, named in one line below
        return f"the restricted reader refuses it: {weights_only_reason(e)}"
    try:
        same = bool(back == value)
    except Exception:  # noqa: BLE001 - a value whose == is not a bool (a container of tensors): it loaded
        same = True
    return None if same else "it does not come back equal"
