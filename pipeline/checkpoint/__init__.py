"""The checkpoint library: the pipeline's guarantees for any ``torchrun`` script (no Hydra, no submitit, no app).

    from pipeline.checkpoint import Checkpointer

* :class:`Checkpointer` (training side: ``should_save``, ``save``/``save_async``/``wait``, ``load_latest``,
  ``load(step=...)``, ``steps``/``best_step``, ``reached_preemption``, ``close``), :class:`RankLocal` /
  :func:`RankRNG` for per-rank state, :class:`ResumableLoader` for a plain ``DataLoader``;
* :class:`Committer` / :class:`CommitPolicy`: the one committer (also ``python -m pipeline.commit``);
* the on-disk protocol beneath them: :mod:`.manifest` (markers, manifests, ``latest``), :mod:`.rank_save`,
  :mod:`.retention`, :mod:`.state` (the key schema), :mod:`pipeline.storage.backend` (the storage seam).

Names are imported on first use, so ``import pipeline.checkpoint.manifest`` (the committer's jobs) never pulls
in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "pipeline.checkpoint.checkpointer",
    "Committer": "pipeline.checkpoint.protocol.committer",
    "CommitPolicy": "pipeline.checkpoint.protocol.committer",
    "CommitterBusy": "pipeline.checkpoint.protocol.committer",
    "RankLocal": "pipeline.checkpoint.save.state",
    "RankRNG": "pipeline.checkpoint.save.state",
    "ResumableLoader": "pipeline.checkpoint.loader",
    "SaveResult": "pipeline.checkpoint.save.rank_save",
}
__all__ = [
    "Checkpointer",
    "CommitPolicy",
    "Committer",
    "CommitterBusy",
    "RankLocal",
    "RankRNG",
    "ResumableLoader",
    "SaveResult",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
