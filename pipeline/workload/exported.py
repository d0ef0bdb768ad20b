"""Which tensors an export holds, and how each is read from the consolidated checkpoint, for the run's model.

The run's model is built on the meta device (no memory, no reads) as the reference. The consolidated tensors
must be exactly its state (names and shapes; a tied weight may be stored once or twice); the export then holds:

* a tied weight once, under the name the architecture keeps (``transformer.wte.weight`` for GPT-2, whose
  ``lm_head.weight`` is tied to it), as ``save_pretrained`` writes it;
* for a LoRA model, the base model's names with each adapted weight merged (``W + scaling * B @ A``, transposed
  for ``fan_in_fan_out`` layers such as GPT-2's ``Conv1D``), read one layer at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.config.workload import ModelConfig
from pipeline.errors import ConfigError
from pipeline.formats.hf_model import first_misfit, tied_duplicates

PEFT_PREFIX = "base_model.model."
Reader = Callable[[Any], torch.Tensor]
"""Reads one exported tensor from an open ``safe_open`` handle."""


@dataclass(frozen=True)
class ExportTensor:
    name: str
    shape: tuple[int, ...]
    read: Reader


def _lora_layers(reference: torch.nn.Module) -> dict[str, tuple[float, bool]]:
    """LoRA-adapted module name -> (scaling, fan_in_fan_out), from the reference's peft layers."""
    layers: dict[str, tuple[float, bool]] = {}
    for name, m in reference.named_modules():
        lora_a = getattr(m, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and "default" in lora_a:
            layers[name] = (float(m.scaling["default"]), bool(getattr(m, "fan_in_fan_out", False)))
    return layers


def check_fits(stored: dict[str, tuple[int, ...]], reference: torch.nn.Module, where: str, model_hint: str) -> None:
    """Refuse stored tensors that the run's model cannot load (the first difference, in name order)."""
    problem = first_misfit(stored, reference, "the run's model")
    if problem is not None:
        raise ConfigError(
            f"{where} {problem} ({model_hint}): the weights do "
            "not fit the model this run's config describes; give the run the model the checkpoint was trained as "
            "(model.config / model.config_dir / model.pretrained / model._target_, in a new run or with "
            "run.overwrite=true), or export=none (the consolidated file only)"
        )


def model_hint(model: ModelConfig, tokenizer: Any) -> str:
    """The run's model in a few words, for an error: the built-in Llama's sizes, else its route."""
    if model.route == "llama":
        sizes = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
        return ", ".join(f"model.{k}={getattr(model, k)}" for k in sizes) + f", vocab {len(tokenizer)}"
    return f"model route {model.route}"


def _plain(name: str) -> Reader:
    return lambda f: f.get_tensor(name)


def _merged(base: str, prefix: str, scaling: float, fan_in_fan_out: bool) -> Reader:
    def read(f: Any) -> torch.Tensor:
        w = f.get_tensor(base)
        a = f.get_tensor(f"{prefix}.lora_A.default.weight").to(torch.float32)
        b = f.get_tensor(f"{prefix}.lora_B.default.weight").to(torch.float32)
        delta = b @ a
        delta = delta.T if fan_in_fan_out else delta
        return (w.to(torch.float32) + scaling * delta).to(w.dtype)

    return read


def export_tensors(stored: dict[str, tuple[int, ...]], reference: torch.nn.Module) -> list[ExportTensor]:
    """The export's tensors, in name order (call :func:`check_fits` first)."""
    dups = tied_duplicates(reference)
    lora = _lora_layers(reference)
    out: dict[str, ExportTensor] = {}
    for name in reference.state_dict():
        if name in dups:
            continue
        source = name if name in stored else next(d for d, kept in dups.items() if kept == name and d in stored)
        if ".lora_" in name:
            continue
        if not lora:
            out[name] = ExportTensor(name, stored[source], _plain(source))
            continue
        target = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        prefix = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if prefix is not None and prefix in lora and name.endswith(".base_layer.weight"):
            scaling, fan = lora[prefix]
            out[target] = ExportTensor(target, stored[source], _merged(source, prefix, scaling, fan))
        else:
            out[target] = ExportTensor(target, stored[source], _plain(source))
    return [out[k] for k in sorted(out)]


def adapter_tensors(stored: dict[str, tuple[int, ...]], reference: torch.nn.Module) -> list[ExportTensor]:
    """The LoRA adapter alone, named as ``peft``'s ``save_pretrained`` names it (adapter name dropped)."""
    return [
        ExportTensor(name.replace(".default.", "."), stored[name], _plain(name))
        for name in sorted(stored)
        if ".lora_" in name and name in reference.state_dict()
    ]
