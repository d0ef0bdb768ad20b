"""The ``shared_fs`` fixture: one SeaweedFS filer mounted twice through FUSE for the whole session.

Use it from a test module with ``pytest_plugins = ["tests.sharedfs_fixture"]`` and mark its tests
``@pytest.mark.xdist_group("sharedfs")`` so that one xdist worker owns the mounts. Tests share the filesystem:
each should work in a directory of its own (e.g. named after ``uuid.uuid4()``). Skips when FUSE cannot work
here (:func:`tests.sharedfs.skip_reason`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sharedfs import SharedFS, shared_filesystem, skip_reason


@pytest.fixture(scope="session")
def shared_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedFS]:
    """Two FUSE mounts (``shared_fs.mounts[0]``, ``[1]``) of one filer: two "nodes" sharing one filesystem."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with shared_filesystem(tmp_path_factory.mktemp("sharedfs")) as fs:
        yield fs
