"""Typed configuration of what is trained: the model (its route), the data, and the training step.

A model comes by one of five routes (``model.config``, ``model.config_dir``, ``model.pretrained``, ``model._target_``,
or none of them: the built-in Llama of the size fields); the data from one of four sources (``data.source``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config.fields import MUTABLE, PER_LAUNCH
from pipeline.errors import ConfigError


@dataclass
class LoraConfig:
    """LoRA through ``peft`` on the built model (off while ``r`` is 0); only the adapter weights train."""

    r: int = 0
    """Rank of the LoRA update (0: no LoRA; the whole model trains)."""
    alpha: int = 16
    """LoRA scaling numerator (the update is scaled by ``alpha / r``)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] | None = None
    """Module names to adapt (e.g. ``[q_proj, v_proj]``, ``[c_attn]``); null: peft's default for the architecture."""

    def __post_init__(self) -> None:
        if self.r < 0 or not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise ConfigError(
                f"model.lora: r={self.r} must be >= 0, alpha={self.alpha} > 0 and dropout={self.dropout} in [0, 1)"
            )


@dataclass
class ModelConfig:
    """The model: a ``transformers`` causal LM from a config (inline or a directory), local pretrained weights,
    a user factory, or (none of those set) the built-in small Llama of the size fields. Nothing is downloaded."""

    config: dict[str, Any] = field(default_factory=dict)
    """Inline ``transformers`` config, e.g. ``{model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 4}``; without
    ``vocab_size`` the tokenizer's size is used."""
    config_dir: str | None = None
    """A local directory holding a ``transformers`` ``config.json`` (the model is built from it, randomly
    initialised with ``init_seed``)."""
    pretrained: str | None = None
    """A local Hugging Face model directory (``config.json`` + safetensors): training starts from its weights
    (fine-tuning); its tokenizer is used unless ``data.tokenizer`` is set."""
    _target_: str | None = None
    """A user factory, ``mypkg.models.build`` or ``mypkg.models:build``, called with ``args`` and returning an
    ``nn.Module`` (contract in docs/your-model-and-data.md)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the ``_target_`` factory."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``model.lora.r > 0``); exported merged into the weights (and the adapter alone with
    ``export.adapter=true``)."""
    freeze: list[str] = field(default_factory=list)
    """Parameters that do not train: ``fnmatch`` patterns over the model's parameter names (e.g.
    ``[model.embed_tokens.*, model.layers.0.*]``); each must match at least one. With ``checkpoint.dedup`` they
    are written once and shared by later steps."""
    hidden_size: int = 64
    """Built-in Llama: width of the residual stream."""
    intermediate_size: int = 128
    """Built-in Llama: width of the MLP."""
    num_layers: int = 2
    """Built-in Llama: decoder layers (each is one FSDP2 unit)."""
    num_heads: int = 4
    """Built-in Llama: attention heads."""
    num_kv_heads: int = 2
    """Built-in Llama: key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    max_position_embeddings: int = 128
    """Built-in Llama: longest sequence the rotary embedding is configured for."""
    init_seed: int = 0
    """Seed for weight initialisation (identical on every rank)."""

    def __post_init__(self) -> None:
        routes = [k for k in ("config", "config_dir", "pretrained", "_target_") if getattr(self, k)]
        if len(routes) > 1:
            raise ConfigError(
                f"model.{' and model.'.join(routes)} are both set: a model comes from one route; keep one of them"
            )
        if self.config and "model_type" not in self.config:
            raise ConfigError("model.config needs a model_type (e.g. model.config={model_type: gpt2, n_layer: 2})")
        for key in ("config_dir", "pretrained"):  # fixed where the run is launched, checked before any job runs
            value = getattr(self, key)
            if value:
                path = Path(value).expanduser().resolve()
                if not (path / "config.json").is_file():
                    raise ConfigError(
                        f"model.{key}={value}: no config.json there (a local transformers model directory; "
                        "nothing is downloaded)"
                    )
                setattr(self, key, str(path))
        if self.args and not self._target_:
            raise ConfigError("model.args are the arguments of model._target_: set model._target_ or drop model.args")
        sizes = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
        for key in (*sizes, "max_position_embeddings"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model: hidden_size={self.hidden_size} must divide by num_heads={self.num_heads}, "
                f"and num_heads by num_kv_heads={self.num_kv_heads}"
            )

    @property
    def route(self) -> str:
        """``config``, ``config_dir``, ``pretrained``, ``factory`` or ``llama`` (the built-in)."""
        for key in ("config", "config_dir", "pretrained"):
            if getattr(self, key):
                return key
        return "factory" if self._target_ else "llama"


DATA_SOURCES = ("synthetic", "text", "jsonl", "tokens")


@dataclass
class DataConfig:
    """Training data: a generated corpus (default), local text or JSONL files tokenized by prepare-dirs, or
    pre-tokenized token files read in place (memory-mapped, fingerprinted)."""

    source: str = "synthetic"
    """``synthetic`` (sentences from a small grammar), ``text`` (one document per file), ``jsonl`` (one document
    per line, in ``field``) or ``tokens`` (flat uint16/uint32 binaries, as nanoGPT/Megatron write them)."""
    path: str | None = None
    """Glob of the local files (``text``, ``jsonl``, ``tokens``); relative to where the run is launched."""
    field: str = "text"
    """``jsonl``: the field holding each document's text."""
    tokenizer: str | None = None
    """A local tokenizer directory (``tokenizer.json``; any ``transformers`` fast tokenizer). Null: a BPE
    tokenizer of ``vocab_size`` is trained on the corpus (or the pretrained model's own is used)."""
    token_dtype: str = "uint16"
    """``tokens``: the integer type of the files (``uint16`` or ``uint32``)."""
    eval_samples: int = 0
    """Samples held out of training (the last ones of the data) for the eval loss every ``train.eval_every``."""
    num_documents: int = 400
    """``synthetic``: sentences generated from a fixed grammar with ``seed``."""
    seq_len: int = 32
    """Tokens per training sample."""
    vocab_size: int = 256
    """Target BPE vocabulary size when the tokenizer is trained here (the model's vocab is the tokenizer's)."""
    seed: int = 1234
    """``synthetic``: seed of the corpus generator (which sentences the grammar produces)."""

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ConfigError(f"data.source={self.source!r}: choose one of {', '.join(DATA_SOURCES)}")
        if self.source != "synthetic" and not self.path:
            raise ConfigError(f"data.source={self.source} reads local files: set data.path=<glob>")
        if self.path:  # fixed where the run is launched
            self.path = str(Path(self.path).expanduser().absolute())
        if self.tokenizer:
            self.tokenizer = str(Path(self.tokenizer).expanduser().resolve())
        if self.token_dtype not in ("uint16", "uint32"):
            raise ConfigError(f"data.token_dtype={self.token_dtype!r}: use uint16 or uint32")
        for key, low in (("num_documents", 1), ("seq_len", 2), ("vocab_size", 32), ("eval_samples", 0)):
            if getattr(self, key) < low:
                raise ConfigError(f"data.{key}={getattr(self, key)} must be >= {low}")


