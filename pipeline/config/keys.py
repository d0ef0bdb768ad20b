"""The config's keys and what they mean, read from the schema and ``conf/``: every dotted key with its doc and
default, the config groups and their options, and did-you-mean hints for a mistyped key.

Field docs are the attribute docstrings under each dataclass field in :mod:`pipeline.config.schema`,
:mod:`pipeline.config.launcher` and :mod:`pipeline.config.workload`. Python drops those at runtime, so they are
read from the source with :mod:`ast`; an inherited field's doc comes from the class that documents it (the
nearest in the MRO). A field typed with a base class whose ConfigStore group of the same name registers several
subclasses (``launcher``: local, slurm) is documented as their union, each key not shared by all of them marked
with the launchers it belongs to.

Groups and options are the YAML files under ``conf/<group>/``; experiments are ``conf/experiment/*.yaml``.
:mod:`pipeline.config.compose` reads this module for its error hints and :mod:`pipeline.config.docs` for the
``--help`` page; both find ``conf/`` through :mod:`pipeline.config.location`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from pipeline.config import launcher, schema, workload
from pipeline.config.location import conf_dir


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One documented leaf key: its dotted path, first paragraph of its docstring, and dataclass default."""

    key: str
    doc: str
    default: Any
    section: str  # the top-level field it lives under; "" for top-level keys


# ---------------------------------------------------------------------------------------------- source docs


