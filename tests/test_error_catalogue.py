"""The error catalogue (docs/status-and-errors.md) stays true: every row's message fragment occurs in the
pipeline's code and in the test named for it (which triggers the error and checks its message), and every error
class is listed."""

from __future__ import annotations

import ast
import re

import pytest

from pipeline import errors
from tests.conftest import ROOT

CATALOGUE = ROOT / "docs" / "status-and-errors.md"  # the page that owns the catalogue
_ROW = re.compile(r"^\| `(?P<fragment>[^`]+)` \| (?P<exit>\d) \| .* \| `(?P<test>tests/[\w/]+\.py::\w+)` \|$")


def _rows() -> list[re.Match[str]]:
    text = CATALOGUE.read_text()
    section = text.split("## Error catalogue", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| `")]
    rows = [_ROW.match(ln) for ln in lines]
    assert all(rows), [ln for ln, m in zip(lines, rows, strict=True) if m is None]
    return [m for m in rows if m is not None]


def _code() -> str:
    files = [*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "launchers").rglob("*.py")]
    return "\n".join(p.read_text() for p in files)


def _test_source(ref: str) -> str:
    path, name = ref.split("::")
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            src = ast.get_source_segment((ROOT / path).read_text(), node) or ""
            decorators = "\n".join(
                ast.get_source_segment((ROOT / path).read_text(), d) or "" for d in node.decorator_list
            )
            return decorators + src
    raise AssertionError(f"{ref}: no such test")


def _plain(text: str) -> str:
    """Source text with regex escapes and string-literal line joins removed, for a plain substring search."""
    return re.sub(r'"\s*\n\s*f?"', "", text).replace("\\", "")


@pytest.mark.parametrize("row", _rows(), ids=lambda m: m["fragment"][:40])
def test_catalogue_row_is_raised_by_the_code_and_checked_by_its_test(row: re.Match[str]) -> None:
    fragment = row["fragment"]
    assert fragment in _plain(_code()), f"{fragment!r} occurs in no message of pipeline/ or launchers/"
    assert fragment in _plain(_test_source(row["test"])), f"{row['test']} does not check {fragment!r}"


def test_exit_codes_in_the_catalogue_are_the_classes_exit_codes() -> None:
    assert {m["exit"] for m in _rows()} == {"1", "2"}
    assert errors.ConfigError.exit_code == 2 and errors.StageFailedError.exit_code == 1
    assert CATALOGUE.exists()
