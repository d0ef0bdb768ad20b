"""A Lightning checkpoint dict as a state the library saves and restores exactly (:mod:`.lightning`).

The library stores plain values (tensors, numbers, strings, bytes, ``None``, lists and dicts of them) by their
path in a DCP step, with string keys. A Lightning checkpoint holds more shapes than that: the optimizer's state
keyed by parameter index (``{0: {...}}``), tuples (Adam's ``betas``), empty dicts and lists (a loop's
``state_dict: {}``) that a flattening by path would drop. :func:`encode` writes those as plain values of
their own, :func:`decode` gives the original back; any other object is left as it is, and the library's save
refuses it in one line naming it (a committed step is a resumable one).
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import StateError

_MARK = "#"
_INT = "#int:"
_STR = "#str:"
_TUPLE = "#tuple"
_EMPTY = {"#{}": dict, "#[]": list, "#()": tuple}


def encode(value: Any) -> Any:
    """``value`` with int dict keys, tuples and empty containers spelled as plain strings and dicts."""
    if isinstance(value, dict):
        if not value:
            return "#{}"
        return {_key(k): encode(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v) for v in value]} if value else "#()"
    if isinstance(value, list):
        return [encode(v) for v in value] if value else "#[]"
    if isinstance(value, str) and value.startswith(_MARK):
        return _STR + value
    return value


def decode(value: Any) -> Any:
    """:func:`encode`'s inverse."""
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(decode(v) for v in value[_TUPLE])
        return {_unkey(k): decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, str):
        if value in _EMPTY:
            return _EMPTY[value]()
        if value.startswith(_STR):
            return value[len(_STR) :]
    return value


def _key(key: Any) -> str:
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise StateError(
            f"the Lightning checkpoint has a dict key {key!r} ({type(key).__name__}): a step keeps str and int keys; "
            "return plain dicts from your state_dict()/on_save_checkpoint"
        )
    if isinstance(key, int):
        return f"{_INT}{key}"
    return _STR + key if key.startswith(_MARK) else key


def _unkey(key: str) -> Any:
    if key.startswith(_INT):
        return int(key[len(_INT) :])
    return key[len(_STR) :] if key.startswith(_STR) else key