@functools.cache
def _own_attribute_docs(cls: type) -> dict[str, str]:
    """Docstrings written under the fields of ``cls`` itself (not its bases), as in the source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app, REPL class): undocumented rather than broken
        return {}
    cls_node = ast.parse(source).body[0]
    if not isinstance(cls_node, ast.ClassDef):
        return {}
    docs: dict[str, str] = {}
    body = cls_node.body
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = _first_paragraph(after.value.value)
    return docs


def _first_paragraph(doc: str) -> str:
    """The summary of a docstring: its first paragraph, on one line."""
    paragraph = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(paragraph.split())


def class_field_docs(cls: type) -> dict[str, str]:
    """Every dataclass field of ``cls`` -> its doc, taken from the nearest class in the MRO that documents it."""
    documented = [_own_attribute_docs(base) for base in cls.__mro__ if dataclasses.is_dataclass(base)]
    return {f.name: next((d[f.name] for d in documented if d.get(f.name)), "") for f in dataclasses.fields(cls)}


def schema_classes() -> list[type]:
    """Every dataclass defined in :mod:`pipeline.config.schema`, :mod:`~pipeline.config.launcher` and
    :mod:`~pipeline.config.workload`."""
    return [
        obj
        for module in (schema, launcher, workload)
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__
    ]


# ---------------------------------------------------------------------------------------------- the key tree


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def _group_variants(group: str) -> list[tuple[str, type]]:
    """(ConfigStore name without ``.yaml``, dataclass) for each schema registered in ``group``."""
    schema.register_configs()
    cs = ConfigStore.instance()
    try:
        names = cs.list(group)
    except OSError:  # no such group registered
        return []
    out: list[tuple[str, type]] = []
    for name in names:
        node = cs.load(f"{group}/{name}").node
        cls = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            out.append((name.removesuffix(".yaml"), cls))
    return out


def _options_using(group: str, schema_name: str) -> list[str]:
    """The options of ``conf/<group>/`` whose defaults list starts from the ConfigStore schema ``schema_name``."""
    found = []
    for path in _group_files(group):
        if schema_name in _defaults_list(path):
            found.append(path.stem)
    return sorted(found)


def _walk(cls: type, prefix: str, section: str) -> list[KeyDoc]:
    docs = class_field_docs(cls)
    hints = typing.get_type_hints(cls)
    out: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        sub = section or f.name
        tp = hints.get(f.name)
        variants = _group_variants(f.name) if tp is Any or isinstance(tp, type) else []
        if isinstance(tp, type) and len(variants) > 1 and all(issubclass(c, tp) for _, c in variants):
            out += _walk_union(f.name, key, variants, sub)  # a base class whose group has several subclasses
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += _walk(tp, f"{key}.", sub)
        elif tp is Any and variants:
            out += _walk_union(f.name, key, variants, sub)
        else:
            out.append(KeyDoc(key, docs[f.name], _default_of(f), section))
    return out


def _walk_union(group: str, prefix: str, variants: list[tuple[str, type]], section: str) -> list[KeyDoc]:
    """Keys of every variant of an ``Any`` field, in first-seen order; a key not in all variants says whose it is."""
    per_variant = [(name, {k.key: k for k in _walk(cls, f"{prefix}.", section)}) for name, cls in variants]
    merged: dict[str, KeyDoc] = {}
    for _, keys in per_variant:
        for key, doc in keys.items():
            merged.setdefault(key, doc)
    out = []
    for key, first in merged.items():
        owners = [name for name, keys in per_variant if key in keys]
        doc = first
        if len(owners) < len(per_variant):
            options = sorted({o for name in owners for o in _options_using(group, name)}) or [
                name.removeprefix("base_") for name in owners
            ]
            note = f"[{group}={'|'.join(options)}]"
            doc = dataclasses.replace(doc, doc=f"{note} {doc.doc}".strip())
        out.append(doc)
    return out


def key_docs() -> list[KeyDoc]:
    """Every leaf key of :class:`~pipeline.config.schema.PipelineConfig`, in schema order."""
    return _walk(schema.PipelineConfig, "", "")


def field_docs() -> dict[str, str]:
    """Every config key path (``train.steps``, ``launcher.job_deadline_s``, ``stage``, ...) -> its doc ("" if none)."""
    return {k.key: k.doc for k in key_docs()}


def all_keys() -> list[str]:
    return list(field_docs())


def section_docs() -> dict[str, str]:
    """Top-level sections (``run``, ``train``, ...) -> their doc in ``PipelineConfig``."""
    docs = class_field_docs(schema.PipelineConfig)
    return {k.section: docs[k.section] for k in key_docs() if k.section}


# ---------------------------------------------------------------------------------------------- conf/ files


def _conf_dir() -> Path:

    return Path(conf_dir())


def _group_files(group: str) -> list[Path]:
    return sorted((_conf_dir() / group).glob("*.yaml"))


def _defaults_list(path: Path) -> list[Any]:
    cfg = OmegaConf.load(path)
    defaults = cfg.get("defaults") if isinstance(cfg, DictConfig) else None
    entries = OmegaConf.to_container(defaults) if isinstance(defaults, ListConfig) else None
    return entries if isinstance(entries, list) else []


def group_options() -> dict[str, list[str]]:
    """Config group -> its sorted options (``conf/<group>/*.yaml``); experiments are listed by ``experiment_names``."""
    root = _conf_dir()
    return {
        d.name: sorted(p.stem for p in _group_files(d.name))
        for d in sorted(root.iterdir())
        if d.is_dir() and d.name != "experiment" and _group_files(d.name)
    }


def group_defaults() -> dict[str, str]:
    """Config group -> the option chosen by ``conf/config.yaml``'s defaults list."""
    out: dict[str, str] = {}
    for entry in _defaults_list(_conf_dir() / "config.yaml"):
        if isinstance(entry, dict):
            for group, option in entry.items():
                name = str(group).split()[-1]  # "override x" / "optional x"
                if option is not None:
                    out[name] = str(option)
    return out


def experiment_names() -> list[str]:
    return [p.stem for p in _group_files("experiment")]


def cli_key(key: str) -> str:
    """A schema key as typed on the command line (``import_.source`` -> ``import.source``)."""
    for word, field_name in schema.KEYWORD_SECTIONS.items():
        if key == field_name or key.startswith(field_name + "."):
            return word + key[len(field_name) :]
    return key


# ---------------------------------------------------------------------------------------------- did you mean


def did_you_mean(key: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``key`` was most likely meant to be, or None.

    Tried in order: the last component among the keys of the same parent (``train.stpes`` -> ``train.steps``),
    the whole dotted key (``trian.steps`` -> ``train.steps``), and a bare name that is the last component of
    exactly one key (``world_size`` -> ``strategy.world_size``). Hydra's ``+``/``++``/``~`` prefixes are ignored.
    """
    key = key.lstrip("+~")
    keys = list(dict.fromkeys(candidates))
    if not key or key in keys:
        return None
    parent, _, leaf = key.rpartition(".")
    siblings = {c.rpartition(".")[2]: c for c in keys if c.rpartition(".")[0] == parent}
    if match := difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6):
        return siblings[match[0]]
    if match := difflib.get_close_matches(key, keys, n=1, cutoff=0.75):
        return match[0]
    same_leaf = [c for c in keys if c.rpartition(".")[2] == leaf]
    if len(same_leaf) == 1:
        return same_leaf[0]
    return None
