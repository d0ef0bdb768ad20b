"""The fast tier's options (:class:`FastConfig`) and what its saves did (:class:`FastStats`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeline.errors import PipelineError


@dataclass(frozen=True)
class FastConfig:
    """The fast tier's options (the ``Checkpointer``'s ``fast_*`` arguments, the app's ``checkpoint.fast``)."""

    every: int
    """Save to the fast tier every this many steps."""
    dir: str = "/dev/shm/pipeline-fast"
    """Node-local (RAM-backed by default); a dir per run is made inside."""
    replicas: int = 1
    """Copies of each rank's shard on other nodes."""
    keep: int = 2
    """Steps kept per copy once a save is done; while the next is written, the newest ``keep - 1`` (at least one)
    complete steps survive, so a node holds ``keep`` steps at most (``keep = 1``: two) and reuses the pages of the
    step it dropped."""

    def check(self) -> None:
        for name in ("every", "keep"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise PipelineError(f"fast {name}={value!r}: must be a positive integer")
        if type(self.replicas) is not int or self.replicas < 0:
            raise PipelineError(f"fast replicas={self.replicas!r}: must be 0 or a positive integer")


@dataclass
class FastStats:
    saved: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    held_bytes: int = 0
    """What this rank's copies (own and replicas, every step kept) take in its node dir."""
    staging_bytes: int = 0
    """What each snapshot packs into: its buffer's bytes in use (reused; pinned for GPU state), and this process's
    snapshot files (:mod:`.slots`)."""
    last_persist_s: float = 0.0
    written_bytes: int = 0
    """Bytes this rank wrote into node dirs (every save, copies and replicas)."""
    renamed_bytes: int = 0
    """Of ``written_bytes``, those that went in as files already holding them (a snapshot's, a receive's), by a
    rename: no copy."""
    sent_bytes: int = 0
    """Bytes this rank sent to peers (every save)."""
    persist_cpu_s: float = 0.0
    """CPU seconds of the background thread (every save; the transport's own threads not counted)."""
    phase_cpu_s: dict[str, float] = field(default_factory=dict)
    """``persist_cpu_s`` by phase: hash, gather, write, replicate, prune, refill."""
    save_cpu_s: list[float] = field(default_factory=list)
    """``persist_cpu_s`` by save, in order."""

    def add(self, phase: str, since: float) -> float:
        now = time.thread_time()
        self.phase_cpu_s[phase] = self.phase_cpu_s.get(phase, 0.0) + now - since
        return now
