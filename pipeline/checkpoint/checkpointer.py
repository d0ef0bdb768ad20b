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

Collectives: the constructor, :meth:`save`, :meth:`save_async`, :meth:`wait`, :meth:`load_latest`, :meth:`load`,
:meth:`should_save` (with ``every_minutes``), :meth:`reached_preemption` and :meth:`close` are called by every rank
at the same point, on a gloo group of the checkpointer's own (timeout ``deadline_s``). :meth:`steps`,
:meth:`latest_step` and :meth:`best_step` only read the store (any rank, any time). A value a resume could not
load is refused at :meth:`save` on every rank (:class:`~pipeline.errors.StateError`, one line).
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

from pipeline.checkpoint import one_line, options
from pipeline.checkpoint.fast.tier import FAST_DIR_ENV, FastConfig, FastTier
from pipeline.checkpoint.loading import Loading
from pipeline.checkpoint.protocol.committer import CommitPolicy
from pipeline.checkpoint.save import agree, deepspeed_engine, rank_save
from pipeline.checkpoint.save.async_save import stuck_writers
from pipeline.checkpoint.save.background import BackgroundCommitter
from pipeline.checkpoint.save.external_wait import await_external_commit
from pipeline.checkpoint.save.rank_save import RankTarget, SaveResult, Written
from pipeline.checkpoint.save.session import CheckpointSession, Write
from pipeline.checkpoint.save.state import piece_groups, save_state
from pipeline.checkpoint.stores.stores import record_store, recorded_store, remote_at
from pipeline.errors import ConfigError, PipelineError
from pipeline.storage.layout import CheckpointLayout

log = logging.getLogger(__name__)

COMMITTERS = ("thread", "external")


def _check_options(given: dict[str, Any]) -> None:
    """Each option's value (its name is checked by :func:`options.check_call`): one line naming a bad one."""
    if given["committer"] not in COMMITTERS:
        raise ConfigError(f"committer={given['committer']!r}: choose one of {', '.join(COMMITTERS)}")
    options.check_every_steps(given["every_steps"])
    for name in ("keep_last", "keep_every"):
        options.check_keep(given[name], name)
    options.check_best(given["keep_best"], given["best_metric"], given["best_mode"])
    minutes = given["every_minutes"]
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, int | float) or not minutes > 0):
        raise ConfigError(f"every_minutes={minutes!r}: must be positive or None")
    options.check_deadline(given["deadline_s"])
    options.check_seconds(given["poll_interval_s"])
    wait = given["external_commit_wait_s"]
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not wait >= 0:
        raise ConfigError(f"external_commit_wait_s={wait!r}: must be 0 or more seconds")
    options.check_writer_threads(given["writer_threads"])


