"""Child process for the diagnostics tests: a pipeline whose samples get stuck.

Usage: ``python tests/diag_child.py MODE [--loop asyncio|uvloop] [--samples N]``

Every mode starts a pipeline of ``N`` samples whose stage ``wait_forever`` awaits an
``asyncio.Event`` that is never set, under ``pipeline.asyncio_run`` (so the task dumper is
installed on SIGUSR1). Once every sample is stuck it writes ``ready-<pid>`` into
``$DIAG_READY_DIR`` (default ``$ROLLOUT_DUMP_DIR``) and then, by mode:

- ``idle``: the event loop idles (waits in epoll);
- ``sleep``: the loop thread blocks in ``time.sleep`` inside ``block_in_sleep``;
- ``spin``: the loop thread spins in pure Python inside ``busy_spin``;
- ``lock``: the loop thread blocks on a held ``threading.Lock`` inside ``wait_on_lock``;
- ``cgil``: the loop thread runs one long C call holding the GIL inside ``hold_gil_in_c``;
- ``thread``: like ``idle``, but the loop runs in a non-main thread (no signal handler:
  dumps come through the dump socket);
- ``hardlimit``: the loop blocks in ``block_in_sleep`` under a watchdog with a 1 s hard
  limit, which writes a dump and exits the process with status 70.
- ``limits``: no stuck samples and no ready file; under ``Watchdog(**json(--watchdog))`` one
  healthy sample sleeps ``--slow`` seconds (a stall, not a block), then the loop thread
  blocks for each of ``--blocks`` seconds in turn; it prints ``phase_done <name>`` after
  each phase and exits 0 if the watchdog let it live.

The parent always kills this process; every wait here is bounded anyway (60 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from pathlib import Path

from pipeline import BuildPrompt, Pipeline, asyncio_run
from pipeline.diagnostics import Watchdog
from pipeline.testing import ByteTokenizer, SimulatedEngine

LIMIT_S = 60.0


class WaitForever:
    """A stage stuck on an Event nobody sets."""

    name = "wait_forever"

    def __init__(self) -> None:
        self.never_set: asyncio.Event | None = None

    async def run(self, item, ctx) -> None:  # type: ignore[no-untyped-def]
        if self.never_set is None:
            self.never_set = asyncio.Event()
        await self.never_set.wait()


def block_in_sleep() -> None:
    time.sleep(LIMIT_S)


def busy_spin() -> int:
    end = time.monotonic() + LIMIT_S
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


def hold_gil_in_c() -> int:
    return sum(range(10**12))  # one C call: no bytecode boundary, so no Python handler runs


def wait_on_lock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire(timeout=LIMIT_S)


async def main(mode: str, samples: int) -> None:
    pipeline = Pipeline([BuildPrompt(offload=False), WaitForever()],
                        engine=SimulatedEngine(), tokenizer=ByteTokenizer(),
                        sample_timeout_s=LIMIT_S * 2)
    rows = [{"prompt": f"question {i}"} for i in range(samples)]
    batch = asyncio.create_task(pipeline.run_batch(rows, n=1), name="run-batch")
    for _ in range(1000):
        if len(pipeline.inflight()) == samples and all(
                s.stage == "wait_forever" for s in pipeline.inflight()):
            break
        await asyncio.sleep(0.01)
    ready_dir = os.environ.get("DIAG_READY_DIR") or os.environ["ROLLOUT_DUMP_DIR"]
    ready = Path(ready_dir) / f"ready-{os.getpid()}"
    ready.write_text(" ".join(s.uid for s in pipeline.inflight()))
    if mode in ("sleep", "hardlimit"):
        block_in_sleep()
    elif mode == "spin":
        busy_spin()
    elif mode == "lock":
        wait_on_lock()
    elif mode == "cgil":
        hold_gil_in_c()
    else:
        await asyncio.sleep(LIMIT_S)
    batch.cancel()


class SleepStage:
    """A healthy but slow stage: awaits (the loop stays free) for ``seconds``."""

    name = "slow_stage"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def run(self, item, ctx) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.seconds)


def phase_done(name: str) -> None:
    print(f"phase_done {name}", flush=True)


async def limits(slow: float, blocks: list[float]) -> None:
    pipeline = Pipeline([BuildPrompt(offload=False), SleepStage(slow)],
                        engine=SimulatedEngine(), tokenizer=ByteTokenizer())
    [sample] = (await pipeline.run_batch([{"prompt": "slow"}], n=1)).samples
    assert sample.status == "completed", sample
    phase_done("slow")
    for seconds in blocks:
        time.sleep(seconds)  # noqa: ASYNC251  (the point: block the loop thread)
        await asyncio.sleep(0.1)  # let the heartbeat through
        phase_done(f"block {seconds:g}")


def run(args: argparse.Namespace) -> None:
    watchdog: Watchdog | bool = False
    if args.mode == "hardlimit":
        watchdog = Watchdog(0.2, hard_limit_s=1.0)
    if args.mode == "limits":
        blocks = [float(b) for b in args.blocks.split(",") if b]
        asyncio_run(limits(args.slow, blocks), watchdog=Watchdog(**json.loads(args.watchdog)))
        return
    asyncio_run(main(args.mode, args.samples), use_uvloop=args.loop == "uvloop",
                watchdog=watchdog)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["idle", "sleep", "spin", "lock", "cgil", "thread",
                                         "hardlimit", "limits"])
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--watchdog", default="{}", help="Watchdog keywords as JSON (limits)")
    parser.add_argument("--slow", type=float, default=0.0, help="the slow sample's seconds")
    parser.add_argument("--blocks", default="", help="comma-separated block seconds")
    parsed = parser.parse_args()
    if parsed.mode == "thread":
        worker = threading.Thread(target=run, args=(parsed,), name="rollout-worker")
        worker.start()
        worker.join(LIMIT_S * 2)
    else:
        run(parsed)
