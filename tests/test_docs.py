"""The documentation runs as written and is reachable: every fenced code block of the library and app pages is
either run here (only commands that start no stage and create nothing) or names, next to it, the existing test
that runs it; the README stays a short front page whose links all resolve. ``scripts/test.sh`` also builds the
site with ``mkdocs build --strict`` (broken links, anchors and missing pages)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
PAGES = ["library.md", "app.md"]  # the pages a new user runs from
README_MAX_LINES = 250
_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
# Run here: they compose and print, and start no stage (dry_run=true plans only; --cfg job and --help print).
_CHEAP = re.compile(r"^python -m pipeline(\.\w+)? .*(--help|--cfg job|dry_run=true)\b")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _paragraph(lines: list[str], start: int, step: int) -> str:
    """The paragraph next to a fence: from line ``start`` (or the line after it, in direction ``step``, when it is
    blank) on, up to the next blank line."""
    out: list[str] = []
    i = start if 0 <= start < len(lines) and lines[start].strip() else start + step
    while 0 <= i < len(lines) and lines[i].strip():
        out.append(lines[i])
        i += step
    return " ".join(out)


def _blocks(page: str) -> list[tuple[int, list[str], str]]:
    """Each fenced block of a page: (line number, its lines, the paragraphs just before and just after it)."""
    lines = (DOCS / page).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            around = _paragraph(lines, i - 1, -1) + " " + _paragraph(lines, end + 1, 1)
            blocks.append((i + 1, lines[i + 1 : end], around))
            i = end
        i += 1
    return blocks


def _commands(block: list[str]) -> list[str]:
    """A shell block's command lines, comments dropped."""
    return [ln.split("  #", 1)[0].strip() for ln in block if ln.strip() and not ln.lstrip().startswith("#")]


def _cheap_commands() -> list[str]:
    return [
        cmd
        for page in PAGES
        for _, block, around in _blocks(page)
        if "Tested by" not in around
        for cmd in _commands(block)
    ]


@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_is_run_here_or_names_the_test_that_runs_it(page: str) -> None:
    blocks = _blocks(page)
    assert blocks, f"docs/{page} has no code block"
    for line, block, around in blocks:
        if "Tested by" in around:
            refs = _TEST_REF.findall(around)
            assert refs, f"docs/{page}:{line}: 'Tested by' names no `tests/<file>.py::<test>`"
            for path, name in refs:
                source = ROOT / path
                assert source.is_file(), f"docs/{page}:{line}: {path} does not exist"
                assert re.search(rf"^def {name}\(", source.read_text(), re.M), f"docs/{page}:{line}: no {path}::{name}"
        else:
            commands = _commands(block)
            assert commands and all(_CHEAP.match(c) for c in commands), (
                f"docs/{page}:{line}: a block this test does not run must be next to a line "
                f"'Tested by `tests/<file>.py::<test>`' naming the test that runs it: {commands}"
            )


@pytest.mark.parametrize("command", _cheap_commands())
def test_the_pages_commands_run_as_written_and_create_nothing(command: str, tmp_path: Path) -> None:
    argv = shlex.split(command)
    assert argv[0] == "python"
    proc = subprocess.run(
        [sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), f"{command} printed nothing"
    assert not list(tmp_path.iterdir()), f"{command} created {sorted(p.name for p in tmp_path.iterdir())}"


def test_the_app_page_has_commands_this_test_runs() -> None:
    assert any("dry_run=true" in c for c in _cheap_commands()) and any("--help" in c for c in _cheap_commands())


def test_readme_is_a_short_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    text = "\n".join(lines)
    assert "bash scripts/setup.sh && .venv/bin/python -m pipeline +experiment=tiny\nbash scripts/test.sh\n" in text


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_every_relative_link_in_the_readme_points_to_a_file_and_anchor_that_exist() -> None:
    links = [
        link
        for link in _LINK.findall((ROOT / "README.md").read_text())
        if not link.startswith(("http://", "https://", "mailto:"))
    ]
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {link}: no such file"
        if anchor and target.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md links to {link}: no such heading"
    assert {f"docs/{p.name}" for p in DOCS.glob("*.md")} <= {link.partition("#")[0] for link in links}
