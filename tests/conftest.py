from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
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

    from pipeline.checkpoint.async_save import stuck_writers  # noqa: PLC0415

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
    from pipeline.checkpoint import ownership  # noqa: PLC0415

    monkeypatch.setattr(ownership, "SETTLE_S", 0.0)


_RELIABILITY_ROWS: list[tuple[str, str, bool, list[str]]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == "reliability_row":
            _RELIABILITY_ROWS.append(value)


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

    def cpu() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    c0, t0 = cpu(), time.monotonic()
    yield
    line = {"test": item.nodeid, "cpu": round(cpu() - c0, 1), "wall": round(time.monotonic() - t0, 1)}
    with open(_CPU_LOG, "a") as f:
        f.write(json.dumps(line) + "\n")
