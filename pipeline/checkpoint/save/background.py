"""The committer as a background thread of rank 0: commits each staged step as it completes, never blocking
training. It holds the checkpoint dir's committer lock for its whole life (so no second committer runs), and
a failed pass is logged and retried, never lost silently; :meth:`BackgroundCommitter.stop` runs one last pass
and waits for it at most a deadline.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from pipeline.checkpoint.protocol.committer import CommitPolicy, Committer, CommitterLost
from pipeline.checkpoint.stores.remote import Remote
from pipeline.checkpoint.stores.stores import store_for
from pipeline.errors import PipelineError
from pipeline.storage.layout import CheckpointLayout

log = logging.getLogger(__name__)


class BackgroundCommitter:
    def __init__(self, layout: CheckpointLayout, policy: CommitPolicy, remote: Remote | None = None) -> None:
        self.committer = Committer(layout, policy, store_for(layout, remote))
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.recovered = threading.Event()
        """Set once the first pass (re-verify ``latest``, finish an interrupted commit) is done: resume waits for it."""
        self._lock = contextlib.ExitStack()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the committer lock (raises ``CommitterBusy`` if another committer holds it) and start."""
        self._lock.enter_context(self.committer.hold(takeover=True))  # rank 0 of the job owns its commits
        self._thread = threading.Thread(target=self._run, name="checkpoint-committer", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        recovered = False
        while True:
            try:
                if not recovered:
                    if not self.committer.recover_or_defer():  # the store away now: one line, then again
                        if self._stop.wait(self.committer.policy.poll_interval_s):
                            return
                        continue
                    recovered = True
                    self.recovered.set()
                self.committer.follow(alive=lambda: True, stop=self._stop.is_set)
                return
            except CommitterLost as e:  # another committer took over: this one acts no more
                self.errors.append(str(e))
                log.error("COMMITTER: %s", e)
                return
            except (PipelineError, OSError) as e:
                self.errors.append(str(e))
                log.error("COMMITTER: %s (retrying in %.1f s)", e, self.committer.policy.poll_interval_s)
                if self._stop.is_set():
                    return
                time.sleep(self.committer.policy.poll_interval_s)

    def stop(self, deadline_s: float) -> None:
        """One last pass (commits every complete step), at most ``deadline_s``; the lock is released only once
        the thread has ended (a stuck committer keeps it until the process exits)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(deadline_s)
            if self._thread.is_alive():
                log.error("COMMITTER did not finish its last pass within %.0f s; left to the process exit", deadline_s)
                return
        self._lock.close()
        report = self.committer.report
        for line in report.quarantined:
            log.error("QUARANTINED %s", line)
        if report.committed:
            log.info("committer: committed step(s) %s", sorted(report.committed))
