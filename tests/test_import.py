"""``import.source=``: a checkpoint the pipeline did not write (DCP, DeepSpeed with its ``latest``, ``torch.save``)
is staged, committed, consolidated by its format and exported, through the CLI.

Sources are built once per module: a DCP step of a tiny pipeline run (only the files DCP's metadata names), two
DeepSpeed checkpoints that DeepSpeed itself writes for the pipeline's own tiny model (``torchrun``, ZeRO-2 and
ZeRO-3, ``engine.save_checkpoint(dir)`` with its ``latest``), and two ``torch.save`` files (one needing a global
the restricted unpickler does not allow). Each import is checked against the source's own reader: the export's
logits equal a model loaded with the source's weights. Single-task import runs use ``launcher=inprocess`` (no job
start-up) except the DCP import, which goes through the default local launcher.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint.manifest import read_latest, read_manifest
from pipeline.config.compose import load_config
from pipeline.formats.dcp import load_into, stored_files
from pipeline.rundir.layout import RunLayout
from pipeline.storage.atomic import read_json
from pipeline.storage.integrity import hash_file
from pipeline.workload.corpus import build_assets, load_tokenizer
from pipeline.workload.model import build_model
from tests.conftest import ROOT, run_cli, snapshot

pytestmark = [pytest.mark.slow]

INPROCESS = "launcher=inprocess"
DS_STEPS = {2: 3, 3: 2}
"""ZeRO stage -> optimizer steps trained (the step an import of it records)."""

_DS_SCRIPT = r"""
import os
import sys
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from pipeline.config.compose import load_config
from pipeline.strategies.zero import disable_shm_comm_op
from pipeline.workload.corpus import build_assets, load_tokenizer
from pipeline.workload.model import build_model

disable_shm_comm_op()  # no 25 s JIT build of DeepSpeed's shared-memory allreduce op (gloo is used)
out_dir, assets, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
deepspeed.init_distributed(dist_backend="gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
for case in cases:
    stage, steps = (int(v) for v in case.split(":"))
    model = build_model(load_config(["+experiment=tiny"]).model, load_tokenizer(assets))
    config = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * ws, "zero_optimization": {"stage": stage},
              "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    for s in range(steps):
        x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(s * 10 + rank))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(str(out_dir / f"z{stage}"))  # DeepSpeed's defaults: tag global_step<N> and `latest`
    dist.barrier()
    del engine, model, opt
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown: a native thread left at exit can abort the process under load
"""


@dataclass(frozen=True)
class Saved:
    plain: Path
    pickled: Path
    state: dict[str, torch.Tensor]
    """What both ``torch.save`` files hold under ``model``."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deepspeed_sources(out: Path, assets: Path) -> dict[int, Path]:
    script = out / "_ds_train.py"
    script.write_text(_DS_SCRIPT)
    cases = [f"{stage}:{steps}" for stage, steps in DS_STEPS.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1"]
    cmd += ["--nproc-per-node=2", str(script), str(out), str(assets), *cases]
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "MASTER_PORT": str(_free_port()),
    }
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    assert proc.returncode == 0, f"DeepSpeed source launch failed ({proc.returncode}):\n{output[-6000:]}"
    return {stage: out / f"z{stage}" for stage in DS_STEPS}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("import")


@pytest.fixture(scope="module")
def assets(root: Path) -> Path:
    """The tiny experiment's assets, built as prepare-dirs builds them (every import run's tokenizer is equal)."""
    out = root / "assets"
    out.mkdir()
    build_assets(load_config(["+experiment=tiny"]).data, out)
    return out


