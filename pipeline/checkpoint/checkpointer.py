"""``Checkpointer``: the pipeline's guarantees for any ``torchrun`` training script, with no config and no app.

    ckpt = Checkpointer("runs/my-run", every_steps=100, keep_last=3)
    start = ckpt.load_latest(into=state)            # the resume step, decided once by rank 0, same on every rank
    for step in range(start + 1, steps + 1):
        ...                                          # the user's own forward/backward/optimizer step
        if ckpt.should_save(step) or ckpt.reached_preemption(step):
            ckpt.save(step, state)                   # or save_async(step, state)
        if ckpt.reached_preemption(step):
            break
    ckpt.close()

``state`` maps names to ``nn.Module`` / ``Optimizer`` (under ``model`` / ``optim``: saved with torch's
``get_state_dict``, so DDP and FSDP2 checkpoints reshard on load and consolidate like the app's), DCP
``Stateful`` objects (an LR scheduler, a ``torchdata`` ``StatefulDataLoader``, :class:`RankRNG`), or plain state
dicts; or a DeepSpeed engine under any key (saved in DeepSpeed's layout, the rest as DCP beside it; loaded at any
world size without DeepSpeed's ``load_checkpoint``). Every save goes through the session the app's train stage
drives (:class:`~pipeline.checkpoint.save.session.CheckpointSession`: rank-private files hashed while written, then a
done-marker, every rank agreeing on the outcome); exactly one committer verifies and publishes each step and only
then moves ``latest``: by default a background thread of rank 0 that never blocks training (``committer="thread"``),
or ``python -m pipeline.commit <dir> --follow`` beside the job (``committer="external"``: :meth:`Checkpointer.close`
then waits, bounded, for it to commit the job's steps, and names in a WARNING those nobody committed). The
layout is the app's (``<dir>/checkpoints/...``), so ``python -m pipeline.status <dir>``, ``python -m
pipeline.consolidate <dir>`` and the app's import read it.

Collectives: the constructor, :meth:`save`, :meth:`save_async`, :meth:`wait`, :meth:`load_latest`,
:meth:`should_save` (with ``every_minutes``), :meth:`reached_preemption` and :meth:`close` are called by every rank
at the same point, on a gloo group of the checkpointer's own (timeout ``deadline_s``).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from pipeline.checkpoint import options, resume
from pipeline.checkpoint.fast.codec import fill, unpack
from pipeline.checkpoint.fast.resuming import FastResume
from pipeline.checkpoint.fast.tier import FAST_DIR_ENV, FastConfig, FastTier
from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.protocol.committer import CommitPolicy
from pipeline.checkpoint.save import deepspeed_engine, rank_save
from pipeline.checkpoint.save.async_save import stuck_writers
from pipeline.checkpoint.save.background import BackgroundCommitter
from pipeline.checkpoint.save.external_wait import await_external_commit
from pipeline.checkpoint.save.rank_save import RankTarget, SaveResult, Written
from pipeline.checkpoint.save.session import CheckpointSession
from pipeline.checkpoint.save.state import apply_state, load_state, piece_groups, save_state
from pipeline.checkpoint.stores.stores import record_store, recorded_store, remote_at, store_for
from pipeline.errors import PipelineError
from pipeline.storage.layout import CheckpointLayout

log = logging.getLogger(__name__)

COMMITTERS = ("thread", "external")
EXTERNAL_COMMIT_WAIT_S = 60.0
"""``external_commit_wait_s``'s default: how long :meth:`Checkpointer.close` waits with no committer running."""


