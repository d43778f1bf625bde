"""GC tuning happens only at the sync entry point, is restored after, and can be switched off;
the library itself never touches a host's collector settings."""

from __future__ import annotations

import asyncio
import gc

import pytest

from pipeline import BuildPrompt, Pipeline, asyncio_run
from pipeline.testing import ByteTokenizer


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
