from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.config.compose import load_config
from pipeline.config.schema import PipelineConfig
from pipeline.driver.task import execute_task
from pipeline.formats.registry import FORMATS, Format, _dcp_owner
from pipeline.rundir.layout import RunLayout
from tests.s3.server import S3Server, seaweedfs
from tests.seed_helpers import TEST_FORMAT

ROOT = Path(__file__).resolve().parents[1]

# A listed file that looks absent counts as missing after this settle (pipeline.storage.reads); the tests delete
# files on purpose hundreds of times, on one local disk or a mount they wait on, so they settle briefly (the
# processes they start inherit it). tests/test_unknown_not_damage.py checks the settle itself.
os.environ.setdefault("PIPELINE_ABSENT_SETTLE_S", "0.05")


def _test_files(step_dir: Path, _allow_pickle: bool = False) -> set[str]:
    """A TEST_FORMAT step's data files, named as DCP names them (``__K_0.distcp`` by rank K, ``.metadata``)."""
    names = {p.name for p in step_dir.iterdir()} if step_dir.is_dir() else set()
    return {n for n in names if n == ".metadata" or (n.startswith("__") and n.endswith(".distcp"))}


def _test_world(step_dir: Path, _allow_pickle: bool = False) -> int:
    """How many ranks wrote a TEST_FORMAT step: from its DCP-named files when it has them; a step of files named
    otherwise (the seed tests' ``rank_K/...`` paths) has no names to count, and its markers' world size is used."""
    ranks = [r for r in (_dcp_owner(n) for n in _test_files(step_dir)) if r is not None]
    if ranks:
        return max(ranks) + 1
    from pipeline.storage.integrity import read_record_json  # noqa: PLC0415

    for marker in sorted(step_dir.glob("rank_*.done.json")):
        return int(read_record_json(marker, "marker")["world_size"])
    return 0


# The commit-protocol tests stage fake steps in a format of their own (``seed_helpers.TEST_FORMAT``: plain bytes,
# no metadata naming other files); the committer knows that format only inside this test process.
FORMATS.setdefault(TEST_FORMAT, Format(TEST_FORMAT, _test_files, _dcp_owner, _test_world))


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pipeline`` as a user would, in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def probe_file(root: Path, run_id: str) -> Path:
    """Where a test asks train's rank 0 to write its probe logits (``PIPELINE_PROBE_FILE``): beside the runs."""
    return root / f"probe-{run_id}.json"


def probe_env(path: Path) -> dict[str, str]:
    """The environment that makes train write the trained model's probe logits to ``path``."""
    return {"PIPELINE_PROBE_FILE": str(path)}


def read_probe(path: Path) -> dict[str, Any]:
    """The probe train wrote under :func:`probe_env` (input ids, logits shape and values)."""
    return json.loads(path.read_text())


def train_losses(layout: RunLayout, attempt: str | None = None) -> dict[str, float]:
    """Step -> loss of one train attempt (default: the one its stage record names), from ``metrics.jsonl``."""
    if attempt is None:
        attempt = json.loads(layout.stage_record("train").read_text())["attempt"]
    events = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line.strip()]
    return {str(e["step"]): e["loss"] for e in events if e.get("event") == "step" and e.get("attempt") == attempt}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every path under ``root``: equal snapshots mean nothing was written."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> PipelineConfig:
    return load_config(["+experiment=tiny", f"run.root={tmp_path}", "run.id=r1", "checkpoint.marker_deadline_s=2"])


@pytest.fixture
def layout(tiny_cfg: PipelineConfig) -> RunLayout:
    return RunLayout.for_run(tiny_cfg.run.root, tiny_cfg.experiment, "r1")


RunFactory = Callable[..., tuple[PipelineConfig, RunLayout]]


