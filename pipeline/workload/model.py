"""The model, by its route (:attr:`ModelConfig.route`): a ``transformers`` causal LM from an inline config, a config
directory or pretrained weights; a user factory; or the built-in small Llama. LoRA (``peft``) on top. Nothing is
downloaded: every path is local.

The contract a model meets (docs/your-model-and-data.md):

* **loss**: ``model(input_ids=batch, labels=batch)`` returns the loss, or an object with ``.loss``
  (``transformers`` models do); or ``train.step._target_`` computes it;
* **FSDP2 units**: ``model.fsdp_units()`` if the module defines it, else every submodule whose class is named in
  ``_no_split_modules`` (``transformers`` models), else the root alone;
* **export**: a ``transformers`` model is exported as its architecture (``config.json``, ``from_pretrained``);
  any other module as safetensors plus ``config.json`` naming the factory and its arguments.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from pipeline.config.workload import LoraConfig, ModelConfig
from pipeline.errors import ConfigError


def load_target(target: str, what: str) -> Callable[..., Any]:
    """``pkg.mod.fn`` or ``pkg.mod:fn`` -> the function (a one-line error naming ``what`` when it does not import)."""
    module, _, name = target.partition(":") if ":" in target else target.rpartition(".")
    if not module or not name:
        raise ConfigError(f"{what}={target!r} is not a dotted path: write mypkg.module.function or mypkg.module:fn")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"{what}={target!r} cannot be imported ({type(e).__name__}: {e}); is your project installed or on "
            "PYTHONPATH where the jobs run?"
        ) from None
    if not callable(fn):
        raise ConfigError(f"{what}={target!r} is not callable")
    return fn  # type: ignore[no-any-return]


def llama_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _local_dir(path: str, key: str, needs: str = "config.json") -> Path:
    d = Path(path).expanduser()
    if not (d / needs).is_file():
        raise ConfigError(f"{key}={path}: no {needs} there (give a local directory; nothing is downloaded)")
    return d


def hf_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig | None:
    """The ``transformers`` config of the model (None for a user factory's module)."""
    route = cfg.route
    if route == "llama":
        return llama_config(cfg, tokenizer)
    if route == "factory":
        return None
    if route == "config":
        values = dict(cfg.config)
        model_type = values.pop("model_type")
        values.setdefault("vocab_size", len(tokenizer))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            values.setdefault(key, getattr(tokenizer, key))
        try:
            conf = AutoConfig.for_model(model_type, **values)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"model.config: {str(e).splitlines()[0][:300]}") from None
    else:
        key = f"model.{route}"
        try:
            conf = AutoConfig.from_pretrained(str(_local_dir(getattr(cfg, route), key)), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:  # malformed config.json, unknown model_type
            raise ConfigError(f"{key}={getattr(cfg, route)}: {str(e).splitlines()[0][:300]}") from None
    vocab = getattr(conf, "vocab_size", None)
    if isinstance(vocab, int) and vocab < len(tokenizer):
        raise ConfigError(
            f"the model's vocab_size={vocab} is smaller than the tokenizer's {len(tokenizer)} tokens: raise "
            "vocab_size in the model config, or use the model's own tokenizer (data.tokenizer=<its directory>)"
        )
    return conf


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Same weights on every rank: initialisation is seeded by ``model.init_seed`` alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, *, meta: bool = False) -> torch.nn.Module:
    """The model of this route, LoRA applied; ``meta``: on the meta device (shapes only: no memory, no reads)."""
    conf = hf_config(cfg, tokenizer)
    with _seeded(cfg.init_seed), torch.device("meta") if meta else _no_context():
        if cfg.route == "factory":
            model = load_target(str(cfg._target_), "model._target_")(**cfg.args)
            if not isinstance(model, torch.nn.Module):
                raise ConfigError(f"model._target_={cfg._target_} returned a {type(model).__name__}, not an nn.Module")
        elif cfg.route == "llama":
            model = LlamaForCausalLM(conf)  # type: ignore[arg-type]
        elif cfg.route == "pretrained" and not meta:
            model = AutoModelForCausalLM.from_pretrained(
                str(cfg.pretrained), config=conf, dtype=torch.float32, local_files_only=True
            )
        else:
            model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    if cfg.lora.r:
        with _seeded(cfg.init_seed + 1), torch.device("meta") if meta else _no_context():
            model = apply_lora(model, cfg.lora)
    freeze(model, cfg.freeze)
    return model


def freeze(model: torch.nn.Module, patterns: list[str]) -> None:
    """``model.freeze``: the parameters whose names match a pattern stop training (each pattern must match)."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ConfigError(f"model.freeze: {pattern!r} matches no parameter of this model (its names: {shown})")
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            param.requires_grad_(False)


@contextmanager
def _no_context() -> Iterator[None]:
    yield


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    from peft import LoraConfig as PeftLoraConfig  # noqa: PLC0415 - peft only for LoRA runs
    from peft import get_peft_model  # noqa: PLC0415

    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules) if lora.target_modules else None,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, peft_cfg)  # type: ignore[arg-type]
    except ValueError as e:
        raise ConfigError(f"model.lora: {str(e).splitlines()[0][:300]} (set model.lora.target_modules)") from None


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a LoRA wrapper (the model itself when there is none)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules FSDP2 shards as units (each gathered in turn), by the contract in the module doc."""
    own = getattr(base_model(model), "fsdp_units", None)
    if callable(own):
        return list(own())
    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def loss_of(net: Any, batch: torch.Tensor) -> torch.Tensor:
    """The model's loss on a batch of token ids (the contract: a tensor, or an object with ``.loss``)."""
    out = net(input_ids=batch, labels=batch)
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"the model returned a {type(out).__name__} without a loss: return the loss (or an object with .loss) "
            "from forward(input_ids=..., labels=...), or set train.step._target_"
        )
    return loss


def is_transformers(model: torch.nn.Module) -> bool:
    return isinstance(base_model(model), PreTrainedModel)


def factory_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of an export of a user module: how to build it again."""
    return {"pipeline_factory": cfg._target_, "args": json.loads(json.dumps(cfg.args, default=str))}
