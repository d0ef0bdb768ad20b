"""The ``--help`` page of the app, rendered from the config's keys (:mod:`pipeline.config.keys`) and ``conf/``.

Every key is shown with its value (from the composed config of an experiment, else the schema's default) and
its doc; then the experiments, stages and config groups. ``pipeline/cli.py`` installs the page as Hydra's help
template (:func:`hydra_template`).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from pipeline.config import schema
from pipeline.config.keys import cli_key, experiment_names, group_defaults, group_options, key_docs, section_docs
from pipeline.config.location import conf_dir

PROG = "python -m pipeline"
WIDTH = 110  # help lines are wrapped to this many characters
_KEY_COLUMN_MAX = 40  # a longer "key = value" puts its doc on the next line
_ABSENT = object()


def _experiment_summary(name: str) -> str:
    """The first sentence of ``conf/experiment/<name>.yaml``'s opening comment (after the ``@package`` header),
    whole: it may run over several comment lines."""
    words: list[str] = []
    for line in (conf_dir() / "experiment" / f"{name}.yaml").read_text().splitlines():
        text = line.strip()
        if not text.startswith("#"):
            break
        text = text.lstrip("#").strip()
        if text.startswith("@package"):
            continue
        if not text and words:
            break
        words += text.split()
    paragraph = " ".join(words)
    end = re.search(r"[.!?](\s|$)", paragraph)
    return paragraph[: end.start() + 1] if end else paragraph


def compose_defaults(experiment: str | None = None) -> DictConfig:
    """The composed config for ``+experiment=<experiment>`` (or none), for :func:`render_help`'s values."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    schema.register_configs()
    overrides = [f"+experiment={experiment}"] if experiment else []
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: reuse its config search path
        return compose(config_name="config", overrides=overrides)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


# ---------------------------------------------------------------------------------------------- help page


def _lookup(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    *parents, leaf = key.split(".")
    for part in parents:
        if not isinstance(node, DictConfig) or part not in node or OmegaConf.is_missing(node, part):
            return _ABSENT
        node = node[part]
    if not isinstance(node, DictConfig) or leaf not in node:
        return _ABSENT
    if OmegaConf.is_missing(node, leaf):
        return MISSING
    value = node[leaf]
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def format_value(value: Any) -> str:
    """A value as one would write it on the command line: ``???`` for MISSING, ``null``, ``true``/``false``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, dict | list):
        return str(OmegaConf.to_yaml(OmegaConf.create(value), sort_keys=False)).strip().replace("\n", ", ")
    return str(value)


def _rst(doc: str) -> str:
    return doc.replace("``", "`")  # RST literals read better as Markdown ones in a terminal


def _rows(rows: Iterable[tuple[str, str]], indent: int = 2, width: int | None = None) -> list[str]:
    """Two columns, the left ``width`` wide (default: its longest entry, at most ``_KEY_COLUMN_MAX``); the right
    one wrapped to ``WIDTH`` and hanging at its column. A longer left entry puts its text on the next line."""
    rows = list(rows)
    if width is None:
        width = min(max((len(left) for left, _ in rows), default=0), _KEY_COLUMN_MAX)
    column = indent + width + 2
    out: list[str] = []
    for left, right in rows:
        wrapped = textwrap.wrap(right, max(WIDTH - column, 30), break_on_hyphens=False) or [""]
        head = " " * indent + left
        if len(left) > width and right:
            out.append(head)
        else:
            out.append((head.ljust(column) + wrapped.pop(0)).rstrip())
        out += [" " * column + line for line in wrapped]
    return out


def render_help(stages: list[tuple[str, str]], defaults: DictConfig | dict[str, Any] | None = None) -> str:
    """The ``--help`` page: usage, experiments, ``stages`` ((name, one-line description) pairs), config groups
    with their options and default, and every key with its value and doc.

    Values come from ``defaults`` (a composed config, see :func:`compose_defaults`) where it has the key, else
    from the schema's dataclass defaults.
    """
    cfg = defaults if defaults is None or isinstance(defaults, DictConfig) else OmegaConf.create(defaults)
    lines: list[str] = [
        "race-free-ckpt: a race-free checkpoint pipeline for distributed PyTorch training.",
        "",
        "Usage:",
        f"  {PROG} +experiment=<name> [key=value ...]",
        "",
        *_rows(
            [
                ("+experiment=<name>", "new run (id = UTC time + random suffix), all stages"),
                ("... run.id=<id>", "continue run <id>: stages whose outputs verify are skipped"),
                ("... run.id=last", "continue the newest run of the experiment"),
                ("... run.id=<id> stage=<name>", "rerun one stage of run <id> (skipped if its outputs verify)"),
                ("... run.id=<id> stage=<name> force=true", "redo that stage even if its outputs verify"),
                ("... run.id=<id> run.overwrite=true", "delete run <id> and start it over"),
                ("-m +experiment=<name> strategy=ddp,fsdp2", "sweep: one run per combination of values"),
                ("... --cfg job", "print the composed config, run nothing"),
                ("... dry_run=true", "print the resolved config and the stage plan, run nothing"),
            ],
            width=44,
        ),
        "",
        "Experiments (+experiment=<name>):",
        *_rows((name, _rst(_experiment_summary(name))) for name in experiment_names()),
        "",
        "Stages (stage=<name>; default: all):",
        *_rows((name, _rst(doc)) for name, doc in stages),
        "",
        "Config groups (group=option):",
    ]
    chosen = group_defaults()
    for group, options in group_options().items():
        default = f" (default: {chosen[group]})" if group in chosen else ""
        lines.append(f"  {group}: {', '.join(options)}{default}")

    lines += ["", "Keys (key = value, set with key=value):"]
    sections = section_docs()
    by_section: dict[str, list[tuple[str, str]]] = {}
    for k in key_docs():
        value = _lookup(cfg, k.key) if cfg is not None else _ABSENT
        left = f"{cli_key(k.key)} = {format_value(k.default if value is _ABSENT else value)}"
        by_section.setdefault(k.section, []).append((left, _rst(k.doc)))
    width = min(max(len(left) for rows in by_section.values() for left, _ in rows), _KEY_COLUMN_MAX)
    for section, rows in by_section.items():
        lines.append("")
        if section:
            lines.append(f"  # {cli_key(section)}: {_rst(sections.get(section, ''))}".rstrip(": "))
        lines += _rows(rows, width=width)
    return "\n".join(lines) + "\n"


def hydra_template(text: str, *, literal: bool = False) -> str:
    """``text`` as a ``hydra.help.template`` that prints as ``text``: Hydra runs the template through
    ``string.Template``, where ``$`` is special, so every ``$`` becomes ``$$``.

    That is all a resolver's result needs (OmegaConf does not resolve what a resolver returns). With
    ``literal=True`` the result is meant to be stored as a plain config value (YAML, ConfigStore), which OmegaConf
    resolves when Hydra reads it: a ``${`` is then also escaped, as ``\\${``.
    """
    escaped = text.replace("$", "$$")
    return escaped.replace("$${", "$\\${") if literal else escaped
