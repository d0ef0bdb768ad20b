"""Safety checks shared by the restricted unpicklers (DCP metadata, torch.save archives); no heavy imports."""

from __future__ import annotations

import pickletools
import re
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import PipelineError

_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def error_summary(e: BaseException, limit: int = 200) -> str:
    """An exception's text on one line, without terminal codes, cut at a word to at most ``limit`` characters
    (for one-line error messages)."""
    text = " ".join(_TERMINAL_CODES.sub("", str(e)).split())
    if len(text) > limit:
        text = text[: limit - 1].rsplit(" ", 1)[0] + "…"
    return text or type(e).__name__


def weights_only_reason(e: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused: the global it names, without torch's multi-paragraph advice
    and terminal codes; else the error's own text on one line."""
    marker = "Unsupported global: GLOBAL "
    text = " ".join(_TERMINAL_CODES.sub("", str(e)).split())
    if marker in text:
        return "global " + text.split(marker, 1)[1].split(" ", 1)[0] + " is not allowed"
    return error_summary(e)


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def check_opcodes(data: bytes, file: Path, refusal: Callable[[Path, str], PipelineError]) -> None:
    """Walk the pickle's opcodes without running them and refuse what would make the C unpickler allocate far
    beyond the file: a memo index larger than the number of opcodes before it (``LONG_BINPUT 10**9`` grows
    the memo table to gigabytes; a pickler numbers its memo entries from 0), a frame or a length that runs
    past the end of the data."""
    try:
        for count, (op, arg, pos) in enumerate(pickletools.genops(data)):
            if op.name in _MEMO_PUTS and not (isinstance(arg, int) and 0 <= arg <= count):
                raise refusal(file, f"memo index {arg!r} at byte {pos} is not one a pickler writes")
            if op.name == "FRAME" and not (isinstance(arg, int) and arg <= len(data) - (pos or 0)):
                raise refusal(file, f"a frame of {arg!r} bytes at byte {pos} runs past the end")
    except PipelineError:
        raise
    except Exception as e:  # truncated opcodes, lengths past the end, unknown opcodes
        raise refusal(file, f"its pickle opcodes are malformed ({type(e).__name__}: {error_summary(e)})") from None
