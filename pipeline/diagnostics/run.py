"""``asyncio_run``: the library's one sync entry point."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

T = TypeVar("T")
_logger = structlog.get_logger("pipeline")


def asyncio_run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a new event loop (uvloop when installed).

    Tasks still running when ``main`` returns are reported (a leak: something started a task
    nobody owns), then cancelled by ``asyncio.Runner`` as usual.
    """
    loop_factory = None
    if use_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass

    async def wrapper() -> T:
        result = await main
        me = asyncio.current_task()
        leaked = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if leaked:
            _logger.warning("tasks_left_running", count=len(leaked),
                            tasks=[t.get_name() for t in leaked[:20]])
        return result

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(wrapper())
