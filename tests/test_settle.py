"""Records another node replaces read whole: a torn read (seen through a FUSE mount) is read again first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.checkpoint.protocol.ownership import FileLease, Holder
from pipeline.errors import VerificationError
from pipeline.storage import settle
from pipeline.storage.integrity import read_record_json


def test_a_record_read_torn_is_read_again_and_parses_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = json.dumps({"step": 8, "pad": "x" * 50}).encode()
    reads = [whole[:20], whole[:31] + b"\0" * 9, whole]
    slept: list[float] = []
    monkeypatch.setattr(settle.time, "sleep", slept.append)
    assert settle.parse_settled(lambda: reads.pop(0), json.loads, (ValueError,)) == {"step": 8, "pad": "x" * 50}
    assert slept == list(settle.REREAD_DELAYS_S[:2])


def test_a_record_damaged_for_good_is_damaged_after_a_quarter_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(settle.time, "sleep", slept.append)
    (tmp_path / "latest").write_bytes(b'{"step": 8, "dir": "ste')
    with pytest.raises(VerificationError, match="is not valid JSON"):
        read_record_json(tmp_path / "latest", "latest pointer")
    assert slept == list(settle.REREAD_DELAYS_S)
    # a committer lease record: read again the same way, then returned as it is (garbled: no holder named in it;
    # a newcomer then watches it for a whole lease before taking over, it never counts as free at once)
    slept.clear()
    name = "epoch-00000003-0123456789abcdef.json"
    (tmp_path / name).write_bytes(b'{"epoch": 3, "tok')
    assert Holder.parse(FileLease(tmp_path).get(name)) is None
    assert slept == list(settle.REREAD_DELAYS_S)