@pytest.fixture
def make_run(tmp_path: Path) -> RunFactory:
    """Compose a config under ``tmp_path`` and run prepare-dirs once (the layout every other stage needs)."""

    def make(*overrides: str, run_id: str = "r1") -> tuple[PipelineConfig, RunLayout]:
        cfg = load_config(
            [
                "+experiment=tiny",
                f"run.root={tmp_path / 'outputs'}",
                "checkpoint.marker_deadline_s=1",
                f"run.id={run_id}",
                *overrides,
            ]
        )
        layout = RunLayout.for_run(cfg.run.root, cfg.experiment, run_id)
        execute_task("prepare_dirs", cfg, str(layout.run_dir), "prepare-dirs-test")
        return cfg, layout

    return make


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[Any]:
    """A world-size-1 gloo group in this test process (yields a fresh group); torn down after the test, never
    under an async writer that still runs (its daemon thread ends with the process)."""
    import torch.distributed as dist  # noqa: PLC0415

    from pipeline.checkpoint.save.async_save import stuck_writers  # noqa: PLC0415

    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg_store'}", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        until = time.monotonic() + 10  # a given-up writer ends soon after its injected sleep (bounded wait)
        while stuck_writers() and time.monotonic() < until:
            time.sleep(0.05)
        if not stuck_writers():  # never destroy a group under a writer that still runs (it is a daemon)
            dist.destroy_process_group()


@pytest.fixture
def no_lease_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The committer lease's settle pause off: each acquire waits ``ownership.SETTLE_S`` (0.2 s) for its rename to
    reach other nodes before it reads the record back, which decides between committers that start at the same
    moment. For tests in which one committer at a time takes the lease, hundreds of times (a hypothesis example
    or a crash point each), it is only a sleep; the racing-committer tests keep it."""
    from pipeline.checkpoint.protocol import ownership  # noqa: PLC0415

    monkeypatch.setattr(ownership, "SETTLE_S", 0.0)


@pytest.fixture
def no_reread_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pauses a reader takes for another mount's write to show through a shared mount, set to 0: before
    re-reading a record that did not parse (``settle.REREAD_DELAYS_S``, 0.26 s a record) and before a damaged or
    missing manifest of the step ``latest`` names stands (``posix_store.VISIBILITY_S``, 5 s). On a local disk
    nothing is torn or late, so the re-reads still happen (the same path) but never wait. For tests that hand the
    readers thousands of malformed records (the hostile-input families): there they were most of the time."""
    from pipeline.checkpoint.stores import posix_store  # noqa: PLC0415
    from pipeline.storage import settle  # noqa: PLC0415

    monkeypatch.setattr(settle, "REREAD_DELAYS_S", (0.0,) * len(settle.REREAD_DELAYS_S))
    monkeypatch.setattr(posix_store, "VISIBILITY_S", 0.0)