def test_assets_are_built_without_torch_or_transformers(root: Path, assets: Path) -> None:
    """prepare-dirs trains the tokenizer and writes the token stream with ``tokenizers`` and ``safetensors`` alone
    (torch and ``transformers`` cost seconds of CPU per run); ``AutoTokenizer`` loads what it wrote, and encodes
    as the tokenizer that made the token stream did."""
    out = root / "assets-bare"
    code = (
        "import sys; from pathlib import Path; from pipeline.config.compose import load_config; "
        "from pipeline.workload.corpus import build_assets; "
        f"build_assets(load_config(['+experiment=tiny']).data, Path({str(out)!r})); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout
    tokenizer = load_tokenizer(out)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    from safetensors.torch import load_file  # noqa: PLC0415

    tokens = load_file(str(out / "tokens.safetensors"))["tokens"].tolist()
    first = tokens[: tokens.index(tokenizer.eos_token_id)]
    assert tokenizer.decode(first) and tokenizer.encode(tokenizer.decode(first), add_special_tokens=False) == first
    assert hash_file(out / "tokens.safetensors") == hash_file(assets / "tokens.safetensors")  # the same build


@pytest.fixture(scope="module")
def saved(root: Path, assets: Path) -> Saved:
    """Two ``torch.save`` files of the tiny model (weights moved off their init), one needing a foreign global."""
    model = build_model(load_config(["+experiment=tiny"]).model, load_tokenizer(assets))
    gen = torch.Generator().manual_seed(1)
    state = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    (root / "sources").mkdir(exist_ok=True)
    plain, pickled = root / "sources" / "plain.pt", root / "sources" / "pickled.pt"
    torch.save({"model": state, "rng_state": torch.get_rng_state(), "step": 3}, plain)  # a stray top-level tensor
    torch.save({"model": state, "args": argparse.Namespace(lr=0.1)}, pickled)
    return Saved(plain, pickled, state)


@pytest.fixture(scope="module")
def dcp_source(root: Path) -> Path:
    """Step 8 of a tiny pipeline run (2 DDP ranks): only the files DCP's metadata names, not the pipeline's
    manifest and markers. Only its committed step is used: the source run exports nothing (export=none)."""
    run = ("+experiment=tiny", f"run.root={root / 'trained'}", "run.id=src", "run.create=true", "export=none")
    proc = run_cli(*run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step8 = RunLayout.for_run(root / "trained", "tiny", "src").committed_step(8)
    dcp = root / "sources" / "dcp"
    dcp.mkdir(parents=True)
    for name in stored_files(step8):
        shutil.copy2(step8 / name, dcp / name)
    return dcp


@pytest.fixture(scope="module")
def ds_sources(root: Path, assets: Path) -> dict[int, Path]:
    out = root / "sources" / "deepspeed"
    out.mkdir(parents=True)
    return _deepspeed_sources(out, assets)


def _import(root: Path, run_id: str, source: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "+experiment=tiny", f"run.root={root}", f"run.id={run_id}", "run.create=true", f"import.source={source}", *extra
    )


def _imported(root: Path, run_id: str, source: Path, *extra: str) -> RunLayout:
    proc = _import(root, run_id, source, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skip train: this run imports import.source instead of training" in proc.stdout
    return RunLayout.for_run(root, "tiny", run_id)


def _file_snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of a source: a directory's every entry, or one file."""
    if path.is_dir():
        return snapshot(path)
    st = path.stat()
    return {path.name: (st.st_size, st.st_mtime_ns)}


def _check_committed(layout: RunLayout, step: int, fmt: str, by_rank: dict[int, set[str]], source_dir: Path) -> None:
    """One committed step (``latest``), its manifest naming ``fmt`` and the world size, a marker per source rank
    listing exactly that rank's files, every file a byte copy of the source's."""
    latest = read_latest(layout)
    assert latest is not None and latest.step == step
    assert sorted(p.name for p in layout.checkpoints.glob("step_*")) == [f"step_{step}"]
    assert not any(layout.staging.iterdir()), "the committed step leaves staging"
    step_dir = layout.committed_step(step)
    manifest = read_manifest(step_dir)
    assert (manifest.format, manifest.world_size, manifest.step) == (fmt, len(by_rank), step)
    names = set().union(*by_rank.values())
    assert {f.path for f in manifest.files} == names
    markers = {p.name for p in step_dir.glob("rank_*.done.json")}
    assert markers == {f"rank_{r}.done.json" for r in by_rank}
    for rank, files in by_rank.items():
        marker = read_json(step_dir / f"rank_{rank}.done.json")
        assert (marker["rank"], marker["world_size"], marker["format"]) == (rank, len(by_rank), fmt)
        assert {f["path"] for f in marker["files"]} == files, f"rank {rank} lists only its own files"
    assert {p.name for p in step_dir.iterdir()} == names | markers | {"manifest.json"}
    source_names = {"checkpoint.pt": source_dir.name} if source_dir.is_file() else {}
    src_root = source_dir.parent if source_dir.is_file() else source_dir
    for f in manifest.files:
        src = src_root / source_names.get(f.path, f.path)
        assert (f.size, f.hash) == (src.stat().st_size, hash_file(src))
    records = {p.stem: read_json(p)["status"] for p in layout.stages.glob("*.json")}
    assert records == dict.fromkeys(
        ["prepare_dirs", "import_checkpoint", "verify_manifest", "consolidate", "export"], "succeeded"
    )


def _check_logits(layout: RunLayout, step: int, reference_state: dict[str, torch.Tensor], assets: Path) -> None:
    """The export loads in transformers offline and computes the logits of a model holding the source's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_dir = layout.export_step(step)
    model = AutoModelForCausalLM.from_pretrained(str(export_dir), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(export_dir), local_files_only=True)
    ids = tokenizer("the robot reads the old book at night .", return_tensors="pt").input_ids
    reference = build_model(load_config(["+experiment=tiny"]).model, load_tokenizer(assets)).eval()
    reference.load_state_dict(reference_state)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert read_json(export_dir / "provenance.json")["source"]["step"] == step


@pytest.fixture(scope="module")
def dcp_import(root: Path, dcp_source: Path) -> RunLayout:
    before = snapshot(dcp_source)
    layout = _imported(root / "runs", "dcp", dcp_source)  # the default local launcher: real jobs
    assert snapshot(dcp_source) == before, "the source is read, never written"
    return layout


# The tests of one expensive module fixture run on one xdist worker, so that it is made once: the DCP source run
# and its import (dcp_import), and the torchrun of DeepSpeed (ds_sources).
DCP_GROUP = pytest.mark.xdist_group("import_dcp")
DEEPSPEED_GROUP = pytest.mark.xdist_group("import_deepspeed")


@pytest.mark.distributed
@DCP_GROUP
def test_dcp_directory_is_imported_at_its_train_step(assets: Path, dcp_source: Path, dcp_import: RunLayout) -> None:
    by_rank = {0: {".metadata", "__0_0.distcp"}, 1: {"__1_0.distcp"}}
    _check_committed(dcp_import, 8, "torch_dcp", by_rank, dcp_source)
    reference = build_model(load_config(["+experiment=tiny"]).model, load_tokenizer(assets))
    state = {"model": reference.state_dict()}
    load_into(state, dcp_source, no_dist=True)
    _check_logits(dcp_import, 8, state["model"], assets)


@pytest.mark.distributed
@DCP_GROUP
def test_rerun_of_an_import_run_writes_nothing(root: Path, dcp_import: RunLayout) -> None:
    before = snapshot(dcp_import.run_dir)
    proc = run_cli(f"run.root={root / 'runs'}", "run.id=dcp")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ("prepare_dirs", "import_checkpoint", "train", "verify_manifest", "consolidate", "export"):
        assert f"skip {stage}:" in proc.stdout
    assert snapshot(dcp_import.run_dir) == before


@pytest.mark.distributed
@DEEPSPEED_GROUP
@pytest.mark.parametrize("stage", sorted(DS_STEPS))
def test_deepspeed_checkpoint_is_imported_at_its_global_step(
    root: Path, assets: Path, ds_sources: dict[int, Path], stage: int, tmp_path: Path
) -> None:
    """ZeRO-2 through the directory DeepSpeed's ``latest`` is in; ZeRO-3 through the tag directory itself."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    from safetensors.torch import load_file

    steps = DS_STEPS[stage]
    parent = ds_sources[stage]
    tag = (parent / "latest").read_text().strip()
    assert tag == f"global_step{steps}"
    before = snapshot(parent)
    given = parent if stage == 2 else parent / tag
    layout = _imported(root / "runs", f"ds{stage}", given, INPROCESS)
    assert snapshot(parent) == before, "the source (latest, tag dir, DeepSpeed's scripts) is never written"

    if stage == 2:  # data-parallel rank 0 writes the module's states
        by_rank = {0: {"mp_rank_00_model_states.pt"}, 1: set()}
    else:
        by_rank = {r: {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"} for r in (0, 1)}
    for r in (0, 1):
        by_rank[r].add(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    _check_committed(layout, steps, f"deepspeed_zero{stage}", by_rank, parent / tag)

    out = tmp_path / "zero_to_fp32"
    convert_zero_checkpoint_to_fp32_state_dict(
        str(parent), str(out), safe_serialization=True, max_shard_size=None, tag=tag
    )
    _check_logits(layout, steps, load_file(str(out / "model.safetensors")), assets)


def test_torch_save_file_is_imported_at_its_step(root: Path, assets: Path, saved: Saved) -> None:
    before = _file_snapshot(saved.plain)
    layout = _imported(root / "runs", "ts", saved.plain, INPROCESS)
    assert _file_snapshot(saved.plain) == before
    _check_committed(layout, 3, "torch_save", {0: {"checkpoint.pt"}}, saved.plain)
    _check_logits(layout, 3, saved.state, assets)


def test_pickled_file_is_refused_unless_allowed(root: Path, assets: Path, saved: Saved) -> None:
    runs = root / "pickle"
    before = _file_snapshot(saved.pickled)
    proc = _import(runs, "pk", saved.pickled, INPROCESS)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "argparse.Namespace" in lines[0] and "import.allow_pickle=true" in lines[0], lines
    assert not (runs / "tiny" / "pk").exists(), "a refused source creates no run"

    layout = _imported(runs, "pk", saved.pickled, INPROCESS, "import.allow_pickle=true", "import.step=7")
    assert _file_snapshot(saved.pickled) == before
    _check_committed(layout, 7, "torch_save", {0: {"checkpoint.pt"}}, saved.pickled)
    _check_logits(layout, 7, saved.state, assets)


@pytest.mark.parametrize("kind", ["missing", "not a checkpoint"])
def test_unreadable_source_fails_in_one_line_before_anything_is_created(root: Path, kind: str) -> None:
    runs = root / "bad"
    source = root / "no-such-checkpoint"
    if kind == "not a checkpoint":
        source = root / "notes"
        source.mkdir(exist_ok=True)
        (source / "README.txt").write_text("not a checkpoint\n")
    proc = _import(runs, "bad", source, INPROCESS)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"import.source={source}" in lines[0], lines
    assert ("is missing" if kind == "missing" else "is not a checkpoint") in lines[0]
    assert not runs.exists(), "nothing is created"


def test_weights_that_do_not_fit_the_model_are_refused_before_any_job_runs(root: Path, saved: Saved) -> None:
    """The export's model is decided before any job: an import it cannot export is refused in one line (exit 2,
    nothing created); with export=none the same import is committed and consolidated."""
    runs = root / "runs"
    proc = _import(runs, "narrow", saved.plain, INPROCESS, "model.hidden_size=32")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "do not fit the model" in lines[0], proc.stderr
    assert "lm_head.weight" in lines[0] and "model.hidden_size=32" in lines[0] and "export=none" in lines[0]
    layout = RunLayout.for_run(runs, "tiny", "narrow")
    assert not layout.run_dir.exists(), "nothing is created"
    proc = _import(runs, "narrow", saved.plain, INPROCESS, "model.hidden_size=32", "export=none")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert read_manifest(layout.committed_step(3)).format == "torch_save"
    assert (layout.consolidated_step(3) / "model.safetensors").is_file() and not any(layout.export.iterdir())


def test_a_plain_dcp_checkpoint_records_its_step_as_an_int_or_a_scalar_tensor(tmp_path: Path) -> None:
    """``dcp.save({..., "step": 5})`` (an int, stored pickled) and ``{"global_step": tensor(7)}`` both give the
    import its step; a stored value that is not a plain int (here one that would run code) is never executed."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from pipeline.stages.import_checkpoint import _dcp_step

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    cases = {
        "int": ({"step": 5}, 5),
        "tensor": ({"global_step": torch.tensor(7)}, 7),
        "hostile": ({"step": Boom()}, None),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized: assuming a single process"
        for name, (extra, expected) in cases.items():
            d = tmp_path / name
            dcp.save({"fc1.weight": torch.ones(2, 2), **extra}, checkpoint_id=str(d))
            assert _dcp_step(d) == expected, name
    assert not (tmp_path / "pwned").exists(), "a stored value was unpickled with its code"
