"""Dump sections: state that lives elsewhere (the Ray workers of a driver's pool, say), added to
every dump this process writes by a provider registered with :func:`add_dump_section`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_sections: dict[str, Callable[[], tuple[str, Any]]] = {}


def add_dump_section(name: str, provider: Callable[[], tuple[str, Any]]) -> Callable[[], None]:
    """Add a section to every dump this process writes, for state that lives elsewhere (the
    Ray workers of a driver's ``RayRolloutPool``).

    ``provider()`` runs on the dumper's thread at each dump and returns ``(text, data)``:
    the text is appended to the text dump, the data (JSON-able) goes under
    ``"sections": {name: data}`` in the JSON dump. It must bound its own time; if it raises,
    the error is written in its place.

    Returns:
        A function that removes the section.
    """
    _sections[name] = provider

    def remove() -> None:
        if _sections.get(name) is provider:
            del _sections[name]

    return remove


def collect_sections() -> tuple[str, dict[str, Any]]:
    """Run every provider: the text to append to a text dump, and the data by section name
    (a provider that raised gives its error instead)."""
    texts: list[str] = []
    data: dict[str, Any] = {}
    for name, provider in list(_sections.items()):
        try:
            text, data[name] = provider()
        except Exception as exc:  # a section must never cost the dump
            text = f"(section failed: {type(exc).__name__}: {exc})"
            data[name] = {"error": text}
        texts.append(f"\n== {name} ==\n{text.rstrip()}\n")
    return "".join(texts), data
