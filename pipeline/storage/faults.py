"""Fault injection for tests: ``PIPELINE_FAULTS="point[@key=value...][;point...]"`` makes :func:`inject` raise.

Points are named where I/O happens (``shard_save.before_marker``, ``verify.before_publish``, ...); optional
``key=value`` filters match the call's context, e.g. ``shard_save.before_marker@rank=1@step=4``.
The special filter ``action=exit`` kills the process with ``os._exit(17)`` instead of raising, like a crash.
"""

from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    pass


def inject(point: str, **context: object) -> None:
    spec = os.environ.get("PIPELINE_FAULTS", "")
    if not spec:
        return
    for item in spec.split(";"):
        name, *filters = item.strip().split("@")
        if name != point:
            continue
        wanted = dict(f.split("=", 1) for f in filters if "=" in f)
        action = wanted.pop("action", "raise")
        if all(str(context.get(k)) == v for k, v in wanted.items()):
            if action == "exit":
                os._exit(17)
            raise InjectedFault(f"injected fault at {point} {context}")
