"""LIKE patterns from user text."""

from __future__ import annotations


def escape_like(text: str, escape: str = "\\") -> str:
    """``text`` with LIKE's wildcards (``%``, ``_``) and the escape character escaped, so that it
    matches itself (use with ``escape=`` the same character)."""
    return text.replace(escape, escape * 2).replace("%", escape + "%").replace("_", escape + "_")
