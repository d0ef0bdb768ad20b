"""MkDocs hooks (mkdocs.yml `hooks:`): the library's docstrings use Sphinx cross-reference roles
(:meth:`save`, :class:`Checkpointer`, :mod:`.manifest`), which the API reference would otherwise print literally;
keep the name, drop the role."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:meth|func|class|mod|attr|data|exc|obj|const):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub("", html)
