"""Your own model, data and training step through the app, end to end (real processes, gloo, DCP/DeepSpeed).

Every model route trains, resumes and exports a model its real client loads with the trained model's logits:

* A: an inline ``transformers`` config (GPT-2: tied embeddings, learned positions, biases) under DeepSpeed ZeRO-3
  (parameters partitioned, the tied weight too), on the synthetic corpus: an interrupted run resumes
  bit-identically;
* B: a config directory (Mistral: grouped-query attention, a sliding window) under FSDP2, on local text files,
  with clipping, accumulation, a cosine schedule and eval: bit-identical resume, the same samples;
* C: local pretrained weights + LoRA on JSONL, steps 1-4 under DDP on 2 ranks, then FSDP2 on 1 rank in bf16 in
  the user's own loop: exactly the samples an uninterrupted run trains on; exported merged and as the adapter
  ``peft`` loads;
* D: a user factory (and the user's loss) under FSDP2 on pre-tokenized uint16 files read in place: continued at
  world size 1 with the same samples; a token file changed afterwards is refused.

(C and D compare their samples with the uninterrupted order computed in-process from the run's assets.)

A user project outside the repo (its own conf/ and model package, ``--config-dir``, a non-editable install) is in
``test_user_project_runs_through_config_dir_against_a_wheel_install``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.rundir.layout import RunLayout
from pipeline.workload.corpus import generate_corpus
from pipeline.workload.data import SAMPLES_ENV, SampleStream
from tests.conftest import ROOT, probe_env, probe_file, read_probe, run_cli, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GPT2 = "model.config={model_type: gpt2, n_layer: 2, n_embd: 32, n_head: 4, n_positions: 64}"
SHORT = ("train.steps=8", "checkpoint.every=4")


def _launch(root: Path, *args: str, env: dict[str, str] | None = None, ok: bool = True) -> str:
    proc = run_cli(f"run.root={root}", *args, env=env)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _layout(root: Path, run_id: str, experiment: str = "tiny") -> RunLayout:
    return RunLayout.for_run(root, experiment, run_id)


def _samples(path: Path) -> dict[int, list[int]]:
    """Step -> the sorted sample indices every rank trained on (from the ``SAMPLES_ENV`` logs)."""
    out: dict[int, list[int]] = {}
    for log in sorted(path.parent.glob(f"{path.name}.rank*")):
        for line in log.read_text().splitlines():
            e = json.loads(line)
            out.setdefault(e["step"], []).extend(e["indices"])
    return {k: sorted(v) for k, v in out.items()}


def _full_and_split(
    root: Path, args: tuple[str, ...], continue_with: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> tuple[str, str]:
    """An uninterrupted run ``full`` (probe logits written) and a run ``split`` stopped after step 4, then
    continued (with ``continue_with``); both log their sample indices."""
    common = ("+experiment=tiny", *SHORT, *args)
    for run_id, extra in (("full", ()), ("split", ("train.stop_after_step=4", "export=none"))):
        logs = {**probe_env(probe_file(root, run_id)), SAMPLES_ENV: str(root / f"samples-{run_id}")}
        _launch(root, *common, f"run.id={run_id}", "run.create=true", *extra, env={**(env or {}), **logs})
    logs = {SAMPLES_ENV: str(root / "samples-split")}
    _launch(root, "run.id=split", *continue_with, env={**(env or {}), **logs})  # export=none is carried
    return "full", "split"


def _split(root: Path, args: tuple[str, ...], continue_with: tuple[str, ...], env: dict[str, str]) -> None:
    """Only the run ``split``: stopped after step 4, then continued (``continue_with``, export on, probe logits
    written at its end); its samples are checked against the uninterrupted order computed here."""
    logs = {SAMPLES_ENV: str(root / "samples-split")}
    first = ("+experiment=tiny", *SHORT, *args, "run.id=split", "run.create=true", "train.stop_after_step=4")
    _launch(root, *first, "export=none", env={**env, **logs})
    probe = probe_env(probe_file(root, "full"))  # named "full": what the uninterrupted model would be
    _launch(root, "run.id=split", "export=hf", *continue_with, env={**env, **logs, **probe})


def _assert_uninterrupted_samples(root: Path) -> None:
    """The split run trained, step by step, on exactly the samples of an uninterrupted run at any world size
    (its global batches, computed here from the run's assets with one rank taking the whole batch)."""
    import yaml

    layout = _layout(root, "split")
    cfg = yaml.safe_load(layout.run_yaml.read_text())["config"]
    global_batch = cfg["train"]["global_batch_size"] or cfg["train"]["micro_batch_size"] * 2
    os.environ[SAMPLES_ENV] = str(root / "samples-full")
    try:
        stream = SampleStream(layout.assets, cfg["data"]["seq_len"], cfg["train"]["seed"], global_batch, 0, 1)
    finally:
        del os.environ[SAMPLES_ENV]
    for step in range(1, 9):
        stream.next_batch(step)
    _assert_same_samples(root)


def _assert_bit_identical(root: Path) -> None:
    full, split = _layout(root, "full"), _layout(root, "split")
    a = load_file(str(full.consolidated_step(8) / "model.safetensors"))
    b = load_file(str(split.consolidated_step(8) / "model.safetensors"))
    assert a.keys() == b.keys()
    assert not [k for k in a if not torch.equal(a[k], b[k])], "the resumed run differs"
    assert train_losses(split) == {k: v for k, v in train_losses(full).items() if int(k) > 4}


def _assert_same_samples(root: Path) -> None:
    full, split = _samples(root / "samples-full"), _samples(root / "samples-split")
    assert sorted(full) == list(range(1, 9)) and full == split, "a sample was skipped or repeated"


def _assert_export_matches_probe(root: Path, run_id: str = "full", tol: float = 1e-4) -> Any:
    """The export of ``run_id``'s step 8 loads in ``transformers`` with the logits the trained model had."""
    from transformers import AutoModelForCausalLM

    probe = read_probe(probe_file(root, "full"))
    model = AutoModelForCausalLM.from_pretrained(str(_layout(root, run_id).export_step(8))).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([probe["input_ids"]])).logits
    expected = torch.tensor(probe["logits"]).view(probe["shape"])
    torch.testing.assert_close(logits, expected, rtol=tol, atol=tol)
    return model


