"""Structure rules that keep ownership clear: stages do not import each other; only atomic.py renames/deletes."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.stagekit.contract import OPTIONAL
from pipeline.stages import ORDER, get_stage

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path, runtime_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if runtime_only:  # imports under ``if TYPE_CHECKING:`` are for annotations, not dependencies
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                skipped.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


# Lower layers never import higher ones. Each package is one layer; the library (storage, formats, checkpoint) is
# at the bottom, then the app: its run dir, config, workload and strategies, the stage kit, the stages, the driver,
# the launchers and the entry points.
LAYERS: list[tuple[str, ...]] = [
    ("pipeline", "pipeline.errors"),
    ("pipeline.storage",),
    ("pipeline.formats",),
    ("pipeline.checkpoint",),
    ("pipeline.integrations",),
    ("pipeline.rundir",),
    ("pipeline.config",),
    ("pipeline.workload", "pipeline.strategies"),
    ("pipeline.stagekit",),
    ("pipeline.stages",),
    ("pipeline.driver",),
    ("launchers",),
    (
        "pipeline.cli",
        "pipeline.__main__",
        "pipeline.status",
        "pipeline.commit",
        "pipeline.consolidate",
        "pipeline.export",
    ),
]


def _layer(module: str) -> int | None:
    """The layer of ``module``: its package's (``pipeline.stages.train`` -> ``pipeline.stages``), or its own for a
    top-level module; None outside the project."""
    parts = module.split(".")
    if parts[0] not in ("pipeline", "launchers"):
        return None
    top = ".".join(parts[:2])  # pipeline.<package or top-level module>; launchers is one package
    for level, names in enumerate(LAYERS):
        if top in names or (parts[0] == "launchers" and "launchers" in names):
            return level
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_layers_only_import_downwards() -> None:
    files = [p for p in (ROOT / "pipeline").rglob("*.py")] + list((ROOT / "launchers").rglob("*.py"))
    for path in files:
        module = _module_name(path)
        own = _layer(module)
        assert own is not None, f"{module} belongs to no layer: add it to LAYERS in tests/test_structure.py"
        for imported in _imports(path):  # TYPE_CHECKING imports count: they are dependencies too
            other = _layer(imported)
            assert other is None or other <= own, f"{module} (layer {own}) imports {imported} (layer {other})"


def test_each_package_is_one_layer() -> None:
    """LAYERS names packages (and the top-level modules), never a module inside a package: a package's modules all
    sit on its layer, so the test needs no per-module exception."""
    names = [name for layer in LAYERS for name in layer]
    assert len(names) == len(set(names)), names
    assert all(name == "launchers" or name.count(".") <= 1 for name in names), names
    packages = {f"pipeline.{p.name}" for p in (ROOT / "pipeline").iterdir() if (p / "__init__.py").is_file()}
    assert packages <= set(names), f"packages in no layer: {sorted(packages - set(names))}"


def test_pipeline_top_level_is_only_the_entry_point() -> None:
    loose = sorted(p.name for p in (ROOT / "pipeline").glob("*.py"))
    entry_points = ["cli.py", "commit.py", "consolidate.py", "export.py", "status.py"]
    assert loose == sorted(["__init__.py", "__main__.py", "errors.py", *entry_points]), loose


def test_stages_do_not_import_each_other() -> None:
    """No exception: what train and shard-save share is the stage kit's (``pipeline/stagekit/saving.py``)."""
    for path in (ROOT / "pipeline" / "stages").glob("*.py"):
        if path.name == "__init__.py":
            continue
        for mod in _imports(path):
            if mod.startswith("pipeline.stages."):
                other = mod.split(".")[2]
                raise AssertionError(f"{path.name} imports stage {other}: share it through pipeline/stagekit")


MAX_MODULE_LINES = 400
"""Modules a newcomer reads in one sitting (STYLE.md: modules under ~400 lines)."""


def test_modules_stay_under_the_size_a_newcomer_reads() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for top in ("pipeline", "launchers")
        for p in (ROOT / top).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"over {MAX_MODULE_LINES} lines (split along a real seam): {long}"


def test_stage_code_never_imports_submitit() -> None:
    for path in (ROOT / "pipeline").rglob("*.py"):
        assert not any(m.split(".")[0] == "submitit" for m in _imports(path)), path


def test_only_atomic_module_renames_or_deletes() -> None:
    forbidden = ("os.rename", "os.replace", "shutil.rmtree", "shutil.move", ".unlink(", "os.remove", "shutil.copytree")
    for path in list((ROOT / "pipeline").rglob("*.py")) + list((ROOT / "launchers").rglob("*.py")):
        if path.name == "atomic.py":
            continue
        text = path.read_text()
        hits = [f for f in forbidden if f in text]
        assert not hits, f"{path.relative_to(ROOT)} uses {hits}: publish and delete through pipeline/storage/atomic.py"


def test_every_stage_declares_a_contract() -> None:
    for name in ORDER:
        module = get_stage(name)
        contract = module.CONTRACT
        assert contract.name == name and contract.produces and contract.marker and module.__doc__
        assert all(n in ORDER for n in contract.needs)


