"""``FunctionJudger``: a synchronous reward function (verl's ``compute_score`` shape) as a judger.

The function is called as ``fn(data_source, solution_str, ground_truth, extra_info)`` and
returns a number or a dict with ``score`` (other keys become the payload), so a verl reward
function plugs in unchanged. By default it runs in a :class:`ProcessPool`: a slow function
never blocks the event loop and a hung one is killed at its timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pipeline._concurrency.callables import check_callable, plain_result
from pipeline._data.models import AgentRolloutItem
from pipeline.judgers._base import JudgeResult, response_text
from pipeline.judgers._pool import ProcessPool
from pipeline.judgers._registry import register_judger

RewardFunction = Callable[[str, str, Any, dict[str, Any]], Any]
"""``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``."""


@register_judger("function")
class FunctionJudger:
    """Runs a synchronous reward function on the final answer.

    Args:
        fn: ``fn(data_source, solution_str, ground_truth, extra_info)``, a plain function
            (an ``async def`` is refused: nothing would await it in a worker process); in
            ``"process"`` mode it must be an importable top-level function (it is pickled by
            reference). A value that is awaitable fails the judge call.
        name: the judger's name (default: the function's name).
        mode: ``"process"`` (default): run in a worker process, killed past ``timeout_s``;
            ``"inline"``: call it on the event loop (only for functions that take
            microseconds: nothing can interrupt it there).
        timeout_s: limit on one call's run time in its worker (waiting for a free worker is
            not counted; the ``Judge`` stage's own timeout bounds the whole judge call).
        pool: a shared pool (the caller closes it); default: the judger starts its own
            pool of ``pool_size`` workers, closed by :meth:`aclose`.
        pool_size: size of the judger's own pool.

    Raises:
        ConfigError: ``fn`` is not callable, is async or a generator function (``field="fn"``).
    """

    def __init__(self, fn: RewardFunction, *, name: str | None = None,
                 mode: Literal["process", "inline"] = "process", timeout_s: float | None = 10.0,
                 pool: ProcessPool | None = None, pool_size: int | None = None) -> None:
        check_callable(fn, "fn", "sync", owner="FunctionJudger",
                       shape="(data_source, solution_str, ground_truth, extra_info)")
        if mode not in ("process", "inline"):
            raise ValueError(f"mode must be 'process' or 'inline', got {mode!r}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "function")
        self.mode = mode
        self.timeout_s = timeout_s
        self._owns_pool = pool is None
        self._pool = pool
        self._pool_size = pool_size

    @property
    def pool(self) -> ProcessPool:
        """The pool calls run in (started on first use when the judger owns it)."""
        if self._pool is None:
            self._pool = ProcessPool(self._pool_size)
        return self._pool

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        """Call the function on ``item``'s answer; see the class doc.

        Raises:
            JudgerTimeout: the call ran past ``timeout_s`` (its worker was killed).
            WorkerError: the function raised in its worker or the worker died.
            JudgeError: the function returned something that is not a score.
            ContractError: the function returned an awaitable (inline mode; closed).
        """
        args = (item.data.data_source, response_text(item), item.data.ground_truth,
                dict(item.data.extra))
        if self.mode == "inline":
            value = plain_result(self.fn(*args), f"FunctionJudger {self.name!r}: fn")
        else:
            value = await self.pool.call(self.fn, *args, timeout_s=self.timeout_s)
        return JudgeResult.coerce(value)

    async def aclose(self) -> None:
        """Close the judger's own pool (a shared pool is left to its owner)."""
        if self._owns_pool and self._pool is not None:
            await self._pool.aclose()