def test_a_inline_gpt2_under_zero3_resumes_bit_identically_and_exports_tied(tmp_path: Path) -> None:
    _full_and_split(tmp_path, (GPT2, "strategy=deepspeed", "strategy.zero_stage=3"))
    _assert_bit_identical(tmp_path)
    model = _assert_export_matches_probe(tmp_path)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "tied as GPT-2 ties"
    export = _layout(tmp_path, "full").export_step(8)
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert "transformer.wte.weight" in index and "lm_head.weight" not in index, "a tied weight is stored once"


def test_b_config_dir_under_fsdp2_on_text_files_resumes_bit_identically(tmp_path: Path) -> None:
    conf = tmp_path / "mistral"
    conf.mkdir()
    values = {
        "model_type": "mistral",
        "vocab_size": 600,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 16,
        "max_position_embeddings": 128,
    }
    (conf / "config.json").write_text(json.dumps(values))
    text = ("data.source=text", "data.path=/usr/share/common-licenses/*", "data.vocab_size=512", "data.seq_len=32")
    train = ("train.grad_accum=2", "train.grad_clip=1.0", "train.schedule=cosine")
    evals = ("data.eval_samples=8", "train.eval_every=4")
    _full_and_split(tmp_path, (f"model.config_dir={conf}", "strategy=fsdp2", *text, *train, *evals))
    _assert_bit_identical(tmp_path)
    _assert_same_samples(tmp_path)
    model = _assert_export_matches_probe(tmp_path)
    assert model.config.sliding_window == 16 and model.config.num_key_value_heads == 2
    events = [json.loads(x) for x in _layout(tmp_path, "full").metrics.read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "eval"] == [4, 8]
    assert list((_layout(tmp_path, "full").run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_c_pretrained_lora_on_jsonl_ddp_then_fsdp2_bf16_user_loop_at_world_size_1(
    tmp_path: Path, pretrained_gpt2: Path
) -> None:
    """Pretrained + LoRA on JSONL: steps 1-4 under DDP on 2 ranks, continued under FSDP2 on 1 rank with bf16
    compute (``MixedPrecisionPolicy``) in the user's own loop (``train.loop._target_``). Exactly the samples of an
    uninterrupted run; fp32 weights in the checkpoint; the merged export and the adapter (loaded by ``peft`` on the
    base model) reproduce the trained logits (to bf16's precision: the probe ran in bf16)."""
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"id": i, "content": s}) for i, s in enumerate(generate_corpus(_data_cfg()))]
    corpus.write_text("\n".join(lines) + "\n")
    args = (
        f"model.pretrained={pretrained_gpt2}",
        "model.lora.r=4",
        "export.adapter=true",
        "data.source=jsonl",
        f"data.path={corpus}",
        "data.field=content",
    )
    then = ("strategy=fsdp2", "strategy.world_size=1", "strategy.precision=bf16")
    loop = ("train.loop._target_=mypkg.train.loop", "train.loop.args={log_every: 2}")
    _split(tmp_path, args, (*then, *loop), {"PYTHONPATH": str(ROOT / "examples")})
    _assert_uninterrupted_samples(tmp_path)
    layout = _layout(tmp_path, "split")
    train_logs = "".join(p.read_text() for p in (layout.logs / "train").rglob("*.out"))
    assert "my loop: step 8 loss" in train_logs, "the user's loop ran"
    events = [json.loads(x) for x in layout.metrics.read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [4, 8]
    state = load_file(str(layout.consolidated_step(8) / "model.safetensors"))
    assert {t.dtype for t in state.values()} == {torch.float32}, "fp32 master weights in the checkpoint"
    merged = _assert_export_matches_probe(tmp_path, "split", tol=0.05)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(pretrained_gpt2)).eval()
    ids = torch.tensor([read_probe(probe_file(tmp_path, "full"))["input_ids"]])
    assert _logits(merged, ids) != _logits(base, ids), "the adapter trained"
    adapted = PeftModel.from_pretrained(base, str(layout.export_step(8) / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def _data_cfg() -> Any:
    from pipeline.config.workload import DataConfig

    return DataConfig()


def _logits(model: Any, ids: torch.Tensor) -> list[float]:
    with torch.no_grad():
        return model(input_ids=ids).logits.flatten().tolist()  # type: ignore[no-any-return]


def test_d_user_factory_under_fsdp2_on_token_files_continues_at_world_size_1(
    tmp_path: Path, pretrained_gpt2: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pretrained_gpt2))
    bins = tmp_path / "bins"
    bins.mkdir()
    docs = generate_corpus(_data_cfg())
    for part in range(2):  # two shards, as nanoGPT/Megatron write train_000.bin, ...
        ids = [t for d in docs[part::2] for t in [*tok.encode(d, add_special_tokens=False), tok.eos_token_id]]
        np.asarray(ids, dtype=np.uint16).tofile(bins / f"train_{part:03d}.bin")
    env_path = f"{ROOT / 'examples'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    args = (
        "model._target_=mypkg.models.build",
        "model.args={dim: 48}",
        "strategy=fsdp2",
        "data.source=tokens",
        f"data.path={bins}/*.bin",
        f"data.tokenizer={pretrained_gpt2}",
        "train.optimizer=sgd",
        "train.schedule=linear",
        "train.step._target_=mypkg.train.loss",  # the user's loss: the factory's own is not used
        "train.step.args={label_smoothing: 0.1}",
    )
    # the jobs import the user's package (examples/mypkg)
    _split(tmp_path, args, ("strategy.world_size=1",), {"PYTHONPATH": env_path})
    _assert_uninterrupted_samples(tmp_path)
    export = _layout(tmp_path, "split").export_step(8)
    assert json.loads((export / "config.json").read_text()) == {
        "pipeline_factory": "mypkg.models.build",
        "args": {"dim": 48},
    }
    sys.path.insert(0, str(ROOT / "examples"))
    from mypkg.models import build

    model = build(dim=48).eval()
    weights = {k: v for f in sorted(export.glob("model-*.safetensors")) for k, v in load_file(str(f)).items()}
    model.load_state_dict(weights)
    probe = read_probe(probe_file(tmp_path, "full"))
    with torch.no_grad():
        logits = model(torch.tensor([probe["input_ids"]]))
    torch.testing.assert_close(logits, torch.tensor(probe["logits"]).view(probe["shape"]), rtol=1e-4, atol=1e-4)
    assert not list(_layout(tmp_path, "split").assets.glob("*.safetensors")), "token files are read in place"
    with open(bins / "train_001.bin", "ab") as f:  # the data changes under the run
        f.write(np.asarray([1, 2, 3], dtype=np.uint16).tobytes())
    out = _launch(tmp_path, "run.id=split", "train.steps=12", ok=False)
    assert "train_001.bin changed since the run was prepared" in out, out


