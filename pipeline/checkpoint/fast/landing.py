"""Where a fast restore puts a rank's state: the state dict it loads into (the *template*, built once per restore),
and which of its tensors received bytes may land in directly.

A replaced node's rank receives most of its blob over the link. Received into a buffer, those bytes cost a pass
over memory the new process has never touched and a second copy into the state; received straight into the
template's tensors (the model's parameters and the optimizer's moments themselves), they cost neither. Every byte
is still hashed against the step's table before the state is used: in place, the hash runs over the tensor's own
bytes. The price is that a piece that fails its hash has already overwritten its tensor. That is harmless where
something else overwrites every such tensor before training goes on (another verified copy, or the durable tier's
step), so a landing receives in place only where the durable tier has a step (``floor`` >= 1); where the durable
tier then has nothing that verifies after all, the resume fails in one line (:meth:`Landing.check_fresh`) rather
than train from a state that holds bytes that failed their hash."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipeline.checkpoint.fast.codec import (
    _HEAD,
    DTYPES,
    SKELETON_KEY,
    BlobView,
    Scattered,
    _layout,
    _piece_of,
    fill,
    unpack,
)
from pipeline.errors import VerificationError

__all__ = ["Landing", "destinations", "prime"]


class Landing:
    """``build()``: the template (what :func:`~.codec.fill` loads into: the state dict with the live tensors);
    ``apply(filled)``: set it into the model and optimizer, returns the step it records; ``optimizer``: the
    optimizer whose state the blob holds under ``optim`` (None: none), primed from the blob's header before the
    template is built (:func:`prime`). ``what`` names the copy in errors."""

    def __init__(
        self,
        build: Callable[[], Any],
        apply: Callable[[Any], int],
        what: str,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self._build, self._apply, self.what, self.optimizer = build, apply, what, optimizer
        self._template: Any = None
        self._built = False
        self._primed: list[Any] = []
        self.landed = 0
        """The bytes received into the template's tensors, over every round (they hold what arrived, verified or
        not)."""
        self.loaded = False
        """A blob was loaded into the template (the state holds its bytes, whether or not it is then used)."""
        self.seconds = 0.0
        """Spent building the template."""

    def template(self, head: memoryview) -> Any:
        """The template, built once, for the blob whose (verified) header is ``head``."""
        if not self._built:
            t = time.monotonic()
            if self.optimizer is not None:
                self._primed = prime(self.optimizer, head)
            self._template, self._built = self._build(), True
            self.seconds += time.monotonic() - t
        return self._template

    def places(self, head: memoryview) -> dict[int, torch.Tensor]:
        """For the blob whose header is ``head`` (its verified first piece): blob offset -> the bytes of the
        template tensor that :func:`~.codec.fill` would copy the tensor at that offset into."""
        return destinations(self.template(head), head)

    def load(self, blob: BlobView) -> int:
        head = blob.views[0] if isinstance(blob, Scattered) else memoryview(blob).cast("B")
        template = self.template(head)
        self.loaded = True  # from here on the state may hold the blob's bytes
        return self._apply(fill(template, unpack(blob, self.what)))

    def discard(self) -> None:
        """Nothing was restored: the optimizer state :func:`prime` made is taken back (the durable tier's load
        builds its own), and the template with it."""
        if self.optimizer is not None:
            for param in self._primed:
                self.optimizer.state.pop(param, None)
        self._primed, self._template, self._built = [], None, False

    def check_fresh(self, step: int, group: Any) -> None:
        """Every rank, once the resume step is decided: a fresh start (0) after any rank's state took a fast copy's
        bytes is refused: bytes received into it that failed their check, or a copy loaded into it and then not
        used (it recorded another step, or another rank's failed), and nothing overwrote them."""
        if step:
            return
        touched = torch.tensor([int(self.landed > 0 or self.loaded)])
        dist.all_reduce(touched, group=group)
        if touched.item():
            raise VerificationError(
                "a fast-tier copy's bytes went into the model's state and the copy was then not used, and the "
                "durable tier has no step that verifies: the state is not the initial one. Relaunch: the refused "
                "copy is quarantined, and the run starts fresh from its initialisation"
            )


def prime(opt: torch.optim.Optimizer, head: memoryview) -> list[Any]:
    """Where ``opt`` has no state yet (a new process), give each parameter the state the blob whose header is
    ``head`` holds for it, as uninitialised tensors of the saved dtypes (``torch.empty_like`` the parameter, a
    DTensor shard as one), and return the parameters primed. Without it, building the template runs DCP's
    ``_init_optim_state``: an optimizer step with zero gradients, a pass over every parameter and moment that
    the restore then overwrites; here the first write into the moments' memory is the restore's. Parameters are
    matched to the saved names by their order in the param groups (the fast tier restores only the same
    layout); where anything does not match, nothing is primed (the template then takes that step)."""
    if opt.state:
        return []
    parsed = _header(head)
    if parsed is None:
        return []
    header, skeleton = parsed
    optim = _child(skeleton, "optim")
    saved_state, groups = _child(optim, "state"), _child(optim, "param_groups")
    if not isinstance(groups, dict) or not isinstance(groups.get("L"), list) or not isinstance(saved_state, dict):
        return []
    names = [_value(_child(g, "params")) for g in groups["L"]]
    live = [g["params"] for g in opt.param_groups]
    if len(names) != len(live) or any(not isinstance(n, list) or len(n) != len(p) for n, p in zip(names, live)):  # noqa: B905
        return []
    made: dict[Any, dict[str, Any]] = {}
    for fqns, params in zip(names, live, strict=True):
        for fqn, param in zip(fqns, params, strict=True):
            entry = _child(saved_state, fqn)
            if entry is None:
                continue  # no state saved for it (frozen, or never stepped): none made
            values = _state_of(entry, param, header)
            if values is None:
                return []
            made[param] = values
    for param, values in made.items():
        opt.state[param] = values
    return list(made)


def _state_of(entry: Any, param: torch.Tensor, header: dict[str, Any]) -> dict[str, Any] | None:
    """One parameter's saved state (a skeleton dict of tensors and numbers) as empty tensors; None: unsure."""
    if not isinstance(entry, dict) or not isinstance(entry.get("D"), list):
        return None
    out: dict[str, Any] = {}
    for pair in entry["D"]:
        key = _value(pair[0]) if isinstance(pair, list) and len(pair) == 2 else None
        if not isinstance(key, str) or not isinstance(pair[1], dict) or len(pair[1]) != 1:
            return None
        ((tag, value),) = pair[1].items()
        if tag == "V" and isinstance(value, int | float | bool | None):
            out[key] = value
            continue
        name = value if tag == "T" else value[0] if tag == "S" and isinstance(value, list) and value else None
        meta = header.get(name) if isinstance(name, str) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("shape"), list):
            return None
        dtype, shape = DTYPES.get(str(meta.get("dtype"))), list(meta["shape"])
        if dtype is None:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param
        if shape == list(local.shape) and (tag == "S") == isinstance(param, DTensor):
            out[key] = torch.empty_like(param, dtype=dtype, requires_grad=False)
        elif not shape and tag == "T" and local.device.type == "cpu":  # on a GPU the step's device is the
            out[key] = torch.empty((), dtype=dtype)  # optimizer's choice (fused, capturable): not guessed
        else:
            return None
    return out


