"""How the suite runs in parallel (pytest-xdist, ``--dist loadgroup`` in pyproject.toml).

Each xdist worker is its own process; a *group* (``xdist_group`` mark) runs whole on one worker.

- ``xdist_group("vllm")``: modules that start a vLLM engine (in-process or a server). vLLM's
  CPU build computes on one core and reserves the other, so two engines at once oversubscribe
  the machine: they must never overlap, and one group serialises them.
- ``xdist_group("ray")``: modules (and the docs examples that mention Ray) that start a local
  Ray cluster (``num_cpus=2``): one cluster at a time.
- Every other module that has a module-scoped fixture becomes a group of its own here, so its
  fixture (a batch run, a loaded model) is built once, not once per worker.
- The rest is spread test by test.

The longest groups are handed out first (``--no-loadscope-reorder`` keeps the order this hook
gives): vLLM, then Ray, then the tests marked ``slow``, then the rest in file order.
"""

from __future__ import annotations

from typing import Any

import pytest

GROUP_ORDER = {"vllm": 0, "ray": 1}


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def _has_module_fixture(item: pytest.Item) -> bool:
    info: Any = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Any:
    for item in items:
        if _group(item) is None and _has_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__
                                                    if item.module else item.nodeid))

    def rank(indexed: tuple[int, pytest.Item]) -> tuple[int, int]:
        index, item = indexed
        group = _group(item)
        if group in GROUP_ORDER:
            return GROUP_ORDER[group], index
        if item.get_closest_marker("slow") is not None:
            return len(GROUP_ORDER), index
        return len(GROUP_ORDER) + 1, index

    # Only the order between groups matters to the scheduler; a stable sort keeps each module's
    # own order (module-scoped fixtures and loops see their tests in file order).
    items[:] = [item for _, item in sorted(enumerate(items), key=rank)]
    result = yield  # xdist's own hook (on a worker, with loadgroup) tags the grouped node ids
    if getattr(config.option, "loadgroup", False):  # set on xdist workers only
        for item in items:
            _tag_nodeid(item)
    return result


def _tag_nodeid(item: pytest.Item) -> None:
    """Give a grouped test the ``@group`` node-id suffix the loadgroup scheduler groups by.

    xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2's structured node ids no longer
    read: the marks are then silently ignored and every test is spread on its own
    (pytest-dev/pytest-xdist#1386). Done here only where xdist's own tagging did not take.
    """
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    if not names:
        return
    tagged = f"{item.nodeid}@{'_'.join(names)}"
    if item.nodeid.endswith(f"@{'_'.join(names)}") or not hasattr(item, "_id"):
        return
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(tagged)