_RELIABILITY_ROWS: list[tuple[str, str, bool, list[str]]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == "reliability_row":
            _RELIABILITY_ROWS.append(value)
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append(Skip(report.nodeid, _skip_reason(report), "gpu" in report.keywords))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The reliability suite's scenario table (``tests/reliability/conftest.py``'s ``record``), one line each."""
    rows = _RELIABILITY_ROWS
    if not rows:
        return
    tr = terminalreporter
    tr.section(f"reliability scenarios (RELIABILITY_SCALE={os.environ.get('RELIABILITY_SCALE', 'ci')})")
    width = max(len(r[0]) for r in rows)
    for scenario, figure, ok, notes in rows:
        tr.write_line(f"{'ok  ' if ok else 'FAIL'} {scenario:<{width}}  {figure}")
        for note in notes[:5]:
            tr.write_line(f"       {note}")


# --- skips for want of an environment piece --------------------------------------------------------------------
# A test that needs a piece of the machine skips where the machine lacks it, with a reason that starts with the
# piece in the words of ENVIRONMENT_REASONS. After pytest's own summary every skip is listed, grouped by reason,
# and the session fails (exit status 1) when a test skipped for want of a piece that this machine should have:
# a Debian package where this machine can install packages (root, apt-get, an apt source that answers:
# ``scripts/system-packages.sh --can-install``), or a part of the project's own setup. Allowed: a piece this
# machine cannot have (not root, no /dev/fuse, a kernel that refuses FUSE, namespaces or a tmpfs mount, no way to
# install packages), except under CI (``$CI`` set and not false/0), where only gpu-marked and opt-in tests skip.

SYSTEM_PACKAGES = ROOT / "scripts" / "system-packages.sh"
MACHINE, PACKAGE, SETUP = "machine", "package", "setup"
"""What a test lacks: a piece this machine cannot have; a Debian package; a part of ``scripts/setup.sh``."""
ENVIRONMENT_REASONS: tuple[tuple[re.Pattern[str], str, str | None], ...] = (
    (re.compile(r"(needs root|not root)\b"), MACHINE, "root"),
    (re.compile(r"(no /dev/fuse|the kernel refuses|cannot mount a tmpfs here)\b"), MACHINE, None),
    (re.compile(r"missing Debian packages? "), PACKAGE, None),
    (re.compile(r"missing "), SETUP, None),
    # reasons of tests that name the piece otherwise
    (re.compile(r"submitit writes SLURM scripts only where srun is\b"), PACKAGE, "missing Debian package slurm-client"),
    (re.compile(r"no mount command here\b"), PACKAGE, "missing Debian package mount"),
)
"""How a skip's reason starts when the test skipped for want of a piece of the machine, which kind of piece, and
what to call it (None: the reason up to its first ``: ``)."""
OPT_IN_REASONS = re.compile(r"set PIPELINE_TEST_\w+=1|DeepSpeed's async_io op cannot be built")
"""Skips of opt-in tests (not asked for, or asked for where they cannot run): allowed, also under CI."""
LISTED_TESTS = 4


@dataclass(frozen=True)
class Skip:
    nodeid: str
    reason: str
    gpu: bool


_SKIPS: list[Skip] = []


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple | list) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _kind(skip: Skip) -> str:
    if skip.gpu:
        return "gpu"
    if OPT_IN_REASONS.search(skip.reason):
        return "opt-in"
    return next((kind for pattern, kind, _ in ENVIRONMENT_REASONS if pattern.match(skip.reason)), "other")


def _piece(reason: str) -> str:
    """What a skip for want of an environment piece lacked, in a few words."""
    label = next((label for pattern, _, label in ENVIRONMENT_REASONS if pattern.match(reason)), None)
    return label or reason.split(": ", 1)[0]


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@functools.cache
def _cannot_install() -> str | None:
    """Why this machine cannot install Debian packages (``scripts/system-packages.sh --can-install``), or None."""
    try:
        done = subprocess.run(["bash", str(SYSTEM_PACKAGES), "--can-install"], capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 3:
        return None
    return (done.stderr.strip().splitlines() or ["?"])[-1].split(": ", 1)[-1]


def _skips_verdict(write: Callable[..., None]) -> bool:
    """Writes every skip, grouped by reason, then one line on those for want of an environment piece; True when
    the session must fail for them."""
    order = ["other", "opt-in", "gpu", MACHINE, PACKAGE, SETUP]
    groups: dict[tuple[str, str], list[str]] = {}
    for skip in _SKIPS:
        groups.setdefault((_kind(skip), skip.reason.splitlines()[0] if skip.reason else ""), []).append(skip.nodeid)
    why_not = _cannot_install() if any(kind == PACKAGE for kind, _ in groups) else None
    should = {(k, r) for k, r in groups if k == SETUP or (k == PACKAGE and why_not is None)}
    ci = _under_ci()
    label = {
        "other": "not for want of the machine",
        "opt-in": "allowed: opt-in",
        "gpu": "allowed: gpu-marked",
        MACHINE: "this machine cannot have it",
        PACKAGE: f"this machine cannot install packages: {why_not}",
    }
    for kind, reason in sorted(groups, key=lambda g: (order.index(g[0]), g[1])):
        ids = sorted(groups[kind, reason])
        bad = (kind, reason) in should or (ci and kind in (MACHINE, PACKAGE))
        if (kind, reason) in should:
            text = "not allowed: this machine should have it"
        elif kind in (MACHINE, PACKAGE):
            text = f"{'not allowed under CI' if ci else 'allowed'}: {label[kind]}"
        else:
            text = label[kind]
        write(f"{len(ids)} skipped ({text}): {reason}", red=bad)
        for nodeid in ids[:LISTED_TESTS]:
            write(f"    {nodeid}")
        if len(ids) > LISTED_TESTS:
            write(f"    and {len(ids) - LISTED_TESTS} more")
    env = {g: ids for g, ids in groups.items() if g[0] in (MACHINE, PACKAGE, SETUP)}
    count = sum(len(ids) for ids in env.values())
    pieces = "; ".join(sorted({_piece(r) for _, r in env}))
    tests = f"{count} test{'s' if count != 1 else ''}"
    if should:
        n = sum(len(env[g]) for g in should)
        needs = sorted({_piece(r) for _, r in should})
        fix = "run as root with apt sources: bash scripts/system-packages.sh"
        if any(k == SETUP for k, _ in should):
            fix = "bash scripts/setup.sh" if all(k == SETUP for k, _ in should) else f"{fix}; bash scripts/setup.sh"
        write(f"FAILED: {n} test{'s' if n != 1 else ''} skipped for want of an environment piece that this machine "
              f"should have: {'; '.join(needs)} ({fix})", red=True, bold=True)  # fmt: skip
        return True
    if env and ci:
        write(f"FAILED: {tests} skipped for want of an environment piece, and CI is set (CI={os.environ['CI']}): "
              f"under CI only gpu-marked and opt-in tests may skip: {pieces}", red=True, bold=True)  # fmt: skip
        return True
    if env:
        write(f"{tests} skipped for want of an environment piece this machine cannot have ({pieces}): allowed "
              "here, a failure under CI", yellow=True, bold=True)  # fmt: skip
    else:
        write("no test skipped for want of an environment piece", green=True)
    return False


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Generator[None, object, object]:
    """After pytest's own summary (its last line too): the skips by reason, and the verdict on them (last)."""
    result = yield
    if hasattr(session.config, "workerinput") or not _SKIPS:  # an xdist worker: the controller reports
        return result
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def write(line: str, **markup: bool) -> None:
        if reporter is not None:
            reporter.write_line(line, **markup)

    if reporter is not None:
        reporter.write_sep("=", "skipped tests, by reason (tests/conftest.py)")
    if _skips_verdict(write) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result


