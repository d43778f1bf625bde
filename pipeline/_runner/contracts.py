"""Stage contracts: the artifacts a stage needs before it runs and those it writes, checked
along the stage list when a :class:`~pipeline.Pipeline` is built, so a chain that cannot work
(``[Generate()]`` without ``BuildPrompt``) fails at once with the artifact, the stage that
needs it and the stage that provides it, instead of every sample failing with ``KeyError``.

A stage may declare (all built-ins do; custom stages may):

- ``requires``: the artifact keys it reads, as a set, or as a mapping key -> the name of the
  stage that provides it (the hint of the error message);
- ``provides``: the artifact keys it writes (a set).

A stage that declares no ``provides`` may write anything: after it nothing is checked (the
chain cannot know). Containers (``Loop``, ``Route``) check their bodies themselves through
``check_contract(available) -> provides | None``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pipeline._exceptions import StageDefinitionError

Available = frozenset[str]


def check_chain(stages: Iterable[Any], available: Available = frozenset(),
                where: str = "") -> Available | None:
    """Check ``stages`` in order against what earlier stages provide.

    Args:
        stages: the stage list (already validated as stages).
        available: artifacts written before the list runs.
        where: names the list in errors (``" in Loop 'loop'"``).

    Returns:
        What is available after the list, or None once a stage that declares nothing ran
        (anything may be there).

    Raises:
        StageDefinitionError: a stage needs an artifact no earlier stage provides; names the
            artifact, the stage, and the stage that provides it.
    """
    have: Available | None = available
    for stage in stages:
        if have is None:
            return None
        check = getattr(stage, "check_contract", None)
        if callable(check):
            have = check(have)
            continue
        requires = getattr(stage, "requires", None)
        for key in _keys(requires):
            if key not in have:
                provider = requires.get(key) if isinstance(requires, Mapping) else None
                hint = (f"; {provider} provides it: put {provider}() before it" if provider
                        else "; put a stage that writes it before it")
                raise StageDefinitionError(
                    f"stage '{stage.name}'{where} needs the artifact '{key}', which no stage "
                    f"before it provides{hint}")
        provides = getattr(stage, "provides", None)
        have = None if provides is None else have | frozenset(_keys(provides))
    return have


def _keys(declared: object) -> list[str]:
    if declared is None:
        return []
    if isinstance(declared, str) or not isinstance(declared, Iterable):
        raise StageDefinitionError(f"a stage's requires/provides must be a set of artifact "
                                   f"names (or a mapping name -> provider), got {declared!r:.60}")
    return list(declared)
