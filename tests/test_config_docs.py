"""Config documentation: every schema field is documented, and ``--help`` shows every key, group and stage."""

from __future__ import annotations

import dataclasses
import string

import pytest
from omegaconf import OmegaConf

from pipeline.config import docs, keys, launcher, schema, workload

STAGES = [("prepare_dirs", "Create the run layout."), ("consolidate", "Merge the shards of `latest`.")]


@pytest.fixture(scope="module")
def composed() -> object:
    return docs.compose_defaults("tiny")


def test_every_schema_field_has_a_docstring() -> None:
    classes = keys.schema_classes()
    assert schema.PipelineConfig in classes and launcher.SlurmLauncherConfig in classes
    undocumented = [
        f"{cls.__name__}.{name}" for cls in classes for name, doc in keys.class_field_docs(cls).items() if not doc
    ]
    assert not undocumented, f"add a docstring under these fields in pipeline/config/schema.py: {undocumented}"


def test_inherited_fields_take_the_base_class_doc() -> None:
    local = keys.class_field_docs(launcher.LocalLauncherConfig)
    base = keys.class_field_docs(launcher.LauncherConfig)
    assert local["kind"] == base["kind"] and local["kind"].startswith("Which launcher")
    assert local["master_addr"].startswith("Rendezvous address")


def test_field_docs_covers_nested_keys_with_their_text() -> None:
    fd = keys.field_docs()
    assert fd["train.steps"].startswith("Total optimizer steps of the run")
    assert fd["run.id"] and "\n" not in fd["run.id"]
    assert fd["launcher.poll_interval_s"] == "How often the launcher polls job state."
    base = keys.class_field_docs(launcher.LauncherConfig)  # every shared launcher key, documented by the base class
    assert all(fd[f"launcher.{name}"] == doc for name, doc in base.items() if name != "stages")
    assert fd["launcher.stages.train.mem_gb"].startswith("Memory per task in GB")  # nested: one key per leaf
    assert fd["strategy.world_size"] == "Number of training ranks (tasks of the train job)."
    assert {"stage", "force", "dry_run", "experiment"} <= set(fd)
    assert keys.all_keys() == list(fd)


def test_launcher_keys_are_the_union_marked_by_owner() -> None:
    fd = keys.field_docs()
    assert fd["launcher.partition"].startswith("[launcher=slurm] SLURM partition")
    assert fd["launcher.master_addr"].startswith("[launcher=inprocess|local] ")
    assert not fd["launcher.poll_interval_s"].startswith("[")  # shared by every launcher: no owner note


def test_every_dataclass_leaf_is_a_key() -> None:
    def leaves(cls: type, prefix: str) -> set[str]:
        out: set[str] = set()
        for f in dataclasses.fields(cls):
            sub = next((getattr(m, str(f.type)) for m in (schema, launcher, workload) if hasattr(m, str(f.type))), None)
            out |= leaves(sub, f"{prefix}{f.name}.") if dataclasses.is_dataclass(sub) else {f"{prefix}{f.name}"}
        return out

    expected = leaves(schema.PipelineConfig, "") - {"launcher"}
    expected |= {
        f"launcher.{k}" for c in (launcher.LocalLauncherConfig, launcher.SlurmLauncherConfig) for k in leaves(c, "")
    }
    assert set(keys.all_keys()) == expected


def test_group_options_and_experiments() -> None:
    groups = keys.group_options()
    assert groups["strategy"] == ["ddp", "deepspeed", "fsdp2"]
    assert groups["launcher"] == ["inprocess", "local", "slurm"]
    assert "experiment" not in groups
    assert keys.group_defaults()["strategy"] == "ddp"
    assert "tiny" in keys.experiment_names()


