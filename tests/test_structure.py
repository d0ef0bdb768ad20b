"""Structure rules that keep ownership clear: stages do not import each other; only atomic.py renames/deletes."""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.stages import ORDER, get_stage

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_stages_do_not_import_each_other() -> None:
    allowed = {("train", "shard_save")}  # train calls shard-save's save function: the one natural exception
    for path in (ROOT / "pipeline" / "stages").glob("*.py"):
        if path.name == "__init__.py":
            continue
        for mod in _imports(path):
            if mod.startswith("pipeline.stages."):
                other = mod.split(".")[2]
                assert (path.stem, other) in allowed, f"{path.name} imports stage {other}"


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
        assert not hits, f"{path.relative_to(ROOT)} uses {hits}: publish and delete through pipeline/atomic.py"


def test_every_stage_declares_a_contract() -> None:
    for name in ORDER:
        module = get_stage(name)
        contract = module.CONTRACT
        assert contract.name == name and contract.produces and contract.marker and module.__doc__
        assert all(n in ORDER for n in contract.needs)