class Checkpointer:
    """Save, commit and resume one training run's checkpoints under ``directory``."""

    def __init__(
        self,
        directory: str | Path,
        *,
        every_steps: int | None = None,
        every_minutes: float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str = "loss",
        best_mode: str = "min",
        committer: str = "thread",
        deadline_s: float = 600.0,
        writer_threads: int | None = None,
        fail_on_save_error: bool = False,
        preemption_signals: tuple[int, ...] = (signal.SIGUSR2,),
        poll_interval_s: float = 0.5,
        storage: str | None = None,
        dedup: bool = True,
        external_commit_wait_s: float = EXTERNAL_COMMIT_WAIT_S,
        fast_every: int | None = None,
        fast_dir: str | None = None,
        fast_replicas: int = 1,
        fast_keep: int = 2,
    ) -> None:
        """Every rank constructs it alike (a collective).

        ``every_steps`` / ``every_minutes``: when :meth:`should_save` says yes (either may be None).
        ``keep_last`` / ``keep_every``: retention, done by the committer (``latest``'s step always stays).
        ``keep_best``: also keep the ``keep_best`` steps with the best ``best_metric`` (passed to :meth:`save` in
        ``metrics``; ``best_mode`` ``min``: lowest is best, ``max``: highest); a step without it is kept.
        ``committer``: ``thread`` (rank 0 commits in the background) or ``external`` (``python -m
        pipeline.commit <dir> --follow`` runs beside the job). ``deadline_s`` bounds every wait: markers,
        async writers, the committer's last pass, the checkpoint group's collectives.
        ``writer_threads``: files per rank written in parallel (None: the CPUs a rank has to itself, at most 4).
        ``preemption_signals``: signals that set the preemption flag (SLURM's ``--signal=USR2@...``); installed
        only from the main thread.
        ``storage``: ``s3://bucket/prefix`` keeps the checkpoints in an S3-compatible bucket (AWS environment
        variables and config files say where and as whom); ``directory`` then holds the committer lock and the
        verified local copy of the step :meth:`load_latest` loads.
        ``dedup``: the model's parameters that do not train (``requires_grad=False``) and its buffers are saved as
        pieces of their own, and a piece whose bytes equal the latest committed step's is not written again (a
        hard link; in a bucket, one object) — every step still complete (:mod:`pipeline.checkpoint.save.pieces`).
        ``external_commit_wait_s``: with ``committer="external"``, how long :meth:`close` (rank 0) waits, while no
        committer holds the dir, for one to commit the steps this job saved (a running one is waited for up to
        ``deadline_s``); steps still uncommitted then are named in a WARNING and stay staged. 0: do not wait.
        ``fast_every``: also keep a fast copy every this many steps (:meth:`save_fast`): each rank's shard in
        ``fast_dir`` (node-local; default ``/dev/shm/pipeline-fast``, or ``$PIPELINE_FAST_DIR``) and on
        ``fast_replicas`` peer nodes, the newest ``fast_keep`` steps; :meth:`load_latest` restores from the
        newest one that verifies on every rank when it is at least as new as the durable tier's
        (:mod:`pipeline.checkpoint.fast`).
        """
        if committer not in COMMITTERS:
            raise PipelineError(f"committer={committer!r}: choose one of {', '.join(COMMITTERS)}")
        options.check_every_steps(every_steps)
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            options.check_keep(value, name)
        options.check_best(keep_best, best_metric, best_mode)
        if every_minutes is not None and not every_minutes > 0:
            raise PipelineError(f"every_minutes={every_minutes!r}: must be positive or None")
        options.check_deadline(deadline_s)
        options.check_seconds(poll_interval_s)
        if not external_commit_wait_s >= 0:
            raise PipelineError(f"external_commit_wait_s={external_commit_wait_s!r}: must be 0 or more seconds")
        options.check_writer_threads(writer_threads)
        if not dist.is_available() or not dist.is_initialized():
            raise PipelineError(
                "Checkpointer needs torch.distributed initialised first (dist.init_process_group; torchrun sets "
                "the environment): every rank constructs it"
            )
        self.layout = CheckpointLayout(Path(directory).resolve())
        self._storage = storage
        self.remote = None if storage is None else remote_at(storage, self.layout.run_dir)
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.deadline_s = deadline_s
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Checkpoint collectives never share the training group (NCCL or gloo): a gloo group of its own.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=deadline_s))
        self._preempted = threading.Event()
        self._install_signals(preemption_signals)
        self._committer: BackgroundCommitter | None = None
        self._external = committer == "external"
        self._external_wait_s = external_commit_wait_s
        keep = {"keep_last": keep_last, "keep_every": keep_every, "keep_best": keep_best, "best_metric": best_metric,
                "best_mode": best_mode}  # fmt: skip
        opened = self._open(keep, poll_interval_s) if self.rank == 0 else None
        decided = self._broadcast(opened)
        if not isinstance(decided, tuple):
            self._stop_committer()
            raise PipelineError(str(decided))
        self.attempt = decided[0]
        threads = writer_threads if writer_threads is not None else rank_save.auto_writer_threads(self.world_size)
        self.target = RankTarget(
            self.layout, self.rank, self.world_size, self.attempt, threads, fail_on_save_error, self.remote, dedup
        )
        self.session = CheckpointSession(self.target, self.group, async_deadline_s=deadline_s)
        """The save path (save, async, wait, agreement, resume decision), shared with the app's train stage."""
        self.fast: FastTier | None = None
        if fast_every is not None:
            cfg = FastConfig(fast_every, fast_dir or os.environ.get(FAST_DIR_ENV, FastConfig.dir), fast_replicas,
                             fast_keep)  # fmt: skip
            try:
                self.fast = FastTier(cfg, self.layout.run_dir, self.attempt, self.group, deadline_s)
            except PipelineError:
                self._stop_committer()  # as for any other failed open: nothing of this Checkpointer runs on
                raise
        self.resumed: dict[str, Any] | None = None
        """How :meth:`load_latest` resumed (rank 0): the tier, the step, where each rank's bytes came from."""
        self._last_save = time.monotonic()
        self._closed = False

    # -- set-up (rank 0) ---------------------------------------------------------------------------------------

    def _open(self, keep: dict[str, Any], poll_s: float) -> tuple[str] | str:
        """Rank 0: create the layout, decide this launch's attempt, start the committer; or why it cannot."""
        try:
            for d in self.layout.checkpoint_dirs():
                d.mkdir(parents=True, exist_ok=True)
            recorded = recorded_store(self.layout)
            if recorded is not None and recorded != self._storage:
                return f"{self.layout.run_dir} keeps its checkpoints in {recorded}: pass storage={recorded!r}"
            if self._storage is not None and recorded is None:
                record_store(self.layout, self._storage)  # the command lines find the bucket by the dir alone
            if not self._external:
                policy = CommitPolicy(
                    world_size=self.world_size,
                    marker_deadline_s=self.deadline_s,
                    poll_interval_s=poll_s,
                    **keep,
                )
                self._committer = BackgroundCommitter(self.layout, policy, self.remote)
                self._committer.start()
        except (PipelineError, OSError) as e:
            return f"cannot open checkpoints in {self.layout.checkpoints}: {e}"
        return (time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3),)

    def _broadcast(self, value: Any) -> Any:
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _install_signals(self, signums: tuple[int, ...]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: FrameType | None) -> None:
            log.warning("received %s: saving at the next reached_preemption()", signal.Signals(signum).name)
            self._preempted.set()

        for signum in signums:
            signal.signal(signum, handler)

    # -- when to save ------------------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Every ``every_steps`` steps, and/or when ``every_minutes`` passed since the last save (rank 0's clock
        decides, so every rank answers alike)."""
        due = self.every_steps is not None and step % self.every_steps == 0
        if self.every_minutes is not None:
            late = time.monotonic() - self._last_save >= self.every_minutes * 60
            due = self.session.any_rank(late) or due
        return due

    def request_preemption(self) -> None:
        """Set the preemption flag from code (what the signal handler does)."""
        self._preempted.set()

    def reached_preemption(self, step: int) -> bool:
        """True on every rank, at the same step, once any rank received a preemption signal: save ``step`` and
        stop (a requeued job resumes from it)."""
        return self.session.any_rank(self._preempted.is_set())

    def should_save_fast(self, step: int) -> bool:
        """Every ``fast_every`` steps (False without a fast tier, or once it turned itself off)."""
        return self.fast is not None and self.fast.due(step)

    # -- save --------------------------------------------------------------------------------------------------

    def save_fast(self, step: int, state: dict[str, Any]) -> float:
        """Keep ``step`` in the fast tier (node-local, replicated to peers) in the background; returns the seconds
        training waited (the copy of its tensors to CPU). Every rank calls it at the same step."""
        self._check_open()
        if self.fast is None:
            raise PipelineError("save_fast: this Checkpointer has no fast tier (pass fast_every=K)")
        if deepspeed_engine.find_engine(state) is not None:
            raise PipelineError("save_fast: a DeepSpeed engine saves in its own layout: use save() for it")
        return self.fast.save(step, save_state(state, step, self.rank), self.session.any_rank)

    def save(self, step: int, state: dict[str, Any], metrics: Mapping[str, Any] | None = None) -> SaveResult:
        """Save ``state`` as ``step`` (blocking); returns how this rank's save went, with every rank agreeing on
        ``ok``. A step a rank could not save is never committed; training may go on (or, with
        ``fail_on_save_error``, this raises). A DeepSpeed engine in ``state`` (under any key) is saved in
        DeepSpeed's layout, the rest of ``state`` as DCP beside it. ``metrics`` (name -> number, e.g.
        ``{"loss": loss.item()}``): recorded in the step's manifest (rank 0's values) for ``keep_best`` and
        ``status``; a value that is not finite is recorded as null."""
        self._check_open()
        started, recorded = time.monotonic(), options.check_metrics(metrics)
        engine_key = deepspeed_engine.find_engine(state)
        if engine_key is None:
            sd = save_state(state, step, self.rank)
            result = self.session.save(step, sd, piece_groups(state), started, recorded)
        else:
            engine = state[engine_key]
            rest = save_state({k: v for k, v in state.items() if k != engine_key}, step, self.rank)

            def write(staged: Path) -> Written:
                return deepspeed_engine.write_step(self.target, staged, engine, rest, self.group)

            result = self.session.save_files(step, deepspeed_engine.format_of(engine), write, started, recorded)
        self._last_save = time.monotonic()
        return result

    def save_async(self, step: int, state: dict[str, Any], metrics: Mapping[str, Any] | None = None) -> float:
        """Copy ``state`` into a reused staging buffer and persist it in the background (same files, marker and
        ``metrics`` as :meth:`save`); returns the seconds training was blocked. The previous async save is settled
        first. A state with a DeepSpeed engine is saved synchronously (its files are DeepSpeed's to write)."""
        self._check_open()
        t0, recorded = time.monotonic(), options.check_metrics(metrics)
        if deepspeed_engine.find_engine(state) is not None:
            self.save(step, state, recorded)
            return time.monotonic() - t0
        sd = save_state(state, step, self.rank)
        self._last_save = time.monotonic()
        return self.session.save_async(step, sd, piece_groups(state), t0, recorded)

    def wait(self) -> SaveResult | None:
        """Settle the pending async save (at most ``deadline_s``, polling the writer's liveness); None if none."""
        return self.session.wait()

    # -- resume ------------------------------------------------------------------------------------------------

    def load_latest(self, into: dict[str, Any]) -> int:
        """Load the newest committed step into ``into`` (same keys as saved) and return it; 0 when there is
        none. Rank 0 first lets every completely staged step be committed (a step saved before a kill is never
        lost nor trained again), verifies the step against its manifest, and hands its choice to every rank."""
        self._check_open()
        engine_key = deepspeed_engine.find_engine(into)
        rest = {k: v for k, v in into.items() if k != engine_key}

        def load(step_dir: Path, manifest: Manifest) -> int:
            if engine_key is not None:
                deepspeed_engine.load_engine(into[engine_key], step_dir, manifest)
            same_world = manifest.world_size == self.world_size
            return load_state(rest, step_dir, self.group, self.rank, same_world=same_world)

        fast, store = None, store_for(self.layout, self.remote)
        if self.fast is not None and engine_key is None:
            fast = FastResume(self.fast, store, self.layout.checkpoints, lambda blob: self._load_fast(rest, blob))
        first, floor = (fast.first, fast.floor) if fast is not None else (None, None)
        step = self.session.load_latest(self._resume_step, load, first=first, floor=floor)
        if fast is not None and self.rank == 0:
            self.resumed = fast.record(step)
        if self.rank == 0 and (self.resumed or {}).get("tier") != "fast":  # the fast tier logs its own line
            resume.log_resumed(store, step)
        self._last_save = time.monotonic()
        return step

    def _load_fast(self, into: dict[str, Any], blob: memoryview) -> int:
        target = fill(save_state(into, 0, self.rank), unpack(blob, f"rank {self.rank}'s fast copy"))
        return apply_state(into, target)

    def _resume_step(self) -> int | str:
        if self._committer is not None and not self._committer.recovered.wait(self.deadline_s):
            errors = "; ".join(self._committer.errors[-3:]) or "no error reported"
            return f"cannot resume: the committer's first pass over {self.layout.checkpoints} did not finish ({errors})"
        alive = self._committer.alive if self._committer is not None else None
        return resume.decide_with(self.layout, self.world_size, self.deadline_s, alive, self.remote)

    # -- end ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Settle a pending async save, then let the committer commit what is complete and stop; every wait is
        bounded by ``deadline_s``. With ``committer="external"`` rank 0 waits for an external committer to commit
        the steps this job saved (``external_commit_wait_s`` while none runs) and names those it did not. Never
        destroys a group a stuck writer may still use."""
        if self._closed:
            return
        try:
            self.wait()
            if self.fast is not None:
                self.fast.wait()
            dist.barrier(group=self.group)  # every rank's last marker is written before the last pass
            if self.rank == 0 and self._external:
                await_external_commit(
                    self.layout,
                    self.remote,
                    self.world_size,
                    self.session.saved,
                    self.deadline_s,
                    self._external_wait_s,
                )
        finally:
            self._closed = True
            self._stop_committer()
            if not stuck_writers():
                dist.destroy_process_group(self.group)

    def _stop_committer(self) -> None:
        if self._committer is not None:
            self._committer.stop(self.deadline_s)

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineError(f"the Checkpointer of {self.layout.run_dir} is closed")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # a failing training: no collective (other ranks may be gone); the committer still finishes
            self._closed = True
            self.session.abandon(f"training failed: {getattr(exc[0], '__name__', exc[0])}")
            self._stop_committer()
