"""How the suite runs in parallel (pytest-xdist, ``--dist loadgroup`` in pyproject.toml).

Each xdist worker is its own process; a *group* (``xdist_group`` mark) runs whole on one worker.

- ``xdist_group("vllm")``: modules that start a vLLM engine (in-process or a server). vLLM's
  CPU build computes on one core and reserves the other, so two engines at once oversubscribe
  the machine: they must never overlap, and one group serialises them.
- ``xdist_group("ray")``: modules that use a local Ray cluster (``num_cpus=2``), all through
  the session fixture ``ray_cluster`` below (one cluster for them all, started once on the
  worker that runs the group), and the docs examples that mention Ray (their own cluster,
  in a subprocess).
- ``xdist_group("families")``: every test that uses the session fixture ``family_tokenizers``
  below (the model-family modules): each family's tokenizer (2-5 s to load, a 150-200k
  vocabulary) is loaded once per run, not once per module and worker.
- Every other module that has a module-scoped fixture becomes a group of its own here, so its
  fixture (a batch run, a loaded model) is built once, not once per worker.
- The rest is spread test by test.

The longest groups are handed out first (``--no-loadscope-reorder`` keeps the order this hook
gives): vLLM, then Ray, then the tests marked ``slow``, then the rest in file order.

Every process of the run computes on one thread (``OMP_NUM_THREADS=1``, set below unless the
environment already sets it; subprocesses inherit it): workers on two cores each running
torch with two OpenMP threads left the threads spin-waiting against each other (vLLM's own
serving code sets torch to one thread for the same reason; its CPU worker binds its threads
itself). Measured on this 2-core machine at load ~5: test_tiny_policy, test_family_engines
and two guide examples took 126 s and 80 CPU-s, 80 s and 61 CPU-s with one thread, with the
same results.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test module imports torch

GROUP_ORDER = {"vllm": 0, "ray": 1, "families": 2}


class _FamilyTokenizers(dict[str, Any]):
    """Family name -> its tokenizer, loaded at first use."""

    def __missing__(self, name: str) -> Any:
        from pipeline.families import family_tokenizer

        self[name] = tokenizer = family_tokenizer(name)
        return tokenizer


@pytest.fixture(scope="session")
def family_tokenizers() -> dict[str, Any]:
    """Each model family's tokenizer, shared by the ``families`` group (never modify one:
    copy it first)."""
    return _FamilyTokenizers()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """The local Ray cluster (127.0.0.1, ``num_cpus=2``) of the ``ray`` group's modules: one
    start (5-10 s) serves the whole group, which runs on one worker, module after module.
    Modules register what they pickle by value. A module that leaves actors holding CPUs gets
    the cluster shut down behind it (the next module starts a fresh one), and the cluster is
    shut down once the worker's next test is not in the group (see the hook below)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        os.environ["RAY_AUTH_MODE"] = "disabled"
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)
    yield ray
    if not _all_cpus_free(ray):
        _shutdown(ray)


def _shutdown(ray: Any, reap_s: float = 30.0) -> None:
    """``ray.shutdown()``, then reap the node's processes. Ray kills them but waits only 1 s
    for each to exit: on a loaded machine one can still be exiting, and its ``Popen`` then
    warns "subprocess ... is still running" when collected, inside whichever test runs next
    (``filterwarnings = error`` made that test fail in a CI run)."""
    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    processes = [info.process for infos in getattr(node, "all_processes", {}).values()
                 for info in infos]
    ray.shutdown()
    deadline = time.monotonic() + reap_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))


def _all_cpus_free(ray: Any, wait_s: float = 5.0) -> bool:
    """Whether every CPU of the cluster is free again (killed actors free theirs shortly)."""
    until = time.monotonic() + wait_s
    while True:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return True
        if time.monotonic() > until:
            return False
        time.sleep(0.1)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a module's last test on this worker (its fixtures torn down): shut the group's
    Ray cluster down once the group is done, so that it does not idle beside the tests that
    follow, and freeze what the module left alive (see :func:`_freeze_heap`)."""
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)() and (
            nextitem is None or _group(nextitem) != "ray"):
        _shutdown(ray)
    if nextitem is None or nextitem.module is not item.module:
        _freeze_heap()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze_heap()


def _freeze_heap() -> None:
    """Move what is alive now out of the collector's sight (``gc.freeze()``), garbage
    collected first.

    A worker holds about a million tracked objects once the test modules and what they import
    (torch, transformers, vLLM, ...) are loaded, and every full collection walked them all:
    0.5 s each, 120 of them in a run, 67 CPU-s (measured with ``gc.callbacks`` on both
    workers), beside the explicit ``gc.collect()`` of tests that check for leaks. Frozen at
    the start and after each module, a full pass walks only what the running module made.
    Objects a test creates are never frozen while it runs, so leak and cycle checks see them
    as before; tests that read the freeze count unfreeze first (tests/test_gc_tuning.py).
    """
    gc.collect()
    gc.freeze()


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
        if _group(item) is None and "family_tokenizers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("families"))
        elif _group(item) is None and _has_module_fixture(item):
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
