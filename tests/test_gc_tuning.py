"""GC tuning happens only at the sync entry point, is restored after, and can be switched off;
the library itself never touches a host's collector settings."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest
import structlog

from pipeline import BuildPrompt, Pipeline, asyncio_run
from pipeline.testing import ByteTokenizer


@pytest.fixture(autouse=True)
def nothing_frozen() -> Iterator[None]:
    """These tests read the freeze count: each starts from a collector with nothing frozen
    (the suite freezes each worker's heap between modules, tests/conftest.py)."""
    gc.unfreeze()
    yield
    gc.freeze()


async def observe() -> tuple[tuple[int, int, int], int]:
    return gc.get_threshold(), gc.get_freeze_count()


def test_asyncio_run_tunes_the_collector_and_restores_it():
    before = gc.get_threshold()
    threshold, frozen = asyncio_run(observe(), watchdog=False, dump_signal=None)
    assert threshold[0] == 50_000 and threshold[1:] == before[1:]
    assert frozen > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_gc_tuning_can_be_switched_off(how, monkeypatch):
    before = gc.get_threshold()
    if how == "environment":
        monkeypatch.setenv("ROLLOUT_GC_TUNING", "0")
        threshold, frozen = asyncio_run(observe(), watchdog=False, dump_signal=None)
    else:
        threshold, frozen = asyncio_run(observe(), watchdog=False, dump_signal=None,
                                        gc_tuning=False)
    assert threshold == before and frozen == 0


def test_the_library_never_changes_the_collector():
    before = gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()
    pipe = Pipeline([BuildPrompt()], tokenizer=ByteTokenizer())
    asyncio.run(pipe.run_batch([{"prompt": "hi"}], n=4))
    assert (gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()) == before


@pytest.mark.parametrize("tuned", [True, False])
def test_the_cli_freezes_the_engine_it_built(tuned, monkeypatch, tmp_path):
    from pipeline import cli

    if not tuned:
        monkeypatch.setenv("ROLLOUT_GC_TUNING", "0")
    real_build = cli._build_engine
    seen: dict[str, int] = {}
    start_up: list[list[int]] = []

    async def build(*args):  # (args, scenario, console)
        built = await real_build(*args)
        start_up.extend([] for _ in range(20_000))  # an engine's start-up objects (tracked)
        seen["built"] = gc.get_freeze_count()
        return built

    class Watched(cli.Pipeline):
        def __init__(self, *args, **kwargs):
            seen["running"] = gc.get_freeze_count()
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cli, "_build_engine", build)
    monkeypatch.setattr(cli, "Pipeline", Watched)
    try:
        assert cli.main(["run", "arith", "--engine", "simulated", "--rows", "2", "--n", "1",
                         "--out", str(tmp_path / "t.jsonl")]) == 0
    finally:
        structlog.reset_defaults()  # the CLI configured logging for the whole process
    if tuned:
        assert seen["running"] >= seen["built"] + 20_000
    else:
        assert seen["running"] == seen["built"] == 0
    assert gc.get_freeze_count() == 0  # unfrozen on exit


def test_a_hosts_own_frozen_objects_stay_frozen():
    """A host that froze its start-up heap (vLLM's server does) keeps it frozen: CPython can
    only unfreeze everything at once, so ``asyncio_run`` leaves the frozen set alone on exit
    and restores only the thresholds."""
    before_threshold = gc.get_threshold()
    startup_heap = [[] for _ in range(3)]  # the host's, alive throughout
    gc.freeze()
    try:
        host_frozen = gc.get_freeze_count()
        threshold, frozen = asyncio_run(observe(), watchdog=False, dump_signal=None)
        assert threshold[0] == 50_000 and frozen > 0
        assert gc.get_threshold() == before_threshold
        # frozen objects are outside every generation gc.get_objects() lists
        tracked = {id(obj) for obj in gc.get_objects()}
        assert not {id(part) for part in startup_heap} & tracked
        assert gc.get_freeze_count() > host_frozen // 2
    finally:
        gc.unfreeze()
