"""A ``transformers`` model's config beside exported weights: what makes an export load with ``from_pretrained``.

* :func:`first_misfit` compares stored tensor shapes with a model (tied duplicates such as a tied ``lm_head`` may be
  absent): the first difference, in name order, as words; shared by the library's export and the app's.
* :class:`HFConfig` is a model's config given to the library's export (``python -m pipeline.export <dir> --config
  <dir or config.json>``, or ``export_latest(..., config=...)`` with a directory, a ``config.json`` or a
  ``PretrainedConfig``): it builds the model on the meta device (no memory) to check the weights fit it, and
  writes ``config.json``, ``generation_config.json`` and, from a directory that has them, the tokenizer's files.

``transformers`` is imported inside the functions that need it: the committer's imports stay light.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, need

CONFIG = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
"""Copied from a config directory when present, so ``AutoTokenizer.from_pretrained(export)`` works too."""


def tied_duplicates(reference: Any) -> dict[str, str]:
    """Every second (third...) name of a shared parameter -> the name kept (the first, as ``state_dict`` order)."""
    first: dict[int, str] = {}
    dups: dict[str, str] = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        if id(p) in first:
            dups[name] = first[id(p)]
        else:
            first[id(p)] = name
    return dups


def first_misfit(stored: dict[str, tuple[int, ...]], reference: Any, model: str = "the model") -> str | None:
    """Why ``reference`` (an ``nn.Module``, called ``model`` in the words) cannot load tensors of these names and
    shapes, or None when it can."""
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    optional = set(tied_duplicates(reference))
    for name in sorted(stored.keys() | expected.keys()):
        if name not in stored and name in optional:
            continue
        if name not in stored:
            return f"has no tensor {name}, which {model} needs (shape {expected[name]})"
        if name not in expected:
            return f"has tensor {name} {stored[name]}, which {model} does not have"
        if stored[name] != expected[name]:
            return f"has tensor {name} of shape {stored[name]}, but {model} expects {expected[name]}"
    return None


@dataclass(frozen=True)
class HFConfig:
    """A ``transformers`` config for an export, and the directory its tokenizer files come from (if any)."""

    config: Any
    """A ``transformers.PretrainedConfig``."""
    where: str
    """Where it came from, for errors."""
    tokenizer_dir: Path | None = None

    @classmethod
    def of(cls, given: str | Path | Any) -> HFConfig:
        """From a directory holding ``config.json``, a ``config.json`` file, or a ``PretrainedConfig``; a
        one-line :class:`ConfigError` for anything else."""
        transformers = need("transformers", "hf", "a model config (--config, export.config)")
        CONFIG_MAPPING, PretrainedConfig = transformers.CONFIG_MAPPING, transformers.PretrainedConfig  # noqa: N806

        if isinstance(given, HFConfig):
            return given
        if isinstance(given, PretrainedConfig):
            return cls(given, f"the given {type(given).__name__}")
        if not isinstance(given, str | Path):
            raise ConfigError(f"config={given!r}: give a directory holding config.json, a config.json, or a config")
        path = Path(given)
        directory = path if path.is_dir() else path.parent
        file = directory / CONFIG if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--config {path}: no {CONFIG} there (give the directory save_pretrained wrote)")
        try:
            obj = json.loads(file.read_text())
            config = CONFIG_MAPPING[obj["model_type"]].from_dict(obj) if "model_type" in obj else None
        except Exception as e:  # transformers' own errors too: one line, never a traceback
            raise ConfigError(f"--config {file}: not a transformers config ({_first_line(e)})") from None
        if config is None:
            raise ConfigError(f"--config {file}: no model_type in it: not a transformers config.json")
        has_tokenizer = path.is_dir() and any((directory / f).is_file() for f in TOKENIZER_FILES)
        return cls(config, str(file), directory if has_tokenizer else None)

    @property
    def digest(self) -> str:
        """Names the config in the export's done-marker: another config is another export."""
        text = json.dumps(self.config.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def meta_model(self) -> Any:
        """The model the config describes, on the meta device (its architecture if it names one, else a causal
        LM)."""
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415

        names = list(getattr(self.config, "architectures", None) or [])
        model_cls = getattr(transformers, names[0], None) if names else None
        try:
            with torch.device("meta"):
                if model_cls is not None:
                    return model_cls(self.config)
                return transformers.AutoModelForCausalLM.from_config(self.config)
        except Exception as e:  # an architecture transformers cannot build here (a missing extra, a bad value)
            raise ConfigError(f"{self.where}: cannot build its model ({_first_line(e)})") from None

    def check_fits(self, stored: dict[str, tuple[int, ...]], weights: str) -> Any:
        """The meta model, once the stored weights are known to fit it; else a one-line :class:`ConfigError`."""
        reference = self.meta_model()
        problem = first_misfit(stored, reference)
        if problem is not None:
            raise ConfigError(
                f"{weights} {problem}: the checkpoint's model is not the one {self.where} describes "
                "(give the config the model was trained with)"
            )
        return reference

    def write(self, out: Path, dtype: str) -> list[str]:
        """``config.json`` (its ``dtype`` the export's), ``generation_config.json`` and the tokenizer's files
        into ``out``; the names written."""
        from transformers import GenerationConfig  # noqa: PLC0415

        config = self.config.__class__.from_dict(self.config.to_dict())
        config.dtype = dtype
        config.save_pretrained(str(out))
        GenerationConfig.from_model_config(config).save_pretrained(str(out))
        copied = []
        for name in TOKENIZER_FILES if self.tokenizer_dir is not None else ():
            src = self.tokenizer_dir / name  # type: ignore[operator]
            if src.is_file():
                shutil.copyfile(src, out / name)
                copied.append(name)
        return [CONFIG, "generation_config.json", *copied]


def _first_line(e: BaseException) -> str:
    return ((str(e) or type(e).__name__).splitlines() or [type(e).__name__])[0][:200]
