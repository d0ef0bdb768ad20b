"""Deterministic simulation of the commit protocol, driving the real committer code (:mod:`tests.sim`).

    python -m tests.simulate --schedules 10000            # both stores: N random schedules, seeds 0..N-1, and
                                                          # every schedule of the first --depth choices of a
                                                          # small configuration
    python -m tests.simulate --replay 1234 --store posix  # one schedule again, its faults minimized

Each schedule runs a writer of one or two ranks (which may restart, with a new appointed committer, and save again
under a new attempt every step above what it resumes from), a ghost (a committer that acquired first), a live
committer (appointed: it takes over) and maybe a newcomer (not appointed), stepped by one seeded scheduler at every
store operation, I/O op, lease read or write and read of a record or a data file; faults at any of them: a pause
of any length, a process killed, ``EIO`` on a write, a torn or stale lease read, clock skew between processes,
bursts of failed reads (``EIO``/``ESTALE``, a bucket's 5xx and timeouts; some outlast the reads' retries), torn
and short reads of records, damage to a data file, a manifest, a marker, ``latest``, a lease record or a trash
record (:mod:`tests.sim.read_faults`, :mod:`tests.sim.damage`). The invariants (:mod:`tests.sim.world`) are
checked after every operation that changes something. A failing schedule is printed as the seed that replays it
and a minimized list of the faults that make it fail. The last lines count the faults injected, by class. Exit
status 1 when any schedule failed.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import tests.conftest  # noqa: F401  (registers the test format the staged steps use)
from tests.sim.world import Settings, World, run_one, scratch_root

STORES = ("posix", "bucket")


@dataclass
class Tally:
    schedules: int = 0
    steps: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    resaved: int = 0  # schedules whose restarted writer saved a step again under a new attempt
    failed: list[tuple[int, str, str]] = field(default_factory=list)  # (seed, store, first violation)


def _quiet() -> None:
    logging.getLogger("pipeline").setLevel(logging.CRITICAL + 1)


def _chunk(args: tuple[str, list[int]]) -> Tally:
    store, seeds = args
    _quiet()
    t = Tally()
    root = scratch_root()
    try:
        for seed in seeds:
            w = run_one(seed, store, root=root)
            t.schedules += 1
            t.steps += w.kernel.steps
            for f in w.faults:
                t.faults[f.split(" ", 1)[0]] += 1
            t.resaved += bool(w.resaved)
            if w.violations:
                t.failed.append((seed, store, w.violations[0]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return t


def _chunks(store: str, seeds: range, workers: int) -> list[tuple[str, list[int]]]:
    return [(store, list(seeds[i :: workers * 8])) for i in range(workers * 8)]


def _merge(parts: Iterable[Tally]) -> Tally:
    total = Tally()
    for t in parts:
        total.schedules += t.schedules
        total.steps += t.steps
        total.faults.update(t.faults)
        total.resaved += t.resaved
        total.failed += t.failed
    total.failed.sort()
    return total


def explore(store: str, seeds: range, workers: int) -> Tally:
    chunks = _chunks(store, seeds, workers)
    if workers <= 1:
        return _merge(map(_chunk, chunks))
    with mp.get_context("fork").Pool(workers) as pool:
        return _merge(pool.imap_unordered(_chunk, chunks))


def exhaustive(store: str, depth: int, settings: Settings) -> tuple[int, list[tuple[list[int], str]]]:
    """Every schedule whose first ``depth`` choices differ (later choices: the first option); returns how many
    ran and the failing ones (their choices)."""
    _quiet()
    root = scratch_root()
    failed: list[tuple[list[int], str]] = []
    runs = 0
    prefix: list[int] = []
    try:
        while True:
            w = run_one(0, store, settings=settings, script=prefix, root=root)
            runs += 1
            taken = w.chooser.taken
            if w.violations:
                failed.append(([c for c, _ in taken], w.violations[0]))
            # the next prefix in lexicographic order over the first `depth` choices
            choices = [(c, n) for c, n in taken[:depth]]
            while choices and choices[-1][0] + 1 >= choices[-1][1]:
                choices.pop()
            if not choices:
                return runs, failed
            last, n = choices.pop()
            prefix = [c for c, _ in choices] + [last + 1]
    finally:
        shutil.rmtree(root, ignore_errors=True)


CLASSES = {
    "read faults (bursts of failed reads)": ("read-",),
    "torn or short reads of records": ("torn-record", "short-record"),
    "record damage": ("damage-manifest", "damage-marker", "damage-latest", "damage-lease", "damage-trash"),
    "data damage": ("damage-data",),
    "pauses, kills, write EIO, torn/stale lease reads": ("pause", "kill", "eio", "torn", "stale"),
}
"""The classes of faults the last lines count (by the first word of each fault, as :class:`World` names them)."""


def classes(faults: Counter[str]) -> list[str]:
    """One line per class of fault: how many were injected, and of which kinds."""
    lines = []
    for name, starts in CLASSES.items():
        kinds = {
            k: v for k, v in faults.items() if k in starts or k.startswith(tuple(s for s in starts if s[-1] == "-"))
        }
        detail = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        lines.append(f"  {name}: {sum(kinds.values())}" + (f" ({detail})" if detail else ""))
    outlasting = sum(v for k, v in faults.items() if k.endswith("-outlasting"))
    lines.append(f"  of the read faults, {outlasting} outlasted the reads' retries (READ_RETRY_S)")
    return lines


def kind_of(violation: str) -> str:
    """A violation without its numbers and paths: two schedules that break the same invariant alike match."""
    words = [w for w in violation.split(":", 1)[-1].split() if not any(c.isdigit() for c in w) and "/" not in w]
    return " ".join(words[:8])


def minimize(seed: int, store: str) -> World:
    """The schedule of ``seed`` with as few of its faults as still break the same invariant (each fault choice
    turned off in turn, kept off when the schedule still fails so)."""
    first = run_one(seed, store)
    if not first.violations:
        return first
    want = kind_of(first.violations[0])
    script = [c for c, _ in first.chooser.taken]
    best = first
    i = 0
    while i < len(script):
        if script[i] and best.chooser.taken[i][1] == 2:  # a fault drawn here: try without it
            trial = script[:i] + [0] + script[i + 1 :]
            w = run_one(seed, store, settings=first.s, script=trial)
            if w.violations and kind_of(w.violations[0]) == want:
                script = [c for c, _ in w.chooser.taken]
                best = w
                continue
        i += 1
    return best


def report(w: World, seed: int, store: str) -> str:
    lines = [f"seed {seed} ({store}): {w.violations[0] if w.violations else 'no violation'}"]
    lines.append(f"  replay: python -m tests.simulate --replay {seed} --store {store}")
    lines.append("  faults: " + ("; ".join(w.faults) or "none"))
    lines += [f"  {a}" for a in w.kernel.trace[-12:]]
    return "\n".join(lines)


def small(store: str) -> Settings:
    """The configuration explored exhaustively: two committers (a ghost, a live one), two steps, one pause."""
    return Settings(store=store, steps=(2, 4), keep_last=1, live_at=3.0, write_every=1.0, fault_rate=0.5,
                    max_faults=1, kinds=("pause",))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", type=int, default=2000, help="random schedules per run, split over the stores")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--store", choices=(*STORES, "both"), default="both")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--depth", type=int, default=5, help="choices explored exhaustively in the small configuration")
    p.add_argument("--replay", type=int, metavar="SEED", help="run one seed's schedule and print it")
    p.add_argument("--show", type=int, default=5, help="failing schedules to minimize and print")
    args = p.parse_args(argv)
    _quiet()
    stores = STORES if args.store == "both" else (args.store,)
    if args.replay is not None:
        for store in stores:
            w = minimize(args.replay, store)
            print(report(w, args.replay, store))
        return 0
    bad = 0
    every: Counter[str] = Counter()
    n = args.schedules // len(stores)
    start = time.monotonic()
    # One pool for all of it (each store's exhaustive part and its random chunks), so both cores stay busy to the
    # end: the exhaustive part used to run first, alone, on one core, and each store's pool drained on its own.
    pool = mp.get_context("fork").Pool(args.workers) if args.workers > 1 else None
    exh: dict[str, Any] = {}
    rand: dict[str, Any] = {}
    for store in stores:
        if pool is not None:
            if args.depth > 0:
                exh[store] = pool.apply_async(exhaustive, (store, args.depth, small(store)))
            seeds = range(args.first_seed, args.first_seed + n)
            rand[store] = pool.map_async(_chunk, _chunks(store, seeds, args.workers))
    for store in stores:
        if pool is not None:
            runs, failed = exh[store].get() if store in exh else (0, [])
            t = _merge(rand[store].get())
        else:
            runs, failed = exhaustive(store, args.depth, small(store)) if args.depth > 0 else (0, [])
            t = explore(store, range(args.first_seed, args.first_seed + n), 1)
        faults = ", ".join(f"{k} {v}" for k, v in sorted(t.faults.items()))
        print(
            f"{store}: {t.schedules} random schedules (seeds {args.first_seed}-{args.first_seed + n - 1}, "
            f"{t.steps} operations stepped, {t.resaved} with a step saved again under a new attempt), and {runs} "
            f"schedules covering every choice of the first {args.depth} of a small configuration (2 committers, 2 "
            f"steps, a pause); faults injected: {faults}; {len(t.failed) + len(failed)} violations (done "
            f"{time.monotonic() - start:.0f} s after the start)"
        )
        every.update(t.faults)
        for choices, what in failed[: args.show]:
            print(f"  exhaustive, choices {choices[: args.depth + 4]}...: {what}")
        kinds = Counter(kind_of(what) for _, _, what in t.failed)
        for what, count in kinds.most_common(10):
            print(f"  {count} x {what}")
        for seed, st, _ in t.failed[: args.show]:
            print(report(minimize(seed, st), seed, st))
        bad += len(t.failed) + len(failed)
    if pool is not None:
        pool.close()
        pool.join()
    print(f"faults injected, by class ({', '.join(stores)}):")
    print("\n".join(classes(every)))
    print(f"{bad} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