def test_status_names_the_optional_stages_as_their_contracts_do() -> None:
    """``python -m pipeline.status`` reads which stages are optional from the contract module, not from the stage
    modules (which import the app's config and Hydra)."""
    assert {name for name in ORDER if get_stage(name).CONTRACT.optional} == OPTIONAL


LIBRARY = ("pipeline.checkpoint", "pipeline.storage", "pipeline.formats", "pipeline.errors")
"""The checkpoint library: what a torchrun script imports. It knows nothing of the app."""
APP_OR_FRAMEWORK = (
    "pipeline.config",
    "pipeline.rundir",
    "pipeline.stagekit",
    "pipeline.driver",
    "pipeline.stages",
    "pipeline.workload",
    "pipeline.strategies",
    "pipeline.cli",
    "launchers",
    "hydra",
    "omegaconf",
    "submitit",
)


def _all_imports(path: Path) -> set[str]:
    """Every import of a module: top level, ``TYPE_CHECKING`` blocks and inside functions alike."""
    return _imports(path, runtime_only=False)


def test_library_imports_nothing_from_the_app_hydra_or_submitit() -> None:
    files = [p for p in (ROOT / "pipeline").rglob("*.py") if _module_name(p).startswith(LIBRARY)]
    assert len(files) > 20, "the library's modules were not found"
    for path in files:
        bad = sorted(m for m in _all_imports(path) if any(m == a or m.startswith(a + ".") for a in APP_OR_FRAMEWORK))
        assert not bad, f"{_module_name(path)} (library) imports {bad}"


def test_library_knows_no_run_layout() -> None:
    """The run dir (``run.yaml``, lease, stage records, assets) is the app's: the library names only the checkpoint
    protocol's paths (:class:`~pipeline.storage.layout.CheckpointLayout`), and no library module names
    :class:`~pipeline.rundir.layout.RunLayout` or ``run.yaml``."""
    import pipeline.storage.layout as checkpoint_layout  # noqa: PLC0415

    assert not hasattr(checkpoint_layout, "RunLayout") and not hasattr(checkpoint_layout, "RUN_YAML")
    for path in (p for p in (ROOT / "pipeline").rglob("*.py") if _module_name(p).startswith(LIBRARY)):
        names = {m.rsplit(".", 1)[-1] for m in _all_imports(path)}
        assert not names & {"RunLayout", "RUN_YAML"}, f"{_module_name(path)} (library) imports the app's run layout"


def test_library_runtime_loads_no_app_module() -> None:
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = (
        "import sys\n"
        "from pipeline.checkpoint import Checkpointer, Committer, RankRNG\n"
        "import pipeline.commit, pipeline.consolidate, pipeline.export\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({APP_OR_FRAMEWORK!r}))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


TOOLS = ("status", "commit", "consolidate", "export")
"""The command lines ``python -m pipeline.<tool>``: they read a checkpoint or run dir without the app."""
NOT_IN_TOOLS = ("hydra", "omegaconf", "submitit", "pipeline.config", "pipeline.stages", "pipeline.driver.runner")
"""What no tool loads: the app's config composition, the stage modules, the runner, Hydra and submitit."""


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_loads_no_hydra_submitit_or_app_module(tool: str) -> None:
    """``python -m pipeline.<tool> --help`` (the module imported and its entry point run, as ``-m`` does) loads
    none of :data:`NOT_IN_TOOLS`."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['pipeline.{tool}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('pipeline.{tool}', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        f"print(sorted(m for m in sys.modules if m.startswith({NOT_IN_TOOLS!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[]", out.stdout.splitlines()[-1]


def test_the_driver_help_and_the_plan_load_no_torch() -> None:
    """``python -m pipeline --help`` and a dry run (the driver: compose, plan, every stage's contract and checks)
    load neither ``torch`` nor ``transformers``: they cost a second, not the 5-8 s of CPU those imports take.
    The stage jobs import them in ``run``."""
    heavy = ("torch", "transformers", "deepspeed")
    code = (
        "import runpy, sys\n"
        "sys.argv = ['pipeline', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_module('pipeline', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))\n"
    )
    for args in (["--help"], ["+experiment=tiny", "run.root=/nonexistent-never-made", "dry_run=true"]):
        out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines()[-1] == "[]", (args, out.stdout.splitlines()[-1])


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help_describes_it_in_full(tool: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--help``'s description is the module docstring's whole text (after its usage line), ending with a full
    stop: never its first line cut mid-sentence."""
    module = importlib.import_module(f"pipeline.{tool}")
    assert module.main(["--help"]) == 0
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert description.endswith("."), description
    body = " ".join(module.__doc__.split("\n\n", 1)[1].split()).replace("``", "")
    assert description == body and body.count(". ") >= 2, description


def _import_graph() -> dict[str, set[str]]:
    files = list((ROOT / "pipeline").rglob("*.py")) + list((ROOT / "launchers").rglob("*.py"))
    modules = {_module_name(p): p for p in files}
    return {m: {d for d in _all_imports(p) if d in modules and d != m} for m, p in modules.items()}


def test_no_import_cycles_including_type_checking_and_function_imports() -> None:
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


def test_every_package_ships_in_the_wheel() -> None:
    """``pyproject.toml`` lists packages by name: a new subpackage missing there installs broken (a wheel)."""
    import tomllib  # noqa: PLC0415

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("pipeline", "launchers")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
