"""Tools with a per-trajectory resource (a sandbox, a browser, a database connection), and a
warm pool of pre-created resources for tools whose creation is slow.

verl's ``BaseTool`` has ``create / execute / calc_reward / release`` around one trajectory;
here a :class:`ResourceTool` takes ``create(item)``, ``call(resource, **arguments)`` and
``release(resource)`` (any object with the :class:`TrajectoryTool` methods works too). The
tool-calling stage creates the resource at the sample's first call of the tool, passes it to
every call of that sample, and releases it once when the sample ends (on every outcome:
completed, failed, timeout, aborted), through the sample's exit stack: shielded, bounded by
``cleanup_timeout_s``; a ``release`` that raises is logged and recorded as a failed cleanup,
never the sample's outcome. A call may return :class:`ToolResult` with a reward; the rewards of
a sample reach verl's ``tool_rewards`` column.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import structlog

from pipeline._exceptions import ConfigError
from pipeline.tools._registry import FAIRNESS_KEYS

_logger = structlog.get_logger("pipeline.tools")


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A tool's answer and the reward it earned (verl's ``execute`` returns both).

    Attributes:
        content: what the model sees (``str`` as is, anything else as JSON).
        reward: appended to the sample's ``tool_rewards`` (verl's column); None: no reward.
    """

    content: Any
    reward: float | None = None


@runtime_checkable
class TrajectoryTool(Protocol):
    """A tool that holds a resource for the length of one trajectory (see the module doc)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    timeout_s: float

    async def create_for(self, item: Any) -> tuple[Any, bool]:
        """Make the sample's resource; also says whether it came ready from a warm pool."""
        ...

    async def call_with(self, resource: Any, arguments: Mapping[str, Any]) -> Any:
        """Run one call on the sample's resource; may return :class:`ToolResult`."""
        ...

    async def release_resource(self, resource: Any) -> None:
        """Give the resource back; runs once per created resource."""
        ...


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What a :class:`WarmPool` did so far.

    Attributes:
        size: instances the pool keeps ready.
        idle: ready instances now.
        hits: acquisitions served by a ready instance.
        misses: acquisitions that created one cold (the pool was empty).
        wait_s: seconds acquisitions spent in all (health checks and cold creations).
        create_failures: creations that raised (in the background or cold).
        unhealthy: ready instances the health check refused (destroyed, not handed out).
    """

    size: int
    idle: int
    hits: int
    misses: int
    wait_s: float
    create_failures: int
    unhealthy: int

    def as_dict(self) -> dict[str, float]:
        """The fields as a flat dict (for ``extra_fields`` and dumps)."""
        return {name: getattr(self, name) for name in self.__slots__}


class WarmPool:
    """Up to ``size`` resources created ahead of use, handed out one per trajectory.

    A trajectory's resource is not reused after it (it may hold the trajectory's state): it is
    destroyed at release, and the pool creates a replacement in the background. An acquisition
    takes a ready instance after ``healthy(resource)`` passes; when none is ready it creates
    one itself (cold), so the pool never makes a sample wait for another sample. Background
    tasks are owned by the pool: ``aclose()`` (or ``async with``) cancels and awaits them and
    destroys the ready instances.

    Args:
        create: ``async () -> resource``.
        size: instances kept ready (>= 1).
        destroy: ``async (resource) -> None``; default: nothing.
        healthy: ``async (resource) -> bool``, checked before handing one out.
        max_idle_s: a ready instance older than this is destroyed, not handed out.
    """

    def __init__(self, create: Callable[[], Awaitable[Any]], *, size: int,
                 destroy: Callable[[Any], Awaitable[None]] | None = None,
                 healthy: Callable[[Any], Awaitable[bool]] | None = None,
                 max_idle_s: float | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"WarmPool: size must be an int >= 1, got {size!r}", field="size")
        self._create, self._destroy, self._healthy = create, destroy, healthy
        self.size, self.max_idle_s = size, max_idle_s
        self._ready: deque[tuple[float, Any]] = deque()
        self._filling: set[asyncio.Task[None]] = set()
        self._closed = False
        self._hits = self._misses = self._failures = self._unhealthy = 0
        self._wait_s = 0.0

    def stats(self) -> PoolStats:
        """Counters and the current number of ready instances."""
        return PoolStats(size=self.size, idle=len(self._ready), hits=self._hits,
                         misses=self._misses, wait_s=self._wait_s,
                         create_failures=self._failures, unhealthy=self._unhealthy)

    async def start(self) -> None:
        """Begin filling the pool (also done by the first :meth:`acquire`)."""
        self._refill()

    def _refill(self) -> None:
        if self._closed:
            return
        while len(self._ready) + len(self._filling) < self.size:
            task = asyncio.get_running_loop().create_task(self._fill_one())
            self._filling.add(task)
            task.add_done_callback(self._filling.discard)

    async def _fill_one(self) -> None:
        try:
            resource = await self._create()
        except Exception as exc:  # counted; the next release or acquisition tries again
            self._failures += 1
            _logger.warning("warm_pool_create_failed", error=f"{type(exc).__name__}: {exc}")
            return
        if self._closed:
            await self._discard(resource)
            return
        self._ready.append((time.monotonic(), resource))

    async def acquire(self) -> tuple[Any, bool]:
        """A resource for one trajectory and whether it came ready (warm).

        Raises:
            Exception: whatever a cold ``create`` raised (counted in ``create_failures``).
        """
        started = time.monotonic()
        try:
            self._refill()
            while self._ready:
                made, resource = self._ready.popleft()
                self._refill()
                too_old = self.max_idle_s is not None and started - made > self.max_idle_s
                if too_old or (self._healthy is not None and not await self._check(resource)):
                    self._unhealthy += 1
                    await self._discard(resource)
                    continue
                self._hits += 1
                return resource, True
            self._misses += 1
            try:
                return await self._create(), False
            except Exception:
                self._failures += 1
                raise
        finally:
            self._wait_s += time.monotonic() - started

    async def _check(self, resource: Any) -> bool:
        assert self._healthy is not None
        try:
            return bool(await self._healthy(resource))
        except Exception:  # a health check that raises says the instance is not healthy
            return False

    async def release(self, resource: Any) -> None:
        """Destroy a trajectory's resource (never reused) and top the pool up."""
        try:
            await self._discard(resource, raise_errors=True)
        finally:
            self._refill()

    async def _discard(self, resource: Any, *, raise_errors: bool = False) -> None:
        if self._destroy is None:
            return
        try:
            await self._destroy(resource)
        except Exception:
            if raise_errors:
                raise
            _logger.warning("warm_pool_destroy_failed", exc_info=True)

    async def aclose(self) -> None:
        """Stop filling, then destroy the ready instances."""
        self._closed = True
        for task in list(self._filling):
            task.cancel()
        for task in list(self._filling):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while self._ready:
            await self._discard(self._ready.popleft()[1])

    async def __aenter__(self) -> WarmPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass(frozen=True, kw_only=True)
