"""MkDocs hook: show the docstrings' Sphinx roles as code.

The docstrings use reST roles (``:class:`~pipeline.Pipeline```) that Python tools and IDEs
read; mkdocstrings renders Markdown, where a role stays literal text (``:class:`` before the
code span). This drops the role and, for ``~a.b.C``, keeps the last name, as Sphinx shows it.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const|type):"
                   r"<code>(~?)([^<]*)</code>")


def _shown(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_shown, html)
