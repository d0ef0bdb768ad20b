"""``python -m pipeline.export <dir> --config <model dir>``: a library run's export that ``transformers`` loads.

A ``transformers`` GPT-2 trained one step under a ``Checkpointer`` (one rank), exported without and then with its
config: weights only first (no ``config.json``); with ``--config`` the export holds ``config.json``,
``generation_config.json`` and the tokenizer, and ``from_pretrained`` gives the trained model's logits exactly. A
config of another model is refused in one line naming the first tensor that differs, before anything is written;
a path without a config is a bad argument (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pipeline.checkpoint import Checkpointer
from pipeline.export import main as export_main
from pipeline.storage.atomic import read_json
from tests.conftest import snapshot


def test_export_with_the_models_config_loads_in_transformers(
    tmp_path: Path, one_rank: Any, pretrained_gpt2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(pretrained_gpt2, local_files_only=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    ck = Checkpointer(tmp_path / "run", poll_interval_s=0.05)
    try:
        ck.save(1, {"model": model, "optim": opt}, metrics={"loss": 1.0})
    finally:
        ck.close()
    run = str(ck.layout.run_dir)
    out = ck.layout.export_step(1)

    assert export_main([run, "--max-shard-size", "40KB"]) == 0
    assert not (out / "config.json").exists()  # weights only

    assert export_main([run, "--config", str(pretrained_gpt2), "--max-shard-size", "40KB"]) == 0
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert read_json(out / "provenance.json")["format"] == "huggingface"
    assert any((ck.layout.export / ".retired").iterdir())  # the weights-only export, kept aside
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = tokenizer("the committer publishes each step once", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(loaded(text).logits, model.eval()(text).logits)
    capsys.readouterr()
    assert export_main([run, "--config", str(pretrained_gpt2 / "config.json"), "--max-shard-size", "40KB"]) == 0
    assert "already verifies" in capsys.readouterr().out  # the same config: nothing to redo

    other = AutoConfig.from_pretrained(pretrained_gpt2, n_embd=32, local_files_only=True)
    other.save_pretrained(tmp_path / "other")
    before = snapshot(ck.layout.export)
    assert export_main([run, "--config", str(tmp_path / "other")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "but the model expects" in err[0], err
    assert "the checkpoint's model is not the one" in err[0] and "other/config.json describes" in err[0], err
    assert snapshot(ck.layout.export) == before

    assert export_main([run, "--config", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --config {tmp_path / 'missing'}: no config.json there " + (
        "(give the directory save_pretrained wrote)"
    )


def test_ctrl_c_ends_a_command_line_in_one_line_with_exit_130(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.errors import run_command  # noqa: PLC0415

    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    assert run_command(interrupted, "nothing half-written was published; run it again to finish") == 130
    err = capsys.readouterr().err
    assert err == "interrupted: nothing half-written was published; run it again to finish\n"