@pytest.fixture(scope="session")
def pretrained_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small "pretrained" GPT-2 and its tokenizer in a local directory, made by the example script."""
    out = tmp_path_factory.mktemp("pretrained") / "tiny-gpt2"
    script = Path(__file__).resolve().parents[1] / "examples" / "make_pretrained.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(out), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


# --- a real S3-compatible server (SeaweedFS) for checkpoint.storage=s3://... -----------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS per test session (per xdist worker), on loopback."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process (and its children) pointed at the server; a fresh client per test."""
    from pipeline.storage import s3  # noqa: PLC0415

    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3._clients.clear()
    return env


@pytest.fixture
def bucket(s3_server: S3Server, s3_env: dict[str, str]) -> str:
    """The session's bucket (a new bucket costs SeaweedFS a volume growth of seconds): tests use their own prefix."""
    return s3_server.bucket


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}/r1"


_CPU_LOG = os.environ.get("PIPELINE_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``PIPELINE_TEST_CPU_LOG=<file>``, append each test's CPU seconds (this worker and the children it
    waited for: the pipelines it launched) and wall seconds, setup included, one JSON line per test. It is how the
    suite's time on 2 cores is budgeted: wall time under xdist says little about which test costs the CPU."""
    if not _CPU_LOG:
        yield
        return
    import resource  # noqa: PLC0415

    def cpu() -> tuple[float, float]:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime

    (s0, c0), t0 = cpu(), time.monotonic()
    yield
    s1, c1 = cpu()
    line = {"test": item.nodeid, "cpu": round(s1 - s0 + c1 - c0, 1), "self": round(s1 - s0, 1)}
    line["wall"] = round(time.monotonic() - t0, 1)
    with open(_CPU_LOG, "a") as f:
        f.write(json.dumps(line) + "\n")