def _run_in(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipeline", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)


USER_EXPERIMENT = """# @package _global_
experiment: mine
train: {steps: 4}
checkpoint: {every: 2}
model:
  _target_: userpkg.nets.build
  args: {dim: 24}
"""


def test_user_project_runs_through_config_dir_against_a_wheel_install(tmp_path: Path) -> None:
    """A user's repository outside this one: conf/experiment/mine.yaml and a model package of its own; the
    pipeline installed from a wheel (not editable, so conf/ must ship inside it), run from the user's dir."""
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    proc = subprocess.run([*pip, str(ROOT)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    project = tmp_path / "project"
    (project / "conf" / "experiment").mkdir(parents=True)
    (project / "conf" / "experiment" / "mine.yaml").write_text(USER_EXPERIMENT)
    shutil.copytree(ROOT / "examples" / "mypkg", project / "userpkg")
    (project / "userpkg" / "nets.py").write_text((ROOT / "examples" / "mypkg" / "models.py").read_text())
    env = {**os.environ, "PYTHONPATH": str(site)}
    cmd = [sys.executable, "-m", "pipeline", "--config-dir", "conf", "+experiment=mine", "run.id=u", "run.create=true"]
    proc = _run_in(project, env, *cmd[3:], f"run.root={tmp_path / 'runs'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    layout = RunLayout.for_run(tmp_path / "runs", "mine", "u")
    assert json.loads((layout.export_step(4) / "config.json").read_text())["pipeline_factory"] == "userpkg.nets.build"
    where = subprocess.run(
        [sys.executable, "-c", "import pipeline; print(pipeline.__file__)"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(site)), "the wheel install ran, not the source tree"
    # a continuation names only the run: the search path was recorded with it
    proc = _run_in(project, env, f"run.root={tmp_path / 'runs'}", "run.id=u", "train.steps=6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (layout.export_step(6) / "provenance.json").is_file()
