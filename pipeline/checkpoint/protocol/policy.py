"""What a committer is told (how it waits, what it may read, what it keeps) and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.checkpoint import options
from pipeline.checkpoint.protocol.ownership import DEFAULT_LEASE_S


@dataclass(frozen=True)
class CommitPolicy:
    """How the committer waits, what it may read, and what it keeps."""

    world_size: int
    """Markers a staged step needs when its rank-0 marker does not say (the run's world size)."""
    marker_deadline_s: float = 600.0
    """How long the last pass waits for a step's missing markers while its producer is alive."""
    poll_interval_s: float = 1.0
    """How often a following committer looks for newly staged steps."""
    allow_pickle: bool = False
    """Whether a format's files that need full unpickling may be read (an imported checkpoint the user trusts)."""
    keep_last: int | None = None
    keep_every: int | None = None
    keep_outputs_last: int | None = None
    keep_best: int | None = None
    """Also keep the ``keep_best`` steps whose ``best_metric`` (recorded by ``save(..., metrics=...)``) is best."""
    best_metric: str = "loss"
    best_mode: str = "min"
    """``min``: the lowest value is best (a loss); ``max``: the highest (an accuracy)."""
    lease_s: float = DEFAULT_LEASE_S
    """The committer lease: a holder whose heartbeat is older than this is gone, and another may take over."""

    def __post_init__(self) -> None:
        """The same checks as the app's config and the command lines make (:mod:`pipeline.checkpoint.options`)."""
        options.check_world_size(self.world_size)
        options.check_deadline(self.marker_deadline_s, "marker_deadline_s")
        options.check_seconds(self.poll_interval_s, "poll_interval_s")
        options.check_seconds(self.lease_s, "lease_s")
        for name in ("keep_last", "keep_every", "keep_outputs_last"):
            options.check_keep(getattr(self, name), name)
        options.check_best(self.keep_best, self.best_metric, self.best_mode)


@dataclass
class CommitReport:
    """What one committer run did: committed steps (with the unix time of each commit), and what it refused."""

    committed: dict[int, float] = field(default_factory=dict)
    quarantined: list[str] = field(default_factory=list)
    incomplete: list[tuple[int, str]] = field(default_factory=list)
    unread: dict[int, str] = field(default_factory=dict)
    """Steps not committed because their files could not be read (unknown, not damage), with why."""