class ResourceTool:
    """A tool whose calls share one resource per trajectory (see the module doc).

    Attributes:
        name: what the model calls it.
        description: shown to the model with the schema.
        parameters: JSON schema of the arguments object.
        create: ``async (item) -> resource``, run at the sample's first call of the tool
            (ignored when ``pool`` is given: the pool's ``create`` makes them).
        call: ``async (resource, **arguments)``; may return :class:`ToolResult`.
        release: ``async (resource) -> None``, once per resource on every outcome (with a
            pool: the pool's ``destroy``).
        pool: a :class:`WarmPool` the resources come from.
        timeout_s: one call's limit (creating the resource counts towards the first call).
        rate: sustained calls per second (None: unlimited), as ``FunctionTool``.
        burst: calls allowed at once above ``rate``.
        max_concurrency: calls running at once (None: unlimited).
        fairness_key: what the limit is shared fairly across, as ``FunctionTool``.
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}})
    call: Callable[..., Awaitable[Any]]
    create: Callable[[Any], Awaitable[Any]] | None = None
    release: Callable[[Any], Awaitable[None]] | None = None
    pool: WarmPool | None = None
    timeout_s: float = 10.0
    rate: float | None = None
    burst: int | None = None
    max_concurrency: int | None = None
    fairness_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"tool name must be a non-empty string, got {self.name!r}",
                              field="name")
        if (self.create is None) == (self.pool is None):
            raise ConfigError(f"tool {self.name!r}: give create (a resource per trajectory) "
                              "or pool (a WarmPool), exactly one", field="create")
        if self.pool is not None and self.release is not None:
            raise ConfigError(f"tool {self.name!r}: with a pool, the pool's destroy releases "
                              "resources; leave release out", field="release")
        if self.fairness_key not in FAIRNESS_KEYS:
            raise ConfigError(f"tool {self.name!r}: fairness_key must be one of "
                              f"{FAIRNESS_KEYS}, got {self.fairness_key!r}", field="fairness_key")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or (
                not self.timeout_s > 0):
            raise ConfigError(f"tool {self.name!r}: timeout_s must be a number > 0",
                              field="timeout_s")

    async def __call__(self, arguments: Mapping[str, Any]) -> Any:
        """A resource tool runs only inside a trajectory (through ``CallTools``)."""
        raise RuntimeError(f"tool {self.name!r} needs a per-trajectory resource: it runs "
                           "through CallTools, which creates and releases it")

    async def create_for(self, item: Any) -> tuple[Any, bool]:
        """The sample's resource and whether it came warm from the pool."""
        if self.pool is not None:
            return await self.pool.acquire()
        assert self.create is not None
        return await self.create(item), False

    async def release_resource(self, resource: Any) -> None:
        """Release (or, with a pool, destroy) one resource."""
        if self.pool is not None:
            await self.pool.release(resource)
        elif self.release is not None:
            await self.release(resource)

    async def call_with(self, resource: Any, arguments: Mapping[str, Any]) -> Any:
        """One call on the sample's resource."""
        return await self.call(resource, **arguments)
