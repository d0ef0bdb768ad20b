"""Compose the Hydra config from ``conf/`` and command-line overrides into a typed :class:`PipelineConfig`."""

from __future__ import annotations

import dataclasses
import re

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from pipeline.config.keys import all_keys, cli_key, did_you_mean
from pipeline.config.location import conf_dir
from pipeline.config.schema import PipelineConfig, register_configs, schema_key
from pipeline.errors import ConfigError, PipelineError


def experiments() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def compose_dict(overrides: list[str]) -> DictConfig:
    register_configs()
    overrides = [schema_key(o) for o in overrides]
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e)) from e


_UNKNOWN_KEY = re.compile(r"Could not override '([^']*)'\.\s*$", re.MULTILINE)


def explain(e: BaseException) -> str:
    """One line from a Hydra/OmegaConf error: keep its hints (available options, ``+experiment=``), drop the
    config search path and object types, and suggest the key that was probably meant."""
    text = str(e).strip()
    cause = str(e.__cause__).strip() if e.__cause__ is not None else ""
    m = _UNKNOWN_KEY.search(text)
    if m and "not in" in cause:
        return unknown_key(m.group(1))
    lines: list[str] = []
    for raw in (text + "\n" + cause).splitlines():
        line = raw.strip()
        if line.startswith("Config search path"):
            break
        if not line or line.startswith(("full_key:", "reference_type=", "object_type=", "See https://", "None")):
            continue
        lines.append(line)
    msg = " ".join(lines) or type(e).__name__
    msg = re.sub(r"Available options in '([^']*)':((?:\s+\S+)+)", _options, msg)
    return f"bad config override: {msg}"


def _options(m: re.Match[str]) -> str:
    opts = [o for o in m.group(2).split() if not o.startswith("base_")]
    return f"available options in '{m.group(1)}': {', '.join(opts)}"


def unknown_key(key: str) -> str:
    keys = all_keys()
    hint = did_you_mean(key, keys + sorted({k.rsplit(".", 1)[0] for k in keys if "." in k}))
    key, hint = cli_key(key), (cli_key(hint) if hint else hint)
    return (
        f"unknown config key {key!r}"
        + (f": did you mean {hint}?" if hint else "")
        + " (python -m pipeline --help lists every key)"
    )


def _reject_unknown_keys(node: DictConfig, prefix: str = "") -> None:
    """Hydra's ``+key=`` adds keys even to structured nodes; a typo must fail instead of being ignored."""
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node:
        full = f"{prefix}{key!s}"
        if known is not None and key not in known:
            raise ConfigError(unknown_key(full))
        if not OmegaConf.is_missing(node, str(key)):
            child = node[key]
            if isinstance(child, DictConfig):
                _reject_unknown_keys(child, f"{full}.")


def to_typed(cfg: DictConfig) -> PipelineConfig:
    _reject_unknown_keys(cfg)
    if OmegaConf.is_missing(cfg, "experiment"):
        raise ConfigError(
            f"no experiment chosen: add +experiment=<name> to the command (available: {', '.join(experiments())})"
        )
    try:
        typed = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"config value missing: {e.full_key} must be set") from e
    except PipelineError:
        raise
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        raise ConfigError(f"invalid config: {str(e).splitlines()[0]}") from e
    if not isinstance(typed, PipelineConfig):  # internal invariant: base_config is the root schema
        raise ConfigError("conf/config.yaml must start from base_config")
    return typed


def load_config(overrides: list[str]) -> PipelineConfig:
    return to_typed(compose_dict(overrides))


def to_yaml(cfg: PipelineConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
