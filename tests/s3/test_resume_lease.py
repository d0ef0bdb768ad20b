"""The library's resume beside an external bucket committer watches the lease where the bucket keeps it.

On b7e80a6 ``resume.decide_with`` judged the committer by the local directory's lease: on any node but the
committer's, a renewing bucket committer was never seen, and the resume gave up after ``EXTERNAL_START_S`` with
"the producer is no longer running" while a step staged before the kill still waited to be committed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline.checkpoint import resume
from tests.s3.helpers import committer, make_remote, stage_step


def test_a_resume_on_another_node_waits_for_a_live_bucket_committer(
    tmp_path: Path, bucket: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resume, "EXTERNAL_START_S", 0.3)  # past this, only a live lease keeps the resume waiting
    committer_node, remote_a = make_remote(tmp_path / "node1", bucket, prefix)
    trainer_node, remote_b = make_remote(tmp_path / "node2", bucket, prefix)  # another node: its own local dir
    stage_step(committer_node, remote_a, 2)  # saved whole before the kill, not committed yet
    c = committer(committer_node, remote_a)
    with c.hold():  # the committer runs on node1: its lease is in the bucket, renewed
        later = threading.Timer(2.0, c.commit_ready)  # and commits the step a while after the resume began
        later.start()
        try:
            got = resume.decide_with(trainer_node, 2, deadline_s=60.0, thread_alive=None, remote=remote_b)
        finally:
            later.join()
    assert got == 2, got