@dataclass
class HookConfig:
    """A user function, ``mypkg.train.step`` or ``mypkg.train:step``, called with ``args`` as extra keywords."""

    _target_: str | None = None
    """The function (null: the pipeline's own)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments it is called with."""


OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class TrainConfig:
    steps: int = field(default=8, metadata=MUTABLE)
    """Total optimizer steps of the run (raise it on a finished run to train on from ``latest``)."""
    micro_batch_size: int = 4
    """Samples per rank per step (when ``global_batch_size`` is null)."""
    global_batch_size: int | None = None
    """Samples per step over all ranks; each rank takes ``global_batch_size / strategy.world_size``. Null: the
    micro batch x the world size the run was created at; a continuation at another world size keeps that number
    (it sets this key to it), so the training arithmetic (batches, loss curve) does not change with the ranks."""
    grad_accum: int = 1
    """Each rank's batch of a step is run in this many micro-batches, gradients accumulated (must divide it)."""
    optimizer: str = "adamw"
    """``adamw`` or ``sgd`` (with ``momentum``)."""
    lr: float = 3e-3
    """Peak learning rate."""
    schedule: str = "constant"
    """After the linear warm-up: ``constant``, ``linear`` (to ``min_lr_ratio`` x lr at the last step) or
    ``cosine`` (likewise)."""
    warmup_steps: int = 2
    """Linear warm-up length of the schedule."""
    min_lr_ratio: float = 0.0
    """``linear``/``cosine``: the rate at ``train.steps``, as a fraction of ``lr``."""
    weight_decay: float = 0.01
    """Weight decay (AdamW's decoupled one; SGD's L2)."""
    momentum: float = 0.9
    """``sgd``: momentum."""
    grad_clip: float | None = None
    """Clip the gradients' global L2 norm to this (null: no clipping)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (``transformers`` models: gradient checkpointing; others: each
    FSDP unit is checkpointed)."""
    eval_every: int | None = field(default=None, metadata=MUTABLE)
    """Every this many steps (and at the last), the mean loss over the held-out ``data.eval_samples``."""
    step: HookConfig = field(default_factory=HookConfig)
    """``train.step._target_``: your loss function, ``fn(model, batch, **args) -> loss`` (batch: token ids)."""
    loop: HookConfig = field(default_factory=HookConfig, metadata=MUTABLE)
    """``train.loop._target_``: your whole loop, ``fn(ctx, **args)`` in every rank (docs/your-model-and-data.md);
    may change between launches of a run (it must train the same way: the checkpoint, data position and schedule
    are the run's)."""
    seed: int = 42
    """Base seed for the data order and per-rank RNG (rank k uses seed + k)."""
    stop_after_step: int | None = field(default=None, metadata=PER_LAUNCH)
    """Stop the train job cleanly after this step (simulates a pre-emption; the next run resumes)."""
    time_limit_min: int = field(default=2880, metadata=MUTABLE)
    """Wall-clock budget of one train job in minutes (SLURM ``--time``; locally cancelled past it plus
    ``launcher.deadline_grace_s``). Longer runs continue in a new job from ``latest``."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.micro_batch_size < 1 or self.grad_accum < 1:
            raise ConfigError("train.steps, train.micro_batch_size and train.grad_accum must be >= 1")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"train.lr={self.lr} must be a finite number > 0")
        if not 0 <= self.weight_decay < math.inf or self.warmup_steps < 0:
            raise ConfigError(
                f"train.weight_decay={self.weight_decay} and train.warmup_steps={self.warmup_steps} must be >= 0"
            )
        if self.optimizer not in OPTIMIZERS or self.schedule not in SCHEDULES:
            raise ConfigError(
                f"train.optimizer={self.optimizer!r} / train.schedule={self.schedule!r}: optimizers are "
                f"{', '.join(OPTIMIZERS)}; schedules {', '.join(SCHEDULES)}"
            )
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.momentum < 1:
            raise ConfigError(
                f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] and train.momentum={self.momentum} in [0, 1)"
            )
        if self.grad_clip is not None and not 0 < self.grad_clip < math.inf:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be a finite number > 0 (or null)")
        if self.eval_every is not None and self.eval_every < 1:
            raise ConfigError(f"train.eval_every={self.eval_every} must be >= 1 (or null)")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"train.global_batch_size={self.global_batch_size} must be >= 1 (or null)")
        if self.stop_after_step is not None and self.stop_after_step < 1:
            raise ConfigError(f"train.stop_after_step={self.stop_after_step} must be >= 1 (or null)")
        if self.time_limit_min < 1:
            raise ConfigError(f"train.time_limit_min={self.time_limit_min} must be >= 1")