def test_render_help_shows_usage_groups_stages_and_every_key(composed: object) -> None:
    text = docs.render_help(STAGES, composed)  # type: ignore[arg-type]
    lines = text.splitlines()
    assert "python -m pipeline +experiment=<name> [key=value ...]" in text
    for hint in ("run.id=<id>", "run.id=last", "stage=<name>", "-m ", "--cfg job", "dry_run=true"):
        assert hint in text, hint
    assert "  strategy: ddp, deepspeed, fsdp2 (default: ddp)" in lines
    assert any(line.split()[:1] == ["tiny"] for line in lines)
    for name, _ in STAGES:
        assert any(line.split()[:1] == [name] for line in lines), name
    for key in keys.all_keys():
        assert any(line.lstrip().startswith(f"{keys.cli_key(key)} = ") for line in lines), key
    assert any(line.lstrip().startswith("import.source = ") for line in lines)  # as typed, not import_
    assert max(len(line) for line in lines) <= docs.WIDTH


def test_render_help_values_come_from_the_composed_config_then_the_schema(composed: object) -> None:
    lines = [" ".join(line.split()) for line in docs.render_help(STAGES, composed).splitlines()]  # type: ignore[arg-type]
    assert any(line.startswith("train.steps = 8 Total optimizer steps") for line in lines)
    assert "experiment = tiny" in "\n".join(lines)
    assert any(line.startswith("launcher.partition = null ") for line in lines)  # not in the local launcher

    bare = docs.render_help(STAGES).splitlines()
    assert any(line.lstrip().startswith("experiment = ??? ") for line in bare)  # MISSING
    assert any(line.lstrip().startswith("run.id = null ") for line in bare)
    as_dict = docs.render_help(STAGES, {"train": {"steps": 3}}).splitlines()
    assert any(line.lstrip().startswith("train.steps = 3 ") for line in as_dict)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("train.stpes", "train.steps"),
        ("trian.steps", "train.steps"),
        ("strategy.worldsize", "strategy.world_size"),
        ("+train.stpes", "train.steps"),
        ("dryrun", "dry_run"),
        ("world_size", "strategy.world_size"),
        ("zzz.qqq", None),
        ("seed", None),  # data.seed or train.seed: ambiguous, no guess
        ("train.steps", None),  # already a key
    ],
)
def test_did_you_mean(key: str, expected: str | None) -> None:
    assert keys.did_you_mean(key, keys.all_keys()) == expected


def test_hydra_template_escapes_dollar_for_string_template() -> None:
    text = "costs $5, literal ${not.a.key} and $$ stay"
    escaped = docs.hydra_template(text)
    assert escaped == "costs $$5, literal $${not.a.key} and $$$$ stay"
    assert string.Template(escaped).substitute(FLAGS_HELP="", CONFIG="") == text


def test_hydra_template_round_trips_through_a_resolver_and_a_literal_config_value() -> None:
    text = "costs $5, literal ${not.a.key} and $$ stay"
    if not OmegaConf.has_resolver("test_config_docs_help"):
        OmegaConf.register_new_resolver("test_config_docs_help", lambda: docs.hydra_template(text))
    via_resolver = OmegaConf.create({"template": "${test_config_docs_help:}"}).template
    literal = OmegaConf.create({"template": docs.hydra_template(text, literal=True)}).template
    for template in (via_resolver, literal):  # Hydra reads the template from the config, then substitutes
        assert string.Template(template).substitute(FLAGS_HELP="", CONFIG="") == text


def test_every_experiment_in_help_is_described_by_a_whole_sentence(composed: object) -> None:
    """Each experiment's line(s) under "Experiments" in --help end a sentence: never a comment cut mid-way."""
    text = docs.render_help(STAGES, composed)  # type: ignore[arg-type]
    block = text.split("Experiments (+experiment=<name>):\n", 1)[1].split("\n\n", 1)[0]
    entries: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name, _, rest = line.strip().partition(" ")
            entries[name] = rest.strip()
        else:
            entries[name] += " " + line.strip()
    assert set(entries) == set(keys.experiment_names())
    for name, described in entries.items():
        assert described and described[-1] in ".!?)", f"{name}: {described!r} ends mid-sentence"