def _header(head: memoryview) -> tuple[dict[str, Any], Any] | None:
    try:
        (n,) = _HEAD.unpack_from(head)
        header = json.loads(bytes(head[_HEAD.size : _HEAD.size + n]))
        return header, json.loads(header.pop("__metadata__")[SKELETON_KEY])
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None


def _child(node: Any, key: str) -> Any:
    """The skeleton node under ``key`` of a skeleton dict node (None: not one, or no such key)."""
    if not isinstance(node, dict) or not isinstance(node.get("D"), list):
        return None
    for pair in node["D"]:
        if isinstance(pair, list) and len(pair) == 2 and _value(pair[0]) == key:
            return pair[1]
    return None


def _value(node: Any) -> Any:
    """A skeleton leaf's plain value; a list node's values (None where not plain)."""
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "V":
            return value
        if tag in ("L", "U") and isinstance(value, list):
            return [_value(v) for v in value]
    return None


def destinations(template: Any, head: memoryview) -> dict[int, torch.Tensor]:
    """Blob offset -> a uint8 view of the template tensor :func:`~.codec.fill` copies that blob tensor into, for
    each tensor fill takes whole (same dtype, shape and shard place; CPU; contiguous); {} where ``head`` does not
    hold a header that parses (nothing lands in place: fill then says why)."""
    parsed = _header(head)
    if parsed is None:
        return {}
    header, skeleton = parsed
    (n,) = _HEAD.unpack_from(head)
    start = _HEAD.size + n
    out: dict[int, torch.Tensor] = {}

    def walk(t: Any, node: Any) -> None:
        if not isinstance(node, dict) or len(node) != 1:
            return
        ((tag, value),) = node.items()
        if tag == "D" and isinstance(t, dict) and isinstance(value, list):
            for pair in value:
                if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict) and "V" in pair[0]:
                    key = pair[0]["V"]
                    if isinstance(key, str | int) and key in t:
                        walk(t[key], pair[1])
        elif tag in ("T", "S") and isinstance(t, torch.Tensor):
            place(t, value if tag == "T" else value[0] if isinstance(value, list) and value else None, tag, value)

    def place(t: torch.Tensor, key: Any, tag: str, value: Any) -> None:
        entry = header.get(key) if isinstance(key, str) else None
        if not isinstance(entry, dict):
            return
        try:
            theirs = _layout(value[1], value[2]) if tag == "S" else None
            b, e = (int(x) for x in entry["data_offsets"])
            dtype, shape = DTYPES.get(entry["dtype"]), [int(d) for d in entry["shape"]]
        except (ValueError, TypeError, KeyError, IndexError):
            return
        if (_piece_of(t) if isinstance(t, DTensor) else None) != theirs:
            return
        local = (t.to_local() if isinstance(t, DTensor) else t).detach()
        nbytes = local.numel() * local.element_size()
        if local.device.type != "cpu" or not local.is_contiguous() or local.dtype != dtype:
            return
        if list(local.shape) != shape or e - b != nbytes or nbytes == 0:
            return
        out[start + b] = local.view(-1).view(torch.uint8)

    walk(template, skeleton)
    return out