class Checkpointer(Loading):
    """Save, commit and resume one training run's checkpoints under ``directory``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Checkpointer:
        options.check_call("Checkpointer", cls.__init__, args, kwargs)  # a typo: one line, the nearest name
        return super().__new__(cls)

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
        external_commit_wait_s: float = 60.0,
        fast_every: int | None = None,
        fast_dir: str | None = None,
        fast_replicas: int = 1,
        fast_keep: int = 2,
    ) -> None:
        """Every rank constructs it alike (a collective). Without a process group (one process, no ``torchrun``)
        it starts a one-rank gloo group of its own, in memory, and ends it in :meth:`close`.

        :param directory: where the checkpoints go (``<directory>/checkpoints/...``, the app's layout).
        :param every_steps: :meth:`should_save` says yes every this many steps (None: never by steps).
        :param every_minutes: ... or once this many minutes passed since the last save (rank 0's clock decides).
        :param keep_last: retention, done by the committer: keep the newest N committed steps (``latest``'s step
            always stays). None: keep every step.
        :param keep_every: retention: also keep every step divisible by N.
        :param keep_best: retention: also keep the N steps whose ``best_metric`` is best; the metric is passed to
            :meth:`save` in ``metrics`` by every rank and reduced across ranks (the mean); a step without it is kept.
        :param best_metric: the metric ``keep_best`` and :meth:`best_step` rank by (default ``loss``).
        :param best_mode: ``min`` (lowest is best, a loss) or ``max`` (highest, an accuracy).
        :param committer: ``thread`` (rank 0 commits in the background) or ``external`` (``python -m
            pipeline.commit <dir> --follow`` runs beside the job).
        :param deadline_s: bounds every wait (markers, async writers, the committer's last pass, the checkpoint
            group's collectives); default 600.
        :param writer_threads: files per rank written in parallel (None: the CPUs a rank has to itself, at most 4).
        :param fail_on_save_error: a failed save raises instead of returning ``ok=False`` (never committed either way).
        :param preemption_signals: signals that set the flag :meth:`reached_preemption` reports (SLURM's
            ``--signal=USR2@...``); installed only from the main thread.
        :param poll_interval_s: how often the committer thread looks for complete steps (default 0.5 s).
        :param storage: ``s3://bucket/prefix`` keeps the checkpoints in an S3-compatible bucket (AWS environment
            variables and config files say where and as whom); ``directory`` then holds the committer lock and the
            verified local copy of the step a load reads.
        :param dedup: the model's frozen parameters and buffers are saved as pieces of their own, not written again
            while their bytes equal the latest committed step's (every step still complete).
        :param external_commit_wait_s: with ``committer="external"``, how long :meth:`close` (rank 0) waits, while
            no committer holds the dir, for one to commit the job's steps (default 60 s; 0: do not wait); those
            still uncommitted then are named in a WARNING and stay staged.
        :param fast_every: also keep a fast copy every this many steps (:meth:`save_fast`), node-local and on peers.
        :param fast_dir: the fast copies' node-local dir (default ``$PIPELINE_FAST_DIR`` or
            ``/dev/shm/pipeline-fast``).
        :param fast_replicas: peer nodes holding a copy of each rank's fast shard (default 1).
        :param fast_keep: fast steps kept (default 2).
        """
        _check_options(locals())
        self._own_group = agree.ensure_process_group()
        one_line.install()  # after torch's own hook (init_process_group), so in front of it
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
            self._end_own_group()
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
                self._end_own_group()
                raise
        self.resumed: dict[str, Any] | None = None
        """How :meth:`load_latest` resumed (rank 0): the tier, the step, where each rank's bytes came from."""
        self._last_save = time.monotonic()
        self._closed = False
        self._keep = keep

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
        sd = save_state(state, step, self.rank)
        agree.admit(step, sd, self.rank, self.session.any_rank)
        return self.fast.save(step, sd, self.session.any_rank)

    def save(self, step: int, state: dict[str, Any], metrics: Mapping[str, Any] | None = None) -> SaveResult:
        """Save ``state`` as ``step`` (blocking); returns how this rank's save went, with every rank agreeing on
        ``ok``. A step a rank could not save is never committed; training may go on (or, with
        ``fail_on_save_error``, this raises). A DeepSpeed engine in ``state`` (under any key) is saved in
        DeepSpeed's layout, the rest of ``state`` as DCP beside it. ``metrics`` (name -> number, e.g.
        ``{"loss": loss.item()}``): recorded in the step's manifest (rank 0's values) for ``keep_best`` and
        ``status``; a value that is not finite is recorded as null."""
        self._check_open()
        started = time.monotonic()
        engine_key = deepspeed_engine.find_engine(state)
        if engine_key is None:
            sd = save_state(state, step, self.rank)
            agree.admit(step, sd, self.rank, self.session.any_rank)
            result = self.session.save(step, sd, piece_groups(state), started, self._metrics(step, metrics))
        else:
            engine = state[engine_key]
            rest = save_state({k: v for k, v in state.items() if k != engine_key}, step, self.rank)
            agree.admit(step, rest, self.rank, self.session.any_rank)
            recorded = self._metrics(step, metrics)

            def write(staged: Path) -> Written:
                return deepspeed_engine.write_step(self.target, staged, engine, rest, self.group)

            result = self.session.save_files(step, deepspeed_engine.format_of(engine), write, started, recorded)
        self._last_save = time.monotonic()
        return result

    def save_files(self, step: int, fmt: str, write: Write, metrics: Mapping[str, Any] | None = None) -> SaveResult:
        """:meth:`save` for a trainer that writes its own files (a Hugging Face ``Trainer``'s): ``write(staged)``
        writes this rank's files of ``step`` (format ``fmt``) into the staged dir and returns their entries."""
        self._check_open()
        result = self.session.save_files(step, fmt, write, time.monotonic(), self._metrics(step, metrics))
        self._last_save = time.monotonic()
        return result

    def save_async(self, step: int, state: dict[str, Any], metrics: Mapping[str, Any] | None = None) -> float:
        """Copy ``state`` into a reused staging buffer and persist it in the background (same files, marker and
        ``metrics`` as :meth:`save`); returns the seconds training was blocked. The previous async save is settled
        first. A state with a DeepSpeed engine is saved synchronously (its files are DeepSpeed's to write)."""
        self._check_open()
        t0 = time.monotonic()
        if deepspeed_engine.find_engine(state) is not None:
            self.save(step, state, metrics)
            return time.monotonic() - t0
        sd = save_state(state, step, self.rank)
        agree.admit(step, sd, self.rank, self.session.any_rank)
        recorded = self._metrics(step, metrics)
        self._last_save = time.monotonic()
        return self.session.save_async(step, sd, piece_groups(state), t0, recorded)

    def _metrics(self, step: int, metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
        """The metrics recorded with ``step``: with ``keep_best``, each the mean over the ranks (a collective)."""
        recorded = options.check_metrics(metrics)
        if self._keep["keep_best"] is None:
            return recorded
        return agree.reduce_metrics(recorded, self._keep["best_metric"], self.group, self.rank, step)

    def wait(self) -> SaveResult | None:
        """Settle the pending async save (at most ``deadline_s``, polling the writer's liveness); None if none."""
        return self.session.wait()

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
                self.fast.close()
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
                self._end_own_group()

    def _stop_committer(self) -> None:
        if self._committer is not None:
            self._committer.stop(self.deadline_s)

    def _end_own_group(self) -> None:
        agree.end_process_group(self._own_group)
        self._own_group = False

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
            if not stuck_writers():
                self._end_own_group()
